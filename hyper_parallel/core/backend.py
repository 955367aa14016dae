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
    """What the swap path needs to know about one tensor a region saves, answered by
    :meth:`Backend.saved_facts` in one call (it runs for every saved tensor).

    ``reason`` is ``None`` for a swap candidate, else why the tensor stays on the device as it is.
    ``alias`` (see :meth:`Backend.alias`) and ``version`` (its version counter now) are always set;
    ``nbytes`` is the storage's size (0 where it cannot be measured); ``key`` the storage's
    :meth:`Backend.storage_id` for a candidate, a parameter or a buffer, else ``None``. ``meta``
    (what :meth:`Backend.rebuild_view` and :meth:`Backend.empty_device_bytes` need: size, stride,
    storage offset, dtype, device), ``device`` (the device whose streams order the storage's
    copies, what :meth:`Backend.current_stream` and :meth:`Backend.new_copy_stream` take) and
    ``stream`` (the current stream there: the producer) are set for a swap candidate only (else
    ``None``)."""

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
    #: Whether a frame's ``boxes`` (``SessionBoxes``) can be installed inside the framework's
    #: checkpoint hooks (:meth:`session_hooks`), so that a ``RecomputeSession`` can share one
    #: recomputation between the halves of a split backward. When False, no boxes are made and
    #: each half recomputes (the framework's behaviour).
    recompute_sessions: bool = False
    #: Whether sub-modules can be excluded from a region's recomputation
    #: (``checkpoint_exclude_wrapper``; needs :meth:`recomputed_leaf`).
    exclusion_supported: bool = False
    #: Whether the op objects a dispatch mode receives live as long as the process (one object per
    #: op, as PyTorch's ``OpOverload``): a selective region then remembers each op's kind per object.
    persistent_ops: bool = False

    # ------------------------------------------------------------------ tensors
    @abc.abstractmethod
    def is_tensor(self, x: Any) -> bool:
        """True for a tensor of this framework."""

    @abc.abstractmethod
    def storage_id(self, t: Tensor) -> int:
        """Identity of the storage ``t`` views; equal for all views of one storage and stable while
        any of them is alive."""

    @abc.abstractmethod
    def saved_facts(self, t: Tensor, param_keys: Container[int]) -> SavedFacts:
        """Everything the swap path needs to know about a tensor a region saves (see
        :class:`SavedFacts`), in one call: it runs for every tensor autograd saves in a swap
        region. The reason it stays on the device, checked in this order: ``UNSUPPORTED_TENSOR``
        (a tensor type a byte copy cannot rebuild), ``ON_HOST`` (already in host memory),
        ``EMPTY`` (an empty storage), ``PARAMETER`` / ``BUFFER`` when its storage is one of
        ``param_keys`` (by whether it requires grad), ``PARAMETER`` for a view of a leaf that
        requires grad (a parameter or an input being differentiated, held outside the region);
        else it is a swap candidate. Callable from a saved-tensor hook and from inside a dispatch
        mode (below autograd, where the alias must still share the version counter)."""

    @abc.abstractmethod
    def storage_other_holders(self, aliases: Sequence[Tensor]) -> int:
        """How many tensors other than ``aliases`` still view their (common) storage; 0 when the
        framework cannot tell (then every candidate is copied, which stays safe)."""

    @abc.abstractmethod
    def version(self, t: Tensor) -> int:
        """The version counter bumped by every in-place change of ``t``'s data (shared by aliases)."""

    @abc.abstractmethod
    def alias(self, t: Tensor) -> Tensor:
        """A view of ``t`` with the same layout, no autograd history, sharing ``t``'s version
        counter; callable from inside a dispatch mode and from a saved-tensor hook."""

    @abc.abstractmethod
    def clone(self, t: Tensor) -> Tensor:
        """A new tensor with ``t``'s values and layout, in its own storage."""

    @abc.abstractmethod
    def hand_back(self, t: Tensor) -> Tensor:
        """The tensor a recomputation returns for a kept op output ``t`` (``t`` itself where
        autograd allows it; a fresh alias where autograd attaches its node to the object)."""

    @abc.abstractmethod
    def requires_grad(self, t: Tensor) -> bool:
        """Whether ``t`` requires grad (its gradient is computed in backward)."""

    # ------------------------------------------------------------------ byte views, allocation, copies
    @abc.abstractmethod
    def rebuild_view(self, flat: Any, meta: ViewMeta) -> Tensor:
        """A tensor with ``meta``'s layout over the storage of ``flat`` (a byte tensor, a saved
        tensor of that storage, or what :meth:`slot_bytes` returned)."""

    #: Whether :meth:`slot_bytes` can make a storage over part of another (bucketed copies need
    #: it, ``core/swap_bucket.py``; without it every storage is copied by itself).
    supports_slots: bool = False

    @abc.abstractmethod
    def slot_bytes(self, buf: Tensor, offset: int, nbytes: int) -> Any:
        """Bytes ``[offset, offset + nbytes)`` of ``buf``'s storage as a storage of their own that
        shares ``buf``'s memory and keeps it alive: views rebuilt over it (:meth:`rebuild_view`)
        keep their original storage offset and storage size. Only called where
        :attr:`supports_slots` is true (elsewhere: raise)."""

    @abc.abstractmethod
    def empty_device_bytes(self, nbytes: int, like: ViewMeta) -> Tensor:
        """``nbytes`` uninitialised bytes on the device of ``like``, allocated for the current
        (compute) stream."""

    @abc.abstractmethod
    def empty_host_bytes(self, nbytes: int) -> Tensor:
        """``nbytes`` host bytes, page-locked where the framework offers it (asynchronous copies)."""

    @abc.abstractmethod
    def host_alloc_size(self, nbytes: int) -> int:
        """Bytes the framework's host allocator really reserves for an :meth:`empty_host_bytes`
        request of ``nbytes`` (what the host pool counts against its cap)."""

    @abc.abstractmethod
    def empty_host_cache(self) -> None:
        """Return the host memory the framework's host allocator caches (blocks no tensor uses)
        to the operating system (nothing where it caches none)."""

    @abc.abstractmethod
    def copy_bytes(self, dst: Tensor, src: Tensor, dst_offset: int = 0) -> None:
        """Copy every byte of the storage ``src`` views into the storage of ``dst``, starting at
        byte ``dst_offset`` there (``src`` is a saved tensor or a byte tensor; ``dst`` a byte
        tensor with room for them: the same byte count, or a bucket's buffer) on the current
        stream, asynchronously where possible; invisible to autograd and to user dispatch modes."""

    @abc.abstractmethod
    def mark_used_by(self, t: Tensor, stream: Stream) -> None:
        """Tell the allocator that ``stream`` uses ``t``: its memory must not be reused before the
        work queued on ``stream`` so far has finished (no-op without streams)."""

    # ------------------------------------------------------------------ streams and events
    @abc.abstractmethod
    def current_stream(self, device: Hashable = None) -> Stream:
        """The stream compute runs on now on ``device`` (a :attr:`SavedFacts.device`; ``None``: the
        current device); ``None`` without streams."""

    @abc.abstractmethod
    def new_copy_stream(self, device: Hashable = None) -> Stream:
        """A new stream for copies on ``device`` (a :attr:`SavedFacts.device`; ``None``: the
        current device); ``None`` without streams."""

    @abc.abstractmethod
    def stream_context(self, stream: Stream) -> ContextManager[Any]:
        """Make ``stream`` current (on its device) inside the ``with`` block."""

    @abc.abstractmethod
    def record_event(self, stream: Stream) -> Event:
        """An event marking the work queued on ``stream`` so far (``None`` without streams)."""

    @abc.abstractmethod
    def wait_event(self, stream: Stream, event: Event) -> None:
        """Work queued on ``stream`` from now on starts after ``event`` (no-op if either is None)."""

    @abc.abstractmethod
    def trace_range(self, name: str) -> ContextManager[Any]:
        """A named range in the framework's profiler trace; costs nothing unless a profiler records."""

    # ------------------------------------------------------------------ random numbers
    @abc.abstractmethod
    def rng_state(self, args: Optional[Sequence[Any]]) -> Any:
        """A snapshot of the generators an op on ``args`` may draw from; ``args=None``: of every
        generator of the process (what a whole training step may draw from: the planner puts it
        back after each run of the step)."""

    @abc.abstractmethod
    def rng_equal(self, a: Any, b: Any) -> bool:
        """Whether two :meth:`rng_state` snapshots are equal (the op drew nothing)."""

    @abc.abstractmethod
    def set_rng_state(self, state: Any) -> None:
        """Restore a :meth:`rng_state` snapshot."""

    # ------------------------------------------------------------------ autograd
    @abc.abstractmethod
    def grad_recording(self) -> bool:
        """Whether ops run now are recorded for a backward (only then is anything saved)."""

    @abc.abstractmethod
    def in_backward(self) -> bool:
        """Whether the autograd engine runs a backward on this thread (a forward hook that fires
        then belongs to a recomputation)."""

    @abc.abstractmethod
    def saved_tensors_hooks(self, pack: Callable[[Tensor], Any],
                            unpack: Callable[[Any], Tensor]) -> ContextManager[Any]:
        """Autograd's saved-tensor hooks: ``pack`` on every tensor saved inside, ``unpack`` when
        backward needs it."""

    @abc.abstractmethod
    def run_checkpoint(self, function: Callable[..., Any], args: Tuple[Any, ...], kwargs: dict,
                       context_fn: Callable[[], Tuple[Any, Any]], options: dict) -> Any:
        """Run ``function(*args, **kwargs)`` under the framework's non-reentrant checkpoint with
        ``context_fn`` (the ``(forward, recompute)`` context pair the engine builds:
        ``region_state.region_contexts``). ``options`` are the accepted :attr:`checkpoint_options`."""

    @abc.abstractmethod
    def op_mode(self, handler: Callable[[Op, Tuple[Any, ...], dict], Any], around: ContextManager[Any]) -> Any:
        """A dispatch mode of the framework that returns ``handler(op, args, kwargs)`` for every
        op run while it is active, and enters ``around`` (the engine's ``RegionShell``) before it
        becomes active and leaves it after. A mode object may be entered again once left."""

    @abc.abstractmethod
    def session_hooks(self, boxes: Any) -> ContextManager[Any]:
        """Saved-tensor hooks pushed *inside* the checkpoint's own (this is called while the
        checkpoint's forward context is entered) that wrap what the checkpoint packs:
        ``boxes.pack(checkpoint_pack, x)`` / ``boxes.unpack(checkpoint_unpack, box)``. Only called
        where :attr:`recompute_sessions` is true (elsewhere: raise)."""

    @abc.abstractmethod
    def recomputed_leaf(self, t: Tensor, requires_grad: bool) -> Tensor:
        """A tensor over ``t``'s data, with no autograd history, that requires grad iff
        ``requires_grad``: what a recomputation receives in place of the output of a sub-module
        excluded from it (``checkpoint_exclude_wrapper``), so that the ops after it save what they
        saved in forward. Only called where :attr:`exclusion_supported` is true (elsewhere: raise
        a clear error)."""

    @abc.abstractmethod
    def compiling(self) -> bool:
        """Whether the framework's compiler is tracing the code that runs now."""

    @abc.abstractmethod
    def run_eagerly(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` outside any compiled graph (a graph break around it while tracing)."""

    @abc.abstractmethod
    def run_compiled_checkpoint(self, function: Callable[..., Any], args: Tuple[Any, ...], kwargs: dict,
                                policy_fn: Optional[Callable[..., Any]], options: dict) -> Any:
        """Run ``function`` under the framework's own checkpoint while its compiler traces it:
        whole-region recompute without ``policy_fn``, else the framework's compiled selective
        checkpoint driven by ``policy_fn`` (our answers translated)."""

    @abc.abstractmethod
    def check_checkpoint_options(self, options: dict, selective: bool) -> None:
        """Raise a clear error for an option combination the framework's checkpoint refuses."""

    @abc.abstractmethod
    def check_ready(self, what: str) -> None:
        """Raise a clear error if the framework is in a mode the library cannot run in."""

    # ------------------------------------------------------------------ ops and policies
    @abc.abstractmethod
    def op_kind(self, op: Op) -> OpKind:
        """How a selective region must treat ``op`` before asking any policy (cached by the caller)."""

    @abc.abstractmethod
    def cannot_hand_back(self, op: Op, args: Tuple[Any, ...]) -> bool:
        """Whether a recomputation cannot return a kept output of this op call instead of running
        it (the framework's autograd would block or attach to the wrong tensor): such a call is
        recomputed whatever the policy answered, and the answer is reported."""

    @abc.abstractmethod
    def op_key(self, op: Op) -> Hashable:
        """What identifies ``op`` across forward and recompute (and in a list policy)."""

    @abc.abstractmethod
    def written_tensors(self, op: Op, args: Tuple[Any, ...], kwargs: dict) -> List[Tensor]:
        """The tensor arguments ``op`` writes to, declared or not (empty for ops that write nothing)."""

    @abc.abstractmethod
    def op_list_entry(self, entry: Any) -> Hashable:
        """The :meth:`op_key` named by one entry of a list policy; a clear error for a bad entry."""

    @abc.abstractmethod
    def convert_policy(self, value: Any) -> Any:
        """The ``CheckpointPolicy`` meant by a framework-specific policy answer (PyTorch's own
        enum), or ``None``."""

    @abc.abstractmethod
    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        """``fn`` applied to every leaf of a nested tuple/list/dict structure."""

    @abc.abstractmethod
    def tree_leaves(self, tree: Any) -> List[Any]:
        """The leaves of a nested tuple/list/dict structure."""

    # ------------------------------------------------------------------ modules and hooks
    @abc.abstractmethod
    def is_module(self, x: Any) -> bool:
        """True for an ``nn.Module`` / ``nn.Cell``."""

    @abc.abstractmethod
    def self_checkpointing_family(self, cls: type) -> Any:
        """The :class:`~hyper_parallel.core.wrapping.SelfCheckpointing` family of a module class
        from a model library of this framework that checkpoints its layers itself (Hugging Face's
        ``GradientCheckpointingLayer``), or ``None``: wrapping recognises such a layer wherever
        it meets one, with no import the user must know about."""

    @abc.abstractmethod
    def module_storage_ids(self, module: Module) -> Set[int]:
        """:meth:`storage_id` of every parameter and buffer of ``module`` and its sub-modules (read
        on every call of a swap region: they are never swap candidates)."""

    @abc.abstractmethod
    def has_buffers(self, module: Module) -> bool:
        """Whether ``module`` or a sub-module holds state that ops may update in place (buffers,
        e.g. BatchNorm's running statistics)."""

    @abc.abstractmethod
    def check_region_owner(self, module: Module, selective: bool) -> None:
        """Raise a clear error if a region that intercepts ops or saved tensors cannot act inside
        ``module`` (a compiled module; with ``selective``, sharded units whose hooks differ
        between forward and recompute)."""

    @abc.abstractmethod
    def register_forward_hooks(self, module: Module, pre: Callable[[Module, Any], None],
                               post: Callable[[Module, Any, Any], None]) -> List[Any]:
        """Call ``pre(module, args)`` before and ``post(module, args, output)`` after every call of
        ``module`` (``post`` also when the call raised); returns removable handles."""

    @abc.abstractmethod
    def register_grad_hook(self, t: Tensor, fn: Callable[[Any], None]) -> None:
        """Call ``fn(grad)`` when the gradient of ``t`` is computed in backward."""

    # ------------------------------------------------------------------ the planner
    @abc.abstractmethod
    def prober(self) -> Any:
        """The planner's part of this framework, working on this backend (one object per backend):
        a :class:`hyper_parallel.planner.prober.Prober` that profiles a training step, probes a
        layer's options and applies plans. The planner asks the active backend for it
        (``active_backend().prober()``); it has no registry of its own."""



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
