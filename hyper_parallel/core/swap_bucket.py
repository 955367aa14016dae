"""Bucketed copies: the small storages of one offload share one host buffer and come back with one copy.

A transformer layer saves a few large activations and many small tensors (normalisation
statistics, masks, indices, the outputs of narrow projections). Moving each small one by itself
costs a copy launch, a pooled host buffer and a device allocation apiece; on an accelerator the
launch costs more than the bytes. So an offload launch packs the small storages of one region's
forward (one :class:`~hyper_parallel.core.storage.Storage`) back to back into one pooled host
buffer (one slot per storage, each slot aligned to :data:`SLOT_ALIGN`), and a load brings the
whole buffer back with one host-to-device copy into one device buffer, over which every member's
saved tensors are rebuilt as views at their slot's offset.

Each member keeps its own state machine (``SwapTensor``): what changes is where its bytes live
(a slot of a shared buffer) and that a load of one member loads its siblings too (they share the
copy). The device-to-host direction still issues one copy per member: the sources are separate
device blocks, and gathering them into one first would need a device buffer of the bucket's size
at the moment the offload is meant to free memory.

What a reloaded member looks like: its slot of the device block is a storage of its own
(``Backend.slot_bytes``: a storage slice in PyTorch, sharing the block's memory and keeping it
alive), so size, stride, storage offset, storage size, dtype and aliasing (two saved views of one
storage come back as views of one slot) are exactly the original's; the block is freed when the
last member's tensors are. Such a storage is not an allocation of the framework's allocator:
``record_stream`` on it is ignored (the engine only ever records the block itself), which is why
bucketing is opt-in (see ``SwapManager.set_bucket_bytes``).

Bucket sizes: a storage of at most ``bucket_bytes // SMALL_FRACTION`` bytes is small, and a
bucket holds at most ``bucket_bytes`` (``SwapManager().set_bucket_bytes``; 0, the default, turns
bucketing off). A bucket is never filled across regions' forwards, so a per-micro-batch load
still brings back only the forward whose backward is next.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Sequence, Tuple

__all__ = ["HostBucket", "SLOT_ALIGN", "SMALL_FRACTION", "plan_buckets"]

#: A storage is small (bucketed) when it holds at most ``bucket_bytes // SMALL_FRACTION`` bytes.
SMALL_FRACTION = 16
#: Every slot starts at a multiple of this many bytes: the block alignment of PyTorch's CUDA
#: caching allocator. A reloaded view then has the same address alignment as its original had in
#: its own block, so a kernel that picks a vectorised (or another) path by alignment picks the
#: same one in backward, and every dtype's element offset is whole.
SLOT_ALIGN = 512


def _aligned(n: int) -> int:
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def plan_buckets(tensors: Sequence[Any], bucket_bytes: int) -> Tuple[List[Tuple[List[Any], List[int], int]], List[Any]]:
    """Split ``tensors`` (the ``SwapTensor`` s of one storage and device about to be offloaded,
    in the order they were saved) into buckets and solos.

    Returns ``(buckets, solos)``: each bucket is ``(members, offsets, nbytes)`` with at least two
    members; every tensor that is not small, or would be alone in its bucket, is a solo."""
    if bucket_bytes <= 0 or len(tensors) < 2:
        return [], list(tensors)
    small_limit = bucket_bytes // SMALL_FRACTION
    buckets: List[Tuple[List[Any], List[int], int]] = []
    solos: List[Any] = []
    members: List[Any] = []
    offsets: List[int] = []
    end = 0
    for t in tensors:
        if t.nbytes > small_limit:
            solos.append(t)
            continue
        start = _aligned(end)
        if members and start + t.nbytes > bucket_bytes:  # full: close it, start the next
            _close(members, offsets, end, buckets, solos)
            members, offsets, start = [], [], 0
        members.append(t)
        offsets.append(start)
        end = start + t.nbytes
    _close(members, offsets, end, buckets, solos)
    return buckets, solos


def _close(members: List[Any], offsets: List[int], end: int, buckets: List[Tuple[List[Any], List[int], int]],
           solos: List[Any]) -> None:
    if len(members) > 1:
        buckets.append((members, offsets, end))
    else:
        solos.extend(members)  # a bucket of one would only add a slot to the same single copy


class HostBucket:
    """One pooled host buffer shared by the slots of several ``SwapTensor`` s.

    Each member holds one share; the buffer goes back to the pool when the last share is released
    (a member loaded back, its offload cancelled, or its region's graph dead). The pool's guard
    is the last copy event recorded on the buffer: every copy that touches it runs on the copy
    stream of its device, in order, so the last event covers them all."""

    __slots__ = ("host", "nbytes", "guard", "_pool", "_shares", "_members", "__weakref__")

    def __init__(self, pool: Any, host: Any, nbytes: int, members: Sequence[Any]) -> None:
        self.host = host
        self.nbytes = nbytes
        self.guard: Any = None
        self._pool = pool
        self._shares = len(members)
        # Weak: members reference their bucket, so strong references back would keep a dead
        # region's tensors alive until the cycle collector runs.
        self._members = [weakref.ref(t) for t in members]

    def members(self, *states: Any) -> List[Any]:
        """The members still alive, in slot order; with ``states``, those in one of them."""
        alive = [t for t in (r() for r in self._members) if t is not None]
        return [t for t in alive if t.state in states] if states else alive

    def release(self, guard: Any) -> None:
        """A member is done with its slot (``guard``: the event after its last copy, recorded as
        :attr:`guard` already unless the copy failed)."""
        if guard is not None and self.guard is None:
            self.guard = guard
        self._shares -= 1
        if self._shares == 0 and self.host is not None:
            self._pool.release(self.host, self.nbytes, self.guard)
            self.host = None

    def __repr__(self) -> str:
        return f"HostBucket(nbytes={self.nbytes}, members={len(self._members)}, shares={self._shares})"

