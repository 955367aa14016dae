"""Tensor, stream and event operations that the framework-neutral swap engine calls, on MindSpore.

On Ascend / GPU copies run on a copy stream (``mindspore.runtime.Stream``), ordered by events, into
pinned host buffers. On a CPU-only build MindSpore has no streams or events (they return ``None``),
so every stream operation is a no-op and copies are synchronous: the same state machine runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, List, NamedTuple, Optional, Tuple

import mindspore as ms
from mindspore import Tensor, mint

from hyper_parallel.platform.base import EventOps

from . import _shim

__all__ = ["ViewMeta", "MindSporeTensorOps", "device_kind"]

_ACCELERATORS = ("Ascend", "GPU")


class ViewMeta(NamedTuple):
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    dtype: Any
    device: str  # what ``mint.empty(device=...)`` accepts: "CPU", "Ascend", ...


def device_kind(t: Tensor) -> str:
    """``"CPU"`` / ``"Ascend"`` / ``"GPU"`` for a tensor (MindSpore spells e.g. ``"Ascend:0"``)."""
    name = str(t.device).split(":", 1)[0]
    low = name.lower()
    if low == "cpu":
        return "CPU"
    if low in ("ascend", "npu"):
        return "Ascend"
    if low in ("gpu", "cuda"):
        return "GPU"
    return name


class _MstxRange:
    """A named range in Ascend profiler (mstx) traces."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rid: Any = None

    def __enter__(self) -> "_MstxRange":
        try:
            from mindspore.profiler import mstx
            self.rid = mstx.range_start(self.name)
        except Exception:  # profiler not available / not enabled: tracing is optional
            self.rid = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.rid is not None:
            try:
                from mindspore.profiler import mstx
                mstx.range_end(self.rid)
            except Exception:
                pass


class MindSporeTensorOps(EventOps):
    """What ``SwapTensor`` / ``SwapGroup`` / ``HostBufferPool`` ask of the framework."""

    def __init__(self) -> None:
        target = ms.get_context("device_target")
        self.device_target: str = target
        self.accelerator: Optional[str] = target if target in _ACCELERATORS else None

    # ----------------------------------------------------------- what may be swapped
    def unswappable_reason(self, t: Any) -> Optional[str]:
        """Why ``t`` cannot be swapped (``None`` if it can)."""
        if not isinstance(t, Tensor):
            return "unsupported_tensor"
        try:
            if t.is_meta():
                return "unsupported_tensor"
        except Exception:
            pass
        if self.accelerator is not None and device_kind(t) != self.accelerator:
            return "on_host"
        try:
            if t.untyped_storage().nbytes() == 0:
                return "empty"
        except Exception:  # a tensor without a device address (not materialised)
            return "unsupported_tensor"
        return None

    # ----------------------------------------------------------- identity and layout
    def storage_id(self, t: Tensor) -> int:
        # The address of the storage's first byte: aliases (views, reshapes, transposes) share it.
        # It is only compared while the swap system holds an alias, so it cannot be reused meanwhile.
        return t.untyped_storage().data_ptr()

    def storage_nbytes(self, t: Tensor) -> int:
        return t.untyped_storage().nbytes()

    def view_meta(self, t: Tensor) -> ViewMeta:
        return ViewMeta(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype, device_kind(t))

    def version(self, t: Tensor) -> int:
        # Version bumps happen in PyNative's asynchronous pipeline: wait for it, or an in-place
        # op issued just before would not be counted yet.
        t.wait_pipeline()
        return t._version  # pylint: disable=protected-access

    def storage_other_holders(self, aliases: List[Tensor]) -> int:
        """MindSpore exposes no use count of a storage, so "does somebody else still hold it" cannot be
        answered: every candidate is copied. That stays safe (the swap system only drops its own
        references, so memory that others hold is never freed); it only spends bandwidth and a
        host buffer on storages that are shared (see docs/mindspore.md)."""
        return 0

    def _full_typed(self, t: Tensor) -> Tensor:
        """A flat tensor of the storage's dtype over the whole storage of ``t``."""
        st = t.untyped_storage()
        empty = mint.empty(0, dtype=st.dtype, device=device_kind(t))
        n = st.nbytes() // empty.itemsize
        return empty.set_(st, 0, (n,), (1,))

    def byte_view(self, t: Tensor) -> Tensor:
        """A flat uint8 tensor over the whole storage of ``t`` (what gets copied)."""
        with _shim.internal():
            return self._full_typed(t).view(ms.uint8)

    def rebuild_view(self, flat: Tensor, meta: ViewMeta) -> Tensor:
        """The saved tensor, as a view with its original layout over the storage of ``flat``."""
        with _shim.internal():
            typed = flat.view(meta.dtype)
            out = mint.empty(0, dtype=meta.dtype, device=meta.device)
            return out.set_(typed.untyped_storage(), meta.offset, meta.size, meta.stride)

    def alias(self, t: Tensor) -> Tensor:
        """A view of ``t`` with the same layout, no autograd history, sharing its version counter
        (so an in-place change of ``t`` is seen through it). Holding it keeps the storage alive but
        not the autograd graph (``saved_tensors_hooks`` forbids packs that hold the original)."""
        with _shim.internal():
            return t.view(tuple(t.shape))

    # ----------------------------------------------------------- allocation and copies
    def empty_device_bytes(self, nbytes: int, device: Any) -> Tensor:
        with _shim.internal():
            return mint.empty(nbytes, dtype=ms.uint8, device=device)

    def empty_host_bytes(self, nbytes: int) -> Tensor:
        # Pinned memory makes D2H/H2D asynchronous; a CPU-only build has none.
        with _shim.internal():
            return mint.empty(nbytes, dtype=ms.uint8, device="CPU", pin_memory=self.accelerator is not None)

    def mark_used_by(self, t: Tensor, stream: Any) -> None:
        """Tell the allocator that ``stream`` uses ``t`` where MindSpore offers it (no-op on CPU,
        where there are no streams)."""
        record = getattr(t, "record_stream", None)
        if stream is not None and record is not None:
            record(stream)

    def copy_bytes(self, dst: Tensor, src: Tensor) -> None:
        with _shim.internal():
            dst.copy_(src, non_blocking=True)

    # ----------------------------------------------------------- streams and events
    def trace_range(self, name: str) -> Any:
        """A named range in Ascend profiler traces (launches and waits of every group)."""
        if self.accelerator == "Ascend":
            return _MstxRange(name)
        return contextlib.nullcontext()

    def current_stream(self) -> Any:
        return ms.runtime.current_stream() if self.accelerator is not None else None

    def new_copy_stream(self) -> Any:
        return ms.runtime.Stream() if self.accelerator is not None else None

    def stream_context(self, stream: Any) -> Any:
        if stream is None or self.accelerator is None:
            return contextlib.nullcontext()
        return ms.runtime.StreamCtx(stream)

    def current_stream_wait(self, event: Any) -> None:
        if event is not None and self.accelerator is not None:
            ms.runtime.current_stream().wait_event(event)
