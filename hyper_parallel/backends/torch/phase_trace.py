"""One training step of a decoder-shaped model, traced phase by phase on the meta device.

The target planner needs, for each kind of layer and each activation option, what a layer's
forward keeps for its backward, how high its forward and backward rise above that, and what its
ops cost; and the same for what comes before the layers (the embedding) and after them (the loss
head). A model of ``L`` identical layers does not need ``L`` layers traced: the model is built
with only as many layers as it takes to see every kind of layer after a first one
(:func:`traced_layer_count`: two for a model of one kind), on the meta device (no memory, no
weights, no download), and one step, ``loss(model, ids).backward()``, runs under
:class:`~.meta_trace.LiveBytesMode`, cut into phases by module and tensor hooks:

``embed.fwd`` (everything before the first layer) -> ``layer{i}.fwd`` ... -> ``head.fwd`` (after
the last layer: final norm, output projection, the loss) -> ``head.bwd`` -> ``layer{i}.bwd``
(from the gradient of the layer's output to that of its input; a checkpointed layer's recompute
is inside it) ... -> ``embed.bwd``.

This module is the part any model shares: :func:`trace_phases` traces a built model,
:class:`ModelFactory` describes a model by a function that builds it (any ``nn.Module`` whose
layers are called one after another on the hidden states: :func:`trace_factory`);
``hf_trace.py`` builds a Hugging Face model from its configuration and hands it here.

Which parameters belong to the embedding and which to the head is read from the step itself: a
parameter belongs to the phase whose module call first uses it (a head tied to the embedding has
none of its own). Buffers (a causal mask, rotary tables) likewise, held as they are.

Activation options are traced by the machinery that runs them in training, not modelled:

- ``none``: the model as it is;
- ``full``: every layer's ``forward`` under ``torch.utils.checkpoint`` (non-reentrant, no RNG
  state: torchtitan's full activation checkpointing), the module's hooks outside it (as FSDP2's
  stay outside it: Hugging Face's ``GradientCheckpointingLayer`` checkpoints ``forward`` too);
- ``selective``: torchtitan's per-op selective policy (``_apply_op_sac``) through PyTorch's
  ``create_selective_checkpoint_contexts``: save the outputs of the attention kernels and of
  every other ``mm``, recompute the rest;
- ``hf-gc``: ``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable()``
  before transformers 5: Hugging Face gradient checkpointing with its defaults; a model without
  that switch cannot take it).

Example (a two-layer MLP stack as a model factory, its step traced on the meta device)::

    >>> import torch
    >>> class Net(torch.nn.Module):
    ...     def __init__(self, n):
    ...         super().__init__()
    ...         self.embed = torch.nn.Embedding(100, 32)
    ...         self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(n))
    ...         self.head = torch.nn.Linear(32, 100)
    ...     def forward(self, ids):
    ...         h = self.embed(ids)
    ...         for layer in self.layers:
    ...             h = layer(h).relu()
    ...         return self.head(h)
    >>> factory = ModelFactory(Net, layers=12, loss=lambda m, ids: m(ids).logsumexp(-1).mean())
    >>> step = trace_factory(factory, seq=16, batch=2, dtype=torch.float32, option="none", allocator="exact")
    >>> step.traced, len(step.kinds), step.embed_params, step.head_params, step.hidden
    (2, 12, [3200], [3200, 100], 32)
    >>> step.phases["layer0.fwd"].net    # the linear's output, which relu saves: 2 x 16 x 32 floats
    4096
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .meta_trace import FusedAttentionOnMeta, LiveBytesMode, Phase

__all__ = ["OPTIONS", "ModelFactory", "TracedStep", "trace_phases", "trace_factory", "trace_optimizer",
           "apply_option", "apply_plan", "decoder_layers", "torchtitan_policy", "traced_layer_count"]

#: The activation options a step is traced under (module docstring).
OPTIONS = ("none", "full", "selective", "hf-gc")


@dataclasses.dataclass(frozen=True, eq=False)
class ModelFactory:
    """A model the target planner builds itself (any model, not only a Hugging Face config).

    - ``build(n)``: the model with its first ``n`` layers (all of one kind, or ``kinds[:n]``),
      called under ``torch.device(...)`` (the meta device: parameters made by PyTorch's default
      factories cost nothing), its parameters then cast to the step's compute dtype (buffers
      stay as built);
    - ``layers``: how many layers the real model has;
    - ``loss(model, ids)``: the training loss of a batch of token ids (``(batch, seq)``,
      ``int64``), e.g. ``lambda m, ids: m(ids, labels=ids).loss``;
    - ``kinds``: the kind of each layer, where layers differ (default: all one kind);
    - ``name``: how the report names the model;
    - ``fused_attention(model, kind)``: makes the built model's attention run the target's fused
      kernel (``kind``: :class:`~.meta_trace.FusedAttentionOnMeta`'s) in its forward and in any
      recompute; default: each layer's ``forward`` runs under ``FusedAttentionOnMeta``, which a
      checkpoint the model sets inside its own ``forward`` does not see in its recompute
      (Hugging Face's: ``hf_trace.model_factory`` gives its own).

    The model's layers are its longest ``nn.ModuleList`` (:func:`decoder_layers`), called one
    after another on the hidden states; every parameter is trained (frozen ones: a
    ``ValueError``)."""

    build: Callable[[int], torch.nn.Module]
    layers: int
    loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    kinds: Optional[Tuple[str, ...]] = None
    name: str = "model factory"
    fused_attention: Optional[Callable[[torch.nn.Module, str], None]] = None

    def __post_init__(self) -> None:
        if not callable(self.build) or not callable(self.loss):
            raise TypeError("ModelFactory needs build(n) -> model and loss(model, ids) -> loss, both callable")
        if not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"ModelFactory.layers must be a positive int (the real model's layer count), "
                             f"got {self.layers!r}")
        if self.kinds is not None and len(self.kinds) != self.layers:
            raise ValueError(f"ModelFactory.kinds names {len(self.kinds)} layers, not layers={self.layers}")

    def layer_kinds(self) -> List[str]:
        return list(self.kinds) if self.kinds is not None else ["layer"] * self.layers

    @classmethod
    def from_model(cls, model: torch.nn.Module, loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
                   kinds: Optional[Sequence[str]] = None, name: str = "",
                   fused_attention: Optional[Callable[[torch.nn.Module, str], None]] = None) -> "ModelFactory":
        """The factory of a model you have (on any device, trained or not), to plan it for a
        target: ``build(n)`` is a copy of ``model`` on the meta device with its first ``n``
        layers, its parameters and buffers shapes only (nothing is copied but the modules; the
        model itself is left as it is). ``model``: unwrapped (its layers as :func:`decoder_layers`
        finds them); ``loss``, ``kinds``, ``fused_attention``: as :class:`ModelFactory`'s.

        >>> net = torch.nn.Sequential()
        >>> net.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
        >>> factory = ModelFactory.from_model(net, lambda m, ids: ids.sum())
        >>> small = factory.build(2)
        >>> factory.layers, len(small.layers), small.layers[0].weight.device.type, net.layers[0].weight.device.type
        (5, 2, 'meta', 'cpu')
        """
        layers = len(decoder_layers(model))

        def build(n: int) -> torch.nn.Module:
            # (deepcopy with every parameter and buffer already "copied" to an empty meta tensor)
            memo: Dict[int, Any] = {}
            for p in model.parameters():
                memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for b in model.buffers():
                memo[id(b)] = torch.empty_like(b, device="meta")
            meta = copy.deepcopy(model, memo)
            del decoder_layers(meta)[n:]
            return meta

        return cls(build, layers, loss, tuple(kinds) if kinds is not None else None,
                   name or f"{type(model).__name__} ({layers} layers)", fused_attention)


def traced_layer_count(kinds: Sequence[str]) -> int:
    """How many leading layers show every kind after a first layer: the last first appearance of
    a kind, plus one more layer (two layers for a model of one kind)."""
    first: Dict[str, int] = {}
    for i, kind in enumerate(kinds):
        first.setdefault(kind, i)
    return min(len(kinds), max(max(first.values()) + 1, 2))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's layers: ``model.model.layers`` and its look-alikes, else its longest
    ``nn.ModuleList``."""
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
        raise ValueError(f"cannot find the layers of {type(model).__name__}: it has no nn.ModuleList")
    return max(lists, key=len)


def torchtitan_policy() -> Callable[..., Any]:
    """torchtitan's per-op selective activation checkpointing policy (``_apply_op_sac`` in
    ``torchtitan/models/llama3/infra/parallelize.py``), as a ``context_fn`` for
    ``torch.utils.checkpoint``: save the outputs of the attention kernels and of every other
    ``aten.mm`` (the 1st, 3rd, ... of a layer's forward; the count restarts in the recompute),
    recompute everything else. The CPU flash kernel is added beside the CUDA ones so that "this
    machine" runs the same policy."""

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


def _checkpointed(forward: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    # (keyword arguments bound, positional ones passed: what a non-reentrant checkpoint saves for
    # its recompute, as Hugging Face's layers call it)
    @functools.wraps(forward)
    def run(*args: Any, **call_kwargs: Any) -> Any:
        return checkpoint(functools.partial(forward, **call_kwargs), *args, **kwargs)
    return run


def apply_option(model: torch.nn.Module, option: str, layers: Optional[Sequence[int]] = None) -> None:
    """Set activation ``option`` (:data:`OPTIONS`) on the layers of ``model`` (``layers``: their
    indices; default every one) the way it runs in training (module docstring), once per layer;
    ``none`` leaves them as they are. ``hf-gc`` is the whole model's switch (every layer)."""
    if option not in OPTIONS:
        raise ValueError(f"unknown activation option {option!r}; use one of {', '.join(OPTIONS)}")
    every = decoder_layers(model)
    chosen = [every[i] for i in layers] if layers is not None else list(every)
    if option in ("full", "selective"):
        for layer in chosen:
            kwargs: Dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": False}
            if option == "selective":  # (one policy per layer: its counters are the layer's own)
                kwargs["context_fn"] = torchtitan_policy()
            # (an instance attribute: the class's forward, and every other instance, stay as they are)
            layer.forward = _checkpointed(layer.forward, **kwargs)
    elif option == "hf-gc":
        # (transformers 5 names it activation_checkpointing_enable, earlier releases gradient_...)
        enable = getattr(model, "activation_checkpointing_enable", None) or \
            getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise ValueError(f"hf-gc is Hugging Face's gradient checkpointing; {type(model).__name__} has no "
                             "gradient_checkpointing_enable(): use full or selective")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable()


def apply_plan(model: torch.nn.Module, plan: Sequence[str]) -> None:
    """Set a plan's option (``none``, ``selective``, ``recompute``) on each layer, as the plan was
    traced; ``swap`` is the swap engine's (``core/``), not set here: a ``ValueError``."""
    names = {"none": "none", "selective": "selective", "recompute": "full"}
    for option in set(plan):
        if option not in names:
            raise ValueError(f"apply_plan sets none, selective and recompute; {option!r} is not one of them")
        apply_option(model, names[option], [i for i, o in enumerate(plan) if o == option])


@dataclasses.dataclass
class TracedStep:
    """A traced step (module docstring): its phases, and what the trace's model holds.

    ``layer_params[i]``: the element counts of traced layer ``i``'s parameters; ``embed_params``
    and ``head_params`` likewise (module docstring: which is which); ``kinds``: the kind of each
    of the real model's layers; ``traced``: how many layers were traced; ``dtype``: the compute
    dtype; ``layer_buffers[i]`` / ``other_buffers``: the bytes of each of traced layer ``i``'s
    buffers and of the rest of the model's (as held; the step model rounds them as the target's
    allocator does)."""

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
    #: the gradients existed before the step (``accumulate=True``): the phases hold none
    accumulate: bool = False
    layer_buffers: List[List[int]] = dataclasses.field(default_factory=list)
    other_buffers: List[int] = dataclasses.field(default_factory=list)

    def layer(self, i: int) -> Tuple[Phase, Phase]:
        """The forward and backward phases standing for the real model's layer ``i``: the traced
        layer itself when it was traced, else the last traced layer of its kind."""
        t = self.traced_index(i)
        return self.phases[f"layer{t}.fwd"], self.phases[f"layer{t}.bwd"]

    def traced_index(self, i: int) -> int:
        if i < self.traced:
            return i
        return max(j for j in range(self.traced) if self.kinds[j] == self.kinds[i])


def _in_mode(forward: Callable[..., Any], mode: Callable[[], Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with mode():
            return forward(*args, **kwargs)
    return run


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return getattr(value, "last_hidden_state", None)


def trace_phases(model: torch.nn.Module, loss: Callable[[], torch.Tensor], *, kinds: Sequence[str], option: str,
                 allocator: str, dtype: torch.dtype, attention: Optional[str] = None,
                 accumulate: bool = False) -> TracedStep:
    """Trace one step of ``model`` (built with its first few layers; module docstring) under
    activation ``option``: ``loss()`` runs its forward and returns the loss, whose backward the
    trace runs. The model is built for the trace: its layers keep the option afterwards. ``kinds``: the kind of each of the real model's layers; ``attention``: the fused
    attention kernel SDPA on meta tensors runs in the layers (:class:`~.meta_trace.FusedAttentionOnMeta`), or
    ``None`` (SDPA as it is). ``accumulate``: the gradients exist before the step (a micro-batch
    after the first under gradient accumulation): autograd adds each new gradient into them and
    frees it, and the trace counts only that transient."""
    if option not in OPTIONS:
        raise ValueError(f"unknown activation option {option!r}; use one of {', '.join(OPTIONS)}")
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise ValueError(f"the target planner plans a model whose parameters all train; {type(model).__name__} has "
                         f"frozen ones ({', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''})")
    layers = decoder_layers(model)
    if attention:
        # (inside each layer rather than around the step: a checkpoint's recompute in the backward
        # runs outside a mode entered around the forward, and must take the forward's kernel)
        for layer in layers:
            layer.forward = _in_mode(layer.forward, functools.partial(FusedAttentionOnMeta, attention))
    apply_option(model, option)
    mode = LiveBytesMode(allocator)
    last = len(layers) - 1
    hidden = [0]
    in_layer = {id(m) for layer in layers for m in layer.modules()}
    first_use: Dict[int, str] = {}  # id(module) -> the phase of its first call

    def pre_hook(i: int, module: Any, args: Any, kwargs: Any) -> None:
        mode.mark(f"layer{i}.fwd")
        h = _first_tensor(args) if args else kwargs.get("hidden_states")
        if h is not None and h.requires_grad:
            after = "embed.bwd" if i == 0 else f"layer{i - 1}.bwd"
            h.register_hook(lambda grad: (mode.mark(after), None)[1])

    def post_hook(i: int, module: Any, args: Any, output: Any) -> None:
        out = _first_tensor(output)
        if i == last:
            if out is not None:
                hidden[0] = int(out.shape[-1])
                if out.requires_grad:
                    out.register_hook(lambda grad: (mode.mark(f"layer{i}.bwd"), None)[1])
            mode.mark("head.fwd")

    def used(module: Any, args: Any) -> None:
        if mode.order:
            first_use.setdefault(id(module), mode.order[-1])

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(functools.partial(pre_hook, i), with_kwargs=True))
        handles.append(layer.register_forward_hook(functools.partial(post_hook, i)))
    handles.extend(m.register_forward_pre_hook(used) for m in model.modules() if id(m) not in in_layer)
    if accumulate:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    try:
        with mode:
            mode.mark("embed.fwd")
            value = loss()
            mode.mark("head.bwd")
            value.backward()
            mode.mark("end")
            del value  # (the training loop keeps the loss only until its backward)
    finally:
        for h in handles:
            h.remove()
    expected = ["embed.fwd"] + [f"layer{i}.fwd" for i in range(len(layers))] + ["head.fwd", "head.bwd"] + \
        [f"layer{i}.bwd" for i in reversed(range(len(layers)))] + ["embed.bwd", "end"]
    if mode.order != expected:
        raise ValueError(f"the traced step's phases came out as {mode.order}, not {expected}: the planner cannot "
                         f"cut {type(model).__name__}'s step into layers (its layers are not called one after "
                         "another on the hidden states)")
    notes: List[str] = []
    if not any(c.op_class == "attention" for p in mode.phases.values() for c in p.costs):
        notes.append("no scaled_dot_product_attention call was seen: the model's attention was traced as written "
                     "(an eager attention materialises its score matrix; the target's fused kernel may not)")
    embed, head, other_buffers = _outside_layers(model, layers, first_use, notes)
    return TracedStep(option=option, phases=dict(mode.phases), kinds=list(kinds), traced=len(layers),
                      layer_params=[[p.numel() for p in layer.parameters()] for layer in layers],
                      embed_params=embed, head_params=head, dtype=dtype, notes=notes,
                      bytes_only=dict(mode.log.bytes_only), hidden=hidden[0], accumulate=accumulate,
                      layer_buffers=[[_nbytes(b) for b in layer.buffers()] for layer in layers],
                      other_buffers=other_buffers)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _outside_layers(model: torch.nn.Module, layers: torch.nn.ModuleList, first_use: Dict[int, str],
                    notes: List[str]) -> Tuple[List[int], List[int], List[int]]:
    """The element counts of the embedding's and the head's parameters (module docstring: the phase
    of the module call that first uses each), and the bytes of the buffers outside the layers."""
    seen = {id(p) for p in layers.parameters()} | {id(b) for b in layers.buffers()}  # (the layers' own)
    embed: List[int] = []
    head: List[int] = []
    unused: List[str] = []
    buffers: List[int] = []
    for module_name, module in model.named_modules():
        phase = first_use.get(id(module), "")
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            (head if phase.startswith("head") else embed).append(p.numel())
            if not phase:
                unused.append(f"{module_name}.{name}".lstrip("."))
        for b in module.buffers(recurse=False):
            if id(b) not in seen:
                seen.add(id(b))
                buffers.append(_nbytes(b))
    if unused:
        notes.append(f"parameters no module call used in the forward, counted with the embedding: "
                     f"{', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}")
    return embed, head, buffers


def trace_factory(factory: ModelFactory, *, seq: int, batch: int, dtype: torch.dtype, option: str,
                  allocator: str = "cuda_caching", attention: Optional[str] = "cuda", device: Any = "meta",
                  model: Optional[torch.nn.Module] = None, accumulate: bool = False) -> TracedStep:
    """Trace one step of ``factory``'s model (module docstring) under activation ``option``,
    built with :func:`traced_layer_count` layers on ``device`` in ``dtype``; ``device="cpu"``
    with a built ``model`` runs the same phases on a real model (a measured profile, for
    comparing with a meta trace)."""
    kinds = factory.layer_kinds()
    if model is None:
        with torch.device(device):
            model = factory.build(traced_layer_count(kinds))
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ModelFactory.build returned {type(model).__name__}, not an nn.Module")
        model = model.to(device=device).train()
        with torch.no_grad():
            # (the parameters in the compute dtype, the buffers as the model keeps them: rotary
            # tables stay float32, as Hugging Face builds them in any dtype; ``.data`` keeps tied
            # parameters tied)
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    if device != "meta":
        attention = None  # (real tensors: SDPA as it is)
    elif attention and factory.fused_attention is not None:
        factory.fused_attention(model, attention)
        attention = None
    return trace_phases(model, lambda: factory.loss(model, ids), kinds=kinds, option=option, allocator=allocator,
                        dtype=dtype, attention=attention, accumulate=accumulate)


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
