"""Which checkpoint region is running on this thread (framework-neutral).

A swap region or a layer-chain hook that runs *inside* a checkpoint region (its forward, or its
recomputation during backward) must stand aside: the checkpoint's own saved-tensor hooks must see
every tensor saved there, or recomputation breaks. The backends' dispatch modes and checkpoint
contexts mark the region here; the swap code reads it.

The innermost running region's :class:`RegionFrame` (what one ``checkpoint`` call keeps beyond
the framework's checkpoint) is on a per-thread stack too, so that a sub-module wrapped with
``checkpoint_exclude_wrapper`` finds the region it runs in, and whether it runs in that region's
forward or in its recomputation.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional, Tuple

__all__ = ["region_flags", "RegionMarker", "RegionFrame"]


class _Flags(threading.local):
    def __init__(self) -> None:
        self.checkpoint_depth = 0  # inside a hyper_parallel checkpoint region (forward or recompute)
        self.recompute_depth = 0   # inside the recomputation of one
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
        region's op log is restarted by its recompute dispatch mode)."""
        if self.excluded is not None:
            self.excluded.start_replay()


class RegionMarker:
    """Context manager marking (on this thread) that a checkpoint region's forward or its
    recomputation is running. Used as (part of) the checkpoint ``context_fn`` contexts; with a
    ``frame``, entering the recomputation also restarts the frame's replay."""

    def __init__(self, recompute: bool, frame: Optional[RegionFrame] = None) -> None:
        self.recompute = recompute
        self.frame = frame

    def __enter__(self) -> "RegionMarker":
        if self.recompute and self.frame is not None:
            self.frame.start_replay()
        region_flags.checkpoint_depth += 1
        region_flags.recompute_depth += self.recompute
        region_flags.frames.append((self.frame, self.recompute))
        return self

    def __exit__(self, *exc: Any) -> None:
        region_flags.checkpoint_depth -= 1
        region_flags.recompute_depth -= self.recompute
        region_flags.frames.pop()
