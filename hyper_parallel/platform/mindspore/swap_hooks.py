"""Swap of what autograd saves, through ``mindspore.saved_tensors_hooks``."""

from __future__ import annotations

from typing import Any, Callable, Optional, Set

import mindspore as ms
from mindspore import nn

from hyper_parallel.core.activation_checkpoint.policy import Decision, normalize_swap_policy
from hyper_parallel.core.activation_checkpoint.swap_tensor import SwapView

from .saved import Saved

__all__ = ["SwapPacker", "parameter_storages"]


def parameter_storages(owner: Any) -> Set[int]:
    """Storage ids of a Cell's parameters (views of them share these storages)."""
    if not isinstance(owner, nn.Cell):
        return set()
    ids = set()
    for p in owner.get_parameters():
        try:
            ids.add(p.untyped_storage().data_ptr())
        except Exception:  # a parameter not materialised yet (lazy init): nothing saves it
            continue
    return ids


def _is_parameter_like(t: Any, param_ids: Set[int], ops: Any) -> bool:
    if ops.storage_id(t) in param_ids:
        return True
    # A leaf that requires grad: a parameter (perhaps of another Cell) or an input being
    # differentiated; either way it is held outside the region.
    return bool(t._is_leaf and t._requires_grad)  # pylint: disable=protected-access


class SwapPacker:
    """Pack/unpack hooks that put saved tensors into a swap ``Storage``.

    Parameters and their views, and tensors the platform cannot swap, are kept as they are (and
    counted in ``stats()``); ``policy_fn(tensor)`` may keep others (``MUST_SAVE``). What a pack
    returns never holds the original tensor (``saved_tensors_hooks`` forbids it: a reference cycle
    through the graph), only a no-grad alias of it.
    """

    def __init__(self, storage: Any, ops: Any, policy_fn: Optional[Callable[[Any], Any]] = None,
                 param_ids: Optional[Set[int]] = None) -> None:
        self.storage = storage
        self.ops = ops
        self.policy_fn = policy_fn
        self.param_ids = param_ids or set()

    def pack(self, t: Any) -> Any:
        ops = self.ops
        reason = ops.unswappable_reason(t)
        if reason is None and _is_parameter_like(t, self.param_ids, ops):
            reason = "parameter"
        if reason is None and self.policy_fn is not None:
            decision = normalize_swap_policy(
                self.policy_fn(t), f"a saved tensor of shape {tuple(t.shape)} and dtype {t.dtype}")
            if decision is Decision.SAVE:
                reason = "policy_save"
        alias = ops.alias(t)
        if reason is not None:
            nbytes = ops.storage_nbytes(t) if reason != "unsupported_tensor" else 0
            self.storage.add_save(nbytes, reason)
            return Saved(alias)
        return self.storage.add_swap(alias)

    @staticmethod
    def unpack(packed: Any) -> Any:
        return packed.get_val() if isinstance(packed, (Saved, SwapView)) else packed

    def hooks(self) -> ms.saved_tensors_hooks:
        return ms.saved_tensors_hooks(self.pack, self.unpack)
