"""The planner's profiling and probing, written once for every framework: :class:`ChainProber`.

Profiling (:meth:`ChainProber.profile_step`) calls the user's ``step_fn`` twice:

1. instrumented (the framework's :meth:`~ChainProber._instrumented`): under a memory meter, with
   layer hooks cutting the step into segments (each layer's forward, the stretch after it, each
   layer's backward, which starts when the gradient of its output is ready; :mod:`.segments`),
   a dispatch mode recording every op of each layer's forward and saved-tensor hooks recording
   what autograd keeps (into a :class:`LayerLog`);
2. plain, for the step's time, with hooks that time each layer (synchronised, so that an
   accelerator's times are its kernels') and keep one input of each kind of layer for the probes.

Around both calls the framework puts back everything the step changes (its ``state``).

Probing (:meth:`ChainProber.probe`) runs deep copies of one layer alone, chained through the
layer chain as the model's layers are, on the input it received in the step: once with every
copy left as it is and once with one copy wrapped by the option, and reads the difference at
each segment (:class:`~hyper_parallel.planner.profile.Effect`). Four copies with the option on
the second show how a layer affects its own forward and backward, the next layer's and later
ones; two copies with the option on the last show the last layer's case. The time is that of
three copies all wrapped, against three left as they are, the fastest of several runs.

A framework's prober subclasses :class:`ChainProber` and implements its primitives (the
abstract methods, listed in its docstring) and the ``Prober`` protocol's own framework methods
(``is_layer``, ``is_stack``, ``find_layers``). This module imports no framework.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import gc
import time
import weakref
from dataclasses import dataclass, field
from typing import (Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence,
                    Tuple)

from hyper_parallel.core.swap_manager import SwapManager
from hyper_parallel.core.wrapping import checkpoint_wrapper, swap_wrapper
from hyper_parallel.tools.gc_pause import no_gc

from .options import LayerOption, OpKey, option_policy
from .profile import Effect, LayerRecord, LayerType, OpRecord, RELATIONS, Segment, StepProfile
from .segments import BackwardTimer, Meter, PostHook, PreHook, Segments, check_layer_events, layer_marks

__all__ = ["ChainProber", "ProbeSource", "LayerLog", "StepTrace", "OpTimes", "layer_output", "tensors_in",
           "fastest_seconds", "SLACK_BYTES", "PROBE_REPEATS"]

#: Timed runs per measurement (a probe's chain, an op-timing forward, a copy); the fastest counts.
PROBE_REPEATS = 3
#: Bytes added to every relation of a wrapped layer's effect but ``after_bwd``: the small allocations
#: of the engine and of the framework's checkpoint around a wrapped layer (random-number states,
#: handles), a few hundred bytes that two peaks measured at different moments can miss.
SLACK_BYTES = 4 << 10


#: What ``measure_step`` (and so ``measure_plan``) gives for a step that ran out of device memory:
#: more than any budget
OUT_OF_MEMORY = float("inf")


def free_after_out_of_memory() -> None:
    """Free what a call that ran out of device memory left behind. Its tensors can stay alive after
    the exception is handled, in reference cycles through the traceback (the frames of the context
    managers it passed through): until a full collection they hold device memory the next try needs."""
    gc.collect()


def layer_output(out: Any, tensor_type: type) -> Any:
    """The activation a layer passes to the next: its output, or the first element of it."""
    if isinstance(out, tensor_type):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], tensor_type):
        return out[0]
    raise TypeError(f"plan_memory: a layer returned {type(out).__name__}; the planner needs a layer stack whose "
                    "layers return the next layer's input (a tensor, or a tuple whose first item is one).")


def tensors_in(values: Iterable[Any], tensor_type: type) -> Iterator[Any]:
    """The tensors among ``values`` and one level of tuples / lists in them (an op's arguments)."""
    for v in values:
        if isinstance(v, tensor_type):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, tensor_type))


def fastest_seconds(run: Callable[[], Any], synchronize: Callable[[], None],
                    now: Callable[[], float] = time.perf_counter, repeats: int = PROBE_REPEATS) -> float:
    """The fastest of ``repeats`` runs of ``run``, each between two synchronisations."""
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        t0 = now()
        run()
        synchronize()
        best = min(best, now() - t0)
    return best


class ProbeSource(Protocol):
    """One layer and the input it received in the step (kept on the host between probes): what
    a probe runs copies of. Each framework's prober makes its own (:meth:`ChainProber._probe_input`)."""

    layer: Any
    device: Any          # where the layer runs (what ``synchronize`` and ``_clock`` take)
    outside: List[Any]   # tensors outside the layer that a run writes in place (put back by ``_restored_after``)

    def inputs(self, copies: int = 1) -> List[Any]:
        """The input on the device for a chain of ``copies``, made afresh for every run:
        ``[activation, calls]``, ``calls`` holding per copy ``(other arguments, keyword
        arguments)`` (tensors shared, other objects, such as a cache the layer writes, one per
        copy)."""
        ...

    def forward(self, layer: Any) -> Any:
        """``layer``'s forward on fresh inputs."""
        ...

    def run(self, copies: Sequence[Any], inputs: Optional[List[Any]] = None) -> None:
        """Forward through the chain of ``copies`` and backward from its end, as the step does. It
        takes ``inputs`` (and empties the list): what the copies were called with lives on only
        where their autograd keeps it, as a training step drops its model's outputs (and a cache
        in them) before the backward."""
        ...


class LayerLog:
    """What the instrumented call of the step records per layer: its input (bytes, the shapes of
    its tensor arguments, whether it is the previous layer's output, whether the program still
    holds it when the next layer ends), the op calls of its forward, and the storages autograd
    saved in it. The layer hooks call :meth:`on_pre` / :meth:`on_post`, the framework's dispatch
    mode :meth:`op` and :meth:`forget`, its saved-tensor hook :meth:`save`. Storages are named by
    whatever key the framework gives them (its storage identity)."""

    def __init__(self, tensor_type: type, storage_bytes: Callable[[Any], int]) -> None:
        self._tensor_type = tensor_type
        self._storage_bytes = storage_bytes
        self.layer: Optional[int] = None  # the layer whose forward runs now
        self.ops: Dict[int, List[OpRecord]] = {}
        self.saved: Dict[int, Dict[Any, int]] = {}  # layer -> storage -> bytes
        # storage -> the layer and op record that made it (a storage's key can be reused once it
        # died: the framework forgets it then)
        self.made_by: Dict[Any, Tuple[int, OpRecord]] = {}
        self.inputs: Dict[int, int] = {}          # layer -> bytes of its input activation
        self.arg_shapes: Dict[int, tuple] = {}    # layer -> (shape, dtype) of its tensor arguments
        self.flows: List[bool] = []               # per layer: its input is the previous layer's output
        self.held: List[int] = []                 # layers whose input outlived the next layer
        self._outputs: Dict[int, int] = {}        # layer -> id of its output activation
        self.reshapes: Dict[int, Tuple[Any, Any]] = {}  # layer -> (input, output) (shape, dtype) where they differ
        self._given: Dict[int, Any] = {}          # layer -> a weak reference to its input

    # -- the layer hooks (the first micro-step is recorded: every micro-batch runs the same)
    def on_pre(self, j: int, args: tuple, kwargs: dict) -> None:
        if j in self.inputs:
            self.layer = None
            return
        self.layer = j
        self.arg_shapes[j] = tuple((tuple(t.shape), str(t.dtype), bool(getattr(t, "requires_grad", False)))
                                   for t in tensors_in(args, self._tensor_type))
        x = args[0] if args and isinstance(args[0], self._tensor_type) else None
        if x is not None:
            self._given[j] = weakref.ref(x)
            self._entered = (tuple(x.shape), str(x.dtype))
        self.inputs[j] = self._storage_bytes(x) if x is not None else 0
        self.flows.append(x is not None and self._outputs.get(j - 1) == id(x))

    def on_post(self, j: int, out: Any) -> None:
        if self.layer is None:
            return
        self.layer = None
        h = layer_output(out, self._tensor_type)
        self._outputs[j] = id(h)
        if (tuple(h.shape), str(h.dtype)) != getattr(self, "_entered", None):
            self.reshapes[j] = (getattr(self, "_entered", None), (tuple(h.shape), str(h.dtype)))
        # (autograd keeps aliases of what it saves: the input object itself outlives the next
        # layer only where the program holds it)
        earlier = self._given.pop(j - 1, None)
        if earlier is not None and earlier() is not None:
            self.held.append(j - 1)

    # -- the dispatch mode and the saved-tensor hook
    def op(self, key: OpKey, new_bytes: int, mutating: bool, expensive: bool, made: Iterable[Any]) -> None:
        """An op call of the running layer's forward, which made the storages ``made``."""
        if self.layer is None:
            return
        record = OpRecord(key, new_bytes, False, mutating, expensive)
        self.ops.setdefault(self.layer, []).append(record)
        for storage in made:
            self.made_by[storage] = (self.layer, record)

    def forget(self, storage: Any) -> None:
        """``storage`` died (its key may name another one from now on)."""
        self.made_by.pop(storage, None)

    def save(self, storage: Any, nbytes: int, name: Any = None) -> None:
        """Autograd saved a tensor of ``storage`` (``nbytes``) in the running layer's forward;
        ``name``: what names that saved storage for as long as autograd holds it, if not its key
        (a storage moved to the host dies at once, and its key may name another one)."""
        if self.layer is None:
            return
        made = self.made_by.get(storage)
        if made is not None and made[0] == self.layer:  # (saved by the layer that made it)
            made[1].saved = True
        self.saved.setdefault(self.layer, {})[storage if name is None else name] = nbytes


@dataclass
class StepTrace:
    """What the instrumented call of the step found (the framework's ``_instrumented``)."""

    segments: List[Segment]  # absolute bytes, as the budget counts them
    log: LayerLog
    baseline_bytes: int
    peak_bytes: int
    param_bytes: int         # the parameters the step reached
    grad_bytes: int          # the gradients its backward makes (of the leaves its forward used)
    #: what the step changes, put back after the call: ``state.fresh_snapshot()`` snapshots the same tensors
    #: now, for the timing call (an object with ``fresh_snapshot``, ``save_rng`` and ``restore``)
    state: Any
    notes: List[str] = field(default_factory=list)


class OpTimes:
    """The time of every op call of a forward over several runs; per call, the fastest run. The
    framework's op-timing dispatch mode (:meth:`ChainProber._op_timer`) passes each call through
    :meth:`call`."""

    def __init__(self, now: Callable[[], float], synchronize: Callable[[], None]) -> None:
        self._now = now
        self._synchronize = synchronize
        self.runs: List[List[Tuple[OpKey, float]]] = []

    def start_run(self) -> None:
        self.runs.append([])

    def call(self, key: OpKey, run: Callable[[], Any]) -> Any:
        """``run()`` (one op call, ``key``) between two synchronisations, timed; its result."""
        self._synchronize()
        t0 = self._now()
        out = run()
        self._synchronize()
        self.runs[-1].append((key, self._now() - t0))
        return out

    def best(self) -> Dict[OpKey, float]:
        out: Dict[OpKey, float] = {}
        calls = min(len(r) for r in self.runs)
        for i in range(calls):
            key = self.runs[0][i][0]
            out[key] = out.get(key, 0.0) + min(r[i][1] for r in self.runs)
        return out


class _Ran:
    """A :func:`layer_marks` target recording which layers ran their forward."""

    def __init__(self, into: set) -> None:
        self.into = into

    def mark(self, kind: str, layer: int) -> None:
        if kind == "fwd":
            self.into.add(layer)


class ChainProber(abc.ABC):
    """Profiling and probing (see the module docstring) on a framework's primitives.

    A subclass sets ``name`` and ``tensor_type`` (the framework's tensor class) and implements:

    - names and sizes: :meth:`key_of`, :meth:`nbytes` (the ``Prober`` protocol's);
      :meth:`_storage_bytes`, :meth:`_named_parameters`;
    - devices and time: :meth:`_device_of`, :meth:`synchronize`, :meth:`_clock`,
      :meth:`_timing_mode`, :meth:`_no_grad`;
    - autograd: :meth:`_in_backward`, :meth:`_grad_outputs`, :meth:`_clear_grads`;
    - the step: :meth:`_instrumented` (call 1 of profiling), :meth:`_probe_input`,
      :meth:`_copy_bytes_per_s`, :meth:`_copies_overlap`;
    - probes: :meth:`_restored_after`, :meth:`_chain_meter`, :meth:`_op_timer`.
    """

    #: the framework's name (``"torch"``, ``"mindspore"``), stored in plans
    name: str
    #: the framework's tensor class
    tensor_type: type
    #: how to write a step in the framework, appended to the error for a step that runs the
    #: layers out of order
    step_hint: str = ""

    # ------------------------------------------------------------------ primitives: names and sizes
    @abc.abstractmethod
    def key_of(self, op: Any, args: Tuple[Any, ...]) -> OpKey:
        """An op call's :class:`OpKey` (what generated policies look up)."""

    @abc.abstractmethod
    def nbytes(self, t: Any) -> int:
        """Bytes of the storage a saved tensor views (what a swap moves)."""

    @abc.abstractmethod
    def _storage_bytes(self, t: Any) -> int:
        """Bytes of the storage of a layer's input tensor (cheap; 0 for one without memory)."""

    @abc.abstractmethod
    def _named_parameters(self, layer: Any) -> Iterable[Tuple[str, Any]]:
        """``(name, parameter)`` of every parameter of ``layer``."""

    # ------------------------------------------------------------------ primitives: devices and time
    @abc.abstractmethod
    def _device_of(self, layers: Sequence[Any]) -> Any:
        """Where ``layers`` run (passed to ``synchronize`` and ``_clock``; its ``str`` is the
        profile's device)."""

    @abc.abstractmethod
    def synchronize(self, device: Any) -> None:
        """Wait for every kernel launched on ``device``."""

    @abc.abstractmethod
    def _clock(self, device: Any) -> Callable[[], float]:
        """The clock steps, probes and ops are timed with on ``device``."""

    @abc.abstractmethod
    def _timing_mode(self) -> ContextManager[Any]:
        """What every timed run of a whole forward + backward runs under (nothing, or what keeps
        the program's state from being drawn on)."""

    @abc.abstractmethod
    def _no_grad(self) -> ContextManager[Any]:
        """Autograd records nothing in the block."""

    # ------------------------------------------------------------------ primitives: autograd
    @abc.abstractmethod
    def _in_backward(self) -> bool:
        """Whether autograd runs a backward now (a recomputation's forward is no new forward)."""

    @abc.abstractmethod
    def _grad_outputs(self, out: Any) -> Iterable[Any]:
        """The tensors of a layer's output that require a gradient (hooked for its backward)."""

    @abc.abstractmethod
    def _clear_grads(self, layers: Sequence[Any]) -> None:
        """Drop the gradients a run left on ``layers``' parameters (where the framework keeps them)."""

    # ------------------------------------------------------------------ primitives: the step
    @abc.abstractmethod
    def _instrumented(self, layers: Sequence[Any], step_fn: Callable[[], Any], device: Any) -> StepTrace:
        """Call 1 of profiling: one ``step_fn()`` under the framework's meter, dispatch mode and
        saved-tensor hooks, its segments cut by :meth:`_segmented` with a :class:`LayerLog`'s
        hooks; everything it changed put back."""

    @abc.abstractmethod
    def _probe_input(self, layer: Any, args: tuple, kwargs: dict, hooks: Sequence[Any]) -> ProbeSource:
        """``layer`` and a host copy of the input it receives now (made in its forward pre-hook;
        ``hooks``: the handles of the profile's own hooks on it, which a copy must not carry)."""

    @abc.abstractmethod
    def _copy_bytes_per_s(self, device: Any) -> float:
        """Bytes per second of one direction of a host <-> device copy."""

    @abc.abstractmethod
    def _copies_overlap(self, device: Any) -> bool:
        """Whether copies run beside compute on ``device`` (on a copy stream)."""

    # ------------------------------------------------------------------ primitives: probes
    @abc.abstractmethod
    def _restored_after(self, source: ProbeSource, copies: Sequence[Any], watch: bool) -> ContextManager[Any]:
        """A probe run leaves the program as it found it: the generators and ``source.outside``
        are put back after the block. ``watch``: also find the tensors outside ``copies`` that the
        block writes in place and add them to ``source.outside`` (untimed runs only)."""

    @abc.abstractmethod
    def _chain_meter(self, source: ProbeSource, copies: Sequence[Any]) -> ContextManager[Tuple[Meter, Any]]:
        """A memory run of a chain of ``copies``: restored and watched as ``_restored_after(source, copies,
        True)``; yields the meter to cut into segments and the inputs to run on."""

    #: The exceptions the framework raises when the device runs out of memory.
    out_of_memory: Tuple[type, ...] = ()

    @abc.abstractmethod
    def _moving_saved(self, meter: Any = None, log: Optional[LayerLog] = None,
                      device: Any = None) -> ContextManager[Any]:
        """While planning a step that did not fit as it is (the framework's ``in_training`` found
        it): the block moves what autograd saves to the host and back, so that the device holds
        little; ``meter`` still counts what the block would hold with nothing moved, ``log`` gets
        the saved storages, ``device`` times the copies (``seconds``, per layer ``forward_s`` /
        ``backward_s``, the running layer set through ``layer``). Yields that mover, or ``None``
        (nothing is moved: the step fitted, or the framework cannot move)."""

    @abc.abstractmethod
    def _move_saved_from_now(self) -> bool:
        """Plan on as for a step that does not fit as it is: :meth:`_moving_saved` moves from now
        on. ``False`` where it moves already, or the framework cannot move."""

    @abc.abstractmethod
    def _op_timer(self, times: OpTimes) -> ContextManager[Any]:
        """A dispatch mode passing every op call through ``times.call``."""

    # ------------------------------------------------------------------ primitives: checking a plan
    @abc.abstractmethod
    def _copyable(self, layers: Sequence[Any]) -> bool:
        """Whether :meth:`_shared_copy` can copy every layer (sharded layers belong to their owner)."""

    @abc.abstractmethod
    def _shared_copy(self, layer: Any) -> Any:
        """A copy of ``layer`` that shares its parameters and buffers (a new module around them)."""

    @abc.abstractmethod
    def _substituted(self, stack: Any, copies: Sequence[Any]) -> ContextManager[Any]:
        """``stack`` (the container the model calls its layers from) holds ``copies`` in the
        block, its own layers again after it."""

    @abc.abstractmethod
    def measure_step(self, device: Any, step_fn: Callable[[], Any]) -> int:
        """The peak bytes of one ``step_fn()`` as a budget counts them, what it changed put back."""

    # ------------------------------------------------------------------ wrapping
    def wrap(self, layer: Any, option: LayerOption, seen: Sequence[OpKey]) -> Any:
        """Wrap ``layer`` in place for ``option`` through the public API; the generated policy."""
        policy = option_policy(option, seen, self.key_of, self.nbytes)
        if option.kind == "swap":
            swap_wrapper(layer, policy_fn=policy)
        elif option.kind == "recompute":
            checkpoint_wrapper(layer, policy_fn=policy, swap_inputs=option.swap_inputs)
        return policy

    # ------------------------------------------------------------------ checking a plan
    def measure_plan(self, stack: Any, layers: Sequence[Any], options: Sequence[LayerOption],
                     seen: Sequence[Sequence[OpKey]], step_fn: Callable[[], Any]) -> Optional[int]:
        """The peak bytes of one ``step_fn()`` with ``layers[i]`` wrapped by ``options[i]``, as the
        budget counts them, measured: the stack's entries are, for the call, copies of its layers
        sharing their parameters and buffers, wrapped and chained as the plan wraps them (the
        layers themselves stay as they are; what the step changes is put back as profiling puts
        it back). ``None`` when the plan cannot be run so: no container of the layers to put the
        copies in (``stack`` is ``None``), or the step did not call them through it."""
        if stack is None or not options or not self._copyable(layers):
            return None
        copies = [self._shared_copy(layer) for layer in layers]
        ran = set()
        try:
            for copy_, option, keys in zip(copies, options, seen):
                self.wrap(copy_, option, keys)
            if any(o.swaps for o in options):
                for first, second in zip(copies, copies[1:]):
                    SwapManager().set_forward_prefetch_layer(first, second)
            marks = self._layer_marks(copies, _Ran(ran))
            try:
                with self._substituted(stack, copies):
                    peak = self.measure_step(self._device_of(layers), step_fn)
            finally:
                for h in marks:
                    h.remove()
        finally:
            self._forget(copies)
        return peak if len(ran) == len(layers) else None

    # ------------------------------------------------------------------ segments
    def _layer_marks(self, layers: Sequence[Any], target: Any, on_pre: Optional[PreHook] = None,
                     on_post: Optional[PostHook] = None) -> List[Any]:
        return layer_marks(layers, target, self._in_backward, self._grad_outputs, on_pre, on_post)

    def _segmented(self, layers: Sequence[Any], meter: Meter, run: Callable[[], Any],
                   on_pre: Optional[PreHook] = None, on_post: Optional[PostHook] = None) -> Segments:
        """``run()`` cut into segments of ``meter``'s timeline at ``layers``' boundaries."""
        segments = Segments(meter)
        handles = self._layer_marks(layers, segments, on_pre, on_post)
        try:
            segments.mark("pre", -1)
            run()
            segments.close()
        finally:
            for h in handles:
                h.remove()
        return segments

    def _layer_log(self) -> LayerLog:
        """A fresh :class:`LayerLog` for call 1 (its hooks go to :meth:`_segmented`)."""
        return LayerLog(self.tensor_type, self._storage_bytes)

    # ------------------------------------------------------------------ profiling the step
    def profile_step(self, layers: Sequence[Any], step_fn: Callable[[], Any]) -> StepProfile:
        """The step's profile (``Prober.profile_step``; see the module docstring)."""
        device = self._device_of(layers)
        n = len(layers)
        # Call 1: the memory timeline, every layer's ops and saved storages.
        trace = self._instrumented(layers, step_fn, device)
        micro_steps, first_backward = check_layer_events(trace.segments, n, self.step_hint)
        log = trace.log
        changed = {j: io for j, io in log.reshapes.items() if j >= first_backward}
        if changed:
            j, (given, made) = sorted(changed.items())[0]
            raise ValueError(
                f"plan_memory: layer {j} ({type(layers[j]).__name__}) turns its input {given} into {made} (shape, "
                "dtype): the planner measures a layer's options on a chain of copies of it, each fed the one "
                "before's output, so every layer whose backward runs must give back an activation like the one it "
                "got. Plan the part of the stack whose layers keep the activation's shape (pass that stack, and "
                "leave the layers that change it unwrapped).")
        records = []
        for j in range(n):
            sizes = sorted(log.saved.get(j, {}).values(), reverse=True)
            shapes = log.arg_shapes.get(j) or ((),)
            records.append(LayerRecord(j, "", log.ops.get(j, []), sizes, log.inputs.get(j, 0),
                                       input_held=j in log.held, backward=j >= first_backward,
                                       input_shape=tuple(shapes[0][0])))
        types = self._layer_types(layers, records, log.arg_shapes)
        # Call 2: the plain step's time and each layer's; an input of every layer kept for probes.
        step_s = self._timed_call(layers, step_fn, device, records, types, trace.state)
        notes = list(trace.notes)
        with self._moving_saved() as mover:
            if mover is not None:
                notes.append("the step ran out of device memory as it is: it was profiled with what autograd saves "
                             "moved to the host as it is saved (counted as if it stayed on the device; the copies' "
                             "time taken out of the layers' and the step's)")
        if not all(log.flows[1:]):
            notes.append("a layer's input is not the previous layer's output: the probes chain the layers anyway")
        return StepProfile(
            device=str(device), segments=trace.segments, layers=records, types=types,
            baseline_bytes=trace.baseline_bytes, peak_bytes=trace.peak_bytes, step_s=step_s,
            param_bytes=trace.param_bytes, grad_bytes=trace.grad_bytes,
            copy_bytes_per_s=self._copy_bytes_per_s(device), overlaps=self._copies_overlap(device), notes=notes,
            micro_steps=micro_steps)

    def _timed_call(self, layers: Sequence[Any], step_fn: Callable[[], Any], device: Any,
                    records: List[LayerRecord], types: Dict[str, LayerType], state: Any) -> float:
        """Call 2 of profiling: the plain step's seconds. Sets each record's forward and backward
        seconds, and the probe input of each type (its first layer's, copied when it runs: a cache
        the step fills up later must not be in it); the copies' time is not the step's."""
        first = {t.layers[0]: t for t in types.values()}
        now = self._clock(device)
        started: Dict[int, float] = {}
        copying = [0.0]

        def timed_pre(j: int, args: tuple, kwargs: dict) -> None:
            if moved is not None:
                moved.layer = j
            self.synchronize(device)
            if j in first and first[j].probe_inputs is None:  # (the first micro-batch's)
                t = now()
                first[j].probe_inputs = self._probe_input(layers[j], args, kwargs, handles)
                self.synchronize(device)
                copying[0] += now() - t
            started[j] = now()

        def timed_post(j: int, out: Any) -> None:
            self.synchronize(device)
            records[j].forward_s = now() - started[j]
            if moved is not None:
                moved.layer = None

        moved = None  # (the mover, while planning a step that does not fit as it is)
        second = state.fresh_snapshot()
        second.save_rng()
        timer = BackwardTimer(now, lambda: self.synchronize(device))
        handles = self._layer_marks(layers, timer, timed_pre, timed_post)
        try:
            with self._timing_mode(), no_gc(), self._moving_saved(device=device) as moved:
                self.synchronize(device)
                t0 = now()
                step_fn()
                self.synchronize(device)
                step_s = now() - t0 - copying[0]
        finally:
            for h in handles:
                h.remove()
            second.restore()
        for j, seconds in timer.backward_times().items():
            records[j].backward_s = seconds
        if moved is not None:  # (the copies are not the step's: each layer's time without them)
            for j, seconds in moved.forward_s.items():
                records[j].forward_s = max(0.0, records[j].forward_s - seconds)
            for j, seconds in moved.backward_s.items():
                records[j].backward_s = max(0.0, records[j].backward_s - seconds)
            step_s = max(0.0, step_s - moved.seconds)
        return step_s

    def _layer_types(self, layers: Sequence[Any], records: List[LayerRecord],
                     arg_shapes: Dict[int, tuple]) -> Dict[str, LayerType]:
        """Group the layers whose profiles agree (class, parameter shapes, input shapes, ops,
        saved storages) into :class:`LayerType` s (without their probe inputs yet)."""
        types: Dict[str, LayerType] = {}
        signatures: Dict[Any, str] = {}
        for j, (layer, record) in enumerate(zip(layers, records)):
            signature = (type(layer).__qualname__,
                         tuple((n, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
                               for n, p in self._named_parameters(layer)),
                         arg_shapes.get(j), tuple((r.key, r.new_bytes, r.saved) for r in record.ops),
                         tuple(record.saved_sizes), record.backward)
            key = signatures.get(signature)
            if key is None:
                key = signatures[signature] = f"{type(layer).__name__}#{len(signatures)}"
                types[key] = LayerType(key, [], record)
            types[key].layers.append(j)
            record.type_key = key
        return types

    # ------------------------------------------------------------------ probing one layer type
    def probe(self, ltype: LayerType, option: LayerOption, seen: Sequence[OpKey],
              reference: Optional[Dict[str, Any]] = None) -> Tuple[Effect, Dict[str, Any]]:
        """Measure ``option`` on copies of ``ltype``'s layer (see the module docstring). Returns
        its :class:`Effect` and the reference runs (every copy left as it is), which the caller
        passes back for the type's other options."""
        try:
            return self._probe(ltype, option, seen, reference)
        except self.out_of_memory:
            if not self._move_saved_from_now():
                raise
        # (past the except clause: its traceback is gone) The step fitted, a chain of copies beside
        # it does not: probe as for a step that does not fit, against references run the same way.
        free_after_out_of_memory()
        return self._probe(ltype, option, seen, None)

    def _probe(self, ltype: LayerType, option: LayerOption, seen: Sequence[OpKey],
               reference: Optional[Dict[str, Any]]) -> Tuple[Effect, Dict[str, Any]]:
        source: ProbeSource = ltype.probe_inputs
        with self._moving_saved() as mover:
            moving = mover is not None
        if reference is None or reference["moving"] != moving:  # (an option's runs and their references alike)
            reference = {"middle": self._chain_memory(source, [None] * 4, seen),
                         "last": self._chain_memory(source, [None] * 2, seen), "moving": moving}
        middle = self._chain_memory(source, [None, option, None, None], seen)  # a layer amid the stack
        last = self._chain_memory(source, [None, option], seen)  # the last layer
        effect = _chain_effect(_differences(middle, reference["middle"]), _differences(last, reference["last"]))
        # Every option adds work to the layer (recompute, copies, bookkeeping): a run measured faster
        # than the plain layer is timing noise, and counts as free. The noise: half the spread of
        # the differences of the runs timed in turns.
        for length in (3, 2, 1):  # (a chain the device cannot hold, planning a step that does not fit: a shorter one)
            try:
                plain, wrapped = self._chain_times(source, option, seen, length)
                break
            except self.out_of_memory:
                if length == 1:
                    raise
            free_after_out_of_memory()  # (past the except clause: its traceback is gone)
        reference.setdefault("time", min(plain) * 3 / length)  # (three layers' time)
        seconds = max(0.0, (min(wrapped) - min(plain)) / length)
        differences = [w - p for p, w in zip(plain, wrapped)]
        noise = (max(differences) - min(differences)) / 2 / length
        return Effect(effect, seconds, measured=True, noise=noise), reference

    def _copies(self, source: ProbeSource, options: Sequence[Optional[LayerOption]],
                seen: Sequence[OpKey]) -> List[Any]:
        """Deep copies of ``source``'s layer, one per option (``None``: left as it is), wrapped and
        chained through the layer chain; planning a step that does not fit as it is
        (:meth:`_moving_saved`), copies sharing its parameters and buffers where it can: a probe
        then holds one layer's parameters and gradients, not one per copy (what it measures are
        differences between chains of copies alike)."""
        with self._moving_saved() as moving:
            share = moving is not None and self._copyable([source.layer])
        copies = [self._shared_copy(source.layer) if share else copy.deepcopy(source.layer) for _ in options]
        for i, option in enumerate(options):
            if option is not None:
                self.wrap(copies[i], option, seen)
        for i in range(len(copies) - 1):
            SwapManager().set_forward_prefetch_layer(copies[i], copies[i + 1])
        return copies

    @staticmethod
    def _forget(copies: List[Any]) -> None:
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
                    with contextlib.suppress(ValueError):  # (alive still: an error on its way out holds it)
                        manager.discard_group(name)

    def _chain_memory(self, source: ProbeSource, options: Sequence[Optional[LayerOption]],
                      seen: Sequence[OpKey]) -> Dict[str, Tuple[int, int, int]]:
        """``(start, peak, end)`` bytes of each segment (by name) of one forward + backward of a
        chain of copies."""
        copies = self._copies(source, options, seen)
        self._clear_grads(copies)  # (shared parameters: no gradient left from an earlier run)
        try:
            with self._chain_meter(source, copies) as (meter, inputs):
                # (no warm-up run: host buffers are never device memory, and the step ran already,
                # so one-off device allocations such as a BLAS workspace are made)
                with self._moving_saved(meter=meter):
                    cut = self._segmented(copies, meter, lambda: source.run(copies, inputs))
        finally:
            self._clear_grads(copies)
            self._forget(copies)
        ends = [s.start for s in cut.segments[1:]] + [cut.end_bytes]
        return {s.name: (s.start, s.peak, end) for s, end in zip(cut.segments, ends)}

    def _chain_times(self, source: ProbeSource, option: LayerOption, seen: Sequence[OpKey], length: int = 3
                     ) -> Tuple[List[float], List[float]]:
        """Seconds of one forward + backward of ``length`` copies left as they are and of as many
        all wrapped by ``option``, timed in turns (each after one untimed run, on fresh inputs), so
        that what slows the machine down meanwhile slows both: ``PROBE_REPEATS`` of each."""
        plain = self._copies(source, [None] * length, seen)
        wrapped = self._copies(source, [option] * length, seen)
        now = self._clock(source.device)
        times: Tuple[List[float], List[float]] = ([], [])
        try:
            with self._restored_after(source, [*plain, *wrapped], watch=False), self._timing_mode():
                with self._moving_saved():
                    source.run(plain)
                    source.run(wrapped)
                for r in range(PROBE_REPEATS):
                    for k in ((0, 1) if r % 2 == 0 else (1, 0)):  # (alternating which goes first)
                        copies = (plain, wrapped)[k]
                        self._clear_grads(copies)
                        inputs = source.inputs(len(copies))
                        self.synchronize(source.device)
                        with no_gc(), self._moving_saved(device=source.device) as moved:
                            t0 = now()
                            source.run(copies, inputs)
                            self.synchronize(source.device)
                            times[k].append(now() - t0 - (moved.seconds if moved is not None else 0.0))
        finally:
            self._clear_grads([*plain, *wrapped])  # (shared parameters: no gradient left behind)
            self._forget(plain)
            self._forget(wrapped)
        return times

    def op_seconds(self, ltype: LayerType) -> Dict[OpKey, float]:
        """Forward seconds of each op kind of ``ltype``'s layer (the sum over its calls; the
        fastest of several runs of a copy), what recomputing it costs."""
        source: ProbeSource = ltype.probe_inputs
        layer = copy.deepcopy(source.layer)
        times = OpTimes(self._clock(source.device), lambda: self.synchronize(source.device))
        with self._no_grad():
            with self._restored_after(source, [layer], watch=True):  # (an untimed run finds what it writes outside)
                source.forward(layer)
            for _ in range(PROBE_REPEATS):
                times.start_run()
                with self._restored_after(source, [layer], watch=False), no_gc(), self._op_timer(times):
                    source.forward(layer)
        return times.best()


def _differences(run: Dict[str, Tuple[int, int, int]], reference: Dict[str, Tuple[int, int, int]]
                 ) -> Dict[str, Tuple[int, int, int]]:
    """Per segment, what a wrapped copy changed at its start, its peak and its end."""
    return {name: tuple(a - b for a, b in zip(values, reference[name])) for name, values in run.items()}


def _chain_effect(middle: Dict[str, Tuple[int, int, int]], last: Dict[str, Tuple[int, int, int]]) -> Dict[str, int]:
    """An option's bytes per relation (``profile.RELATIONS``) from the differences it made to the
    segments of the middle chain (on the second of four copies) and of the last chain (on the last
    of two), with :data:`SLACK_BYTES` on every relation but ``after_bwd``. A segment where the wrapped
    copy runs (its own forward or backward) counts the difference at its peak, where its own work
    is; in any other the copy only holds what it keeps, and what it keeps can change within the
    segment (the step's objects die at the end of the forward, a load lands): the largest
    difference at its start, peak or end counts, so that wherever the model's own segment peaks
    the effect is no larger."""
    held = {k: max(v) for k, v in middle.items()}
    old = max(held["gap 2"], held["fwd 3"], held["gap 3"], held["bwd 3"])
    effect = {
        "own_fwd": middle["fwd 1"][1], "own_gap": held["gap 1"], "next_fwd": held["fwd 2"], "later": old,
        "next_bwd": held["bwd 2"], "own_bwd": middle["bwd 1"][1],
        "after_bwd": max(held["bwd 0"], max(last["bwd 0"])),
        # (the loss head's segment runs on into the backward: the state its own backward starts in)
        "last_fwd": last["fwd 1"][1], "last_head": max(max(last["gap 1"]), last["bwd 1"][0]),
        "last_bwd": last["bwd 1"][1],
    }
    effect["input_kept"] = max(effect["next_fwd"], old)
    assert set(effect) == set(RELATIONS)
    for relation in RELATIONS:  # what a wrapped layer keeps that a difference of peaks can miss
        if relation != "after_bwd":
            effect[relation] += SLACK_BYTES
    return effect
