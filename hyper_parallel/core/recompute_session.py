"""One recomputation shared by the halves of a split backward (framework-neutral).

Zero-bubble pipeline schedules run a stage's backward in two halves through the same graph:
first the input gradients (``stage_backward_input``, with ``retain_graph=True``), later the
weight gradients (``stage_backward_weight``). A non-reentrant checkpoint recomputes a region
once per backward *call* that reaches it, and hands each recomputed tensor to backward only once,
so without help the second half recomputes every region again (once per parameter group in
PyTorch), and a selective region, whose kept op outputs the first recomputation consumed, cannot
be recomputed a second time at all.

A :class:`RecomputeSession` spans the halves of one split backward. Every tensor a checkpoint
region saves is packed into a box (:class:`SessionBoxes`, installed by the backend inside the
framework's checkpoint hooks). Outside any session a box is transparent: unpacking it unpacks
what the framework packed, with exactly the framework's memory behaviour. Inside a session, the
first unpack of any box of a region unpacks *all* of that region's boxes at once (one
recomputation, triggered by the first) and the session keeps the values: both halves take them
from there. During the last half (:meth:`RecomputeSession.last_half`) a value is released as
soon as backward has it, and closing the session (at the end of the last half) releases
whatever no node asked for.

Memory: between the halves the session holds the recomputed saved tensors of the regions the
first half reached, i.e. what the stage would hold for that micro-batch without checkpointing;
from the last half on it is the ordinary behaviour again. The session is current process-wide
(not per thread: an autograd engine may run the unpack hooks on its own device threads), so one
split backward runs at a time per process, as pipeline schedules do.

Example (what the pipeline adapters do for each micro-batch)::

    >>> import torch
    >>> from hyper_parallel.core.activation_checkpoint import RecomputeSession, checkpoint_wrapper
    >>> block = checkpoint_wrapper(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(),
    ...                                                torch.nn.Linear(8, 8)))
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> y = block(x)
    >>> session = RecomputeSession()
    >>> with session:                                    # first half: input gradients
    ...     (gx,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    >>> with session.last_half():                        # second half: weight gradients
    ...     gw = torch.autograd.grad(y.sum(), list(block.parameters()))
    >>> session.closed, session.kept
    (True, 0)
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional

__all__ = ["RecomputeSession", "SessionBoxes", "current_session"]

_current: Optional["RecomputeSession"] = None


def current_session() -> Optional["RecomputeSession"]:
    """The session whose backward half is running now (process-wide), or ``None``."""
    return _current


class _Box:
    """What a region's saved tensor is packed into: the framework's own packed value, and the
    region (its :class:`SessionBoxes`) it belongs to."""

    __slots__ = ("inner", "owner", "__weakref__")

    def __init__(self, inner: Any, owner: "SessionBoxes") -> None:
        self.inner = inner
        self.owner = owner


class SessionBoxes:
    """The boxes of one checkpoint call. The backend calls :meth:`pack` / :meth:`unpack` from
    saved-tensor hooks pushed inside the framework's checkpoint hooks, passing the framework's
    own pack / unpack functions."""

    __slots__ = ("_boxes", "__weakref__")

    def __init__(self) -> None:
        self._boxes: List["weakref.ref[_Box]"] = []

    def pack(self, inner_pack: Callable[[Any], Any], x: Any) -> _Box:
        box = _Box(inner_pack(x), self)
        self._boxes.append(weakref.ref(box))
        return box

    @staticmethod
    def unpack(inner_unpack: Callable[[Any], Any], box: _Box) -> Any:
        session = _current
        if session is None:
            return inner_unpack(box.inner)  # the framework's behaviour, untouched
        return session._unpack(box, inner_unpack)

    def alive(self) -> Iterator[_Box]:
        """The boxes autograd still holds, in the order they were packed."""
        for ref in self._boxes:
            box = ref()
            if box is not None:
                yield box


class RecomputeSession:
    """Share one recomputation of every checkpoint region between the halves of a split
    backward; see the module docstring.

    Use ``with session:`` around every half but the last and ``with session.last_half():``
    around the last one (it closes the session when it ends), or call :meth:`close` yourself
    (e.g. when a step is abandoned). A session is current process-wide while a half runs;
    entering a second session while one is current is an error. A closed session cannot be
    entered again.

    Attributes:
        name: for error messages and ``repr``.
        regions: how many regions were recomputed in this session (each once).
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._kept: Dict[_Box, Any] = {}
        self._forced: "weakref.WeakSet[SessionBoxes]" = weakref.WeakSet()
        self._release = False
        self._depth = 0
        self.closed = False
        self.regions = 0

    # ------------------------------------------------------------------ state
    @property
    def kept(self) -> int:
        """How many recomputed values the session holds now."""
        return len(self._kept)

    def kept_values(self) -> List[Any]:
        """The recomputed values the session holds now (for measuring; do not modify them)."""
        return list(self._kept.values())

    # ------------------------------------------------------------------ halves
    def __enter__(self) -> "RecomputeSession":
        global _current
        if self.closed:
            raise RuntimeError(f"RecomputeSession {self.name!r} is closed: a split backward's halves must "
                               "all run before the session is closed (last_half() closes it).")
        if _current is not None and _current is not self:
            raise RuntimeError(
                f"RecomputeSession {self.name!r} entered while session {_current.name!r} is running: one "
                "split-backward half runs at a time per process.")
        _current = self
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        global _current
        self._depth -= 1
        if self._depth == 0:
            _current = None

    @contextlib.contextmanager
    def last_half(self) -> Iterator["RecomputeSession"]:
        """Run the last half of the split backward: each value is released as soon as backward
        has it, and the session is closed at the end (also when the half raises)."""
        with self:
            self._release = True
            try:
                yield self
            finally:
                self._release = False
                self.close()

    def close(self) -> None:
        """Release every value the session holds. Safe to call twice."""
        self._kept.clear()
        self._forced = weakref.WeakSet()
        self.closed = True

    # ------------------------------------------------------------------ unpack
    def _unpack(self, box: _Box, inner_unpack: Callable[[Any], Any]) -> Any:
        kept = self._kept
        if box in kept:
            return kept.pop(box) if self._release else kept[box]
        owner = box.owner
        if owner in self._forced:
            # Already handed to backward and released (a second unpack in the last half, e.g. with
            # retain_graph=True): the framework decides, as without a session.
            return inner_unpack(box.inner)
        # First unpack of this region in the session: the framework recomputes the region (once)
        # for this one, and every other box of the region is taken now, from that recomputation.
        value = inner_unpack(box.inner)
        self._forced.add(owner)
        self.regions += 1
        for other in owner.alive():
            if other is not box and other not in kept:
                kept[other] = inner_unpack(other.inner)
        if not self._release:
            kept[box] = value
        return value

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("running" if _current is self else "open")
        return f"RecomputeSession({self.name!r}, {state}, kept={self.kept}, regions={self.regions})"
