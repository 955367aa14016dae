"""What a selective checkpoint region decided and kept, op call by op call (framework-neutral).

Forward records, for every op call the policy was asked about, the decision and what was kept
(the op output for SAVE, swap handles for SWAP, nothing for RECOMPUTE). Recomputation replays the
region from its first op and finds each call's record by ``(op key, n-th call of that op)``. The
platforms' dispatch modes drive this log; the errors a user can hit live here, once.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, DefaultDict, Hashable, List, Set, Tuple

from .policy import Decision

__all__ = ["OpLog", "RECOMPUTE"]


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


RECOMPUTE = _Marker("RECOMPUTE")  # nothing kept: the op runs again
_CONSUMED = _Marker("CONSUMED")   # kept value handed to backward and released


class OpLog:
    """Per op key, the forward calls in order: decision and kept value."""

    def __init__(self) -> None:
        self._entries: DefaultDict[Hashable, List[Any]] = defaultdict(list)
        self._decisions: DefaultDict[Hashable, List[Decision]] = defaultdict(list)
        self._unasked: Set[Tuple[Hashable, int]] = set()  # replayed without asking the policy
        self._counters: DefaultDict[Hashable, int] = defaultdict(int)

    # ------------------------------------------------------------------ forward
    def record(self, key: Hashable, decision: Decision, kept: Any, asked: bool = True) -> int:
        """Record one forward call; ``kept`` is ignored for RECOMPUTE. ``asked=False``: the
        platform decided without the policy (recompute will not ask it either)."""
        index = len(self._entries[key])
        self._decisions[key].append(decision)
        self._entries[key].append(RECOMPUTE if decision is Decision.RECOMPUTE else kept)
        if not asked:
            self._unasked.add((key, index))
        return index

    def recompute_instead(self, key: Hashable, index: int) -> None:
        """What was kept for this call is no longer valid (overwritten in place later in the
        forward): recompute the op instead, without holding the policy to its forward answer."""
        self._entries[key][index] = RECOMPUTE
        self._unasked.add((key, index))

    # ------------------------------------------------------------------ recompute
    def start_replay(self) -> None:
        """Each recomputation replays the region from its first op."""
        self._counters.clear()

    def next_call(self, key: Hashable, op_label: Any) -> Tuple[int, Any, bool]:
        """The record of the next call of ``key`` in this replay: ``(index, kept, ask_policy)``."""
        index = self._counters[key]
        self._counters[key] += 1
        entries = self._entries.get(key)
        if entries is None or index >= len(entries):
            raise RuntimeError(
                f"selective checkpoint: op {op_label} (call #{index}) ran during recomputation but not in "
                "forward. The region must run the same ops in forward and recompute; check for "
                "control flow that depends on global state or on tensor values that changed.")
        kept = entries[index]
        if kept is _CONSUMED:
            raise RuntimeError(
                "selective checkpoint: backward ran a second time through a region whose saved/swapped "
                "op outputs were released by the first backward. Backward through a selectively "
                "checkpointed region only once per forward (retain_graph=True cannot reuse them).")
        return index, kept, (key, index) not in self._unasked

    def check(self, key: Hashable, index: int, decision: Decision, op_label: Any) -> None:
        """The policy's answer during recomputation must be the one it gave in forward."""
        forward = self._decisions[key][index]
        if decision is not forward:
            raise RuntimeError(
                f"selective checkpoint: policy_fn chose {forward.value.upper()} for op {op_label} in "
                f"forward but {decision.value.upper()} while recomputing it; the policy must make the "
                "same choice in both (ctx.is_recompute tells them apart for logging, not for deciding).")

    def consume(self, key: Hashable, index: int) -> None:
        """Backward has the kept value: release it (device memory goes as soon as it can)."""
        self._entries[key][index] = _CONSUMED
