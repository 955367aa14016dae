"""A yardstick for the swap engine's Python cost: the least a saved-tensor hook pair does to swap
what ``swap_wrapper`` + the layer chain swap on CPU, with the same checks, and nothing else.

Per block (:class:`FloorSwapLayer`): the storage keys of the block's parameters and buffers, read
on every call by the engine's own walk; a pack that keeps parameters, buffers, leaves that require grad
and tensors a byte copy cannot rebuild, and records every other saved tensor under its storage
(aliases share one record, with their versions and layouts); at the block's end, every record
that only the hooks still hold and that was not changed in place is copied to a host buffer from a
free list, and the records the previous block's end skipped because the caller still held them
(its input) get their one more try; an unpack that loads an offloaded record on use, rebuilds the
view and checks the version of one still on the device; and a record's device copy dropped when
autograd drops its last saved tensor.

What it leaves out is what the engine adds around the same work: groups and the manager's lock,
the state machine's states and their errors, statistics, streams and events, buckets, the host
cap, the prefetch budget, early offload during a long layer, several forwards of one layer in
flight (gradient accumulation), MindSpore. So it is not a replacement, only the floor that a
leaner engine could approach: ``benchmarks/swap_overhead.py`` times it next to ``swap_wrapper``.
Synchronous copies only (CPU).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import torch
from torch import nn

from hyper_parallel.backends.torch import _shim
from hyper_parallel.backends.torch.backend import TorchBackend, not_byte_copyable
from hyper_parallel.bench.modes import ByteCounter
from hyper_parallel.core.packer import parameter_storages
from hyper_parallel.core.saved import Saved

__all__ = ["FloorSwapLayer"]

_ON_DEVICE, _ON_HOST = 0, 1
_BACKEND = TorchBackend()  # (for the engine's own parameter walk, parameter_storages)


class _Record:
    """One saved storage: its aliases (while on the device), versions, layouts, host copy."""

    __slots__ = ("aliases", "versions", "metas", "nbytes", "state", "host", "dev", "views", "skips")

    def __init__(self, alias: torch.Tensor, version: int, nbytes: int) -> None:
        self.aliases: Optional[List[torch.Tensor]] = [alias]
        self.versions = [version]
        self.metas = [(alias.shape, alias.stride(), alias.storage_offset(), alias.dtype)]
        self.nbytes = nbytes
        self.state = _ON_DEVICE
        self.host: Optional[torch.Tensor] = None
        self.dev: Optional[torch.Tensor] = None
        self.views = 0
        self.skips = 0


class _View:
    """What the pack returns for a recorded tensor; its death is autograd dropping it."""

    __slots__ = ("rec", "index")

    def __init__(self, rec: _Record, index: int) -> None:
        self.rec = rec
        self.index = index
        rec.views += 1

    def __del__(self) -> None:
        rec = self.rec
        rec.views -= 1
        if not rec.views and rec.state == _ON_DEVICE:
            rec.dev = rec.aliases = None


_free: Dict[int, List[torch.Tensor]] = {}  # host buffers by size, shared by every layer


class _Region:
    """One block's forward: its pack hook, the records in save order, and the unpack hook, which
    counts what comes back."""

    __slots__ = ("params", "records", "order", "counter")

    def __init__(self, params: Set[int], counter: ByteCounter) -> None:
        self.params = params
        self.records: Dict[int, _Record] = {}
        self.order: List[_Record] = []
        self.counter = counter

    def pack(self, t: torch.Tensor) -> Any:
        if not_byte_copyable(t):
            return Saved(_shim.detach_keeping_version(t), _shim.version)
        alias, version, key, nbytes = _shim.saved_identity(t)
        base = t._base if t._base is not None else t
        if nbytes == 0 or key in self.params or (base.is_leaf and base.requires_grad):
            return Saved(alias, _shim.version, saved_version=version)
        rec = self.records.get(key)
        if rec is not None and rec.state == _ON_DEVICE and rec.aliases is not None:
            rec.aliases.append(alias)
            rec.versions.append(version)
            rec.metas.append((alias.shape, alias.stride(), alias.storage_offset(), alias.dtype))
            return _View(rec, len(rec.aliases) - 1)
        rec = self.records[key] = _Record(alias, version, nbytes)
        self.order.append(rec)
        return _View(rec, 0)

    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is Saved:
            return packed.get_val()  # (the version check of a kept tensor)
        rec = packed.rec
        if rec.state == _ON_HOST:
            self.counter.h2d += rec.nbytes
            rec.dev = rec.host.to("cpu", copy=True)
            _free.setdefault(rec.nbytes, []).append(rec.host)
            rec.host = None
            rec.state = _ON_DEVICE
        elif rec.aliases is not None:
            for alias, version in zip(rec.aliases, rec.versions):
                if _shim.version(alias) != version:
                    raise RuntimeError("a saved tensor was modified by an in-place operation after it was saved")
            return rec.aliases[packed.index]
        size, stride, offset, dtype = rec.metas[packed.index]
        return torch.empty(0, dtype=dtype).set_(rec.dev.untyped_storage(), offset, size, stride)


def _offload(records: List[_Record], counter: ByteCounter) -> List[_Record]:
    """Offload what only the hooks hold; returns the records skipped because somebody else held
    them (a record changed in place stays on the device for good)."""
    skipped = []
    for rec in records:
        aliases = rec.aliases
        if rec.state != _ON_DEVICE or aliases is None:
            continue
        if any(_shim.version(a) != v for a, v in zip(aliases, rec.versions)):
            continue
        if _shim.storage_use_count(aliases[0].untyped_storage()) - 1 > len(aliases):
            rec.skips += 1
            skipped.append(rec)
            continue
        free = _free.get(rec.nbytes)
        host = free.pop() if free else torch.empty(rec.nbytes, dtype=torch.uint8)
        host.untyped_storage().copy_(aliases[0].untyped_storage())
        rec.host, rec.aliases, rec.state = host, None, _ON_HOST
        counter.tensors += 1
        counter.d2h += rec.nbytes
    return skipped


class FloorSwapLayer(nn.Module):
    """Run ``inner`` with the floor's hooks, counting what moves into ``counter``. ``previous``:
    the layer before it, whose records skipped as held elsewhere this layer's end retries once
    when ``retry`` (as the layer chain does at the end of every layer but the last)."""

    def __init__(self, inner: nn.Module, counter: ByteCounter, previous: Optional["FloorSwapLayer"] = None,
                 retry: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self._counter = counter
        self._previous = [previous]  # (a list: not registered as a sub-module)
        self._retry = retry
        self._skipped: List[_Record] = []

    def forward(self, *args: Any) -> Any:
        region = _Region(parameter_storages(_BACKEND, self.inner), self._counter)
        with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
            out = self.inner(*args)
        self._skipped = _offload(region.order, self._counter)
        previous = self._previous[0]
        if self._retry and previous is not None and previous._skipped:
            _offload([r for r in previous._skipped if r.skips == 1], self._counter)
            previous._skipped = []
        return out
