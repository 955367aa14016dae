"""The backend contract: every primitive the engine asks of a framework, and nothing else.

The engine (everything under ``hyper_parallel.core``) is framework-neutral: it never imports
torch or MindSpore. It reaches the framework only through an object implementing
:class:`Backend`. A backend (``hyper_parallel.backends.torch.TorchBackend``,
``hyper_parallel.backends.mindspore.MindSporeBackend``) implements these primitives and nothing
that is the same algorithm on both frameworks.

Which backend is active is decided once, by the public API module
:mod:`hyper_parallel.core.activation_checkpoint` (``HYPER_PARALLEL_PLATFORM``), which calls
:func:`set_backend`; the engine's entry points then ask :func:`active_backend`.

Values the engine treats as opaque: ``Tensor`` (the framework's tensor), ``Stream``, ``Event``
(``None`` everywhere means "no streams": a CPU build, where copies are synchronous and there is
nothing to order), ``ViewMeta`` (what :meth:`Backend.rebuild_view` needs), ``Op`` (what a dispatch
mode receives as the op), ``Module`` (``nn.Module`` / ``nn.Cell``).

Adding a backend: subclass :class:`Backend`, implement every method (each docstring says what
it must guarantee), and select it in ``hyper_parallel/core/activation_checkpoint/__init__.py``.
``docs/architecture.md`` walks through it.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from typing import (Any, Callable, Container, ContextManager, Hashable, Iterator, List, NamedTuple, Optional, Sequence,
                    Set, Tuple)

from .keep_reason import KeepReason

__all__ = ["Backend", "OpKind", "SavedFacts", "set_backend", "active_backend", "use_backend"]

Tensor = Any
Stream = Any
Event = Any
ViewMeta = Any
Op = Any
Module = Any


class OpKind(enum.Enum):
    """How a selective region treats an op, before any policy is asked."""

    PLAIN = "plain"          # the policy decides
    MACHINERY = "machinery"  # issued by the checkpoint implementation itself: always re-run, never logged
    MUTATING = "mutating"    # writes to an argument: always re-run (replaying its output cannot replay the write)
    RANDOM = "random"        # draws random numbers: see Backend.rng_replayable
    COLLECTIVE = "collective"  # communicates: kept unless the policy answers MUST_RECOMPUTE
    WAIT = "wait"            # waits for a collective's result: as COLLECTIVE, and re-runs with a re-run collective


class SavedFacts(NamedTuple):
    """What the swap path needs to know about one tensor autograd saves, answered by
    :meth:`Backend.saved_facts` in one call (it runs for every saved tensor).

    ``reason`` is ``None`` for a swap candidate, else why the tensor stays on the device as it is.
    ``alias`` (see :meth:`Backend.alias`) and ``version`` (its version counter now) are always set;
    ``nbytes`` is the storage's size (0 where it cannot be measured); ``key`` the storage's
    :meth:`Backend.storage_id` once the tensor passed :meth:`Backend.unswappable_reason` (a
    candidate, a parameter, a buffer), else ``None``. ``meta`` (the alias's
    :meth:`Backend.view_meta`), ``device`` (its :meth:`Backend.device_key`) and ``stream`` (the
    current stream there: the producer) are set for a swap candidate only (else ``None``)."""

    reason: Optional[KeepReason]
    alias: Tensor
    version: int
    key: Optional[int]
    nbytes: int
    meta: Optional[ViewMeta]
    device: Hashable
    stream: Optional[Stream]


class Backend(abc.ABC):
    """Primitives of one framework. Subclasses implement every method."""

    #: ``"torch"`` / ``"mindspore"``.
    name: str = "abstract"
    #: What modules are called in this framework, for error messages (``"nn.Module"``).
    module_type: str = "module"
    #: Name of the method a module runs on call (``"forward"`` / ``"construct"``).
    module_method: str = "forward"
    #: Keyword arguments of ``checkpoint`` that configure the framework's checkpoint rather than
    #: go to the function.
    checkpoint_options: Tuple[str, ...] = ()
    #: Whether the framework restores the RNG state for a recomputation, so that random ops may
    #: run again and draw the same numbers. When False, random ops are always kept (SAVE).
    rng_replayable: bool = True
    #: What a list policy holds, for error messages ("OpOverloads", "op names").
    op_list_entries: str = "ops"
    #: Whether :meth:`run_checkpoint` installs a frame's ``boxes`` (``SessionBoxes``) inside the
    #: framework's checkpoint hooks, so that a ``RecomputeSession`` can share one recomputation
    #: between the halves of a split backward. When False, no boxes are made and each half
    #: recomputes (the framework's behaviour).
    recompute_sessions: bool = False
    #: Whether sub-modules can be excluded from a region's recomputation
    #: (``checkpoint_exclude_wrapper``; needs :meth:`recomputed_leaf` and the frames that
    #: :meth:`run_checkpoint` marks).
    exclusion_supported: bool = False
    #: Whether the op objects a dispatch mode receives live as long as the process (one object per
    #: op, as PyTorch's ``OpOverload``): a selective region then remembers each op's kind per object.
    persistent_ops: bool = False

    # ------------------------------------------------------------------ tensors: identity, layout
    @abc.abstractmethod
    def is_tensor(self, x: Any) -> bool:
        """True for a tensor of this framework."""
        ...

    @abc.abstractmethod
    def storage_id(self, t: Tensor) -> int:
        """Identity of the storage ``t`` views; equal for all views of one storage and stable while
        any of them is alive."""
        ...

    @abc.abstractmethod
    def storage_nbytes(self, t: Tensor) -> int:
        """Bytes of the whole storage ``t`` views (what an offload copies)."""
        ...

    @abc.abstractmethod
    def storage_other_holders(self, aliases: Sequence[Tensor]) -> int:
        """How many tensors other than ``aliases`` still view their (common) storage; 0 when the
        framework cannot tell (then every candidate is copied, which stays safe)."""
        ...

    def offload_blocker(self, aliases: Sequence[Tensor], versions: Sequence[int]) -> Optional[KeepReason]:
        """Why the storage that ``aliases`` (saved tensors, ``versions`` their versions when saved)
        view cannot be offloaded now: ``MODIFIED_IN_PLACE`` when one was changed in place since
        (its :meth:`version` moved), else ``SHARED`` when :meth:`storage_other_holders` is above 0;
        ``None`` when it can go. One call for what an offload checks per storage; the default
        composes those primitives, and an override must give the same answers."""
        for alias, saved in zip(aliases, versions):
            if self.version(alias) != saved:
                return KeepReason.MODIFIED_IN_PLACE
        return KeepReason.SHARED if self.storage_other_holders(aliases) > 0 else None

    @abc.abstractmethod
    def version(self, t: Tensor) -> int:
        """The version counter bumped by every in-place change of ``t``'s data (shared by aliases)."""
        ...

    @abc.abstractmethod
    def view_meta(self, t: Tensor) -> ViewMeta:
        """Everything :meth:`rebuild_view` needs to rebuild ``t`` over a copy of its storage:
        size, stride, storage offset, dtype, device."""
        ...

    @abc.abstractmethod
    def alias(self, t: Tensor) -> Tensor:
        """A view of ``t`` with the same layout, no autograd history, sharing ``t``'s version
        counter; callable from inside a dispatch mode and from a saved-tensor hook."""
        ...

    @abc.abstractmethod
    def clone(self, t: Tensor) -> Tensor:
        """A new tensor with ``t``'s values and layout, in its own storage."""
        ...

    @abc.abstractmethod
    def hand_back(self, t: Tensor) -> Tensor:
        """The tensor a recomputation returns for a kept op output ``t`` (``t`` itself where
        autograd allows it; a fresh alias where autograd attaches its node to the object)."""
        ...

    @abc.abstractmethod
    def unswappable_reason(self, t: Tensor) -> Optional[KeepReason]:
        """Why ``t`` cannot be swapped (``None`` if it can): a tensor type the byte copy cannot
        rebuild, a tensor already in host memory, an empty storage."""
        ...

    @abc.abstractmethod
    def requires_grad(self, t: Tensor) -> bool:
        """Whether ``t`` requires grad (its gradient is computed in backward)."""
        ...

    @abc.abstractmethod
    def is_grad_leaf(self, t: Tensor) -> bool:
        """Whether ``t`` (or the tensor it is a view of) is a leaf that requires grad: a parameter
        or an input being differentiated, held outside any region."""
        ...

    def saved_facts(self, t: Tensor, param_keys: Container[int]) -> SavedFacts:
        """Everything a saved-tensor pack needs to know about ``t`` (see :class:`SavedFacts`), with
        the reason it stays on the device: :meth:`unswappable_reason`, else ``PARAMETER`` /
        ``BUFFER`` when its storage is one of ``param_keys`` (by :meth:`requires_grad`), else
        ``PARAMETER`` for a :meth:`is_grad_leaf`. The default composes those primitives; a backend
        may answer in one call, with exactly the same answers (``tests/test_backend_contract.py``
        compares them)."""
        alias = self.alias(t)
        version = self.version(alias)
        reason = self.unswappable_reason(t)
        if reason is not None:
            nbytes = 0 if reason is KeepReason.UNSUPPORTED_TENSOR else self.storage_nbytes(t)
            return SavedFacts(reason, alias, version, None, nbytes, None, None, None)
        key = self.storage_id(t)
        nbytes = self.storage_nbytes(t)
        if key in param_keys:
            reason = KeepReason.PARAMETER if self.requires_grad(t) else KeepReason.BUFFER
        elif self.is_grad_leaf(t):
            reason = KeepReason.PARAMETER
        if reason is not None:
            return SavedFacts(reason, alias, version, key, nbytes, None, None, None)
        return self.candidate_facts(alias, version, key, nbytes)

    def candidate_facts(self, alias: Tensor, version: int, key: int, nbytes: int) -> SavedFacts:
        """The :class:`SavedFacts` of a swap candidate whose ``alias``, ``version``, storage
        ``key`` and ``nbytes`` are known: its view metadata, device and producer stream added."""
        meta = self.view_meta(alias)
        device = self.device_key(meta)
        return SavedFacts(None, alias, version, key, nbytes, meta, device, self.current_stream(device))

    # ------------------------------------------------------------------ byte views, allocation, copies
    @abc.abstractmethod
    def rebuild_view(self, flat: Any, meta: ViewMeta) -> Tensor:
        """A tensor with ``meta``'s layout over the storage of ``flat`` (a byte tensor, a saved
        tensor of that storage, or what :meth:`slot_bytes` returned)."""
        ...

    #: Whether :meth:`slot_bytes` can make a storage over part of another (bucketed copies need
    #: it, ``core/swap_bucket.py``; without it every storage is copied by itself).
    supports_slots: bool = False

    def slot_bytes(self, buf: Tensor, offset: int, nbytes: int) -> Any:
        """Bytes ``[offset, offset + nbytes)`` of ``buf``'s storage as a storage of their own that
        shares ``buf``'s memory and keeps it alive: views rebuilt over it (:meth:`rebuild_view`)
        keep their original storage offset and storage size. Only called where
        :attr:`supports_slots` is true."""
        raise NotImplementedError(f"{type(self).__name__} cannot make a storage over part of another")

    @abc.abstractmethod
    def empty_device_bytes(self, nbytes: int, like: ViewMeta) -> Tensor:
        """``nbytes`` uninitialised bytes on the device of ``like``, allocated for the current
        (compute) stream."""
        ...

    @abc.abstractmethod
    def empty_host_bytes(self, nbytes: int) -> Tensor:
        """``nbytes`` host bytes, page-locked where the framework offers it (asynchronous copies)."""
        ...

    def host_alloc_size(self, nbytes: int) -> int:
        """Bytes the framework's host allocator really reserves for an :meth:`empty_host_bytes`
        request of ``nbytes`` (what the host pool counts against its cap). The default: exactly
        ``nbytes``."""
        return nbytes

    def empty_host_cache(self) -> None:
        """Return the host memory the framework's host allocator caches (blocks no tensor uses)
        to the operating system. The default does nothing (no caching host allocator)."""
        return None

    @abc.abstractmethod
    def copy_bytes(self, dst: Tensor, src: Tensor, dst_offset: int = 0) -> None:
        """Copy every byte of the storage ``src`` views into the storage of ``dst``, starting at
        byte ``dst_offset`` there (``src`` is a saved tensor or a byte tensor; ``dst`` a byte
        tensor with room for them: the same byte count, or a bucket's buffer) on the current
        stream, asynchronously where possible; invisible to autograd and to user dispatch modes."""
        ...

    @abc.abstractmethod
    def mark_used_by(self, t: Tensor, stream: Stream) -> None:
        """Tell the allocator that ``stream`` uses ``t``: its memory must not be reused before the
        work queued on ``stream`` so far has finished (no-op without streams)."""
        ...

    # ------------------------------------------------------------------ streams and events
    def device_key(self, meta: ViewMeta) -> Hashable:
        """The device whose streams order work on a tensor with this :meth:`view_meta` (what
        :meth:`current_stream` and :meth:`new_copy_stream` take); ``None`` means the current
        device. The default: ``None`` (one device per process)."""
        return None

    @abc.abstractmethod
    def current_stream(self, device: Hashable = None) -> Stream:
        """The stream compute runs on now on ``device`` (a :meth:`device_key`; ``None``: the
        current device); ``None`` without streams."""
        ...

    @abc.abstractmethod
    def new_copy_stream(self, device: Hashable = None) -> Stream:
        """A new stream for copies on ``device`` (a :meth:`device_key`; ``None``: the current
        device); ``None`` without streams."""
        ...

    @abc.abstractmethod
    def stream_context(self, stream: Stream) -> ContextManager[Any]:
        """Make ``stream`` current (on its device) inside the ``with`` block."""
        ...

    def record_event(self, stream: Stream) -> Event:
        """An event marking the work queued on ``stream`` so far (``None`` without streams).
        The default uses the stream protocol torch and MindSpore share (``stream.record_event()``)."""
        return stream.record_event() if stream is not None else None

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Work queued on ``stream`` from now on starts after ``event`` (no-op if either is None).
        The default uses the shared stream protocol (``stream.wait_event(event)``)."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    @abc.abstractmethod
    def trace_range(self, name: str) -> ContextManager[Any]:
        """A named range in the framework's profiler trace; costs nothing unless a profiler records."""
        ...

    # ------------------------------------------------------------------ random numbers
    @abc.abstractmethod
    def rng_state(self, args: Sequence[Any]) -> Any:
        """A snapshot of the generators an op on ``args`` may draw from."""
        ...

    @abc.abstractmethod
    def rng_equal(self, a: Any, b: Any) -> bool:
        """Whether two :meth:`rng_state` snapshots are equal (the op drew nothing)."""
        ...

    @abc.abstractmethod
    def set_rng_state(self, state: Any) -> None:
        """Restore a :meth:`rng_state` snapshot."""
        ...

    # ------------------------------------------------------------------ autograd
    @abc.abstractmethod
    def grad_recording(self) -> bool:
        """Whether ops run now are recorded for a backward (only then is anything saved)."""
        ...

    @abc.abstractmethod
    def in_backward(self) -> bool:
        """Whether the autograd engine runs a backward on this thread (a forward hook that fires
        then belongs to a recomputation)."""
        ...

    @abc.abstractmethod
    def saved_tensors_hooks(self, pack: Callable[[Tensor], Any],
                            unpack: Callable[[Any], Tensor]) -> ContextManager[Any]:
        """Autograd's saved-tensor hooks: ``pack`` on every tensor saved inside, ``unpack`` when
        backward needs it."""
        ...

    @abc.abstractmethod
    def run_checkpoint(self, function: Callable[..., Any], args: Tuple[Any, ...], kwargs: dict,
                       frame: Any, options: dict) -> Any:
        """Run ``function`` under the framework's non-reentrant checkpoint. ``frame`` is the
        call's ``region_state.RegionFrame``. With a ``frame.selective`` region, the forward runs
        under a dispatch mode that calls ``region.forward_op`` for every op and the recomputation
        under one that calls ``region.recompute_op``; both enter
        ``region_state.RegionMarker(recompute, frame)``. Without one, only the markers. Where
        :attr:`recompute_sessions` is true and ``frame.boxes`` is set, the forward context also
        pushes saved-tensor hooks *inside* the checkpoint's own that wrap what the checkpoint packs:
        ``boxes.pack(checkpoint_pack, x)`` / ``boxes.unpack(checkpoint_unpack, box)``.
        ``options`` are the accepted :attr:`checkpoint_options`."""
        ...

    @abc.abstractmethod
    def dispatch_modes(self, region: Any, frame: Any = None) -> Tuple[Any, Any]:
        """The ``(forward, recompute)`` pair of the framework's dispatch modes for a
        ``SelectiveRegion``: they call ``region.forward_op(op, args, kwargs)`` /
        ``region.recompute_op(op, args, kwargs)`` for every op and enter
        ``region_state.RegionMarker(recompute, frame)`` while active."""
        ...

    def recomputed_leaf(self, t: Tensor, requires_grad: bool) -> Tensor:
        """A tensor over ``t``'s data, with no autograd history, that requires grad iff
        ``requires_grad``: what a recomputation receives in place of the output of a sub-module
        excluded from it (``checkpoint_exclude_wrapper``), so that the ops after it save what they
        saved in forward. The default says the backend does not support exclusion."""
        raise RuntimeError(f"checkpoint_exclude_wrapper is not supported on the {self.name} backend (PyTorch "
                           "only); keep the sub-module's outputs with a selective policy (MUST_SAVE for its ops) instead.")

    @abc.abstractmethod
    def compiling(self) -> bool:
        """Whether the framework's compiler is tracing the code that runs now."""
        ...

    @abc.abstractmethod
    def run_eagerly(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` outside any compiled graph (a graph break around it while tracing)."""
        ...

    @abc.abstractmethod
    def run_compiled_checkpoint(self, function: Callable[..., Any], args: Tuple[Any, ...], kwargs: dict,
                                policy_fn: Optional[Callable[..., Any]], options: dict) -> Any:
        """Run ``function`` under the framework's own checkpoint while its compiler traces it:
        whole-region recompute without ``policy_fn``, else the framework's compiled selective
        checkpoint driven by ``policy_fn`` (our answers translated)."""
        ...

    @abc.abstractmethod
    def check_checkpoint_options(self, options: dict, selective: bool) -> None:
        """Raise a clear error for an option combination the framework's checkpoint refuses."""
        ...

    @abc.abstractmethod
    def check_ready(self, what: str) -> None:
        """Raise a clear error if the framework is in a mode the library cannot run in."""
        ...

    # ------------------------------------------------------------------ ops and policies
    @abc.abstractmethod
    def op_kind(self, op: Op) -> OpKind:
        """How a selective region must treat ``op`` before asking any policy (cached by the caller)."""
        ...

    @abc.abstractmethod
    def cannot_hand_back(self, op: Op, args: Tuple[Any, ...]) -> bool:
        """Whether a recomputation cannot return a kept output of this op call instead of running
        it (the framework's autograd would block or attach to the wrong tensor): such a call is
        recomputed whatever the policy answered, and the answer is reported."""
        ...

    @abc.abstractmethod
    def op_key(self, op: Op) -> Hashable:
        """What identifies ``op`` across forward and recompute (and in a list policy)."""
        ...

    @abc.abstractmethod
    def written_tensors(self, op: Op, args: Tuple[Any, ...], kwargs: dict) -> List[Tensor]:
        """The tensor arguments ``op`` writes to, declared or not (empty for ops that write nothing)."""
        ...

    @abc.abstractmethod
    def op_list_entry(self, entry: Any) -> Hashable:
        """The :meth:`op_key` named by one entry of a list policy; a clear error for a bad entry."""
        ...

    @abc.abstractmethod
    def convert_policy(self, value: Any) -> Any:
        """The ``CheckpointPolicy`` meant by a framework-specific policy answer (PyTorch's own
        enum), or ``None``."""
        ...

    @abc.abstractmethod
    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        """``fn`` applied to every leaf of a nested tuple/list/dict structure."""
        ...

    @abc.abstractmethod
    def tree_leaves(self, tree: Any) -> List[Any]:
        """The leaves of a nested tuple/list/dict structure."""
        ...

    # ------------------------------------------------------------------ modules and hooks
    @abc.abstractmethod
    def is_module(self, x: Any) -> bool:
        """True for an ``nn.Module`` / ``nn.Cell``."""
        ...

    @abc.abstractmethod
    def module_tensors(self, module: Module) -> Iterator[Tensor]:
        """The parameters and buffers of ``module`` and its sub-modules."""
        ...

    def module_storage_ids(self, module: Module) -> Set[int]:
        """``storage_id`` of every tensor of :meth:`module_tensors` (read on every call of a swap
        region: a backend may answer in one call)."""
        return {self.storage_id(t) for t in self.module_tensors(module)}

    @abc.abstractmethod
    def has_buffers(self, module: Module) -> bool:
        """Whether ``module`` or a sub-module holds state that ops may update in place (buffers,
        e.g. BatchNorm's running statistics)."""
        ...

    @abc.abstractmethod
    def check_region_owner(self, module: Module, selective: bool) -> None:
        """Raise a clear error if a region that intercepts ops or saved tensors cannot act inside
        ``module`` (a compiled module; with ``selective``, sharded units whose hooks differ
        between forward and recompute)."""
        ...

    @abc.abstractmethod
    def register_forward_hooks(self, module: Module, pre: Callable[[Module, Any], None],
                               post: Callable[[Module, Any, Any], None]) -> List[Any]:
        """Call ``pre(module, args)`` before and ``post(module, args, output)`` after every call of
        ``module`` (``post`` also when the call raised); returns removable handles."""
        ...

    @abc.abstractmethod
    def register_grad_hook(self, t: Tensor, fn: Callable[[Any], None]) -> None:
        """Call ``fn(grad)`` when the gradient of ``t`` is computed in backward."""
        ...



# ---------------------------------------------------------------------- the active backend
_ACTIVE: Optional[Backend] = None


def set_backend(backend: Backend) -> None:
    """Make ``backend`` the one the engine uses (the public API module does this at import)."""
    global _ACTIVE
    if not isinstance(backend, Backend):
        raise TypeError(f"set_backend expects a hyper_parallel Backend, got {type(backend).__name__}")
    _ACTIVE = backend


def active_backend() -> Backend:
    """The backend set by :func:`set_backend`."""
    if _ACTIVE is None:
        raise RuntimeError("no hyper_parallel backend is active: import "
                           "hyper_parallel.core.activation_checkpoint (it selects one) before using the engine.")
    return _ACTIVE


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Run the block with ``backend`` active (e.g. the simulated asynchronous device of
    ``hyper_parallel.testing``); the previous backend is restored afterwards."""
    global _ACTIVE
    previous = _ACTIVE
    set_backend(backend)
    try:
        yield backend
    finally:
        _ACTIVE = previous
