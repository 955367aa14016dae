"""``MindSporeBackend``: the primitives of :class:`hyper_parallel.core.backend.Backend` on
MindSpore (PyNative).

On Ascend / GPU copies run on a copy stream (``mindspore.runtime.Stream``), ordered by events, into
pinned host buffers. On a CPU-only build MindSpore has no streams or events, so every stream
operation is a no-op and copies are synchronous: the same state machine runs.

Selective regions run inside ``mindspore.recompute(block, *args, use_reentrant=False,
context_fn=...)`` with a pair of ``MsDispatchMode`` s. The policy receives MindSpore's op object
(``mindspore._c_expression.OpFunc``); name ops by ``op.name`` (the primitive name, e.g.
``"MatMul"``, ``"MatMulExt"``, ``"Softmax"``); a list policy names ops by those strings.
Ops never left to the policy: ``StopGradient`` (issued by ``mindspore.recompute`` itself while
recomputing), ops that mutate an argument (``Inplace*``, ``Assign*``...: always re-run), and ops
that draw random numbers (dropout, ``Uniform*``...: always kept, because MindSpore's CPU kernels
keep their own RNG state, which ``recompute`` cannot restore).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Set, Tuple

import mindspore as ms
from mindspore import Tensor, mint, nn
from mindspore.ops import Primitive
from mindspore.utils import MsDispatchMode

from hyper_parallel.core.backend import Backend, OpKind, SavedFacts
from hyper_parallel.core.keep_reason import KeepReason
from hyper_parallel.core.policy import CheckpointPolicy
from hyper_parallel.core.region_state import AroundMode

from . import _shim
from .op_classes import MACHINERY_OPS, is_legacy_primitive_call, is_mutating_op, is_random_op, op_name
from .prober import HOST_MARKS, MindSporeProber

__all__ = ["MindSporeBackend", "ViewMeta", "device_kind", "pipeline_swap", "pipeline_recompute"]

_ACCELERATORS = ("Ascend", "GPU")


class ViewMeta(NamedTuple):
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    dtype: Any
    device: str  # what ``mint.empty(device=...)`` accepts: "CPU", "Ascend", ...


def device_kind(t: Tensor) -> str:
    """``"CPU"`` / ``"Ascend"`` / ``"GPU"`` for a tensor (MindSpore spells e.g. ``"Ascend:0"``)."""
    name = str(t.device).split(":", 1)[0]
    low = name.lower()
    if low == "cpu":
        return "CPU"
    if low in ("ascend", "npu"):
        return "Ascend"
    if low in ("gpu", "cuda"):
        return "GPU"
    return name


class _MstxRange:
    """A named range in Ascend profiler (mstx) traces; tracing is optional, so any profiler
    failure leaves the range out."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rid: Any = None

    def __enter__(self) -> "_MstxRange":
        try:
            self.rid = _shim.mstx_range_start(self.name)
        except Exception:  # profiler not available / not enabled
            self.rid = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.rid is not None:
            try:
                _shim.mstx_range_end(self.rid)
            except Exception:
                pass


# ------------------------------------------------------------------------------------- dispatch modes
class _PipelineOff:
    """PyNative's front-end pipeline off inside (see ``_shim.disable_pipeline``), as it was before
    when it was off already; re-entrant."""

    def __init__(self) -> None:
        self._was_off: List[bool] = []

    def __enter__(self) -> None:
        self._was_off.append(_shim.disable_pipeline())

    def __exit__(self, *exc: Any) -> None:
        _shim.restore_pipeline(self._was_off.pop())


class _OpMode(AroundMode, MsDispatchMode):
    """A dispatch mode (inside ``mindspore.recompute``) that hands every op to ``handler(op,
    args, kwargs)``, inside ``around`` (the engine's region shell: ``AroundMode``), with PyNative's
    front-end pipeline off while it is active."""

    def __init__(self, handler: Callable[[Any, Tuple[Any, ...], dict], Any], around: Any) -> None:
        super().__init__()
        self._handler = handler
        self.around = (_PipelineOff(), around)

    def __ms_dispatch__(self, func: Any, args: Tuple, kwargs: Optional[Dict] = None) -> Any:
        return self._handler(func, args, kwargs or {})


class MindSporeBackend(Backend):
    name = "mindspore"
    module_method = "construct"
    module_type = "nn.Cell"
    #: ``early_stop`` defaults to False: MindSpore 2.10's early stop raises its stop signal from
    #: inside the saved-tensor hook, and when that happens inside a legacy primitive (e.g. the CPU
    #: ``Dropout``) the recompute's graph bookkeeping breaks ("Stack input_args_info_stack_ is
    #: empty"). ``preserve_rng_state`` maps to MindSpore's ``save_rng_state``.
    checkpoint_options = ("early_stop", "preserve_rng_state")
    rng_replayable = False
    op_list_entries = "op names"

    def __init__(self) -> None:
        target = ms.get_context("device_target")
        self.device_target: str = target
        self.accelerator: Optional[str] = target if target in _ACCELERATORS else None
        self._kinds: Dict[str, OpKind] = {}
        self._prober: Optional[MindSporeProber] = None

    # ------------------------------------------------------------------ tensors
    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, Tensor)

    def storage_id(self, t: Tensor) -> int:
        # The address of the storage's first byte: aliases (views, reshapes, transposes) share it.
        # It is only compared while the swap system holds an alias, so it cannot be reused meanwhile.
        return t.untyped_storage().data_ptr()

    def storage_other_holders(self, aliases: Sequence[Tensor]) -> int:
        # MindSpore exposes no use count of a storage, so "does somebody else still hold it" cannot
        # be answered: every candidate is copied. That stays safe (only the swap system's own
        # references are dropped); it spends bandwidth and a host buffer on shared storages.
        return 0

    def version(self, t: Tensor) -> int:
        # Version bumps happen in PyNative's asynchronous pipeline: wait for it, or an in-place
        # op issued just before would not be counted yet.
        t.wait_pipeline()
        return t._version  # pylint: disable=protected-access

    def alias(self, t: Tensor) -> Tensor:
        # A no-grad view with the same layout, sharing the version counter: holding it keeps the
        # storage alive but not the autograd graph (saved_tensors_hooks forbids packs that do).
        with _shim.internal():
            return t.view(tuple(t.shape))

    def hand_back(self, t: Tensor) -> Tensor:
        # Autograd attaches the recomputed node to the returned tensor object, so it must not be
        # the one the cache (or the swap system) keeps; and it must not be a PyNative stub tensor
        # (a view op's output is one), or a legacy primitive fed by it blocks in backward
        # (see cannot_hand_back): Tensor(view) has the same storage and layout, and is not a stub.
        return Tensor(self.alias(t))

    def clone(self, t: Tensor) -> Tensor:
        with _shim.internal():  # the CPU build has no Clone kernel
            return mint.empty_like(t).copy_(t)

    def saved_facts(self, t: Any, param_keys: Any) -> SavedFacts:
        if not isinstance(t, Tensor):  # nothing a byte copy can rebuild, nor alias
            return SavedFacts(KeepReason.UNSUPPORTED_TENSOR, t, 0, None, 0, None, None, None)
        alias = self.alias(t)
        version = self.version(alias)
        reason = self._unswappable_reason(t)
        if reason is not None:
            nbytes = 0 if reason is KeepReason.UNSUPPORTED_TENSOR else t.untyped_storage().nbytes()
            return SavedFacts(reason, alias, version, None, nbytes, None, None, None)
        key = self.storage_id(t)
        nbytes = t.untyped_storage().nbytes()
        if key in param_keys:
            reason = KeepReason.PARAMETER if self.requires_grad(t) else KeepReason.BUFFER
        elif t._is_leaf and t._requires_grad:  # pylint: disable=protected-access
            reason = KeepReason.PARAMETER
        if reason is not None:
            return SavedFacts(reason, alias, version, key, nbytes, None, None, None)
        meta = ViewMeta(tuple(alias.shape), tuple(alias.stride()), int(alias.storage_offset()), alias.dtype,
                        device_kind(alias))
        # One device per process (``set_device``): its streams order every storage (device None).
        return SavedFacts(None, alias, version, key, nbytes, meta, None, self.current_stream())

    def _unswappable_reason(self, t: Tensor) -> Optional[KeepReason]:
        """Why ``t`` cannot be swapped: a meta or unmaterialised tensor, one on the host, an empty
        storage (``None`` if it can)."""
        try:
            if t.is_meta():
                return KeepReason.UNSUPPORTED_TENSOR
        except Exception:
            pass
        if self.accelerator is not None and device_kind(t) != self.accelerator:
            return KeepReason.ON_HOST
        try:
            if t.untyped_storage().nbytes() == 0:
                return KeepReason.EMPTY
        except Exception:  # a tensor without a device address (not materialised)
            return KeepReason.UNSUPPORTED_TENSOR
        return None

    def requires_grad(self, t: Tensor) -> bool:
        return bool(t._requires_grad)  # pylint: disable=protected-access

    # ------------------------------------------------------------------ byte views, allocation, copies
    @staticmethod
    def _byte_view(t: Tensor) -> Tensor:
        """A flat uint8 tensor over the whole storage of ``t``."""
        with _shim.internal():
            st = t.untyped_storage()
            empty = mint.empty(0, dtype=st.dtype, device=device_kind(t))
            n = st.nbytes() // empty.itemsize
            return empty.set_(st, 0, (n,), (1,)).view(ms.uint8)

    def rebuild_view(self, flat: Tensor, meta: ViewMeta) -> Tensor:
        with _shim.internal():
            typed = self._byte_view(flat).view(meta.dtype)
            out = mint.empty(0, dtype=meta.dtype, device=meta.device)
            return out.set_(typed.untyped_storage(), meta.offset, meta.size, meta.stride)

    # MindSpore 2.10's UntypedStorage cannot be sliced (no storage over part of another), so a
    # bucket's members could not get their own storage back: every storage is copied by itself.
    supports_slots = False

    def slot_bytes(self, buf: Tensor, offset: int, nbytes: int) -> Any:
        raise NotImplementedError("the MindSpore backend cannot make a storage over part of another (no buckets)")

    def empty_device_bytes(self, nbytes: int, like: ViewMeta) -> Tensor:
        with _shim.internal():
            return mint.empty(nbytes, dtype=ms.uint8, device=like.device)

    def empty_host_bytes(self, nbytes: int) -> Tensor:
        with _shim.internal():
            buf = mint.empty(nbytes, dtype=ms.uint8, device="CPU", pin_memory=self.accelerator is not None)
        HOST_MARKS.mark(buf)  # (host memory: the CPU meter never counts it as device memory)
        return buf

    def copy_bytes(self, dst: Tensor, src: Tensor, dst_offset: int = 0) -> None:
        if dst_offset:
            # Only bucketed copies write at an offset, and buckets are off here (supports_slots).
            # (In MindSpore 2.10 a copy into a narrowed view does not reach the base either.)
            raise NotImplementedError("the MindSpore backend copies whole storages only (no buckets)")
        with _shim.internal():
            dst.copy_(self._byte_view(src), non_blocking=True)

    def mark_used_by(self, t: Tensor, stream: Any) -> None:
        record = getattr(t, "record_stream", None)
        if stream is not None and record is not None:
            record(stream)

    # ------------------------------------------------------------------ streams and events
    def host_alloc_size(self, nbytes: int) -> int:
        # MindSpore documents no rounding of pinned host requests: count them as asked.
        return nbytes

    def empty_host_cache(self) -> None:
        # MindSpore documents no cache of pinned host memory: freed buffers go back at once.
        return None

    # A MindSpore process drives one device (``set_device``), so every tensor's streams are the
    # current device's: ``device`` is always ``None``, the current one.
    def current_stream(self, device: Any = None) -> Any:
        return ms.runtime.current_stream() if self.accelerator is not None else None

    def new_copy_stream(self, device: Any = None) -> Any:
        return ms.runtime.Stream() if self.accelerator is not None else None

    def stream_context(self, stream: Any) -> Any:
        if stream is None or self.accelerator is None:
            return contextlib.nullcontext()
        return ms.runtime.StreamCtx(stream)

    def record_event(self, stream: Any) -> Any:
        return stream.record_event() if stream is not None else None

    def wait_event(self, stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def trace_range(self, name: str) -> Any:
        return _MstxRange(name) if self.accelerator == "Ascend" else contextlib.nullcontext()

    # ------------------------------------------------------------------ random numbers
    # The default generator, what the generator-based random ops draw from, for every ``args``
    # (the legacy random primitives keep their state in their kernels: nothing can rewind them).
    # rng_replayable is False: random ops are always kept, so the engine never snapshots the RNG;
    # the planner puts the generator back after each run of a step.
    def rng_state(self, args: Optional[Sequence[Any]]) -> Any:
        try:
            return ms.get_rng_state()
        except Exception:  # pragma: no cover - a MindSpore without a default generator
            return None

    def rng_equal(self, a: Any, b: Any) -> bool:
        return a is b or (a is not None and b is not None and bool((a == b).all()))

    def set_rng_state(self, state: Any) -> None:
        if state is not None:
            ms.set_rng_state(state)

    # ------------------------------------------------------------------ autograd
    def grad_recording(self) -> bool:
        return _shim.recording_grad()

    def in_backward(self) -> bool:
        return _shim.in_backward()

    def saved_tensors_hooks(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> Any:
        return ms.saved_tensors_hooks(pack, unpack)

    def run_checkpoint(self, function: Callable[..., Any], args: Tuple[Any, ...], kwargs: dict,
                       context_fn: Callable[[], Tuple[Any, Any]], options: dict) -> Any:
        # MindSpore always runs a selective region (it cannot replay the RNG; see rng_replayable).
        # recompute_sessions stays False: each half of a split backward recomputes.
        extra = {}
        if "preserve_rng_state" in options:
            extra["save_rng_state"] = bool(options["preserve_rng_state"])
        return ms.recompute(function, *args, use_reentrant=False, early_stop=bool(options.get("early_stop", False)),
                            context_fn=context_fn, **extra, **kwargs)

    def op_mode(self, handler: Callable[[Any, Tuple[Any, ...], dict], Any], around: Any) -> MsDispatchMode:
        return _OpMode(handler, around)

    def session_hooks(self, boxes: Any) -> Any:
        raise NotImplementedError("MindSpore's recompute cannot host recompute sessions (recompute_sessions is False)")

    def recomputed_leaf(self, t: Tensor, requires_grad: bool) -> Tensor:
        raise NotImplementedError("checkpoint_exclude_wrapper is PyTorch only (exclusion_supported is False)")

    def compiling(self) -> bool:
        return False  # PyNative only: graph mode is refused by check_ready

    def run_eagerly(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def run_compiled_checkpoint(self, function: Callable[..., Any], args: Tuple[Any, ...], kwargs: dict,
                                policy_fn: Optional[Callable[..., Any]], options: dict) -> Any:
        raise RuntimeError("hyper_parallel has no compiled path on MindSpore (PyNative only).")

    def check_checkpoint_options(self, options: dict, selective: bool) -> None:
        return None

    def check_ready(self, what: str) -> None:
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise RuntimeError(f"hyper_parallel {what} on MindSpore runs in PyNative mode only "
                               "(mindspore.set_context(mode=mindspore.PYNATIVE_MODE)); in graph mode use "
                               "Cell.recompute().")

    # ------------------------------------------------------------------ ops and policies
    def op_kind(self, op: Any) -> OpKind:
        name = op.name
        kind = self._kinds.get(name)
        if kind is None:
            if name in MACHINERY_OPS:
                kind = OpKind.MACHINERY
            elif is_mutating_op(name):
                kind = OpKind.MUTATING
            elif is_random_op(name):
                kind = OpKind.RANDOM
            else:
                kind = OpKind.PLAIN
            self._kinds[name] = kind
        return kind

    def cannot_hand_back(self, op: Any, args: Tuple[Any, ...]) -> bool:
        # MindSpore 2.10 has two op paths. Most ops are "pyboost" ops; a few (LayerNorm, BiasAdd,
        # FastGeLU, Gather, ReduceMean, OnesLike, Dropout on CPU) are legacy primitives, which a
        # dispatch mode receives as (primitive, name, inputs). When a dispatch mode answers such a
        # call without running it, MindSpore registers the op for autograd itself
        # (PostDispatchGrad), filling each input's abstract with StubNode::ToAbstract(), which
        # waits forever (StubNode::WaitPipeline) for an input that is a PyNative stub tensor made
        # outside the mode, e.g. the region's input. Running the op and handing back the kept
        # output instead attaches autograd to the new run's outputs, so the recomputation saves
        # other tensors than forward did. Such calls are therefore recomputed. Random legacy ops
        # (CPU Dropout) stay kept: re-running them would draw a new mask.
        return is_legacy_primitive_call(args) and not is_random_op(op.name)

    def op_key(self, op: Any) -> Hashable:
        return op.name

    def written_tensors(self, op: Any, args: Tuple[Any, ...], kwargs: dict) -> List[Tensor]:
        # MindSpore's in-place primitives (Inplace*, Assign*, Scatter*) write to their first input.
        if not is_mutating_op(op.name):
            return []
        return [args[0]] if args and isinstance(args[0], Tensor) else []

    def op_list_entry(self, entry: Any) -> Hashable:
        if isinstance(entry, str):
            if not entry:
                raise ValueError("policy list entries must be non-empty op names such as 'MatMul'.")
            return entry
        if (isinstance(entry, type) and issubclass(entry, Primitive)) or isinstance(entry, Primitive):
            return op_name(entry)
        raise TypeError(f"policy list entries must be op names such as 'MatMul' (or mindspore.ops "
                        f"Primitives), got {entry!r} ({type(entry).__name__}).")

    def convert_policy(self, value: Any) -> Optional[CheckpointPolicy]:
        return None  # MindSpore has no policy enum of its own

    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        if isinstance(tree, tuple):
            return tuple(self.tree_map(fn, v) for v in tree)
        if isinstance(tree, list):
            return [self.tree_map(fn, v) for v in tree]
        if isinstance(tree, dict):
            return {k: self.tree_map(fn, v) for k, v in tree.items()}
        return fn(tree)

    def tree_leaves(self, tree: Any) -> List[Any]:
        if isinstance(tree, (tuple, list)):
            return [leaf for v in tree for leaf in self.tree_leaves(v)]
        if isinstance(tree, dict):
            return [leaf for v in tree.values() for leaf in self.tree_leaves(v)]
        return [tree]

    # ------------------------------------------------------------------ modules and hooks
    def is_module(self, x: Any) -> bool:
        return isinstance(x, nn.Cell)

    def self_checkpointing_family(self, cls: type) -> Any:
        return None  # (no MindSpore model library checkpoints its own cells)

    def module_storage_ids(self, module: nn.Cell) -> Set[int]:
        ids = set()
        for p in module.get_parameters():
            try:
                ids.add(self.storage_id(p))
            except Exception:  # not materialised yet (lazy init): nothing can save it
                continue
        return ids

    def has_buffers(self, module: nn.Cell) -> bool:
        return any(not p.requires_grad for p in module.get_parameters())

    def check_region_owner(self, module: nn.Cell, selective: bool) -> None:
        return None

    def register_forward_hooks(self, module: nn.Cell, pre: Callable[..., None],
                               post: Callable[..., None]) -> List[Any]:
        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]

    def register_grad_hook(self, t: Tensor, fn: Callable[[Any], None]) -> None:
        t.register_hook(fn)

    # ------------------------------------------------------------------ the planner
    def prober(self) -> MindSporeProber:
        if self._prober is None:
            self._prober = MindSporeProber(self)
        return self._prober


def pipeline_swap(schedule: Any, prefetch: int = 1, prefix: str = "pp", measure: bool = False) -> Any:
    """Not available on MindSpore: it adapts ``torch.distributed.pipelining`` schedules."""
    raise RuntimeError(
        "pipeline_swap adapts torch.distributed.pipelining schedules; MindSpore has no such schedule "
        "object in PyNative. Drive hyper_parallel.core.microbatch_schedule.MicrobatchSwapSchedule by hand "
        "(forward_start/forward_end/backward_start/backward_end per microbatch, step_end per step), or "
        "use SwapManager's atomic API.")


def pipeline_recompute(schedule: Any) -> Any:
    """Not available on MindSpore: it adapts ``torch.distributed.pipelining`` schedules."""
    raise RuntimeError(
        "pipeline_recompute adapts torch.distributed.pipelining schedules (zero-bubble split backward); "
        "MindSpore has no such schedule object in PyNative, and its recompute does not support recompute "
        "sessions.")
