"""Timing for every benchmark: one device synchronisation and one interleaved-median timer.

* :func:`synchronize` waits for the device's queued work (nothing to wait for on CPU);
* :func:`timed` runs a callable between two synchronisations and returns its wall time;
* :func:`interleaved` is the order of an interleaved measurement: one step of every variant per
  round, the order reversed every other round, so that machine noise (and a position bias) hits
  all variants alike; :func:`median` reads the times.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import torch

__all__ = ["synchronize", "timed", "interleaved", "median"]


def synchronize(device: Any = None) -> None:
    """Wait for the work queued on ``device`` (a ``torch.device`` or its name); no-op on CPU or
    for ``None``."""
    if device is None:
        return
    dev = torch.device(device)
    if dev.type == "cpu":
        return
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available() and acc.current_accelerator().type == dev.type:
        acc.synchronize()
        return
    sync = getattr(getattr(torch, dev.type, None), "synchronize", None)
    if sync is not None:
        sync()


def timed(fn: Callable[[], Any], device: Any = None) -> Tuple[Any, float]:
    """``(fn(), seconds)``, the device synchronised before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def interleaved(names: Sequence[str], rounds: int) -> Iterator[Tuple[int, str]]:
    """``(round, name)`` pairs: every name once per round, the order reversed every other round."""
    names = list(names)
    for rnd in range(int(rounds)):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            yield rnd, name


def median(times: Sequence[float]) -> Optional[float]:
    """The median of ``times``; ``None`` when there are none."""
    return statistics.median(times) if times else None
