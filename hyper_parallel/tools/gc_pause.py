"""The cyclic garbage collector, for every framework: paused around a timed block, and asked once
for the live objects of some classes.

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
import itertools
from typing import Any, Dict, Iterator, List

__all__ = ["no_gc", "live_objects"]


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


def live_objects(*classes: type) -> List[List[Any]]:
    """Per class of ``classes``, every object the collector tracks that is an instance of it (an
    object goes to the first class it matches), in one pass over ``gc.get_objects()``. Each type is
    matched once (a large program holds a million objects of a few thousand types), with
    ``issubclass`` on the type: ``isinstance`` may evaluate a ``__class__`` property, and some warn.

    Example::

        >>> class Box: pass
        >>> kept = [Box(), Box()]
        >>> boxes, = live_objects(Box)
        >>> all(b in boxes for b in kept)
        True
    """
    objs = gc.get_objects()
    try:
        # (the loops run in C: map, set, compress; Python only sees each distinct type once)
        types = list(map(type, objs))
        where: Dict[type, int] = {tp: next((i for i, c in enumerate(classes) if issubclass(tp, c)), -1)
                                  for tp in set(types)}
        kinds = list(map(where.__getitem__, types))
        found: List[List[Any]] = [[] for _ in classes]
        for obj, k in itertools.compress(zip(objs, kinds), map((-1).__ne__, kinds)):
            found[k].append(obj)
        return found
    finally:
        del objs  # (the list pins every object in the process)
