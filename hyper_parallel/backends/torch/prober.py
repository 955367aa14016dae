"""The planner's PyTorch part: the primitives :class:`~hyper_parallel.planner.chain_prober.ChainProber`
profiles a training step and probes a layer's options with (the algorithm is there, once for
every framework).

- Memory: a :class:`~hyper_parallel.tools.memory.MemoryMeter` (the allocator on an accelerator,
  live storages on a CPU).
- The op trace of call 1: a ``TorchDispatchMode`` (:class:`_Recorder`) records every op of each
  layer's forward, and saved-tensor hooks (which save what autograd would, through an alias)
  record what autograd keeps.
- What a step changes is put back around both calls of it: the gradients of the parameters it
  reaches (``.grad`` objects and values), every tensor that existed before the step and was
  written in place by it (BatchNorm statistics, accumulated gradients; found by the dispatch mode
  of call 1 and copied to the host before the first write), and the random number generators.
- Probes run deep copies of a layer on a host copy of the input it received in the step
  (:class:`_ProbeInput`; each copy with its own copy of the objects a layer writes, a
  Hugging Face KV cache), forward and ``backward``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hyper_parallel.core.backend import Backend
from hyper_parallel.integrations import find_layer_stack
from hyper_parallel.planner.options import OpKey
from hyper_parallel.planner.chain_prober import (OUT_OF_MEMORY, ChainProber, LayerLog, OpTimes, StepTrace, fastest_seconds,
                                                 free_after_out_of_memory, layer_output, tensors_in)
from hyper_parallel.planner.step_state import StepState
from hyper_parallel.tools.clock import no_gc, step_clock
from hyper_parallel.tools.gc_pause import live_objects
from hyper_parallel.tools.memory import MemoryMeter, host_allocation, is_host_storage, local_tensors, mark_host

from ._shim import in_backward, is_sharded, storage_key, unsharded_copy, untyped_storage_key
from .collectives import TorchCollectives
from .pipeline_schedule import TorchPipeline

__all__ = ["TorchProber", "EXPENSIVE_OPS"]

_aten = torch.ops.aten
#: Ops whose outputs the fixed recipes save or swap (matmuls and attention kernels): costly to
#: recompute for the bytes they produce.
EXPENSIVE_OPS = frozenset(str(op) for op in (
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten.convolution.default,
))


class _StepState(StepState):
    """What a step changes, put back afterwards (see the module docstring): beside the tensors it
    writes and the generators, the ``.grad`` of every leaf it reaches (``leaves``)."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend)
        self.leaves: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}  # id -> (leaf, its .grad)

    def see_leaf(self, t: torch.Tensor) -> None:
        if id(t) not in self.leaves:
            self.leaves[id(t)] = (t, t.grad)
            grad = t.grad
            if grad is not None:
                self.keep(grad)

    def fresh_snapshot(self) -> "_StepState":
        other = cast(_StepState, super().fresh_snapshot())
        for leaf, _ in self.leaves.values():
            other.see_leaf(leaf)
        return other

    def restore(self) -> None:
        super().restore()
        self.restore_gradients()

    def restore_gradients(self) -> None:
        """Put back the ``.grad`` of every leaf seen, and their values (accumulated into in place)."""
        grads = {storage_key(g) for _, g in self.leaves.values() if g is not None and _backed(g)}
        self._write_back(v for k, v in self.written.items() if k in grads)
        for leaf, grad in self.leaves.values():
            leaf.grad = grad

    def _storage_of(self, t: torch.Tensor) -> Optional[int]:
        # (a tensor whose storage its owner freed, FSDP2's all-gather buffers resized to zero
        # bytes between uses, holds nothing to put back)
        return storage_key(t) if _backed(t) else None

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        return _on_host(t)

    def _write_back(self, written: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for t, host in written:
                if _backed(t):  # (freed by its owner meanwhile, FSDP2's resharding: its content is the owner's)
                    t.copy_(host)


class _Recorder(TorchDispatchMode):
    """A dispatch mode watching a step or a probe run: the tensors that existed before it and that
    it overwrites (into ``state``), the storages created in it, the parameters it reaches and,
    given a ``log`` (call 1 of profiling), the op calls of the layer whose forward runs."""

    def __init__(self, state: _StepState, key_of: Callable[[Any, tuple], OpKey], written: Callable[..., list],
                 log: Optional[LayerLog] = None) -> None:
        super().__init__()
        self.state = state
        self.key_of = key_of
        self.written = written
        self.log = log
        # storages made in the step: a storage's key can be reused once it died, so it is
        # forgotten then (here and in the log)
        self.created: Dict[int, Any] = {}
        self.reached: Dict[int, int] = {}  # storages the step used that existed before it -> bytes
        self.grad_leaves: Dict[int, int] = {}  # leaves the forward reached requiring grad -> bytes

    def _made(self, key: int, storage: Any) -> None:
        def forget(_: Any, key: int = key) -> None:
            self.created.pop(key, None)
            if self.log is not None:
                self.log.forget(key)

        self.created[key] = weakref.ref(storage, forget)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        inputs = set()
        # (below autograd, a backward kernel's saved tensors look like leaves requiring grad:
        # only the forward's leaves are the parameters and inputs whose .grad the step writes)
        forward = not in_backward()
        for arg in tree_leaves((args, kwargs)):
            if not (isinstance(arg, torch.Tensor) and arg.layout is torch.strided and not arg.is_meta):
                continue
            for t in local_tensors(arg):  # (a DTensor reaches its local shard)
                key = storage_key(t)
                inputs.add(key)
                if key not in self.created and key not in self.reached and not is_host_storage(t):
                    self.reached[key] = t.untyped_storage().nbytes()
            if forward and arg.requires_grad and arg.is_leaf:
                self.state.see_leaf(arg)
                for t in local_tensors(arg):
                    self.grad_leaves[storage_key(t)] = t.untyped_storage().nbytes()
        written = self.written(func, args, kwargs)  # (declared or not: BatchNorm's statistics)
        mutating = bool(written)
        for t in written:
            if t.layout is torch.strided and storage_key(t) not in self.created:
                self.state.keep(t)
        out = func(*args, **kwargs)
        new_bytes, made = 0, []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta:
                key = storage_key(t)
                if key not in inputs and key not in made:
                    storage = t.untyped_storage()
                    self._made(key, storage)
                    new_bytes += storage.nbytes()
                    made.append(key)
        if self.log is not None and self.log.layer is not None and forward and not _OFFLOADING[0]:
            self.log.op(self.key_of(func, args), new_bytes, mutating, str(func) in EXPENSIVE_OPS, made)
        return out


_OFFLOADING = [0]  # (> 0 while an _Offload hook copies: the op recorder does not log its ops as the layer's)


class _Held:
    """The host copy of one saved storage, shared by every tensor autograd saved of it; autograd
    holds it (through what ``_Offload.pack`` returns) as long as it would hold the storage."""

    def __init__(self, host: torch.Tensor, device: torch.device, layer: Optional[int]) -> None:
        self.host = host
        self.device = device
        self.layer = layer
        self.back: Optional[weakref.ref] = None  # the device copy while backward uses it


class _Offload:
    """Planning a step that does not fit as it is: every storage autograd saves outside a wrapped
    layer is copied to a host buffer as it is saved, and back when backward unpacks it, so that the
    device holds what the layers pass on and one backward node's saved tensors. Parameters stay.
    With a ``meter``, that meter still counts what the step would hold with nothing moved: a moved
    storage stays counted after it dies for as long as autograd holds its host copy (the moment the
    device would free it), and the copies made for backward are not counted again. ``layer`` (set
    by the caller) names the layer whose forward runs; the copies' seconds add up per layer in
    ``forward_s`` / ``backward_s`` (by the layer that saved them) and in ``seconds``."""

    def __init__(self, keep: set, meter: Optional[MemoryMeter] = None, clock: Optional[Callable[[], float]] = None,
                 synchronize: Optional[Callable[[], None]] = None, log: Optional[LayerLog] = None) -> None:
        self.keep = keep
        self.meter = meter
        self.log = log
        self.layer: Optional[int] = None
        self.now = clock
        self.sync = synchronize or (lambda: None)
        self.seconds = 0.0
        self.forward_s: Dict[int, float] = {}
        self.backward_s: Dict[int, float] = {}
        self._held: Dict[int, weakref.ref] = {}  # storage key -> its _Held, while the storage lives

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _timed(self, into: Dict[int, float], layer: Optional[int], copy: Callable[[], Any]) -> Any:
        if self.now is None:
            return copy()
        self.sync()
        t0 = self.now()
        out = copy()
        self.sync()
        dt = self.now() - t0
        self.seconds += dt
        if layer is not None:
            into[layer] = into.get(layer, 0.0) + dt
        return out

    def pack(self, t: torch.Tensor) -> Any:
        layer = self.log.layer if self.log is not None else self.layer
        logged = self.log is not None and layer is not None and t.layout is torch.strided and not t.is_meta
        if t.layout is not torch.strided or t.is_meta or is_host_storage(t) or storage_key(t) in self.keep:
            if logged:
                self.log.save(storage_key(t), t.untyped_storage().nbytes())
            return t.detach()
        key = storage_key(t)
        found = self._held.get(key)
        held = found() if found is not None else None
        if held is None:
            storage = t.untyped_storage()
            held = self._timed(self.forward_s, layer, lambda: self._to_host(storage, t.device, layer))
            self._held[key] = weakref.ref(held)
            weakref.finalize(storage, self._held.pop, key, None)
            if self.meter is not None:
                self.meter.count_until(storage, held)
        if logged:
            self.log.save(key, t.untyped_storage().nbytes(), name=("moved", id(held)))
            t.detach()  # (the op the plain profile's hook runs, and logs with the layer's: the same ops either way)
        return held, t.dtype, t.size(), t.stride(), t.storage_offset()

    def _to_host(self, storage: torch.UntypedStorage, device: torch.device, layer: Optional[int]) -> _Held:
        _OFFLOADING[0] += 1
        try:
            host = _on_host(torch.empty(0, dtype=torch.uint8, device=device).set_(storage))
        finally:
            _OFFLOADING[0] -= 1
        return _Held(host, device, layer)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        held, dtype, size, stride, offset = packed
        back = held.back() if held.back is not None else None
        if back is None:
            back = self._timed(self.backward_s, held.layer, lambda: self._to_device(held))
            held.back = weakref.ref(back)
        return torch.empty(0, dtype=dtype, device=held.device).set_(back, offset, size, stride)

    def _to_device(self, held: _Held) -> torch.UntypedStorage:
        _OFFLOADING[0] += 1
        try:
            flat = held.host.to(held.device, copy=True)
        finally:
            _OFFLOADING[0] -= 1
        storage = flat.untyped_storage()
        if self.meter is not None:  # (counted already: the moved storage's bytes, until autograd lets go)
            self.meter.uncount(storage)
        return storage


class TorchProber(ChainProber):
    """Profiling and probing on PyTorch; the planner's framework part. The algorithm is
    :class:`~hyper_parallel.planner.chain_prober.ChainProber`'s; this class gives it PyTorch's
    primitives (see the module docstring)."""

    name = "torch"
    tensor_type = torch.Tensor
    out_of_memory = (torch.OutOfMemoryError,)

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._labels: Dict[Any, str] = {}
        self._session: Optional[Tuple[List[torch.nn.Parameter], List[Any]]] = None  # (see _watched_state)
        self._moving = False  # (planning a step that ran out of memory as it is: see in_training)

    # ------------------------------------------------------------------ names and sizes
    def key_of(self, op: Any, args: Tuple[Any, ...]) -> OpKey:
        """An op call's :class:`OpKey` (what generated policies look up)."""
        label = self._labels.get(op)
        if label is None:
            label = self._labels[op] = str(op)
        return OpKey(label, tuple(tuple(t.shape) for t in tensors_in(args, torch.Tensor)))

    @staticmethod
    def nbytes(t: Any) -> int:
        """Bytes of the storage a saved tensor views (what a swap moves)."""
        return t.untyped_storage().nbytes()

    def _storage_bytes(self, t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes()

    def _named_parameters(self, layer: torch.nn.Module) -> Iterable[Tuple[str, Any]]:
        return layer.named_parameters()

    # ------------------------------------------------------------------ the model
    @staticmethod
    def is_layer(x: Any) -> bool:
        return isinstance(x, torch.nn.Module)

    @staticmethod
    def is_stack(x: Any) -> bool:
        """Whether ``x`` is a layer stack itself rather than a model holding one."""
        return isinstance(x, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict, list, tuple))

    @staticmethod
    def find_layers(model: torch.nn.Module) -> Tuple[str, List[torch.nn.Module]]:
        """The layer stack of ``model`` (``find_layer_stack``: the longest ``ModuleList`` /
        ``ModuleDict`` of same-class blocks): its attribute path and layers."""
        stack = find_layer_stack(model)
        layers = list(stack.layers.values()) if isinstance(stack.layers, torch.nn.ModuleDict) else list(stack.layers)
        return stack.path, layers

    # ------------------------------------------------------------------ parallel training
    @staticmethod
    def pipeline(schedule: Any) -> TorchPipeline:
        """What ``plan_pipeline`` reads of a ``torch.distributed.pipelining`` schedule and runs of it."""
        return TorchPipeline(schedule)

    def measure_step(self, device: Any, step_fn: Callable[[], Any]) -> int:
        """The peak bytes of one ``step_fn()`` as a budget counts them (the allocator's peak on an
        accelerator; on a CPU the live storages less those the step never touched, as profiling
        counts them), with what the step changed put back as profiling puts it back: gradients,
        tensors written in place, the generators. ``plan_pipeline`` measures a schedule's step."""
        device = torch.device(device)
        state = self._watched_state()
        recorder = _Recorder(state, self.key_of, self._backend.written_tensors)
        ran_out = False
        try:
            with MemoryMeter(device) as meter:
                with recorder:  # (the collector running, as in call 1 of a profile: see there)
                    step_fn()
        except torch.OutOfMemoryError:  # (over what the device has: over any budget it can hold)
            ran_out = True
        finally:
            state.restore()
        if ran_out:
            free_after_out_of_memory()
            return OUT_OF_MEMORY
        return meter.peak_bytes - (_unrelated_bytes(recorder) if device.type == "cpu" else 0)

    @contextlib.contextmanager
    def in_training(self, step_fn: Callable[[], Any]) -> Iterator[None]:
        """The block runs with one ``step_fn()`` done first, as in the middle of training: what a
        step creates for good (an optimizer's state, made by its first step; a scaler's scale)
        exists, so that what planning profiles is the step training repeats; the gradients are put
        back as they were (the step is profiled from them, as the loop runs it). Everything that
        call changed (parameters stepped, optimizer and scheduler state, generators) is put back
        after the block."""
        state = self._watched_state(collect=2)
        try:
            ran_out = False
            try:
                with _Recorder(state, self.key_of, self._backend.written_tensors):
                    step_fn()
            except torch.OutOfMemoryError:
                ran_out = True
            if ran_out:  # (outside the except clause: the failed step's tensors are gone with its traceback)
                # Plan it with what autograd saves moved to the host while planning (``_moving_saved``):
                # the device then holds about what the layers pass on, and the profile still counts
                # every byte the step would hold as it is.
                state.restore()
                free_after_out_of_memory()
                state = self._watched_state(collect=2)
                self._move_saved_from_now()
                try:
                    with _Recorder(state, self.key_of, self._backend.written_tensors), self._moving_saved():
                        step_fn()
                except torch.OutOfMemoryError as exc:
                    raise torch.OutOfMemoryError(
                        "plan_memory: the step ran out of device memory as it is, and again with every activation "
                        "autograd saves moved to the host while planning: what the step holds besides them "
                        "(parameters, gradients, optimizer state, the layers' inputs and outputs, the loss head) "
                        "does not fit. Plan where it fits (a device with more memory), or, for a Hugging Face "
                        "model, plan for this accelerator without running on it: python -m hyper_parallel.plan. "
                        f"Everything the step changed is put back. ({exc})") from exc
            state.restore_gradients()
            # (found after a step: what the first step makes lazily, FSDP2's unsharded parameters, is there)
            self._session = _live_training_objects()
            yield
        finally:
            self._session = None
            self._moving = False
            state.restore()

    def _move_saved_from_now(self) -> bool:
        moving, self._moving = self._moving, True
        return not moving

    @contextlib.contextmanager
    def _moving_saved(self, meter: Optional[MemoryMeter] = None, log: Optional[LayerLog] = None,
                      device: Optional[torch.device] = None) -> Iterator[Optional[_Offload]]:
        if not self._moving:
            yield None
            return
        parameters = self._session[0] if self._session is not None else _live_training_objects()[0]
        keep = {storage_key(t) for p in parameters for t in local_tensors(p)}
        mover = _Offload(keep, meter, self._clock(device) if device is not None else None,
                         (lambda: self.synchronize(device)) if device is not None else None, log)
        with mover.hooks():
            yield mover

    @staticmethod
    def collectives(group: Any) -> Optional[TorchCollectives]:
        """The collectives ``plan_memory(..., group=group)`` agrees through, or ``None`` to plan on
        this process alone (``group=False``; ``None`` when ``torch.distributed`` is not initialized or
        has one rank; a group of one rank)."""
        if group is False:
            return None
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"plan_memory(group=...): expected a torch.distributed ProcessGroup, None (the default group "
                            f"when torch.distributed is initialized) or False (this process alone), got {group!r}")
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError("plan_memory(group=...): torch.distributed is not initialized "
                                 "(call torch.distributed.init_process_group first, or leave group out)")
            return None
        collectives = TorchCollectives(group)
        return collectives if collectives.size > 1 else None

    def _watched_state(self, collect: int = 1) -> _StepState:
        """A fresh state for a step: the generators saved, every live parameter's ``.grad`` seen
        (FSDP2 sets its sharded parameters' ``.grad`` itself: no op of the step names them), and
        every optimizer, learning-rate scheduler and gradient scaler kept as it is (a step may
        step them: their lazily created state and counters go back afterwards)."""
        state = _StepState(self._backend)
        state.save_rng()
        # (garbage in reference cycles would count as live memory, and its parameters as the step's;
        # the old generation is collected once, when planning starts: what planning leaves is young)
        gc.collect(collect)
        # (while planning, the parameters and optimizers alive are those it started with)
        parameters, stateful = self._session or _live_training_objects()
        for p in parameters:
            state.see_leaf(p)
        for obj in stateful:
            state.keep_object(obj)
        return state

    # ------------------------------------------------------------------ devices and time
    @staticmethod
    def _device_of(layers: Sequence[torch.nn.Module]) -> torch.device:
        for layer in layers:
            for p in layer.parameters():
                return p.device
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: torch.device) -> None:
        if device.type != "cpu":
            torch.get_device_module(device.type).synchronize(device)

    def _clock(self, device: torch.device) -> Callable[[], float]:
        return step_clock(device)  # (steps, probes and ops are timed as the benchmarks time them)

    def _timing_mode(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # (what a timed run changes, _restored_after puts back)

    def _no_grad(self) -> contextlib.AbstractContextManager:
        return torch.no_grad()

    @staticmethod
    def copy_bandwidth(device: torch.device, nbytes: int = 32 << 20) -> float:
        """Bytes per second of one direction of a host <-> device copy (pinned host memory on an
        accelerator; a memory copy on a CPU), the faster of three."""
        try:
            src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:  # (a device short of memory: a smaller probe)
            if nbytes <= 1 << 18:
                raise
            return TorchProber.copy_bandwidth(device, nbytes // 8)
        with host_allocation():
            dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type != "cpu")
        mark_host(dst)
        best = fastest_seconds(lambda: dst.copy_(src, non_blocking=True), lambda: TorchProber.synchronize(device))
        return nbytes / max(best, 1e-9)

    def _copy_bytes_per_s(self, device: torch.device) -> float:
        return self.copy_bandwidth(device)

    def _copies_overlap(self, device: torch.device) -> bool:
        return device.type != "cpu"

    # ------------------------------------------------------------------ autograd
    def _in_backward(self) -> bool:
        return in_backward()

    def _grad_outputs(self, out: Any) -> List[torch.Tensor]:
        return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]

    def _clear_grads(self, layers: Sequence[torch.nn.Module]) -> None:
        for layer in layers:  # (a function of its own: no loop variable outlives the probe's copies)
            layer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ the step
    def _instrumented(self, layers: Sequence[torch.nn.Module], step_fn: Callable[[], Any],
                      device: torch.device) -> StepTrace:
        try:
            return self._instrumented_once(layers, step_fn, device)
        except torch.OutOfMemoryError:  # (the first step fitted, this one with its instruments does not)
            if not self._move_saved_from_now():
                raise
        free_after_out_of_memory()  # (past the except clause: the failed step's traceback is gone)
        return self._instrumented_once(layers, step_fn, device)

    def _instrumented_once(self, layers: Sequence[torch.nn.Module], step_fn: Callable[[], Any],
                           device: torch.device) -> StepTrace:
        state = self._watched_state()
        log = self._layer_log()
        recorder = _Recorder(state, self.key_of, self._backend.written_tensors, log)

        def pack(t: torch.Tensor) -> torch.Tensor:
            if log.layer is not None and t.layout is torch.strided and not t.is_meta:
                log.save(storage_key(t), t.untyped_storage().nbytes())
            return t.detach()  # what autograd would keep: an alias of the same storage

        # On a CPU the step's memory is every live storage (the meter counts them all) but those it
        # has nothing to do with: alive before and after it, never read or written by it (see
        # _unrelated_bytes). An accelerator's allocator counts all of its memory. The cyclic
        # collector runs as it does in training: paused, it would count the garbage in reference
        # cycles a step leaves (2 MiB of the bench GPT's 182 MiB), which training collects. (Where
        # it runs can differ between data-parallel ranks: ranks combine the timeline at its largest.)
        try:
            with MemoryMeter(device) as meter, recorder, self._moving_saved(meter, log) as moved, \
                    (contextlib.nullcontext() if moved is not None else
                     torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
                segments = self._segmented(layers, meter, step_fn, log.on_pre, log.on_post).segments
        finally:
            state.restore()
        before = -_unrelated_bytes(recorder) if device.type == "cpu" else 0
        for segment in segments:
            segment.start += before
            segment.peak += before
        # (what the step owns: the parameters it reached, the gradients of the leaves its forward used)
        parameters = {storage_key(t) for leaf, _ in state.leaves.values() if isinstance(leaf, torch.nn.Parameter)
                      for t in local_tensors(leaf)}
        params = sum(n for key, n in recorder.reached.items() if key in parameters)
        return StepTrace(segments, log, meter.baseline_bytes + before, meter.peak_bytes + before,
                         params, sum(recorder.grad_leaves.values()), state)

    def _probe_input(self, layer: torch.nn.Module, args: tuple, kwargs: dict, hooks: Sequence[Any]) -> "_ProbeInput":
        return _ProbeInput(layer, args, kwargs, hooks)

    # ------------------------------------------------------------------ probes
    @contextlib.contextmanager
    def _restored_after(self, source: "_ProbeInput", copies: Sequence[torch.nn.Module], watch: bool) -> Iterator[_StepState]:
        """A probe leaves the program as it found it: the generators (probes draw dropout masks too)
        and every tensor outside the probe's copies that it wrote in place (a hook of the layer using
        a module of the model, e.g. a BatchNorm's statistics). ``watch``: find those tensors with a
        dispatch mode (for runs whose time does not count); else restore the ones found before."""
        state = _StepState(self._backend)
        state.save_rng()
        for t in source.outside:
            state.keep(t)
        recorder = _Recorder(state, self.key_of, self._backend.written_tensors) if watch else contextlib.nullcontext()
        try:
            with recorder:
                yield state
        finally:
            if watch:  # (the copies' own tensors are made afresh for every run: nothing to put back)
                own = {storage_key(t) for layer in copies for t in [*layer.parameters(), *layer.buffers()]}
                found = [t for key, (t, _) in state.written.items() if key not in own]
                source.outside = list({id(t): t for t in [*source.outside, *found]}.values())
            state.restore()

    @contextlib.contextmanager
    def _chain_meter(self, source: "_ProbeInput",
                     copies: Sequence[torch.nn.Module]) -> Iterator[Tuple[MemoryMeter, List[Any]]]:
        with self._restored_after(source, copies, watch=True):
            inputs = source.inputs(len(copies))
            tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
            with MemoryMeter(source.device, track=[copies, tensors], scan_gc=False) as meter, no_gc():
                yield meter, inputs

    def _op_timer(self, times: OpTimes) -> "_OpTimer":
        return _OpTimer(times, self.key_of)

    # ------------------------------------------------------------------ checking a plan
    @staticmethod
    def submodule(model: torch.nn.Module, path: str) -> Any:
        """The module at ``path`` in ``model`` (where ``find_layers`` found the stack)."""
        return model.get_submodule(path)

    @staticmethod
    def is_container(x: Any) -> bool:
        """Whether ``x`` holds the layers so that the model calls them from it, entries settable
        (a plain list handed to ``plan_memory`` is not the model's)."""
        return isinstance(x, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential))

    def _copyable(self, layers: Sequence[torch.nn.Module]) -> bool:
        return not any(is_sharded(layer) for layer in layers)  # (FSDP2's state belongs to its module)

    def _shared_copy(self, layer: torch.nn.Module) -> torch.nn.Module:
        memo = {id(t): t for t in [*layer.parameters(), *layer.buffers()]}
        return copy.deepcopy(layer, memo)

    @contextlib.contextmanager
    def _substituted(self, stack: Any, copies: Sequence[torch.nn.Module]) -> Iterator[None]:
        keys = list(stack.keys()) if isinstance(stack, torch.nn.ModuleDict) else list(range(len(stack)))
        originals = [stack[k] for k in keys]
        try:
            for k, layer in zip(keys, copies):
                stack[k] = layer
            yield
        finally:
            for k, layer in zip(keys, originals):
                stack[k] = layer


class _OpTimer(TorchDispatchMode):
    """Passes every op call through ``times`` (:class:`~hyper_parallel.planner.chain_prober.OpTimes`)."""

    def __init__(self, times: OpTimes, key_of: Callable[[Any, tuple], OpKey]) -> None:
        super().__init__()
        self.times = times
        self.key_of = key_of

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return self.times.call(self.key_of(func, args), lambda: func(*args, **(kwargs or {})))


class _ProbeInput:
    """One layer and the input it received in the step: what a probe runs copies of. The input's
    tensors are kept as host copies (never device memory, for a CPU meter either) between probes."""

    def __init__(self, layer: torch.nn.Module, args: tuple, kwargs: dict, hooks: Sequence[Any] = ()) -> None:
        # Made inside the layer's forward: an FSDP2-sharded layer holds its unsharded parameters
        # now, and the probes run copies of it as a plain module on them (no collective), without
        # the profile's ``hooks`` (their handles remove them from the layer, not from a copy).
        self.layer = unsharded_copy(layer, [h.id for h in hooks]) if is_sharded(layer) else layer
        if any(next(local_tensors(p)) is not p for p in self.layer.parameters()):
            raise ValueError(
                f"plan_memory: the parameters of {type(layer).__name__} are sharded tensors (DTensor) but the layer "
                "is no FSDP2 module of its own (fully_shard applied only above it, or tensor parallelism): the "
                "planner probes plain copies of a layer. Apply fully_shard to every layer (and the root), as FSDP2 "
                "is usually applied, or plan before sharding.")
        self.outside: List[torch.Tensor] = []  # tensors outside the layer a run writes in place
        x = args[0]
        self.device = x.device
        self.requires_grad = x.requires_grad
        self._host = _host_copy((args, kwargs))
        # (the layer ran under the step's autocast, if any: its copies do too)
        self._autocast = [(d, torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
                          for d in {"cpu", x.device.type} if torch.is_autocast_enabled(d)]

    def inputs(self, copies: int = 1) -> List[Any]:
        """The input on the device for a chain of ``copies``: ``[activation, calls]``, ``calls``
        holding each copy's other arguments and keyword arguments. Tensors are shared by the
        copies, as the step's layers share a mask or a rotary table; other objects are fresh
        copies for each copy and every run: a Hugging Face KV cache the layer writes keeps that
        layer's keys and values as in the step, and copies sharing one layer index must not read
        each other's."""
        on_device = {id(t): t.to(self.device) for t in tree_leaves(self._host) if isinstance(t, torch.Tensor)}
        calls = []
        for _ in range(copies):
            args, kwargs = copy.deepcopy(self._host, dict(on_device))  # (the memo shares the tensors)
            calls.append((tuple(args[1:]), kwargs))
        return [on_device[id(self._host[0][0])], calls]

    def forward(self, layer: torch.nn.Module) -> Any:
        x, [(rest, kwargs)] = self.inputs()
        with self._as_in_the_step():
            return layer(x, *rest, **kwargs)

    def _as_in_the_step(self) -> contextlib.ExitStack:
        """The autocast the step ran the layer under (the backward runs outside it, as there)."""
        stack = contextlib.ExitStack()
        for device_type, dtype, cache in self._autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
        return stack

    def run(self, copies: Sequence[torch.nn.Module], inputs: Optional[List[Any]] = None) -> None:
        """Forward through the chain of copies and backward from its end, as the step does: the
        input is a fresh activation (a non-leaf where the step's required grad). The run takes
        ``inputs`` (the list is emptied): the objects the copies were called with die with the
        forward, as a model's cache dies with the output a training step drops before backward,
        and what lives on is what the copies' autograd keeps of them."""
        inputs = inputs if inputs is not None else self.inputs(len(copies))
        h = self._forward_chain(copies, inputs)
        if h.requires_grad:
            h.backward(torch.ones_like(h))

    def _forward_chain(self, copies: Sequence[torch.nn.Module], inputs: List[Any]) -> torch.Tensor:
        x, calls = inputs
        inputs.clear()
        h = x.detach().requires_grad_(True).clone() if self.requires_grad else x
        with self._as_in_the_step():
            for layer, (rest, kwargs) in zip(copies, calls):
                h = layer_output(layer(h, *rest, **kwargs), torch.Tensor)
        return h


def _backed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds all of ``t`` (an owner may have resized it to zero bytes)."""
    if t.numel() == 0:
        return True
    extent = t.storage_offset() + 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= extent * t.element_size()


#: What a training step may step besides the model: their state goes back after every run.
_STATEFUL = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau,
             torch.amp.GradScaler)


def _live_training_objects() -> Tuple[List[torch.nn.Parameter], List[Any]]:
    """Every parameter alive in the process, and every optimizer, scheduler and gradient scaler.
    (A parameter of a tensor subclass, FSDP2's sharded ``DTensor``, is not of a ``Parameter`` type:
    ``isinstance`` recognises it by its mark, so every tensor is asked.)"""
    tensors, *stateful = live_objects(torch.Tensor, *_STATEFUL)
    return [t for t in tensors if isinstance(t, torch.nn.Parameter)], [obj for found in stateful for obj in found]


def _unrelated_bytes(recorder: _Recorder) -> int:
    """Bytes of the CPU storages alive after the step that it neither made nor reached (another
    model in the process, a data set kept as tensors): they lived through the whole step, which
    never touched them, so they are not its memory. (What the step reached, parameters, buffers,
    inputs, and what existed before it and it let go of, old gradients, are.) A wrapper subclass
    (FSDP2's DTensor parameters) has no storage of its own: its inner tensors' storages count, as
    the meter counts them; storage objects count too, as the meter counts them. A tensor whose
    storage is not on the CPU is no memory here: a traced tensor kept by ``torch.compile``'s caches
    says ``cpu`` but holds a meta storage of symbolic size. A model the step reached is the step's
    whole: a buffer of it the step never reads (a rotary table's unused copy) is device memory the
    model holds, as an accelerator's allocator counts it."""
    seen, total = set(), 0
    modules, storages, tensors = live_objects(torch.nn.Module, torch.UntypedStorage, torch.Tensor)
    children = {id(c) for m in modules for c in m._modules.values() if c is not None}
    used = recorder.reached.keys() | recorder.created.keys()
    for root in (m for m in modules if id(m) not in children):
        keys = {storage_key(t) for p in [*root.parameters(), *root.buffers()] for t in local_tensors(p)}
        if keys & used:
            seen |= keys  # (the model's own: not unrelated)
    found = [(untyped_storage_key(s), s) for s in storages]
    found += [(storage_key(t), t.untyped_storage()) for obj in tensors if obj.layout is torch.strided
              for t in local_tensors(obj)]
    for key, storage in found:
        if storage.device.type != "cpu" or key in seen or key in recorder.created or key in recorder.reached \
                or is_host_storage(storage):
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _host_copy(value: Any) -> Any:
    """A deep copy of ``value`` whose tensors, wherever they sit (in containers, or in objects such
    as a Hugging Face cache holding earlier layers' keys), are detached host copies."""
    memo: Dict[int, Any] = {}
    for t in _tensors_within(value):
        memo[id(t)] = _on_host(t)
    return copy.deepcopy(value, memo)


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` in host memory, marked so (never counted as device memory by a CPU
    meter, nor refused by its cap)."""
    with host_allocation():
        host = t.detach().to("cpu", copy=True)
    mark_host(host)
    return host


def _tensors_within(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``value`` through containers and objects' attributes (modules
    and classes excluded: their tensors are parameters, never a layer's input)."""
    seen, stack = set(), [value]
    while stack:
        v = stack.pop()
        if id(v) in seen or isinstance(v, (str, bytes, int, float, bool, type, torch.nn.Module)) or v is None:
            continue
        seen.add(id(v))
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif hasattr(v, "__dict__") and not callable(v):
            stack.extend(vars(v).values())
