"""The saved-tensor packer of ``swap_wrapper`` and ``swap_inputs``: every tensor autograd saves
inside a region becomes a swap candidate of one swap ``Storage``."""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Set

from .backend import Backend
from .keep_reason import KeepReason
from .policy import Decision, normalize_swap_policy
from .storage import Storage

__all__ = ["SwapPacker", "parameter_storages"]


def parameter_storages(backend: Backend, owner: Any) -> Set[int]:
    """Storage ids of a module's parameters and buffers (views of them share these storages;
    FSDP's unsharded parameters are the module's parameters while its forward runs)."""
    return backend.module_storage_ids(owner) if backend.is_module(owner) else set()


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

    def __init__(self, backend: Backend, storage: Optional[Storage],
                 policy_fn: Optional[Callable[[Any], Any]] = None, param_ids: Optional[Set[int]] = None) -> None:
        self._b = backend
        self.storage = storage
        self.policy_fn = policy_fn
        self.param_ids = param_ids or set()

    def pack(self, t: Any) -> Any:
        # Called for every tensor autograd saves: one backend call answers every question (why it
        # stays, or what a swap candidate needs).
        facts = self._b.saved_facts(t, self.param_ids)
        if facts.reason is None and self.policy_fn is not None and not self._policy_swaps(t):
            return self.storage.add(facts, KeepReason.POLICY_SAVE)
        return self.storage.add(facts)

    def _policy_swaps(self, t: Any) -> bool:
        """Whether ``policy_fn(t)`` lets a swap candidate go (anything but a SAVE answer)."""
        decision = normalize_swap_policy(
            self.policy_fn(t), f"a saved tensor of shape {tuple(t.shape)} and dtype {t.dtype}")
        return decision is not Decision.SAVE

    #: ``unpack(packed)`` is ``packed.get_val()`` (pack returns a Saved or a SwapView); a C-level
    #: ``methodcaller`` rather than a function: one Python call less per saved tensor read.
    unpack = staticmethod(operator.methodcaller("get_val"))

    def hooks(self) -> Any:
        """The backend's saved-tensor hooks context with this packer's pack/unpack."""
        return self._b.saved_tensors_hooks(self.pack, self.unpack)
