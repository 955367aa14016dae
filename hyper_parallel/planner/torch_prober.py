"""The planner's PyTorch part: profile a training step, probe a layer's options in isolation.

Profiling (:meth:`TorchProber.profile_step`) calls the user's ``step_fn`` twice:

1. instrumented, under a :class:`~hyper_parallel.tools.memory.MemoryMeter` (the allocator on an
   accelerator, live storages on a CPU): layer hooks cut the step into segments (each layer's
   forward, the stretch after it, each layer's backward, which starts when the gradient of its
   output is ready), a dispatch mode records every op of each layer's forward, and saved-tensor
   hooks (which save what autograd would, through an alias) record what autograd keeps;
2. plain, for the step's time, with hooks that time each layer and keep one input of each kind
   of layer for the probes.

Around both calls everything the step changes is put back: the gradients of the parameters it
reaches (``.grad`` objects and values), every tensor that existed before the step and was written
in place by it (BatchNorm statistics, accumulated gradients; found by the dispatch mode of call
1 and copied to the host before the first write), and the random number generators.

Probing (:meth:`TorchProber.probe`) runs deep copies of one layer alone, chained through the
layer chain as the model's layers are, on the input it received in the step: once with every
copy left as it is and once with one copy wrapped by the option, and reads the difference at
each segment (:class:`~hyper_parallel.planner.profile.Effect`). Four copies with the option on
the second show how a layer affects its own forward and backward, the next layer's and later
ones; two copies with the option on the last show the last layer's case. The time is that of
three copies all wrapped, against three left as they are, the faster of several runs.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map

from hyper_parallel.backends.torch._shim import is_sharded, unsharded_copy, untyped_storage_key
from hyper_parallel.backends.torch.backend import TorchBackend
from hyper_parallel.core.swap_manager import SwapManager
from hyper_parallel.core.wrapping import checkpoint_wrapper, swap_wrapper
from hyper_parallel.integrations import find_layer_stack
from hyper_parallel.tools.clock import no_gc, step_clock
from hyper_parallel.tools.memory import MemoryMeter, is_host_storage, mark_host

from .options import LayerOption, OpKey, option_policy
from .torch_distributed import collectives_for
from .torch_pipeline import TorchPipeline
from .profile import Effect, LayerRecord, LayerType, OpRecord, RELATIONS, Segment, StepProfile

__all__ = ["TorchProber", "EXPENSIVE_OPS"]

_aten = torch.ops.aten
#: Ops whose outputs the fixed recipes save or swap (matmuls and attention kernels): costly to
#: recompute for the bytes they produce.
EXPENSIVE_OPS = frozenset(str(op) for op in (
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten.convolution.default,
))
#: imported by a program that trains Hugging Face models (it imports transformers, so not here)
_HF_INTEGRATION = "hyper_parallel.integrations.transformers"
_PROBE_REPEATS = 3
#: Bytes added to every relation of a wrapped layer's effect: the small allocations of the engine
#: and of the framework's checkpoint around a wrapped layer (random-number states, handles), a few
#: hundred bytes that two peaks measured at different moments can miss.
SLACK_BYTES = 4 << 10


_clock = step_clock  # (steps, probes and ops are timed as the benchmarks time them)


def _hidden(out: Any) -> torch.Tensor:
    """The activation a layer passes to the next: its output, or the first element of it."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"plan_memory: a layer returned {type(out).__name__}; the planner needs a layer stack whose "
                    "layers return the next layer's input (a tensor, or a tuple whose first item is one).")


_BACKEND = TorchBackend()
_storage_key = _BACKEND.storage_id  # the engine's storage identity
_in_backward = _BACKEND.in_backward


def _tensor_args(args: Sequence[Any]) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


class _Segments:
    """Cuts a region measured by ``meter`` into :class:`Segment` s, at marks."""

    def __init__(self, meter: MemoryMeter) -> None:
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


def _layer_marks(layers: Sequence[torch.nn.Module], segments: _Segments,
                 on_pre: Optional[Callable[[int, tuple, dict], None]] = None,
                 on_post: Optional[Callable[[int, Any], None]] = None) -> List[Any]:
    """Hooks marking each layer's forward, the stretch after it, and its backward (when the
    gradient of its output is ready). Returns the removable handles."""
    handles = []
    for j, layer in enumerate(layers):
        def pre(module: Any, args: tuple, kwargs: dict, j: int = j) -> None:
            if _in_backward():  # (a recomputation: not a new forward)
                return
            segments.mark("fwd", j)
            if on_pre is not None:
                on_pre(j, args, kwargs)

        def post(module: Any, args: tuple, kwargs: dict, out: Any, j: int = j) -> None:
            if _in_backward():
                return
            if on_post is not None:
                on_post(j, out)
            segments.mark("gap", j)
            fired = [False]

            def on_grad(grad: Any) -> None:
                if not fired[0]:
                    fired[0] = True
                    segments.mark("bwd", j)

            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(on_grad)

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    return handles


def _backed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds all of ``t`` (an owner may have resized it to zero bytes)."""
    if t.numel() == 0:
        return True
    extent = t.storage_offset() + 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= extent * t.element_size()


class _StepState:
    """What a step changes, put back afterwards (see the module docstring)."""

    def __init__(self) -> None:
        self.leaves: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}  # id -> (leaf, its .grad)
        self.written: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # storage -> (tensor, host copy)
        self._rng: Any = None

    def see_leaf(self, t: torch.Tensor) -> None:
        if id(t) not in self.leaves:
            self.leaves[id(t)] = (t, t.grad)
            grad = t.grad
            if grad is not None:
                self.keep(grad)

    def keep(self, t: torch.Tensor) -> None:
        """Copy ``t`` to the host before the step writes it (once per storage). A tensor whose
        storage its owner has freed (FSDP2 resizes its all-gather buffers to zero bytes between
        uses) holds nothing to put back: it is skipped."""
        key = _storage_key(t)
        if key not in self.written and _backed(t):
            host = t.detach().to("cpu", copy=True)
            mark_host(host)  # (never counted as device memory by a CPU meter)
            self.written[key] = (t, host)

    def save_rng(self) -> None:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        dm = torch.get_device_module(acc.type) if acc is not None else None
        self._rng = (torch.get_rng_state(), dm.get_rng_state_all() if dm is not None else None, dm)

    def again(self) -> "_StepState":
        """A state that snapshots the same tensors now, for another call of the step."""
        other = _StepState()
        for leaf, _ in self.leaves.values():
            other.see_leaf(leaf)
        for t, _ in self.written.values():
            other.keep(t)
        return other

    def restore(self) -> None:
        with torch.no_grad():
            for t, host in self.written.values():
                if _backed(t):  # (freed by its owner meanwhile, FSDP2's resharding: its content is the owner's)
                    t.copy_(host)
        for leaf, grad in self.leaves.values():
            leaf.grad = grad
        if self._rng is not None:
            cpu, acc, dm = self._rng
            torch.set_rng_state(cpu)
            if acc is not None:
                dm.set_rng_state_all(acc)


class _Recorder(TorchDispatchMode):
    """Call 1's dispatch mode: the op calls of the layer whose forward runs (per layer), the
    storages created in the step, the parameters it reaches and the tensors it overwrites."""

    def __init__(self, state: _StepState, key_of: Callable[[Any, tuple], OpKey], written: Callable[..., list]) -> None:
        super().__init__()
        self.state = state
        self.key_of = key_of
        self.written = written
        self.layer: Optional[int] = None
        self.ops: Dict[int, List[OpRecord]] = {}
        # storage -> the op record of the running layer that made it / storages made in the step:
        # a storage's key can be reused once it died, so both forget it then.
        self.made_by: Dict[int, Tuple[int, OpRecord]] = {}
        self.created: Dict[int, Any] = {}
        self.reached: Dict[int, int] = {}  # storages the step used that existed before it -> bytes

    def _made(self, key: int, storage: Any) -> None:
        def forget(_: Any, key: int = key) -> None:
            self.created.pop(key, None)
            self.made_by.pop(key, None)

        self.created[key] = weakref.ref(storage, forget)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        inputs = set()
        # (below autograd, a backward kernel's saved tensors look like leaves requiring grad:
        # only the forward's leaves are the parameters and inputs whose .grad the step writes)
        forward = not _in_backward()
        for arg in tree_leaves((args, kwargs)):
            if not (isinstance(arg, torch.Tensor) and arg.layout is torch.strided and not arg.is_meta):
                continue
            for t in _local_tensors(arg):  # (a DTensor reaches its local shard)
                key = _storage_key(t)
                inputs.add(key)
                if key not in self.created and key not in self.reached and not is_host_storage(t):
                    self.reached[key] = t.untyped_storage().nbytes()
            if forward and arg.requires_grad and arg.is_leaf:
                self.state.see_leaf(arg)
        written = self.written(func, args, kwargs)  # (declared or not: BatchNorm's statistics)
        mutating = bool(written)
        for t in written:
            if t.layout is torch.strided and _storage_key(t) not in self.created:
                self.state.keep(t)
        out = func(*args, **kwargs)
        new_bytes, made = 0, []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta:
                key = _storage_key(t)
                if key not in inputs and key not in made:
                    storage = t.untyped_storage()
                    self._made(key, storage)
                    new_bytes += storage.nbytes()
                    made.append(key)
        if self.layer is not None and forward:
            label = str(func)
            record = OpRecord(self.key_of(func, args), new_bytes, False, mutating, label in EXPENSIVE_OPS)
            self.ops.setdefault(self.layer, []).append(record)
            for key in made:
                self.made_by[key] = (self.layer, record)
        return out


class TorchProber:
    """Profiling and probing on PyTorch (see the module docstring); the planner's framework part."""

    name = "torch"

    def __init__(self) -> None:
        self._backend = _BACKEND
        self._labels: Dict[Any, str] = {}

    # ------------------------------------------------------------------ names and sizes
    def key_of(self, op: Any, args: Tuple[Any, ...]) -> OpKey:
        """An op call's :class:`OpKey` (what generated policies look up)."""
        label = self._labels.get(op)
        if label is None:
            label = self._labels[op] = str(op)
        return OpKey(label, tuple(tuple(t.shape) for t in _tensor_args(args)))

    @staticmethod
    def nbytes(t: Any) -> int:
        """Bytes of the storage a saved tensor views (what a swap moves)."""
        return t.untyped_storage().nbytes()

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
        ``ModuleDict`` of same-class blocks): its attribute path and layers. A Hugging Face model
        needs ``hyper_parallel.integrations.transformers`` imported (it hands the layers our
        checkpoint, so that their KV cache follows Hugging Face's rules)."""
        if type(model).__module__.startswith("transformers.") and _HF_INTEGRATION not in sys.modules:
            raise ValueError(f"plan_memory: {type(model).__name__} is a Hugging Face model: import "
                             f"{_HF_INTEGRATION} first (it hands Hugging Face's layers our checkpoint, so that "
                             "their cache follows Hugging Face's rules when some layers are recomputed).")
        stack = find_layer_stack(model)
        layers = list(stack.layers.values()) if isinstance(stack.layers, torch.nn.ModuleDict) else list(stack.layers)
        return stack.path, layers

    @staticmethod
    def after_wrap(model: Optional[torch.nn.Module], layers: Sequence[torch.nn.Module], recomputes: bool) -> None:
        """What a model needs once some of its layers are wrapped: a Hugging Face model whose
        layers recompute gets its model-level checkpointing flag (``checkpoint_above``)."""
        integration = sys.modules.get(_HF_INTEGRATION)
        if model is not None and recomputes and integration is not None and \
                type(model).__module__.startswith("transformers."):
            integration.checkpoint_above(model, layers)

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
        state = _StepState()
        state.save_rng()
        gc.collect()
        for p in _parameters():
            state.see_leaf(p)
        recorder = _Recorder(state, self.key_of, self._backend.written_tensors)
        try:
            with MemoryMeter(device) as meter:
                with recorder, no_gc():  # (as call 1 of a profile: see there)
                    step_fn()
        finally:
            state.restore()
        return meter.peak_bytes - (_unrelated_bytes(recorder) if device.type == "cpu" else 0)

    @staticmethod
    def collectives(group: Any) -> Any:
        """The ``torch.distributed`` collectives of ``plan_memory(..., group=group)``, or ``None``
        to plan alone (``torch_distributed.collectives_for``)."""
        return collectives_for(group)

    def wrap(self, layer: torch.nn.Module, option: LayerOption, seen: Sequence[OpKey]) -> Any:
        """Wrap ``layer`` in place for ``option`` through the public API; the generated policy."""
        policy = option_policy(option, seen, self.key_of, self.nbytes)
        if option.kind == "swap":
            swap_wrapper(layer, policy_fn=policy)
        elif option.kind == "checkpoint":
            checkpoint_wrapper(layer, policy_fn=policy, swap_inputs=option.swap_inputs)
        return policy

    @staticmethod
    def device_of(layers: Sequence[torch.nn.Module]) -> torch.device:
        for layer in layers:
            for p in layer.parameters():
                return p.device
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: torch.device) -> None:
        if device.type != "cpu":
            torch.get_device_module(device.type).synchronize(device)

    # ------------------------------------------------------------------ profiling the step
    def profile_step(self, layers: Sequence[torch.nn.Module], step_fn: Callable[[], Any]) -> StepProfile:
        device = self.device_of(layers)
        n = len(layers)
        # Call 1: the memory timeline, every layer's ops and saved storages.
        state = _StepState()
        state.save_rng()
        gc.collect()  # (garbage in reference cycles would count as live memory, and its parameters as the step's)
        for p in _parameters():  # (FSDP2 sets its sharded parameters' .grad itself: no op of the step names them)
            state.see_leaf(p)
        recorder = _Recorder(state, self.key_of, self._backend.written_tensors)
        saved: Dict[int, Dict[int, int]] = {}  # layer -> storage -> bytes
        inputs: Dict[int, int] = {}
        flows: List[bool] = []
        outputs: Dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if recorder.layer is not None and t.layout is torch.strided and not t.is_meta:
                key = _storage_key(t)
                made = recorder.made_by.get(key)
                if made is not None and made[0] == recorder.layer:  # (saved by the layer that made it)
                    made[1].saved = True
                saved.setdefault(recorder.layer, {})[key] = t.untyped_storage().nbytes()
            return t.detach()  # what autograd would keep: an alias of the same storage

        arg_shapes: Dict[int, tuple] = {}

        held: List[int] = []
        given: Dict[int, Any] = {}  # layer -> a weak reference to its input

        def on_pre(j: int, args: tuple, kwargs: dict) -> None:
            recorder.layer = j
            arg_shapes[j] = tuple((tuple(t.shape), str(t.dtype)) for t in _tensor_args(args))
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is not None:
                given[j] = weakref.ref(x)
            inputs[j] = x.untyped_storage().nbytes() if x is not None else 0
            flows.append(x is not None and outputs.get(j - 1) == id(x))

        def on_post(j: int, out: Any) -> None:
            recorder.layer = None
            outputs[j] = id(_hidden(out))
            # (autograd keeps aliases of what it saves: the input object itself outlives the next
            # layer only where the program holds it)
            earlier = given.pop(j - 1, None)
            if earlier is not None and earlier() is not None:
                held.append(j - 1)

        # On a CPU the step's memory is every live storage (the meter counts them all) but those it
        # has nothing to do with: alive before and after it, never read or written by it (see
        # _unrelated_bytes). An accelerator's allocator counts all of its memory.
        cpu = device.type == "cpu"
        gc.collect()  # (garbage in reference cycles would count as live memory)
        try:
            with MemoryMeter(device) as meter:
                segments = _Segments(meter)
                handles = _layer_marks(layers, segments, on_pre, on_post)
                try:
                    segments.mark("pre", -1)
                    # (no cyclic collection inside: when it would run depends on everything the
                    # process did before, so the bytes of data-parallel ranks would differ, by a
                    # layer of FSDP2's gathered parameters kept by a cycle, say)
                    with recorder, no_gc(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        step_fn()
                    segments.close()
                finally:
                    for h in handles:
                        h.remove()
        finally:
            state.restore()
        unrelated = _unrelated_bytes(recorder) if cpu else 0
        kinds = [(s.kind, s.layer) for s in segments.segments]
        expected = [("pre", -1)] + [(k, j) for j in range(n) for k in ("fwd", "gap")] + \
                   [("bwd", j) for j in range(n - 1, -1, -1)]
        if kinds != expected:
            raise RuntimeError(
                "plan_memory: step_fn must run every layer's forward once, in order, then the backward "
                f"through all of them (got the layer events {[f'{k} {j}' for k, j in kinds[:12]]}...). Pass the "
                "model's layer stack in the order its forward calls it, and a step_fn doing one forward + backward.")
        # Call 2: the plain step's time and each layer's; an input of every layer kept for probes.
        times = [[0.0, 0.0] for _ in range(n)]
        clock: Dict[str, float] = {}
        records = []
        for j in range(n):
            sizes = sorted(saved.get(j, {}).values(), reverse=True)
            records.append(LayerRecord(j, "", recorder.ops.get(j, []), sizes, inputs.get(j, 0)))
        types = self._layer_types(layers, records, arg_shapes)
        first = {t.layers[0]: t for t in types.values()}

        now = _clock(device)

        def timed_pre(j: int, args: tuple, kwargs: dict) -> None:
            if j in first:  # the input a probe of its type runs on, copied now (a cache fills up later)
                t0 = now()
                first[j].probe_inputs = _ProbeInput(layers[j], args, kwargs, handles)
                clock["copies"] = clock.get("copies", 0.0) + now() - t0  # (not the step's time)
            clock["f"] = now()

        def timed_post(j: int, out: Any) -> None:
            times[j][0] = now() - clock["f"]

        second = state.again()
        second.save_rng()
        timer = _Timer(now)
        handles = _layer_marks(layers, timer, timed_pre, timed_post)
        try:
            self.synchronize(device)
            with no_gc():
                t0 = now()
                step_fn()
                self.synchronize(device)
                step_s = now() - t0 - clock.get("copies", 0.0)
        finally:
            for h in handles:
                h.remove()
            second.restore()
        for j, seconds in timer.backward_times(n).items():
            times[j][1] = seconds
        for j, record in enumerate(records):
            record.forward_s, record.backward_s = times[j]
            record.input_held = j in held
        params = {_storage_key(t): t.untyped_storage().nbytes() for layer in layers for p in layer.parameters()
                  for t in _local_tensors(p)}
        param_bytes = sum(params.values())
        before = -unrelated
        for segment in segments.segments:
            segment.start += before
            segment.peak += before
        all_leaves = {_storage_key(leaf): leaf.untyped_storage().nbytes() for leaf, _ in state.leaves.values()}
        notes = []
        if not all(flows[1:]):
            notes.append("a layer's input is not the previous layer's output: the probes chain the layers anyway")
        return StepProfile(
            device=str(device), segments=segments.segments, layers=records, types=types,
            baseline_bytes=meter.baseline_bytes + before, peak_bytes=meter.peak_bytes + before, step_s=step_s,
            param_bytes=max(param_bytes, sum(all_leaves.values())), grad_bytes=sum(all_leaves.values()),
            copy_bytes_per_s=self.copy_bandwidth(device), overlaps=device.type != "cpu", notes=notes)

    @staticmethod
    def _layer_types(layers: Sequence[torch.nn.Module], records: List[LayerRecord],
                     arg_shapes: Dict[int, tuple]) -> Dict[str, LayerType]:
        """Group the layers whose profiles agree (class, parameter shapes, input shapes, ops,
        saved storages) into :class:`LayerType` s (without their probe inputs yet)."""
        types: Dict[str, LayerType] = {}
        signatures: Dict[Any, str] = {}
        for j, (layer, record) in enumerate(zip(layers, records)):
            signature = (type(layer).__qualname__,
                         tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters()),
                         arg_shapes.get(j), tuple((r.key, r.new_bytes, r.saved) for r in record.ops),
                         tuple(record.saved_sizes))
            key = signatures.get(signature)
            if key is None:
                key = signatures[signature] = f"{type(layer).__name__}#{len(signatures)}"
                types[key] = LayerType(key, [], record)
            types[key].layers.append(j)
            record.type_key = key
        return types

    @staticmethod
    def copy_bandwidth(device: torch.device, nbytes: int = 32 << 20) -> float:
        """Bytes per second of one direction of a host <-> device copy (pinned host memory on an
        accelerator; a memory copy on a CPU), the faster of three."""
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type != "cpu")
        mark_host(dst)
        best = float("inf")
        for _ in range(3):
            TorchProber.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            TorchProber.synchronize(device)
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
        for relation in RELATIONS:  # what a wrapped layer keeps that a difference of peaks can miss
            if relation != "after":
                effect[relation] += SLACK_BYTES
        # Every option adds work to the layer (recompute, copies, bookkeeping): a run measured faster
        # than the plain layer is timing noise, and counts as free.
        seconds = max(0.0, (self._chain_time(source, option, seen) - reference["time"]) / 3)
        return Effect(effect, seconds, measured=True), reference

    def _copies(self, source: "_ProbeInput", options: Sequence[Optional[LayerOption]],
                seen: Sequence[OpKey]) -> List[torch.nn.Module]:
        copies = [copy.deepcopy(source.layer) for _ in options]
        for i, option in enumerate(options):
            if option is not None:
                self.wrap(copies[i], option, seen)
        for i in range(len(copies) - 1):
            SwapManager().set_forward_prefetch_layer(copies[i], copies[i + 1])
        return copies

    @staticmethod
    def _forget(copies: List[torch.nn.Module]) -> None:
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

    def _chain_memory(self, source: "_ProbeInput", options: Sequence[Optional[LayerOption]],
                      seen: Sequence[OpKey]) -> Dict[str, int]:
        """Segment peaks (by name) of one forward + backward of a chain of copies."""
        copies = self._copies(source, options, seen)
        try:
            with _kept(source, self.key_of, watch=True, copies=copies):
                # (no warm-up run: host buffers are never device memory, and the step ran already,
                # so one-off device allocations such as a BLAS workspace are made)
                inputs = source.inputs()
                tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
                with MemoryMeter(source.device, track=[copies, tensors], scan_gc=False) as meter, no_gc():
                    segments = _Segments(meter)
                    handles = _layer_marks(copies, segments)
                    try:
                        segments.mark("pre", -1)
                        source.run(copies, inputs)
                        segments.close()
                    finally:
                        for h in handles:
                            h.remove()
        finally:
            self._forget(copies)
        return {s.name: s.peak for s in segments.segments}

    def _chain_time(self, source: "_ProbeInput", option: Optional[LayerOption], seen: Sequence[OpKey]) -> float:
        """Seconds of one forward + backward of three copies, all wrapped by ``option`` (the
        fastest of several runs)."""
        copies = self._copies(source, [option] * 3, seen)
        now = _clock(source.device)
        best = float("inf")
        try:
            with _kept(source, self.key_of, watch=False):
                source.run(copies)
                for _ in range(_PROBE_REPEATS):
                    _zero_grads(copies)
                    inputs = source.inputs()
                    self.synchronize(source.device)
                    with no_gc():
                        t0 = now()
                        source.run(copies, inputs)
                        self.synchronize(source.device)
                        best = min(best, now() - t0)
        finally:
            self._forget(copies)
        return best

    def op_seconds(self, ltype: LayerType) -> Dict[OpKey, float]:
        """Forward seconds of each op kind of ``ltype``'s layer (the sum over its calls; the
        fastest of several runs of a copy), what recomputing it costs."""
        source: _ProbeInput = ltype.probe_inputs
        layer = copy.deepcopy(source.layer)
        timer = _OpTimer(source.device, self.key_of)
        with torch.no_grad():
            for _ in range(_PROBE_REPEATS):
                timer.start_run()
                with no_gc(), timer, _kept(source, self.key_of, watch=True, copies=[layer]):  # (the timer below: ops only)
                    source.forward(layer)
        return timer.best()


class _Timer(_Segments):
    """``_layer_marks``'s target in the timing call: the time of each layer's backward (from its
    mark to the next), nothing else."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.marks: List[Tuple[str, int, float]] = []
        self._now = now

    def mark(self, kind: str, layer: int) -> None:  # type: ignore[override]
        if kind == "bwd":
            self.marks.append((kind, layer, self._now()))

    def backward_times(self, n: int) -> Dict[int, float]:
        out = {}
        for (_, j, t), (_, _, t_next) in zip(self.marks, self.marks[1:]):
            out[j] = t_next - t
        return out


class _OpTimer(TorchDispatchMode):
    """Times every op call of a forward; keeps the fastest of the runs, per call."""

    def __init__(self, device: torch.device, key_of: Callable[[Any, tuple], OpKey]) -> None:
        super().__init__()
        self.device = device
        self.key_of = key_of
        self.now = _clock(device)
        self.runs: List[List[Tuple[OpKey, float]]] = []

    def start_run(self) -> None:
        self.runs.append([])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        TorchProber.synchronize(self.device)
        t0 = self.now()
        out = func(*args, **(kwargs or {}))
        TorchProber.synchronize(self.device)
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
    tensors are kept as host copies (never device memory, for a CPU meter either) between probes."""

    def __init__(self, layer: torch.nn.Module, args: tuple, kwargs: dict, hooks: Sequence[Any] = ()) -> None:
        # Made inside the layer's forward: an FSDP2-sharded layer holds its unsharded parameters
        # now, and the probes run copies of it as a plain module on them (no collective), without
        # the profile's ``hooks`` (their handles remove them from the layer, not from a copy).
        self.layer = unsharded_copy(layer, [h.id for h in hooks]) if is_sharded(layer) else layer
        self.outside: List[torch.Tensor] = []  # tensors outside the layer a run writes in place
        x = args[0]
        self.device = x.device
        self.requires_grad = x.requires_grad
        args, kwargs = _without_cache(args, kwargs)
        self._host = copy.deepcopy(tree_map(_to_host, (args, kwargs)))  # (its own copy of other objects)

    def inputs(self) -> Tuple[torch.Tensor, tuple, dict]:
        """The input on the device: ``(activation, other arguments, keyword arguments)``. Other
        objects among them are fresh copies for every run (a cache a layer appends to must not
        grow from probe to probe)."""
        args, kwargs = tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t,
                                copy.deepcopy(self._host))
        return args[0], tuple(args[1:]), kwargs

    def forward(self, layer: torch.nn.Module) -> Any:
        x, rest, kwargs = self.inputs()
        return layer(x, *rest, **kwargs)

    def run(self, copies: Sequence[torch.nn.Module], inputs: Optional[Tuple[torch.Tensor, tuple, dict]] = None) -> None:
        """Forward through the chain of copies and backward from its end, as the step does: the
        input is a fresh activation (a non-leaf where the step's required grad)."""
        x, rest, kwargs = inputs if inputs is not None else self.inputs()
        h = x.detach().requires_grad_(True).clone() if self.requires_grad else x
        for layer in copies:
            h = _hidden(layer(h, *rest, **kwargs))
        if h.requires_grad:
            h.backward(torch.ones_like(h))


def _local_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors holding ``t``'s data: itself, or a wrapper subclass's inner tensors (FSDP2's
    DTensor parameters hold their local shard)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _local_tensors(inner)
    else:
        yield t


def _parameters() -> List[torch.nn.Parameter]:
    """Every parameter alive in the process (``type`` first: ``isinstance`` on an arbitrary object
    may evaluate a ``__class__`` property, and some warn)."""
    tensor_type = torch.Tensor
    return [obj for obj in gc.get_objects() if issubclass(type(obj), tensor_type) and isinstance(obj, torch.nn.Parameter)]


def _unrelated_bytes(recorder: _Recorder) -> int:
    """Bytes of the CPU storages alive after the step that it neither made nor reached (another
    model in the process, a data set kept as tensors): they lived through the whole step, which
    never touched them, so they are not its memory. (What the step reached, parameters, buffers,
    inputs, and what existed before it and it let go of, old gradients, are.) A wrapper subclass
    (FSDP2's DTensor parameters) has no storage of its own: its inner tensors' storages count, as
    the meter counts them."""
    seen, total = set(), 0
    tensor_type, storage_type = torch.Tensor, torch.UntypedStorage
    objs = gc.get_objects()
    try:
        for obj in objs:
            if type(obj) is storage_type:  # (the meter counts storage objects too)
                storages = [(untyped_storage_key(obj), obj)] if obj.device.type == "cpu" else []
            elif issubclass(type(obj), tensor_type) and obj.device.type == "cpu" and obj.layout is torch.strided \
                    and not obj.is_meta:
                storages = [(_storage_key(t), t.untyped_storage()) for t in _local_tensors(obj)]
            else:
                continue
            for key, storage in storages:
                if key in seen or key in recorder.created or key in recorder.reached or is_host_storage(storage):
                    continue
                seen.add(key)
                total += storage.nbytes()
    finally:
        del objs
    return total


def _is_hf_cache(x: Any) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(x).__mro__)


def _without_cache(args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """A layer's arguments for probes, a Hugging Face KV cache left out (``None``, ``use_cache``
    off): copies of one layer share its layer index, so they would read each other's keys, and a
    recomputed layer trains without a cache anyway."""
    if not any(_is_hf_cache(a) for a in (*args, *kwargs.values())):
        return args, kwargs
    args = tuple(None if _is_hf_cache(a) else a for a in args)
    kwargs = {k: (None if _is_hf_cache(v) else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def _to_host(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    host = t.detach().to("cpu", copy=True)
    mark_host(host)
    return host


def _zero_grads(layers: Sequence[torch.nn.Module]) -> None:
    for layer in layers:  # (a function of its own: no loop variable outlives the probe's copies)
        layer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _kept(source: "_ProbeInput", key_of: Callable[[Any, tuple], OpKey], watch: bool,
          copies: Sequence[torch.nn.Module] = ()) -> Iterator[None]:
    """A probe leaves the program as it found it: the generators (probes draw dropout masks too)
    and every tensor outside the probe's copies that it wrote in place (a hook of the layer using
    a module of the model, e.g. a BatchNorm's statistics). ``watch``: find those tensors with a
    dispatch mode (for runs whose time does not count); else restore the ones found before."""
    state = _StepState()
    state.save_rng()
    for t in source.outside:
        state.keep(t)
    recorder = _Recorder(state, key_of, _BACKEND.written_tensors) if watch else contextlib.nullcontext()
    try:
        with recorder:
            yield
    finally:
        if watch:  # (the copies' own tensors are made afresh for every run: nothing to put back)
            own = {_storage_key(t) for layer in copies for t in [*layer.parameters(), *layer.buffers()]}
            found = [t for key, (t, _) in state.written.items() if key not in own]
            source.outside = list({id(t): t for t in [*source.outside, *found]}.values())
        state.restore()
