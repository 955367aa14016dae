"""Variants side by side in one process, interleaved: the runner of ``benchmarks/compare_peers.py``
and ``benchmarks/recompute_vs_torch.py``.

Every variant (a recipe of :mod:`hyper_parallel.bench.modes`) gets its own copy of the same initial
model and its own SGD optimizer, and the rounds are interleaved (:func:`~hyper_parallel.bench.timing.interleaved`),
so machine noise hits all variants alike.

How memory is counted (see docs/benchmarks.md, "What the memory column means"):

* on an accelerator, the caching allocator's counters: the peak of allocated device bytes during
  one training step, minus what was allocated before it, plus the variant's own parameters and
  buffers (other variants' models live in the same process and are not counted);
* on CPU, ``MemoryMeter`` counts live CPU storages. Host copies are CPU storages too, so to make
  the CPU numbers a model of what a device would hold, every offloading variant's host copies are
  counted as host memory (ours via ``mark_host`` in the library; ``save_on_cpu``'s through the
  recipe's byte counter, which also makes the copy that ``tensor.cpu()`` skips on a CPU tensor)
  and every reload as a new device allocation. Timings on CPU say nothing about copy engines.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
from hyper_parallel.bench.modes import RECIPES, ByteCounter, apply_variant
from hyper_parallel.bench.timing import interleaved, median, synchronize, timed
from hyper_parallel.core.activation_checkpoint import SwapManager
from hyper_parallel.tools.memory import MemoryMeter

__all__ = ["VariantRun", "RunResult", "build_variant", "run_variants", "summarize", "truncated_copy",
           "probe_bandwidth", "released_caches"]


@dataclass
class VariantRun:
    """One variant's model, optimizer and what was measured on it."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    counter: Optional[ByteCounter] = None  # peers that move bytes
    uses_manager: bool = False             # ours that move bytes (counted by SwapManager.stats())
    static_bytes: int = 0
    losses: List[float] = field(default_factory=list)
    times: List[float] = field(default_factory=list)
    peak_bytes: Optional[int] = None
    moved: Dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    trace_path: Optional[str] = None
    copy_engine: Optional[Dict[str, Any]] = None


@dataclass
class RunResult:
    variants: Dict[str, VariantRun]
    skipped: Dict[str, str]
    errors: Dict[str, str]


def _bytes(tensors, per_storage) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage()._cdata
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


def build_variant(name: str, base: nn.Module, device: torch.device, lr: float) -> VariantRun:
    """A fresh copy of ``base`` (already on ``device``) set up as recipe ``name``.

    Raises ``RuntimeError`` with the reason when the variant cannot run here."""
    model = copy.deepcopy(base)
    counter = apply_variant(model, name, device=device)
    recipe = RECIPES[name]
    # SGD without momentum keeps no optimizer state: the memory column is params + grads +
    # activations, and the models of all variants fit side by side in one process.
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return VariantRun(name, model, opt, counter=counter, uses_manager=recipe.offloads and recipe.who == "ours",
                      static_bytes=module_bytes(model))


def _manager_bytes() -> Tuple[int, int]:
    s = SwapManager().stats()
    return int(s["offloaded_bytes"]), int(s["loaded_bytes"])


def train_step(v: VariantRun, batch: Tuple[torch.Tensor, torch.Tensor], seed: int,
               device: torch.device) -> Tuple[float, float, Dict[str, int]]:
    """One SGD step of variant ``v``: ``(loss, forward+backward seconds, bytes moved)``.

    The global RNG is seeded from ``seed`` first, so dropout is the same in every variant. The
    timed region is forward + backward (what the variants change); the optimizer step follows."""
    tokens, targets = batch
    torch.manual_seed(seed)
    v.optimizer.zero_grad(set_to_none=True)
    before_c = (v.counter.d2h, v.counter.h2d) if v.counter is not None else (0, 0)
    before_m = _manager_bytes() if v.uses_manager else (0, 0)

    def fwd_bwd():
        loss = v.model(tokens, targets)
        loss.backward()
        return loss

    loss, dt = timed(fwd_bwd, device)
    v.optimizer.step()
    value = float(loss.detach().item())
    del loss
    moved = {"d2h": 0, "h2d": 0}
    if v.counter is not None:
        moved = {"d2h": v.counter.d2h - before_c[0], "h2d": v.counter.h2d - before_c[1]}
    elif v.uses_manager:
        after = _manager_bytes()
        moved = {"d2h": after[0] - before_m[0], "h2d": after[1] - before_m[1]}
    return value, dt, moved


def metered_step(v: VariantRun, batch, seed: int, device: torch.device) -> Tuple[float, int, Dict[str, int]]:
    """One step under ``MemoryMeter``: ``(loss, peak bytes, bytes moved)``; peak = own static bytes +
    the step's peak above what was allocated before it."""
    # Drop the previous step's gradients first: inside the meter they would count as baseline.
    v.optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    with MemoryMeter(device, track=[v.model], scan_gc=False) as meter:
        loss, _, moved = train_step(v, batch, seed, device)
    return loss, v.static_bytes + max(0, meter.peak_above_baseline), moved


def run_variants(names: Sequence[str], cfg: GPTConfig, *, batch: int, device: torch.device,
                 dtype: torch.dtype, rounds: int, warmup: int, lr: float, seed: int, metered: bool = True,
                 trace_dir: Optional[str] = None, profile_copies: bool = False, trace_gz: bool = False,
                 base_model: Optional[nn.Module] = None, log: Callable[[str], None] = print) -> RunResult:
    """Build every variant from one base model and run them interleaved.

    Step order for every variant: ``warmup`` unmetered steps, one metered step (peak memory; not
    when ``metered`` is false), then ``rounds`` timed steps, one per variant per round, the order
    reversed every other round. Every variant sees the same batches in the same order, so the loss
    sequences must agree. Optionally one more step per variant under ``torch.profiler``
    (``trace_dir``: Chrome traces; ``profile_copies``: copy-engine figures from the device events).

    ``base_model``: the model to copy for every variant (moved to ``device`` / ``dtype`` in place;
    default a fresh ``GPT(cfg, seed)``); ``cfg`` then only shapes the batches."""
    from hyper_parallel.bench.trace import analyze_copies, write_trace

    base = (base_model if base_model is not None else GPT(cfg, seed=seed)).to(device=device, dtype=dtype)
    variants: Dict[str, VariantRun] = {}
    skipped: Dict[str, str] = {}
    errors: Dict[str, str] = {}
    for name in names:
        try:
            variants[name] = build_variant(name, base, device, lr)
        except Exception as exc:  # e.g. torchtune absent, or its constructor failing here
            skipped[name] = str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"
            log(f"skipping {name}: {skipped[name]}")
    del base
    traced = bool(trace_dir or profile_copies)
    total_steps = warmup + int(metered) + rounds + int(traced)
    batches = [make_batch(cfg, batch, seed + i, device=device) for i in range(total_steps)]
    order = list(variants)

    def step(name: str, i: int, fn: Callable[..., Any] = train_step) -> Any:
        """``fn(variant, batch i, seed + i)``; ``None`` once the variant has failed: one broken
        variant must not sink the comparison."""
        if name in errors:
            return None
        v = variants[name]
        try:
            out = fn(v, batches[i], seed + i, device)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            log(f"variant {name} failed: {errors[name]}")
            return None
        v.losses.append(out[0])
        return out

    for i in range(warmup):
        for name in order:
            step(name, i)
    i = warmup
    if metered:
        for name in order:
            r = step(name, i, metered_step)
            if r is not None:
                variants[name].peak_bytes, variants[name].moved = r[1], r[2]
        i += 1
    for rnd, name in interleaved(order, rounds):
        r = step(name, i + rnd)
        if r is not None:
            variants[name].times.append(r[1])
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
            if profile_copies and RECIPES[name].offloads and device.type != "cpu":
                try:
                    v.copy_engine = analyze_copies(path)
                except Exception as exc:
                    errors[name] = f"{type(exc).__name__}: {exc}"
            if not trace_dir:
                os.unlink(path)
    for name in errors:
        variants.pop(name, None)
    return RunResult(variants, skipped, errors)


def summarize(v: VariantRun) -> Dict[str, Any]:
    """The JSON row of one variant."""
    recipe = RECIPES[v.name]
    return {
        "who": recipe.who,
        "description": recipe.what,
        "peak_bytes": v.peak_bytes,
        "static_bytes": v.static_bytes,
        "grad_bytes": grad_bytes(v.model),
        "peak_above_static_bytes": (v.peak_bytes - v.static_bytes) if v.peak_bytes is not None else None,
        "step_time_s": median(v.times),
        "step_times_s": v.times,
        "bytes_moved_per_step": dict(v.moved),
        "losses": v.losses,
        "trace": v.trace_path,
        "copy_engine": v.copy_engine,
    }


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
