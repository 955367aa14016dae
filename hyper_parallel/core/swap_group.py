"""The storages of one group name, offloaded and loaded together."""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Sequence

from .backend import Backend
from .keep_reason import KeepReason
from .swap_bucket import HostBucket, plan_buckets
from .swap_tensor import SwapTensor, TensorState

__all__ = ["SwapGroup", "GroupStats"]


def _by_device(tensors: List[SwapTensor]) -> Dict[Any, List[SwapTensor]]:
    """``tensors`` grouped by their device, in order (streams and events are per device)."""
    out: Dict[Any, List[SwapTensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


#: The counters of a group that add up (``GroupStats.merge``), besides ``kept_bytes``.
_COUNTERS = ("offloaded_bytes", "loaded_bytes", "wait_offload_s", "wait_load_s", "offload_launches", "load_launches",
             "unscheduled_bytes")


class GroupStats:
    """Counters of one group (cumulative until ``SwapManager().reset()``).

    ``wait_offload_s`` / ``wait_load_s`` are host seconds spent in the wait calls: issuing the
    stream waits and the bookkeeping. On an accelerator the waits are asynchronous, so they do not
    include the time the device stream stalls for a copy (measure that in a profiler trace: the
    ``hyper_parallel.wait_*`` ranges against the ``Memcpy`` kernels)."""

    __slots__ = _COUNTERS + ("kept_bytes",)

    def __init__(self) -> None:
        self.offloaded_bytes = 0
        self.loaded_bytes = 0
        self.kept_bytes: Dict[KeepReason, int] = defaultdict(int)
        self.wait_offload_s = 0.0
        self.wait_load_s = 0.0
        self.offload_launches = 0
        self.load_launches = 0
        #: swap candidates whose storage died while nothing had ever offloaded their group (they
        #: stayed on the device, as SAVE: no layer chain, no launch_offload)
        self.unscheduled_bytes = 0

    def keep(self, reason: KeepReason, nbytes: int) -> None:
        self.kept_bytes[reason] += nbytes
        if nbytes < 0 and not self.kept_bytes[reason]:  # all of it was offloaded after all
            del self.kept_bytes[reason]

    def merge(self, other: "GroupStats") -> None:
        """Add ``other``'s counters to these (statistics of retired groups are folded together)."""
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for reason, nbytes in other.kept_bytes.items():
            self.keep(reason, nbytes)

    def as_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {name: getattr(self, name) for name in _COUNTERS}
        out["kept_bytes"] = dict(self.kept_bytes)
        return out


class _InFlight:
    """The copies of one direction (D2H or H2D) issued since they were last waited: the tensors,
    and per device and launch the event recorded after their copies. ``pending``: a launch
    happened since the last wait (what the wait checks; also true for a launch that found nothing
    to copy)."""

    __slots__ = ("tensors", "events", "pending")

    def __init__(self) -> None:
        # Strong references: a tensor whose region died in flight is still waited, then freed
        # (``SwapGroup.forget_in_flight`` drops them when nothing will wait).
        self.tensors: List[SwapTensor] = []
        self.events: List[Any] = []
        self.pending = False

    def clear(self) -> None:
        self.tensors.clear()
        self.events.clear()
        self.pending = False


class SwapGroup:
    """All storages added under one name; one copy event per direction and launch.

    ``launch_offload`` copies every storage still on the device to the host on the copy stream,
    after making the copy stream wait for what compute has produced so far. ``wait_offload``
    makes the compute stream wait for those copies and then drops the swap system's references
    to the sources, which frees their device memory (unless somebody else holds it).
    ``launch_load`` allocates the destinations for the compute stream and copies back on the copy
    stream; ``wait_load`` makes compute wait for the copies. Waiting without launching is an error.

    Streams belong to a device: storages are moved per device (``SwapTensor.device``), each on
    that device's copy stream (``copy_streams(device)``), ordered with that device's current
    stream. Each ordering point is one ``_order_*`` method (the stream-ordering table of
    ``docs/architecture.md``). A launch that fails part-way leaves every copy it issued with its
    event (so it can be waited) and every other tensor where it was.
    """

    def __init__(self, name: str, backend: Backend, stats: GroupStats, pool: Any,
                 copy_streams: Callable[[Any], Any], persistent: bool = False) -> None:
        self.name = name
        #: ``copy_streams(device)``: the manager's copy stream of a device, what launches use by default
        self._copy_streams = copy_streams
        #: the backend the group's storages and tensors use
        self.backend = backend
        self.stats = stats
        #: the host buffer pool (a bucket's buffer is taken here, a solo storage's by its SwapTensor)
        self.pool = pool
        #: cap of one bucket of small storages (``core/swap_bucket.py``), set by the manager; 0:
        #: every storage by itself
        self.bucket_bytes = 0
        self.persistent = persistent  # layer-chain groups live as long as the chain
        # Profiler range names, made once: the launches and waits run several times per layer.
        self._ranges = {kind: f"hyper_parallel.{kind}[{name}]"
                        for kind in ("launch_offload", "wait_offload", "launch_load", "wait_load")}
        # Weak references in the order the storages were added (loads go in backward-use order,
        # the reverse of it); plain refs are much cheaper to walk than a weak container.
        self._storages: List[weakref.ref] = []
        # What the launches since the last wait issued, and the tensors the last offload launch
        # skipped because somebody else held them: the waits and the layer chain's retry look at
        # these instead of walking every storage of the group.
        self._d2h = _InFlight()
        self._h2d = _InFlight()
        self._skipped_shared: List[SwapTensor] = []
        self.offload_cancelled = False  # launch_load cancelled an offload in flight (for wait_offload's message)

    @property
    def offload_pending(self) -> bool:
        """An offload was launched and not waited yet."""
        return self._d2h.pending

    @property
    def load_pending(self) -> bool:
        """A load was launched and not waited yet."""
        return self._h2d.pending

    # ------------------------------------------------------------------ content
    def add(self, storage: Any, new: bool = False) -> None:
        """Add ``storage`` (once: adding it again does nothing; ``new``: it was just made, so it
        cannot be here yet)."""
        refs = self._storages
        if refs and refs[0]() is None:  # drop the references of dead storages (a chain group adds one per step)
            refs = self._storages = [r for r in refs if r() is not None]
        if new or not any(r() is storage for r in refs):
            refs.append(weakref.ref(storage))

    def storages(self) -> List[Any]:
        """The live storages, in the order they were added (forward order)."""
        live = [s for s in (r() for r in self._storages) if s is not None]
        if len(live) != len(self._storages):  # drop the references of dead storages
            self._storages = [weakref.ref(s) for s in live]
        return live

    def __len__(self) -> int:
        return len(self.storages())

    def has_live_storage(self) -> bool:
        """Whether a storage of the group is still alive (cheaper than ``len``): newest first,
        since older forwards die first."""
        for r in reversed(self._storages):
            if r() is not None:
                return True
        return False

    def settle(self) -> None:
        """Bring everything back to the device, synchronously: finish an offload in flight, load
        what is on the host. Used before the manager forgets the group."""
        if self.offload_pending:
            self.wait_offload()
        if self._tensors(TensorState.HOST, TensorState.D2H):
            # The copies go on the compute stream, in its order; its event guards the host buffers.
            self.launch_load(self.backend.current_stream)
        if self.load_pending:
            self.wait_load()

    def _tensors(self, *states: TensorState) -> List[SwapTensor]:
        out = []
        for r in self._storages:
            s = r()
            if s is not None:
                out.extend(t for t in s.swap_tensors if t.state in states)
        return out

    def has_retryable(self) -> bool:
        """Whether the last offload launch skipped tensors that were held elsewhere at the time
        (and are worth one more try, see ``SwapTensor.retryable``)."""
        return any(t.retryable for t in self._skipped_shared)

    def resident_swap_bytes(self) -> int:
        """Bytes of this group's swap candidates that occupy device memory now."""
        return sum(t.nbytes for s in self.storages() for t in s.swap_tensors if t.resident_candidate)

    def forget_in_flight(self) -> None:
        """Every storage of the group died: nothing can wait for its copies any more (their host
        buffers went back to the pool guarded by their events), so drop the pending state."""
        self._d2h.clear()
        self._h2d.clear()
        self._skipped_shared.clear()

    # ------------------------------------------------------------------ ordering points
    def _order_d2h_after_producers(self, copy_stream: Any, device: Any, tensors: List[SwapTensor]) -> None:
        """The copy stream must not read a tensor before compute has finished writing it: it waits
        the current stream and every other stream the tensors were produced on."""
        p = self.backend
        streams = [p.current_stream(device)]
        for t in tensors:
            for s in t.producers:
                if not any(s == known for known in streams):
                    streams.append(s)
        for s in streams:
            p.wait_event(copy_stream, p.record_event(s))

    def _order_release_after_d2h(self, compute: Any, event: Any) -> None:
        """Compute (the current stream of the sources' device) waits the D2H before the sources
        are released (their blocks go back to the compute stream's pool at once)."""
        self.backend.wait_event(compute, event)

    def _order_h2d_after_allocation(self, copy_stream: Any, compute: Any) -> None:
        """The allocator may hand the destinations memory that pending compute work still uses:
        the copy stream waits compute (the stream that allocated them) after the allocations."""
        self.backend.wait_event(copy_stream, self.backend.record_event(compute))

    def _order_use_after_h2d(self, compute: Any, event: Any) -> None:
        """Compute (the current stream of the destinations' device) waits the H2D before it uses
        the reloaded tensors."""
        self.backend.wait_event(compute, event)

    # ------------------------------------------------------------------ offload
    def launch_offload(self, copy_streams: Optional[Callable[[Any], Any]] = None,
                       runs: Optional[List[List[SwapTensor]]] = None) -> None:
        """Copy the tensors of ``runs`` (one list per storage; default: the whole group's) that can
        go to the host, per device on ``copy_streams(device)`` (default: the manager's copy stream)."""
        if runs is None:
            runs = self._offload_runs()
        skipped: List[SwapTensor] = []
        self._skipped_shared = skipped
        with self.backend.trace_range(self._ranges["launch_offload"]):
            try:
                for device, tensors in _by_device([t for run in runs for t in run]).items():
                    copy_stream = (copy_streams or self._copy_streams)(device)
                    self._order_d2h_after_producers(copy_stream, device, tensors)
                    started: List[SwapTensor] = []
                    try:
                        with self.backend.stream_context(copy_stream):
                            for run in runs:
                                ready = [t for t in run if t.device == device and self._cleared(t, skipped)]
                                self._start_offloads(ready, copy_stream, started)
                    finally:  # even if a later tensor failed: these copies are queued
                        self._issued(self._d2h, started, copy_stream, device)
                        for t in started:
                            self._offloaded(t)
            finally:
                self.stats.offload_launches += 1
        self._d2h.pending = True
        self.offload_cancelled = False

    def retry_offload(self) -> None:
        """Launch the offload of the tensors the last launch skipped as held elsewhere and that
        are worth one more try (``SwapTensor.retryable``: a layer input, free once the caller
        moved on), each by itself: a second look at only these, not a walk of the whole group."""
        self.launch_offload(runs=[[t] for t in self._skipped_shared if t.retryable])

    def _cleared(self, t: SwapTensor, skipped: List[SwapTensor]) -> bool:
        """Whether ``t`` can be offloaded now (``SwapTensor.offload_reason``). If not, the bytes it
        keeps on the device are counted (a storage skipped as held elsewhere once, however often
        it is skipped again) and, held elsewhere, it joins ``skipped``."""
        skipped_before = t.shared_skips
        reason = t.offload_reason()
        if reason is None:
            return True
        if reason is KeepReason.SHARED:
            skipped.append(t)
        if reason is not KeepReason.SHARED or not skipped_before:  # count each storage once
            self.stats.keep(reason, t.nbytes)
        return False

    def _offloaded(self, t: SwapTensor) -> None:
        """The offload copy of ``t`` was issued: its statistics."""
        self.stats.offloaded_bytes += t.nbytes
        if t.shared_skips:  # it was counted as kept 'shared' by an earlier launch
            self.stats.keep(KeepReason.SHARED, -t.nbytes)

    def _offload_runs(self) -> List[List[SwapTensor]]:
        """What a launch of the whole group considers, one list per storage (a bucket never spans
        two regions' forwards): every storage's tensors on the device and not kept for good, in
        the order they were saved."""
        runs = []
        for r in self._storages:
            s = r()
            if s is not None:
                run = [t for t in s.swap_tensors if t.state is TensorState.DEVICE and t.kept_reason is None]
                if run:
                    runs.append(run)
        return runs

    def _issued(self, flight: _InFlight, tensors: List[SwapTensor], copy_stream: Any, device: Any) -> None:
        """The copies of ``tensors`` (on ``device``) were queued on ``copy_stream``: the event
        recorded after them guards their host buffers (``SwapTensor.set_copy_event``), and the
        wait of ``flight`` waits it."""
        if tensors:
            event = self.backend.record_event(copy_stream)
            for t in tensors:
                t.set_copy_event(event)
            flight.tensors.extend(tensors)
            flight.events.append((device, event))
            flight.pending = True

    def _start_offloads(self, ready: List[SwapTensor], copy_stream: Any, started: List[SwapTensor]) -> None:
        """Issue the D2H copies of ``ready`` (one storage's tensors cleared to go, in save order):
        the small ones into shared bucket buffers, the rest each into its own. Appends every
        tensor whose copy was issued to ``started`` as it goes (a failure leaves the rest where
        they were, and returns the unused shares of a bucket's buffer)."""
        buckets, solos = plan_buckets(ready, self.bucket_bytes)
        for members, offsets, nbytes in buckets:
            host = self.pool.acquire(nbytes, copy_stream)
            if host is None:  # over the host cap: each member tries for a buffer of its own
                solos.extend(members)
                continue
            bucket = HostBucket(self.pool, host, nbytes, members)
            issued = 0
            try:
                for t, offset in zip(members, offsets):
                    t.start_offload(host, copy_stream, bucket, offset)
                    started.append(t)
                    issued += 1
            finally:
                for _ in range(len(members) - issued):
                    bucket.release(self.backend.record_event(copy_stream))
        for t in solos:
            host = self.pool.acquire(t.nbytes, copy_stream)
            if host is None:
                self.stats.keep(t.keep(KeepReason.HOST_LIMIT), t.nbytes)
                continue
            try:
                t.start_offload(host, copy_stream)
            except BaseException:
                # Nothing of ours is in flight; guard the buffer with the copy stream anyway, in
                # case the framework queued part of the copy before failing.
                self.pool.release(host, t.nbytes, self.backend.record_event(copy_stream))
                raise
            started.append(t)

    def wait_offload(self) -> None:
        if not self._d2h.pending and self.offload_cancelled:
            raise RuntimeError(
                f"wait_offload('{self.name}'): the offload of group '{self.name}' was cancelled by "
                f"launch_load('{self.name}') before it was waited (its tensors never left the device), so "
                "there is nothing to wait for. Call wait_offload before launch_load, or drop the "
                "wait_offload when a group is loaded back right away.")
        if not self._d2h.pending:
            raise RuntimeError(
                f"wait_offload('{self.name}') called but no offload of group '{self.name}' is in flight; "
                f"call SwapManager().launch_offload('{self.name}') first.")
        self.stats.wait_offload_s += self._wait(self._d2h, "wait_offload", self._order_release_after_d2h,
                                                TensorState.D2H, SwapTensor.wait_offload)

    def _wait(self, flight: _InFlight, kind: str, order: Callable[[Any, Any], None], state: TensorState,
              arrived: Callable[[SwapTensor, Any], None]) -> float:
        """Wait ``flight``: on each device the current stream waits the launches' events
        (``order``, an ordering point), then each tensor still in ``state`` (not cancelled since)
        is told that stream waited (``arrived(tensor, waiter)``). Returns the host seconds spent."""
        t0 = time.perf_counter()
        with self.backend.trace_range(self._ranges[kind]):
            waiters: Dict[Any, Any] = {}  # device -> its current stream (every tensor's device has an event)
            for device, event in flight.events:
                if device not in waiters:
                    waiters[device] = self.backend.current_stream(device)
                order(waiters[device], event)
            for t in flight.tensors:
                if t.state is state:
                    arrived(t, waiters[t.device])
        flight.clear()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ load
    def launch_load(self, copy_streams: Optional[Callable[[Any], Any]] = None, storages: Optional[Sequence[Any]] = None,
                    limit_bytes: Optional[int] = None) -> int:
        """``copy_streams(device)``: the copy stream to use for the storages of ``device``
        (default: the manager's).

        ``storages``: load only these (e.g. the storages of one forward, when several forwards of
        the layer wait for their backward); default all. ``limit_bytes``: load at most this many
        bytes, the tensors backward needs first (the reverse of the order they were saved in);
        the rest stay on the host for a later load. Returns the bytes whose copies were issued."""
        with self.backend.trace_range(self._ranges["launch_load"]):
            wanted = self._in_backward_order(storages, TensorState.HOST, TensorState.D2H)
            if limit_bytes is not None:
                wanted = self._first_bytes(wanted, limit_bytes)
            self._cancel_offloads(wanted)
            try:
                issued = self._load([t for t in wanted if t.state is TensorState.HOST],
                                    copy_streams or self._copy_streams, self._h2d)
            finally:
                self.stats.load_launches += 1
            self._h2d.pending = True
            return issued

    def pending_load_bytes(self, storages: Optional[Sequence[Any]] = None) -> int:
        """Bytes of ``storages`` (default: all) still to bring back to the device."""
        return sum(t.nbytes for t in self._in_backward_order(storages, TensorState.HOST, TensorState.D2H))

    def _in_backward_order(self, storages: Optional[Sequence[Any]], *states: TensorState) -> List[SwapTensor]:
        chosen = self.storages() if storages is None else [s for s in storages if s is not None]
        return [t for s in reversed(chosen) for t in reversed(s.swap_tensors) if t.state in states]

    @staticmethod
    def _with_siblings(tensors: List[SwapTensor]) -> Dict[Any, List[SwapTensor]]:
        """``tensors`` plus the members of their buckets still on the host (a bucket comes back
        whole: its members share one copy), each once, in order, by device (as ``_by_device``)."""
        out: Dict[Any, List[SwapTensor]] = {}
        seen = set()
        for t in tensors:
            for m in [t] if t.bucket is None else t.bucket.members(TensorState.HOST):
                if id(m) not in seen:
                    seen.add(id(m))
                    out.setdefault(m.device, []).append(m)
        return out

    @staticmethod
    def _first_bytes(wanted: List[SwapTensor], limit_bytes: int) -> List[SwapTensor]:
        """The first tensors of ``wanted`` (in backward-use order) that fit in ``limit_bytes``, a
        bucket's members together (a bucket comes back whole); nothing after one that does not fit."""
        budget, chosen, seen = limit_bytes, [], set()
        for t in wanted:
            if t.bucket is None:
                cost, take = t.nbytes, [t]
            elif t.bucket in seen:
                continue  # came with its bucket already
            else:
                seen.add(t.bucket)
                take = t.bucket.members(TensorState.HOST, TensorState.D2H)
                cost = sum(m.nbytes for m in take)
            if cost > budget:
                break
            budget -= cost
            chosen.extend(take)
        return chosen

    def _cancel_offloads(self, wanted: List[SwapTensor]) -> None:
        """Offloads of ``wanted`` that were launched but never waited are cancelled: their sources
        are intact (``SwapTensor.cancel_offload``); with none left in flight, nothing is to be waited."""
        for t in wanted:
            if t.state is TensorState.D2H:
                t.cancel_offload()
        d2h = self._d2h
        if d2h.tensors and not any(t.state is TensorState.D2H for t in d2h.tensors):
            d2h.tensors.clear()
        if not d2h.tensors:
            self.offload_cancelled = d2h.pending
            d2h.clear()

    def _load(self, tensors: List[SwapTensor], copy_streams: Callable[[Any], Any], flight: _InFlight) -> int:
        """Bring ``tensors`` (state host) back with the siblings of their buckets, per device:
        the destinations allocated on the compute stream that will use and free them (one device
        buffer per bucket), then one H2D copy per bucket or storage on ``copy_streams(device)``,
        left for the wait of ``flight``. A tensor whose copy was not issued (a failure) goes back
        to the host. Returns the bytes whose copies were issued."""
        issued_bytes = 0
        for device, on_device in self._with_siblings(tensors).items():
            copy_stream = copy_streams(device)
            compute = self.backend.current_stream(device)
            bucket_devs: Dict[Any, Any] = {}
            allocated: List[SwapTensor] = []
            try:
                for t in on_device:
                    t.allocate(compute, bucket_devs)
                    allocated.append(t)
                self._order_h2d_after_allocation(copy_stream, compute)
                with self.backend.stream_context(copy_stream):
                    for t in allocated:  # a bucket's first member copies the whole bucket's buffer
                        t.copy_in(copy_stream, issue=t.bucket is None or bucket_devs.pop(t.bucket, None) is not None)
            finally:  # even if a later allocation or copy failed: these copies are queued
                issued = [t for t in allocated if t.load_issued]
                for t in allocated:
                    if not t.load_issued:
                        t.unload()
                self._issued(flight, issued, copy_stream, device)
                for t in issued:
                    self.stats.loaded_bytes += t.nbytes
                    issued_bytes += t.nbytes
        return issued_bytes

    def wait_load(self) -> None:
        if not self._h2d.pending:
            raise RuntimeError(
                f"wait_load('{self.name}') called but no load of group '{self.name}' is in flight; "
                f"call SwapManager().launch_load('{self.name}') first.")
        self.stats.wait_load_s += self._wait(self._h2d, "wait_load", self._order_use_after_h2d, TensorState.H2D,
                                             SwapTensor.wait_load)

    def __repr__(self) -> str:
        return (f"SwapGroup({self.name!r}, storages={len(self)}, "
                f"offload_pending={self.offload_pending}, load_pending={self.load_pending})")
