"""The planner's MindSpore part (PyNative): profile a training step, probe a layer's options in isolation.

It follows :mod:`hyper_parallel.planner.torch_prober` step by step, with MindSpore's machinery:
``mindspore.utils.MsDispatchMode`` for the op trace (MindSpore hands a new op object per call, so
ops are keyed by ``op.name``; PyNative's front-end pipeline is off while a mode of this module is
active, or the mode would miss ops), ``mindspore.saved_tensors_hooks`` for what autograd saves,
``Cell`` forward (pre-)hooks for the segments and a gradient hook on each layer's output for the
start of its backward, ``copy.deepcopy`` of a ``Cell`` for the probes (it copies parameters and
gives every primitive a fresh kernel, so a copy's dropout starts its own random stream), and
``mindspore.vjp`` to run a probe's backward.

Profiling (:meth:`MindSporeProber.profile_step`) calls the user's ``step_fn`` twice: once
instrumented (segments, ops, saved storages, memory), once timed (each layer's forward and
backward, one input of each kind of layer kept for the probes). Around both calls what the step
changes is put back:

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

Probing (:meth:`MindSporeProber.probe`) runs deep copies of one layer alone, chained through the
layer chain as the model's layers are, on the input it received in the step: once with every
copy left as it is and once with one copy wrapped by the option, forward and ``vjp`` backward,
and reads the difference at each segment, as the torch prober does (four copies with the option
on the second, two with it on the last; time: three copies all wrapped against three left alone,
the faster of several runs). Times are CPU time of the process on a CPU (MindSpore's work runs on
a few threads; a shared machine's wall clock would time the neighbours), wall time on an
accelerator; every timed run has the pipeline off and the random primitives shielded, as above.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops import Primitive
from mindspore.utils import MsDispatchMode

from hyper_parallel.backends.mindspore import _shim
from hyper_parallel.backends.mindspore.backend import (MindSporeBackend, is_legacy_primitive_call, is_random_op,
                                                       op_name)
from hyper_parallel.core.backend import active_backend
from hyper_parallel.core.host_pool import on_host_buffer
from hyper_parallel.core.swap_manager import SwapManager
from hyper_parallel.core.wrapping import checkpoint_wrapper, swap_wrapper

from .options import LayerOption, OpKey, option_policy
from .profile import Effect, LayerRecord, LayerType, OpRecord, RELATIONS, Segment, StepProfile

__all__ = ["MindSporeProber", "LiveTensorMeter", "AllocatorMeter", "EXPENSIVE_OPS", "memory_meter"]

#: Ops whose outputs the fixed recipes save or swap (matmuls, attention kernels, convolutions).
EXPENSIVE_OPS = frozenset({"MatMul", "MatMulExt", "BatchMatMul", "BatchMatMulExt", "Dense", "Baddbmm",
                           "FlashAttentionScore", "Conv2D", "Conv2DExt", "Convolution"})
_ACCELERATORS = ("Ascend", "GPU")
_PROBE_REPEATS = 3


def _backend() -> MindSporeBackend:
    backend = active_backend()
    if not isinstance(backend, MindSporeBackend):
        raise RuntimeError("the MindSpore prober needs the MindSpore backend (HYPER_PARALLEL_PLATFORM=mindspore)")
    return backend


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


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused (for timed runs, as ``timeit`` does)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _tensors(values: Any) -> Iterator[Tensor]:
    """The tensors among ``values`` and one level of tuples / lists in them (a legacy primitive
    call's arguments are ``(primitive, name, inputs)``)."""
    for v in values:
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from (t for t in v if isinstance(t, Tensor))


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


def _hidden(out: Any) -> Tensor:
    """The activation a layer passes to the next: its output, or the first element of it."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(f"plan_memory: a layer returned {type(out).__name__}; the planner needs a layer stack whose "
                    "layers return the next layer's input (a tensor, or a tuple whose first item is one).")


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


_HOST = _HostMarks()
on_host_buffer(_HOST.mark)  # (every host buffer the swap engine holds now and allocates from now on)


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
        if ptr is None or ptr in _HOST:
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


class _StepState:
    """What a step changes, put back afterwards (see the module docstring)."""

    def __init__(self) -> None:
        self.written: Dict[int, Tuple[Tensor, np.ndarray]] = {}  # storage address -> (tensor, host copy)
        self._rng: Any = None

    def keep(self, t: Tensor) -> None:
        """Copy ``t`` to the host before the step writes it (once per storage)."""
        ptr = _address(t)
        if ptr is not None and ptr not in self.written:
            with _shim.internal():
                self.written[ptr] = (t, t.asnumpy().copy())

    def save_rng(self) -> None:
        try:
            self._rng = ms.get_rng_state()
        except Exception:  # pragma: no cover - a MindSpore without a default generator
            self._rng = None

    def again(self) -> "_StepState":
        """A state that snapshots the same tensors now, for another call of the step."""
        other = _StepState()
        for t, _ in self.written.values():
            other.keep(t)
        return other

    def restore(self) -> None:
        with _shim.internal():
            for t, host in self.written.values():
                t.copy_(Tensor(host, dtype=t.dtype))
        if self._rng is not None:
            ms.set_rng_state(self._rng)


def _side_effect_args(args: Tuple[Any, ...]) -> List[Tensor]:
    """The tensor arguments of a legacy primitive that declares it writes memory (``BatchNorm``)."""
    if is_legacy_primitive_call(args) and args[0].attrs.get("side_effect_mem", False):
        return [t for t in _tensors(args[2:])]
    return []


# ----------------------------------------------------------------------------------- dispatch mode
class _TraceMode(MsDispatchMode):
    """One dispatch mode for everything the prober watches: the CPU meter (every op's inputs and
    outputs), the step's state (tensors that existed before it and that it writes), the random
    primitives' shield, and the op recorder of the profile. PyNative's front-end pipeline is off
    while it is active (else MindSpore 2.10's modes miss ops)."""

    def __init__(self, live: Optional[LiveTensorMeter] = None, state: Optional[_StepState] = None,
                 shield: Optional[_Shield] = None, recorder: Optional["_Recorder"] = None) -> None:
        super().__init__()
        self.live = live
        self.state = state
        self.shield = shield
        self.recorder = recorder
        self._was_off: List[bool] = []

    def __enter__(self) -> "_TraceMode":
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

    def __ms_dispatch__(self, func: Any, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if self.shield is not None and is_legacy_primitive_call(args) and is_random_op(args[1]):
            args = self.shield.args(args)
        live, state = self.live, self.state
        inputs = list(_tensors(args)) + list(_tensors(kwargs.values()))
        written: List[Tensor] = []
        if state is not None or self.recorder is not None:
            written = list(_backend().written_tensors(func, args, kwargs)) + _side_effect_args(args)
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
        alias = _backend().alias(t)
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
    """Call 1's op records: the op calls of the layer whose forward runs (per layer), which of
    the storages they made autograd saved, the storages saved per layer, and the trainable
    parameters the step reached (whose gradient hooks feed the meter)."""

    def __init__(self, key_of: Callable[[Any, tuple], OpKey], live: LiveTensorMeter, count_grads: bool) -> None:
        self.key_of = key_of
        self.live = live
        self.count_grads = count_grads  # (on a CPU: the meter counts gradients through hooks)
        self.layer: Optional[int] = None
        self.ops: Dict[int, List[OpRecord]] = {}
        self.saved_by: Dict[int, Dict[int, int]] = {}  # layer -> storage -> bytes
        self.made_by: Dict[int, Tuple[int, OpRecord]] = {}
        self.params: Dict[int, Any] = {}  # address -> trainable parameter reached in forward
        self.hooks: List[Any] = []
        live.on_death(lambda ptr: self.made_by.pop(ptr, None))  # (an address is reused once it died)

    def op(self, func: Any, args: Tuple[Any, ...], inputs: List[Tensor], made: Dict[int, int], mutating: bool) -> None:
        backend = _backend()
        forward = not backend.in_backward()
        if forward:  # (a trainable parameter the step reaches: its gradient feeds the meter)
            for t in inputs:
                ptr = _address(t)
                param = self.live.parameter(ptr) if ptr is not None else None
                if param is not None and ptr not in self.params:
                    self.params[ptr] = param
                    if self.count_grads:
                        self.hooks.append(param.register_hook(self._grad_hook))
        if self.layer is None or not forward:
            return
        name = op_name(func)
        record = OpRecord(self.key_of(func, args), sum(made.values()), False, mutating, name in EXPENSIVE_OPS)
        self.ops.setdefault(self.layer, []).append(record)
        for ptr in made:
            self.made_by[ptr] = (self.layer, record)

    def _grad_hook(self, grad: Any) -> None:
        self.live.hold(grad)

    def saved(self, t: Tensor) -> None:
        if self.layer is None:
            return
        ptr = _address(t)
        if ptr is None:
            return
        made = self.made_by.get(ptr)
        if made is not None and made[0] == self.layer:  # (saved by the layer that made it)
            made[1].saved = True
        self.saved_by.setdefault(self.layer, {})[ptr] = self.live.bytes_of(t)

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


# ----------------------------------------------------------------------------------- segments
class _Segments:
    """Cuts a region measured by ``meter`` into :class:`Segment` s, at marks."""

    def __init__(self, meter: Any) -> None:
        self.meter = meter
        self.segments: List[Segment] = []

    def mark(self, kind: str, layer: int) -> None:
        peak = self.meter.reset_peak()
        if self.segments:
            self.segments[-1].peak = max(self.segments[-1].start, peak)
        start = self.meter.current_bytes
        self.segments.append(Segment(kind, layer, start, start))

    def close(self) -> None:
        self.mark("end", -1)
        self.segments.pop()


def _layer_marks(layers: Sequence[nn.Cell], segments: Any,
                 on_pre: Optional[Callable[[int, tuple, dict], None]] = None,
                 on_post: Optional[Callable[[int, Any], None]] = None) -> List[Any]:
    """Hooks marking each layer's forward, the stretch after it, and its backward (when the
    gradient of its output is ready). Returns the removable handles."""
    backend = _backend()
    handles = []
    for j, layer in enumerate(layers):
        def pre(cell: Any, args: tuple, kwargs: dict, j: int = j) -> None:
            if backend.in_backward():  # (a recomputation: not a new forward)
                return
            segments.mark("fwd", j)
            if on_pre is not None:
                on_pre(j, args, kwargs)

        def post(cell: Any, args: tuple, kwargs: dict, out: Any, j: int = j) -> None:
            if backend.in_backward():
                return
            if on_post is not None:
                on_post(j, out)
            segments.mark("gap", j)
            fired = [False]

            def on_grad(grad: Any) -> None:
                if not fired[0]:
                    fired[0] = True
                    segments.mark("bwd", j)

            for t in _outputs(out):
                if backend.requires_grad(t):
                    t.register_hook(on_grad)

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    return handles


class _Call:
    """What one instrumented call of the step found (``MindSporeProber._instrumented``)."""

    def __init__(self) -> None:
        self.segments: List[Segment] = []
        self.inputs: Dict[int, int] = {}
        self.flows: List[bool] = []
        self.outputs: Dict[int, int] = {}
        self.reached: Dict[int, int] = {}
        self.baseline = 0
        self.peak = 0
        self.state: Any = None
        self.meter: Any = None
        self.recorder: Any = None


class _Timer:
    """``_layer_marks``'s target in the timing call: the time of each layer's backward (from its
    mark to the next), nothing else."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.marks: List[Tuple[int, float]] = []
        self._now = now

    def mark(self, kind: str, layer: int) -> None:
        if kind == "bwd":
            _synchronize()
            self.marks.append((layer, self._now()))

    def backward_times(self) -> Dict[int, float]:
        return {j: t_next - t for (j, t), (_, t_next) in zip(self.marks, self.marks[1:])}


# ----------------------------------------------------------------------------------- the prober
class MindSporeProber:
    """Profiling and probing on MindSpore (see the module docstring); the planner's framework part."""

    name = "mindspore"

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

    @staticmethod
    def after_wrap(model: Any, layers: Sequence[nn.Cell], recomputes: bool) -> None:
        """Nothing: no MindSpore model needs more once its layers are wrapped."""

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

    def wrap(self, layer: nn.Cell, option: LayerOption, seen: Sequence[OpKey]) -> Any:
        """Wrap ``layer`` in place for ``option`` through the public API; the generated policy."""
        policy = option_policy(option, seen, self.key_of, self.nbytes)
        if option.kind == "swap":
            swap_wrapper(layer, policy_fn=policy)
        elif option.kind == "checkpoint":
            checkpoint_wrapper(layer, policy_fn=policy, swap_inputs=option.swap_inputs)
        return policy

    @staticmethod
    def device() -> str:
        target = ms.get_context("device_target")
        if target in _ACCELERATORS:
            return f"{target}:{ms.get_context('device_id')}"
        return target

    # ------------------------------------------------------------------ profiling the step
    def _instrumented(self, layers: Sequence[nn.Cell], step_fn: Callable[[], Any]) -> "_Call":
        """One instrumented call of ``step_fn`` (call 1 of profiling): segments, op records, saved
        storages, memory. What it changes is put back."""
        call = _Call()
        cpu = _accelerator() is None
        call.state = state = _StepState()
        state.save_rng()
        meter = call.meter = memory_meter()
        live = meter if cpu else LiveTensorMeter()  # (on an accelerator: the recorder's storage lives)
        recorder = call.recorder = _Recorder(self.key_of, live, count_grads=cpu)

        def on_pre(j: int, args: tuple, kwargs: dict) -> None:
            recorder.layer = j
            x = args[0] if args and isinstance(args[0], Tensor) else None
            found = _storage(x) if x is not None else None
            call.inputs[j] = found[1] if found is not None else 0
            call.flows.append(x is not None and call.outputs.get(j - 1) == id(x))

        def on_post(j: int, out: Any) -> None:
            recorder.layer = None
            call.outputs[j] = id(_hidden(out))

        mode = _TraceMode(live=live, state=state, shield=_Shield(), recorder=recorder)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(meter)
                if live is not meter:
                    stack.enter_context(live)
                segments = _Segments(meter)
                handles = _layer_marks(layers, segments, on_pre, on_post)
                try:
                    segments.mark("pre", -1)
                    with mode, _SavedHooks(live, recorder):
                        step_fn()
                    segments.close()
                finally:
                    for h in handles:
                        h.remove()
                    recorder.remove_hooks()
                call.reached = dict(live.reached)
        finally:
            state.restore()
        call.segments = segments.segments
        if cpu:
            # The step's memory on a CPU: what it allocates (counted) plus the storages it reached that
            # existed before it (parameters, inputs; as the budget counts them), whatever else the process holds.
            before = sum(call.reached.values())
            for segment in call.segments:
                segment.start += before
                segment.peak += before
            call.baseline, call.peak = before, meter.peak_bytes + before
        else:
            call.baseline, call.peak = meter.baseline_bytes, meter.peak_bytes
        return call

    def step_peak(self, layers: Sequence[nn.Cell], step_fn: Callable[[], Any]) -> int:
        """The peak device memory of one ``step_fn()`` as the planner counts it (the budget's
        quantity; ``layers`` mark the segments): MindSpore's allocator on Ascend / GPU (measured),
        the live-tensor count on a CPU (estimated, see the module docstring). Puts back what the
        step changes, as profiling does."""
        return self._instrumented(layers, step_fn).peak

    def profile_step(self, layers: Sequence[nn.Cell], step_fn: Callable[[], Any]) -> StepProfile:
        _backend().check_ready("plan_memory")
        n = len(layers)
        cpu = _accelerator() is None
        # Call 1: the memory timeline, every layer's ops and saved storages.
        first = self._instrumented(layers, step_fn)
        segments, recorder, state = first.segments, first.recorder, first.state
        inputs, flows = first.inputs, first.flows
        kinds = [(s.kind, s.layer) for s in segments]
        expected = [("pre", -1)] + [(k, j) for j in range(n) for k in ("fwd", "gap")] + \
                   [("bwd", j) for j in range(n - 1, -1, -1)]
        if kinds != expected:
            raise RuntimeError(
                "plan_memory: step_fn must run every layer's forward once, in order, then the backward "
                f"through all of them (got the layer events {[f'{k} {j}' for k, j in kinds[:12]]}...). Pass the "
                "model's layer stack in the order its forward calls it, and a step_fn doing one forward + backward "
                "(mindspore.value_and_grad / grad / vjp with its backward).")
        # Call 2: the plain step's time and each layer's; an input of every layer kept for probes.
        times = [[0.0, 0.0] for _ in range(n)]
        clock: Dict[str, float] = {}
        captured: Dict[int, Tuple[tuple, dict]] = {}
        now = _clock()

        def timed_pre(j: int, args: tuple, kwargs: dict) -> None:
            captured[j] = (args, kwargs)
            _synchronize()
            clock["f"] = now()

        def timed_post(j: int, out: Any) -> None:
            _synchronize()
            times[j][0] = now() - clock["f"]

        second = state.again()
        second.save_rng()
        timer = _Timer(now)
        handles = _layer_marks(layers, timer, timed_pre, timed_post)
        try:
            with _TraceMode(shield=_Shield()), _no_gc():
                _synchronize()
                t0 = now()
                step_fn()
                _synchronize()
                step_s = now() - t0
        finally:
            for h in handles:
                h.remove()
            second.restore()
        for j, seconds in timer.backward_times().items():
            times[j][1] = seconds
        records = []
        for j in range(n):
            sizes = sorted(recorder.saved_by.get(j, {}).values(), reverse=True)
            records.append(LayerRecord(j, "", recorder.ops.get(j, []), sizes, inputs.get(j, 0), times[j][0],
                                       times[j][1]))
        types = self._layer_types(layers, records, captured)
        params: Dict[int, int] = {}
        for layer in layers:
            for p in layer.get_parameters():
                found = _storage(p)
                if found is not None:
                    params[found[0]] = found[1]
        grads: Dict[int, int] = {}
        for p in recorder.params.values():
            found = _storage(p)
            if found is not None:
                grads[found[0]] = found[1]
        notes = []
        if cpu:
            notes.append("memory on MindSpore's CPU build is estimated: MindSpore keeps no allocator statistics on "
                         "a CPU, so the planner counts live tensors itself (op inputs and outputs, saved tensors, "
                         "gradients, the engine's tensors at layer boundaries); it misses what only C++ holds, "
                         "such as the outputs of backward kernels no dispatch mode sees (legacy primitives: "
                         "LayerNorm, BiasAdd, Dropout); see docs/mindspore.md")
        baseline, peak = first.baseline, first.peak
        if not all(flows[1:]):
            notes.append("a layer's input is not the previous layer's output: the probes chain the layers anyway")
        return StepProfile(
            device=self.device(), segments=segments, layers=records, types=types,
            baseline_bytes=baseline, peak_bytes=peak, step_s=step_s,
            param_bytes=max(sum(params.values()), sum(grads.values())), grad_bytes=sum(grads.values()),
            copy_bytes_per_s=self.copy_bandwidth(), overlaps=not cpu, notes=notes)

    def _layer_types(self, layers: Sequence[nn.Cell], records: List[LayerRecord],
                     captured: Dict[int, Tuple[tuple, dict]]) -> Dict[str, LayerType]:
        """Group the layers whose profiles agree (class, parameter shapes, input shapes, ops,
        saved storages) into :class:`LayerType` s; each keeps its first layer's captured input."""
        types: Dict[str, LayerType] = {}
        signatures: Dict[Any, str] = {}
        for j, (layer, record) in enumerate(zip(layers, records)):
            args, kwargs = captured[j]
            signature = (type(layer).__qualname__,
                         tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.parameters_and_names()),
                         tuple((tuple(t.shape), str(t.dtype)) for t in _tensors(args)),
                         tuple((r.key, r.new_bytes, r.saved) for r in record.ops),
                         tuple(record.saved_sizes))
            key = signatures.get(signature)
            if key is None:
                key = signatures[signature] = f"{type(layer).__name__}#{len(signatures)}"
                types[key] = LayerType(key, [], record, _ProbeInput(layer, args, kwargs))
            types[key].layers.append(j)
            record.type_key = key
        return types

    @staticmethod
    def copy_bandwidth(nbytes: int = 16 << 20) -> float:
        """Bytes per second of one direction of a host <-> device copy (into the engine's kind of
        host buffer: pinned on an accelerator; a memory copy on a CPU), the faster of three."""
        backend = _backend()
        with _shim.internal():
            src = ops.zeros((nbytes,), ms.uint8)
            dst = backend.empty_host_bytes(nbytes)
            best = float("inf")
            for _ in range(3):
                _synchronize()
                t0 = time.perf_counter()
                dst.copy_(src)
                _synchronize()
                best = min(best, time.perf_counter() - t0)
        return nbytes / max(best, 1e-9)

    # ------------------------------------------------------------------ probing one layer type
    def probe(self, ltype: LayerType, option: LayerOption, seen: Sequence[OpKey],
              reference: Optional[Dict[str, Any]] = None) -> Tuple[Effect, Dict[str, Any]]:
        """Measure ``option`` on copies of ``ltype``'s layer (see the module docstring). Returns
        its :class:`Effect` and the reference runs (every copy left as it is), which the caller
        passes back for the type's other options."""
        source: _ProbeInput = ltype.probe_inputs
        if reference is None:
            reference = {"middle": self._chain_memory(source, [None] * 4, seen),
                         "last": self._chain_memory(source, [None] * 2, seen),
                         "time": self._chain_time(source, None, seen)}
        middle = self._chain_memory(source, [None, option, None, None], seen)
        last = self._chain_memory(source, [None, option], seen)
        delta_m = {k: middle[k] - reference["middle"][k] for k in middle}
        delta_l = {k: last[k] - reference["last"][k] for k in last}
        old = max(delta_m["gap 2"], delta_m["fwd 3"], delta_m["gap 3"], delta_m["bwd 3"])
        effect = {
            "own_fwd": delta_m["fwd 1"], "own_gap": delta_m["gap 1"], "fwd_age1": delta_m["fwd 2"], "old": old,
            "bwd_prev": delta_m["bwd 2"], "own_bwd": delta_m["bwd 1"],
            "after": max(delta_m["bwd 0"], delta_l["bwd 0"]),
            "last_fwd": delta_l["fwd 1"], "last_head": delta_l["gap 1"], "last_bwd": delta_l["bwd 1"],
        }
        assert set(effect) == set(RELATIONS)
        # Every option adds work to the layer (recompute, copies, bookkeeping): a run measured faster
        # than the plain layer is timing noise, and counts as free.
        seconds = max(0.0, (self._chain_time(source, option, seen) - reference["time"]) / 3)
        return Effect(effect, seconds, measured=True), reference

    def _copies(self, source: "_ProbeInput", options: Sequence[Optional[LayerOption]],
                seen: Sequence[OpKey]) -> List[nn.Cell]:
        copies = [copy.deepcopy(source.layer) for _ in options]
        for i, option in enumerate(options):
            if option is not None:
                self.wrap(copies[i], option, seen)
        for i in range(len(copies) - 1):
            SwapManager().set_forward_prefetch_layer(copies[i], copies[i + 1])
        return copies

    @staticmethod
    def _forget(copies: List[nn.Cell]) -> None:
        """Drop the probe's layer-chain groups (their layers die with the probe)."""
        manager = SwapManager()
        names = [manager.layer_group_name(layer) for layer in copies]
        copies.clear()  # (the copies die here: nothing else refers to them)
        for name in names:
            if name is not None:
                try:
                    manager.discard_group(name)
                except ValueError:  # a copy is still alive (a cycle): collect it, then drop its group
                    gc.collect()
                    manager.discard_group(name)

    def _chain_memory(self, source: "_ProbeInput", options: Sequence[Optional[LayerOption]],
                      seen: Sequence[OpKey]) -> Dict[str, int]:
        """Segment peaks (by name) of one forward + backward of a chain of copies."""
        copies = self._copies(source, options, seen)
        cpu = _accelerator() is None
        try:
            with _kept(source) as state:
                inputs = source.inputs()
                meter = memory_meter()
                live = meter if cpu else LiveTensorMeter()  # (on an accelerator: which tensors existed before)
                with contextlib.ExitStack() as stack:
                    stack.enter_context(meter)
                    if live is not meter:
                        stack.enter_context(live)
                    segments = _Segments(meter)
                    handles = _layer_marks(copies, segments)
                    if cpu:  # (the gradients of the copies' parameters: see LiveTensorMeter)
                        handles += [p.register_hook(live.hold) for c in copies for p in c.trainable_params()]
                    try:
                        segments.mark("pre", -1)
                        with _TraceMode(live=live, state=state, shield=_Shield()), _SavedHooks(live):
                            source.run(copies, inputs)
                        segments.close()
                    finally:
                        for h in handles:
                            h.remove()
                source.note_outside(state, copies)
        finally:
            self._forget(copies)
        return {s.name: s.peak for s in segments.segments}

    def _chain_time(self, source: "_ProbeInput", option: Optional[LayerOption], seen: Sequence[OpKey]) -> float:
        """Seconds of one forward + backward of three copies, all wrapped by ``option`` (the
        fastest of several runs)."""
        copies = self._copies(source, [option] * 3, seen)
        now = _clock()
        best = float("inf")
        try:
            with _kept(source), _TraceMode(shield=_Shield()):
                inputs = source.inputs()
                source.run(copies, inputs)
                for _ in range(_PROBE_REPEATS):
                    _synchronize()
                    with _no_gc():
                        t0 = now()
                        source.run(copies, inputs)
                        _synchronize()
                        best = min(best, now() - t0)
        finally:
            self._forget(copies)
        return best

    def op_seconds(self, ltype: LayerType) -> Dict[OpKey, float]:
        """Forward seconds of each op kind of ``ltype``'s layer (the sum over its calls; the
        fastest of several runs of a copy), what recomputing it costs."""
        source: _ProbeInput = ltype.probe_inputs
        layer = copy.deepcopy(source.layer)
        with _kept(source) as state, LiveTensorMeter() as live:  # (an untimed run finds what it writes outside)
            with _TraceMode(live=live, state=state, shield=_Shield()), _no_grad():
                source.forward(layer)
            source.note_outside(state, [layer])
        timer = _OpTimer(self.key_of)
        with _kept(source), _no_grad():
            for _ in range(_PROBE_REPEATS):
                timer.start_run()
                with _no_gc(), timer:
                    source.forward(layer)
        return timer.best()


@contextlib.contextmanager
def _no_grad() -> Iterator[None]:
    with _shim.no_grad():
        yield


class _OpTimer(MsDispatchMode):
    """Times every op call of a forward; keeps the fastest of the runs, per call. Random legacy
    primitives run shielded (see :class:`_Shield`)."""

    def __init__(self, key_of: Callable[[Any, tuple], OpKey]) -> None:
        super().__init__()
        self.key_of = key_of
        self.now = _clock()
        self.runs: List[List[Tuple[OpKey, float]]] = []
        self._shield = _Shield()
        self._was_off: List[bool] = []

    def start_run(self) -> None:
        self.runs.append([])

    def __enter__(self) -> "_OpTimer":
        self._was_off.append(_shim.disable_pipeline())
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            _shim.restore_pipeline(self._was_off.pop())

    def __ms_dispatch__(self, func: Any, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if is_legacy_primitive_call(args) and is_random_op(args[1]):
            args = self._shield.args(args)
        _synchronize()
        t0 = self.now()
        out = func(*args, **kwargs) if kwargs else func(*args)
        _synchronize()
        self.runs[-1].append((self.key_of(func, args), self.now() - t0))
        return out

    def best(self) -> Dict[OpKey, float]:
        out: Dict[OpKey, float] = {}
        calls = min(len(r) for r in self.runs)
        for i in range(calls):
            key = self.runs[0][i][0]
            out[key] = out.get(key, 0.0) + min(r[i][1] for r in self.runs)
        return out


class _ProbeInput:
    """One layer and the input it received in the step: what a probe runs copies of. The input's
    tensors are kept as host (numpy) copies between probes, never as device memory."""

    def __init__(self, layer: nn.Cell, args: tuple, kwargs: dict) -> None:
        self.layer = layer
        self.outside: List[Tensor] = []  # tensors outside the layer a run writes in place
        with _shim.internal():
            self._host = copy.deepcopy(_tree_map(_to_host, (tuple(args), dict(kwargs))))

    def note_outside(self, state: _StepState, copies: Sequence[nn.Cell]) -> None:
        """Remember the tensors outside ``copies`` that a watched run wrote (``state``): every later
        run of this layer's copies puts them back too (its time runs watch nothing)."""
        own = {_address(t) for c in copies for t in c.get_parameters()}
        found = [t for key, (t, _) in state.written.items() if key not in own]
        self.outside = list({id(t): t for t in [*self.outside, *found]}.values())

    def inputs(self) -> Tuple[Tensor, tuple, dict]:
        """The input on the device: ``(activation, other arguments, keyword arguments)``. Other
        objects among them are fresh copies for every run."""
        args, kwargs = _tree_map(_from_host, copy.deepcopy(self._host))
        return args[0], tuple(args[1:]), kwargs

    def forward(self, layer: nn.Cell) -> Any:
        x, rest, kwargs = self.inputs()
        return layer(x, *rest, **kwargs)

    def run(self, copies: Sequence[nn.Cell], inputs: Optional[Tuple[Tensor, tuple, dict]] = None) -> None:
        """Forward through the chain of copies and backward from its end (``mindspore.vjp`` with a
        cotangent of ones), as the step does."""
        x, rest, kwargs = inputs if inputs is not None else self.inputs()
        weights = [p for layer in copies for p in layer.trainable_params()]

        def chain(h: Tensor) -> Tensor:
            for layer in copies:
                h = _hidden(layer(h, *rest, **kwargs))
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


@contextlib.contextmanager
def _kept(source: _ProbeInput) -> Iterator[_StepState]:
    """A probe leaves the program as it found it: the default generator, and every tensor
    outside the probe's copies that it writes in place (found by the memory runs' mode; a hook of
    the layer that uses a cell of the model). Legacy random primitives run shielded inside."""
    state = _StepState()
    state.save_rng()
    for t in source.outside:
        state.keep(t)
    try:
        yield state
    finally:
        state.restore()
