"""The clock steps are timed with, for the benchmarks and the memory planner alike.

On a CPU computing on one intra-op thread it is the process's CPU time: what other processes on
a shared machine do to the wall clock does not count, and a step's work (its kernels, the copies
of a swap, which are memory copies there) is all CPU time. Everywhere else (an accelerator, whose
work runs beside the host; a CPU computing on several threads) it is the wall clock.

What is timed runs under :func:`no_gc` (re-exported from :mod:`hyper_parallel.tools.gc_pause`,
which imports no framework): a full collection of Python's cyclic garbage collector costs a large
program (torch with its compiler imported) hundreds of milliseconds, and would land in whichever
step happened to allocate past its threshold.

Example::

    >>> import torch
    >>> from hyper_parallel.tools.clock import step_clock
    >>> now = step_clock(torch.device("cpu"))
    >>> t0 = now(); _ = torch.randn(256, 256) @ torch.randn(256, 256); now() >= t0
    True
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .gc_pause import no_gc

__all__ = ["step_clock", "no_gc"]


def step_clock(device: Any) -> Callable[[], float]:
    """``time.process_time`` on a CPU running one intra-op thread, else ``time.perf_counter``."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter

