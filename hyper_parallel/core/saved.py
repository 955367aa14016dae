"""A tensor kept on the device for backward, with the in-place check autograd would have made."""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["Saved"]


class Saved:
    """A tensor kept on the device (a SAVE decision, or a swap candidate that stays).

    ``version`` reads the framework's version counter; with ``check`` an in-place change of the
    tensor between saving and use is an error, as autograd would have raised.
    """

    __slots__ = ("val", "saved_version", "_version")

    def __init__(self, val: Any, version: Callable[[Any], int], check: bool = True,
                 saved_version: Optional[int] = None) -> None:
        self.val = val
        self._version = version if check else None
        if not check:
            saved_version = 0
        elif saved_version is None:
            saved_version = version(val)
        self.saved_version = saved_version  # (given: read by the caller already)

    def get_val(self) -> Any:
        if self._version is not None:
            now = self._version(self.val)
            if now != self.saved_version:
                raise RuntimeError(
                    "a tensor saved for backward was modified by an in-place operation after it was saved "
                    f"(version {self.saved_version} when saved, {now} now); gradients would be wrong. Use "
                    "the out-of-place form of the op, or clone the tensor before it is saved.")
        return self.val
