"""``SwapManager``: the process-wide owner of every swap group and of the copy stream."""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from .backend import Backend, active_backend
from .host_pool import HostBufferPool
from .layer_chain import LayerChain
from .storage import Storage
from .swap_bucket import SLOT_ALIGN
from .swap_group import GroupStats, SwapGroup

__all__ = ["SwapManager", "DEFAULT_GROUP"]

DEFAULT_GROUP = "default"
_RETIRED_NAMES = 1024  # how many names of forgotten groups are remembered
_RETIRED_STATS = 64    # how many forgotten groups keep their own entry in stats()["groups"]


class _Locked:
    """``with manager._locked:``: a class rather than a generator context manager, because the
    swap path takes the lock several times per layer."""

    __slots__ = ("_m",)

    def __init__(self, manager: "SwapManager") -> None:
        self._m = manager

    def __enter__(self) -> None:
        m = self._m
        m.lock.acquire()
        try:
            while m._deferred:
                m._storage_gone(*m._deferred.pop())
        except BaseException:
            m.lock.release()
            raise

    def __exit__(self, *exc: Any) -> None:
        self._m.lock.release()


class SwapManager:
    """Process-wide singleton that schedules all host<->device activation traffic.

    Four layers: ``SwapManager -> SwapGroup (by name) -> Storage (what one region saved in one
    forward) -> SwapTensor``. Regions (``checkpoint_wrapper`` with ``MUST_SWAP`` ops or
    ``swap_inputs=True``, ``swap_wrapper``) add a ``Storage`` to the *current* group; a schedule
    moves whole groups.

    Two ways to schedule:

    - per layer: ``set_forward_prefetch_layer(first, second)`` for consecutive layers; offload and
      prefetch then happen automatically from module hooks;
    - atomic, for pipeline schedules: ``set_current_group_name``, ``launch_offload``,
      ``wait_offload``, ``launch_load``, ``wait_load``.

    If nothing ever launches an offload, swapped tensors simply stay on the device (= SAVE).

    Thread safety: module and autograd hooks may call in from several threads (autograd runs one
    thread per device); every public method holds the manager's re-entrant lock, and so do the
    layer chain's hooks. Finalizers (a region's graph dying, in any thread)
    never wait for it: what they would do is deferred to the next public call that takes it
    (``new_storage``, run by every region, for instance).

    Example (atomic API on one micro-batch)::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper
        >>> block = swap_wrapper(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()))
        >>> mgr = SwapManager()
        >>> mgr.set_current_group_name("mb0")
        >>> loss = block(torch.randn(4, 8)).sum()
        >>> mgr.set_current_group_name(None)
        >>> mgr.launch_offload("mb0"); mgr.wait_offload("mb0")   # activations now on the host
        >>> mgr.launch_load("mb0"); mgr.wait_load("mb0")         # ... and back
        >>> loss.backward()
    """

    _instance: Optional["SwapManager"] = None
    _lock = threading.Lock()

    def __new__(cls) -> "SwapManager":
        inst = cls._instance
        if inst is not None:  # every region calls this: no lock once the singleton exists
            return inst
        with cls._lock:
            if cls._instance is None:
                inst = super().__new__(cls)
                inst._init()
                cls._instance = inst
        return cls._instance

    def _init(self) -> None:
        self.lock = threading.RLock()
        #: ``with manager._locked:``, the manager's lock; entering it first forgets the groups whose
        #: last storage died while the lock was held elsewhere
        self._locked = _Locked(self)
        # (group, tally) of storages that died while the lock was held
        self._deferred: List[Tuple[str, List[int]]] = []
        self._chain = LayerChain(self)  # cleared, never replaced: it may still receive hook calls
        self._start()

    def _start(self) -> None:
        """The state :meth:`reset` forgets: groups, statistics, settings, the host pool."""
        # The backend is read again at each reset: a test or tool may have switched it
        # (core.backend.use_backend).
        self.backend: Backend = active_backend()
        self._groups: Dict[str, SwapGroup] = {}
        self._retired: "OrderedDict[str, None]" = OrderedDict()
        self._stats: Dict[str, GroupStats] = {}
        # Statistics of forgotten groups, folded together: a fresh name per step or micro-batch
        # must not grow stats() without bound.
        self._retired_stats = GroupStats()
        self._retired_groups = 0
        self._recent_retired: "OrderedDict[str, None]" = OrderedDict()
        self._current_group_name: Optional[str] = None
        self._copy_streams: Dict[Any, Any] = {}  # device -> the manager's copy stream there
        self._prefetch_budget: Optional[int] = None
        self._bucket_bytes = 0  # bucketed copies are opt-in (see set_bucket_bytes)
        self._pool = HostBufferPool(self.backend)  # (a new pool: the host limit goes back to "none" too)
        self._warned_unscheduled = False

    # ------------------------------------------------------------------ groups
    def _group(self, name: str, create: bool = False, persistent: bool = False) -> SwapGroup:
        group = self._groups.get(name)
        if group is None:
            if not create:
                known = ", ".join(repr(n) for n in sorted(self._groups)) or "none"
                raise KeyError(f"unknown swap group {name!r}; known groups: {known}. Groups are created "
                               "by set_current_group_name, add_storage or set_forward_prefetch_layer.")
            self._retired.pop(name, None)
            self._recent_retired.pop(name, None)
            stats = self._stats.setdefault(name, GroupStats())
            group = self._groups[name] = SwapGroup(name, self.backend, stats, self._pool, self._copy_stream_for,
                                                    persistent)
            group.bucket_bytes = self._bucket_bytes
        elif persistent:
            group.persistent = True
        return group

    def new_storage(self, group_name: Optional[str] = None) -> Storage:
        """Create the :class:`Storage` of one region's forward in ``group_name`` (default: the
        current group) and register it there. Used by the wrappers; rarely needed directly."""
        if group_name is not None and (not isinstance(group_name, str) or not group_name):
            raise TypeError(f"new_storage: the group name must be a non-empty str or None, got {group_name!r}")
        with self._locked:
            name = group_name or self._current_group_name or DEFAULT_GROUP
            group = self._group(name, create=True)
            storage = Storage(group)
            self._add_storage(group, storage, new=True)
            self._chain.storage_made(storage)
            return storage

    def add_storage(self, group_name: str, storage: Storage) -> None:
        """Add ``storage`` to group ``group_name`` (created if new). The group holds it weakly:
        it leaves the group when the autograd graph that references it dies."""
        if not isinstance(group_name, str) or not group_name:
            raise TypeError(f"add_storage: the group name must be a non-empty str, got {group_name!r}")
        if not isinstance(storage, Storage):
            raise TypeError(f"add_storage expects a swap Storage (as made by SwapManager().new_storage()), got "
                            f"{type(storage).__name__}; to swap a module's activations wrap it with swap_wrapper "
                            "or checkpoint_wrapper instead.")
        with self._locked:
            self._add_storage(self._group(group_name, create=True), storage)

    def _add_storage(self, group: SwapGroup, storage: Storage, new: bool = False) -> None:
        """``add_storage`` once the arguments are known good and the lock is held (``new``: made
        by ``new_storage`` just now)."""
        group.add(storage, new)
        weakref.finalize(storage, self._forget_later, group.name, storage.candidate_tally)

    def _forget_later(self, name: str, tally: List[int]) -> None:
        """Finalizer of a storage: :meth:`_storage_gone` now if the lock is free (or held by this
        thread), else at the next public call that takes it through ``_locked`` (a finalizer must
        never block: the thread holding the lock may be waiting for this one's)."""
        if self.lock.acquire(blocking=False):
            try:
                self._storage_gone(name, tally)
            finally:
                self.lock.release()
        else:
            self._deferred.append((name, tally))

    def _storage_gone(self, name: str, tally: List[int]) -> None:
        """A storage of group ``name`` died holding ``tally[0]`` bytes of swap candidates. If
        nothing ever offloaded that group (no layer chain, no ``launch_offload``), they stayed on
        the device: counted as unscheduled, and said once."""
        group = self._groups.get(name)
        if tally[0] and group is not None and not group.persistent and not group.stats.offload_launches:
            group.stats.unscheduled_bytes += tally[0]
            if not self._warned_unscheduled:
                self._warned_unscheduled = True
                warnings.warn(
                    f"hyper_parallel: {tally[0]} bytes of swap candidates (swap_wrapper, MUST_SWAP or swap_inputs) in "
                    f"swap group {name!r} stayed on the device because nothing offloads that group: chain the layers "
                    "(wrap_layers, or SwapManager().set_forward_prefetch_layer) or schedule the group "
                    f"(SwapManager().launch_offload({name!r}) / wait_offload / launch_load / wait_load). They were "
                    "kept as with SAVE; stats()['unscheduled_bytes'] counts them. (Said once per process.)",
                    UserWarning, stacklevel=2)
        self._forget_if_empty(name)

    def _forget_if_empty(self, name: str) -> None:
        """Called when a storage of group ``name`` dies (and after waits). A group whose storages
        all died has nothing left to move, even if a launch was never waited (a skipped step):
        its pending state goes, and unless the layer chain owns it or it is current, the group
        goes too, so per-step or per-micro-batch names never accumulate."""
        group = self._groups.get(name)
        if group is None or group.has_live_storage():
            return
        group.forget_in_flight()
        if not group.persistent and name != self._current_group_name:
            self._retire(name)
            # Remember the name for a while: a wait or launch on it after its graph died (the
            # graph of a skipped step) has nothing to do, which is not the user's mistake.
            self._retired[name] = None
            while len(self._retired) > _RETIRED_NAMES:
                self._retired.popitem(last=False)

    def _retire(self, name: str) -> None:
        """Forget group ``name``. It keeps its own statistics entry for a while (the last
        ``_RETIRED_STATS`` forgotten groups); older ones are folded into ``retired_groups``."""
        del self._groups[name]
        self._recent_retired[name] = None
        self._recent_retired.move_to_end(name)
        while len(self._recent_retired) > _RETIRED_STATS:
            old, _ = self._recent_retired.popitem(last=False)
            stats = self._stats.pop(old, None)
            if stats is not None and old not in self._groups:
                self._retired_stats.merge(stats)
                self._retired_groups += 1

    def _live_group(self, name: str) -> Optional[SwapGroup]:
        """The group ``name``; ``None`` if it was forgotten because all its storages died."""
        if name not in self._groups and name in self._retired:
            return None
        return self._group(name)

    def set_current_group_name(self, group_name: Optional[str]) -> None:
        """Regions that run from now on add their storages to ``group_name`` (``None``: the
        default group). The group is created if new."""
        if group_name is not None:
            if not isinstance(group_name, str) or not group_name:
                raise TypeError(f"group name must be a non-empty str or None, got {group_name!r}")
        with self._locked:
            if group_name is not None:
                self._group(group_name, create=True)
            self.switch_group(group_name)

    def discard_group(self, group_name: str) -> None:
        """Forget group ``group_name`` without moving anything (no-op if unknown): storages of it
        that are still alive stay where they are and give their host buffers back when they die.
        Used to clean up after an aborted step so the name is free for the next one. A group of
        the layer chain cannot be discarded while its layer is alive (its hooks keep using it):
        :meth:`reset` drops the chain with every group."""
        with self._locked:
            group = self._groups.get(group_name)
            if group is not None and group.persistent and self._chain.uses(group_name):
                raise ValueError(
                    f"discard_group({group_name!r}): the group belongs to the layer chain "
                    "(set_forward_prefetch_layer / wrap_layers), whose hooks keep using it in forward and "
                    "backward. Call SwapManager().reset() to remove the chain and every group.")
            if group is not None:
                self._retire(group_name)
                if group_name == self._current_group_name:
                    self._current_group_name = None

    def resident_swap_bytes(self, prefix: Optional[str] = None) -> int:
        """Bytes of swap candidates occupying device memory now (produced and not yet offloaded,
        in flight, or loaded back), over the groups whose name starts with ``prefix`` (all if
        ``None``). Tensors kept on the device for good (parameters, shared ones) are excluded."""
        with self._locked:
            return sum(g.resident_swap_bytes() for name, g in list(self._groups.items())
                       if prefix is None or name.startswith(prefix))

    def get_current_group_name(self) -> Optional[str]:
        return self._current_group_name

    def group_names(self) -> list:
        """Names of the live groups."""
        return sorted(self._groups)

    # ------------------------------------------------------------------ atomic API
    def _copy_stream_for(self, device: Any) -> Any:
        """The manager's copy stream on ``device`` (made on first use: streams belong to a device)."""
        try:
            return self._copy_streams[device]
        except KeyError:  # (None, the answer of a backend without streams, is cached too)
            stream = self._copy_streams[device] = self.backend.new_copy_stream(device)
            return stream

    @staticmethod
    def _streams(copy_stream: Any) -> Optional[Callable[[Any], Any]]:
        """The ``copy_streams`` of a launch given ``copy_stream`` (``None``: the group's default,
        the manager's copy stream of each device)."""
        return None if copy_stream is None else lambda device: copy_stream

    def _on_live_group(self, group_name: str, step: Callable[..., Any], *args: Any, wait: bool = False) -> None:
        """``step(group, *args)`` under the lock; nothing for a group forgotten because every
        storage of it died (see ``_forget_if_empty``). After a ``wait``, a group whose storages
        all died is forgotten."""
        with self._locked:
            group = self._live_group(group_name)
            if group is not None:
                step(group, *args)
                if wait:
                    self._forget_if_empty(group_name)

    def launch_offload(self, group_name: str, copy_stream: Any = None) -> None:
        """Start copying group ``group_name``'s tensors to host memory on ``copy_stream`` (default:
        the manager's copy stream of each tensor's device). Returns at once on accelerators."""
        self._on_live_group(group_name, SwapGroup.launch_offload, self._streams(copy_stream))

    def wait_offload(self, group_name: str) -> None:
        """Make compute wait for the group's offload and release its device memory."""
        self._on_live_group(group_name, SwapGroup.wait_offload, wait=True)

    def launch_load(self, group_name: str, copy_stream: Any = None, *, storages: Any = None,
                    limit_bytes: Optional[int] = None) -> None:
        """Start copying group ``group_name``'s offloaded tensors back to the device.

        ``storages`` (a sequence of the group's :class:`Storage` s) loads only those, and
        ``limit_bytes`` at most that many bytes, the tensors backward needs first; the layer chain
        uses both (one forward's storages, the prefetch budget)."""
        if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int)
                                        or limit_bytes < 0):
            raise TypeError(f"launch_load: limit_bytes must be an int >= 0 or None, got {limit_bytes!r}")
        self._on_live_group(group_name, SwapGroup.launch_load, self._streams(copy_stream), storages, limit_bytes)

    def wait_load(self, group_name: str) -> None:
        """Make compute wait for the group's load; its tensors are usable afterwards."""
        self._on_live_group(group_name, SwapGroup.wait_load, wait=True)

    def set_prefetch_budget(self, nbytes: Optional[int]) -> None:
        """How many bytes of the previous layer's swapped tensors the layer chain prefetches while
        a layer runs its backward (the tensors backward needs first go first; the rest are loaded
        when that layer's backward starts). In backward the device then holds the running layer's
        swapped tensors plus at most this budget.

        ``None`` (the default, until this is called and after :meth:`reset`): no limit, the RFC's
        schedule (the whole previous layer is prefetched). ``0``: nothing ahead, each layer is
        loaded when its own backward starts. The schedule is the same on every device; without a
        copy stream (CPU) each copy is done when it returns.

        Example::

            >>> SwapManager().set_prefetch_budget(256 << 20)   # at most 256 MiB ahead
            >>> SwapManager().set_prefetch_budget(None)        # back to the default: no limit
        """
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
            raise TypeError(f"set_prefetch_budget expects a number of bytes (int >= 0) or None, got {nbytes!r}")
        self._prefetch_budget = nbytes

    def prefetch_budget(self) -> Optional[int]:
        """The budget in force (see :meth:`set_prefetch_budget`): ``None`` means no limit."""
        return self._prefetch_budget

    def set_bucket_bytes(self, nbytes: int) -> None:
        """Move small saved tensors in buckets of at most ``nbytes`` (``0``, the default: every
        storage by itself). An offload packs the storages of at most ``nbytes // 16`` bytes that
        one region's forward saved into shared host buffers of at most ``nbytes``, and a load
        brings each such buffer back with one copy into one device block: one copy launch and one
        allocation per bucket instead of one per tensor (``core/swap_bucket.py``). Loading any
        tensor of a bucket loads the whole bucket, so a load limited to fewer bytes
        (``limit_bytes``, the prefetch budget) takes a bucket whole or not at all.

        Each reloaded tensor keeps its exact layout (shape, stride, storage offset, dtype) over a
        storage of its own that is a slot of the bucket's block. The one difference a program can
        see: that storage is memory the framework's allocator did not hand out, so a
        ``tensor.record_stream(s)`` called *on a reloaded saved tensor* by code outside the engine
        (a custom backward handing it to a side stream) is ignored by PyTorch's caching
        allocator; such code must keep the tensor alive until ``s`` is done with it (the engine
        itself always protects the block). That is why bucketing is opt-in.

        Needs the framework to make a storage over part of another (``Backend.supports_slots``:
        PyTorch can, MindSpore 2.10 cannot, where a positive value is refused).

        Example::

            >>> SwapManager().set_bucket_bytes(1 << 20)   # buckets of up to 1 MiB, of storages <= 64 KiB
            >>> SwapManager().set_bucket_bytes(0)         # every storage copied by itself
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"set_bucket_bytes expects a number of bytes (int; 0 turns bucketing off), got {nbytes!r}")
        if nbytes < 0 or 0 < nbytes < 2 * SLOT_ALIGN:
            raise ValueError(f"set_bucket_bytes({nbytes}): a bucket holds at least two slots of {SLOT_ALIGN} bytes, "
                             f"so use 0 (off) or at least {2 * SLOT_ALIGN} (e.g. 1 << 20)")
        if nbytes and not self.backend.supports_slots:
            raise ValueError(f"set_bucket_bytes({nbytes}): the {type(self.backend).__name__} cannot make a storage "
                             "over part of another, which bucketed copies need (each reloaded tensor gets its own "
                             "storage back); leave bucketing off (0) on this framework.")
        with self._locked:
            self._bucket_bytes = nbytes
            for group in self._groups.values():
                group.bucket_bytes = nbytes

    def bucket_bytes(self) -> int:
        """The bucket cap in force (see :meth:`set_bucket_bytes`); 0: no bucketing."""
        return self._bucket_bytes

    # ------------------------------------------------------------------ layer chain
    def set_forward_prefetch_layer(self, first_layer: Any, second_layer: Any) -> None:
        """Declare that ``second_layer`` runs right after ``first_layer`` in forward (idempotent).

        Each layer gets its own group. Forward: when a layer with a successor finishes, its
        offload is launched, then its predecessor's offload is waited. Backward: when a layer's
        backward starts, its predecessor's load is launched and its own load waited. The hooks do
        nothing while a checkpointed region is recomputed.

        Example::

            >>> for i in range(len(model.layers) - 1):  # doctest: +SKIP
            ...     SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
        """
        with self._locked:
            self._chain.link(first_layer, second_layer)

    def layer_group_name(self, layer: Any) -> Optional[str]:
        """The group name the layer chain gave ``layer`` (``None`` if not chained)."""
        return self._chain.group_name(layer)

    # ------------------------------------------------------------------ the layer chain's interface
    # What ``LayerChain`` uses beyond the public schedule calls (``layer_chain.ChainManager``): for
    # the package's schedules, called with the manager's lock held.
    def chain_group(self, group_name: str) -> SwapGroup:
        """The group of a chained layer, created if new; it lives as long as the chain."""
        return self._group(group_name, create=True, persistent=True)

    def switch_group(self, group_name: Optional[str]) -> Optional[str]:
        """Make ``group_name`` (a chained layer's group, or the name one replaced) current without
        checking it; returns the previous current name. A group left behind with no live storage
        is forgotten."""
        previous, self._current_group_name = self._current_group_name, group_name
        if previous is not None and previous != group_name:
            self._forget_if_empty(previous)
        return previous

    def retry_offload(self, group_name: str) -> None:
        """Launch the offload of what group ``group_name``'s last launch skipped because somebody
        else held it then (``SwapGroup.retry_offload``): the layer chain's second try."""
        self._group(group_name).retry_offload()

    # ------------------------------------------------------------------ housekeeping
    def set_host_memory_limit(self, limit_bytes: Optional[int]) -> None:
        """Cap the host memory the swap pool may reserve; past it tensors stay on the device and
        ``stats()`` counts them under ``kept_bytes['host_limit']``. ``None`` removes the cap."""
        if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int)):
            raise TypeError(f"set_host_memory_limit expects a number of bytes (int) or None, got {limit_bytes!r} "
                            f"({type(limit_bytes).__name__}); e.g. set_host_memory_limit(8 << 30) for 8 GiB.")
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"host memory limit must be >= 0 or None, got {limit_bytes}")
        with self._locked:
            self._pool.limit_bytes = limit_bytes

    def release_host_cache(self) -> int:
        """Free the pooled host buffers that no tensor uses now and return them to the OS (the
        framework's host allocator cache is emptied too); returns the bytes released, as the
        host allocator reserved them (rounded up, see ``core/host_pool.py``)."""
        with self._locked:
            return self._pool.release_idle()

    def stats(self) -> Dict[str, Any]:
        """Bytes offloaded, loaded and kept on the device (by reason), and seconds the host spent
        in waits, in total and per live group; plus the host pool's size.

        ``groups`` has one entry per live group and per recently forgotten one (every storage of
        it died, or ``discard_group``): the last 64 forgotten groups keep their entry, older ones
        are folded into ``retired_groups`` (``count`` plus the summed counters), so a fresh group
        name per step or micro-batch does not make ``stats()`` grow.
        Totals include retired groups. Counters are cumulative until :meth:`reset`.
        """
        total = GroupStats()
        total.merge(self._retired_stats)
        for s in self._stats.values():
            total.merge(s)
        out = total.as_dict()
        out["groups"] = {name: s.as_dict() for name, s in sorted(self._stats.items())}
        out["retired_groups"] = {"count": self._retired_groups, **self._retired_stats.as_dict()}
        out["host_pool"] = {"reserved_bytes": self._pool.reserved_bytes,
                            "in_use_bytes": self._pool.in_use_bytes,
                            "allocations": self._pool.allocations,
                            "limit_bytes": self._pool.limit_bytes}
        return out

    def reset_stats(self) -> None:
        """Forget the statistics only (``stats()`` counts from zero again); groups, the layer
        chain, the host pool and every setting stay. :meth:`reset` removes all of them.

        Example::

            >>> SwapManager().reset_stats()
            >>> SwapManager().stats()["offloaded_bytes"]
            0
        """
        with self._locked:
            self._stats = {}
            for name, group in self._groups.items():
                group.stats = self._stats[name] = GroupStats()
            self._retired_stats = GroupStats()
            self._retired_groups = 0
            self._recent_retired.clear()

    def reset(self) -> None:
        """Forget every group, the layer chain (its hooks are removed: chained layers are no longer
        offloaded or prefetched), the statistics, the pooled host buffers and every setting (host
        memory limit, prefetch budget, bucket size). For tests, tools and recovery after a failed
        step; to clear the statistics alone, :meth:`reset_stats`. Tensors of regions still alive
        are first brought back to the device (synchronously), so such a region's backward still
        works, as with SAVE."""
        with self._locked:
            for group in list(self._groups.values()):
                group.settle()
            self._chain.clear()
            self._start()
