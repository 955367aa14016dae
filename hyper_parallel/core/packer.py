"""The saved-tensor packer of ``swap_wrapper`` and ``swap_inputs``: every tensor autograd saves
inside a region becomes a swap candidate of one swap ``Storage``."""

from __future__ import annotations

from typing import Any, Callable, Optional, Set

from .backend import Backend
from .keep_reason import KeepReason
from .policy import Decision, normalize_swap_policy
from .saved import Saved
from .storage import Storage
from .swap_tensor import SwapView

__all__ = ["SwapPacker", "parameter_storages"]


def parameter_storages(backend: Backend, owner: Any) -> Set[int]:
    """Storage ids of a module's parameters and buffers (views of them share these storages;
    FSDP's unsharded parameters are the module's parameters while its forward runs)."""
    if not backend.is_module(owner):
        return set()
    return {backend.storage_id(t) for t in backend.module_tensors(owner)}


class SwapPacker:
    """Pack/unpack hooks that put saved tensors into a swap ``Storage``.

    Kept on the device as they are (and counted in ``stats()``): parameters, buffers and their
    views, leaves that require grad (a parameter of another module, an input being
    differentiated), tensors the backend cannot swap, and tensors ``policy_fn(tensor)`` answers
    ``MUST_SAVE`` for. Other tensors owned elsewhere (a parent model's mask buffer, a rotary
    table) cannot be told apart from a detached activation here; they are caught before copying,
    when the swap system sees that somebody else still holds their storage (``shared``).
    What a pack returns never holds the saved tensor itself, only a no-grad alias: holding the
    original would make a reference cycle through the autograd graph.
    """

    __slots__ = ("_b", "storage", "policy_fn", "param_ids")

    def __init__(self, backend: Backend, storage: Storage,
                 policy_fn: Optional[Callable[[Any], Any]] = None, param_ids: Optional[Set[int]] = None) -> None:
        self._b = backend
        self.storage = storage
        self.policy_fn = policy_fn
        self.param_ids = param_ids or set()

    def _keep_reason(self, t: Any, key: int) -> Optional[KeepReason]:
        """Why ``t`` (of device storage ``key``) stays on the device, or ``None`` to swap it.
        ``t`` passed ``Backend.unswappable_reason`` already."""
        b = self._b
        if key in self.param_ids:
            return KeepReason.PARAMETER if b.requires_grad(t) else KeepReason.BUFFER
        if b.is_grad_leaf(t):
            return KeepReason.PARAMETER
        if self.policy_fn is not None:
            decision = normalize_swap_policy(
                self.policy_fn(t), f"a saved tensor of shape {tuple(t.shape)} and dtype {t.dtype}")
            if decision is Decision.SAVE:
                return KeepReason.POLICY_SAVE
        return None

    def pack(self, t: Any) -> Any:
        # Called for every tensor autograd saves: the common case (an activation to swap) makes
        # one pass over the checks and computes the storage key once.
        b = self._b
        reason = b.unswappable_reason(t)
        if reason is None:
            key = b.storage_id(t)
            reason = self._keep_reason(t, key)
            if reason is None:
                return self.storage.add_swap(b.alias(t), key)
        self.storage.add_kept(t, reason)
        return Saved(b.alias(t), b.version)

    @staticmethod
    def unpack(packed: Any) -> Any:
        return packed.get_val() if isinstance(packed, (Saved, SwapView)) else packed

    def hooks(self) -> Any:
        """The backend's saved-tensor hooks context with this packer's pack/unpack."""
        return self._b.saved_tensors_hooks(self.pack, self.unpack)
