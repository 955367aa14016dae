"""A version-checked saved tensor; the region flags live in the core (re-exported here)."""

from __future__ import annotations

from typing import Any

import torch

from . import _shim

from hyper_parallel.core.activation_checkpoint.region_state import RegionMarker, region_flags

__all__ = ["Saved", "region_flags", "RegionMarker"]


class Saved:
    """A tensor kept on the device (SAVE), with the in-place check autograd would have made."""

    __slots__ = ("val", "version", "check")

    def __init__(self, val: torch.Tensor, check: bool = True) -> None:
        self.val = val
        self.version = _shim.version(val)
        self.check = check

    def get_val(self) -> torch.Tensor:
        if self.check and _shim.version(self.val) != self.version:
            raise RuntimeError(
                "a tensor saved for backward was modified by an in-place operation after it was saved "
                f"(version {self.version} when saved, {_shim.version(self.val)} now); gradients would be "
                "wrong. Use the out-of-place form of the op, or clone the tensor before it is saved.")
        return self.val
