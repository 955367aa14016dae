"""Which checkpoint region is running on this thread (framework-neutral).

A swap region or a layer-chain hook that runs *inside* a checkpoint region (its forward, or its
recomputation during backward) must stand aside: the checkpoint's own saved-tensor hooks must see
every tensor saved there, or recomputation breaks. The backends' dispatch modes and checkpoint contexts mark the
region here; the swap code reads it.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["region_flags", "RegionMarker"]


class _Flags(threading.local):
    def __init__(self) -> None:
        self.checkpoint_depth = 0  # inside a hyper_parallel checkpoint region (forward or recompute)
        self.recompute_depth = 0   # inside the recomputation of one


region_flags = _Flags()


class RegionMarker:
    """Context manager marking (on this thread) that a checkpoint region's forward or its
    recomputation is running. Used as (part of) the checkpoint ``context_fn`` contexts."""

    def __init__(self, recompute: bool) -> None:
        self.recompute = recompute

    def __enter__(self) -> "RegionMarker":
        region_flags.checkpoint_depth += 1
        region_flags.recompute_depth += self.recompute
        return self

    def __exit__(self, *exc: Any) -> None:
        region_flags.checkpoint_depth -= 1
        region_flags.recompute_depth -= self.recompute
