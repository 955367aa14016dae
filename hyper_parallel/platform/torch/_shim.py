"""The only place that touches private PyTorch internals. Each helper says why it is needed."""

from __future__ import annotations

import torch

__all__ = ["storage_use_count", "in_backward", "detach_keeping_version"]


def storage_use_count(storage: "torch.UntypedStorage") -> int:
    """References to the storage's ``StorageImpl`` (one per tensor viewing it, plus one for the
    live Python storage object passed in). Public torch has no way to ask whether another tensor
    still shares a storage; we need it to skip offloading storages somebody else holds."""
    return torch._C._storage_Use_Count(storage._cdata)


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread. Forward hooks that fire
    then belong to a checkpoint recomputation and must not drive the swap schedule."""
    return torch._C._current_graph_task_id() != -1


def detach_keeping_version(x: torch.Tensor) -> torch.Tensor:
    """``x.detach()`` from inside a ``TorchDispatchMode`` (below autograd), re-enabling the
    ADInplaceOrView key so the alias shares ``x``'s version counter: that is how an in-place
    change of a cached op output is detected later."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()
