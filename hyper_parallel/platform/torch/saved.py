"""Small shared pieces: a version-checked saved tensor and the thread-local region flags."""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["Saved", "region_flags", "RegionMarker"]


class Saved:
    """A tensor kept on the device (SAVE), with the in-place check autograd would have made."""

    __slots__ = ("val", "version", "check")

    def __init__(self, val: torch.Tensor, check: bool = True) -> None:
        self.val = val
        self.version = val._version
        self.check = check

    def get_val(self) -> torch.Tensor:
        if self.check and self.val._version != self.version:
            raise RuntimeError(
                "a tensor saved for backward was modified by an in-place operation after it was saved "
                f"(version {self.version} when saved, {self.val._version} now); gradients would be "
                "wrong. Use the out-of-place form of the op, or clone the tensor before it is saved.")
        return self.val


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
