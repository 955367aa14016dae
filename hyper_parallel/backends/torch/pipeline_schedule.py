"""The planner's ``torch.distributed.pipelining`` part: what ``plan_pipeline`` reads of a
schedule and runs of it.

``plan_pipeline`` (``pipeline.py``) needs, for the stage of this rank: its module, its index and
the stage count, the schedule's action order (for the micro-batches each stage holds), one step
of the schedule to measure what the schedule itself holds, and a micro-batch step through the
stage's module to profile. That step needs a micro-batch as the stage receives it: a non-first
stage's input is the previous stage's activation, so :meth:`TorchPipeline.step` records, while
the schedule runs, the last micro-batch the stage's module is called on (its arguments) and the
gradient its outputs receive in backward, as host copies; :meth:`TorchPipeline.stage_step` then
runs that micro-batch's forward and backward through the module alone (the last stage: the
schedule's loss on the matching slice of the target), profiled inside
:meth:`TorchPipeline.gradients_allocated`: a stage runs every micro-batch but the first with its
parameters' gradients already allocated (they accumulate), and its peak is one of those.

Nothing here imports ``torch.distributed.pipelining``: a program that has a schedule has
imported it, and the schedule's private fields are read in the backend's shim.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_leaves, tree_map

from hyper_parallel.planner.pipeline import gpipe_actions, one_f_one_b_actions
from hyper_parallel.tools.memory import host_allocation, mark_host

from . import _shim
from .collectives import TorchCollectives

__all__ = ["TorchPipeline", "StageView"]


@dataclass
class StageView:
    """One pipeline stage this process runs."""

    index: int
    num_stages: int
    module: Any
    is_first: bool
    is_last: bool
    device: Any
    group: Any = None


@dataclass
class _Seen:
    """What one forward call of a stage's module received (host copies) and, later, the
    gradients its outputs received."""

    args: Any
    kwargs: Any
    grads: Optional[List[torch.Tensor]] = None
    waiting: List[int] = field(default_factory=list)  # positions of the outputs whose gradient is still due


def _host(t: Any) -> Any:
    """A host copy of a tensor (never device memory, for a CPU meter either), its flag kept."""
    if not isinstance(t, torch.Tensor):
        return t
    with host_allocation():
        copy = t.detach().to("cpu", copy=True)
    mark_host(copy)
    return copy.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else copy


class TorchPipeline:
    """A ``torch.distributed.pipelining`` schedule as ``plan_pipeline`` uses it."""

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule
        self.stages = [StageView(int(st.stage_index), int(st.num_stages), st.submod, bool(st.is_first),
                                 bool(st.is_last), torch.device(st.device), getattr(st, "group", None))
                       for st in _shim.pipeline_stages(schedule)]
        self.n_microbatches = _shim.pipeline_microbatches(schedule)
        self._seen: Dict[int, List[_Seen]] = {}

    @property
    def kind(self) -> str:
        """The schedule's class name, for messages and the report."""
        return type(self.schedule).__name__

    def actions(self) -> Optional[Dict[int, List[Tuple[int, str, Optional[int]]]]]:
        """The schedule's compute actions per rank, in the order it runs them, or ``None``:
        ``ScheduleGPipe`` and ``Schedule1F1B`` as their code runs (``one_f_one_b_actions``), any
        other schedule from its action table (``_shim.pipeline_actions``)."""
        # (looked up, not imported: whoever built a schedule imported the module already, and
        # importing it costs every other program seconds)
        schedules = sys.modules.get("torch.distributed.pipelining.schedules")
        stages, n = self.stages[0].num_stages, self.n_microbatches
        if schedules is not None and isinstance(self.schedule, schedules.Schedule1F1B):
            return one_f_one_b_actions(stages, n)
        if schedules is not None and isinstance(self.schedule, schedules.ScheduleGPipe):
            return gpipe_actions(stages, n)
        return _shim.pipeline_actions(self.schedule)

    def collectives(self) -> TorchCollectives:
        """Object collectives over the ranks of the pipeline (the stages' process group)."""
        return TorchCollectives(self.stages[0].group)

    # ------------------------------------------------------------------ one step of the schedule
    def step(self, args: Sequence[Any], kwargs: Dict[str, Any], target: Any) -> Callable[[], None]:
        """A function running one ``schedule.step(*args, target=target, **kwargs)`` that records,
        for each stage here, what its module's forward calls received and their outputs'
        gradients (host copies: :meth:`stage_step` replays the last micro-batch)."""

        def run() -> None:
            handles = [h for stage in self.stages for h in self._watch(stage)]
            try:
                extra: Dict[str, Any] = {}
                if target is not None:
                    extra["target"] = target
                if any(stage.is_last for stage in self.stages):
                    extra["losses"] = []
                self.schedule.step(*args, **extra, **kwargs)
            finally:
                for h in handles:
                    h.remove()

        return run

    def _watch(self, stage: StageView) -> List[Any]:
        seen = self._seen.setdefault(stage.index, [])
        seen.clear()

        def pre(module: Any, args: tuple, kwargs: dict) -> None:
            if torch.is_grad_enabled() and not _shim.in_backward():
                seen.append(_Seen(tree_map(_host, args), tree_map(_host, kwargs)))

        def post(module: Any, args: tuple, kwargs: dict, out: Any) -> None:
            if not (torch.is_grad_enabled() and not _shim.in_backward()) or not seen or stage.is_last:
                return
            call = seen[-1]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            call.grads = [torch.zeros(0)] * len(outs)
            for i, t in enumerate(outs):
                if t.requires_grad:
                    call.waiting.append(i)
                    t.register_hook(lambda g, i=i, call=call: self._got(call, i, g))

        return [stage.module.register_forward_pre_hook(pre, with_kwargs=True),
                stage.module.register_forward_hook(post, with_kwargs=True)]

    @staticmethod
    def _got(call: _Seen, i: int, grad: torch.Tensor) -> None:
        assert call.grads is not None
        call.grads[i] = _host(grad)
        if i in call.waiting:
            call.waiting.remove(i)

    @staticmethod
    @contextlib.contextmanager
    def gradients_allocated(stage: StageView) -> Iterator[None]:
        """The stage's parameters that have no gradient get zeros for the block (a micro-batch
        after the first accumulates into the gradients the first allocated); ``None`` again after."""
        params = [p for p in stage.module.parameters() if p.requires_grad and p.grad is None]
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            yield
        finally:
            for p in params:
                p.grad = None

    # ------------------------------------------------------------------ one micro-batch through a stage
    def stage_step(self, stage: StageView, target: Any) -> Callable[[], None]:
        """One micro-batch's forward and backward through ``stage``'s module alone, on the last
        micro-batch :meth:`step`'s run gave it: the last stage computes the schedule's loss on
        the matching slice of ``target``; another stage back-propagates the gradients its outputs
        received."""
        seen = [c for c in self._seen.get(stage.index, []) if stage.is_last or (c.grads is not None and not c.waiting)]
        if not seen:
            raise RuntimeError(f"plan_pipeline: stage {stage.index} ran no micro-batch forward and backward in the "
                               f"schedule's step (a {self.kind} that never trains this stage?)")
        call = seen[-1]
        device = stage.device

        def on_device(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            moved = t.detach().to(device, copy=True)
            return moved.requires_grad_(t.requires_grad) if t.requires_grad else moved

        args, kwargs = tree_map(on_device, call.args), tree_map(on_device, call.kwargs)
        module = stage.module
        if stage.is_last:
            loss_fn = _shim.pipeline_loss_fn(self.schedule)
            if loss_fn is None or target is None:
                raise ValueError(f"plan_pipeline: the last stage is profiled through the schedule's loss: build the "
                                 f"{self.kind} with loss_fn=... and pass target=... (as to schedule.step)")
            # (the module's last call is the step's last micro-batch; the schedule splits the target
            # as tensor_split does)
            target_mb = torch.tensor_split(target, self.n_microbatches)[-1].detach().to(device, copy=True)

            def last() -> None:
                loss_fn(module(*args, **kwargs), target_mb).backward()

            return last
        grads = [g.to(device) for g in call.grads or ()]

        def middle() -> None:
            outs = [t for t in tree_leaves(module(*args, **kwargs)) if isinstance(t, torch.Tensor)]
            pairs = [(t, g) for t, g in zip(outs, grads) if t.requires_grad]
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

        return middle
