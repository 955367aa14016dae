"""Measure the peak device memory of a code region (PyTorch).

::

    from hyper_parallel.tools.memory import MemoryMeter, mark_host, is_host_storage

Two ways of measuring, chosen by the meter's device:

* **Accelerators** (cuda, npu, xpu, ...): the caching allocator already keeps exact
  counters, so the meter only resets the peak counter at ``__enter__`` and reads
  ``memory_allocated`` / ``max_memory_allocated`` afterwards.
* **CPU**: there is no allocator to ask, so the meter counts live tensor *storages*
  itself. A ``TorchDispatchMode`` sees the output of every ATen op (forward, backward
  and optimizer alike), registers each new output storage once (views share their
  base's storage, so they count once) and a weak reference on the storage subtracts
  its bytes again when the storage dies.

Host buffers owned by the library (swap copies) live on the CPU too; on the CPU meter
they would be indistinguishable from "device" memory: the PyTorch backend marks every host
buffer it allocates for the engine (``empty_host_bytes``) with :func:`mark_host`, which any other
code may call for its own host buffers. Importing this module registers nothing.

Example::

    >>> import torch
    >>> from hyper_parallel.tools.memory import MemoryMeter
    >>> model = torch.nn.Linear(256, 256)
    >>> with MemoryMeter("cpu", track=[model]) as meter:
    ...     model(torch.randn(32, 256)).sum().backward()
    >>> meter.peak_bytes >= meter.baseline_bytes + 256 * 256 * 4   # the weight's gradient
    True
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, Union

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten

from hyper_parallel.tools.gc_pause import live_objects

__all__ = ["MemoryMeter", "mark_host", "host_allocation", "is_host_storage"]

DeviceLike = Union[str, torch.device, None]

# --------------------------------------------------------------------------------------
# Host-buffer registry
# --------------------------------------------------------------------------------------

# Storages marked as host buffers, keyed by ``id(storage)``. The value is a weak reference
# whose callback drops the key when the storage dies, so an id reused by a later storage is
# never mistaken for a marked one. (Keyed by id rather than a ``WeakSet`` so that we never
# depend on ``UntypedStorage.__eq__``/``__hash__`` semantics.)
_HOST_STORAGES: dict[int, weakref.ref] = {}
_HOST_LOCK = threading.Lock()

# CPU trackers of meters that are currently inside their region; ``mark_host`` and the
# ``UntypedStorage.resize_`` hook must reach all of them.
_ACTIVE_CPU_TRACKERS: "weakref.WeakSet[_CpuStorageTracker]" = weakref.WeakSet()


def _as_storage(t: Union[torch.Tensor, torch.UntypedStorage]) -> torch.UntypedStorage:
    if isinstance(t, torch.Tensor):
        return t.untyped_storage()
    if isinstance(t, torch.UntypedStorage):
        return t
    if isinstance(t, torch.TypedStorage):  # legacy typed storages wrap an untyped one
        return t.untyped_storage()
    raise TypeError(f"expected a Tensor or UntypedStorage, got {type(t).__name__}")


def mark_host(t: Union[torch.Tensor, torch.UntypedStorage]) -> None:
    """Declare the storage of ``t`` a host buffer owned by the library (e.g. a swap copy).

    The CPU :class:`MemoryMeter` then never counts it as device memory: not in meters
    entered later, and not in meters already running (if such a meter had already
    registered the storage, its bytes are removed from that meter's current count).
    The mark lives as long as the storage; views of ``t`` share it.

    Call it right after allocating the buffer, before running any other tensor op: the CPU
    meter then treats the buffer as if it had never been counted, so it cannot inflate
    the peak either.

    Example::

        >>> import torch
        >>> from hyper_parallel.tools.memory import MemoryMeter, mark_host
        >>> with MemoryMeter("cpu") as m:
        ...     buf = torch.empty(1 << 20)   # 4 MiB "swap copy"
        ...     mark_host(buf)
        ...     act = torch.empty(1 << 18)   # 1 MiB activation
        >>> m.peak_above_baseline == act.nbytes
        True
    """
    st = _as_storage(t)
    key = id(st)
    with _HOST_LOCK:
        old = _HOST_STORAGES.get(key)
        if old is None or old() is not st:

            def _unmark(ref: weakref.ref, key: int = key) -> None:
                with _HOST_LOCK:
                    if _HOST_STORAGES.get(key) is ref:
                        del _HOST_STORAGES[key]

            _HOST_STORAGES[key] = weakref.ref(st, _unmark)
    for tracker in list(_ACTIVE_CPU_TRACKERS):
        tracker.forget(st)


_HOSTING = threading.local()


@contextlib.contextmanager
def host_allocation() -> Iterator[None]:
    """The ops inside allocate host buffers: no CPU meter counts their outputs, nor checks its
    ``cap`` on them (a device's allocator never sees host memory). Mark each buffer with
    :func:`mark_host` as well: the mark is what keeps meters entered later from counting it.

    Example::

        >>> import torch
        >>> from hyper_parallel.tools.memory import MemoryMeter, host_allocation, mark_host
        >>> with MemoryMeter("cpu", scan_gc=False, cap=1 << 20) as m:
        ...     with host_allocation():
        ...         buf = torch.empty(1 << 20)   # 4 MiB of host buffer, past the 1 MiB cap: allowed
        ...     mark_host(buf)
        >>> m.peak_bytes
        0
    """
    _HOSTING.depth = getattr(_HOSTING, "depth", 0) + 1
    try:
        yield
    finally:
        _HOSTING.depth -= 1


def _allocating_host() -> bool:
    return getattr(_HOSTING, "depth", 0) > 0


def is_host_storage(t: Union[torch.Tensor, torch.UntypedStorage]) -> bool:
    """Return whether the storage of ``t`` was marked with :func:`mark_host`.

    Example::

        >>> import torch
        >>> from hyper_parallel.tools.memory import mark_host, is_host_storage
        >>> buf = torch.empty(8)
        >>> is_host_storage(buf)
        False
        >>> mark_host(buf)
        >>> is_host_storage(buf[2:]), is_host_storage(buf.untyped_storage())
        (True, True)
    """
    st = _as_storage(t)
    ref = _HOST_STORAGES.get(id(st))
    return ref is not None and ref() is st


# --------------------------------------------------------------------------------------
# CPU path: storage accounting
# --------------------------------------------------------------------------------------


def local_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors holding ``t``'s data: ``t`` itself, or a wrapper subclass's inner tensors,
    recursively (a wrapper owns no data itself: FSDP2's DTensor parameters hold their local shard)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from local_tensors(inner)
    else:
        yield t


def _storages_of(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """Yield the storages that back ``t`` (recursing into wrapper subclasses)."""
    for inner in local_tensors(t):
        try:
            yield inner.untyped_storage()
        except (RuntimeError, NotImplementedError):
            # Sparse / nested / functional tensors have no single untyped storage.
            continue


class _CpuStorageTracker:
    """Live-byte counter over CPU storages, fed by registrations and weakref deaths.

    Peak bookkeeping is *deferred*: an addition only marks the peak as pending, and the
    pending value is committed right before anything lowers ``current`` (a death, a
    shrink) or when someone reads the peak. The value committed is the same as checking
    at registration time, except that :meth:`forget` (``mark_host``) may remove bytes
    without committing first, so a host buffer marked right after its allocation never
    shows up in the peak.
    """

    def __init__(self) -> None:
        # id(storage) -> [weakref to the storage, bytes accounted]
        self._entries: dict[int, list[Any]] = {}
        # RLock: a weakref callback can fire on this thread while we hold the lock
        # (e.g. a dealloc triggered inside our own bookkeeping).
        self._lock = threading.RLock()
        self.current = 0
        self._peak = 0
        self._pending = False
        self.active = False
        self._holders: dict[int, weakref.ref] = {}  # id(storage) -> its holder (``count_until``)
        self._ignored: dict[int, weakref.ref] = {}  # id(storage) -> the storage, never counted (``ignore``)
        self._held: dict[int, weakref.ref] = {}  # id(ref) -> a holder of a dead storage still counted

    # -- peak ------------------------------------------------------------------------
    def _commit(self) -> None:
        if self._pending:
            if self.current > self._peak:
                self._peak = self.current
            self._pending = False

    @property
    def peak(self) -> int:
        with self._lock:
            self._commit()
            return self._peak

    def reset_peak(self) -> None:
        with self._lock:
            self._pending = False
            self._peak = self.current

    # -- registration ----------------------------------------------------------------
    def register_storage(self, st: torch.UntypedStorage) -> None:
        if st.device.type != "cpu":  # meta, fake and real accelerator storages
            return
        key = id(st)
        with self._lock:
            if not self.active:
                return
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is st:
                # Already counted; only a resize (tensor.resize_, set_) changes its bytes.
                self._update_size(entry, st)
                return
            if is_host_storage(st):
                return
            ignored = self._ignored.get(key)
            if ignored is not None and ignored() is st:
                return
            nbytes = int(st.nbytes())
            if not st.resizable() and self._inside_counted(st.data_ptr(), nbytes):
                # A storage over part of a counted one's memory (a slice, e.g. a slot of the swap
                # engine's bucket buffer: ``UntypedStorage[a:b]``): no new bytes. Allocations
                # are resizable, so only such slices and foreign memory (from_blob) look here.
                return
            ref = weakref.ref(st, self._on_death_cb(key))
            self._entries[key] = [ref, nbytes]
            self._add(nbytes)

    def _inside_counted(self, ptr: int, nbytes: int) -> bool:
        for ref, counted in self._entries.values():
            other = ref()
            if other is not None and counted and other.data_ptr() <= ptr and ptr + nbytes <= other.data_ptr() + counted:
                return True
        return False

    def refused(self, peak: int) -> None:
        """The outputs just registered were refused (a cap): the peak goes back to ``peak``, the
        one before them; their bytes leave as they die."""
        with self._lock:
            self._pending, self._peak = False, peak

    def register_tensor(self, t: torch.Tensor) -> None:
        for st in _storages_of(t):
            self.register_storage(st)

    def register_tree(self, out: Any) -> None:
        leaves, _ = tree_flatten(out)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self.register_tensor(leaf)

    def _add(self, nbytes: int) -> None:
        if nbytes > 0:
            self.current += nbytes
            self._pending = True

    def _sub(self, nbytes: int, commit: bool = True) -> None:
        if commit:
            self._commit()
        self.current -= nbytes

    def _update_size(self, entry: list[Any], st: torch.UntypedStorage) -> None:
        new = int(st.nbytes())
        old = entry[1]
        if new == old:
            return
        entry[1] = new
        if new > old:
            self._add(new - old)
        else:
            self._sub(old - new)

    def _on_death_cb(self, key: int) -> Callable[[weakref.ref], None]:
        def _on_death(ref: weakref.ref) -> None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry[0] is ref:
                    del self._entries[key]
                    holder = self._holders.pop(key, None)
                    holder = holder() if holder is not None else None
                    if holder is None:
                        self._sub(entry[1])
                    else:  # (its bytes stay counted until the holder dies: ``count_until``)
                        held = weakref.ref(holder, self._on_release_cb(entry[1]))
                        self._held[id(held)] = held

        return _on_death

    def _on_release_cb(self, nbytes: int) -> Callable[[weakref.ref], None]:
        def _on_release(ref: weakref.ref) -> None:
            with self._lock:
                if self.active and self._held.pop(id(ref), None) is not None:
                    self._sub(nbytes)

        return _on_release

    def ignore(self, st: torch.UntypedStorage) -> None:
        """Stop counting ``st``, now and whenever an op shows it again, while it lives."""
        with self._lock:
            self._ignored[id(st)] = weakref.ref(st, lambda _, key=id(st): self._ignored.pop(key, None))
        self.forget(st)

    def count_until(self, st: torch.UntypedStorage, holder: Any) -> None:
        """Keep counting ``st`` (if counted) after it dies, until ``holder`` dies."""
        with self._lock:
            entry = self._entries.get(id(st))
            if entry is not None and entry[0]() is st:
                self._holders[id(st)] = weakref.ref(holder)

    # -- external notifications ------------------------------------------------------
    def forget(self, st: torch.UntypedStorage) -> None:
        """Stop counting ``st`` (it became a host buffer). Does not commit the peak."""
        with self._lock:
            entry = self._entries.get(id(st))
            if entry is not None and entry[0]() is st:
                del self._entries[id(st)]
                self._sub(entry[1], commit=False)

    def resized(self, st: torch.UntypedStorage) -> None:
        with self._lock:
            entry = self._entries.get(id(st))
            if entry is not None and entry[0]() is st:
                self._update_size(entry, st)

    def close(self) -> None:
        with self._lock:
            self._commit()
            self.active = False
            # Dropping the weakrefs also drops their callbacks: nothing fires after exit.
            self._entries.clear()
            self._holders.clear()
            self._held.clear()
            self._ignored.clear()


class _StorageTrackingMode(TorchDispatchMode):
    """Dispatch mode that hands every op's outputs to a :class:`_CpuStorageTracker`; with a
    ``cap``, an op whose outputs take the live bytes past it fails as an allocation would."""

    def __init__(self, tracker: _CpuStorageTracker, cap: Optional[int] = None) -> None:
        super().__init__()
        self._tracker = tracker
        self._cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if _allocating_host():  # (host buffers: never device memory)
            return func(*args, **(kwargs or {}))
        if self._cap is None:
            out = func(*args, **(kwargs or {}))
            self._tracker.register_tree(out)
            return out
        tracker = self._tracker
        before = tracker.peak  # (settles the peak: every byte live before this op was allowed)
        out = func(*args, **(kwargs or {}))
        tracker.register_tree(out)
        live = tracker.current
        if live <= self._cap:
            return out
        tracker.refused(before)
        del out  # (its storages die here, as a refused allocation never lives)
        raise torch.OutOfMemoryError(
            f"MemoryMeter: {func} would take the live bytes to {live} ({live / 2**20:.1f} MiB), past the meter's cap "
            f"of {self._cap} bytes ({self._cap / 2**20:.1f} MiB): an allocator stand-in for the CPU, raising as a "
            "device's allocator does when its memory runs out")


# ``UntypedStorage.resize_`` is a plain method that bypasses the dispatcher on CPU, yet
# offloading code commonly frees a buffer in place with ``storage.resize_(0)``. While at
# least one CPU meter is active we wrap it. Each installation is a fresh closure over
# whatever ``resize_`` was at that moment, so wrappers only ever call older callables (no
# cycles even when others, e.g. MemTracker, patch/restore around us). If someone patched
# on top of us by the time the last meter exits, our wrapper stays in their chain; it then
# notifies no tracker (none active) or notifies idempotently, so it is harmless.
_RESIZE_LOCK = threading.Lock()
_resize_users = 0
_resize_hook: Any = None


def _install_resize_hook() -> None:
    global _resize_users, _resize_hook
    with _RESIZE_LOCK:
        _resize_users += 1
        if _resize_users > 1:
            return
        prev = torch.UntypedStorage.resize_

        @functools.wraps(prev)
        def resize_(self: torch.UntypedStorage, size: int) -> Any:
            out = prev(self, size)
            for tracker in list(_ACTIVE_CPU_TRACKERS):
                tracker.resized(self)  # idempotent: re-reads nbytes()
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        _resize_hook = (resize_, prev)


def _remove_resize_hook() -> None:
    global _resize_users, _resize_hook
    with _RESIZE_LOCK:
        _resize_users -= 1
        if _resize_users > 0 or _resize_hook is None:
            return
        hook, prev = _resize_hook
        if torch.UntypedStorage.resize_ is hook:
            torch.UntypedStorage.resize_ = prev  # type: ignore[method-assign]
        _resize_hook = None


def _iter_tracked_tensors(objs: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Tensors held by modules, optimizers or given directly (nested containers allowed)."""
    leaves, _ = tree_flatten(list(objs))
    for obj in leaves:
        if obj is None:
            continue
        if isinstance(obj, torch.Tensor):
            yield obj
            if obj.grad is not None:
                yield obj.grad
        elif isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for p in group["params"]:
                    yield p
                    if p.grad is not None:
                        yield p.grad
            state_leaves, _ = tree_flatten(list(obj.state.values()))
            for v in state_leaves:
                if isinstance(v, torch.Tensor):
                    yield v
        else:
            raise TypeError(
                "MemoryMeter(track=...) accepts nn.Module, torch.optim.Optimizer and "
                f"Tensor objects, got {type(obj).__name__}"
            )


def _register_gc_tensors(tracker: _CpuStorageTracker) -> None:
    """Register every live CPU storage reachable as a Python object.

    Cost: one pass over ``gc.get_objects()`` (roughly 50-100 ms per 100k objects). We test
    ``type(obj)`` instead of ``isinstance`` because the latter may evaluate a ``__class__``
    property on arbitrary objects (some emit warnings or raise). Tensors that exist only
    in C++ (e.g. activations saved by an autograd graph whose Python tensor was dropped
    before the meter was entered) are invisible here.
    """
    storages, tensors = live_objects(torch.UntypedStorage, torch.Tensor)
    for storage in storages:
        tracker.register_storage(storage)
    for tensor in tensors:
        tracker.register_tensor(tensor)


# --------------------------------------------------------------------------------------
# Accelerator path: allocator counters
# --------------------------------------------------------------------------------------


class _AllocatorStats:
    """Thin adapter over ``torch.accelerator`` (or the device module on older torch)."""

    _FUNCS = ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "synchronize")

    def __init__(self, device: torch.device) -> None:
        acc = getattr(torch, "accelerator", None)
        cur = acc.current_accelerator() if acc is not None else None
        use_acc = (
            cur is not None
            and cur.type == device.type
            and all(hasattr(acc, f) for f in self._FUNCS)
        )
        self._api: Any = acc if use_acc else torch.get_device_module(device)
        if device.index is not None:
            index = device.index
        elif use_acc:
            index = acc.current_device_index()
        else:
            index = self._api.current_device()
        self.device = torch.device(device.type, index)
        self._index = index

    def allocated(self) -> int:
        return int(self._api.memory_allocated(self._index))

    def max_allocated(self) -> int:
        return int(self._api.max_memory_allocated(self._index))

    def reset_peak(self) -> None:
        self._api.reset_peak_memory_stats(self._index)

    def synchronize(self) -> None:
        self._api.synchronize(self._index)


# Accelerator meters inside their region, so that a nested meter resetting the allocator's
# peak counter can first hand the peak seen so far to the enclosing meters.
_ACTIVE_ALLOCATOR_METERS: list["MemoryMeter"] = []


# --------------------------------------------------------------------------------------
# Public meter
# --------------------------------------------------------------------------------------


def _resolve_device(device: DeviceLike) -> torch.device:
    if device is None:
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            cur = acc.current_accelerator()
            if cur is not None:
                return cur
        return torch.device("cpu")
    return torch.device(device)


class MemoryMeter:
    """Peak device bytes of a code region.

    Use it as a context manager; afterwards (and live, inside the region) it reports

    * ``baseline_bytes``: live device bytes at ``__enter__``,
    * ``peak_bytes``: the highest number of live device bytes seen inside the region
      (absolute, baseline included),
    * ``current_bytes``: live device bytes now (inside the region) or at ``__exit__``,
    * ``peak_above_baseline``: ``peak_bytes - baseline_bytes``.

    Args:
        device: ``str`` / ``torch.device``; ``None`` picks the current accelerator when one
            is available, else ``"cpu"``.
        track: modules, optimizers and tensors whose existing tensors (parameters, buffers,
            ``.grad``, optimizer state) belong in the CPU baseline. Nested lists are fine.
        scan_gc: CPU only. Also put every live CPU tensor found through
            ``gc.get_objects()`` into the baseline (one pass over all Python objects,
            about 50-100 ms per 100k objects). Turn it off to count only ``track`` plus what the
            region allocates.
        cap: CPU only. Bytes the live storages may not pass: an op whose outputs would take
            them past it raises ``torch.OutOfMemoryError`` (its outputs freed, the peak left
            where it was), as a device's allocator does when its memory runs out. Tests run a
            step "on a device of ``cap`` bytes" this way. (On an accelerator the allocator
            caps itself: ``torch.cuda.set_per_process_memory_fraction``.)

    On an accelerator the allocator's own counters are used (``memory_allocated`` /
    ``max_memory_allocated``; the device is synchronized at enter and exit, and the
    allocator's peak counter is reset at enter). On CPU the meter counts live tensor
    storages itself, deduplicated by storage (a view counts once), through a
    ``TorchDispatchMode`` that sees every op output, including the backward pass and the
    optimizer step. Storages marked with :func:`mark_host` are never counted.

    CPU caveats: memory that never passes through an ATen op is not seen (e.g.
    ``torch.from_numpy``, kernel-internal scratch space, tensors made under
    ``no_dispatch``). When combined with other dispatch modes, enter the meter *first*
    (outermost): ops that another mode issues from inside its own ``__torch_dispatch__``
    only reach modes below it on the stack.

    Example::

        >>> import torch
        >>> from hyper_parallel.tools.memory import MemoryMeter
        >>> with MemoryMeter("cpu") as m:
        ...     x = torch.empty(1 << 20)        # 4 MiB
        ...     y = x.view(1024, 1024)          # a view: no new bytes
        ...     del x, y
        >>> m.peak_above_baseline == 4 << 20, m.current_bytes == m.baseline_bytes
        (True, True)
    """

    def __init__(
        self,
        device: DeviceLike = None,
        track: Iterable[Any] = (),
        *,
        scan_gc: bool = True,
        cap: Optional[int] = None,
    ) -> None:
        self.device: torch.device = _resolve_device(device)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"MemoryMeter(cap=...): the cap is a number of bytes (an int >= 0), got {cap!r}")
        if cap is not None and self.device.type != "cpu":
            raise ValueError(f"MemoryMeter(cap=...) caps the CPU's live storages; on {self.device} the allocator caps "
                             "itself: torch.cuda.set_per_process_memory_fraction (or the device's own limit)")
        self.cap = cap
        self._track = list(track)
        self._scan_gc = scan_gc
        self._active = False
        # Frozen results (valid after __exit__; zero before the first __enter__).
        self._baseline = 0
        self._peak = 0
        self._current = 0
        # CPU path state
        self._tracker: Optional[_CpuStorageTracker] = None
        self._mode: Optional[_StorageTrackingMode] = None
        # Accelerator path state
        self._stats: Optional[_AllocatorStats] = None
        self._folded_peak = 0  # peak carried over resets made by nested meters

    @property
    def is_cpu(self) -> bool:
        """Whether this meter counts storages itself (CPU) rather than asking an allocator."""
        return self.device.type == "cpu"

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> "MemoryMeter":
        if self._active:
            raise RuntimeError("MemoryMeter is already active; it cannot be re-entered")
        if self.is_cpu:
            self._enter_cpu()
        else:
            self._enter_accelerator()
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._active:
            return
        try:
            if self.is_cpu:
                self._exit_cpu(*exc)
            else:
                self._exit_accelerator()
        finally:
            self._active = False

    def _enter_cpu(self) -> None:
        tracker = _CpuStorageTracker()
        tracker.active = True
        for t in _iter_tracked_tensors(self._track):
            tracker.register_tensor(t)
        if self._scan_gc:
            _register_gc_tensors(tracker)
        tracker.reset_peak()
        self._baseline = self._peak = self._current = self._folded_peak = tracker.current
        # Make the tracker reachable by mark_host / resize_ before any op can run.
        _ACTIVE_CPU_TRACKERS.add(tracker)
        _install_resize_hook()
        self._tracker = tracker
        if self.cap is not None and tracker.current > self.cap:
            tracker.close()
            raise torch.OutOfMemoryError(f"MemoryMeter: {tracker.current} bytes are live at the start, past the "
                                         f"meter's cap of {self.cap} bytes")
        self._mode = _StorageTrackingMode(tracker, self.cap)
        self._mode.__enter__()

    def _exit_cpu(self, *exc: Any) -> None:
        tracker, mode = self._tracker, self._mode
        assert tracker is not None and mode is not None
        try:
            mode.__exit__(*exc)
        finally:
            self._peak = max(self._folded_peak, tracker.peak)
            self._current = tracker.current
            tracker.close()
            _ACTIVE_CPU_TRACKERS.discard(tracker)
            _remove_resize_hook()
            self._tracker = self._mode = None

    def _enter_accelerator(self) -> None:
        stats = _AllocatorStats(self.device)
        stats.synchronize()  # let queued frees/allocs settle before reading the counters
        for outer in _ACTIVE_ALLOCATOR_METERS:
            # Our reset wipes the allocator peak the enclosing meters rely on.
            if outer._stats is not None and outer._stats.device == stats.device:
                outer._folded_peak = max(outer._folded_peak, stats.max_allocated())
        stats.reset_peak()
        self._stats = stats
        self._baseline = self._current = self._folded_peak = stats.allocated()
        self._peak = self._baseline
        _ACTIVE_ALLOCATOR_METERS.append(self)

    def _exit_accelerator(self) -> None:
        stats = self._stats
        assert stats is not None
        try:
            stats.synchronize()
            self._peak = max(self._folded_peak, stats.max_allocated())
            self._current = stats.allocated()
        finally:
            if self in _ACTIVE_ALLOCATOR_METERS:
                _ACTIVE_ALLOCATOR_METERS.remove(self)
            self._stats = None

    # -- results ---------------------------------------------------------------------
    @property
    def baseline_bytes(self) -> int:
        """Live device bytes at ``__enter__``."""
        return self._baseline

    @property
    def peak_bytes(self) -> int:
        """Highest live device bytes seen in the region so far (baseline included)."""
        if self._active:
            if self._tracker is not None:
                return max(self._folded_peak, self._tracker.peak)
            if self._stats is not None:
                return max(self._folded_peak, self._stats.max_allocated())
        return self._peak

    @property
    def current_bytes(self) -> int:
        """Live device bytes now (inside the region) or at ``__exit__`` (afterwards)."""
        if self._active:
            if self._tracker is not None:
                return self._tracker.current
            if self._stats is not None:
                return self._stats.allocated()
        return self._current

    def reset_peak(self) -> int:
        """Return the highest live device bytes since the meter was entered (or since the last
        ``reset_peak``) and start a new window at the bytes live now; :attr:`peak_bytes` keeps
        reporting the whole region's peak. Splits one region into phases (a memory planner marks
        every layer's forward and backward this way).

        Example::

            >>> import torch
            >>> from hyper_parallel.tools.memory import MemoryMeter
            >>> with MemoryMeter("cpu", scan_gc=False) as m:
            ...     big = torch.empty(1 << 20); del big     # 4 MiB, gone again
            ...     first = m.reset_peak()
            ...     small = torch.empty(1 << 10)            # 4 KiB
            ...     second = m.reset_peak()
            >>> first - m.baseline_bytes, second - m.baseline_bytes, m.peak_above_baseline
            (4194304, 4096, 4194304)
        """
        if not self._active:
            raise RuntimeError("MemoryMeter.reset_peak() is only valid inside the meter's region")
        if self._tracker is not None:
            peak = self._tracker.peak
            self._tracker.reset_peak()
        else:
            assert self._stats is not None
            self._stats.synchronize()
            peak = self._stats.max_allocated()
            self._stats.reset_peak()
        self._folded_peak = max(self._folded_peak, peak)
        return peak

    def count_until(self, storage: torch.UntypedStorage, holder: Any) -> None:
        """CPU only: go on counting ``storage`` (if this meter counts it) after it dies, until
        ``holder`` dies. A memory planner moving what autograd saves to the host counts, this
        way, the memory the step would hold with it left on the device: the storage dies when
        moved, autograd's hold on its host copy (the holder) ends when the device would free it."""
        if self._tracker is None:
            raise RuntimeError("MemoryMeter.count_until() is for a CPU meter, inside its region")
        self._tracker.count_until(storage, holder)

    def uncount(self, storage: torch.UntypedStorage) -> None:
        """CPU only: stop counting ``storage`` in this meter alone, for as long as it lives (its
        bytes are counted otherwise, e.g. through :meth:`count_until`); the peak is not touched."""
        if self._tracker is None:
            raise RuntimeError("MemoryMeter.uncount() is for a CPU meter, inside its region")
        self._tracker.ignore(storage)

    @property
    def peak_above_baseline(self) -> int:
        """``peak_bytes - baseline_bytes``: what the region added at its worst moment."""
        return self.peak_bytes - self.baseline_bytes

    def __repr__(self) -> str:
        mib = float(1 << 20)
        return (
            f"MemoryMeter(device={str(self.device)!r}, baseline={self.baseline_bytes / mib:.2f} MiB, "
            f"peak={self.peak_bytes / mib:.2f} MiB, current={self.current_bytes / mib:.2f} MiB)"
        )


# The swap engine's host copies are host memory, never device memory.
