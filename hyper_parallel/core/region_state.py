"""Which checkpoint region is running on this thread (framework-neutral).

A swap region or a layer-chain hook that runs *inside* a checkpoint region (its forward, or its
recomputation during backward) must stand aside: the checkpoint's own saved-tensor hooks must see
every tensor saved there, or recomputation breaks. The checkpoint contexts built here
(:func:`region_contexts`, entered by the framework's checkpoint) mark the region; the swap code
reads it.

The innermost running region's :class:`RegionFrame` (what one ``checkpoint`` call keeps beyond
the framework's checkpoint) is on a per-thread stack too, so that a sub-module wrapped with
``checkpoint_exclude_wrapper`` finds the region it runs in, and whether it runs in that region's
forward or in its recomputation.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional, Tuple

__all__ = ["region_flags", "RegionFrame", "RegionShell", "AroundMode", "region_context", "region_contexts"]


class _Flags(threading.local):
    def __init__(self) -> None:
        self.checkpoint_depth = 0  # inside a hyper_parallel checkpoint region (forward or recompute)
        # (frame, recompute) of the running regions, innermost last; frame is None for regions
        # without one (the framework's own checkpoint driven by our selective contexts).
        self.frames: List[Tuple[Optional["RegionFrame"], bool]] = []

    def innermost(self) -> Tuple[Optional["RegionFrame"], bool]:
        """The innermost running region's frame and whether it is being recomputed."""
        return self.frames[-1] if self.frames else (None, False)


region_flags = _Flags()


class RegionFrame:
    """What one ``checkpoint`` call keeps beyond the framework's checkpoint.

    - ``selective``: its :class:`~hyper_parallel.core.selective.SelectiveRegion` (``None`` for
      whole-region recompute);
    - ``excluded``: the outputs of the sub-modules excluded from its recomputation
      (:class:`~hyper_parallel.core.exclusion.ExcludedCalls`), created on first use;
    - ``boxes``: the saved-tensor boxes that let a split backward share one recomputation
      (:class:`~hyper_parallel.core.recompute_session.SessionBoxes`), where the backend supports it.
    """

    __slots__ = ("selective", "excluded", "boxes", "excluding")

    def __init__(self, selective: Any = None, boxes: Any = None) -> None:
        self.selective = selective
        self.excluded: Any = None
        self.boxes = boxes
        self.excluding = 0  # an excluded sub-module's forward is running in this region

    def start_replay(self) -> None:
        """A recomputation starts: it replays the excluded calls from the first one (the selective
        region's op log is restarted by the same :class:`RegionShell`)."""
        if self.excluded is not None:
            self.excluded.start_replay()


class RegionShell:
    """What one checkpoint region's forward (``recompute=False``) or recomputation runs inside,
    as the engine sees it: entering a recomputation restarts its replays (``region``'s op log,
    ``frame``'s excluded calls); while inside, this thread is marked as running the region
    (:data:`region_flags`), and in a forward whose frame has session boxes the backend's
    saved-tensor hooks box what the framework's checkpoint packs (``Backend.session_hooks``).

    The framework's checkpoint enters it as one of its ``context_fn`` pair, by itself or through
    the dispatch mode that intercepts the region's ops (:func:`region_contexts`). Re-entrant: a
    recomputation context is entered once per recomputation."""

    __slots__ = ("_b", "recompute", "frame", "_region", "_sessions")

    def __init__(self, backend: Any, recompute: bool, frame: Optional[RegionFrame] = None, region: Any = None) -> None:
        self._b = backend
        self.recompute = recompute
        self.frame = frame
        self._region = region
        self._sessions: List[Any] = []  # the session hooks entered, one per entry (or None)

    def __enter__(self) -> "RegionShell":
        frame = self.frame
        if self.recompute:
            if self._region is not None:
                self._region.start_replay()
            if frame is not None:
                frame.start_replay()
        region_flags.checkpoint_depth += 1
        region_flags.frames.append((frame, self.recompute))
        boxes = frame.boxes if frame is not None and not self.recompute else None
        try:
            session = self._b.session_hooks(boxes) if boxes is not None else None
            if session is not None:
                session.__enter__()
        except BaseException:
            self._unmark()
            raise
        self._sessions.append(session)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            session = self._sessions.pop()
            if session is not None:
                session.__exit__(*exc)
        finally:
            self._unmark()

    def _unmark(self) -> None:
        region_flags.checkpoint_depth -= 1
        region_flags.frames.pop()


class AroundMode:
    """Mixin of the dispatch mode a backend makes in ``Backend.op_mode`` (``class
    _OpMode(AroundMode, FrameworkDispatchMode)``): the contexts of ``self.around`` (the engine's
    :class:`RegionShell`, and whatever the framework needs while the mode is active) are entered
    in order before the mode itself becomes active (the next class in the MRO) and left in reverse
    after it. The backend's class only hands ops on."""

    around: Tuple[Any, ...] = ()

    def __enter__(self) -> Any:
        entered: List[Any] = []
        try:
            for context in self.around:
                context.__enter__()
                entered.append(context)
            return super().__enter__()  # type: ignore[misc]
        except BaseException:
            for context in reversed(entered):
                context.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[misc]
        finally:
            for context in reversed(self.around):
                context.__exit__(*exc)


def region_context(backend: Any, recompute: bool, frame: Optional[RegionFrame], region: Any) -> Any:
    """One context of a region's ``context_fn`` pair: its :class:`RegionShell`, inside the
    backend's dispatch mode that hands every op to ``region`` (``recompute_op`` /
    ``forward_op``) where there is a selective region to ask (not in the forward of a whole-region
    one, which only keeps the recomputation's writes off outside state)."""
    shell = RegionShell(backend, recompute, frame, region)
    if region is None or (region.whole and not recompute):
        return shell
    return backend.op_mode(region.recompute_op if recompute else region.forward_op, shell)


def region_contexts(backend: Any, frame: Optional[RegionFrame], region: Any) -> Tuple[Any, Any]:
    """The ``(forward, recompute)`` context pair of a region (:func:`region_context`): what the
    framework's checkpoint enters around the forward and each recomputation."""
    return region_context(backend, False, frame, region), region_context(backend, True, frame, region)
