"""Variants side by side in one process, interleaved: the runner of every script in ``benchmarks/``.

Every variant (a recipe of :mod:`hyper_parallel.bench.modes`) gets its own copy of the same initial
model and its own SGD optimizer, and the rounds are interleaved (:func:`~hyper_parallel.bench.timing.interleaved`),
so machine noise hits all variants alike. A step is ``loss = model(*batch); loss.backward()`` (the
timed part) and the optimizer step, so any model with ``.layers`` whose call returns its loss runs
here: the bench GPT, the post-LN transformer, ``SmallOpsNet``.

What is measured, and how (see docs/benchmarks.md, "Method"):

* memory, in one metered step: :class:`PhaseMeter`'s peak and live bytes at the end of the forward,
  the backward and the optimizer step, each as the variant's own parameters and buffers plus what
  the step added (on an accelerator the allocator's counters; on CPU ``MemoryMeter``'s live CPU
  storages, where every offloading variant's host copies are counted as host memory: ours marked
  by the library, the peers' by their recipes, which also make the copy that ``tensor.cpu()``
  skips on a CPU tensor);
* bytes moved per step: ours from ``SwapManager().stats()`` (offloaded, loaded, load launches),
  the peers' from the counters of their recipes;
* time: the median of the timed forward + backward, and of its forward part (on
  :func:`~hyper_parallel.tools.clock.step_clock`: the process's CPU time on a one-thread CPU);
* optionally the calls the interpreter makes in one step (:class:`~hyper_parallel.bench.timing.counting_calls`),
  a Chrome trace of one step, copy-engine figures from it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
from hyper_parallel.bench.modes import RECIPES, ByteCounter, Recipe
from hyper_parallel.bench.timing import counting_calls, interleaved, median, synchronize
from hyper_parallel.core.activation_checkpoint import SwapManager
from hyper_parallel.tools.clock import no_gc, step_clock
from hyper_parallel.tools.memory import MemoryMeter, is_host_storage

__all__ = ["VariantRun", "RunResult", "COMPILED", "PHASES", "PhaseMeter", "build_variant", "run_variants", "summarize",
           "truncated_copy", "module_bytes", "grad_bytes", "saved_bytes_per_layer", "probe_bandwidth",
           "released_caches"]

#: The phases of a metered step, in order.
PHASES = ("forward", "backward", "optimizer")


#: A variant name ending in this is its recipe's model under ``torch.compile`` (compile_vs_eager.py).
COMPILED = "+compile"


@dataclass
class VariantRun:
    """One variant's model, optimizer and what was measured on it."""

    name: str
    recipe: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    counter: Optional[ByteCounter] = None  # peers that move bytes
    uses_manager: bool = False             # ours that move bytes (counted by SwapManager().stats())
    static_bytes: int = 0
    losses: List[float] = field(default_factory=list)
    times: List[float] = field(default_factory=list)
    forward_times: List[float] = field(default_factory=list)
    peak_bytes: Optional[int] = None
    phases: Dict[str, Dict[str, int]] = field(default_factory=dict)
    moved: Dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    load_launches: Optional[int] = None  # ours: SwapManager().stats()["load_launches"] per step
    tensors_out: Optional[int] = None    # peers: tensors their hooks copied out per step
    calls: Optional[Dict[str, int]] = None
    grads_equal_to_none: Optional[bool] = None
    trace_path: Optional[str] = None
    copy_engine: Optional[Dict[str, Any]] = None


@dataclass
class RunResult:
    variants: Dict[str, VariantRun]
    skipped: Dict[str, str]
    errors: Dict[str, str]


# --------------------------------------------------------------------------- sizes

def _bytes(tensors: Sequence[torch.Tensor], per_storage: Callable[[torch.Tensor], int]) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if key not in seen:
            seen.add(key)
            total += per_storage(t)
    return total


def module_bytes(model: nn.Module) -> int:
    """Bytes of the storages of ``model``'s parameters and buffers."""
    return _bytes(list(model.parameters()) + list(model.buffers()), lambda t: t.untyped_storage().nbytes())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients of all trainable parameters (what a full backward allocates)."""
    return _bytes([p for p in model.parameters() if p.requires_grad], lambda p: p.numel() * p.element_size())


def saved_bytes_per_layer(model: nn.Module, batch: Tuple[torch.Tensor, ...]) -> List[int]:
    """Bytes of the distinct storages each layer of an unwrapped ``model`` saves for backward (its
    parameters and buffers excluded), from one forward of ``batch``: one layer's activations."""
    static = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    per_layer: List[Dict[int, int]] = [dict() for _ in model.layers]
    current: List[Optional[int]] = [None]
    handles = []
    for i, layer in enumerate(model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if current[0] is not None and key not in static:
            per_layer[current[0]][key] = t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            del_me = model(*batch)
        del del_me
    finally:
        for h in handles:
            h.remove()
    return [sum(d.values()) for d in per_layer]


def truncated_copy(model: GPT, layers: int) -> GPT:
    """A deep copy of ``model`` keeping only its first ``layers`` blocks (building a deep GPT is
    slow: its init draws every weight from a CPU generator, so a layer sweep builds the deepest
    model once and copies prefixes of it)."""
    full, cfg = model.layers, model.cfg
    model.layers = nn.ModuleList(list(full)[:layers])
    model.cfg = GPTConfig(**{**cfg.to_dict(), "layers": layers})
    try:
        return copy.deepcopy(model)
    finally:
        model.layers, model.cfg = full, cfg


# --------------------------------------------------------------------------- memory per phase

class _CpuPeakReader(TorchDispatchMode):
    """Reads a CPU ``MemoryMeter``'s live bytes before and after every op; ``peak`` is the highest
    reading since the last :meth:`restart` (the meter's own peak cannot be reset, and covers the
    whole region). A reading right after an op counts its outputs; one of them that is then marked
    as a host buffer (the engine marks its copies right after allocating them, as ``mark_host``
    asks) is taken out of that reading, as the meter itself never counts it."""

    def __init__(self, meter: MemoryMeter) -> None:
        super().__init__()
        self.meter = meter
        self.peak = meter.current_bytes
        self._after: Optional[Tuple[int, List[Any]]] = None  # (reading, weakrefs to the outputs' storages)

    def _settle(self) -> None:
        if self._after is not None:
            reading, outputs = self._after
            self._after = None
            for ref in outputs:
                st = ref()
                if st is not None and is_host_storage(st):
                    reading -= st.nbytes()
            self.peak = max(self.peak, reading)
        self.peak = max(self.peak, self.meter.current_bytes)

    def take(self) -> int:
        """The peak of the phase so far; the next phase's starts from the live bytes now."""
        self._settle()
        peak, self.peak = self.peak, self.meter.current_bytes
        return peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self._settle()
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        self._after = (self.meter.current_bytes,
                       [weakref.ref(t.untyped_storage()) for t in leaves if isinstance(t, torch.Tensor)])
        return out


class PhaseMeter:
    """Peak and live device bytes at the end of every phase of one region, each as params +
    buffers of ``model`` + what the region added.

    Use ``with PhaseMeter(device, model) as pm:`` and call ``pm.phase(name)`` at the end of each
    phase; ``pm.phases[name]`` is ``{"peak", "end"}``. Accelerators: one ``MemoryMeter`` per phase
    (each starts the allocator's peak counter afresh). CPU: one ``MemoryMeter`` (tracking the model,
    no gc scan) for the region, read around every op by a dispatch mode inside it."""

    def __init__(self, device: torch.device, model: nn.Module) -> None:
        self.device = torch.device(device)
        self.model = model
        self.static = module_bytes(model)
        self.phases: Dict[str, Dict[str, int]] = {}
        self._meter: Optional[MemoryMeter] = None
        self._reader: Optional[_CpuPeakReader] = None
        self._baseline = 0

    def _meter_on(self) -> MemoryMeter:
        self._meter = MemoryMeter(self.device, track=[self.model], scan_gc=False).__enter__()
        return self._meter

    def __enter__(self) -> "PhaseMeter":
        synchronize(self.device)
        self._baseline = self._meter_on().baseline_bytes
        if self.device.type == "cpu":
            self._reader = _CpuPeakReader(self._meter).__enter__()
        return self

    def phase(self, name: str) -> None:
        """Close phase ``name``: record its peak and the live bytes now, start the next one."""
        synchronize(self.device)
        if self._reader is not None:
            peak, now = self._reader.take(), self._meter.current_bytes
        else:
            self._meter.__exit__(None, None, None)
            peak, now = self._meter.peak_bytes, self._meter.current_bytes
            self._meter_on()
        self.phases[name] = {"peak": self.static + max(0, peak - self._baseline),
                             "end": self.static + max(0, now - self._baseline)}

    def __exit__(self, *exc: Any) -> None:
        if self._reader is not None:
            self._reader.__exit__(*exc)
        if self._meter is not None:
            self._meter.__exit__(*exc)


# --------------------------------------------------------------------------- the steps

def build_variant(name: str, base: nn.Module, device: torch.device, lr: float,
                  recipes: Mapping[str, Recipe] = RECIPES) -> VariantRun:
    """A fresh copy of ``base`` (already on ``device``) set up as recipe ``name`` of ``recipes``
    (``<recipe>+compile``: then under ``torch.compile``).

    Raises ``RuntimeError`` with the reason when the variant cannot run here."""
    recipe = name[:-len(COMPILED)] if name.endswith(COMPILED) else name
    model = copy.deepcopy(base)
    if recipe not in recipes:
        raise ValueError(f"unknown variant {recipe!r}; choose from {', '.join(recipes)}")
    counter = recipes[recipe].apply(model, torch.device(device), None)
    # SGD without momentum keeps no optimizer state: the memory column is params + grads +
    # activations, and the models of all variants fit side by side in one process.
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    static = module_bytes(model)
    if recipe != name:
        model = torch.compile(model)
    return VariantRun(name, recipe, model, opt, counter=counter, static_bytes=static,
                      uses_manager=recipes[recipe].offloads and recipes[recipe].who == "ours")


def _moved_so_far(v: VariantRun) -> Tuple[int, int, int]:
    if v.counter is not None:
        return v.counter.d2h, v.counter.h2d, v.counter.tensors
    if v.uses_manager:
        s = SwapManager().stats()
        return int(s["offloaded_bytes"]), int(s["loaded_bytes"]), int(s["load_launches"])
    return 0, 0, 0


def train_step(v: VariantRun, batch: Tuple[torch.Tensor, ...], seed: int, device: torch.device,
               meter: Optional[PhaseMeter] = None) -> Tuple[float, float, float]:
    """One SGD step of variant ``v``: ``(loss, forward+backward seconds, forward seconds)``; the
    bytes it moved go to ``v.moved`` (and ``v.load_launches`` / ``v.tensors_out``).

    The global RNG is seeded from ``seed`` first, so dropout is the same in every variant. The
    timed region is forward + backward (what the variants change), synchronised before and after;
    the forward's time is read when it returns (on an accelerator: the host's time to issue it).
    The optimizer step follows. With ``meter``, each phase's end is recorded in it."""
    torch.manual_seed(seed)
    v.optimizer.zero_grad(set_to_none=True)
    before = _moved_so_far(v)
    now = step_clock(device)
    synchronize(device)
    with no_gc():
        t0 = now()
        loss = v.model(*batch)
        t1 = now()
        if meter is not None:
            meter.phase("forward")
        loss.backward()
        synchronize(device)
        t2 = now()
    if meter is not None:
        meter.phase("backward")
    v.optimizer.step()
    if meter is not None:
        meter.phase("optimizer")
    value = float(loss.detach().item())
    del loss
    after = _moved_so_far(v)
    v.moved = {"d2h": after[0] - before[0], "h2d": after[1] - before[1]}
    if v.counter is not None:
        v.tensors_out = after[2] - before[2]
    elif v.uses_manager:
        v.load_launches = after[2] - before[2]
    return value, t2 - t0, t1 - t0


def metered_step(v: VariantRun, batch, seed: int, device: torch.device) -> Tuple[float, float, float]:
    """One step under a :class:`PhaseMeter`: ``v.phases`` and ``v.peak_bytes`` (own static bytes +
    the step's highest phase peak above what was allocated before it). A compiled variant on CPU
    makes a plain step: the CPU meter counts storages through a dispatch mode, which cannot see
    inside compiled kernels (and changes how dynamo runs them)."""
    if v.recipe != v.name and device.type == "cpu":
        return train_step(v, batch, seed, device)
    # Drop the previous step's gradients first: inside the meter they would count as baseline.
    v.optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    if v.counter is not None:  # a peer's host copies are host memory, for the CPU meter (see ByteCounter)
        v.counter.mark = device.type == "cpu"
    try:
        with PhaseMeter(device, v.model) as meter:
            out = train_step(v, batch, seed, device, meter)
    finally:
        if v.counter is not None:
            v.counter.mark = False
    v.phases = meter.phases
    v.peak_bytes = max(p["peak"] for p in meter.phases.values())
    return out


def calls_step(v: VariantRun, batch, seed: int, device: torch.device) -> Tuple[float, float, float]:
    """One untimed forward + backward under :class:`counting_calls` (``v.calls``), the backward on
    this thread so that its hooks are counted on an accelerator too."""
    torch.manual_seed(seed)
    v.optimizer.zero_grad(set_to_none=True)
    with torch.autograd.set_multithreading_enabled(False), counting_calls() as calls:
        loss = v.model(*batch)
        loss.backward()
    v.calls = dict(calls)
    return float(loss.detach().item()), 0.0, 0.0


def _grads_equal(a: nn.Module, b: nn.Module) -> bool:
    pairs = list(zip(a.parameters(), b.parameters()))
    return all((p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))
               for p, q in pairs)


def run_variants(names: Sequence[str], cfg: Optional[GPTConfig] = None, *, batch: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, rounds: int, warmup: int, lr: float, seed: int,
                 metered: bool = True, count_calls: bool = False, trace_dir: Optional[str] = None,
                 profile_copies: bool = False, trace_gz: bool = False, base_model: Optional[nn.Module] = None,
                 batches: Optional[Callable[[int], Tuple[torch.Tensor, ...]]] = None,
                 recipes: Optional[Mapping[str, Recipe]] = None,
                 log: Callable[[str], None] = print) -> RunResult:
    """Build every variant from one base model and run them interleaved.

    Step order for every variant: ``warmup`` unmetered steps, one metered step (memory per phase;
    not when ``metered`` is false), one untimed step counting calls (``count_calls``), then
    ``rounds`` timed steps, one per variant per round, the order reversed every other round.
    Every variant sees the same batches in the same order, so the loss sequences must agree; on
    CPU the last step's gradients are compared with ``none``'s, bitwise. Optionally one more step
    per variant under ``torch.profiler`` (``trace_dir``: Chrome traces; ``profile_copies``:
    copy-engine figures from the device events).

    ``base_model``: the model to copy for every variant (moved to ``device`` / ``dtype`` in place;
    default a fresh ``GPT(cfg, seed)``). ``batches(i)``: step ``i``'s batch, a tuple the model is
    called with (default ``make_batch(cfg, batch, seed + i)``). ``recipes``: where the names are
    looked up (default ``RECIPES``; a script adds recipes of its own, e.g. memory plans)."""
    recipes = RECIPES if recipes is None else recipes
    from hyper_parallel.bench.trace import analyze_copies, write_trace

    base = (base_model if base_model is not None else GPT(cfg, seed=seed)).to(device=device, dtype=dtype)
    if batches is None:
        batches = lambda i: make_batch(cfg, batch, seed + i, device=device)  # noqa: E731
    variants: Dict[str, VariantRun] = {}
    skipped: Dict[str, str] = {}
    errors: Dict[str, str] = {}
    for name in names:
        try:
            variants[name] = build_variant(name, base, device, lr, recipes)
        except Exception as exc:  # e.g. torchtune absent, or its constructor failing here
            skipped[name] = str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"
            log(f"skipping {name}: {skipped[name]}")
    del base
    traced = bool(trace_dir or profile_copies)
    steps = [batches(i) for i in range(warmup + int(metered) + int(count_calls) + rounds + int(traced))]
    order = list(variants)

    def step(name: str, i: int, fn: Callable[..., Any] = train_step) -> Any:
        """``fn(variant, batch i, seed + i)``; ``None`` once the variant has failed: one broken
        variant must not sink the comparison."""
        if name in errors:
            return None
        v = variants[name]
        try:
            out = fn(v, steps[i], seed + i, device)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            log(f"variant {name} failed: {errors[name]}")
            return None
        v.losses.append(out[0])
        return out

    i = 0
    for fn, count in ((train_step, warmup), (metered_step, int(metered)), (calls_step, int(count_calls))):
        for _ in range(count):
            for name in order:
                step(name, i, fn)
            i += 1
    for rnd, name in interleaved(order, rounds):
        r = step(name, i + rnd)
        if r is not None:
            variants[name].times.append(r[1])
            variants[name].forward_times.append(r[2])
    i += rounds
    if traced:
        folder = trace_dir or tempfile.mkdtemp(prefix="hp_traces_")
        for name in order:
            v = variants[name]
            path = os.path.join(folder, f"{name}.json" + (".gz" if trace_gz and trace_dir else ""))
            if name in errors:
                continue
            try:
                write_trace(lambda: step(name, i), path, device=device)
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                log(f"variant {name} failed: {errors[name]}")
                continue
            v.trace_path = path if trace_dir else None
            if profile_copies and recipes[v.recipe].offloads and device.type != "cpu":
                try:
                    v.copy_engine = analyze_copies(path)
                except Exception as exc:
                    errors[name] = f"{type(exc).__name__}: {exc}"
            if not trace_dir:
                os.unlink(path)
    for name in errors:
        variants.pop(name, None)
    if device.type == "cpu" and "none" in variants:  # every variant's last step saw the same weights
        for v in variants.values():
            v.grads_equal_to_none = _grads_equal(v.model, variants["none"].model)
    return RunResult(variants, skipped, errors)


def summarize(v: VariantRun, recipes: Mapping[str, Recipe] = RECIPES) -> Dict[str, Any]:
    """The JSON row of one variant."""
    recipe = recipes[v.recipe]
    return {
        "who": recipe.who,
        "description": recipe.what,
        "peak_bytes": v.peak_bytes,
        "phases": v.phases,
        "static_bytes": v.static_bytes,
        "grad_bytes": grad_bytes(v.model),
        "peak_above_static_bytes": (v.peak_bytes - v.static_bytes) if v.peak_bytes is not None else None,
        "step_time_s": median(v.times),
        "step_times_s": v.times,
        "min_step_time_s": min(v.times) if v.times else None,
        "forward_time_s": median(v.forward_times),
        "backward_time_s": median([t - f for t, f in zip(v.times, v.forward_times)]),
        "bytes_moved_per_step": dict(v.moved),
        "load_launches_per_step": v.load_launches,
        "tensors_out_per_step": v.tensors_out,
        "calls": v.calls,
        "grads_equal_to_none": v.grads_equal_to_none,
        "losses": v.losses,
        "trace": v.trace_path,
        "copy_engine": v.copy_engine,
    }


# --------------------------------------------------------------------------- the machine

def probe_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 8) -> Dict[str, Any]:
    """Raw pinned host<->device copy bandwidth (GB/s, 1e9 B/s) of one big buffer, timed with
    device events on a side stream: the physical limit of this machine's link."""
    if device.type == "cpu":
        return {"skipped": "no accelerator: host and device are the same memory"}
    dm = torch.get_device_module(device.type)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = dm.Stream()
    out: Dict[str, Any] = {"bytes": nbytes, "reps": reps}
    for direction, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        with dm.stream(stream):
            for _ in range(2):
                dst.copy_(src, non_blocking=True)
            start, end = dm.Event(enable_timing=True), dm.Event(enable_timing=True)
            start.record(stream)
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        out[f"{direction}_gbps"] = nbytes * reps / seconds / 1e9
    del host, dev
    return out


@contextlib.contextmanager
def released_caches(device: torch.device):
    """After a block: drop the swap manager's layer chain and pooled host buffers, and the
    framework's cached device / pinned host memory, so the next sweep point starts clean."""
    try:
        yield
    finally:
        SwapManager().reset()
        gc.collect()
        if device.type != "cpu":
            synchronize(device)
            dm = torch.get_device_module(device.type)
            if hasattr(dm, "empty_cache"):
                dm.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)
            if host_empty is not None:
                host_empty()
