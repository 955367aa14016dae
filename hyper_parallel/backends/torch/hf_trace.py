"""One training step of a Hugging Face decoder, traced on the meta device, phase by phase.

The planner needs, for each kind of decoder layer and each activation option, what a layer's
forward keeps for its backward, how high its forward and backward rise above that, and what its
ops cost; and the same for the embedding and the loss head. A model of ``L`` identical layers
does not need ``L`` layers traced: :func:`trace_step` builds the model from its configuration
with only as many layers as it takes to see every kind of layer after a first one (two for a
Llama), on the meta device (no memory, no weights, no download), runs ``model(input_ids,
labels=..., use_cache=False).loss.backward()`` under :class:`~.meta_trace.LiveBytesMode`, and
cuts the trace into phases with module and tensor hooks:

``embed.fwd`` (embedding, rotary tables) -> ``layer{i}.fwd`` ... -> ``head.fwd`` (final norm,
``lm_head``, the loss: Hugging Face upcasts the logits to float32 before the cross-entropy, and
the trace sees it) -> ``head.bwd`` -> ``layer{i}.bwd`` (from the gradient of the layer's output
to that of its input; a checkpointed layer's recompute is inside it) ... -> ``embed.bwd``.

Activation options are traced by the machinery that runs them in training, not modelled:

- ``none``: the model as it is;
- ``full``: every decoder layer under ``torch.utils.checkpoint`` (non-reentrant, no RNG state:
  torchtitan's full activation checkpointing, ``ptd_checkpoint_wrapper``), set through Hugging
  Face's own checkpointing hook of the layer;
- ``selective``: torchtitan's per-op selective policy (``_apply_op_sac``) through PyTorch's
  ``create_selective_checkpoint_contexts``: save the outputs of the attention kernels and of
  every other ``mm``, recompute the rest;
- ``hf-gc``: ``model.activation_checkpointing_enable()`` (Hugging Face gradient checkpointing
  with its defaults).

The step is traced in the compute dtype (``bfloat16`` for the mixed recipes: what FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16)`` runs); master weights, optimizer state and
communication buffers are the step model's (``planner/step_model.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import transformers  # (the target planner plans Hugging Face configs: the test/hf extra)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers import AttentionInterface, AttentionMaskInterface, masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .meta_trace import FusedAttentionOnMeta, LiveBytesMode, Phase
from hyper_parallel.planner.model_configs import config_kwargs

__all__ = ["StepTrace", "trace_step", "apply_option", "apply_plan", "build_model", "layer_kinds", "decoder_layers", "OPTIONS",
           "torchtitan_policy", "trace_optimizer"]

#: The activation options :func:`trace_step` traces (module docstring).
OPTIONS = ("none", "full", "selective", "hf-gc")


def layer_kinds(config: Dict[str, Any]) -> List[str]:
    """The kind of every decoder layer: ``config["layer_types"]`` where the model has several
    (sliding-window and full attention, ...), else one kind, ``"decoder"``."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if isinstance(types, (list, tuple)) and len(types) >= layers:
        return [str(t) for t in types[:layers]]
    return ["decoder"] * layers


def traced_layer_count(kinds: Sequence[str]) -> int:
    """How many leading layers show every kind after a first layer: the last first appearance of
    a kind, plus one more layer (two layers for a model of one kind)."""
    first = {}
    for i, kind in enumerate(kinds):
        first.setdefault(kind, i)
    return min(len(kinds), max(max(first.values()) + 1, 2))


def fused_attention(kind: str) -> str:
    """The name of a Hugging Face attention implementation that is SDPA's (``sdpa_attention_forward``
    and ``sdpa_mask``) with ``F.scaled_dot_product_attention`` on meta tensors running the fused
    kernel of ``kind`` (:class:`~.meta_trace.FusedAttentionOnMeta`; real tensors: SDPA as it is).
    Registered as an implementation rather than entered around the step, so that a checkpoint's
    recompute in the backward takes the same kernel as the forward."""
    name = f"hyper_parallel_meta_{kind}"

    def forward(*args: Any, **kwargs: Any) -> Any:
        with FusedAttentionOnMeta(kind):
            return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, masking_utils.sdpa_mask)
    return name


def build_model(config: Dict[str, Any], layers: int, dtype: torch.dtype, device: Any = "meta",
                attention: Optional[str] = None) -> torch.nn.Module:
    """The Hugging Face causal LM of ``config`` with its first ``layers`` decoder layers, in
    ``dtype``, on ``device`` (the meta device: shapes only), in training mode, SDPA attention
    (``attention``: ``"cuda"`` or ``"cpu"``, the fused kernel that SDPA runs on meta tensors)."""

    model_type, kwargs = config_kwargs(config)
    kwargs["num_hidden_layers"] = layers
    if isinstance(kwargs.get("layer_types"), (list, tuple)):
        kwargs["layer_types"] = list(kwargs["layer_types"])[:layers]
    hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
    hf_config._attn_implementation = fused_attention(attention) if attention else "sdpa"
    with torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.train()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder layers (``model.model.layers`` and its look-alikes)."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "model.language_model.layers"):
        module: Any = model
        for attr in path.split("."):
            module = getattr(module, attr, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList):
            return module
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return max(lists, key=len)


def torchtitan_policy() -> Callable[..., Any]:
    """torchtitan's per-op selective activation checkpointing policy (``_apply_op_sac`` in
    ``torchtitan/models/llama3/infra/parallelize.py``), as a ``policy_fn`` for
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``: save the outputs of the
    attention kernels and of every other ``aten.mm`` (the 1st, 3rd, ... of a layer's forward;
    the count restarts in the recompute), recompute everything else. The CPU flash kernel is
    added beside the CUDA ones so that "this machine" runs the same policy."""

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default, aten.max.default}
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            save.add(getattr(aten, name).default)
    counts: Dict[str, int] = {}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            counts[mode] = counts.get(mode, 0) + 1
        keep = func in save and not (func == aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn() -> Any:
        counts.clear()  # (torchtitan's counters live per layer call; one layer runs at a time)
        return create_selective_checkpoint_contexts(policy)

    return context_fn


@dataclasses.dataclass
class StepTrace:
    """A traced step (module docstring): its phases, and what the trace's model holds.

    ``layer_params[i]``: the element counts of traced layer ``i``'s parameters; ``embed_params``
    and ``head_params`` likewise (the head: final norm and ``lm_head``; a head tied to the
    embedding has none of its own); ``kinds``: the kind of each of the real model's layers;
    ``traced``: how many layers were traced; ``dtype``: the compute dtype."""

    option: str
    phases: Dict[str, Phase]
    kinds: List[str]
    traced: int
    layer_params: List[List[int]]
    embed_params: List[int]
    head_params: List[int]
    dtype: torch.dtype
    notes: List[str]
    bytes_only: Dict[str, int]
    #: the width of the hidden states a layer passes on (its output: what a swapped layer keeps)
    hidden: int = 0
    #: the gradients existed before the step (``trace_step(accumulate=True)``): the phases hold none
    accumulate: bool = False

    def layer(self, i: int) -> Tuple[Phase, Phase]:
        """The forward and backward phases standing for the real model's layer ``i``: the traced
        layer itself when it was traced, else the last traced layer of its kind."""
        if i >= self.traced:
            kind = self.kinds[i]
            i = max(j for j in range(self.traced) if self.kinds[j] == kind)
        return self.phases[f"layer{i}.fwd"], self.phases[f"layer{i}.bwd"]

    def traced_index(self, i: int) -> int:
        if i < self.traced:
            return i
        return max(j for j in range(self.traced) if self.kinds[j] == self.kinds[i])


@contextlib.contextmanager
def _one_sequence_per_row_on_meta() -> Iterator[None]:
    """Hugging Face's mask code asks whether the position ids pack several sequences in a row
    (``masking_utils.find_packed_sequence_indices``), a question about the data that meta tensors
    cannot answer; the step's position ids are ``arange(seq)``, one sequence per row, whose answer
    is ``None``: give that answer for meta tensors."""
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find(position_ids: torch.Tensor) -> Any:
        return None if position_ids.device.type == "meta" else original(position_ids)

    masking_utils.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return getattr(value, "last_hidden_state", None)


def _numels(module: torch.nn.Module, exclude: Sequence[torch.nn.Module] = ()) -> List[int]:
    skip = {id(p) for m in exclude for p in m.parameters()}
    return [p.numel() for p in module.parameters() if id(p) not in skip and p.requires_grad]


def apply_option(model: torch.nn.Module, option: str, layers: Optional[Sequence[int]] = None) -> None:
    """Set activation ``option`` (:data:`OPTIONS`) on the decoder layers of ``model`` (``layers``:
    their indices; default every one) the way it runs in training (module docstring); ``none``
    leaves them as they are. ``hf-gc`` is the whole model's switch (every layer)."""
    if option not in OPTIONS:
        raise ValueError(f"unknown activation option {option!r}; use one of {', '.join(OPTIONS)}")
    every = decoder_layers(model)
    layers = [every[i] for i in layers] if layers is not None else list(every)
    if option in ("full", "selective"):
        kwargs: Dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": False}
        if option == "selective":
            kwargs["context_fn"] = torchtitan_policy()
        for layer in layers:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(checkpoint, **kwargs)
        if option == "selective":  # (one policy per layer: its counters are the layer's own)
            for layer in layers:
                layer._gradient_checkpointing_func = functools.partial(
                    checkpoint, **{**kwargs, "context_fn": torchtitan_policy()})
    elif option == "hf-gc":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()


def apply_plan(model: torch.nn.Module, plan: Sequence[str]) -> None:
    """Set a plan's option (``none``, ``selective``, ``recompute``) on each decoder layer, as
    the plan was traced; ``swap`` is the swap engine's (``core/``), not set here: a ``ValueError``."""
    names = {"none": "none", "selective": "selective", "recompute": "full"}
    for option in set(plan):
        if option not in names:
            raise ValueError(f"apply_plan sets none, selective and recompute; {option!r} is not one of them")
        apply_option(model, names[option], [i for i, o in enumerate(plan) if o == option])


def trace_step(config: Dict[str, Any], *, seq: int, batch: int, dtype: torch.dtype, option: str,
               allocator: str = "cuda_caching", attention: str = "cuda", device: Any = "meta",
               model: Optional[torch.nn.Module] = None, accumulate: bool = False) -> StepTrace:
    """Trace one step of ``config``'s model (module docstring) under activation ``option``.
    ``attention``: the fused attention kernel the target runs (:class:`FusedAttentionOnMeta`);
    ``device="cpu"`` with ``model`` runs the same phases on a real model (a measured profile,
    for comparing with a meta trace). ``accumulate``: the gradients exist before the step (a
    micro-batch after the first under gradient accumulation): autograd adds each new gradient into
    them and frees it, and the trace counts only that transient (else each layer's gradients are
    born in its backward and stay)."""
    if option not in OPTIONS:
        raise ValueError(f"unknown activation option {option!r}; use one of {', '.join(OPTIONS)}")
    kinds = layer_kinds(config)
    traced = len(decoder_layers(model)) if model is not None else traced_layer_count(kinds)
    if model is None:
        model = build_model(config, traced, dtype, device, attention)
    layers = decoder_layers(model)
    notes: List[str] = []
    apply_option(model, option)
    mode = LiveBytesMode(allocator)
    handles = []
    last = len(layers) - 1

    def pre_hook(i: int, module: Any, args: Any, kwargs: Any) -> None:
        mode.mark(f"layer{i}.fwd")
        hidden = _first_tensor(args) if args else kwargs.get("hidden_states")
        if hidden is not None and hidden.requires_grad:
            after = "embed.bwd" if i == 0 else f"layer{i - 1}.bwd"
            hidden.register_hook(lambda grad: (mode.mark(after), None)[1])

    def post_hook(i: int, module: Any, args: Any, output: Any) -> None:
        out = _first_tensor(output)
        if out is not None and out.requires_grad and i == last:
            out.register_hook(lambda grad: (mode.mark(f"layer{i}.bwd"), None)[1])
        if i == last:
            mode.mark("head.fwd")

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(functools.partial(pre_hook, i), with_kwargs=True))
        handles.append(layer.register_forward_hook(functools.partial(post_hook, i)))
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    if accumulate:
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    try:
        with _one_sequence_per_row_on_meta(), mode:
            mode.mark("embed.fwd")
            out = model(input_ids=ids, labels=ids, use_cache=False)
            loss = out.loss
            del out  # (the training loop keeps the loss only: the logits die here)
            mode.mark("head.bwd")
            loss.backward()
            mode.mark("end")
            del loss
    finally:
        for h in handles:
            h.remove()
    fused = sum(1 for p in mode.phases.values() for c in p.costs if c.op_class == "attention")
    if device == "meta" and fused == 0:
        notes.append("no scaled_dot_product_attention call was seen: the model's attention was traced as written "
                     "(an eager attention materialises its score matrix; the target's fused kernel may not)")
    expected = ["embed.fwd"] + [f"layer{i}.fwd" for i in range(len(layers))] + ["head.fwd", "head.bwd"] + \
        [f"layer{i}.bwd" for i in reversed(range(len(layers)))] + ["embed.bwd", "end"]
    if mode.order != expected:
        raise ValueError(f"the traced step's phases came out as {mode.order}, not {expected}: the planner cannot "
                         f"cut {type(model).__name__}'s step into layers (its decoder layers are not called one "
                         "after another on the hidden states)")
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    base = getattr(model, "model", model)
    norm = getattr(base, "norm", None)
    head_params = ([] if tied or head is None else _numels(head)) + (_numels(norm) if norm is not None else [])
    return StepTrace(option=option, phases=dict(mode.phases), kinds=kinds, traced=len(layers),
                     layer_params=[_numels(layer) for layer in layers], embed_params=_numels(embed),
                     head_params=head_params, dtype=dtype, notes=notes, bytes_only=dict(mode.log.bytes_only),
                     hidden=int(getattr(model.config, "hidden_size", 0) or 0), accumulate=accumulate)


def trace_optimizer(numels: Sequence[int], dtype: torch.dtype, optimizer: str,
                    allocator: str = "cuda_caching") -> Tuple[int, List[Any], List[str]]:
    """``(transient bytes, op costs, notes)`` of one optimizer step over parameters of
    ``numels`` elements in ``dtype`` (their gradients and, for AdamW, both states already there:
    a step after the first), traced on the meta device: what the step allocates above what it
    starts with (AdamW foreach: the per-group lists its ``_foreach_*`` ops make)."""
    notes: List[str] = []
    with torch.device("meta"):
        params = [torch.nn.Parameter(torch.empty(n, dtype=dtype)) for n in numels]
        for p in params:
            p.grad = torch.empty(p.numel(), dtype=dtype)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=1e-3)
    elif optimizer == "adamw-fused":
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    try:
        opt.step()  # (the first step makes the states: not part of a step in steady state)
        mode = LiveBytesMode(allocator)
        with mode:
            mode.mark("step")
            opt.step()
            mode.mark("end")
        phase = mode.phases["step"]
        return phase.rise, phase.costs, notes
    except (RuntimeError, NotImplementedError) as e:
        notes.append(f"the {optimizer} step could not be traced on the meta device ({type(e).__name__}); its "
                     "temporaries are modelled as none and its time by the bytes it reads and writes")
        return 0, [], notes
