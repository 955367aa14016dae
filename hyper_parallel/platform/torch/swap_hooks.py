"""Swap of what autograd saves, through ``torch.autograd.graph.saved_tensors_hooks``."""

from __future__ import annotations

from typing import Any, Callable, Optional, Set

import torch

from . import _shim

from hyper_parallel.core.activation_checkpoint.policy import Decision, normalize_swap_policy
from hyper_parallel.core.activation_checkpoint.swap_tensor import SwapView

from .saved import Saved

__all__ = ["SwapPacker", "parameter_storages"]


def parameter_storages(owner: Any) -> Set[int]:
    """Storage ids of a module's parameters and buffers (views of them share these storages;
    FSDP's unsharded parameters are the module's parameters while its forward runs)."""
    if not isinstance(owner, torch.nn.Module):
        return set()
    ids = set()
    for t in owner.parameters():
        ids.add(_shim.storage_key(t))
    for t in owner.buffers():
        ids.add(_shim.storage_key(t))
    return ids


def _not_an_activation(t: torch.Tensor, param_ids: Set[int]) -> Optional[str]:
    """Why ``t`` is certainly not an activation of the region (``None`` if it may be one).

    Parameters and buffers of the wrapped module are recognised by storage (so are their views
    and FSDP's unsharded parameters). Beyond the module, a leaf that requires grad, or a view of
    one (``w.t()``), is a parameter of some other module or a user input. Other tensors owned
    elsewhere (a parent model's mask buffer, a rotary table) cannot be told apart from a
    detached activation here; they are caught before copying, when the swap system sees that
    somebody else still holds their storage (``kept_bytes['shared']``).
    """
    base = t._base if t._base is not None else t
    if _shim.storage_key(t) in param_ids:
        return "parameter" if base.requires_grad else "buffer"
    if base.is_leaf and base.requires_grad:
        return "parameter"
    return None


class SwapPacker:
    """Pack/unpack hooks that put saved tensors into a swap ``Storage``.

    Parameters, buffers and their views, and tensors the platform cannot swap, are kept as they
    are (and counted in ``stats()``); ``policy_fn(tensor)`` may keep others (``MUST_SAVE``).
    """

    def __init__(self, storage: Any, ops: Any, policy_fn: Optional[Callable[[torch.Tensor], Any]] = None,
                 param_ids: Optional[Set[int]] = None) -> None:
        self.storage = storage
        self.ops = ops
        self.policy_fn = policy_fn
        self.param_ids = param_ids or set()

    def pack(self, t: torch.Tensor) -> Any:
        alias = t.detach()  # no grad_fn: avoids a reference cycle through the node saving it
        reason = self.ops.unswappable_reason(t)
        if reason is None:
            reason = _not_an_activation(t, self.param_ids)
        if reason is None and self.policy_fn is not None:
            decision = normalize_swap_policy(
                self.policy_fn(t), f"a saved tensor of shape {tuple(t.shape)} and dtype {t.dtype}")
            if decision is Decision.SAVE:
                reason = "policy_save"
        if reason is not None:
            self.storage.add_save(alias.untyped_storage().nbytes(), reason)
            return Saved(alias)
        return self.storage.add_swap(alias)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.get_val() if isinstance(packed, (Saved, SwapView)) else packed

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
