"""What a step (or a probe run) changes, put back afterwards: :class:`StepState`, once for every
framework's prober.

Profiling calls the user's step twice and every probe runs copies of a layer; none of it may
change the program: every tensor that existed before the run and that it writes in place
(BatchNorm statistics, a gradient accumulator, a tensor outside the layer that a hook writes) is
copied to the host before the first write, once per storage, and copied back afterwards, and the
random number generators are put back (the backend's ``rng_state(None)``: every generator).
A framework's prober says how to copy tensors (the abstract methods); this module imports no
framework.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, Iterable, List, Optional, Tuple

from hyper_parallel.core.backend import Backend

__all__ = ["StepState"]


class StepState(abc.ABC):
    """The host copies of the tensors a run writes (``written``: storage -> (tensor, host copy))
    and the generators' state, put back by :meth:`restore`."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.written: Dict[Any, Tuple[Any, Any]] = {}
        self._rng: Any = None
        self._objects: List[Tuple[Any, Any]] = []  # (object, snapshot of its attributes)

    # -- what a framework implements
    @abc.abstractmethod
    def _storage_of(self, t: Any) -> Optional[Any]:
        """The identity of ``t``'s storage (``None``: no memory to keep)."""

    @abc.abstractmethod
    def _host_copy(self, t: Any) -> Any:
        """A copy of ``t``'s values on the host (never counted as device memory)."""

    @abc.abstractmethod
    def _write_back(self, written: Iterable[Tuple[Any, Any]]) -> None:
        """Copy every ``(tensor, host copy)`` back into its tensor, unseen by autograd."""

    # -- the algorithm
    def keep(self, t: Any) -> None:
        """Copy ``t`` to the host before the run writes it (once per storage)."""
        key = self._storage_of(t)
        if key is not None and key not in self.written:
            self.written[key] = (t, self._host_copy(t))

    def save_rng(self) -> None:
        self._rng = self._backend.rng_state(None)

    def keep_object(self, obj: Any) -> None:
        """Put ``obj``'s attributes back after the run as they are now: an optimizer's state (its
        per-parameter entries, created lazily by its first step, and their step counters), a
        learning-rate scheduler's counters, a gradient scaler's scale. Containers (dicts, lists)
        get their contents back in place; tensors are the same objects again (their values, where
        the run wrote them in place, come back through :meth:`keep`)."""
        self._objects.append((obj, _snapshot(vars(obj))))

    def fresh_snapshot(self) -> "StepState":
        """A state that snapshots the same tensors and objects now, for another call of the step."""
        other = type(self)(self._backend)
        for t, _ in self.written.values():
            other.keep(t)
        for obj, _ in self._objects:
            other.keep_object(obj)
        return other

    def restore(self) -> None:
        self._write_back(self.written.values())
        for _, snapshot in self._objects:
            _put_back(snapshot)
        if self._rng is not None:
            self._backend.set_rng_state(self._rng)


def _snapshot(value: Any) -> Tuple[Any, ...]:
    """``value`` and, for a dict or a list, what it holds now (recursively)."""
    if isinstance(value, dict):
        return ("dict", value, [(k, _snapshot(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", value, [_snapshot(v) for v in value])
    return ("value", value)


def _put_back(snapshot: Tuple[Any, ...]) -> Any:
    """The object of ``snapshot`` with the contents it had then, in place."""
    kind, value = snapshot[0], snapshot[1]
    if kind == "dict":
        items = [(k, _put_back(v)) for k, v in snapshot[2]]
        value.clear()
        value.update(items)
    elif kind == "list":
        value[:] = [_put_back(v) for v in snapshot[2]]
    return value
