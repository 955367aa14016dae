"""Every way the benchmarks train a model, in one registry: our modes, PyTorch's and torchtune's.

Each entry of ``RECIPES`` is a :class:`Recipe`: a name, who provides it (``baseline``, ``ours``, ``peer``), one line
saying what it wraps (the legends print it), and how it applies to a model's layer stack (``model.layers``, or a Hugging
Face model's, through the model's own hooks; the ``func*`` and ``attn`` recipes need layers with ``.attn`` and
``.mlp``). The benchmarks pick rows by name (``MODE_RECIPES``, ``SWAP_WRAPPER_RECIPES``, ``PEER_VARIANTS``,
``OVERHEAD_VARIANTS``, ``MEMORY_VARIANTS``). The library is imported lazily.
"""

from __future__ import annotations

import collections
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

# One (batch 4, heads 4, 256 x 256) float32 attention matrix of the bench's default model: the
# attention's other saved tensors are at most 1 MiB. The bench derives it from its actual shape.
DEFAULT_SWAP_THRESHOLD_BYTES = 4 * 1024 * 1024
#: The matmul overloads the ``save`` / ``swap`` policies single out (a policy is called with an
#: ``OpOverload``; ``torch.matmul`` and ``nn.Linear`` decompose into these before dispatch).
MATMUL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default})


def _api():
    from hyper_parallel.core import activation_checkpoint  # (on first use: the baseline runs without the core)

    return activation_checkpoint


def save_matmuls(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy: keep matmul outputs (MUST_SAVE), recompute the rest (norms, GELU, softmax...).
    Usage: ``checkpoint_wrapper(layer, policy_fn=save_matmuls)``."""
    policy = _api().CheckpointPolicy
    return policy.MUST_SAVE if op in MATMUL_OPS else policy.MUST_RECOMPUTE


def swap_matmuls(ctx, op, *args, **kwargs):
    """Like :func:`save_matmuls` with the matmul outputs MUST_SWAP (offloaded in chained layers; unchained: saved).
    Usage: ``wrap_layers(model.layers, policy_fn=swap_matmuls, swap_inputs=True)``."""
    policy = _api().CheckpointPolicy
    return policy.MUST_SWAP if op in MATMUL_OPS else policy.MUST_RECOMPUTE


def swap_if_at_least(threshold_bytes: int) -> Callable:
    """A ``swap_wrapper`` policy: MUST_SWAP for tensors of at least ``threshold_bytes``, else MUST_SAVE (attention
    matrices to the host, small tensors kept). Usage: ``swap_wrapper(attn, policy_fn=swap_if_at_least(4 << 20))``."""
    threshold = int(threshold_bytes)
    if threshold < 0:
        raise ValueError(f"threshold_bytes must be >= 0, got {threshold_bytes}")

    def policy_fn(tensor):
        policy = _api().CheckpointPolicy
        return policy.MUST_SWAP if tensor.numel() * tensor.element_size() >= threshold else policy.MUST_SAVE

    policy_fn.threshold_bytes = threshold
    policy_fn.__name__ = f"swap_if_at_least_{threshold}"
    return policy_fn


def chain_layers(layers) -> None:
    """Declare the forward order of ``layers`` to the swap manager, for layers not wrapped themselves (``wrap_layers``
    chains the ones it wraps): each one's swapped tensors go when the next has run, return when it starts backward."""
    manager, layers = _api().SwapManager(), list(layers)
    for first, second in zip(layers, layers[1:]):
        manager.set_forward_prefetch_layer(first, second)


def layer_stack(model: nn.Module) -> nn.ModuleList:
    """``model.layers``, else the stack ``find_layer_stack`` finds (a Hugging Face model's)."""
    if isinstance(getattr(model, "layers", None), nn.ModuleList):
        return model.layers
    from hyper_parallel.integrations import find_layer_stack

    return find_layer_stack(model).layers


def _torch_policy(ctx, op, *args, **kwargs):
    policy = torch.utils.checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if op in MATMUL_OPS else policy.PREFER_RECOMPUTE


class HooksLayer(nn.Module):
    """A layer under PyTorch's non-reentrant checkpoint (``context_fn``: its selective one), or under the
    ``saved_tensors_hooks`` context ``hooks()`` makes, checkpointed too if ``checkpointed`` or given ``context_fn``."""

    def __init__(self, inner: nn.Module, hooks: Optional[Callable[[], Any]] = None,
                 checkpointed: bool = False, context_fn: Optional[Callable[[], Any]] = None) -> None:
        super().__init__()
        self.inner, self.hooks = inner, hooks
        self.checkpointed = checkpointed or context_fn is not None
        self.context_fn = context_fn or torch.utils.checkpoint.noop_context_fn

    def forward(self, *args, **kwargs):
        if self.hooks is None:  # (PyTorch's checkpoint alone: nothing around it that would cost the peer)
            return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, context_fn=self.context_fn,
                                                     **kwargs)
        with self.hooks():
            if self.checkpointed:
                return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False,
                                                         context_fn=self.context_fn, **kwargs)
            return self.inner(*args, **kwargs)


@dataclass
class ByteCounter:
    """Bytes a peer moved to the host (``d2h``) and back (``h2d``) and the tensors it copied out, counted by its hooks.
    While ``mark``, its host copies are marked as host memory for the CPU meter: in the metered step only (marking costs
    about 20 us a tensor: the meter's cost, not the peer's; the engine marks a pooled buffer once)."""

    d2h: int = 0
    h2d: int = 0
    tensors: int = 0
    mark: bool = False


def _host_copy(t: torch.Tensor, counter: ByteCounter) -> torch.Tensor:
    """A copy of ``t`` (``empty_like`` + ``copy_``, as ``tensor.cpu()`` makes one), counted out and, while
    ``counter.mark``, marked right after its allocation."""
    host = torch.empty_like(t)
    if counter.mark:
        from hyper_parallel.tools.memory import mark_host

        mark_host(host)
    host.copy_(t)
    counter.tensors += 1
    counter.d2h += host.numel() * host.element_size()
    return host


class CopyHooks(torch.autograd.graph.saved_tensors_hooks):
    """Copies every saved tensor out (parameters too, as ``save_on_cpu`` does) and back (a ``clone``, as ``.to(device)``
    makes a new device tensor): ``save_on_cpu``'s work, on a CPU too."""

    def __init__(self, counter: ByteCounter) -> None:
        def unpack(host: torch.Tensor) -> torch.Tensor:
            counter.h2d += host.numel() * host.element_size()
            return host.clone()

        super().__init__(functools.partial(_host_copy, counter=counter), unpack)


class _HostCopyEntries(dict):
    """One op's entries of PyTorch's selective-checkpoint cache, held as host copies: copied out when the forward stores
    an output, back when the recompute takes it."""

    def __init__(self, counter: ByteCounter) -> None:
        super().__init__()
        self._counter = counter

    def _map(self, entry: Any, out: bool) -> Any:
        from torch.utils._pytree import tree_map

        def copy_one(w: Any) -> Any:
            val = getattr(w, "val", None)
            if not isinstance(val, torch.Tensor) or not hasattr(w, "get_val"):
                return w  # a sentinel (recompute, consumed) or a non-tensor output
            if out:
                return type(w)(_host_copy(val, self._counter))
            self._counter.h2d += val.numel() * val.element_size()
            return type(w)(val.clone())

        return tree_map(copy_one, entry)

    def __setitem__(self, idx: Any, entry: Any) -> None:
        super().__setitem__(idx, self._map(entry, out=True))

    def get(self, idx: Any, default: Any = None) -> Any:
        entry = super().get(idx, default)
        return entry if entry is default else self._map(entry, out=False)


def sac_host_copy_contexts(policy_fn: Callable, counter: ByteCounter) -> Tuple[Any, Any]:
    """``create_selective_checkpoint_contexts(policy_fn)`` whose cache holds host copies, counted: what an offloading
    selective checkpoint does off-device (an outer ``save_on_cpu`` does not see these outputs: PyTorch keeps them in its
    cache, not as saved tensors). Relies on both contexts keeping the cache as ``.storage`` (PyTorch 2.4+)."""
    caching, cached = torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn)
    if not (hasattr(caching, "storage") and hasattr(cached, "storage")):
        raise RuntimeError(f"torch {torch.__version__}: the selective-checkpoint contexts keep no .storage; "
                           "the host-copying peer cannot be built")
    caching.storage = cached.storage = collections.defaultdict(lambda: _HostCopyEntries(counter))
    return caching, cached


def _counted(hooks: Any, counter: ByteCounter, on_cpu: bool) -> Any:
    """``save_on_cpu``'s hooks (packed: ``(device, host tensor)``) counting the bytes they move; on a CPU-only machine
    they model the traffic: the copy ``tensor.cpu()`` skips for a CPU tensor is made (and marked while
    ``counter.mark``), and a reload is a new tensor."""
    pack, unpack = hooks.pack_hook, hooks.unpack_hook

    def pack_hook(t: torch.Tensor) -> Any:
        dev, host = pack(t)
        if on_cpu:
            return dev, _host_copy(t, counter)
        counter.tensors += 1
        counter.d2h += host.numel() * host.element_size()
        return dev, host

    def unpack_hook(packed: Any) -> torch.Tensor:
        out = unpack(packed)
        counter.h2d += out.numel() * out.element_size()
        return out.clone() if on_cpu else out

    hooks.pack_hook, hooks.unpack_hook = pack_hook, unpack_hook
    return hooks


def _counted_torchtune(hooks: Any, counter: ByteCounter) -> Any:
    """torchtune's ``OffloadActivations`` counting the bytes it moves (it tracks what it offloaded)."""
    pack, unpack = hooks.pack_hook, hooks.unpack_hook

    def pack_hook(t: torch.Tensor) -> Any:
        tid = pack(t)
        entry = hooks.tracker.get(tid)
        if entry is not None and entry[1]:
            counter.tensors += 1
            counter.d2h += t.numel() * t.element_size()
        return tid

    def unpack_hook(tid: Any) -> torch.Tensor:
        entry = hooks.tracker.get(tid)
        if entry is not None and entry[1] and tid not in getattr(hooks, "fwd_stash", {}):
            counter.h2d += entry[0].numel() * entry[0].element_size()
        return unpack(tid)

    hooks.pack_hook, hooks.unpack_hook = pack_hook, unpack_hook
    return hooks


@dataclass(frozen=True)
class Recipe:
    """One way to train the model. ``apply(model, device, swap_threshold_bytes)`` wraps it in place and returns the
    :class:`ByteCounter` of a peer that moves bytes (ours are counted by ``SwapManager().stats()``), else ``None``;
    ``RuntimeError`` (the reason) when it cannot run here."""

    name: str
    who: str                         # "baseline", "ours" or "peer"
    what: str                        # one line: what it wraps and how
    apply: Callable[..., Optional[ByteCounter]]
    offloads: bool = False           # moves activations between device and host
    counterparts: Tuple[str, ...] = ()  # like-for-like peers (the same memory technique)


def _each_layer(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> None:
    stack = layer_stack(model)
    for i, layer in enumerate(stack):
        stack[i] = wrap(layer)


def _hugging_face(model: nn.Module) -> bool:
    return hasattr(model, "gradient_checkpointing_enable")


def _wrapped(chain: bool, **kwargs):  # every layer wrapped by wrap_layers (and chained)
    def apply(model, device, threshold):
        if _hugging_face(model):  # wrap_model also lets the model turn its KV cache off above checkpointed layers
            from hyper_parallel.integrations.transformers import wrap_model

            wrap_model(model, chain=chain, **kwargs)
        else:
            _api().wrap_layers(layer_stack(model), chain=chain, **kwargs)
    return apply


def _functions(chain: bool, **kwargs):  # attn.forward / mlp.forward wrapped, whole layers chained
    def apply(model, device, threshold):
        for layer in model.layers:
            for sub in (layer.attn, layer.mlp):  # (on the instance: sub(...) runs the wrapped function)
                sub.forward = _api().checkpoint_wrapper(sub.forward, **kwargs)
        if chain:
            chain_layers(model.layers)
    return apply


def _attn_swap(with_policy: bool):  # swap_wrapper on every layer.attn, whole layers chained
    def apply(model, device, threshold):
        threshold = DEFAULT_SWAP_THRESHOLD_BYTES if threshold is None else threshold
        for layer in model.layers:
            layer.attn = _api().swap_wrapper(layer.attn, policy_fn=swap_if_at_least(threshold) if with_policy else None)
        chain_layers(model.layers)
    return apply


def _torch_ckpt(selective: bool):
    def apply(model, device, threshold):
        context_fn = (functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, _torch_policy)
                      if selective else torch.utils.checkpoint.noop_context_fn)
        if _hugging_face(model):
            # PyTorch's checkpoint through the model's own hook, as its users switch it on (the hook also turns
            # the KV cache off in training, which a recompute cannot append to twice)
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable({"use_reentrant": False, "context_fn": context_fn})
        else:
            _each_layer(model, lambda layer: HooksLayer(layer, context_fn=context_fn))
    return apply


def _save_on_cpu(model, device, threshold):
    counter, on_cpu = ByteCounter(), device.type == "cpu"  # (nothing to pin without an accelerator)
    _each_layer(model, lambda layer: HooksLayer(layer, lambda: _counted(torch.autograd.graph.save_on_cpu(
        pin_memory=not on_cpu, device_type="cuda" if on_cpu else device.type), counter, on_cpu)))
    return counter


def _copying(selective: bool):  # every saved tensor copied out and back; selective: torch_sac's cache too
    def apply(model, device, threshold):
        counter = ByteCounter()
        context_fn = (lambda: sac_host_copy_contexts(_torch_policy, counter)) if selective else None
        _each_layer(model, lambda layer: HooksLayer(layer, lambda: CopyHooks(counter), context_fn=context_fn))
        return counter
    return apply


def _torchtune(checkpointed: bool):
    def apply(model, device, threshold):
        if device.type != "cuda":
            raise RuntimeError("torchtune's OffloadActivations is CUDA-only (it calls torch.cuda.default_stream()); "
                               f"device is {device.type}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from torchtune.training import OffloadActivations
        except Exception as exc:  # ImportError, or torchtune/torchao version mismatches
            raise RuntimeError(f"torchtune is not usable ({type(exc).__name__}: {exc}); install the optional "
                               "extra: pip install -e '.[peers]'") from exc
        counter = ByteCounter()
        hooks = _counted_torchtune(OffloadActivations(use_pin_memory=True, use_streams=True), counter)
        _each_layer(model, lambda layer: HooksLayer(layer, lambda: hooks, checkpointed=checkpointed))
        return counter
    return apply


RECIPES: Dict[str, Recipe] = {r.name: r for r in [
    Recipe("none", "baseline", "no wrapper: plain training, the baseline", lambda model, device, threshold: None),
    Recipe("torch_ckpt", "peer", "torch.utils.checkpoint (non-reentrant) per layer", _torch_ckpt(False)),
    Recipe("torch_sac", "peer", "PyTorch selective checkpoint per layer: save mm/addmm/bmm, recompute the rest",
           _torch_ckpt(True)),
    Recipe("save_on_cpu", "peer", "torch.autograd.graph.save_on_cpu per layer (pin_memory on accelerators)",
           _save_on_cpu, offloads=True),
    Recipe("copy_hooks", "peer", "saved_tensors_hooks per layer copying every saved tensor out and back: save_on_cpu's "
                                 "work on a CPU too (a CPU yardstick)", _copying(False), offloads=True),
    Recipe("torch_sac_copy", "peer", "torch_sac with its cached matmul outputs, and in copy_hooks the layer input, "
                                     "copied out and back: what ours_ckpt_swap moves", _copying(True), offloads=True),
    Recipe("torchtune_offload", "peer", "torchtune OffloadActivations around each layer (streams, pinned)",
           _torchtune(False), offloads=True),
    Recipe("torchtune_offload_ckpt", "peer", "torchtune OffloadActivations + torch.utils.checkpoint per layer "
                                             "(torchtune's recommended pairing: offloads the checkpoint inputs)",
           _torchtune(True), offloads=True),
    Recipe("ours_recompute", "ours", "checkpoint_wrapper(layer): whole-layer recompute",
           _wrapped(False), counterparts=("torch_ckpt",)),
    Recipe("ours_funcrecompute", "ours", "checkpoint_wrapper on attn.forward and mlp.forward: whole-function "
                                         "recompute", _functions(False)),
    Recipe("ours_save", "ours", "checkpoint_wrapper(layer, policy_fn=save_matmuls): matmul outputs saved, "
                                "the rest recomputed", _wrapped(False, policy_fn=save_matmuls),
           counterparts=("torch_sac",)),
    Recipe("ours_funcsave", "ours", "checkpoint_wrapper(policy_fn=save_matmuls) on attn.forward and mlp.forward",
           _functions(False, policy_fn=save_matmuls)),
    Recipe("ours_ckpt_swap", "ours", "checkpoint_wrapper(layer, policy_fn=swap_matmuls, swap_inputs=True), layers "
                                     "chained: matmul outputs + inputs swapped, the rest recomputed",
           _wrapped(True, policy_fn=swap_matmuls, swap_inputs=True), offloads=True,
           counterparts=("save_on_cpu", "torch_sac_copy", "torchtune_offload", "torchtune_offload_ckpt")),
    Recipe("ours_funcswap", "ours", "checkpoint_wrapper(policy_fn=swap_matmuls, swap_inputs=True) on attn.forward "
                                    "and mlp.forward, layers chained",
           _functions(True, policy_fn=swap_matmuls, swap_inputs=True), offloads=True),
    Recipe("ours_swap_wrapper", "ours", "swap_wrapper(layer), layers chained: every saved tensor swapped",
           _wrapped(True, swap=True), offloads=True, counterparts=("save_on_cpu", "copy_hooks", "torchtune_offload")),
    Recipe("ours_recompute_swapin", "ours", "checkpoint_wrapper(layer, swap_inputs=True), layers chained: "
                                            "whole-layer recompute, checkpoint inputs swapped",
           _wrapped(True, swap_inputs=True), offloads=True, counterparts=("torchtune_offload_ckpt", "torch_ckpt")),
    Recipe("ours_attn_swap", "ours", "swap_wrapper(layer.attn), layers chained: all attention saves is swapped",
           _attn_swap(False), offloads=True),
    Recipe("ours_attn_swap_policy", "ours", "swap_wrapper(layer.attn, policy_fn=swap_if_at_least(threshold)), layers "
                                            "chained: tensors >= threshold swapped, smaller ones saved",
           _attn_swap(True), offloads=True),
]}

#: ``python -m hyper_parallel.bench`` mode -> recipe (the RFC's checkpoint_wrapper modes).
MODE_RECIPES: Dict[str, str] = {
    "none": "none", "recompute": "ours_recompute", "funcrecompute": "ours_funcrecompute", "save": "ours_save",
    "funcsave": "ours_funcsave", "swap": "ours_ckpt_swap", "funcswap": "ours_funcswap"}
#: ``python -m hyper_parallel.bench --swap-wrapper`` mode -> recipe.
SWAP_WRAPPER_RECIPES: Dict[str, str] = {"none": "none", "swap": "ours_attn_swap",
                                        "swap_with_policy": "ours_attn_swap_policy"}
MODES = tuple(MODE_RECIPES)
SWAP_WRAPPER_MODES = tuple(SWAP_WRAPPER_RECIPES)
#: ``benchmarks/compare_peers.py``'s default rows, in table order.
PEER_VARIANTS: Tuple[str, ...] = (
    "none", "torch_ckpt", "torch_sac", "save_on_cpu", "torchtune_offload", "torchtune_offload_ckpt",
    "ours_recompute", "ours_save", "ours_swap_wrapper", "ours_ckpt_swap", "ours_recompute_swapin")
#: ``benchmarks/swap_overhead.py``'s rows (on ``SmallOpsNet``): ours and the peers doing the same work.
OVERHEAD_VARIANTS: Tuple[str, ...] = ("none", "save_on_cpu", "copy_hooks", "ours_swap_wrapper", "torch_sac",
                                      "torch_sac_copy", "ours_save", "ours_ckpt_swap")
#: ``benchmarks/swap_memory.py``'s rows.
MEMORY_VARIANTS: Tuple[str, ...] = ("none", "ours_recompute", "ours_ckpt_swap", "ours_swap_wrapper", "save_on_cpu")


def apply_variant(model: nn.Module, name: str, *, device: Any = "cpu", swap_threshold_bytes: Optional[int] = None,
                  recipes: Mapping[str, Recipe] = RECIPES) -> Optional[ByteCounter]:
    """Apply recipe ``name`` (of ``recipes``) to ``model`` in place; return its byte counter (peers that move bytes) or
    ``None``. ``RuntimeError`` with the reason when it cannot run on ``device``."""
    if name not in recipes:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(recipes)}")
    return recipes[name].apply(model, torch.device(device), swap_threshold_bytes)


def apply_mode(model: nn.Module, mode: str, *, swap_wrapper: bool = False,
               swap_threshold_bytes: Optional[int] = None) -> nn.Module:
    """Apply bench mode ``mode`` (one of ``MODES``; with ``swap_wrapper`` of ``SWAP_WRAPPER_MODES``) to ``model`` in
    place and return it."""
    if swap_wrapper:
        return apply_swap_wrapper_mode(model, mode, swap_threshold_bytes=swap_threshold_bytes)
    if mode not in MODE_RECIPES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    apply_variant(model, MODE_RECIPES[mode])
    return model


def apply_swap_wrapper_mode(model: nn.Module, mode: str, *, swap_threshold_bytes: Optional[int] = None) -> nn.Module:
    """Apply one of ``SWAP_WRAPPER_MODES`` to ``model`` in place and return it; ``swap_with_policy`` swaps tensors from
    ``swap_threshold_bytes`` (default ``DEFAULT_SWAP_THRESHOLD_BYTES``)."""
    if mode not in SWAP_WRAPPER_RECIPES:
        raise ValueError(f"unknown swap_wrapper mode {mode!r}; expected one of {', '.join(SWAP_WRAPPER_MODES)}")
    apply_variant(model, SWAP_WRAPPER_RECIPES[mode], swap_threshold_bytes=swap_threshold_bytes)
    return model
