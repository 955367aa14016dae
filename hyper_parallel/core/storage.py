"""Everything one region saved in one forward."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from .backend import Backend, SavedFacts
from .keep_reason import KeepReason

from .swap_tensor import SwapTensor, SwapView

__all__ = ["Storage"]


class Storage:
    """The tensors one region (a wrapped module or function call) saved in one forward.

    SWAP entries are :class:`SwapTensor` s, deduplicated by device storage so that aliases are
    copied once and reload as aliases. SAVE entries stay wherever autograd (or the selective
    checkpoint cache) keeps them; the storage only counts their bytes, for ``stats()``.

    A ``Storage`` is referenced by the handles that autograd keeps for the region; its group holds
    it weakly, so it disappears with the region's autograd graph.
    """

    def __init__(self, backend: Backend, pool: Any, group_name: str, stats: Any) -> None:
        self._b = backend
        self._pool = pool
        self.group_name = group_name
        self._stats = stats
        # Lookup for deduplication: only a storage still on the device can take more aliases.
        # A key may be reused by a new storage once the old one was offloaded (its memory freed),
        # so every SwapTensor ever created is also kept in ``swap_storage`` for the group to move.
        self._on_device: Dict[int, SwapTensor] = {}
        self.swap_storage: List[SwapTensor] = []
        self.save_bytes = 0
        # Early offload (the layer chain where copies are synchronous): called with this storage
        # each time ``early_chunk`` more bytes were saved, to offload what only the swap system
        # still holds, as save_on_cpu would have, instead of keeping it to the end of the layer.
        self.on_saved: Optional[Callable[["Storage"], None]] = None
        self.early_chunk = 0
        self._unscanned_bytes = 0  # saved since the last look
        self._held_bytes = 0       # still held by the forward at the last look

    def add_swap(self, alias: Any) -> SwapView:
        """Register a tensor to be swapped (an alias of it: see ``Backend.alias``); returns the
        handle to read it back with."""
        b = self._b
        return self.add_candidate(b.candidate_facts(alias, b.version(alias), b.storage_id(alias),
                                                    b.storage_nbytes(alias)))

    def add_candidate(self, facts: SavedFacts) -> SwapView:
        """:meth:`add_swap` of a tensor already described by ``Backend.saved_facts``."""
        key = facts.key
        st = self._on_device.get(key)
        if st is not None and st.unmoved:
            return SwapView(st, st.add_alias(facts), self)
        st = SwapTensor(self._b, self._pool, self.group_name, facts)
        self._on_device[key] = st
        self.swap_storage.append(st)
        view = SwapView(st, 0, self)
        if self.on_saved is not None:
            self._unscanned_bytes += st.nbytes
            if self._unscanned_bytes >= self.early_chunk:
                self._unscanned_bytes = 0  # held tensors are looked at again one chunk later
                self.on_saved(self)
        return view

    def dropped(self) -> List[SwapTensor]:
        """The swap candidates that only the swap system still holds (the forward dropped them):
        offloading them now frees their memory. Notes the bytes the forward still holds."""
        out: List[SwapTensor] = []
        held = 0
        for t in self.swap_storage:
            if t.unmoved:
                if t.held_elsewhere():
                    held += t.nbytes
                else:
                    out.append(t)
        self._held_bytes = held
        return out

    def offload_dropped(self) -> None:
        """Called by a selective region between two ops of its forward (outputs the forward has
        just let go of are dropped there): with early offload on, and at least ``early_chunk``
        bytes saved or still held, offload what was dropped (``on_saved``)."""
        if self.on_saved is not None and self._held_bytes + self._unscanned_bytes >= self.early_chunk:
            self._unscanned_bytes = 0
            self.on_saved(self)

    def add_save(self, nbytes: int, reason: KeepReason) -> None:
        """Count bytes (``>= 0``) that stay on the device (a SAVE decision, a parameter...)."""
        self.save_bytes += nbytes
        self._stats.kept_bytes[reason] += nbytes  # (GroupStats.keep of a count that only grows)

    def add_kept(self, tensor: Any, reason: KeepReason) -> None:
        """Count the storage of ``tensor``, kept on the device for ``reason`` (nothing for a
        tensor type whose storage cannot be measured)."""
        self.add_save(0 if reason is KeepReason.UNSUPPORTED_TENSOR else self._b.storage_nbytes(tensor), reason)

    def swap_tensors(self) -> List[SwapTensor]:
        """Every :class:`SwapTensor` of this storage, in the order they were saved (the list
        itself: read it, do not change it)."""
        return self.swap_storage

    def __repr__(self) -> str:
        return (f"Storage(group={self.group_name!r}, swap={len(self.swap_storage)}, "
                f"save_bytes={self.save_bytes})")
