"""The planner's MindSpore part (PyNative): profile a training step, probe a layer's options in isolation.

The algorithm is :class:`~hyper_parallel.planner.chain_prober.ChainProber`'s, written once for every
framework; this module gives it MindSpore's primitives: ``mindspore.utils.MsDispatchMode`` for
the op trace (MindSpore hands a new op object per call, so ops are keyed by ``op.name``;
PyNative's front-end pipeline is off while a mode of this module is active, or the mode would
miss ops), ``mindspore.saved_tensors_hooks`` for what autograd saves, ``Cell`` forward (pre-)hooks
for the segments and a gradient hook on each layer's output for the start of its backward
(:mod:`hyper_parallel.planner.segments`), ``copy.deepcopy`` of a ``Cell`` for the probes (it
copies parameters and gives every primitive a fresh kernel, so a copy's dropout starts its own
random stream), and ``mindspore.vjp`` to run a probe's backward.

Profiling (``profile_step``) calls the user's ``step_fn`` twice: once instrumented (segments, ops,
saved storages, memory), once timed (each layer's forward and backward, one input of each kind of
layer kept for the probes). Around both calls what the step changes is put back:

- tensors that existed before the step and that it wrote in place: the first argument of ops
  that write one (``Inplace*``, ``Assign*``, ``Scatter*``) and every tensor argument of a legacy
  primitive that declares ``side_effect_mem`` (``BatchNorm``'s moving statistics, written by its
  kernel without a version bump) are copied to the host before the op and copied back after the
  step. A write no dispatch mode sees (``Tensor.__setitem__`` on CPU) is not put back.
- random numbers: the default generator (``mindspore.get_rng_state``, what the generator-based
  random ops draw from) is put back; MindSpore's legacy random primitives (the CPU ``Dropout``)
  keep their state in their kernel, which nothing can rewind, so during the planner's calls each
  one runs as a fresh copy of itself (``copy.deepcopy`` of the primitive, same seeds) and the
  model's own primitives never draw: after planning the next step draws the masks it would have
  drawn without it.
- gradients: MindSpore returns them from ``grad`` / ``value_and_grad`` and keeps none on the
  parameters, so nothing is kept there to restore; gradients a step accumulates into tensors of
  its own are in-place writes (above).

Memory, what is measured and what is estimated:

- **Ascend / GPU**: MindSpore's allocator statistics (``mindspore.runtime.memory_allocated``,
  ``max_memory_allocated``, ``reset_peak_memory_stats``, after ``synchronize``): measured, as the
  budget means it.
- **CPU**: MindSpore's CPU build keeps no statistics (``memory_allocated()`` is 0 there by
  definition; its CPU memory pool reserves about 1 GiB up front, so the process's heap says
  nothing either). The planner counts live tensors itself (:class:`LiveTensorMeter`), each
  storage once (by the address of its first byte, which views share), as the torch prober's CPU
  meter does, with what MindSpore allows: MindSpore tensors take weak references, but a storage
  object belongs to one tensor object and dies with it while views keep the memory, and autograd
  holds what it saves without any Python object; so a storage counts while a tensor object of it
  that the meter saw is alive: the inputs and outputs of every op a dispatch mode sees, what
  autograd saves (through a saved-tensor hook whose packed alias lives exactly as long as autograd
  keeps it), parameter gradients (a gradient hook on every parameter the step reaches, kept until
  the region ends: MindSpore returns them all at the end), and, at every segment boundary, the
  MindSpore tensors the garbage collector's young generations hold that no mode saw (the engine
  makes its own aliases, swap reload buffers and caches out of the dispatch modes' sight). The
  swap engine's host buffers are host memory and never counted. This is an **estimate**: it misses
  what only C++ holds and no visible op touches (the outputs of backward kernels that do not
  pass a dispatch mode, e.g. those of the legacy primitives ``LayerNorm``, ``BiasAdd``,
  ``Dropout``, ``Gather`` and of ``Softmax``, counted only while a visible op reads them; the contiguous
  copies MindSpore makes of view inputs before a kernel, counted while that kernel runs or while
  autograd saves them), the engine's hidden tensors between two boundaries, and allocator rounding
  and caching. The profile says so in its notes.

Probing (``probe``) runs deep copies of one layer alone, chained through the layer chain as the
model's layers are, on the input it received in the step (kept as numpy copies), forward and
``vjp`` backward, and reads the difference at each segment (see
:mod:`hyper_parallel.planner.chain_prober`). Times are CPU time of the process on a CPU (MindSpore's
work runs on a few threads; a shared machine's wall clock would time the neighbours), wall time
on an accelerator; every timed run has the pipeline off and the random primitives shielded, as
above.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops import Primitive
from mindspore.utils import MsDispatchMode

from hyper_parallel.core.backend import Backend, active_backend
from hyper_parallel.planner.options import OpKey
from hyper_parallel.planner.chain_prober import ChainProber, LayerLog, OpTimes, StepTrace, fastest_seconds, layer_output, tensors_in
from hyper_parallel.planner.step_state import StepState

from . import _shim
from .op_classes import is_legacy_primitive_call, is_random_op, op_name

__all__ = ["MindSporeProber", "LiveTensorMeter", "AllocatorMeter", "EXPENSIVE_OPS", "memory_meter", "HOST_MARKS"]

#: Ops whose outputs the fixed recipes save or swap (matmuls, attention kernels, convolutions).
EXPENSIVE_OPS = frozenset({"MatMul", "MatMulExt", "BatchMatMul", "BatchMatMulExt", "Dense", "Baddbmm",
                           "FlashAttentionScore", "Conv2D", "Conv2DExt", "Convolution"})
_ACCELERATORS = ("Ascend", "GPU")


def _accelerator() -> Optional[str]:
    target = ms.get_context("device_target")
    return target if target in _ACCELERATORS else None


def _clock() -> Callable[[], float]:
    """CPU time of the process on a CPU (all of MindSpore's threads, not the neighbours'), the wall
    clock where the work runs on an accelerator."""
    return time.perf_counter if _accelerator() is not None else time.process_time


def _synchronize() -> None:
    """Wait for every launched kernel: MindSpore runs kernels asynchronously on a CPU too (a copy
    returns in microseconds and runs for milliseconds after). On a CPU the public
    ``mindspore.runtime.synchronize()`` declines (it logs "CPU device is not supported" and
    returns), so the PyNative executor's own stream sync is used there (private: the shim's
    ``sync_pynative``)."""
    if _accelerator() is not None:
        ms.runtime.synchronize()
    else:
        _shim.sync_pynative()


def _tensors(values: Any) -> Iterator[Tensor]:
    """The tensors among ``values`` and one level of tuples / lists in them (a legacy primitive
    call's arguments are ``(primitive, name, inputs)``)."""
    return tensors_in(values, Tensor)


def _outputs(out: Any) -> List[Tensor]:
    return [out] if isinstance(out, Tensor) else list(_tensors(out)) if isinstance(out, (tuple, list)) else []


def _address(t: Tensor) -> Optional[int]:
    """The address of the first byte of ``t``'s storage (views share it); ``None`` for a tensor
    without memory. Cheap: ``Tensor.untyped_storage()`` costs milliseconds the first time it is
    called on a tensor object in MindSpore 2.10 (CPU), so the meter avoids it."""
    try:
        ptr = int(t.data_ptr()) - int(t.storage_offset()) * int(t.itemsize)
    except Exception:  # not materialised (a lazily initialised parameter), meta, ...
        return None
    return ptr or None


def _size(t: Tensor) -> int:
    """Bytes of ``t``'s storage: its own bytes when it starts the storage and is contiguous (what a
    new op output is), else asked of the storage."""
    try:
        if int(t.storage_offset()) == 0 and t.is_contiguous():
            return int(t.nbytes)
        return int(t.untyped_storage().nbytes())
    except Exception:
        return 0


def _storage(t: Tensor) -> Optional[Tuple[int, int]]:
    """``(address of the storage's first byte, its bytes)``; ``None`` for a tensor without memory."""
    ptr = _address(t)
    if ptr is None:
        return None
    nbytes = _size(t)
    return (ptr, nbytes) if nbytes > 0 else None


def _keep_optimizers(state: "_StepState") -> Dict[int, int]:
    """Keep in ``state`` every parameter of every live optimizer (its moments, step counters and
    the model's parameters it updates: a MindSpore optimizer runs as a compiled graph, whose
    writes no dispatch mode sees); returns their storages and bytes."""
    kept: Dict[int, int] = {}
    optimizer = nn.Optimizer
    for obj in gc.get_objects():
        if issubclass(type(obj), optimizer):
            for p in obj.get_parameters():
                state.keep(p)
                found = _storage(p)
                if found:
                    kept[found[0]] = found[1]
    return kept


# ----------------------------------------------------------------------------------- host buffers
class _HostMarks:
    """Storages that are host memory (the swap engine's host buffers): never counted as device
    memory by the CPU meter. A mark lives as long as the tensor object it was made from."""

    def __init__(self) -> None:
        self._count: Dict[int, int] = {}
        self._refs: Dict[int, Any] = {}

    def mark(self, t: Any) -> None:
        if not isinstance(t, Tensor) or id(t) in self._refs:
            return
        ptr = _address(t)
        if ptr is None:
            return
        self._count[ptr] = self._count.get(ptr, 0) + 1
        key = id(t)

        def unmark(_: Any, key: int = key, ptr: int = ptr) -> None:
            self._refs.pop(key, None)
            left = self._count.get(ptr, 0) - 1
            if left > 0:
                self._count[ptr] = left
            else:
                self._count.pop(ptr, None)

        self._refs[key] = weakref.ref(t, unmark)

    def __contains__(self, ptr: int) -> bool:
        return ptr in self._count


#: The host buffers the backend allocates for the engine (``MindSporeBackend.empty_host_bytes`` marks them).
HOST_MARKS = _HostMarks()


# ----------------------------------------------------------------------------------- memory meters
class LiveTensorMeter:
    """The device memory of a region on MindSpore's CPU build, counted from live tensors (an
    estimate; see the module docstring for what it sees and what it misses).

    ``baseline_bytes`` is 0: the meter counts the storages made inside the region; storages alive
    when it was entered that the region uses (parameters, inputs) are listed in ``reached`` (address
    -> bytes), so that a caller can add them, as the budget counts them. ``current_bytes`` /
    ``peak_bytes``: live now / at the worst moment seen. Feed it with :meth:`see` (a dispatch mode
    of this module does, for every op's inputs and outputs), :meth:`hold` (kept until the region
    ends) and :meth:`scan` (called by :meth:`reset_peak`).

    Example::

        >>> from mindspore import mint
        >>> with LiveTensorMeter() as meter, meter.watching():
        ...     x = mint.ones((256, 256))          # 256 KiB
        ...     y = x.reshape(65536)               # a view: no new bytes
        ...     del x, y
        >>> meter.peak_bytes, meter.current_bytes
        (262144, 0)
    """

    measures = "live tensors (estimated)"

    def __init__(self) -> None:
        self._before: Dict[int, int] = {}
        self._parameters: Dict[int, Any] = {}            # address -> trainable parameter alive at entry
        self.reached: Dict[int, int] = {}
        self._entries: Dict[int, List[int]] = {}      # address -> [bytes, tensor objects holding it]
        self._holders: Dict[int, Any] = {}             # id(tensor) -> weak reference
        self._held: List[Tensor] = []
        self._listeners: List[Callable[[int], None]] = []
        self.current_bytes = 0
        self._peak = 0
        self._window = 0
        self._active = False

    @property
    def baseline_bytes(self) -> int:
        return 0

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def on_death(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(address)`` when a counted storage dies (its last seen holder)."""
        self._listeners.append(listener)

    def alive(self, ptr: int) -> bool:
        return ptr in self._entries

    def parameter(self, ptr: int) -> Optional[Any]:
        """The trainable parameter whose storage is at ``ptr`` (alive at entry), if any."""
        return self._parameters.get(ptr)

    def bytes_of(self, t: Tensor) -> int:
        """Bytes of the storage of ``t`` as counted (else asked)."""
        ptr = _address(t)
        entry = self._entries.get(ptr) if ptr is not None else None
        if entry is not None:
            return entry[0]
        if ptr in self._before:
            return self._before[ptr]
        return _size(t)

    def existed(self, ptr: int) -> bool:
        """Whether the storage at ``ptr`` was alive when the meter was entered."""
        return ptr in self._before

    # -- context ----------------------------------------------------------------
    def __enter__(self) -> "LiveTensorMeter":
        gc.collect()  # (cyclic garbage is not live memory; what survives moves to the old generation)
        for obj in gc.get_objects():
            if issubclass(type(obj), Tensor):
                found = _storage(obj)
                if found is not None:
                    self._before[found[0]] = max(found[1], self._before.get(found[0], 0))
                    if isinstance(obj, ms.Parameter) and obj.requires_grad:
                        self._parameters[found[0]] = obj
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        self._held.clear()
        self._parameters.clear()
        self._holders.clear()  # (the weak references go, and their callbacks with them)
        self._entries.clear()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """A dispatch mode and saved-tensor hooks feeding the meter (what :class:`_TraceMode`
        and :class:`_SavedHooks` do for the prober), for use on its own."""
        with _TraceMode(live=self), _SavedHooks(self):
            yield

    # -- feeding --------------------------------------------------------------------
    def see(self, t: Any, fresh: bool = False) -> None:
        """Count the storage of ``t`` while ``t`` lives (once per storage). ``fresh``: ``t`` is an
        op output made in new memory (an address alive at entry was freed and reused)."""
        if not self._active or not isinstance(t, Tensor):
            return
        key = id(t)
        ref = self._holders.get(key)
        if ref is not None and ref() is t:
            return
        ptr = _address(t)
        if ptr is None or ptr in HOST_MARKS:
            return
        if ptr in self._before:
            if not fresh:
                self.reached[ptr] = self._before[ptr]
                return
            del self._before[ptr]
            self._parameters.pop(ptr, None)
        entry = self._entries.get(ptr)
        if entry is None:
            nbytes = _size(t)
            if nbytes <= 0:
                return
            entry = self._entries[ptr] = [nbytes, 0]
            self._add(nbytes)
        entry[1] += 1

        def died(r: Any, key: int = key, ptr: int = ptr) -> None:
            if self._holders.get(key) is r:
                del self._holders[key]
            e = self._entries.get(ptr)
            if e is None:
                return
            e[1] -= 1
            if e[1] <= 0:
                del self._entries[ptr]
                self.current_bytes -= e[0]
                for listener in self._listeners:
                    listener(ptr)

        self._holders[key] = weakref.ref(t, died)

    def hold(self, t: Any) -> None:
        """Count ``t`` and keep it alive until the region ends (a parameter's gradient)."""
        if self._active and isinstance(t, Tensor):
            self._held.append(t)
            self.see(t)

    def scan(self) -> None:
        """Count the MindSpore tensors made since the meter was entered that no mode saw (the
        garbage collector's young generations)."""
        for generation in (0, 1):
            try:
                objs = gc.get_objects(generation)
            except (TypeError, ValueError):  # (an interpreter without generations)
                return
            for obj in objs:
                if issubclass(type(obj), Tensor):
                    self.see(obj)
            del objs

    def _add(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        if self.current_bytes > self._window:
            self._window = self.current_bytes
            if self._window > self._peak:
                self._peak = self._window

    def reset_peak(self) -> int:
        """The peak since the last call (or entry), after a :meth:`scan`; a new window starts at
        the bytes live now."""
        self.scan()
        peak = self._window
        self._window = self.current_bytes
        return peak


class AllocatorMeter:
    """The device memory of a region on Ascend / GPU, from MindSpore's allocator statistics
    (measured): absolute bytes allocated (``baseline_bytes`` at entry, ``current_bytes``,
    ``peak_bytes``)."""

    measures = "the allocator (measured)"

    def __init__(self) -> None:
        self.baseline_bytes = 0
        self._peak = 0
        self._final = 0
        self._active = False

    def __enter__(self) -> "AllocatorMeter":
        ms.runtime.synchronize()
        ms.runtime.reset_peak_memory_stats()
        self.baseline_bytes = self._peak = int(ms.runtime.memory_allocated())
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        ms.runtime.synchronize()
        self._peak = max(self._peak, int(ms.runtime.max_memory_allocated()))
        self._final = int(ms.runtime.memory_allocated())
        self._active = False

    @property
    def current_bytes(self) -> int:
        return int(ms.runtime.memory_allocated()) if self._active else self._final

    @property
    def peak_bytes(self) -> int:
        return max(self._peak, int(ms.runtime.max_memory_allocated())) if self._active else self._peak

    def reset_peak(self) -> int:
        ms.runtime.synchronize()
        peak = int(ms.runtime.max_memory_allocated())
        ms.runtime.reset_peak_memory_stats()
        self._peak = max(self._peak, peak)
        return peak

    def see(self, t: Any, fresh: bool = False) -> None:
        return None

    def hold(self, t: Any) -> None:
        return None


def memory_meter() -> Any:
    """The meter of the current device: :class:`AllocatorMeter` on Ascend / GPU,
    :class:`LiveTensorMeter` on a CPU."""
    return AllocatorMeter() if _accelerator() is not None else LiveTensorMeter()


# ----------------------------------------------------------------------------------- the step's state
class _Shield:
    """Legacy random primitives (kernels that keep their own random state, e.g. the CPU
    ``Dropout``) run as fresh copies of themselves, so that the originals never draw."""

    def __init__(self) -> None:
        self._copies: Dict[int, Tuple[Primitive, Primitive]] = {}

    def args(self, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        prim = args[0]
        pair = self._copies.get(id(prim))
        if pair is None or pair[0] is not prim:
            pair = self._copies[id(prim)] = (prim, copy.deepcopy(prim))
        return (pair[1],) + tuple(args[1:])


class _StepState(StepState):
    """What a step changes, put back afterwards (see the module docstring): storages by the address
    of their first byte, host copies as numpy arrays, the default generator."""

    def _storage_of(self, t: Tensor) -> Optional[int]:
        return _address(t)

    def _host_copy(self, t: Tensor) -> np.ndarray:
        with _shim.internal():
            return t.asnumpy().copy()

    def _write_back(self, written: Iterable[Tuple[Tensor, np.ndarray]]) -> None:
        with _shim.internal():
            for t, host in written:
                t.copy_(Tensor(host, dtype=t.dtype))



def _side_effect_args(args: Tuple[Any, ...]) -> List[Tensor]:
    """The tensor arguments of a legacy primitive that declares it writes memory (``BatchNorm``)."""
    if is_legacy_primitive_call(args) and args[0].attrs.get("side_effect_mem", False):
        return [t for t in _tensors(args[2:])]
    return []


# ----------------------------------------------------------------------------------- dispatch mode
class _PipelineOffMode(MsDispatchMode):
    """A dispatch mode of this module: PyNative's front-end pipeline is off while it is active
    (else MindSpore 2.10's modes miss ops; see ``_shim.disable_pipeline``), and put back as it was
    when it exits (entries nest)."""

    def __init__(self) -> None:
        super().__init__()
        self._was_off: List[bool] = []

    def __enter__(self) -> "_PipelineOffMode":
        self._was_off.append(_shim.disable_pipeline())
        try:
            super().__enter__()
        except BaseException:
            _shim.restore_pipeline(self._was_off.pop())
            raise
        return self

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            _shim.restore_pipeline(self._was_off.pop())


class _TraceMode(_PipelineOffMode):
    """One dispatch mode for everything the prober watches: the CPU meter (every op's inputs and
    outputs), the step's state (tensors that existed before it and that it writes), the random
    primitives' shield, and the op recorder of the profile."""

    def __init__(self, live: Optional[LiveTensorMeter] = None, state: Optional[_StepState] = None,
                 shield: Optional[_Shield] = None, recorder: Optional["_Recorder"] = None) -> None:
        super().__init__()
        self.live = live
        self.state = state
        self.shield = shield
        self.recorder = recorder

    def __ms_dispatch__(self, func: Any, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if self.shield is not None and is_legacy_primitive_call(args) and is_random_op(args[1]):
            args = self.shield.args(args)
        live, state = self.live, self.state
        inputs = list(_tensors(args)) + list(_tensors(kwargs.values()))
        written: List[Tensor] = []
        if state is not None or self.recorder is not None:
            written = list(active_backend().written_tensors(func, args, kwargs)) + _side_effect_args(args)
            if state is not None and live is not None:
                for t in written:  # (what existed before; what the step made is its own)
                    ptr = _address(t)
                    if ptr is not None and live.existed(ptr):
                        state.keep(t)
        if live is not None:
            for t in inputs:
                live.see(t)
        out = func(*args, **kwargs) if kwargs else func(*args)
        outs = _outputs(out)
        if live is not None or self.recorder is not None:
            in_ptrs = {_address(t) for t in inputs}
            made: Dict[int, int] = {}
            for t in outs:
                ptr = _address(t)
                fresh = ptr is not None and ptr not in in_ptrs
                if live is not None:
                    live.see(t, fresh=fresh)
                if fresh and ptr not in made:
                    made[ptr] = live.bytes_of(t) if live is not None else _size(t)
            if self.recorder is not None:
                self.recorder.op(func, args, inputs, made, bool(written))
        return out


class _SavedHooks:
    """``mindspore.saved_tensors_hooks`` that save what autograd would (an alias of the same
    storage, made out of the modes' sight) and tell the meter and the recorder. The alias lives as
    long as autograd keeps the saved tensor, so the meter counts the storage exactly that long."""

    def __init__(self, live: Optional[LiveTensorMeter], recorder: Optional["_Recorder"] = None) -> None:
        self.live = live
        self.recorder = recorder
        self._ctx: Any = None

    def pack(self, t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        alias = active_backend().alias(t)
        if self.live is not None:
            self.live.see(alias)
        if self.recorder is not None:
            self.recorder.saved(alias)
        return alias

    @staticmethod
    def unpack(t: Any) -> Any:
        return t

    def __enter__(self) -> "_SavedHooks":
        self._ctx = ms.saved_tensors_hooks(self.pack, self.unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        ctx, self._ctx = self._ctx, None
        return ctx.__exit__(*exc)


class _Recorder:
    """Call 1's watcher beside the op records (``log``): the trainable parameters the step reached
    (whose gradient hooks feed the meter). The trace mode calls :meth:`op`, the saved-tensor hooks
    :meth:`saved`."""

    def __init__(self, key_of: Callable[[Any, tuple], OpKey], live: LiveTensorMeter, count_grads: bool,
                 log: LayerLog) -> None:
        self.key_of = key_of
        self.live = live
        self.count_grads = count_grads  # (on a CPU: the meter counts gradients through hooks)
        self.log = log
        self.params: Dict[int, Any] = {}  # address -> trainable parameter reached in forward
        self.hooks: List[Any] = []
        live.on_death(log.forget)  # (an address is reused once it died)

    def op(self, func: Any, args: Tuple[Any, ...], inputs: List[Tensor], made: Dict[int, int], mutating: bool) -> None:
        forward = not active_backend().in_backward()
        if forward:  # (a trainable parameter the step reaches: its gradient feeds the meter)
            for t in inputs:
                ptr = _address(t)
                param = self.live.parameter(ptr) if ptr is not None else None
                if param is not None and ptr not in self.params:
                    self.params[ptr] = param
                    if self.count_grads:
                        self.hooks.append(param.register_hook(self._grad_hook))
        if self.log.layer is not None and forward:
            self.log.op(self.key_of(func, args), sum(made.values()), mutating, op_name(func) in EXPENSIVE_OPS, made)

    def _grad_hook(self, grad: Any) -> None:
        self.live.hold(grad)

    def saved(self, t: Tensor) -> None:
        ptr = _address(t) if self.log.layer is not None else None
        if ptr is not None:
            self.log.save(ptr, self.live.bytes_of(t))

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


# ----------------------------------------------------------------------------------- the prober
class MindSporeProber(ChainProber):
    """Profiling and probing on MindSpore; the planner's framework part. The algorithm is
    :class:`~hyper_parallel.planner.chain_prober.ChainProber`'s; this class gives it MindSpore's
    primitives (see the module docstring)."""

    name = "mindspore"
    tensor_type = Tensor
    step_hint = " (mindspore.value_and_grad / grad / vjp with its backward)"

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    # ------------------------------------------------------------------ names and sizes
    @staticmethod
    def key_of(op: Any, args: Tuple[Any, ...]) -> OpKey:
        """An op call's :class:`OpKey`: ``op.name`` (MindSpore hands a new op object per call) and
        the shapes of its tensor arguments (a legacy primitive's are its ``inputs``)."""
        return OpKey(op_name(op), tuple(tuple(int(d) for d in t.shape) for t in _tensors(args)))

    @staticmethod
    def nbytes(t: Any) -> int:
        """Bytes of the storage a saved tensor views (what a swap moves)."""
        try:
            return int(t.untyped_storage().nbytes())  # (the engine asked for it already: cached)
        except Exception:
            return 0

    def _storage_bytes(self, t: Tensor) -> int:
        found = _storage(t)  # (not untyped_storage(): milliseconds on a tensor object's first call)
        return found[1] if found is not None else 0

    def _named_parameters(self, layer: nn.Cell) -> Iterable[Tuple[str, Any]]:
        return layer.parameters_and_names()

    # ------------------------------------------------------------------ the model
    @staticmethod
    def is_layer(x: Any) -> bool:
        return isinstance(x, nn.Cell)

    @staticmethod
    def is_stack(x: Any) -> bool:
        """Whether ``x`` is a layer stack itself (a ``CellList``, a ``SequentialCell``, a list)."""
        return isinstance(x, (nn.CellList, nn.SequentialCell, list, tuple))

    @staticmethod
    def find_layers(model: nn.Cell) -> Tuple[str, List[nn.Cell]]:
        """A model's layer stack: the longest ``CellList`` of cells of one class (its attribute
        path and layers); none, or two of the same length, is a ``ValueError`` naming them."""
        found = []
        for name, cell in model.cells_and_names():
            if isinstance(cell, nn.CellList) and len(cell) and len({type(c) for c in cell}) == 1:
                found.append((len(cell), name, list(cell)))
        if not found:
            raise ValueError(f"plan_memory: {type(model).__name__} holds no nn.CellList of cells of one class; pass its "
                             "layer stack itself")
        found.sort(key=lambda f: -f[0])
        if len(found) > 1 and found[0][0] == found[1][0]:
            raise ValueError(f"plan_memory: {type(model).__name__} holds two layer stacks of {found[0][0]} cells "
                             f"({found[0][1]!r}, {found[1][1]!r}); pass the one to plan")
        return found[0][1], found[0][2]

    # ------------------------------------------------------------------ parallel training
    @staticmethod
    def pipeline(schedule: Any) -> Any:
        """Refused: ``plan_pipeline`` reads ``torch.distributed.pipelining`` schedules."""
        raise ValueError("plan_pipeline plans torch.distributed.pipelining schedules; on MindSpore plan each stage's "
                         "cells with plan_memory(..., microbatches_in_flight=k)")

    @staticmethod
    def collectives(group: Any) -> None:
        """``None``: on MindSpore each process plans alone (ranks agreeing is ``torch.distributed``'s)."""
        if group not in (None, False):
            raise ValueError("plan_memory(group=...): on MindSpore each process plans alone; ranks agreeing on one "
                             "plan is implemented for torch.distributed. Leave group out (or pass group=False).")
        return None

    # ------------------------------------------------------------------ devices and time
    @staticmethod
    def device() -> str:
        target = ms.get_context("device_target")
        if target in _ACCELERATORS:
            return f"{target}:{ms.get_context('device_id')}"
        return target

    def _device_of(self, layers: Sequence[nn.Cell]) -> str:
        return self.device()  # (PyNative runs every cell on the context's device)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Wait for every launched kernel (``_synchronize``; MindSpore has one device per process)."""
        _synchronize()

    def _clock(self, device: Any) -> Callable[[], float]:
        return _clock()

    def _timing_mode(self) -> "_TraceMode":
        return _TraceMode(shield=_Shield())  # (the pipeline off, as in the measured runs; random kernels shielded)

    def _no_grad(self) -> Any:
        return _shim.no_grad()

    # (planning a step that does not fit as it is is PyTorch's only: this prober catches no
    # out-of-memory error, ``out_of_memory`` is ``()``, and never moves what autograd saves)
    def _moving_saved(self, meter: Any = None, log: Optional[LayerLog] = None, device: Any = None) -> Any:
        return contextlib.nullcontext(None)

    def _move_saved_from_now(self) -> bool:
        return False

    @staticmethod
    def copy_bandwidth(nbytes: int = 16 << 20) -> float:
        """Bytes per second of one direction of a host <-> device copy (into the engine's kind of
        host buffer: pinned on an accelerator; a memory copy on a CPU), the faster of three."""
        backend = active_backend()
        with _shim.internal():
            src = ops.zeros((nbytes,), ms.uint8)
            dst = backend.empty_host_bytes(nbytes)
            best = fastest_seconds(lambda: dst.copy_(src), _synchronize)
        return nbytes / max(best, 1e-9)

    def _copy_bytes_per_s(self, device: Any) -> float:
        return self.copy_bandwidth()

    def _copies_overlap(self, device: Any) -> bool:
        return _accelerator() is not None

    # ------------------------------------------------------------------ autograd
    def _in_backward(self) -> bool:
        return self._backend.in_backward()

    def _grad_outputs(self, out: Any) -> List[Tensor]:
        return [t for t in _outputs(out) if self._backend.requires_grad(t)]

    def _clear_grads(self, layers: Sequence[nn.Cell]) -> None:
        """Nothing: MindSpore returns gradients and keeps none on the parameters."""

    # ------------------------------------------------------------------ the step
    def measure_step(self, device: Any, step_fn: Callable[[], Any], layers: Sequence[nn.Cell] = ()) -> int:
        """The peak device memory of one ``step_fn()`` as the planner counts it (the budget's
        quantity): MindSpore's allocator on Ascend / GPU (measured), the live-tensor count on a CPU
        (estimated, see the module docstring); ``device`` is the context's (one per process),
        ``layers`` may mark the segments. Puts back what the step changes, as profiling does."""
        return self._instrumented(list(layers), step_fn, self.device()).peak_bytes

    def _instrumented(self, layers: Sequence[nn.Cell], step_fn: Callable[[], Any], device: Any) -> StepTrace:
        self._backend.check_ready("plan_memory")  # (PyNative only: profiling and measure_step run the step here first)
        cpu = _accelerator() is None
        state = _StepState(self._backend)
        state.save_rng()
        optimizer_state = _keep_optimizers(state)
        log = self._layer_log()
        try:
            with contextlib.ExitStack() as stack:
                meter, live = _meters(stack)
                recorder = _Recorder(self.key_of, live, count_grads=cpu, log=log)
                stack.callback(recorder.remove_hooks)
                _watch(stack, live, state, recorder)
                segments = self._segmented(layers, meter, step_fn, log.on_pre, log.on_post).segments
                reached = dict(live.reached)
        finally:
            state.restore()
        notes = []
        if cpu:
            # The step's memory on a CPU: what it allocates (counted) plus the storages it reached that
            # existed before it (parameters, inputs; as the budget counts them), whatever else the process holds.
            # (an optimizer's state and what it updates are written by its compiled graph, which no
            # dispatch mode sees: they are the step's memory too)
            before = sum(reached.values()) + sum(n for key, n in optimizer_state.items() if key not in reached)
            for segment in segments:
                segment.start += before
                segment.peak += before
            baseline, peak = before, meter.peak_bytes + before
            notes.append("memory on MindSpore's CPU build is estimated: MindSpore keeps no allocator statistics on "
                         "a CPU, so the planner counts live tensors itself (op inputs and outputs, saved tensors, "
                         "gradients, the engine's tensors at layer boundaries); it misses what only C++ holds, "
                         "such as the outputs of backward kernels no dispatch mode sees (legacy primitives: "
                         "LayerNorm, BiasAdd, Dropout); see docs/mindspore.md")
        else:
            baseline, peak = meter.baseline_bytes, meter.peak_bytes
        params = dict(found for layer in layers for found in map(_storage, layer.get_parameters()) if found)
        grads = dict(found for found in map(_storage, recorder.params.values()) if found)
        return StepTrace(segments, log, baseline, peak, sum(params.values()), sum(grads.values()), state, notes)

    def _probe_input(self, layer: nn.Cell, args: tuple, kwargs: dict, hooks: Sequence[Any]) -> "_ProbeInput":
        return _ProbeInput(layer, args, kwargs, self.device())

    # ------------------------------------------------------------------ probes
    @contextlib.contextmanager
    def _restored_after(self, source: "_ProbeInput", copies: Sequence[nn.Cell], watch: bool) -> Iterator[_StepState]:
        """A probe leaves the program as it found it: the default generator, and every tensor
        outside the probe's copies that it writes in place (a hook of the layer that uses a cell of
        the model). ``watch``: find those tensors with the trace mode, which a live-tensor meter
        tells what existed before (legacy random primitives run shielded there)."""
        state = _StepState(self._backend)
        state.save_rng()
        for t in source.outside:
            state.keep(t)
        try:
            with contextlib.ExitStack() as stack:
                if watch:
                    live = stack.enter_context(LiveTensorMeter())
                    stack.enter_context(_TraceMode(live=live, state=state, shield=_Shield()))
                yield state
        finally:
            if watch:
                source.note_outside(state, copies)
            state.restore()

    @contextlib.contextmanager
    def _chain_meter(self, source: "_ProbeInput",
                     copies: Sequence[nn.Cell]) -> Iterator[Tuple[Any, List[Any]]]:
        with self._restored_after(source, copies, watch=False) as state:
            try:
                inputs = source.inputs(len(copies))
                with contextlib.ExitStack() as stack:
                    meter, live = _meters(stack)
                    if live is meter:  # (a CPU: the gradients of the copies' parameters, see LiveTensorMeter)
                        hooks = [p.register_hook(live.hold) for c in copies for p in c.trainable_params()]
                        stack.callback(_remove, hooks)
                    _watch(stack, live, state)
                    yield meter, inputs
            finally:
                source.note_outside(state, copies)

    def _op_timer(self, times: OpTimes) -> "_OpTimer":
        return _OpTimer(times, self.key_of)

    @contextlib.contextmanager
    def in_training(self, step_fn: Callable[[], Any]) -> Iterator[None]:
        """The block runs with one ``step_fn()`` done first, as in the middle of training; what that
        call changed (parameters, the optimizers' state, which their compiled graphs update unseen
        by any dispatch mode, the generator) is put back after the block."""
        state = _StepState(self._backend)
        state.save_rng()
        _keep_optimizers(state)
        try:
            with contextlib.ExitStack() as stack:  # (what the step writes of what existed before is kept)
                live = stack.enter_context(LiveTensorMeter())
                stack.enter_context(_TraceMode(live=live, state=state, shield=_Shield()))
                step_fn()
            yield
        finally:
            state.restore()

    # ------------------------------------------------------------------ checking a plan
    @staticmethod
    def submodule(model: nn.Cell, path: str) -> Any:
        """The cell at ``path`` in ``model`` (where ``find_layers`` found the stack)."""
        cell = model
        for name in path.split(".") if path else ():
            cell = getattr(cell, name)
        return cell

    @staticmethod
    def is_container(x: Any) -> bool:
        """Whether ``x`` holds the layers so that the model calls them from it, entries settable."""
        return isinstance(x, nn.CellList)

    def _copyable(self, layers: Sequence[nn.Cell]) -> bool:
        return True

    def _shared_copy(self, layer: nn.Cell) -> nn.Cell:
        memo = {id(p): p for p in layer.get_parameters()}
        with _shim.internal():
            return copy.deepcopy(layer, memo)

    @contextlib.contextmanager
    def _substituted(self, stack: Any, copies: Sequence[nn.Cell]) -> Iterator[None]:
        originals = [stack[i] for i in range(len(stack))]
        try:
            for i, layer in enumerate(copies):
                stack[i] = layer
            yield
        finally:
            for i, layer in enumerate(originals):
                stack[i] = layer


def _meters(stack: contextlib.ExitStack) -> Tuple[Any, LiveTensorMeter]:
    """Enter on ``stack`` the meter of the current device (:func:`memory_meter`) and the live-tensor
    meter the trace mode feeds: the same one on a CPU; on an accelerator, one that only tells which
    tensors existed before (and, for the recorder, which storages live)."""
    meter = stack.enter_context(memory_meter())
    live = meter if isinstance(meter, LiveTensorMeter) else stack.enter_context(LiveTensorMeter())
    return meter, live


def _watch(stack: contextlib.ExitStack, live: LiveTensorMeter, state: _StepState,
           recorder: Optional[_Recorder] = None) -> None:
    """Enter on ``stack`` the trace mode (feeding ``live``, keeping what existed before and is
    written into ``state``, shielding the random primitives, recording for ``recorder``) and the
    saved-tensor hooks feeding ``live`` (and ``recorder``)."""
    stack.enter_context(_TraceMode(live=live, state=state, shield=_Shield(), recorder=recorder))
    stack.enter_context(_SavedHooks(live, recorder))


def _remove(handles: List[Any]) -> None:
    for h in handles:
        h.remove()


class _OpTimer(_PipelineOffMode):
    """Passes every op call through ``times`` (:class:`~hyper_parallel.planner.chain_prober.OpTimes`).
    Random legacy primitives run shielded (see :class:`_Shield`)."""

    def __init__(self, times: OpTimes, key_of: Callable[[Any, tuple], OpKey]) -> None:
        super().__init__()
        self.times = times
        self.key_of = key_of
        self._shield = _Shield()

    def __ms_dispatch__(self, func: Any, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if is_legacy_primitive_call(args) and is_random_op(args[1]):
            args = self._shield.args(args)
        return self.times.call(self.key_of(func, args), lambda: func(*args, **kwargs) if kwargs else func(*args))


class _ProbeInput:
    """One layer and the input it received in the step: what a probe runs copies of. The input's
    tensors are kept as host (numpy) copies between probes, never as device memory."""

    def __init__(self, layer: nn.Cell, args: tuple, kwargs: dict, device: str) -> None:
        self.layer = layer
        self.device = device
        self.outside: List[Tensor] = []  # tensors outside the layer a run writes in place
        with _shim.internal():
            self._host = copy.deepcopy(_tree_map(_to_host, (tuple(args), dict(kwargs))))

    def note_outside(self, state: _StepState, copies: Sequence[nn.Cell]) -> None:
        """Remember the tensors outside ``copies`` that a watched run wrote (``state``): every later
        run of this layer's copies puts them back too (its time runs watch nothing)."""
        own = {_address(t) for c in copies for t in c.get_parameters()}
        found = [t for key, (t, _) in state.written.items() if key not in own]
        self.outside = list({id(t): t for t in [*self.outside, *found]}.values())

    def inputs(self, copies: int = 1) -> List[Any]:
        """The input on the device for a chain of ``copies``: the activation and, per copy,
        ``(other arguments, keyword arguments)``; other objects among them are fresh copies for
        every copy and every run."""
        x = None
        calls = []
        for _ in range(copies):
            args, kwargs = _tree_map(_from_host, copy.deepcopy(self._host))
            x = args[0] if x is None else x
            calls.append((tuple(args[1:]), kwargs))
        return [x, calls]

    def forward(self, layer: nn.Cell) -> Any:
        x, [(rest, kwargs)] = self.inputs()
        return layer(x, *rest, **kwargs)

    def run(self, copies: Sequence[nn.Cell], inputs: Optional[List[Any]] = None) -> None:
        """Forward through the chain of copies and backward from its end (``mindspore.vjp`` with a
        cotangent of ones), as the step does."""
        x, calls = inputs if inputs is not None else self.inputs(len(copies))
        if inputs is not None:
            inputs.clear()
        weights = [p for layer in copies for p in layer.trainable_params()]

        def chain(h: Tensor) -> Tensor:
            for layer, (rest, kwargs) in zip(copies, calls):
                h = layer_output(layer(h, *rest, **kwargs), Tensor)
            return h

        out, vjp_fn = ms.vjp(chain, x, weights=weights or None)
        vjp_fn(ops.ones_like(out))


class _Host:
    """A tensor kept on the host (numpy), with its dtype."""

    __slots__ = ("array", "dtype")

    def __init__(self, t: Tensor) -> None:
        self.dtype = t.dtype
        self.array = t.asnumpy().copy()


def _to_host(v: Any) -> Any:
    return _Host(v) if isinstance(v, Tensor) else v


def _from_host(v: Any) -> Any:
    return Tensor(v.array.copy(), dtype=v.dtype) if isinstance(v, _Host) else v


def _tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    if isinstance(tree, tuple):
        return tuple(_tree_map(fn, v) for v in tree)
    if isinstance(tree, list):
        return [_tree_map(fn, v) for v in tree]
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)
