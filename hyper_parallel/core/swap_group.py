"""The storages of one group name, offloaded and loaded together."""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Any, Dict, List

from .backend import Backend
from .keep_reason import KeepReason
from .swap_tensor import SwapTensor, TensorState

__all__ = ["SwapGroup", "GroupStats"]


class GroupStats:
    """Counters of one group (cumulative until ``SwapManager().reset()``)."""

    __slots__ = ("offloaded_bytes", "loaded_bytes", "kept_bytes", "wait_offload_s", "wait_load_s",
                 "offload_launches", "load_launches")

    def __init__(self) -> None:
        self.offloaded_bytes = 0
        self.loaded_bytes = 0
        self.kept_bytes: Dict[KeepReason, int] = defaultdict(int)
        self.wait_offload_s = 0.0
        self.wait_load_s = 0.0
        self.offload_launches = 0
        self.load_launches = 0

    def keep(self, reason: KeepReason, nbytes: int) -> None:
        self.kept_bytes[reason] += nbytes
        if nbytes < 0 and not self.kept_bytes[reason]:  # all of it was offloaded after all
            del self.kept_bytes[reason]

    def merge(self, other: "GroupStats") -> None:
        """Add ``other``'s counters to these (statistics of retired groups are folded together)."""
        for name in ("offloaded_bytes", "loaded_bytes", "wait_offload_s", "wait_load_s", "offload_launches",
                     "load_launches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for reason, nbytes in other.kept_bytes.items():
            self.keep(reason, nbytes)

    def as_dict(self) -> Dict[str, Any]:
        return {
            "offloaded_bytes": self.offloaded_bytes,
            "loaded_bytes": self.loaded_bytes,
            "kept_bytes": dict(self.kept_bytes),
            "wait_offload_s": self.wait_offload_s,
            "wait_load_s": self.wait_load_s,
            "offload_launches": self.offload_launches,
            "load_launches": self.load_launches,
        }


class SwapGroup:
    """All storages added under one name; one copy event per direction and launch.

    ``launch_offload`` copies every storage still on the device to the host on the copy stream,
    after making the copy stream wait for what compute has produced so far. ``wait_offload``
    makes the compute stream wait for those copies and then drops the swap system's references
    to the sources, which frees their device memory (unless somebody else holds it).
    ``launch_load`` allocates the destinations for the compute stream and copies back on the copy
    stream; ``wait_load`` makes compute wait for the copies. Waiting without launching is an error.
    """

    def __init__(self, name: str, backend: Backend, stats: GroupStats, persistent: bool = False) -> None:
        self.name = name
        self._b = backend
        self.stats = stats
        self.persistent = persistent  # layer-chain groups live as long as the chain
        self._storages: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._offload_events: List[Any] = []
        self._load_events: List[Any] = []
        self.offload_pending = False
        self.offload_cancelled = False  # launch_load cancelled an offload in flight (for wait_offload's message)
        self.load_pending = False

    # ------------------------------------------------------------------ content
    def add(self, storage: Any) -> None:
        self._storages.add(storage)

    def __len__(self) -> int:
        # Count live members by iterating: len(WeakSet) still counts an entry whose object is being
        # finalised right now (its removal callback runs after ours).
        return sum(1 for _ in self._storages)

    def settle(self) -> None:
        """Bring everything back to the device, synchronously: finish an offload in flight, load
        what is on the host. Used before the manager forgets the group."""
        if self.offload_pending:
            self.wait_offload()
        if self.has_state(TensorState.HOST) or self.has_state(TensorState.D2H):
            self.launch_load(None)
        if self.load_pending:
            self.wait_load()

    def _tensors(self, *states: TensorState) -> List[SwapTensor]:
        return [t for s in list(self._storages) for t in s.swap_tensors() if t.state in states]

    def has_state(self, state: TensorState) -> bool:
        return bool(self._tensors(state))

    def has_retryable(self) -> bool:
        """Whether an earlier launch skipped tensors that were held elsewhere at the time."""
        return any(t.retryable for t in self._tensors(TensorState.DEVICE))

    def resident_swap_bytes(self) -> int:
        """Bytes of this group's swap candidates that occupy device memory now."""
        return sum(t.nbytes for s in list(self._storages) for t in s.swap_tensors() if t.resident_candidate)

    def forget_in_flight(self) -> None:
        """Every storage of the group died: nothing can wait for its copies any more (their host
        buffers went back to the pool guarded by their events), so drop the pending state."""
        self._offload_events.clear()
        self._load_events.clear()
        self.offload_pending = self.load_pending = False

    # ------------------------------------------------------------------ offload
    def launch_offload(self, copy_stream: Any) -> None:
        with self._b.trace_range(f"hyper_parallel.launch_offload[{self.name}]"):
            self._launch_offload(copy_stream)

    def _launch_offload(self, copy_stream: Any) -> None:
        p = self._b
        todo = [t for t in self._tensors(TensorState.DEVICE) if t.kept_reason is None]
        # The copy stream must not read a tensor before compute has finished writing it.
        p.wait_event(copy_stream, p.record_event(p.current_stream()))
        started = []
        with p.stream_context(copy_stream):
            for t in todo:
                skipped_before = t.shared_skips
                reason = t.async_offload(copy_stream)
                if reason is None:
                    started.append(t)
                    if skipped_before:  # it was counted as kept 'shared' by an earlier launch
                        self.stats.keep(KeepReason.SHARED, -t.nbytes)
                elif reason is not KeepReason.SHARED or not skipped_before:  # count each storage once
                    self.stats.keep(reason, t.nbytes)
        event = p.record_event(copy_stream)
        for t in started:
            t.set_copy_event(event)
            self.stats.offloaded_bytes += t.nbytes
        self._offload_events.append(event)
        self.offload_pending = True
        self.offload_cancelled = False
        self.stats.offload_launches += 1

    def wait_offload(self) -> None:
        if not self.offload_pending and self.offload_cancelled:
            raise RuntimeError(
                f"wait_offload('{self.name}'): the offload of group '{self.name}' was cancelled by "
                f"launch_load('{self.name}') before it was waited (its tensors never left the device), so "
                "there is nothing to wait for. Call wait_offload before launch_load, or drop the "
                "wait_offload when a group is loaded back right away.")
        if not self.offload_pending:
            raise RuntimeError(
                f"wait_offload('{self.name}') called but no offload of group '{self.name}' is in flight; "
                f"call SwapManager().launch_offload('{self.name}') first.")
        t0 = time.perf_counter()
        with self._b.trace_range(f"hyper_parallel.wait_offload[{self.name}]"):
            for event in self._offload_events:
                self._b.wait_event(self._b.current_stream(), event)
            for t in self._tensors(TensorState.D2H):
                t.wait_offload()
        self._offload_events.clear()
        self.offload_pending = False
        self.stats.wait_offload_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ load
    def launch_load(self, copy_stream: Any) -> None:
        with self._b.trace_range(f"hyper_parallel.launch_load[{self.name}]"):
            self._launch_load(copy_stream)

    def _launch_load(self, copy_stream: Any) -> None:
        p = self._b
        # Offloads that were launched but never waited are cancelled: their sources are intact.
        for t in self._tensors(TensorState.D2H):
            t.async_load()
        if not self._tensors(TensorState.D2H):
            self.offload_cancelled = self.offload_pending
            self._offload_events.clear()
            self.offload_pending = False
        # Destinations are allocated here, on the compute stream that will use and free them.
        started = [t for t in self._tensors(TensorState.HOST) if t.async_load()]
        # The allocator may hand us memory that pending compute work still uses: order after it.
        p.wait_event(copy_stream, p.record_event(p.current_stream()))
        with p.stream_context(copy_stream):
            for t in started:
                t.copy_in(copy_stream)
        event = p.record_event(copy_stream)
        for t in started:
            t.set_copy_event(event)
            self.stats.loaded_bytes += t.nbytes
        self._load_events.append(event)
        self.load_pending = True
        self.stats.load_launches += 1

    def wait_load(self) -> None:
        if not self.load_pending:
            raise RuntimeError(
                f"wait_load('{self.name}') called but no load of group '{self.name}' is in flight; "
                f"call SwapManager().launch_load('{self.name}') first.")
        t0 = time.perf_counter()
        with self._b.trace_range(f"hyper_parallel.wait_load[{self.name}]"):
            for event in self._load_events:
                self._b.wait_event(self._b.current_stream(), event)
            for t in self._tensors(TensorState.H2D):
                t.wait_load()
        self._load_events.clear()
        self.load_pending = False
        self.stats.wait_load_s += time.perf_counter() - t0

    def __repr__(self) -> str:
        return (f"SwapGroup({self.name!r}, storages={len(self._storages)}, "
                f"offload_pending={self.offload_pending}, load_pending={self.load_pending})")
