"""Tensor, stream and event operations that the framework-neutral swap engine calls."""

from __future__ import annotations

import contextlib
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from hyper_parallel.platform.base import EventOps

from . import _shim

__all__ = ["ViewMeta", "TorchTensorOps"]


class ViewMeta(NamedTuple):
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device


def _mark_host(t: torch.Tensor) -> None:
    try:
        from .memory import mark_host
    except ImportError:  # the meter is optional for the engine itself
        return
    mark_host(t)


class TorchTensorOps(EventOps):
    """Copies run on an accelerator's copy stream, ordered by events; on a CPU-only build every
    stream operation is a no-op and copies are synchronous, so the same state machine runs."""

    def __init__(self) -> None:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        self.accelerator: Optional[torch.device] = acc
        self._dm = torch.get_device_module(acc.type) if acc is not None else None

    # ----------------------------------------------------------- what may be swapped
    def unswappable_reason(self, t: torch.Tensor) -> Optional[str]:
        """Why ``t`` cannot be swapped (``None`` if it can)."""
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout is not torch.strided:
            return "unsupported_tensor"
        if t.device.type == "meta" or t.is_conj() or t.is_neg():
            # conj/neg views carry a lazy bit that a view rebuilt from raw bytes would lose
            return "unsupported_tensor"
        if self.accelerator is not None and t.device.type != self.accelerator.type:
            return "on_host"
        if t.untyped_storage().nbytes() == 0:
            return "empty"
        return None

    # ----------------------------------------------------------- identity and layout
    def storage_id(self, t: torch.Tensor) -> int:
        return _shim.storage_key(t)

    def storage_nbytes(self, t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes()

    def view_meta(self, t: torch.Tensor) -> ViewMeta:
        return ViewMeta(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device)

    def version(self, t: torch.Tensor) -> int:
        return _shim.version(t)

    def storage_other_holders(self, aliases: List[torch.Tensor]) -> int:
        storage = aliases[0].untyped_storage()
        # use count = tensors viewing the storage + 1 for the `storage` object held here.
        return _shim.storage_use_count(storage) - 1 - len(aliases)

    def byte_view(self, t: torch.Tensor) -> torch.Tensor:
        """A flat uint8 tensor over the whole storage of ``t`` (what gets copied)."""
        with torch.no_grad():
            return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())

    def rebuild_view(self, flat: torch.Tensor, meta: ViewMeta) -> torch.Tensor:
        """The saved tensor, as a view with its original layout over the storage of ``flat``."""
        with torch.no_grad():
            return torch.empty(0, dtype=meta.dtype, device=flat.device).set_(
                flat.untyped_storage(), meta.offset, meta.size, meta.stride)

    # ----------------------------------------------------------- allocation and copies
    def empty_device_bytes(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def empty_host_bytes(self, nbytes: int) -> torch.Tensor:
        # Pinned memory makes D2H/H2D truly asynchronous; a CPU-only build has none.
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.accelerator is not None)
        _mark_host(buf)
        return buf

    def mark_used_by(self, t: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``t`` (no-op on CPU)."""
        if stream is not None and t.device.type != "cpu":
            t.record_stream(stream)

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.no_grad():
            dst.copy_(src, non_blocking=True)

    # ----------------------------------------------------------- streams and events
    def trace_range(self, name: str) -> Any:
        """A named range in ``torch.profiler`` traces (launches and waits of every group)."""
        return torch.profiler.record_function(name)

    # Streams and events all come from the device module (torch.cuda, torch.npu, torch.xpu...)
    # so that stream and event types always match each other.
    def current_stream(self) -> Any:
        return self._dm.current_stream() if self._dm is not None else None

    def new_copy_stream(self) -> Any:
        return self._dm.Stream() if self._dm is not None else None

    def stream_context(self, stream: Any) -> Any:
        if stream is None or self._dm is None:
            return contextlib.nullcontext()
        return self._dm.stream(stream)

    def current_stream_wait(self, event: Any) -> None:
        if event is not None and self._dm is not None:
            self._dm.current_stream().wait_event(event)
