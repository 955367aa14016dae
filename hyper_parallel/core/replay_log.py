"""What a region's forward recorded, read back in the same order by each recomputation."""

from __future__ import annotations

from typing import Any, List

__all__ = ["ReplayLog", "CONSUMED"]


class _Consumed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "CONSUMED"


CONSUMED = _Consumed()  # a record handed to backward and released


class ReplayLog:
    """Records a region's forward made, in order (``kept``), and how many of them the current
    recomputation has read (``replayed``). A recomputation reads them from the first one
    (:meth:`start_replay`); a record backward has taken is :data:`CONSUMED`, so a second backward
    through the region finds it gone and says so."""

    __slots__ = ("kept", "replayed")

    def __init__(self) -> None:
        self.kept: List[Any] = []
        self.replayed = 0

    def start_replay(self) -> None:
        self.replayed = 0

    def next(self, label: Any, missing: str, consumed: str) -> int:
        """The index of the record of this recomputation's next call. Raises ``missing`` (a
        message template with ``{label}`` and ``{index}``) when the forward made fewer calls, and
        ``consumed`` (with ``{label}``) when a previous backward released the record."""
        index = self.replayed
        self.replayed += 1
        if index >= len(self.kept):
            raise RuntimeError(missing.format(label=label, index=index))
        if self.kept[index] is CONSUMED:
            raise RuntimeError(consumed.format(label=label))
        return index

    def consume(self, index: int) -> None:
        """Backward has record ``index``: release it."""
        self.kept[index] = CONSUMED
