"""One device storage that a region saved, its host copy, and the state machine between them.

A ``SwapTensor`` owns one *storage* (not one tensor): every tensor the region saved that views
the same storage is an alias of it, so aliases are copied once and come back as aliases (same
size, stride, storage offset and dtype over one reloaded storage).

States::

    device --start_offload--> d2h --wait_offload--> host --allocate, copy_in--> h2d --wait_load--> device
                               d2h --cancel_offload--> device

Every backend runs the same transitions; without streams (a CPU build) their events and
streams are ``None``, so the ordering calls do nothing and each copy is done when it returns.

``get_val`` is legal in ``device`` (and in ``d2h``, where the source is still intact on the
device); anywhere else it raises. Memory is never freed by force: the swap system only drops its
own references, so a storage that somebody else still holds stays valid.

Stream ordering (the table in ``docs/architecture.md``): the group orders the copies with events;
this class adds what depends on one storage. ``record_stream`` (``Backend.mark_used_by``) is
called only where a block would otherwise be freed while another stream's access may still be in
flight: a source produced on another stream than the one that waits its offload, a cancelled
offload's source, a reloaded storage read on another stream than its allocation stream, and a
storage that dies while its copy is in flight. Each of these is one method (``_protect``,
``_order_use_after_load``) so that a test can remove it and show the simulated device catching it.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional

from .backend import SavedFacts
from .keep_reason import KeepReason

__all__ = ["TensorState", "SwapTensor", "SwapView"]


class TensorState(enum.Enum):
    DEVICE = "device"
    D2H = "d2h"
    HOST = "host"
    H2D = "h2d"


class SwapTensor:
    """One device *storage* that a region saved (every saved tensor viewing it is one of its
    aliases), its host copy, and the state machine between them (see the module docstring).

    ``group`` is the ``SwapGroup`` of the region's ``Storage`` (its backend and host pool; its
    name in error messages); ``facts`` describe the first saved tensor (``Backend.saved_facts`` of
    a swap candidate).
    """

    # One is made per saved storage: slots keep the constructor and attribute reads cheap.
    __slots__ = ("_b", "group", "nbytes", "state", "_aliases", "_versions", "_metas", "_src",
                 "_host", "_dev", "_views", "released", "_host_guard", "kept_reason", "shared_skips", "device",
                 "producers", "_copy_stream", "_dev_stream", "_load_event", "_ready", "load_issued",
                 "bucket", "slot_offset", "_block", "__weakref__")

    def __init__(self, group: Any, facts: SavedFacts) -> None:
        self._b = group.backend
        self.group = group
        self.nbytes: int = facts.nbytes
        self.state = TensorState.DEVICE  # read-only outside this class (a plain attribute: read per tensor)
        # Detached aliases of the saved tensors: they keep the storage alive and share the
        # originals' version counters, so in-place changes after saving are detected.
        self._aliases: Optional[List[Any]] = [facts.alias]
        self._versions: List[int] = [facts.version]
        self._metas: List[Any] = [facts.meta]
        self._src: Any = None      # byte view of the source while its D2H copy is in flight
        self._host: Any = None     # host buffer holding the bytes while offloaded
        self._dev: Any = None      # the reloaded storage (a byte tensor, or a bucket's slot)
        self._block: Any = None    # the device allocation holding ``_dev`` (what record_stream protects)
        # A small storage shares its host buffer with others (``core/swap_bucket.py``): its bytes
        # sit at ``slot_offset`` there, and at the same offset in the device buffer it reloads into.
        self.bucket: Any = None
        self.slot_offset = 0
        self._views = 0            # live SwapViews (saved tensors autograd still holds)
        self.released = False      # every view was released after use: the device copy is gone
        self._host_guard: Any = None  # offload event: the host buffer is written until it fires
        self.kept_reason: Optional[KeepReason] = None  # set once the storage stays on the device for good
        self.shared_skips = 0  # launches that skipped it because somebody else held it
        #: the device whose streams order this storage's copies (``SavedFacts.device``)
        self.device = facts.device
        # Streams current when the aliases were saved (their producers): the copy stream waits
        # them all, and the source's release is protected when one of them is not the stream
        # that waits the offload.
        self.producers: List[Any] = [facts.stream] if facts.stream is not None else []
        self._copy_stream: Any = None  # the copy stream of the copy in flight (or last issued)
        self._dev_stream: Any = None   # the stream that allocated ``_block`` (the block's owner)
        self._load_event: Any = None   # the event after the H2D copy into ``_dev``
        self._ready: List[Any] = []    # streams known to be ordered after ``_load_event``
        self.load_issued = False       # in state h2d: the copy was issued (not only the allocation)

    # ----------------------------------------------------------------- bookkeeping
    @property
    def unmoved(self) -> bool:
        """On the device as saved: never offloaded, not kept for good, the original saved tensors
        still held (an offload candidate; more aliases may join it)."""
        return self.state is TensorState.DEVICE and self.kept_reason is None and self._aliases is not None

    def held_elsewhere(self) -> bool:
        """Whether somebody besides the swap system holds this (unmoved) storage: offloading it
        would free nothing."""
        return self._b.storage_other_holders(self._aliases) > 0

    @property
    def retryable(self) -> bool:
        """Skipped by exactly one earlier launch because it was held elsewhere: worth one more
        try (a layer input is free once the caller moved on); a storage that was still held at
        the second try (a mask every layer uses) is not retried again by the layer chain."""
        return self.unmoved and self.shared_skips == 1

    @property
    def resident_candidate(self) -> bool:
        """True while this storage occupies device memory *as a swap candidate*: produced and not
        yet offloaded (unless somebody else holds it, so an offload would keep it), in flight,
        or loaded back."""
        if self.kept_reason is not None or self.state is TensorState.HOST or self.released:
            return False
        return self._aliases is None or not self.held_elsewhere()

    def add_alias(self, facts: SavedFacts) -> int:
        """Register one more saved tensor viewing this storage (described by ``facts``); returns
        its index."""
        if self.state is not TensorState.DEVICE or self._aliases is None:
            raise RuntimeError(
                f"swap group '{self.group.name}': a tensor was saved into a storage that is already "
                f"{self.state.value}; save all tensors of a region before launching its offload.")
        self._aliases.append(facts.alias)
        self._versions.append(facts.version)
        self._metas.append(facts.meta)
        stream = facts.stream
        if stream is not None and not any(stream == s for s in self.producers):
            self.producers.append(stream)
        return len(self._aliases) - 1

    def _out_of_order(self, call: str, advice: str = "") -> RuntimeError:
        """The error of ``call`` reaching this storage in a state it cannot start from."""
        return RuntimeError(f"swap group '{self.group.name}': {call} on a tensor in state "
                            f"'{self.state.value}'{advice}.")

    def _mutation(self) -> Optional[str]:
        """What is wrong if a saved alias was changed in place since it was saved, else ``None``."""
        if self._aliases is None:
            return None
        for i, alias in enumerate(self._aliases):
            now = self._b.version(alias)
            if now != self._versions[i]:
                return (f"a tensor saved for backward in swap group '{self.group.name}' was modified by an "
                        f"in-place operation after it was saved (version {self._versions[i]} when saved, "
                        f"{now} now); gradients would be wrong. Avoid the in-place op (use its "
                        "out-of-place form) or clone the tensor before the op that saves it.")
        return None

    # ----------------------------------------------------------------- reading
    def get_val(self, index: int) -> Any:
        """Return saved tensor ``index``; raises unless its bytes are on the device."""
        state = self.state
        if state is TensorState.DEVICE:
            if self._aliases is not None:
                problem = self._mutation()
                if problem:
                    raise RuntimeError(problem)
                return self._aliases[index]
            if self._load_event is not None:
                stream = self._b.current_stream(self.device)
                if stream is not None and not any(stream == s for s in self._ready):
                    self._order_use_after_load(stream)
            return self._b.rebuild_view(self._dev, self._metas[index])
        if state is TensorState.D2H:
            # The copy only reads the source, which stays intact until wait_offload.
            return self._b.rebuild_view(self._src, self._metas[index])
        if state is TensorState.HOST:
            raise RuntimeError(
                f"a saved tensor of swap group '{self.group.name}' is on the host (state 'host'): it was "
                "offloaded and never loaded back. Call SwapManager().launch_load"
                f"('{self.group.name}') and SwapManager().wait_load('{self.group.name}') before the "
                "backward that needs it, or chain the layers with set_forward_prefetch_layer.")
        raise RuntimeError(
            f"a saved tensor of swap group '{self.group.name}' is still being loaded (state 'h2d'). "
            f"Call SwapManager().wait_load('{self.group.name}') before the backward that needs it.")

    def _drop_if_unused(self) -> None:
        """On the device with no saved tensor left to read it (autograd dropped them all, possibly
        while it was on the host, and a group load brought it back anyway, e.g. with its bucket):
        let its device copy go."""
        if self._views == 0 and self.state is TensorState.DEVICE:
            self._dev = self._block = None
            self._aliases = None
            self.released = True

    # ----------------------------------------------------------------- offload
    def offload_reason(self) -> Optional[KeepReason]:
        """``None`` when this storage can be offloaded now, else why it stays on the device (kept
        for good, except ``SHARED``: see below)."""
        if self.state is not TensorState.DEVICE:
            raise self._out_of_order("launch_offload", "; only tensors on the device can be offloaded")
        if self.kept_reason is not None:
            return self.kept_reason
        if self._aliases is None:  # reloaded earlier in this step: a second offload is a new save
            return self.keep(KeepReason.RELOADED)
        if self._mutation() is not None:  # modified in place since it was saved
            return self.keep(KeepReason.MODIFIED_IN_PLACE)
        if self.held_elsewhere():
            # Somebody else (the caller still holding a layer's input, a shared mask...) holds
            # this storage: copying it now would free nothing, so skip the bandwidth. Unlike the
            # other reasons this one can pass (the caller moves on to the next layer): the next
            # launch of the group tries again.
            self.shared_skips += 1
            return KeepReason.SHARED
        return None

    def start_offload(self, host: Any, copy_stream: Any, bucket: Any = None, offset: int = 0) -> None:
        """Issue the D2H copy of the whole storage into ``host`` at byte ``offset`` (a slot of
        ``bucket``'s buffer, or a buffer of its own) on ``copy_stream`` (current); after
        :meth:`offload_reason` answered ``None``. If the copy raises, nothing changes."""
        src = self._aliases[0]  # any tensor over the storage: the whole storage is copied
        self._b.copy_bytes(host, src, offset)
        self._host, self._src, self._copy_stream = host, src, copy_stream
        self.bucket, self.slot_offset = bucket, offset
        self._aliases = None
        self.state = TensorState.D2H

    def keep(self, reason: KeepReason) -> KeepReason:
        """Keep this storage on the device for good (a second offload would not help)."""
        self.kept_reason = reason
        return reason

    def wait_offload(self, waiter: Any) -> None:
        """The group's offload event has been waited on stream ``waiter``: drop our reference to
        the source. The allocator may hand its block to a new tensor of the block's stream at
        once; if the source was produced on another stream than ``waiter`` (a side stream), that
        stream is not ordered after the D2H, so the block is protected until the copy is done."""
        if self.state is not TensorState.D2H:
            raise self._out_of_order("wait_offload", "; call launch_offload first")
        if waiter is not None and any(not (p == waiter) for p in self.producers):
            self._protect(self._src, self._copy_stream)
        self._src = None  # the device storage is freed here unless somebody else holds it
        self.state = TensorState.HOST

    # ----------------------------------------------------------------- load
    def cancel_offload(self) -> None:
        """A load of a tensor whose offload was never waited (state d2h): keep the source, which
        is intact. Compute does not wait for the D2H (it only reads the source, as the copy
        does); the block is protected until the copy is done, and the host buffer goes back to
        the pool guarded by the D2H event."""
        self._protect(self._src, self._copy_stream)
        self._dev = self._block = self._src
        self._src = None
        self._release_host(self._host_guard)
        self.state = TensorState.DEVICE
        self._drop_if_unused()

    def allocate(self, compute: Any, bucket_devs: Dict[Any, Any]) -> None:
        """Allocate the H2D destination on ``compute``, the current stream, which will use and
        free it (the caller then makes the copy stream wait for compute); :meth:`copy_in` issues
        the copy. A bucket member's destination is its slot in the device buffer of the whole
        bucket, allocated by the first member that asks and found by the others in
        ``bucket_devs`` (the launch's bucket -> device buffer)."""
        if self.state is not TensorState.HOST:
            raise self._out_of_order("launch_load")
        self._dev_stream = compute
        bucket = self.bucket
        if bucket is None:
            self._dev = self._block = self._b.empty_device_bytes(self.nbytes, self._metas[0])
        else:
            dev = bucket_devs.get(bucket)
            if dev is None:
                dev = bucket_devs[bucket] = self._b.empty_device_bytes(bucket.nbytes, self._metas[0])
            self._block = dev
            self._dev = self._b.slot_bytes(dev, self.slot_offset, self.nbytes)
        self._load_event = None
        self.load_issued = False
        self.state = TensorState.H2D

    def copy_in(self, copy_stream: Any, issue: bool = True) -> None:
        """Issue the H2D copy (called inside the copy-stream context). No ``record_stream`` here:
        compute waits the copy before it uses or frees the destination; only a storage that dies
        before that is protected (``__del__``). ``issue=False``: a bucket member whose bytes the
        group's one copy of the whole bucket brings."""
        if issue:
            self._b.copy_bytes(self._block, self._host)
        self._copy_stream = copy_stream
        self.load_issued = True

    def unload(self) -> None:
        """Undo :meth:`allocate` for a tensor whose copy was never issued (a launch failed
        before reaching it): back to the host, the destination dropped."""
        if self.state is TensorState.H2D and not self.load_issued:
            self._dev = self._block = self._dev_stream = None
            self.state = TensorState.HOST

    def wait_load(self, waiter: Any) -> None:
        """The load's event (:meth:`set_copy_event`) has been waited on stream ``waiter``."""
        if self.state is not TensorState.H2D:
            raise self._out_of_order("wait_load", "; call launch_load first")
        self._load_event = self._host_guard  # the load's event: the H2D reads the host buffer until then
        self._release_host(self._host_guard)
        self._ready = [waiter] if waiter is not None else []
        if waiter is not None and self._dev_stream is not None and not (waiter == self._dev_stream):
            # The block belongs to the allocating stream, which never waited the load: keep it
            # until the waiter (ordered after the copy) is done with it.
            self._protect(self._block, waiter)
        self.state = TensorState.DEVICE
        self._drop_if_unused()

    def _order_use_after_load(self, stream: Any) -> None:
        """Ordering point: a consumer on ``stream`` (the stream current when autograd unpacks the
        tensor, e.g. a backward node replayed on its forward's stream) waits for the H2D copy; and
        if ``stream`` does not own the block, the block is kept until its work is done."""
        self._b.wait_event(stream, self._load_event)
        if self._dev_stream is not None and not (stream == self._dev_stream):
            self._protect(self._block, stream)
        self._ready.append(stream)

    def _protect(self, tensor: Any, stream: Any) -> None:
        """Ordering point: ``record_stream`` -- the allocator must not reuse ``tensor``'s block
        before the work queued on ``stream`` so far is done."""
        if tensor is not None and stream is not None:
            self._b.mark_used_by(tensor, stream)

    def _release_host(self, guard: Any) -> None:
        if self._host is not None:
            if self.bucket is not None:
                self.bucket.release(guard)
            else:
                self.group.pool.release(self._host, self.nbytes, guard)
            self._host = None

    def set_copy_event(self, event: Any) -> None:
        """The event recorded after the copy that uses the host buffer (D2H or H2D)."""
        self._host_guard = event
        if self.bucket is not None:
            self.bucket.guard = event

    def __del__(self) -> None:
        # The region's graph died (forward without backward, or backward done): return the host
        # buffer to the pool, guarded by the copy that may still be writing it; a device block
        # that a copy in flight still reads (D2H) or writes (H2D) is protected from reuse.
        try:
            if self.state is TensorState.D2H:
                self._protect(self._src, self._copy_stream)
            elif self.state is TensorState.H2D:
                self._protect(self._block, self._copy_stream)
            if self._host is not None:
                self._release_host(self._host_guard)
        except Exception:  # interpreter shutdown: the pool may be gone already
            pass

    def __repr__(self) -> str:
        return f"SwapTensor(group={self.group.name!r}, nbytes={self.nbytes}, state={self.state.value})"


class SwapView:
    """What a region keeps in place of one saved tensor: ``get_val()`` returns the tensor.

    Autograd drops it once the node that saved it has run its backward (without
    ``retain_graph``); when every view of a storage is gone, the storage's device copy goes too,
    so backward frees each reloaded tensor as soon as it was used, as recomputation does."""

    __slots__ = ("_swap_tensor", "_index", "_storage")

    def __init__(self, swap_tensor: SwapTensor, index: int, storage: Any) -> None:
        self._swap_tensor = swap_tensor
        self._index = index
        self._storage = storage  # keeps the region's Storage alive as long as autograd needs it
        swap_tensor._views += 1

    def get_val(self) -> Any:
        return self._swap_tensor.get_val(self._index)

    def __del__(self) -> None:
        # A saved tensor of the storage was dropped by autograd. With the last one, a storage on
        # the device (reloaded, or never moved) is needed by nobody: its device copy goes now
        # rather than when the whole region's graph dies.
        try:
            st = self._swap_tensor
            st._views -= 1
            if not st._views:
                st._drop_if_unused()
        except Exception:  # interpreter shutdown
            pass
