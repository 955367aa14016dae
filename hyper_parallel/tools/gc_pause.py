"""The cyclic garbage collector paused around a timed block, for every framework.

A full collection of Python's cyclic garbage collector costs a large program (a framework with
its compiler imported) hundreds of milliseconds, and would land in whichever timed run happened
to allocate past its threshold. This module imports no framework, so that the planner's neutral
part and the MindSpore prober use it without importing torch (:mod:`hyper_parallel.tools.clock`,
PyTorch's clock, re-exports it).

Example::

    >>> import gc
    >>> from hyper_parallel.tools.gc_pause import no_gc
    >>> with no_gc():
    ...     gc.isenabled()
    False
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["no_gc"]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused in the block (as ``timeit`` does); it runs again after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
