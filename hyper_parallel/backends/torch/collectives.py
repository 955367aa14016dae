"""The planner's ``torch.distributed`` part: the object collectives ranks agree through.

``plan_memory(..., group=...)`` plans once for a data-parallel group (see ``distributed.py``):
``group=None`` means the default group when ``torch.distributed`` is initialized with more than
one rank, ``group=False`` this process alone, anything else that process group
(``TorchProber.collectives``).
"""

from __future__ import annotations

from typing import Any, List

import torch.distributed as dist

__all__ = ["TorchCollectives"]


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

