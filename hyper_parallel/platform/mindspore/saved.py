"""A version-checked saved tensor; the region flags live in the core (re-exported here)."""

from __future__ import annotations

from typing import Any

from hyper_parallel.core.activation_checkpoint.region_state import RegionMarker, region_flags

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
