"""Small shared pieces: a version-checked saved tensor and the thread-local region flags."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Saved", "region_flags", "RegionMarker"]


def _version(t: Any) -> int:
    t.wait_pipeline()  # version bumps land asynchronously in PyNative's pipeline
    return t._version  # pylint: disable=protected-access


class Saved:
    """A tensor kept on the device (SAVE), with the in-place check autograd would have made.

    ``val`` is an alias made by ``MindSporeTensorOps.alias`` (a no-grad view sharing the
    original's version counter)."""

    __slots__ = ("val", "version", "check")

    def __init__(self, val: Any, check: bool = True) -> None:
        self.val = val
        self.version = _version(val) if check else 0
        self.check = check

    def get_val(self) -> Any:
        if self.check:
            now = _version(self.val)
            if now != self.version:
                raise RuntimeError(
                    "a tensor saved for backward was modified by an in-place operation after it was saved "
                    f"(version {self.version} when saved, {now} now); gradients would be wrong. Use the "
                    "out-of-place form of the op, or clone the tensor before it is saved.")
        return self.val


class _Flags(threading.local):
    def __init__(self) -> None:
        self.checkpoint_depth = 0  # inside a hyper_parallel checkpoint region (forward or recompute)
        self.recompute_depth = 0   # inside the recomputation of one


region_flags = _Flags()


class RegionMarker:
    """Context manager marking (on this thread) that a checkpoint region's forward or its
    recomputation is running."""

    def __init__(self, recompute: bool) -> None:
        self.recompute = recompute

    def __enter__(self) -> "RegionMarker":
        region_flags.checkpoint_depth += 1
        region_flags.recompute_depth += self.recompute
        return self

    def __exit__(self, *exc: Any) -> None:
        region_flags.checkpoint_depth -= 1
        region_flags.recompute_depth -= self.recompute
