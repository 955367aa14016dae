"""What every platform shares: where the public API's implementations live, and the plumbing
between the framework-neutral swap engine and the platform's tensor operations."""

from __future__ import annotations

import importlib
import weakref
from typing import Any, Callable

__all__ = ["PlatformBase", "EventOps"]


class PlatformBase:
    """Base of ``TorchPlatform`` / ``MindSporePlatform``.

    A platform package provides modules ``checkpoint`` (``checkpoint``), ``wrapper``
    (``checkpoint_wrapper``, ``swap_wrapper``) and ``sac`` (``create_selective_checkpoint_contexts``);
    they are imported on first use. The swap engine calls tensor/stream operations
    (``storage_nbytes``, ``copy_bytes``, ``record_event``...) on the platform itself: those are
    forwarded to ``self.tensor_ops``.
    """

    name = "base"

    def __init__(self, tensor_ops: Any) -> None:
        self.tensor_ops = tensor_ops

    def __getattr__(self, item: str) -> Any:
        if item == "tensor_ops":  # not set yet (e.g. during unpickling): avoid endless recursion
            raise AttributeError(item)
        return getattr(self.tensor_ops, item)

    def _impl(self, module: str, name: str) -> Callable[..., Any]:
        package = type(self).__module__.rsplit(".", 1)[0]
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    # ----------------------------------------------------------- public API backends
    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        return self._impl("checkpoint", "checkpoint")(*args, **kwargs)

    def checkpoint_wrapper(self, *args: Any, **kwargs: Any) -> Any:
        return self._impl("wrapper", "checkpoint_wrapper")(*args, **kwargs)

    def swap_wrapper(self, *args: Any, **kwargs: Any) -> Any:
        return self._impl("wrapper", "swap_wrapper")(*args, **kwargs)

    def create_selective_checkpoint_contexts(self, *args: Any, **kwargs: Any) -> Any:
        return self._impl("sac", "create_selective_checkpoint_contexts")(*args, **kwargs)

    # ----------------------------------------------------------- lifecycle
    def on_storage_death(self, storage: Any, callback: Callable[[str], None], name: str) -> None:
        """Call ``callback(name)`` when the swap ``Storage`` object is garbage collected."""
        weakref.finalize(storage, callback, name)


class EventOps:
    """Event plumbing that only needs the stream/event protocol every framework shares
    (``stream.record_event()``, ``stream.wait_event(event)``); ``None`` means "no streams"
    (CPU: copies are synchronous, so there is nothing to order)."""

    def record_event(self, stream: Any) -> Any:
        return stream.record_event() if stream is not None else None

    def stream_wait(self, stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)
