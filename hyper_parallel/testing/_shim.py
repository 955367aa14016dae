"""Private PyTorch internals the simulated device needs. Each helper says why."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["storage_use_count", "disable_modes"]


def storage_use_count(storage: "torch.UntypedStorage") -> int:
    """References to a ``StorageImpl``: one per tensor viewing it plus one for the live Python
    storage object passed in. The simulator compares it with the references its own queued copies
    hold to see that the program freed a storage while a copy was still queued on it."""
    return torch._C._storage_Use_Count(storage._cdata)


def disable_modes():
    """Run the simulator's own tensor work (deferred copies, poison fills) below every dispatch
    mode: a library region or a user's op counter must not see it."""
    return _disable_current_modes()
