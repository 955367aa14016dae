"""The one benchmark harness: build a variant of a model, train it a step, meter it, time it.

Every benchmark trains through :func:`train_step`: ``python -m hyper_parallel.bench`` (one variant per process, through
``model.train_steps``) and every script of ``benchmarks/`` (:func:`run_variants`, variants side by side). A variant is
a recipe of ``bench.modes`` applied to a copy of a model, with the one optimizer: SGD without momentum, which keeps no
state (a variant holds parameters, gradients and activations, what recompute and swap change, and every variant's copy
fits in one process). A step seeds the RNG, times forward + backward (:func:`timed`), then steps the optimizer; a batch
is a tuple (positional arguments) or a dict (keyword arguments, as Hugging Face models take ``input_ids`` and
``labels``), the model returns the loss or an output with ``.loss``. Memory: one ``MemoryMeter`` split into forward,
backward and optimizer step by ``reset_peak``. Bytes moved: ours from ``SwapManager().stats()``, the peers' counted.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from hyper_parallel.bench.modes import RECIPES, ByteCounter, Recipe, apply_variant
from hyper_parallel.core.activation_checkpoint import SwapManager
from hyper_parallel.tools.clock import no_gc, step_clock
from hyper_parallel.tools.memory import MemoryMeter

#: The phases of a metered step, in order.
PHASES = ("forward", "backward", "optimizer")
#: A variant name ending in this is its recipe's model under ``torch.compile`` (compile_vs_eager.py).
COMPILED = "+compile"

Batch = Any  # a tuple of positional arguments, or a dict of keyword arguments


def synchronize(device: Any = None) -> None:
    """Wait for the work queued on ``device`` (a ``torch.device`` or its name); nothing on CPU or for ``None``."""
    if device is None or torch.device(device).type == "cpu":
        return
    torch.get_device_module(torch.device(device).type).synchronize()


@contextlib.contextmanager
def timed(device: Any) -> Iterator[Callable[[], float]]:
    """Time a region: yields ``elapsed()``, the seconds since it began on the step clock (``tools.clock``), the device
    synchronised first, the garbage collector paused inside (synchronise before the last reading). Example::

        >>> with timed("cpu") as elapsed:
        ...     elapsed() >= 0
        True
    """
    now = step_clock(device if device is not None else "cpu")
    synchronize(device)
    with no_gc():
        t0 = now()
        yield lambda: now() - t0


def interleaved(names: Sequence[str], rounds: int) -> Iterator[Tuple[int, str]]:
    """``(round, name)`` pairs: every name once per round, the order reversed every other round."""
    for rnd in range(int(rounds)):
        yield from ((rnd, name) for name in (names if rnd % 2 == 0 else list(names)[::-1]))


def median(times: Sequence[float]) -> Optional[float]:
    """The median of ``times``; ``None`` when there are none."""
    return statistics.median(times) if times else None


class counting_calls:
    """Count the calls the interpreter makes inside, on this thread: ``python`` functions and ``builtin`` (C) ones (not
    operators such as ``a + b``); a busy machine does not change them. A class, so that leaving adds exactly one call of
    each kind, taken off; a profiler installed before gets its hook back. Example::

        >>> with counting_calls() as calls:
        ...     _ = sorted([3, 1, 2])
        >>> calls
        {'python': 0, 'builtin': 1}
    """

    def __init__(self) -> None:
        self.counts = {"python": 0, "builtin": 0}
        self._previous: Any = None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.counts["python" if event == "call" else "builtin"] += 1

    def __enter__(self) -> Dict[str, int]:
        previous = sys.getprofile()
        if previous is not None and not callable(previous) and not callable(getattr(previous, "enable", None)):
            raise RuntimeError(f"counting_calls: a profiler of type {type(previous).__name__} is installed and "
                               "could not be given back its hook afterwards; stop it first.")
        self._previous = previous
        sys.setprofile(self._profile)
        return self.counts

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)
        self.counts["python"] -= 1   # this __exit__
        self.counts["builtin"] -= 1  # the sys.setprofile above
        if callable(self._previous):
            sys.setprofile(self._previous)
        elif self._previous is not None:  # a C-level profiler (cProfile's) installs its own hook again
            self._previous.enable()


def storage_bytes(tensors: Sequence[Any]) -> int:
    """Bytes of the distinct storages of the tensors among ``tensors``."""
    seen = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors
            if isinstance(t, torch.Tensor)}
    return sum(nbytes for _, nbytes in seen)


def module_bytes(model: nn.Module) -> int:
    """Bytes of the storages of ``model``'s parameters and buffers."""
    return storage_bytes(list(model.parameters()) + list(model.buffers()))


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients of all trainable parameters (what a full backward allocates)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def saved_bytes_per_layer(model: nn.Module, batch: Batch) -> List[int]:
    """Bytes of the distinct storages each layer of an unwrapped ``model`` saves for backward (parameters and buffers
    excluded), from one forward of ``batch``: one layer's activations."""
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
            forward_loss(model, batch)
    finally:
        for h in handles:
            h.remove()
    return [sum(d.values()) for d in per_layer]


def truncated_copy(model: nn.Module, layers: int) -> nn.Module:
    """A deep copy of a bench GPT keeping its first ``layers`` blocks (a deep GPT is slow to build: a layer sweep builds
    the deepest once and copies prefixes of it)."""
    full, cfg = model.layers, model.cfg
    model.layers = nn.ModuleList(list(full)[:layers])
    model.cfg = type(cfg)(**{**cfg.to_dict(), "layers": layers})
    try:
        return copy.deepcopy(model)
    finally:
        model.layers, model.cfg = full, cfg


@dataclass
class Variant:
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


def optimizer_for(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The benchmarks' optimizer: SGD without momentum (no state: see the module doc)."""
    return torch.optim.SGD(model.parameters(), lr=lr)


def build_variant(name: str, base: nn.Module, device: Any, lr: float,
                  recipes: Mapping[str, Recipe] = RECIPES) -> Variant:
    """Recipe ``name`` of ``recipes`` applied to a copy of ``base`` (already on ``device``), with its optimizer;
    ``<recipe>+compile``: then under ``torch.compile``. ``RuntimeError`` with the reason when the recipe cannot run
    here."""
    recipe = name[:-len(COMPILED)] if name.endswith(COMPILED) else name
    model = copy.deepcopy(base)
    counter = apply_variant(model, recipe, device=device, recipes=recipes)
    optimizer, static = optimizer_for(model, lr), module_bytes(model)
    if recipe != name:
        model = torch.compile(model)
    return Variant(name, recipe, model, optimizer, counter=counter, static_bytes=static,
                   uses_manager=recipes[recipe].offloads and recipes[recipe].who == "ours")


def forward_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``model(*batch)`` (a tuple) or ``model(**batch)`` (a dict), as a loss tensor (an output's ``.loss``, as Hugging
    Face models return it)."""
    out = model(**batch) if isinstance(batch, Mapping) else model(*batch)
    return out if isinstance(out, torch.Tensor) else out.loss


def _moved_so_far(v: Variant) -> Tuple[int, int, int]:
    if v.counter is not None:
        return v.counter.d2h, v.counter.h2d, v.counter.tensors
    if v.uses_manager:
        s = SwapManager().stats()
        return int(s["offloaded_bytes"]), int(s["loaded_bytes"]), int(s["load_launches"])
    return 0, 0, 0


def train_step(v: Variant, batch: Batch, seed: int, device: Any,
               meter: Optional[MemoryMeter] = None) -> Tuple[float, float, float]:
    """One training step of ``v``: ``(loss, forward + backward seconds, forward seconds)`` (the forward's read when it
    returns: on an accelerator, the host's time to issue it); the bytes it moved go to ``v.moved``, ``v.load_launches``
    / ``v.tensors_out``; with ``meter`` (entered by the caller) each phase's peak and end go to ``v.phases``."""
    device = torch.device(device)
    torch.manual_seed(seed)
    v.optimizer.zero_grad(set_to_none=True)
    before = _moved_so_far(v)
    base = meter.current_bytes if meter is not None else 0

    def phase(name: str) -> None:
        if meter is not None:
            synchronize(device)
            peak = meter.reset_peak()
            v.phases[name] = {"peak": v.static_bytes + max(0, peak - base),
                              "end": v.static_bytes + max(0, meter.current_bytes - base)}

    with timed(device) as elapsed:
        loss = forward_loss(v.model, batch)
        forward_s = elapsed()
        phase("forward")
        loss.backward()
        synchronize(device)
        seconds = elapsed()
    phase("backward")
    v.optimizer.step()
    phase("optimizer")
    value = float(loss.detach().item())
    del loss
    after = _moved_so_far(v)
    v.moved = {"d2h": after[0] - before[0], "h2d": after[1] - before[1]}
    if v.counter is not None:
        v.tensors_out = after[2] - before[2]
    elif v.uses_manager:
        v.load_launches = after[2] - before[2]
    return value, seconds, forward_s


def metered_step(v: Variant, batch: Batch, seed: int, device: Any) -> Tuple[float, float, float]:
    """One step under a ``MemoryMeter`` (``v.phases``; ``v.peak_bytes``, the highest phase peak). A compiled variant on
    CPU makes a plain step: the CPU meter's dispatch mode cannot see inside compiled kernels (and changes how dynamo
    runs them)."""
    device = torch.device(device)
    if v.recipe != v.name and device.type == "cpu":
        return train_step(v, batch, seed, device)
    v.optimizer.zero_grad(set_to_none=True)  # (gradients alive at entry would count as baseline)
    if v.counter is not None:  # a peer's host copies are host memory, for the CPU meter (see ByteCounter)
        v.counter.mark = device.type == "cpu"
    try:
        with MemoryMeter(device, track=[v.model], scan_gc=False) as meter:
            out = train_step(v, batch, seed, device, meter)
    finally:
        if v.counter is not None:
            v.counter.mark = False
    v.peak_bytes = max(p["peak"] for p in v.phases.values())
    return out


def calls_step(v: Variant, batch: Batch, seed: int, device: Any) -> Tuple[float, float, float]:
    """One untimed forward + backward (a tuple batch) under :class:`counting_calls` (``v.calls``), the backward on this
    thread so that its hooks are counted on an accelerator too."""
    torch.manual_seed(seed)
    v.optimizer.zero_grad(set_to_none=True)
    with torch.autograd.set_multithreading_enabled(False), counting_calls() as calls:  # (the model and backward only)
        loss = v.model(*batch)
        loss.backward()
    v.calls = dict(calls)
    return float(loss.detach().item()), 0.0, 0.0


@dataclass
class RunResult:
    variants: Dict[str, Variant]
    skipped: Dict[str, str]
    errors: Dict[str, str]


def run_variants(names: Sequence[str], cfg: Any = None, *, batch: int = 0, device: Any, rounds: int, warmup: int,
                 lr: float, seed: int, dtype: torch.dtype = torch.float32, metered: bool = True,
                 count_calls: bool = False, trace_dir: Optional[str] = None, profile_copies: bool = False,
                 trace_gz: bool = False, base_model: Optional[nn.Module] = None,
                 batches: Optional[Callable[[int], Batch]] = None, recipes: Optional[Mapping[str, Recipe]] = None,
                 log: Callable[[str], None] = print) -> RunResult:
    """Build every variant (of ``recipes``) from one base model and run them side by side: per variant ``warmup`` steps,
    one metered step (``metered``), one step counting calls (``count_calls``), ``rounds`` timed steps interleaved, then
    optionally one under ``torch.profiler`` (``trace_dir``: Chrome traces; ``profile_copies``: copy-engine figures).
    Every variant sees the same batches; on CPU the last gradients are compared with ``none``'s. A variant that cannot
    be built is skipped, one that fails dropped, each with its reason. ``base_model`` (moved to ``device`` / ``dtype``;
    default ``GPT(cfg, seed)``), ``batches(i)``: step ``i``'s batch (default ``make_batch(cfg, batch, seed + i)``)."""
    from hyper_parallel.bench.trace import analyze_copies, write_trace

    recipes = RECIPES if recipes is None else recipes
    device = torch.device(device)
    if base_model is None or batches is None:
        from hyper_parallel.bench.model import GPT, make_batch

        base_model = GPT(cfg, seed=seed) if base_model is None else base_model
        batches = batches or (lambda i: make_batch(cfg, batch, seed + i, device=device))
    base = base_model.to(device=device, dtype=dtype)
    variants: Dict[str, Variant] = {}
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

    def step(name: str, i: int, fn: Callable[..., Any] = train_step) -> Any:
        # ``None`` once the variant has failed: one broken variant must not sink the comparison
        if name in errors:
            return None
        try:
            out = fn(variants[name], steps[i], seed + i, device)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            log(f"variant {name} failed: {errors[name]}")
            return None
        variants[name].losses.append(out[0])
        return out

    i = 0
    for fn, count in ((train_step, warmup), (metered_step, int(metered)), (calls_step, int(count_calls))):
        for _ in range(count):
            for name in list(variants):
                step(name, i, fn)
            i += 1
    for rnd, name in interleaved(list(variants), rounds):
        r = step(name, i + rnd)
        if r is not None:
            variants[name].times.append(r[1])
            variants[name].forward_times.append(r[2])
    i += rounds
    if traced:
        folder = trace_dir or tempfile.mkdtemp(prefix="hp_traces_")
        for name, v in variants.items():
            path = os.path.join(folder, f"{name}.json" + (".gz" if trace_gz and trace_dir else ""))
            try:
                if name not in errors:
                    write_trace(lambda: step(name, i), path, device=device)
                    if profile_copies and recipes[v.recipe].offloads and device.type != "cpu":
                        v.copy_engine = analyze_copies(path)
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                log(f"variant {name} failed: {errors[name]}")
            v.trace_path = path if trace_dir and name not in errors else None
            if not trace_dir and os.path.exists(path):
                os.unlink(path)
    for name in errors:
        variants.pop(name, None)
    if device.type == "cpu" and "none" in variants:  # every variant's last step saw the same weights
        plain = list(variants["none"].model.parameters())
        for v in variants.values():
            v.grads_equal_to_none = all((p.grad is None) == (q.grad is None) and
                                        (p.grad is None or torch.equal(p.grad, q.grad))
                                        for p, q in zip(v.model.parameters(), plain))
    return RunResult(variants, skipped, errors)


def summarize(v: Variant, recipes: Mapping[str, Recipe] = RECIPES) -> Dict[str, Any]:
    """The JSON row of one variant."""
    return {
        "who": recipes[v.recipe].who, "description": recipes[v.recipe].what, "peak_bytes": v.peak_bytes,
        "phases": v.phases, "static_bytes": v.static_bytes, "grad_bytes": grad_bytes(v.model),
        "peak_above_static_bytes": None if v.peak_bytes is None else v.peak_bytes - v.static_bytes,
        "step_time_s": median(v.times), "step_times_s": v.times, "min_step_time_s": min(v.times, default=None),
        "forward_time_s": median(v.forward_times),
        "backward_time_s": median([t - f for t, f in zip(v.times, v.forward_times)]),
        "bytes_moved_per_step": dict(v.moved), "load_launches_per_step": v.load_launches,
        "tensors_out_per_step": v.tensors_out, "calls": v.calls, "grads_equal_to_none": v.grads_equal_to_none,
        "losses": v.losses, "trace": v.trace_path, "copy_engine": v.copy_engine,
    }


def probe_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 8) -> Dict[str, Any]:
    """Pinned host<->device copy bandwidth (GB/s) of one big buffer, timed with device events on a side stream: the
    physical limit of this machine's link."""
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
        out[f"{direction}_gbps"] = nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9
    return out


@contextlib.contextmanager
def released_caches(device: torch.device) -> Iterator[None]:
    """After a block: drop the swap manager's chain and host pool and the framework's cached device and pinned memory,
    so that the next sweep point starts clean."""
    try:
        yield
    finally:
        SwapManager().reset()
        gc.collect()
        if device.type != "cpu":
            synchronize(device)
            torch.get_device_module(device.type).empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()  # (pinned host memory)
