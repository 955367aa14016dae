"""The simulated asynchronous device and its happens-before checker.

Model
-----
* **Devices.** Every storage the simulator sees belongs to a simulated device (an ``int``, ``0``
  unless :meth:`SimDevice.place` or :meth:`SimDevice.device` says otherwise) or to the host (the
  buffers of :meth:`SimDevice.empty_host_bytes`, standing for pinned memory). All of them are CPU
  tensors. An op runs on the device of its first device tensor argument (or the current device
  for a factory op); its outputs live there.
* **Streams.** Each device has a default compute stream; :meth:`SimDevice.new_stream` makes more
  compute streams and :meth:`SimDevice.new_copy_stream` copy streams. The current stream is per
  thread and per device, as in CUDA (``stream_context`` also makes the stream's device current).
  Compute streams are *eager*: an op runs when it is called. Copy streams are *lazy* queues: a
  copy issued on one (through :meth:`copy_bytes`) runs only when a wait on an event recorded
  after it forces it, at :meth:`synchronize`, or (``seed`` given) at a random earlier point. A
  copy issued while a compute stream is current runs at once, as a synchronous copy would.
* **Events** are positions in a stream's queue; waiting for one on a compute stream runs the
  other stream's queue up to it, waiting on a copy stream queues the wait.
* **Poison.** Every fresh device allocation (:meth:`empty_device_bytes`, and ``empty``-like ops
  while checking) and host buffer is filled with ``0xFF`` (NaN in every float dtype). A device
  storage the program frees while a queued copy still reads it, and that ``record_stream``
  (:meth:`mark_used_by`) does not protect, is overwritten with ``0xFF`` at once, as a new tensor
  given the block by the allocator would do. A missing wait therefore shows as NaN or wrong bits.

Checker
-------
Each stream has a vector clock; an op or copy ticks its stream; events carry the clock of their
stream, and a wait merges it. Every access is logged per storage (the last write, the reads since),
by the dispatch mode that :meth:`SimDevice.checking` enters (ops) and by :meth:`copy_bytes`
(copies). :class:`StreamHazard` is raised for

* a read or write not ordered after another stream's write of the same storage;
* a write (reuse of a buffer) not ordered after another stream's read;
* a device storage freed while another stream's access is not ordered before the free (the
  allocation stream never waited for it) and not covered by ``record_stream``; host buffers are
  exempt (the pinned allocator records events for the copies that use them);
* an allocation of device memory while a copy stream is current (the block would belong to the
  copy stream's pool).

Frees are seen when a storage dies (a weak reference) or, for a storage a queued copy still holds,
at the next simulator call or op (nothing that can order streams happens in between). A hazard
found in the middle of a call is raised at once (``strict=True``) or at the next call; every
hazard is kept in :attr:`SimDevice.violations`, and :meth:`check` raises the first one.

Limits: ops run on the CPU in program order, so only copies are ever reordered; ops that touch
only host buffers are not checked; the dispatch mode is per thread (enter :meth:`checking` in each
thread that runs ops).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import weakref
from collections import Counter, deque
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hyper_parallel.core.activation_checkpoint  # noqa: F401  (binds the framework's backend first)
from hyper_parallel.backends.torch.backend import HOST, TorchBackend
from hyper_parallel.core.backend import use_backend
from hyper_parallel.core.swap_manager import SwapManager
from hyper_parallel.tools.memory import host_allocation, mark_host

from . import _shim

__all__ = ["SimDevice", "SimStream", "SimEvent", "StreamHazard", "POISON_BYTE", "simulated_device",
           "per_layer_streams"]

#: The byte every fresh allocation and every poisoned storage is filled with (NaN in float dtypes).
POISON_BYTE = 0xFF

_ids = itertools.count(1)
_aten = torch.ops.aten
_EMPTY_OPS = frozenset({_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                        _aten.new_empty.default, _aten.new_empty_strided.default})


class StreamHazard(AssertionError):
    """A stream-ordering error found by the simulated device."""


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _merge(clock: Dict[int, int], other: Dict[int, int]) -> None:
    for k, v in other.items():
        if clock.get(k, 0) < v:
            clock[k] = v


class SimEvent:
    """A position in a stream's queue, with the stream's vector clock at that position."""

    __slots__ = ("stream", "pos", "clock")

    def __init__(self, stream: "SimStream", pos: int, clock: Dict[int, int]) -> None:
        self.stream, self.pos, self.clock = stream, pos, clock

    def query(self) -> bool:
        return self.stream.done >= self.pos

    def synchronize(self) -> None:
        self.stream.sim._synchronize_to(self)

    def wait(self, stream: Optional["SimStream"] = None) -> None:
        sim = self.stream.sim
        sim.wait_event(stream if stream is not None else sim.current_stream(self.stream.device), self)

    def __repr__(self) -> str:
        return f"SimEvent({self.stream.name}@{self.pos})"


class SimStream:
    """A simulated stream (``kind`` ``"compute"``: eager; ``"copy"``: a lazy queue). Offers the
    part of ``torch.cuda.Stream`` the engine and tests use."""

    def __init__(self, sim: "SimDevice", device: int, kind: str, index: int) -> None:
        self.sim = sim
        self.device = device
        self.kind = kind
        self.id = next(_ids)
        self.name = f"{kind}{index}@dev{device}"
        self.vc: Dict[int, int] = {self.id: 0}
        self.queue: deque = deque()
        self.issued = 0   # items ever queued
        self.done = 0     # items executed
        self.copies = 0   # copies issued on this stream

    @property
    def lazy(self) -> bool:
        return self.kind == "copy"

    def record_event(self) -> SimEvent:
        return self.sim.record_event(self)

    def wait_event(self, event: SimEvent) -> None:
        self.sim.wait_event(self, event)

    def wait_stream(self, other: "SimStream") -> None:
        self.sim.wait_event(self, self.sim.record_event(other))

    def synchronize(self) -> None:
        self.sim._synchronize_to(self.sim.record_event(self))

    def query(self) -> bool:
        return self.done >= self.issued

    def __repr__(self) -> str:
        return f"SimStream({self.name})"


class _Info:
    """What the simulator knows about one storage."""

    __slots__ = ("key", "device", "alloc", "write", "reads", "recorded", "ref", "cross", "freed", "nbytes",
                 "rounded", "__weakref__")

    def __init__(self, key: int, device: Any, alloc: Optional[SimStream], nbytes: int) -> None:
        self.key = key
        self.device = device           # an int, or HOST
        self.alloc = alloc             # the stream whose pool the block belongs to (None: host)
        self.write: Optional[Tuple[SimStream, int, str]] = None
        self.reads: Dict[int, Tuple[SimStream, int, str]] = {}
        self.recorded: Dict[int, SimStream] = {}  # streams record_stream'ed on it, by id
        self.ref: Any = None
        self.cross = False             # accessed by a stream other than its allocation stream
        self.freed = False             # the free check ran
        self.nbytes = nbytes
        self.rounded = 0               # host buffers: bytes the host allocator reserved

    @property
    def host(self) -> bool:
        return self.device == HOST

    def name(self) -> str:
        where = "host buffer" if self.host else f"device {self.device} storage"
        return f"{where} #{self.key % 100000} ({self.nbytes} bytes)"


class _Copy:
    __slots__ = ("stream", "dst", "src", "dev_key", "reads_dev", "offset")

    def __init__(self, stream: SimStream, dst: torch.Tensor, src: torch.Tensor, dev_key: Optional[int],
                 reads_dev: bool, offset: int) -> None:
        self.stream, self.dst, self.src, self.dev_key, self.reads_dev = stream, dst, src, dev_key, reads_dev
        self.offset = offset

    @property
    def dev_tensor(self) -> torch.Tensor:
        return self.src if self.reads_dev else self.dst


class _Wait:
    __slots__ = ("event",)

    def __init__(self, event: SimEvent) -> None:
        self.event = event


class _Checker(TorchDispatchMode):
    """Logs every op's reads and writes per storage under the current simulated stream."""

    def __init__(self, sim: "SimDevice") -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return self.sim._dispatch(func, args, kwargs or {})


class SimDevice(TorchBackend):
    """A simulated asynchronous device (see the module docstring) behind the backend contract.

    Args:
        seed: ``None``: copies run as late as possible (the most adversarial order, fully
            deterministic). An int: copies also run at random earlier points, drawn from a
            ``random.Random(seed)`` (still deterministic for one seed).
        delay_prob: in random mode, the chance that a call runs one queued item early.
        host_rounding: model PyTorch's caching host allocator, which reserves the next power of
            two for every pinned request (:meth:`host_alloc_size`).
        strict: raise a hazard at once (else only at :meth:`check`).
        poison_empty: also fill the outputs of ``empty``-like ops with ``0xFF`` while checking.
    """

    def __init__(self, seed: Optional[int] = None, delay_prob: float = 0.25, host_rounding: bool = False,
                 strict: bool = True, poison_empty: bool = True) -> None:
        super().__init__()
        # Everything is simulated on CPU tensors, whatever accelerator this build has.
        self.accelerator = None
        self._dm = None
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._defaults: Dict[int, SimStream] = {}
        self._kind_count: Counter = Counter()
        self.streams: List[SimStream] = []
        self._info: Dict[int, _Info] = {}
        # Slot storages (``slot_bytes``: part of another storage's memory) -> the record of the
        # block they are part of, while they live (accesses through a slot are the block's).
        self._slots: Dict[int, _Info] = {}
        self._slot_refs: Dict[int, Any] = {}
        self._held: Dict[int, List[_Copy]] = {}
        self._spec_cache: Dict[Any, Any] = {}
        self.violations: List[str] = []
        self._unraised: deque = deque()
        self._rng = random.Random(seed) if seed is not None else None
        self.delay_prob = delay_prob
        self.host_rounding = host_rounding
        self.strict = strict
        self.poison_empty = poison_empty
        #: bytes the simulated host allocator reserves for live host buffers / keeps cached
        self.host_live_bytes = 0
        self.host_cached_bytes = 0
        #: counters: "record_stream", "poisoned", "eager_copies", "queued_copies", "empty_host_cache"
        self.counts: Counter = Counter()
        #: ``before_call[name](*args)`` runs at the start of primitive ``name`` (outside the
        #: simulator's lock): tests inject failures and thread interleavings with it.
        self.before_call: Dict[str, Callable[..., None]] = {}

    # ================================================================== devices and streams
    def _state(self) -> Any:
        tls = self._tls
        if not hasattr(tls, "current"):
            tls.current = {}
            tls.device = 0
            tls.quiet = 0
        return tls

    def _new_stream(self, device: int, kind: str) -> SimStream:
        with self._lock:
            stream = SimStream(self, device, kind, self._kind_count[(kind, device)])
            self._kind_count[(kind, device)] += 1
            self.streams.append(stream)
            return stream

    def default_stream(self, device: Optional[int] = None) -> SimStream:
        device = self._state().device if device is None else device
        stream = self._defaults.get(device)
        if stream is None:
            with self._lock:
                stream = self._defaults.get(device)
                if stream is None:
                    stream = self._defaults[device] = self._new_stream(device, "compute")
        return stream

    def new_stream(self, device: Optional[int] = None) -> SimStream:
        """A new compute stream (like ``torch.cuda.Stream()`` used for compute)."""
        return self._new_stream(self._state().device if device is None else device, "compute")

    def current_device(self) -> int:
        return self._state().device

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        """Make device ``index`` current in the block (``torch.cuda.device``)."""
        tls = self._state()
        previous, tls.device = tls.device, index
        try:
            yield
        finally:
            tls.device = previous

    def stream(self, stream: SimStream) -> Any:
        """Make ``stream`` current in the block (``torch.cuda.stream``)."""
        return self.stream_context(stream)

    def _push(self, stream: SimStream) -> Tuple[int, Any, int]:
        tls = self._state()
        token = (stream.device, tls.current.get(stream.device), tls.device)
        tls.current[stream.device] = stream
        tls.device = stream.device
        return token

    def _pop(self, token: Tuple[int, Any, int]) -> None:
        tls = self._state()
        device, previous, current_device = token
        if previous is None:
            tls.current.pop(device, None)
        else:
            tls.current[device] = previous
        tls.device = current_device

    def place(self, obj: Any, device: int) -> Any:
        """Declare that the tensors of ``obj`` (a tensor, a module, or a collection of them) live
        on simulated device ``device`` (``model.to(f"cuda:{device}")``); returns ``obj``."""
        if isinstance(obj, torch.nn.Module):
            tensors = list(obj.parameters()) + list(obj.buffers())
        else:
            tensors = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
        with self._lock:
            for t in tensors:
                info = self._get(t)
                if info is not None:  # a synchronous move: the storage starts afresh there
                    info.device = device
                    info.alloc = self.default_stream(device)
                    info.write, info.reads, info.cross = None, {}, False
        return obj

    # ================================================================== the backend contract
    # Only streams, events, allocation, copies and where a storage lives are simulated: every
    # other question (saved_facts above all) is answered by TorchBackend's own code, the code an
    # accelerator runs (tests/test_backend_contract.py checks the class overrides nothing else).
    def device_of(self, t: torch.Tensor) -> Any:
        info = self._get(t)
        if info is None:  # an empty storage (the simulator tracks none)
            return self._state().device
        return HOST if info.host else info.device

    def current_stream(self, device: Any = None) -> SimStream:
        tls = self._state()
        device = tls.device if device is None else device
        stream = tls.current.get(device)
        return stream if stream is not None else self.default_stream(device)

    def new_copy_stream(self, device: Any = None) -> SimStream:
        return self._new_stream(self._state().device if device is None else device, "copy")

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[None]:
        if stream is None:
            yield
            return
        token = self._push(stream)
        try:
            yield
        finally:
            self._pop(token)

    def record_event(self, stream: Any) -> Optional[SimEvent]:
        self._before("record_event", stream)
        if stream is None:
            return None
        with self._lock:
            self._poll()
            return SimEvent(stream, stream.issued, dict(stream.vc))

    def wait_event(self, stream: Any, event: Any) -> None:
        self._before("wait_event", stream, event)
        if stream is None or event is None:
            return
        with self._lock:
            self._poll()
            _merge(stream.vc, event.clock)
            if stream.lazy:
                self._enqueue(stream, _Wait(event))
            else:
                self._run(event.stream, event.pos)
            self._progress()

    def empty_device_bytes(self, nbytes: int, like: Any) -> torch.Tensor:
        self._before("empty_device_bytes", nbytes, like)
        with self._lock:
            self._poll()
            device = like.device
            stream = self.current_stream(device)
            if stream.lazy:
                self._hazard(f"{nbytes} device bytes allocated while copy stream {stream.name} is current: the "
                             "block belongs to the copy stream's pool, and compute, which uses and frees it, "
                             "is not ordered with that stream.")
            with self._quiet(visible=True):
                t = torch.empty(nbytes, dtype=torch.uint8)
            with self._quiet():
                t.fill_(POISON_BYTE)
            info = self._register(t, device, stream)
            self._tick(stream)
            self._access(info, stream, True, "allocation (empty_device_bytes)")
            self._raise_pending()
            return t

    def empty_host_bytes(self, nbytes: int) -> torch.Tensor:
        self._before("empty_host_bytes", nbytes)
        with self._lock:
            with self._quiet(visible=True), host_allocation():
                t = torch.empty(nbytes, dtype=torch.uint8)
            mark_host(t)  # (host memory, as the backend's: a CPU memory meter never counts it)
            with self._quiet():
                t.fill_(POISON_BYTE)
            info = self._register(t, HOST, None)
            info.rounded = self.host_alloc_size(nbytes)
            self.host_live_bytes += info.rounded
            return t

    def host_alloc_size(self, nbytes: int) -> int:
        return _pow2(nbytes) if self.host_rounding else nbytes

    def empty_host_cache(self) -> None:
        self.counts["empty_host_cache"] += 1
        self.host_cached_bytes = 0

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor, dst_offset: int = 0) -> None:
        self._before("copy_bytes", dst, src)
        with self._lock:
            self._poll()
            si, di = self._get(src), self._get(dst)
            if si is None or di is None:  # an empty storage (the simulator tracks none): no bytes to copy
                return
            reads_dev = not si.host
            dev = si if reads_dev else di
            device = dev.device if not dev.host else self._state().device
            stream = self.current_stream(device)
            direction = "D2H" if reads_dev and di.host else "H2D" if si.host and not di.host else "device"
            what = f"{direction} copy on {stream.name}"
            self._tick(stream)
            self._access(si, stream, False, what)
            self._access(di, stream, True, what)
            stream.copies += 1
            if stream.lazy:
                # The queue holds its own tensors (new TensorImpls over the same storages), so the
                # program's references can be told apart from the queue's (see _poll).
                with self._quiet():
                    dst, src = dst.detach(), src.detach()
                item = _Copy(stream, dst, src, None if dev.host else dev.key, reads_dev, dst_offset)
                self._enqueue(stream, item)
                if item.dev_key is not None:
                    self._held.setdefault(item.dev_key, []).append(item)
                self.counts["queued_copies"] += 1
            else:
                self._exec(dst, src, dst_offset)
                self.counts["eager_copies"] += 1
            self._raise_pending()
            self._progress()

    def slot_bytes(self, buf: torch.Tensor, offset: int, nbytes: int) -> torch.UntypedStorage:
        self._before("slot_bytes", buf, offset, nbytes)
        with self._lock:
            info = self._get(buf)
            with self._quiet():
                slot = buf.untyped_storage()[offset:offset + nbytes]
            key = slot._cdata
            if info is not None:
                self._slots[key] = info

                def forget(_: Any, key: int = key, info: _Info = info) -> None:
                    if self._slots.get(key) is info:
                        del self._slots[key]
                    self._slot_refs.pop(key, None)

                self._slot_refs[key] = weakref.ref(slot, forget)
            return slot

    def mark_used_by(self, t: torch.Tensor, stream: Any) -> None:
        # Never raises (the engine calls it from __del__).
        if stream is None:
            return
        with self._lock:
            if t.untyped_storage()._cdata in self._slots:
                # As PyTorch's caching allocator: record_stream on memory it did not hand out
                # itself (a slot of a block) does nothing.
                self.counts["record_stream_ignored"] += 1
                return
            info = self._get(t)
            if info is not None and not info.host:
                info.recorded[stream.id] = stream
                self.counts["record_stream"] += 1

    # ================================================================== user-facing checks
    def checking(self) -> Any:
        """A context that logs every op of this thread for the checker (a dispatch mode)."""
        return _Checker(self)

    def synchronize(self) -> None:
        """Run every queued copy (``torch.cuda.synchronize()``): all work issued so far is done,
        so whatever any stream does next is ordered after it (every clock takes the maximum)."""
        with self._lock:
            self._poll(raise_pending=False)
            for stream in list(self.streams):
                self._run(stream, stream.issued)
            joined: Dict[int, int] = {}
            for stream in self.streams:
                _merge(joined, stream.vc)
            for stream in self.streams:
                _merge(stream.vc, joined)

    def check(self) -> None:
        """Raise the first hazard seen so far, if any."""
        if self.violations:
            more = f" (and {len(self.violations) - 1} more)" if len(self.violations) > 1 else ""
            raise StreamHazard(self.violations[0] + more)

    def is_ordered_after(self, stream: SimStream, event: SimEvent) -> bool:
        """Whether work issued on ``stream`` from now on is ordered after ``event``."""
        return stream is event.stream or stream.vc.get(event.stream.id, 0) >= event.clock.get(event.stream.id, 0)

    def pending_copies(self) -> int:
        return sum(1 for s in self.streams for item in s.queue if isinstance(item, _Copy))

    # ================================================================== internals
    def _before(self, name: str, *args: Any) -> None:
        hook = self.before_call.get(name)
        if hook is not None:
            hook(*args)

    @contextlib.contextmanager
    def _quiet(self, visible: bool = False) -> Iterator[None]:
        """The simulator's own tensor work: the checker ignores it, and (unless ``visible``: an
        allocation the framework backend would make under the user's modes too, so that e.g. a
        memory meter sees it) no other dispatch mode sees it either."""
        tls = self._state()
        tls.quiet += 1
        try:
            if visible:
                yield
            else:
                with _shim.disable_modes():
                    yield
        finally:
            tls.quiet -= 1

    def _hazard(self, message: str) -> None:
        self.violations.append(message)
        self._unraised.append(message)

    def _raise_pending(self) -> None:
        if self.strict and self._unraised:
            message = self._unraised.popleft()
            self._unraised.clear()
            raise StreamHazard(message)

    @staticmethod
    def _tick(stream: SimStream) -> int:
        stream.vc[stream.id] += 1
        return stream.vc[stream.id]

    def _register(self, t: torch.Tensor, device: Any, alloc: Optional[SimStream]) -> _Info:
        storage = t.untyped_storage()
        key = storage._cdata
        info = _Info(key, device, alloc, storage.nbytes())
        info_ref = weakref.ref(info)
        info.ref = weakref.ref(storage, lambda _, key=key, info_ref=info_ref: self._on_dead(key, info_ref))
        self._info[key] = info
        return info

    def _get(self, t: torch.Tensor) -> Optional[_Info]:
        """The storage's record (created for a storage first seen now: device 0 unless placed)."""
        if t.device.type != "cpu":
            return None
        storage = t.untyped_storage()
        info = self._info.get(storage._cdata) or self._slots.get(storage._cdata)
        if info is None:
            if storage.nbytes() == 0:
                return None
            device = 0
            info = self._register(t, device, self.default_stream(device))
        return info

    def _on_dead(self, key: int, info_ref: Any) -> None:
        # Runs when a storage dies, in whatever thread dropped it: no lock, never raises.
        info = info_ref()
        if info is None:
            return
        if self._info.get(key) is info:
            del self._info[key]
        try:
            if info.host:
                self.host_live_bytes -= info.rounded
                self.host_cached_bytes += info.rounded
            elif info.cross and not info.freed:
                self._free_check(info)
        except Exception as exc:  # pragma: no cover  (a checker bug must not crash a finalizer)
            self._hazard(f"simulator error in free check: {exc!r}")

    def _accesses(self, info: _Info) -> List[Tuple[SimStream, int, str]]:
        out = list(info.reads.values())
        if info.write is not None:
            out.append(info.write)
        return out

    def _free_check(self, info: _Info, queued: Sequence[_Copy] = ()) -> None:
        """The program freed ``info``'s storage now (its block goes back to its allocation stream's
        pool): every other stream's access must be ordered before that stream's present, or be
        covered by ``record_stream``. ``queued``: copies still queued on it (they read garbage)."""
        info.freed = True
        owner = info.alloc
        uncovered: List[SimStream] = []
        for stream, t, what in self._accesses(info):
            if owner is None or stream is owner or owner.vc.get(stream.id, 0) >= t:
                continue
            # record_stream(R): at the free the allocator records an event on R and reuses the
            # block only after it; that covers every access R is ordered after by then.
            if any(r is stream or r.vc.get(stream.id, 0) >= t for r in info.recorded.values()):
                continue
            uncovered.append(stream)
            if len(uncovered) == 1:
                self._hazard(
                    f"{info.name()} (allocated on {owner.name}) was freed while the {what} was not ordered "
                    f"before the free ({owner.name} never waited for it) and no record_stream (mark_used_by) "
                    f"covered it: the allocator may give the block to a new tensor on {owner.name} while "
                    "that access is in flight.")
        for item in queued:
            if item.reads_dev and item.stream in uncovered:
                # Simulate the block's reuse: whatever the queued copy reads now is garbage.
                with self._quiet():
                    item.src.untyped_storage().fill_(POISON_BYTE)
                self.counts["poisoned"] += 1
                break

    def _poll(self, raise_pending: bool = True) -> None:
        """Detect device storages the program freed while only queued copies still hold them."""
        for key, items in list(self._held.items()):
            info = self._info.get(key)
            if info is None or info.freed or not items:
                continue
            storage = items[0].dev_tensor.untyped_storage()
            if _shim.storage_use_count(storage) - 1 <= len(items):
                self._free_check(info, items)
            del storage
        if raise_pending:
            self._raise_pending()

    def _enqueue(self, stream: SimStream, item: Any) -> None:
        stream.queue.append(item)
        stream.issued += 1

    def _run(self, stream: SimStream, upto: int) -> None:
        while stream.done < upto:
            item = stream.queue.popleft()
            stream.done += 1
            if isinstance(item, _Wait):
                self._run(item.event.stream, item.event.pos)
            else:
                self._exec(item.dst, item.src, item.offset)
                if item.dev_key is not None:
                    held = self._held.get(item.dev_key)
                    if held is not None:
                        held.remove(item)
                        if not held:
                            del self._held[item.dev_key]
                item.dst = item.src = None  # type: ignore[assignment]

    def _synchronize_to(self, event: SimEvent) -> None:
        with self._lock:
            self._poll()
            self._run(event.stream, event.pos)

    def _exec(self, dst: torch.Tensor, src: torch.Tensor, offset: int = 0) -> None:
        with self._quiet():
            source = src.untyped_storage()
            target = dst.untyped_storage()
            if offset or target.nbytes() != source.nbytes():  # a slot of a bucket's buffer
                target = target[offset:offset + source.nbytes()]
            target.copy_(source)

    def _progress(self) -> None:
        """Random mode: maybe run one queued item early."""
        rng = self._rng
        if rng is None or rng.random() >= self.delay_prob:
            return
        busy = [s for s in self.streams if s.queue]
        if busy:
            stream = rng.choice(busy)
            self._run(stream, stream.done + 1)

    def _access(self, info: Optional[_Info], stream: SimStream, write: bool, what: str) -> None:
        if info is None:
            return
        t = stream.vc[stream.id]
        last = info.write
        kind = "write" if write else "read"
        if last is not None and last[0] is not stream and stream.vc.get(last[0].id, 0) < last[1]:
            self._hazard(f"{kind} of {info.name()} by {what} is not ordered after its write by the {last[2]} "
                         f"(on {last[0].name}): a wait is missing.")
        if write:
            for r_stream, r_t, r_what in info.reads.values():
                if r_stream is not stream and stream.vc.get(r_stream.id, 0) < r_t:
                    self._hazard(f"{info.name()} is reused (written by {what}) before the {r_what} on "
                                 f"{r_stream.name} that reads it is known to be done: a wait is missing.")
                    break
            info.write = (stream, t, what)
            info.reads = {}
        else:
            info.reads[stream.id] = (stream, t, what)
        if stream is not info.alloc:
            info.cross = True

    def _spec(self, func: Any) -> Tuple[bool, Tuple[Tuple[int, str, bool], ...], str]:
        """``(metadata only, (argument index, name, written)..., op name)`` of an op, cached."""
        spec = self._spec_cache.get(func)
        if spec is None:
            schema = getattr(func, "_schema", None)
            if schema is None:
                spec = (False, (), str(func))
            else:
                meta = str(getattr(func, "__name__", "")).startswith("set_") or any(
                    r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
                args = tuple((i, a.name, a.alias_info is not None and a.alias_info.is_write)
                             for i, a in enumerate(schema.arguments)
                             if a.alias_info is None or a.alias_info.is_write)
                spec = (meta, args, str(func))
            self._spec_cache[func] = spec
        return spec

    def _dispatch(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        tls = self._state()
        if tls.quiet:
            return func(*args, **kwargs)
        meta, spec, name = self._spec(func)
        if meta:
            return func(*args, **kwargs)
        with self._lock:
            self._poll()
            reads: List[_Info] = []
            writes: List[_Info] = []
            if spec:
                for i, arg_name, write in spec:
                    value = args[i] if i < len(args) else kwargs.get(arg_name)
                    for t in tree_leaves(value):
                        if isinstance(t, torch.Tensor):
                            info = self._get(t)
                            if info is not None:
                                (writes if write else reads).append(info)
            else:
                for t in tree_leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor):
                        info = self._get(t)
                        if info is not None:
                            reads.append(info)
            device = next((i.device for i in reads + writes if not i.host), None)
            stream: Optional[SimStream] = None
            if device is not None or not (reads or writes):  # ops on host buffers only are not checked
                device = tls.device if device is None else device
                stream = self.current_stream(device)
                self._tick(stream)
                what = f"{name} on {stream.name}"
                for info in reads:
                    self._access(info, stream, False, what)
                for info in writes:
                    self._access(info, stream, True, what)
            inputs = {i.key for i in reads + writes}
            self._raise_pending()
        out = func(*args, **kwargs)
        if stream is None:
            return out
        with self._lock:
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                    continue
                storage = t.untyped_storage()
                key = storage._cdata
                if key in inputs or storage.nbytes() == 0:
                    continue
                info = self._info.get(key) or self._slots.get(key)
                if info is None:
                    if stream.lazy:
                        self._hazard(f"{name} allocated {storage.nbytes()} device bytes while copy stream "
                                     f"{stream.name} is current.")
                    info = self._register(t, device, stream)
                    if self.poison_empty and func in _EMPTY_OPS and t.dtype is not torch.bool:
                        with self._quiet():
                            storage.fill_(POISON_BYTE)
                self._access(info, stream, True, f"{name} on {stream.name}")
            self._raise_pending()
            self._progress()
        return out


@contextlib.contextmanager
def simulated_device(seed: Optional[int] = None, check: bool = True, **options: Any) -> Iterator[SimDevice]:
    """Run the block with a :class:`SimDevice` as the engine's backend and the checker on; the
    ``SwapManager`` is reset on entry and exit (so it uses the simulated streams), every queued
    copy is run at the end and any hazard raised (``check``)."""
    sim = SimDevice(seed=seed, **options)
    with use_backend(sim):
        SwapManager().reset()
        try:
            with sim.checking():
                yield sim
                SwapManager().reset()  # live regions are settled (loaded back) under the checker
            sim.synchronize()
        finally:
            SwapManager().reset()
    SwapManager().reset()
    if check:
        sim.check()


def per_layer_streams(sim: SimDevice, layers: Sequence[torch.nn.Module]) -> List[Any]:
    """Run each layer's forward on its own compute stream and replay it there in backward, the way
    autograd runs a node on the stream its forward used, as a correct program does it: entering a
    layer's stream waits the stream that produced its input (in backward, its output's gradient),
    leaving it makes the caller's stream wait it, and every tensor handed from one stream to the
    other is ``record_stream``-ed on the receiving stream. Returns the hook handles. Register these
    hooks after the layer chain's (``set_forward_prefetch_layer``), so the chain's forward hooks run
    on the layer's stream."""
    handles: List[Any] = []

    def tensors(x: Any) -> List[torch.Tensor]:
        return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]

    for layer in layers:
        stream = sim.new_stream()
        tokens: List[Any] = []

        def enter(handed: Any, stream: SimStream = stream, tokens: List[Any] = tokens) -> None:
            caller = sim.current_stream(stream.device)
            stream.wait_stream(caller)
            for t in tensors(handed):
                sim.mark_used_by(t, stream)
            tokens.append((caller, sim._push(stream)))

        def leave(handed: Any, stream: SimStream = stream, tokens: List[Any] = tokens) -> None:
            caller, token = tokens.pop()
            sim._pop(token)
            caller.wait_stream(stream)
            for t in tensors(handed):
                sim.mark_used_by(t, caller)

        handles.append(layer.register_forward_pre_hook(lambda m, a, enter=enter: enter(a)))
        handles.append(layer.register_forward_hook(lambda m, a, o, leave=leave: leave(o), always_call=True))
        handles.append(layer.register_full_backward_pre_hook(lambda m, g, enter=enter: enter(g)))
        handles.append(layer.register_full_backward_hook(lambda m, gi, go, leave=leave: leave(gi)))
    return handles
