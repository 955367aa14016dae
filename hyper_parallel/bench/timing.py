"""Timing for every benchmark: one device synchronisation and one interleaved-median timer.

* :func:`synchronize` waits for the device's queued work (nothing to wait for on CPU);
* :func:`timed` runs a callable between two synchronisations and returns its time, on the clock of
  :func:`hyper_parallel.tools.clock.step_clock` (the process's CPU time on a one-thread CPU, else
  the wall clock);
* :func:`interleaved` is the order of an interleaved measurement: one step of every variant per
  round, the order reversed every other round, so that machine noise (and a position bias) hits
  all variants alike; :func:`median` reads the times;
* :class:`counting_calls` counts the calls the interpreter makes instead: a measure of a variant's
  Python work that, unlike a time, a busy machine does not blur.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from hyper_parallel.tools.clock import no_gc, step_clock

__all__ = ["synchronize", "timed", "interleaved", "median", "counting_calls"]


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
    now = step_clock(device if device is not None else "cpu")
    synchronize(device)
    with no_gc():
        t0 = now()
        out = fn()
        synchronize(device)
        return out, now() - t0


def interleaved(names: Sequence[str], rounds: int) -> Iterator[Tuple[int, str]]:
    """``(round, name)`` pairs: every name once per round, the order reversed every other round."""
    names = list(names)
    for rnd in range(int(rounds)):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            yield rnd, name


def median(times: Sequence[float]) -> Optional[float]:
    """The median of ``times``; ``None`` when there are none."""
    return statistics.median(times) if times else None


class counting_calls:
    """Count the calls the interpreter makes while inside, on this thread (``sys.setprofile``):
    ``python`` = calls of Python functions, ``builtin`` = calls of functions implemented in C
    (builtins, and the framework's named functions and methods called from Python, e.g.
    ``torch.empty`` or ``t.detach()``; operators such as ``a + b`` or ``a[0]`` go through C slots
    and are not reported). Unlike a time, the count does not depend on how busy the machine is: it
    measures the interpreter work a variant adds, step for step. Hooks that autograd calls from
    another thread (an accelerator's backward) are not seen: run the backward with
    ``torch.autograd.set_multithreading_enabled(False)`` (CPU backward runs on the calling thread
    anyway). A class rather than a generator context manager, so that leaving adds exactly one
    call of each kind, which is taken off. A profiler that was installed before (a Python function,
    or cProfile) is given back its hook on leaving.

    Example::

        >>> with counting_calls() as calls:
        ...     _ = sorted([3, 1, 2])
        >>> calls
        {'python': 0, 'builtin': 1}
    """

    def __init__(self) -> None:
        self.counts = {"python": 0, "builtin": 0}
        self._previous: Any = None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.counts["python"] += 1
        elif event == "c_call":
            self.counts["builtin"] += 1

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
        previous = self._previous
        if callable(previous):
            sys.setprofile(previous)
        elif previous is not None:  # a C-level profiler (cProfile's): it installs its own hook again
            previous.enable()
