"""The planner's ``torch.distributed`` part: the object collectives ranks agree through.

``plan_memory(..., group=...)`` plans once for a data-parallel group (see ``distributed.py``):
``group=None`` means the default group when ``torch.distributed`` is initialized with more than
one rank, ``group=False`` this process alone, anything else that process group.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist

__all__ = ["TorchCollectives", "collectives_for"]


class TorchCollectives:
    """:class:`~hyper_parallel.planner.distributed.Collectives` over a ``torch.distributed``
    process group (``all_gather_object``, ``broadcast_object_list`` from the group's first rank)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._first = dist.get_global_rank(group, 0) if group is not None else 0

    def all_gather(self, obj: Any) -> List[Any]:
        """``obj`` of every rank of the group, in rank order (``all_gather_object``)."""
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The group's first rank's ``obj``, on every rank (``broadcast_object_list``)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self._first, group=self.group)
        return box[0]


def collectives_for(group: Any) -> Optional[TorchCollectives]:
    """The collectives ``plan_memory(..., group=group)`` agrees through, or ``None`` to plan on
    this process alone (``group=False``; ``None`` when ``torch.distributed`` is not initialized or
    has one rank; a group of one rank)."""
    if group is False:
        return None
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"plan_memory(group=...): expected a torch.distributed ProcessGroup, None (the default group "
                        f"when torch.distributed is initialized) or False (this process alone), got {group!r}")
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("plan_memory(group=...): torch.distributed is not initialized "
                             "(call torch.distributed.init_process_group first, or leave group out)")
        return None
    collectives = TorchCollectives(group)
    return collectives if collectives.size > 1 else None
