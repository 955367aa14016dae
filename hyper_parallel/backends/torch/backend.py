"""``TorchBackend``: the primitives of :class:`hyper_parallel.core.backend.Backend` on PyTorch.

Copies run on an accelerator's copy stream, ordered by events; streams and events come from the
device module (``torch.cuda``, ``torch.npu``, ``torch.xpu``...) so their types always match. On a
CPU-only build every stream operation is a no-op and copies are synchronous, so the same state
machine runs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch
import torch.utils.checkpoint as torch_ckpt
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from hyper_parallel.core.backend import Backend, OpKind, SavedFacts
from hyper_parallel.core.keep_reason import KeepReason
from hyper_parallel.core.policy import CheckpointPolicy, normalize_policy
from hyper_parallel.core.region_state import AroundMode
from hyper_parallel.integrations.transformers import family_of as hf_family_of
from hyper_parallel.tools.memory import host_allocation, mark_host

from . import _shim
from .prober import TorchProber

__all__ = ["TorchBackend", "ViewMeta", "HOST", "not_byte_copyable"]


class ViewMeta(NamedTuple):
    """A saved view's layout: what rebuilds it over a copy of its storage."""

    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: Any  # ``TorchBackend.device_of``: the torch.device (a simulated device's own key there)


#: ``TorchBackend.device_of`` of a storage in host memory next to an accelerator.
HOST = "host"


_TORCH_POLICY = torch_ckpt.CheckpointPolicy
_FROM_TORCH = {
    _TORCH_POLICY.MUST_SAVE: CheckpointPolicy.MUST_SAVE,
    _TORCH_POLICY.PREFER_SAVE: CheckpointPolicy.PREFER_SAVE,
    _TORCH_POLICY.MUST_RECOMPUTE: CheckpointPolicy.MUST_RECOMPUTE,
    _TORCH_POLICY.PREFER_RECOMPUTE: CheckpointPolicy.PREFER_RECOMPUTE,
    # PyTorch eager treats CPU_OFFLOAD as recompute; here it really offloads.
    _TORCH_POLICY.MUST_CPU_OFFLOAD: CheckpointPolicy.MUST_SWAP,
    _TORCH_POLICY.PREFER_CPU_OFFLOAD: CheckpointPolicy.MUST_SWAP,
}

# Ops that update their running_mean / running_var arguments (3 and 4) in place in training
# mode although their schemas do not say so.
_UNDECLARED_WRITES = {op: ((3, "running_mean"), (4, "running_var")) for op in (
    torch.ops.aten.native_batch_norm.default, torch.ops.aten.cudnn_batch_norm.default,
    torch.ops.aten.miopen_batch_norm.default)}

# Issued by torch.utils.checkpoint itself, a different number of times in forward and recompute.
_MACHINERY = frozenset({torch.ops.aten.detach.default, torch.ops.prim.device.default})


class _OpMode(AroundMode, TorchDispatchMode):
    """A dispatch mode that hands every op to ``handler(op, args, kwargs)``, inside ``around``
    (the engine's region shell: ``AroundMode``)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, handler: Callable[[Any, Tuple[Any, ...], dict], Any], around: Any) -> None:
        super().__init__()
        self._handler = handler
        self.around = (around,)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return self._handler(func, args, kwargs or {})


# What a selective policy's answer means to PyTorch's compiled selective checkpoint. MUST_SWAP
# becomes CPU_OFFLOAD, which torch 2.13's partitioner keeps saved on the device (it has no eager
# offload inside compiled graphs): under compile a swapped output behaves as SAVE.
_TO_TORCH = {
    CheckpointPolicy.MUST_SAVE: _TORCH_POLICY.MUST_SAVE,
    CheckpointPolicy.PREFER_SAVE: _TORCH_POLICY.PREFER_SAVE,
    CheckpointPolicy.MUST_RECOMPUTE: _TORCH_POLICY.MUST_RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE: _TORCH_POLICY.PREFER_RECOMPUTE,
    CheckpointPolicy.MUST_SWAP: _TORCH_POLICY.MUST_CPU_OFFLOAD,
}


def _as_torch_policy(policy_fn: Callable[..., Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    answer = policy_fn(ctx, op, *args, **kwargs)
    if isinstance(answer, bool):
        return _TORCH_POLICY.MUST_SAVE if answer else _TORCH_POLICY.PREFER_RECOMPUTE
    if isinstance(answer, _TORCH_POLICY):
        return answer
    return _TO_TORCH[normalize_policy(answer, op)]


def _compiled_contexts(policy_fn: Callable[..., Any]) -> Any:
    """The context pair of PyTorch's compiled selective checkpoint for one of our policies; a
    module-level function in a ``functools.partial`` so that dynamo can treat it as a constant."""
    return torch_ckpt.create_selective_checkpoint_contexts(functools.partial(_as_torch_policy, policy_fn))


class _NoCompileHook:
    """A module hook that always runs eagerly: the layer chain's hooks drive the swap manager
    (copies, events, weak references), which a compiler must not trace. Copies and pickling
    behave as those of the hook it carries."""

    __slots__ = ("hook",)
    _compiler_disabled = False

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook
        if not _NoCompileHook._compiler_disabled:
            # Marked once, on first use: torch.compiler.disable imports dynamo (seconds), which
            # a process that never chains layers should not pay for.
            _NoCompileHook.__call__ = torch.compiler.disable(_NoCompileHook.__call__)  # type: ignore[method-assign]
            _NoCompileHook._compiler_disabled = True

    def __call__(self, *args: Any) -> Any:
        return self.hook(*args)

    def __deepcopy__(self, memo: dict) -> "_NoCompileHook":
        return _NoCompileHook(copy.deepcopy(self.hook, memo))

    def __reduce__(self) -> Any:
        return (_NoCompileHook, (self.hook,))


_new_tuple = tuple.__new__
_STRIDED = torch.strided
_NO_CONTEXT = contextlib.nullcontext()  # reusable: nullcontext keeps no state
# Tensor types whose bytes and view metadata are the whole tensor (subclasses such as DTensor are not).
_PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def not_byte_copyable(t: torch.Tensor) -> bool:
    """A tensor the byte copy cannot rebuild: a subclass, a non-strided layout, a nested tensor (its
    sizes are not one shape), a meta tensor, or a conj/neg view (they carry a lazy bit that a view
    rebuilt from raw bytes would lose)."""
    return (type(t) not in _PLAIN_TENSOR_TYPES or t.layout is not _STRIDED or t.is_nested or t.is_meta
            or t.is_conj() or t.is_neg())


def _submodules(module: torch.nn.Module) -> List[torch.nn.Module]:
    """``module`` and every module below it, each once, ``module`` first (what
    ``module.modules()`` yields, without building names)."""
    out, seen, i = [module], {id(module)}, 0
    while i < len(out):
        for sub in out[i]._modules.values():
            if sub is not None and id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
        i += 1
    return out


class TorchBackend(Backend):
    name = "torch"
    module_method = "forward"
    module_type = "nn.Module"
    # Keyword arguments of torch.utils.checkpoint.checkpoint that pass through.
    checkpoint_options = ("preserve_rng_state", "determinism_check", "debug", "early_stop")
    rng_replayable = True  # torch.utils.checkpoint restores the RNG state for recomputation
    op_list_entries = "OpOverloads"
    recompute_sessions = True
    exclusion_supported = True
    persistent_ops = True  # torch.ops.aten.mm.default and the rest are process-wide singletons

    def __init__(self) -> None:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        self.accelerator: Optional[torch.device] = acc
        self._dm = torch.get_device_module(acc.type) if acc is not None else None
        self._written: Dict[Any, Tuple[Tuple[int, str], ...]] = {}
        self._kinds: Dict[Any, OpKind] = {}
        self._prober: Optional[TorchProber] = None

    # ------------------------------------------------------------------ tensors
    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    # The per-tensor primitives below run for every saved tensor: the shim's functions are bound
    # directly (one call instead of two).
    storage_id = staticmethod(_shim.storage_key)
    version = staticmethod(_shim.version)
    alias = staticmethod(_shim.detach_keeping_version)

    def device_of(self, t: torch.Tensor) -> Any:
        """Where the storage of ``t`` lives: :data:`HOST` for host memory next to an accelerator
        (never swapped), else the device whose streams order its copies. The one per-tensor
        answer a simulated device gives differently (``hyper_parallel.testing``: which simulated
        device, or its host buffers); everything else :meth:`saved_facts` asks is the same code."""
        return HOST if self.accelerator is not None and t.is_cpu else t.device

    def saved_facts(self, t: torch.Tensor, param_keys: Any) -> SavedFacts:
        # One call and one shim call (saved_identity) for everything: this runs for every tensor
        # autograd saves in a swap region, and each further call costs more than its work.
        if not_byte_copyable(t):
            alias = _shim.detach_keeping_version(t)
            return _new_tuple(SavedFacts, (KeepReason.UNSUPPORTED_TENSOR, alias, _shim.version(alias), None, 0,
                                           None, None, None))
        alias, version, key, nbytes = _shim.saved_identity(t)
        device = self.device_of(alias)
        if device is HOST:
            return _new_tuple(SavedFacts, (KeepReason.ON_HOST, alias, version, None, nbytes, None, None, None))
        if nbytes == 0:
            return _new_tuple(SavedFacts, (KeepReason.EMPTY, alias, version, None, 0, None, None, None))
        if key in param_keys:
            reason = KeepReason.PARAMETER if t.requires_grad else KeepReason.BUFFER
            return _new_tuple(SavedFacts, (reason, alias, version, key, nbytes, None, None, None))
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return _new_tuple(SavedFacts, (KeepReason.PARAMETER, alias, version, key, nbytes, None, None, None))
        # Size and stride are tuples. tuple.__new__ directly: a NamedTuple's own constructor is a
        # Python function.
        meta = _new_tuple(ViewMeta, (alias.shape, alias.stride(), alias.storage_offset(), alias.dtype, device))
        return _new_tuple(SavedFacts, (None, alias, version, key, nbytes, meta, device, self.current_stream(device)))

    def storage_other_holders(self, aliases: Sequence[torch.Tensor]) -> int:
        # use count = tensors viewing the storage + 1 for the storage object made here.
        return _shim.storage_use_count(aliases[0].untyped_storage()) - 1 - len(aliases)

    def hand_back(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def clone(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def requires_grad(self, t: torch.Tensor) -> bool:
        return t.requires_grad

    # ------------------------------------------------------------------ byte views, allocation, copies
    # Autograd never sees these ops: their inputs are detached aliases and byte tensors that do
    # not require grad, so no grad-mode context is needed around them.
    def rebuild_view(self, flat: Any, meta: ViewMeta) -> torch.Tensor:
        storage = flat if isinstance(flat, torch.UntypedStorage) else flat.untyped_storage()
        return torch.empty(0, dtype=meta.dtype, device=storage.device).set_(storage, meta.offset, meta.size, meta.stride)

    supports_slots = True

    def slot_bytes(self, buf: torch.Tensor, offset: int, nbytes: int) -> torch.UntypedStorage:
        # Slicing an UntypedStorage makes a StorageImpl over the same memory whose deleter holds a
        # reference to the whole one: the bucket's block is freed when its last slot dies. The
        # caching allocator knows only the whole block, so ``mark_used_by`` is always given that.
        return buf.untyped_storage()[offset:offset + nbytes]

    def empty_device_bytes(self, nbytes: int, like: ViewMeta) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=like.device)

    def empty_host_bytes(self, nbytes: int) -> torch.Tensor:
        # Pinned memory makes D2H/H2D truly asynchronous; a CPU-only build has none. Marked as host
        # memory: a CPU memory meter never counts it as device memory.
        with host_allocation():
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.accelerator is not None)
        mark_host(buf)
        return buf

    def host_alloc_size(self, nbytes: int) -> int:
        # PyTorch's caching host allocator reserves the next power of two for a pinned request
        # (unless PYTORCH_CUDA_ALLOC_CONF sets pinned_max_round_threshold below it: then this
        # over-counts, which keeps a host cap safe). Plain host memory is not rounded.
        return _shim.pinned_alloc_size(nbytes) if self.accelerator is not None else nbytes

    def empty_host_cache(self) -> None:
        if self.accelerator is not None:
            _shim.empty_host_cache()

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor, dst_offset: int = 0) -> None:
        source = src.untyped_storage()
        target = dst.untyped_storage()
        if dst_offset == 0 and target.nbytes() == source.nbytes():
            # A storage-to-storage copy: the same asynchronous copy on the current stream as
            # Tensor.copy_, without building a byte view of the source first.
            target.copy_(source, non_blocking=True)
            return
        # Into a slot of a bucket's buffer: a tensor copy between byte views, so that the copy sees
        # the buffer's own allocation (the host allocator records the copy against that pinned
        # block; a storage slice would be memory it does not know, and a new storage to tools
        # that count storages).
        whole = torch.empty(0, dtype=torch.uint8, device=src.device).set_(source)
        dst.narrow(0, dst_offset, source.nbytes()).copy_(whole, non_blocking=True)

    def mark_used_by(self, t: torch.Tensor, stream: Any) -> None:
        if stream is not None and t.device.type != "cpu":
            t.record_stream(stream)

    # ------------------------------------------------------------------ streams and events
    # Streams and events belong to one device: a model moved to cuda:1 without
    # torch.cuda.set_device(1) computes on cuda:1's current stream, not the current device's.
    def current_stream(self, device: Any = None) -> Any:
        return self._dm.current_stream(device) if self._dm is not None else None

    def new_copy_stream(self, device: Any = None) -> Any:
        if self._dm is None:
            return None
        return self._dm.Stream(device=device) if device is not None else self._dm.Stream()

    def stream_context(self, stream: Any) -> Any:
        if stream is None or self._dm is None:
            return _NO_CONTEXT
        return self._dm.stream(stream)

    def record_event(self, stream: Any) -> Any:
        return stream.record_event() if stream is not None else None

    def wait_event(self, stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    trace_range = staticmethod(_shim.trace_range)  # (opened several times per layer)

    # ------------------------------------------------------------------ random numbers
    def rng_state(self, args: Optional[Sequence[Any]]) -> Any:
        if args is None:  # (every generator: the CPU's and every device's of the accelerator)
            devices = {torch.device(self.accelerator.type, i) for i in range(self._dm.device_count())} \
                if self._dm is not None else set()
        else:
            devices = {t.device for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.device.type != "cpu"}
        state: List[Tuple[Optional[torch.device], torch.Tensor]] = [(None, torch.get_rng_state())]
        for device in devices:
            module = torch.get_device_module(device.type)
            state.append((device, module.get_rng_state(device)))
        return state

    def rng_equal(self, a: Any, b: Any) -> bool:
        return len(a) == len(b) and all(da == db and torch.equal(sa, sb) for (da, sa), (db, sb) in zip(a, b))

    def set_rng_state(self, state: Any) -> None:
        for device, value in state:
            if device is None:
                torch.set_rng_state(value)
            else:
                torch.get_device_module(device.type).set_rng_state(value, device)

    # ------------------------------------------------------------------ autograd
    def grad_recording(self) -> bool:
        return torch.is_grad_enabled()

    in_backward = staticmethod(_shim.in_backward)  # (asked on every region call and chain hook)

    def saved_tensors_hooks(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def run_checkpoint(self, function: Callable[..., Any], args: Tuple[Any, ...], kwargs: dict,
                       context_fn: Callable[[], Tuple[Any, Any]], options: dict) -> Any:
        if options.get("debug"):  # (whole-region only: check_checkpoint_options refuses a policy)
            context_fn = torch_ckpt.noop_context_fn  # debug mode insists on the default contexts
        return torch_ckpt.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn,
                                     **options, **kwargs)

    def op_mode(self, handler: Callable[[Any, Tuple[Any, ...], dict], Any], around: Any) -> TorchDispatchMode:
        return _OpMode(handler, around)

    def session_hooks(self, boxes: Any) -> Any:
        inner = _shim.innermost_saved_tensors_hooks()  # the checkpoint's own: this runs inside them
        if inner is None:
            return _NO_CONTEXT
        pack, unpack = inner
        return torch.autograd.graph.saved_tensors_hooks(functools.partial(boxes.pack, pack),
                                                        functools.partial(boxes.unpack, unpack))

    def compiling(self) -> bool:
        return torch.compiler.is_compiling()

    def run_eagerly(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return torch.compiler.disable(fn)(*args, **kwargs)

    def run_compiled_checkpoint(self, function: Callable[..., Any], args: Tuple[Any, ...], kwargs: dict,
                                policy_fn: Optional[Callable[..., Any]], options: dict) -> Any:
        if policy_fn is None:  # dynamo recognises the default context_fn only when none is passed
            return torch_ckpt.checkpoint(function, *args, use_reentrant=False, **options, **kwargs)
        return torch_ckpt.checkpoint(function, *args, use_reentrant=False,
                                     context_fn=functools.partial(_compiled_contexts, policy_fn), **options, **kwargs)

    def recomputed_leaf(self, t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        leaf = t.detach()
        leaf.requires_grad_(requires_grad)
        return leaf

    def check_checkpoint_options(self, options: dict, selective: bool) -> None:
        if options.get("debug") and selective:
            raise ValueError("checkpoint: debug=True cannot be combined with policy_fn (PyTorch's debug "
                             "mode only works with its default context_fn); drop one of them.")

    def check_ready(self, what: str) -> None:
        return None  # eager PyTorch has no mode the library cannot run in

    # ------------------------------------------------------------------ ops and policies
    def op_kind(self, op: Any) -> OpKind:
        # Asked once per op and region (every selective region of every step): remembered per op,
        # whose kind never changes (its schema, namespace and tags are fixed).
        kind = self._kinds.get(op)
        if kind is None:
            kind = self._kinds[op] = self._classify(op)
        return kind

    @staticmethod
    def _classify(op: Any) -> OpKind:
        if op in _MACHINERY:
            return OpKind.MACHINERY
        schema = getattr(op, "_schema", None)
        if schema is not None and schema.is_mutable:
            return OpKind.MUTATING  # in-place collectives too: replaying an output cannot replay a write
        collective = _shim.functional_collective(op)
        if collective is not None:
            return OpKind.WAIT if collective == "wait" else OpKind.COLLECTIVE
        if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
            return OpKind.RANDOM
        return OpKind.PLAIN

    def cannot_hand_back(self, op: Any, args: Tuple[Any, ...]) -> bool:
        return False

    def op_key(self, op: Any) -> Hashable:
        return op

    def written_tensors(self, op: Any, args: Tuple[Any, ...], kwargs: dict) -> List[torch.Tensor]:
        spec = self._written.get(op)
        if spec is None:
            schema = getattr(op, "_schema", None)
            spec = tuple((i, a.name) for i, a in enumerate(schema.arguments if schema is not None else ())
                         if a.alias_info is not None and a.alias_info.is_write) + _UNDECLARED_WRITES.get(op, ())
            self._written[op] = spec
        out = []
        for i, name in spec:
            value = args[i] if i < len(args) else kwargs.get(name)
            out.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
        return out

    def op_list_entry(self, entry: Any) -> Hashable:
        if isinstance(entry, torch._ops.OpOverloadPacket):
            raise ValueError(
                f"policy list entry {entry} is an OpOverloadPacket; name one overload, e.g. "
                f"torch.ops.aten.mm.default instead of torch.ops.aten.mm.")
        if not isinstance(entry, torch._ops.OpOverload):
            raise TypeError(f"policy list entries must be torch OpOverloads such as "
                            f"torch.ops.aten.mm.default, got {entry!r} ({type(entry).__name__}).")
        return entry

    def convert_policy(self, value: Any) -> Optional[CheckpointPolicy]:
        return _FROM_TORCH.get(value) if isinstance(value, _TORCH_POLICY) else None

    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):  # the common case (one op output), without pytree
            return fn(tree)
        return tree_map(fn, tree)

    def tree_leaves(self, tree: Any) -> List[Any]:
        if isinstance(tree, torch.Tensor):  # the common case (a layer's output), without pytree
            return [tree]
        return tree_leaves(tree)

    # ------------------------------------------------------------------ modules and hooks
    def is_module(self, x: Any) -> bool:
        return isinstance(x, torch.nn.Module)

    def self_checkpointing_family(self, cls: type) -> Any:
        return hf_family_of(cls)  # Hugging Face's layers (recognised by name: transformers is not imported)

    def module_storage_ids(self, module: torch.nn.Module) -> Set[int]:
        # Called on every region call: read the live parameter/buffer dicts (FSDP2 swaps entries
        # of ``_parameters`` directly, ``_apply`` swaps storages), but skip ``named_modules``'
        # name building; one shim call for all the keys (a shared tensor seen twice does no harm).
        return _shim.storage_keys([t for m in _submodules(module) for d in (m._parameters, m._buffers)
                                   for t in d.values() if t is not None])

    def has_buffers(self, module: torch.nn.Module) -> bool:
        return next(module.buffers(), None) is not None

    def check_region_owner(self, module: torch.nn.Module, selective: bool) -> None:
        if _shim.is_compiled_module(module):
            # Inside code compiled by torch.compile, PyTorch disables saved-tensor hooks and a
            # dispatch mode sees only the compiled kernels: nothing could be kept or swapped.
            raise ValueError(
                f"{type(module).__name__} is a torch.compile'd module: a selective policy, swap_inputs or "
                "swap_wrapper cannot act inside compiled code (PyTorch disables saved-tensor hooks there). "
                "Wrap the original layers first and compile afterwards (torch.compile(model), or "
                "layer.compile() in place); whole-layer recompute (checkpoint_wrapper without policy_fn) "
                "of a compiled block works.")
        if not selective:
            return
        # FSDP2 units inside a selective region run their all-gather/reshard hooks differently in
        # forward and in recompute, which a selective policy cannot replay: say so plainly.
        fsdp = _shim.fsdp_module_class()
        if fsdp is None:
            return
        inner = [sub for sub in _submodules(module)[1:] if isinstance(sub, fsdp)]
        if inner:
            name = next(n for n, sub in module.named_modules() if sub is inner[0])
            raise ValueError(
                f"checkpoint_wrapper with a policy_fn around a module that contains fully_shard units "
                f"({name!r}) is not supported: wrap each layer with checkpoint_wrapper/swap_wrapper "
                "first, then apply fully_shard to the layers and the root.")

    def register_forward_hooks(self, module: torch.nn.Module, pre: Callable[..., None],
                               post: Callable[..., None]) -> List[Any]:
        return [module.register_forward_pre_hook(_NoCompileHook(pre)),
                module.register_forward_hook(_NoCompileHook(post), always_call=True)]

    def register_grad_hook(self, t: torch.Tensor, fn: Callable[[Any], None]) -> None:
        t.register_hook(fn)

    # ------------------------------------------------------------------ the planner
    def prober(self) -> TorchProber:
        if self._prober is None:
            self._prober = TorchProber(self)
        return self._prober
