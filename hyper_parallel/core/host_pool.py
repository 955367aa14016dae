"""A pool of host buffers, reused by exact size.

Allocating page-locked memory is slow and synchronising (milliseconds per call on CUDA), so a
swap system that allocates per step serialises everything. Transformer layers save tensors of the
same few sizes every step, so an exact-size free list reaches a steady state after one step.

Accounting follows what the framework's host allocator really reserves
(``Backend.host_alloc_size``): PyTorch's caching host allocator rounds every pinned request up to
a power of two, so a 3000-byte buffer holds 4096 bytes of pinned memory, and that is what
``reserved_bytes`` and the cap count. Buffers the pool frees go back to that allocator's cache,
not to the OS; :meth:`HostBufferPool.release_idle` (and an eviction under the cap) therefore also
empties the framework's host cache (``Backend.empty_host_cache``).

Thread safety: hooks fire from autograd threads (one per device) and buffers come back from
finalizers in any thread, so every method takes the pool's lock (a leaf lock: nothing else is
acquired while it is held, apart from the backend's own).
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Any, DefaultDict, List, Optional, Tuple

from .backend import Backend

__all__ = ["HostBufferPool"]


class HostBufferPool:
    """Host buffers keyed by byte size, with an optional cap on the bytes reserved.

    ``acquire`` returns ``None`` when a new buffer would exceed ``limit_bytes``; the caller then
    keeps the tensor on the device.
    """

    def __init__(self, backend: Backend, limit_bytes: Optional[int] = None) -> None:
        self._b = backend
        self._lock = threading.RLock()
        self._free: DefaultDict[int, List[Tuple[Any, Any]]] = defaultdict(list)
        self.limit_bytes = limit_bytes
        # bytes the host allocator reserves for all buffers this pool created and still owns
        # (rounded: Backend.host_alloc_size)
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self.allocations = 0     # how many buffers were ever created (steady state: constant)
        self._all: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()

    def buffers(self) -> List[Any]:
        """Every host buffer of this pool still alive (idle or in use)."""
        return list(self._all.values())

    def _order_reuse_after_guard(self, stream: Any, guard: Any) -> None:
        """Ordering point: a pooled buffer may still be read (H2D) or written (D2H) by a copy on
        another stream; the copy that reuses it on ``stream`` waits that copy's event."""
        self._b.wait_event(stream, guard)

    def acquire(self, nbytes: int, stream: Any) -> Any:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                buf, guard = free.pop()
                if guard is not None:  # (None: copies are synchronous, the buffer is idle)
                    self._order_reuse_after_guard(stream, guard)
            else:
                size = self._b.host_alloc_size(nbytes)
                if self.limit_bytes is not None and self.reserved_bytes + size > self.limit_bytes:
                    self._evict_idle(self.reserved_bytes + size - self.limit_bytes)
                    if self.reserved_bytes + size > self.limit_bytes:
                        return None
                buf = self._b.empty_host_bytes(nbytes)
                self._all[id(buf)] = buf
                self.reserved_bytes += size
                self.allocations += 1
            self.in_use_bytes += nbytes
            return buf

    def release(self, buf: Any, nbytes: int, guard: Any) -> None:
        with self._lock:
            self.in_use_bytes -= nbytes
            self._free[nbytes].append((buf, guard))

    def _evict_idle(self, need: int) -> None:
        """Free idle buffers (largest first) until ``need`` bytes are released or none is idle:
        under a cap, a new tensor size (another sequence length) must not be refused while
        buffers of sizes no longer used sit idle. Freeing is safe: the framework's pinned
        allocator keeps a buffer until the copies that used it have completed. The freed blocks
        are then returned from the framework's host cache to the OS, so that the cap bounds the
        process's pinned memory, not only the pool's."""
        freed = False
        for size in sorted(self._free, reverse=True):
            entries = self._free[size]
            reserved = self._b.host_alloc_size(size)
            while entries and need > 0:
                entries.pop()
                self.reserved_bytes -= reserved
                need -= reserved
                freed = True
            if not entries:
                del self._free[size]
            if need <= 0:
                break
        if freed:
            self._b.empty_host_cache()

    def release_idle(self) -> int:
        """Free every idle buffer (back to the OS); returns the bytes released."""
        with self._lock:
            before = self.reserved_bytes
            self._evict_idle(before)
            return before - self.reserved_bytes
