"""Profiler traces of a training step, and what they say about the copy engine.

:func:`write_trace` writes a Chrome trace of one step (``chrome://tracing``, https://ui.perfetto.dev), where the swap
engine's launches and waits are named ranges (``hyper_parallel.launch_offload[<group>]``, ``wait_offload``,
``launch_load``, ``wait_load``); :func:`range_names` lists them; :func:`analyze_copies` reads a trace's device events:
bytes and busy time of host<->device copies per direction (the achieved bandwidth) and the share of copy time hidden
under compute kernels. Example::

    >>> path = write_trace(lambda: model(tokens, targets).backward(), "traces/swap.json")  # doctest: +SKIP
    >>> sorted(range_names(path))[:1]  # doctest: +SKIP
    ['hyper_parallel.launch_load[layer_0]']
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from hyper_parallel.bench.harness import synchronize

#: Every named range the swap engine emits starts with this.
RANGE_PREFIX = "hyper_parallel."

# Chrome-trace categories of device activity, as torch.profiler (Kineto) writes them.
_KERNEL_CATS = ("kernel",)
_MEMCPY_CATS = ("gpu_memcpy",)


def _accelerator() -> Optional[torch.device]:
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


def profiler_activities(device: Any = None) -> List[Any]:
    """``[CPU]`` plus, for an accelerator (default: the current one), the activities this torch build can profile."""
    from torch.profiler import ProfilerActivity

    dev = torch.device(device) if device is not None else _accelerator()
    if dev is None or dev.type == "cpu":
        return [ProfilerActivity.CPU]
    return [ProfilerActivity.CPU] + [a for a in torch.profiler.supported_activities() if a != ProfilerActivity.CPU]


def write_trace(model_step_fn: Callable[[], Any], path: Union[str, os.PathLike], *, warmup: int = 0,
                device: Any = None) -> str:
    """Run ``model_step_fn()`` (one training step) once under ``torch.profiler``, in a ``hyper_parallel.step`` range and
    synchronised, and write a Chrome trace to ``path`` (``.json``, or gzipped ``.json.gz``; its folder is created);
    return ``str(path)``. ``warmup``: unprofiled calls first (a swap mode's first step allocates its pooled host
    buffers). ``device``: profiled too (default: the current accelerator, else CPU)."""
    dev = torch.device(device) if device is not None else _accelerator()
    for _ in range(int(warmup)):
        model_step_fn()
    synchronize(dev)
    with torch.profiler.profile(activities=profiler_activities(dev)) as prof:
        with torch.profiler.record_function(RANGE_PREFIX + "step"):
            model_step_fn()
        synchronize(dev)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    prof.export_chrome_trace(os.fspath(path))
    return os.fspath(path)


def trace_events(trace: Any) -> List[Dict[str, Any]]:
    """The event dicts of a Chrome trace given as a path (``.json`` or ``.json.gz``), a loaded dict or a list of events.
    """
    if isinstance(trace, (str, os.PathLike)):
        opener = gzip.open if os.fspath(trace).endswith(".gz") else open
        with opener(trace, "rt") as f:
            trace = json.load(f)
    if isinstance(trace, dict):
        trace = trace.get("traceEvents", [])
    return [e for e in trace if isinstance(e, dict)]


def range_names(trace: Any, prefix: str = RANGE_PREFIX) -> List[str]:
    """Distinct names starting with ``prefix`` in a trace: a Chrome-trace path / dict / event list, or a finished
    ``torch.profiler.profile`` object."""
    if hasattr(trace, "events") and callable(trace.events):
        names: Iterable[str] = (e.name for e in trace.events())
    else:
        names = (str(e.get("name", "")) for e in trace_events(trace))
    return sorted({n for n in names if n.startswith(prefix)})


def _direction(event: Dict[str, Any]) -> Optional[str]:
    name = str(event.get("name", ""))
    if "DtoH" in name or "Device -> Pinned" in name or "Device -> Pageable" in name:
        return "d2h"
    if "HtoD" in name or "Pinned -> Device" in name or "Pageable -> Device" in name:
        return "h2d"
    return None


def _merge(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _covered(start: float, end: float, merged: List[Tuple[float, float]], starts: List[float]) -> float:
    """Length of ``[start, end)`` covered by the disjoint sorted ``merged`` intervals."""
    total = 0.0
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(merged) and merged[i][0] < end:
        s, e = merged[i]
        lo, hi = max(s, start), min(e, end)
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def analyze_copies(trace: Any, *, pinned_only: bool = True, min_bytes: int = 0) -> Dict[str, Any]:
    """Host<->device copy figures of a Chrome trace's device events, per direction (``d2h``, ``h2d``, ``total``):
    ``count``, ``bytes``, ``busy_s`` (the union of the copies' intervals), ``gbps`` (1e9 B/s; ``None`` without byte
    counts), ``hidden_s`` (copy time while a kernel ran), ``overlap_fraction``; and ``kernel_busy_s``. Copies of at
    least ``min_bytes``, only pinned ones with ``pinned_only`` where the trace names the memory kind (``loss.item()``
    copies to pageable memory)."""
    events = [e for e in trace_events(trace) if e.get("ph", "X") == "X" and "dur" in e]
    kernels = _merge([(float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                      for e in events if e.get("cat") in _KERNEL_CATS])
    starts = [s for s, _ in kernels]
    copies: Dict[str, List[Dict[str, Any]]] = {"d2h": [], "h2d": []}
    memcpys = [e for e in events if e.get("cat") in _MEMCPY_CATS and _direction(e) is not None]
    names_pinned = any("Pinned" in str(e.get("name", "")) for e in memcpys)
    for e in memcpys:
        nbytes = (e.get("args") or {}).get("bytes")
        if not (pinned_only and names_pinned and "Pinned" not in str(e.get("name", ""))) and \
                (nbytes is None or int(nbytes) >= min_bytes):
            copies[_direction(e)].append(e)

    def summary(evs: List[Dict[str, Any]]) -> Dict[str, Any]:
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs]
        merged = _merge(spans)
        busy_us = sum(e - s for s, e in merged)
        hidden_us = sum(_covered(s, e, kernels, starts) for s, e in merged)
        byte_counts = [(e.get("args") or {}).get("bytes") for e in evs]
        known = all(b is not None for b in byte_counts)
        nbytes = int(sum(int(b) for b in byte_counts if b is not None))
        return {"count": len(evs), "bytes": nbytes if known else None, "busy_s": busy_us * 1e-6,
                "gbps": (nbytes / (busy_us * 1e-6) / 1e9) if known and busy_us > 0 else None,
                "hidden_s": hidden_us * 1e-6, "overlap_fraction": (hidden_us / busy_us) if busy_us > 0 else None}

    out: Dict[str, Any] = {d: summary(evs) for d, evs in copies.items()}
    out["total"] = summary(copies["d2h"] + copies["h2d"])
    out["kernel_busy_s"] = sum(e - s for s, e in kernels) * 1e-6
    return out
