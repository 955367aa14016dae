"""Private PyTorch internals the simulated device and the GPU tests need. Each helper says why."""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["storage_use_count", "disable_modes", "cuda_sleep", "cuda_sanitizer"]


def storage_use_count(storage: "torch.UntypedStorage") -> int:
    """References to a ``StorageImpl``: one per tensor viewing it plus one for the live Python
    storage object passed in. The simulator compares it with the references its own queued copies
    hold to see that the program freed a storage while a copy was still queued on it."""
    return torch._C._storage_Use_Count(storage._cdata)


def disable_modes():
    """Run the simulator's own tensor work (deferred copies, poison fills) below every dispatch
    mode: a library region or a user's op counter must not see it."""
    return _disable_current_modes()


def cuda_sleep(cycles: int) -> None:
    """Keep the current CUDA stream busy for about ``cycles`` GPU clock cycles (PyTorch's own
    test helper): the GPU tests delay every copy with it, so that a stream that does not wait a
    copy runs before the copy lands and reads wrong values."""
    torch.cuda._sleep(cycles)


def cuda_sanitizer() -> Optional[Any]:
    """PyTorch's CUDA stream sanitizer module when ``TORCH_CUDA_SANITIZER=1`` enabled it in this
    process (its ``CUDASanitizerErrors`` is what it raises on an unsynchronized access), else
    ``None``. Looked up, never imported: importing it starts PyTorch's GPU tracing."""
    module = sys.modules.get("torch.cuda._sanitizer")
    return module if module is not None and module.cuda_sanitizer.enabled else None
