"""``Storage``: everything one region saved in one forward."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from .backend import SavedFacts
from .keep_reason import KeepReason
from .saved import Saved
from .swap_tensor import SwapTensor, SwapView

__all__ = ["Storage"]


class Storage:
    """What one region (a wrapped module or function call) saved in one forward, in its group.

    Each saved tensor gets a handle that autograd (or the selective region) keeps in its place
    (:meth:`add`): a swap candidate joins the :class:`SwapTensor` of the device storage it views
    (one per storage: aliases are copied once and reload as aliases) and is read back through a
    :class:`SwapView`; a tensor that stays on the device is kept by a :class:`Saved`, its bytes
    counted for ``stats()``.

    A ``Storage`` is referenced by the handles autograd keeps for the region; its group holds it
    weakly, so it disappears with the region's autograd graph.
    """

    def __init__(self, group: Any) -> None:
        #: the ``SwapGroup`` it was made in (its tensors say this group's name in errors)
        self.group = group
        self._b = group.backend
        #: every :class:`SwapTensor` made here, in the order they were saved (read it, do not change it)
        self.swap_tensors: List[SwapTensor] = []
        # Lookup for deduplication: only a storage still on the device can take more aliases. A key
        # may be reused by a new storage once the old one was offloaded (its memory freed), which
        # is why ``swap_tensors`` keeps every SwapTensor ever made.
        self._on_device: Dict[int, SwapTensor] = {}
        self.save_bytes = 0
        #: ``[bytes of its swap candidates]``: outlives the storage (its finalizer reads it)
        self.candidate_tally = [0]

    def add(self, facts: SavedFacts, reason: Optional[KeepReason] = None,
            check: bool = True) -> Union[SwapView, Saved]:
        """The handle to keep in place of one saved tensor, described by ``Backend.saved_facts``:
        a :class:`SwapView` when it is a swap candidate (no ``facts.reason``, and no ``reason`` to
        keep it, e.g. a policy's SAVE), else a :class:`Saved` that keeps it on the device as it is
        (with autograd's in-place check unless ``check`` is false)."""
        reason = reason or facts.reason
        if reason is not None:
            self.save_bytes += facts.nbytes
            self.group.stats.kept_bytes[reason] += facts.nbytes  # (GroupStats.keep of a count that only grows)
            return Saved(facts.alias, self._b.version, check, facts.version)
        st = self._on_device.get(facts.key)
        if st is not None and st.unmoved:
            return SwapView(st, st.add_alias(facts), self)
        st = SwapTensor(self.group, facts)
        self.candidate_tally[0] += st.nbytes
        self._on_device[facts.key] = st
        self.swap_tensors.append(st)
        return SwapView(st, 0, self)

    def __repr__(self) -> str:
        return f"Storage(group={self.group.name!r}, swap={len(self.swap_tensors)}, save_bytes={self.save_bytes})"
