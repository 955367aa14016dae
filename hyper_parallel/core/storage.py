"""``Storage``: everything one region saved in one forward."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from .backend import SavedFacts
from .keep_reason import KeepReason
from .saved import Saved
from .swap_tensor import SwapTensor, SwapView

__all__ = ["Storage", "EARLY_OFFLOAD_CHUNK"]

#: Where a group follows memory (``SwapGroup.follows_memory``), a storage offloads what the forward
#: has dropped each time this many more bytes were saved into it (or are still held by the forward).
EARLY_OFFLOAD_CHUNK = 1 << 20


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
        self._unscanned_bytes = 0  # saved since the last look for dropped tensors
        self._held_bytes = 0       # still held by the forward at the last look

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
        view = SwapView(st, 0, self)
        if self.group.follows_memory:
            self._unscanned_bytes += st.nbytes
            if self._unscanned_bytes >= EARLY_OFFLOAD_CHUNK:
                self._unscanned_bytes = 0  # held tensors are looked at again one chunk later
                self.group.offload_dropped(self)
        return view

    def dropped(self) -> List[SwapTensor]:
        """The swap candidates that only the swap system still holds (the forward dropped them):
        offloading them now frees their memory. Notes the bytes the forward still holds."""
        out: List[SwapTensor] = []
        held = 0
        for t in self.swap_tensors:
            if t.unmoved:
                if t.held_elsewhere():
                    held += t.nbytes
                else:
                    out.append(t)
        self._held_bytes = held
        return out

    def offload_dropped(self) -> None:
        """Called by a selective region between two ops of its forward (outputs the forward has
        just let go of are dropped there): where the group follows memory and at least
        :data:`EARLY_OFFLOAD_CHUNK` bytes were saved or are still held, offload what was dropped."""
        if self.group.follows_memory and self._held_bytes + self._unscanned_bytes >= EARLY_OFFLOAD_CHUNK:
            self._unscanned_bytes = 0
            self.group.offload_dropped(self)

    def __repr__(self) -> str:
        return f"Storage(group={self.group.name!r}, swap={len(self.swap_tensors)}, save_bytes={self.save_bytes})"
