"""Every way the benchmarks train the GPT, in one registry: our modes, PyTorch's and torchtune's.

Each entry of ``RECIPES`` is a :class:`Recipe`: a name, who provides it (``baseline``, ``ours``,
``peer``), one line saying what it wraps and how (the legends print it), and a few lines that
apply it to a model with ``.layers`` (items with ``.attn`` and ``.mlp``); read them as recipes.
The benchmarks pick their rows from it:

* ``python -m hyper_parallel.bench`` (``MODES``, the RFC's seven modes, and with ``--swap-wrapper``
  ``SWAP_WRAPPER_MODES``) under short mode names (``MODE_RECIPES``, ``SWAP_WRAPPER_RECIPES``);
* ``benchmarks/compare_peers.py``: ``PEER_VARIANTS`` by default, any recipe by name;
* ``benchmarks/recompute_vs_torch.py``: ``RECOMPUTE_VS_TORCH``;
* ``benchmarks/swap_overhead.py``: ``OVERHEAD_VARIANTS`` (on ``SmallOpsNet``: ``copy_hooks`` and
  ``torch_sac_copy`` are the peers doing what ours do on a CPU);
* ``benchmarks/swap_memory.py``: ``MEMORY_VARIANTS``;
* ``benchmarks/compile_vs_eager.py``: any recipe by name.

Bench mode -> recipe: ``none``; ``recompute``, ``funcrecompute``, ``save``, ``funcsave``,
``swap``, ``funcswap`` -> ``ours_<mode>`` (``swap`` -> ``ours_ckpt_swap``: matmul outputs and
inputs swapped, the rest recomputed); with ``--swap-wrapper``: ``swap`` -> ``ours_attn_swap``,
``swap_with_policy`` -> ``ours_attn_swap_policy`` (``swap_wrapper`` on every ``layer.attn``).
``RECIPES[name].what`` says what each one wraps and how.

Stacks of wrapped layers are wrapped and chained with ``wrap_layers``; where functions or
sub-modules are wrapped but whole layers chained, :func:`chain_layers` declares the order. The
library is imported lazily, so ``none`` (and the peers) work without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = [
    "Recipe", "RECIPES", "MODES", "SWAP_WRAPPER_MODES", "MODE_RECIPES", "SWAP_WRAPPER_RECIPES", "PEER_VARIANTS",
    "RECOMPUTE_VS_TORCH", "OVERHEAD_VARIANTS", "MEMORY_VARIANTS", "DEFAULT_SWAP_THRESHOLD_BYTES", "MATMUL_OPS",
    "save_matmuls", "swap_matmuls", "swap_if_at_least", "chain_layers",
    "apply_variant", "apply_mode", "apply_swap_wrapper_mode", "ByteCounter", "CopyHooks",
    "sac_host_copy_contexts", "HooksLayer", "TorchCheckpointLayer",
]

# On the bench's default model (batch 4, seq 256, heads 4, dim 128, float32)
# one attention score / probability matrix is 4 MiB and every other tensor the
# attention saves is at most 1 MiB: a 4 MiB threshold swaps the former and keeps
# the latter.  The bench derives the threshold from its actual shape and dtype
# (``attention_matrix_bytes`` in ``hyper_parallel.bench.__main__``).
DEFAULT_SWAP_THRESHOLD_BYTES = 4 * 1024 * 1024


def _api():
    # Imported on first use so that the baseline runs without the library core.
    from hyper_parallel.core import activation_checkpoint

    return activation_checkpoint


#: The matmul overloads the ``save`` / ``swap`` policies single out.  Note the
#: overloads (``aten.mm.default``), not the packets (``aten.mm``): a policy
#: function is called with an ``OpOverload``.  ``torch.matmul`` and
#: ``nn.Linear`` decompose into these before dispatch.
MATMUL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default})


def save_matmuls(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy: keep matmul outputs, recompute the rest.

    ``aten.mm`` / ``aten.addmm`` / ``aten.bmm`` outputs are saved (MUST_SAVE);
    every other op (layer norm, GELU, softmax, dropout, adds, views...) is
    re-run in backward (MUST_RECOMPUTE).  Expensive ops are not redone; cheap,
    memory-hungry element-wise results are.

    Usage::

        model.layers[i] = checkpoint_wrapper(layer, policy_fn=save_matmuls)
    """
    policy = _api().CheckpointPolicy
    if op in MATMUL_OPS:
        return policy.MUST_SAVE
    return policy.MUST_RECOMPUTE


def swap_matmuls(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy: swap matmul outputs, recompute the rest.

    Like ``save_matmuls`` but the matmul outputs are MUST_SWAP: cached in the
    swap manager, offloaded to host after the layer's forward and prefetched
    before its backward.  Offload only happens for chained layers
    (``SwapManager().set_forward_prefetch_layer``); unchained it behaves like
    ``save_matmuls``.

    Usage::

        wrap_layers(model.layers, policy_fn=swap_matmuls, swap_inputs=True)  # wrapped and chained
    """
    policy = _api().CheckpointPolicy
    if op in MATMUL_OPS:
        return policy.MUST_SWAP
    return policy.MUST_RECOMPUTE


def swap_if_at_least(threshold_bytes: int) -> Callable:
    """A ``swap_wrapper`` policy: swap tensors of at least ``threshold_bytes``.

    Returns ``policy_fn(tensor)`` giving MUST_SWAP when
    ``tensor.numel() * tensor.element_size() >= threshold_bytes`` and MUST_SAVE
    otherwise: large activations (attention scores / probabilities) go to the
    host, small ones stay, which saves most memory for few transfers.

    Usage::

        layer.attn = swap_wrapper(layer.attn, policy_fn=swap_if_at_least(4 << 20))
    """
    threshold = int(threshold_bytes)
    if threshold < 0:
        raise ValueError(f"threshold_bytes must be >= 0, got {threshold_bytes}")

    def policy_fn(tensor):
        policy = _api().CheckpointPolicy
        if tensor.numel() * tensor.element_size() >= threshold:
            return policy.MUST_SWAP
        return policy.MUST_SAVE

    policy_fn.threshold_bytes = threshold
    policy_fn.__name__ = f"swap_if_at_least_{threshold}"
    policy_fn.__doc__ = f"MUST_SWAP for tensors of at least {threshold} bytes, else MUST_SAVE."
    return policy_fn


def chain_layers(layers) -> None:
    """Declare the forward order of ``layers`` to the swap manager, for stacks whose layers were
    not wrapped themselves (``wrap_layers`` chains the ones it wraps).

    After this a layer's swapped activations are offloaded when the next layer
    has run its forward and prefetched when the next layer starts its backward;
    the last layer is never offloaded (the RFC's schedule, with a copy stream; on a
    CPU build the chain follows memory instead, see ``SwapManager.set_prefetch_budget``).
    """
    manager = _api().SwapManager()
    layers = list(layers)
    for first, second in zip(layers, layers[1:]):
        manager.set_forward_prefetch_layer(first, second)


# --------------------------------------------------------------------------- the peers' pieces

def _torch_policy(ctx, op, *args, **kwargs):
    P = torch.utils.checkpoint.CheckpointPolicy
    return P.MUST_SAVE if op in MATMUL_OPS else P.PREFER_RECOMPUTE


class TorchCheckpointLayer(nn.Module):
    """PyTorch's own way: ``torch.utils.checkpoint.checkpoint`` around a layer (``selective``:
    with ``create_selective_checkpoint_contexts`` saving the matmuls)."""

    def __init__(self, inner: nn.Module, selective: bool = False) -> None:
        super().__init__()
        torch_ckpt = torch.utils.checkpoint
        self.inner = inner
        self.context_fn = (functools.partial(torch_ckpt.create_selective_checkpoint_contexts, _torch_policy)
                           if selective else torch_ckpt.noop_context_fn)

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False,
                                                 context_fn=self.context_fn, **kwargs)


class HooksLayer(nn.Module):
    """Run a layer (optionally checkpointed, with ``context_fn`` for PyTorch's selective
    checkpoint) under a ``saved_tensors_hooks`` context made by ``hooks()``."""

    def __init__(self, inner: nn.Module, hooks: Callable[[], Any], checkpointed: bool = False,
                 context_fn: Optional[Callable[[], Any]] = None) -> None:
        super().__init__()
        self.inner = inner
        self.hooks = hooks
        self.checkpointed = checkpointed or context_fn is not None
        self.context_fn = context_fn or torch.utils.checkpoint.noop_context_fn

    def forward(self, *args, **kwargs):
        with self.hooks():
            if self.checkpointed:
                return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False,
                                                         context_fn=self.context_fn, **kwargs)
            return self.inner(*args, **kwargs)


@dataclass
class ByteCounter:
    """Bytes a peer moved, device to host (``d2h``) and back (``h2d``), and how many tensors it
    copied out (``tensors``), counted by the peers' hooks. While ``mark`` is true the peers' host
    copies are marked as host memory (``mark_host``) for the CPU memory meter: the runner sets it
    for its metered step only, because marking costs about 20 us a tensor, the meter's cost, not
    the peer's (the engine marks a pooled buffer once, when the pool allocates it)."""

    d2h: int = 0
    h2d: int = 0
    tensors: int = 0
    mark: bool = False


def _host_copy(t: torch.Tensor, counter: ByteCounter) -> torch.Tensor:
    """A new tensor of ``t``'s size, dtype and strides holding its bytes (``torch.empty_like`` +
    ``copy_``, as ``tensor.cpu()`` makes a host copy), counted out, and marked right after its
    allocation while ``counter.mark``."""
    host = torch.empty_like(t)
    if counter.mark:
        from hyper_parallel.tools.memory import mark_host

        mark_host(host)
    host.copy_(t)
    counter.tensors += 1
    counter.d2h += host.numel() * host.element_size()
    return host


class CopyHooks(torch.autograd.graph.saved_tensors_hooks):
    """A ``saved_tensors_hooks`` pair that copies every saved tensor out and back: what
    ``torch.autograd.graph.save_on_cpu`` does off-device, made to copy on a CPU-only machine too.

    Pack: :func:`_host_copy`, whatever the tensor is (parameters included, as ``save_on_cpu``
    does). Unpack: a copy of that (``clone``, as ``.to(device)`` makes a new device tensor),
    counted back. Nothing is pinned (CPU)."""

    def __init__(self, counter: ByteCounter) -> None:
        def unpack(host: torch.Tensor) -> torch.Tensor:
            counter.h2d += host.numel() * host.element_size()
            return host.clone()

        super().__init__(functools.partial(_host_copy, counter=counter), unpack)


class _HostCopyEntries(dict):
    """One op's entries of PyTorch's selective-checkpoint cache, held as host copies: a cached
    output is copied out when the forward stores it and copied back when the recompute takes it."""

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


class _HostCopyStorage(dict):
    def __init__(self, counter: ByteCounter) -> None:
        super().__init__()
        self._counter = counter

    def __missing__(self, key: Any) -> _HostCopyEntries:
        entries = self[key] = _HostCopyEntries(self._counter)
        return entries


def sac_host_copy_contexts(policy_fn: Callable, counter: ByteCounter) -> Tuple[Any, Any]:
    """``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn)`` whose cache holds
    host copies: every output the policy saves is copied out (:func:`_host_copy`) when the forward
    caches it and copied back (``clone``) when the recompute takes it, counted in ``counter``.
    This is what an offloading selective checkpoint does off-device: an outer ``save_on_cpu`` does
    not see these outputs (PyTorch keeps them in the selective-checkpoint cache, not as saved
    tensors), so without this they would stay on the device. Relies on both contexts keeping the
    cache as ``.storage`` (PyTorch 2.4+)."""
    caching, cached = torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn)
    if not (hasattr(caching, "storage") and hasattr(cached, "storage")):
        raise RuntimeError(f"torch {torch.__version__}: the selective-checkpoint contexts keep no .storage; "
                           "the host-copying peer cannot be built")
    storage = _HostCopyStorage(counter)
    caching.storage = cached.storage = storage
    return caching, cached


def count_hooks(hooks: Any, counter: ByteCounter, *, model_device_on_cpu: bool) -> Any:
    """Wrap the pack/unpack hooks of a ``save_on_cpu``-like ``saved_tensors_hooks`` instance whose
    packed value is ``(device, host_tensor)``: count the bytes moved, and on a CPU-only machine
    model the device<->host traffic: the host copy is made where ``tensor.cpu()`` skips it for a
    CPU tensor (and marked while ``counter.mark``), and the reload is a new device tensor."""
    pack, unpack = hooks.pack_hook, hooks.unpack_hook

    def pack_hook(t: torch.Tensor) -> Any:
        dev, host = pack(t)
        if model_device_on_cpu:
            return dev, _host_copy(t, counter)  # what tensor.cpu() would copy off a real device
        counter.tensors += 1
        counter.d2h += host.numel() * host.element_size()
        return dev, host

    def unpack_hook(packed: Any) -> torch.Tensor:
        out = unpack(packed)
        counter.h2d += out.numel() * out.element_size()
        return out.clone() if model_device_on_cpu else out  # (on CPU .to(device) returns the host copy)

    hooks.pack_hook, hooks.unpack_hook = pack_hook, unpack_hook
    return hooks


def count_torchtune_hooks(hooks: Any, counter: ByteCounter) -> Any:
    """Count the bytes torchtune's ``OffloadActivations`` moves (it tracks what it offloaded)."""
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
        stashed = getattr(hooks, "fwd_stash", {})
        if entry is not None and entry[1] and tid not in stashed:
            counter.h2d += entry[0].numel() * entry[0].element_size()
        return unpack(tid)

    hooks.pack_hook, hooks.unpack_hook = pack_hook, unpack_hook
    return hooks


def torchtune_offload_class(device: torch.device) -> Tuple[Optional[type], str]:
    """torchtune's ``OffloadActivations`` when it can run here, else ``(None, reason)``."""
    if device.type != "cuda":
        return None, (f"torchtune's OffloadActivations is CUDA-only (it calls torch.cuda.default_stream()); "
                      f"device is {device.type}")
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchtune.training import OffloadActivations
    except Exception as exc:  # ImportError, or torchtune/torchao version mismatches
        return None, (f"torchtune is not usable ({type(exc).__name__}: {exc}); "
                      "install the optional extra: pip install -e '.[peers]'")
    return OffloadActivations, ""


# --------------------------------------------------------------------------- the recipes

@dataclass(frozen=True)
class Recipe:
    """One way to train the model. ``apply(model, device, swap_threshold_bytes)`` wraps it in
    place and returns the :class:`ByteCounter` of a peer that moves bytes (ours are counted by
    ``SwapManager().stats()``), else ``None``; it raises ``RuntimeError`` (the reason) when the
    recipe cannot run here."""

    name: str
    who: str                         # "baseline", "ours" or "peer"
    what: str                        # one line: what it wraps and how
    apply: Callable[..., Optional[ByteCounter]]
    offloads: bool = False           # moves activations between device and host
    counterparts: Tuple[str, ...] = ()  # like-for-like peers (the same memory technique)


def _each_layer(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> None:
    for i, layer in enumerate(model.layers):
        model.layers[i] = wrap(layer)


def _wrap_functions(model: nn.Module, policy_fn=None, swap_inputs: bool = False) -> None:
    checkpoint_wrapper = _api().checkpoint_wrapper
    for layer in model.layers:
        for sub in (layer.attn, layer.mlp):
            # A bound method in, a callable out, stored on the instance so that
            # ``sub(...)`` (nn.Module.__call__) runs the wrapped function.
            if policy_fn is None and not swap_inputs:
                sub.forward = checkpoint_wrapper(sub.forward)
            else:
                sub.forward = checkpoint_wrapper(sub.forward, policy_fn=policy_fn, swap_inputs=swap_inputs)


def _none(model, device, threshold):
    return None


def _wrapped(chain: bool, **kwargs):  # every layer wrapped by wrap_layers (and chained)
    def apply(model, device, threshold):
        _api().wrap_layers(model.layers, chain=chain, **kwargs)
    return apply


def _functions(chain: bool, **kwargs):  # attn.forward / mlp.forward wrapped, whole layers chained
    def apply(model, device, threshold):
        _wrap_functions(model, **kwargs)
        if chain:
            chain_layers(model.layers)
    return apply


def _attn_swap(with_policy: bool):  # swap_wrapper on every layer.attn, whole layers chained
    def apply(model, device, threshold):
        swap_wrapper = _api().swap_wrapper
        policy_fn = None
        if with_policy:
            policy_fn = swap_if_at_least(DEFAULT_SWAP_THRESHOLD_BYTES if threshold is None else threshold)
        for layer in model.layers:
            layer.attn = swap_wrapper(layer.attn, policy_fn=policy_fn)
        chain_layers(model.layers)
    return apply


def _torch_ckpt(selective: bool):
    def apply(model, device, threshold):
        _each_layer(model, lambda layer: TorchCheckpointLayer(layer, selective=selective))
    return apply


def _save_on_cpu(model, device, threshold):
    counter, on_cpu = ByteCounter(), device.type == "cpu"

    def factory():
        pin = not on_cpu  # nothing to pin without an accelerator
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=pin, device_type=device.type if pin else "cuda")
        return count_hooks(hooks, counter, model_device_on_cpu=on_cpu)

    _each_layer(model, lambda layer: HooksLayer(layer, factory))
    return counter


def _copy_hooks(model, device, threshold):
    counter = ByteCounter()
    _each_layer(model, lambda layer: HooksLayer(layer, lambda: CopyHooks(counter)))
    return counter


def _torch_sac_copy(model, device, threshold):
    counter = ByteCounter()
    _each_layer(model, lambda layer: HooksLayer(layer, lambda: CopyHooks(counter),
                                                context_fn=lambda: sac_host_copy_contexts(_torch_policy, counter)))
    return counter


def _torchtune(checkpointed: bool):
    def apply(model, device, threshold):
        cls, reason = torchtune_offload_class(device)
        if cls is None:
            raise RuntimeError(reason)
        counter = ByteCounter()
        hooks = count_torchtune_hooks(cls(use_pin_memory=True, use_streams=True), counter)
        _each_layer(model, lambda layer: HooksLayer(layer, lambda: hooks, checkpointed=checkpointed))
        return counter
    return apply


RECIPES: Dict[str, Recipe] = {r.name: r for r in [
    Recipe("none", "baseline", "no wrapper: plain training, the baseline", _none),
    Recipe("torch_ckpt", "peer", "torch.utils.checkpoint (non-reentrant) per layer", _torch_ckpt(False)),
    Recipe("torch_sac", "peer", "PyTorch selective checkpoint per layer: save mm/addmm/bmm, recompute the rest",
           _torch_ckpt(True)),
    Recipe("save_on_cpu", "peer", "torch.autograd.graph.save_on_cpu per layer (pin_memory on accelerators)",
           _save_on_cpu, offloads=True),
    Recipe("copy_hooks", "peer", "saved_tensors_hooks per layer copying every saved tensor (parameters too) out "
                                 "(torch.empty_like + copy_) and back (clone): save_on_cpu's work, also on a CPU "
                                 "(a CPU yardstick: on an accelerator the copy stays on the device)",
           _copy_hooks, offloads=True),
    Recipe("torch_sac_copy", "peer", "torch_sac whose cached matmul outputs are copied out and back "
                                     "(sac_host_copy_contexts), inside copy_hooks (which copy the layer input the "
                                     "checkpoint saves): what ours_ckpt_swap moves",
           _torch_sac_copy, offloads=True),
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
           _wrapped(True, swap=True), offloads=True,
           counterparts=("save_on_cpu", "copy_hooks", "torchtune_offload")),
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
#: ``benchmarks/recompute_vs_torch.py``'s rows (its names -> recipes).
RECOMPUTE_VS_TORCH: Dict[str, str] = {"torch_full": "torch_ckpt", "ours_full": "ours_recompute",
                                      "torch_sac": "torch_sac", "ours_sac": "ours_save"}
#: ``benchmarks/swap_overhead.py``'s rows (on ``SmallOpsNet``): ours and the peers doing the same work.
OVERHEAD_VARIANTS: Tuple[str, ...] = ("none", "save_on_cpu", "copy_hooks", "ours_swap_wrapper", "torch_sac",
                                      "torch_sac_copy", "ours_save", "ours_ckpt_swap")
#: ``benchmarks/swap_memory.py``'s rows.
MEMORY_VARIANTS: Tuple[str, ...] = ("none", "ours_recompute", "ours_ckpt_swap", "ours_swap_wrapper", "save_on_cpu")


def apply_variant(model: nn.Module, name: str, *, device: Any = "cpu",
                  swap_threshold_bytes: Optional[int] = None) -> Optional[ByteCounter]:
    """Apply ``RECIPES[name]`` to ``model`` in place; return its byte counter (peers that move
    bytes) or ``None``. ``RuntimeError`` with the reason when it cannot run on ``device``."""
    if name not in RECIPES:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[name].apply(model, torch.device(device), swap_threshold_bytes)


def apply_mode(model: nn.Module, mode: str, *, swap_wrapper: bool = False,
               swap_threshold_bytes: Optional[int] = None) -> nn.Module:
    """Apply bench mode ``mode`` to ``model`` (in place) and return it.

    ``mode`` is one of ``MODES``, or of ``SWAP_WRAPPER_MODES`` when
    ``swap_wrapper`` is true (see ``apply_swap_wrapper_mode``).  ``model`` must
    have ``.layers`` whose items have ``.attn`` and ``.mlp`` sub-modules.
    """
    if swap_wrapper:
        return apply_swap_wrapper_mode(model, mode, swap_threshold_bytes=swap_threshold_bytes)
    if mode not in MODE_RECIPES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    apply_variant(model, MODE_RECIPES[mode])
    return model


def apply_swap_wrapper_mode(model: nn.Module, mode: str, *,
                            swap_threshold_bytes: Optional[int] = None) -> nn.Module:
    """Apply one of ``SWAP_WRAPPER_MODES`` to ``model`` (in place) and return it.

    ``swap_threshold_bytes`` (default ``DEFAULT_SWAP_THRESHOLD_BYTES``) is the
    size from which ``swap_with_policy`` swaps a tensor.
    """
    if mode not in SWAP_WRAPPER_RECIPES:
        raise ValueError(f"unknown swap_wrapper mode {mode!r}; expected one of {', '.join(SWAP_WRAPPER_MODES)}")
    apply_variant(model, SWAP_WRAPPER_RECIPES[mode], swap_threshold_bytes=swap_threshold_bytes)
    return model

