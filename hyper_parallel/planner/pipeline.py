"""``plan_pipeline``: plan this rank's stage of a pipeline schedule for the micro-batches it holds.

A pipeline stage's peak depends on how many micro-batches its schedule keeps in flight (their
forward has run, their backward has not): 1F1B with ``P`` stages holds up to ``P - s`` on stage
``s``, GPipe all of them. :func:`in_flight_counts` reads that count for every stage from the
schedule's action order. :func:`plan_pipeline` then, on every rank of the pipeline at once:

1. runs one step of the schedule with nothing planned and measures this rank's peak (the
   quantity a budget bounds), recording the last micro-batch the stage's module receives;
2. profiles that micro-batch's forward and backward through the stage's module alone (the last
   stage: the schedule's loss), as a micro-batch after the first runs it (the parameters'
   gradients allocated already, accumulating), and plans it with ``plan_memory``'s planner for ``k`` micro-batches
   in flight (each other one keeps what the plan leaves for its backward). What the measured step
   holds beyond the model's prediction for the unplanned stage (receive buffers, outputs kept
   for the last stage's result, gradients kept to send) is the schedule's own memory: it is
   reserved from the budget (``MemoryPlan.reserved_bytes``), so the step's real peak, not only
   the micro-batch model's, fits;
3. gathers every stage's predicted forward and backward seconds and runs the schedule's action
   order on them (:func:`pipeline_step_seconds`) for the pipeline step's predicted time.

The plans wrap layers; the schedule orchestrates micro-batches. A planned stage swaps through
its own layer chain (one group per layer, each forward's tensors apart from the next forward's),
so the stage needs no ``pipeline_swap`` on top; ``pipeline_recompute`` is for schedules that split
a backward in two halves (zero-bubble), which run several stages per rank: plan those stages with
``plan_memory(..., microbatches_in_flight=pipeline_in_flight(schedule)[s], group=False)`` (each
stage alone: under ``torch.distributed`` the default group is every rank) and add
``pipeline_recompute(schedule)``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .budget import format_bytes, parse_budget
from hyper_parallel.core.backend import active_backend

from .memory_plan import MemoryPlan
from .planner import Planner, make_plan

__all__ = ["plan_pipeline", "pipeline_in_flight", "in_flight_counts", "pipeline_step_seconds", "PipelinePlan",
           "gpipe_actions", "one_f_one_b_actions"]

Action = Tuple[int, str, Optional[int]]  # (stage index, "F" | "B" | "I" | "W", micro-batch)


def gpipe_actions(stages: int, microbatches: int) -> Dict[int, List[Action]]:
    """GPipe's order, stage ``s`` on rank ``s``: every forward, then every backward."""
    return {s: [(s, "F", i) for i in range(microbatches)] + [(s, "B", i) for i in range(microbatches)]
            for s in range(stages)}


def one_f_one_b_actions(stages: int, microbatches: int) -> Dict[int, List[Action]]:
    """1F1B's order as ``Schedule1F1B`` runs it, stage ``s`` on rank ``s``: ``min(n, P - s)``
    forwards, then a backward and a forward in turn, then the remaining backwards. (PyTorch's own
    action table for it, ``pipeline_order``, numbers the last stage's forwards from 1 in 2.13.)

    Example::

        >>> one_f_one_b_actions(stages=2, microbatches=2)[0]
        [(0, 'F', 0), (0, 'F', 1), (0, 'B', 0), (0, 'B', 1)]
    """
    out: Dict[int, List[Action]] = {}
    for s in range(stages):
        warmup = min(microbatches, stages - s)
        order = [(s, "F", i) for i in range(warmup)]
        fwd = warmup
        for bwd in range(microbatches):
            order.append((s, "B", bwd))
            if fwd < microbatches:
                order.append((s, "F", fwd))
                fwd += 1
        out[s] = order
    return out


def in_flight_counts(actions: Mapping[int, Sequence[Action]]) -> Dict[int, int]:
    """The most micro-batches each stage holds at once, over its rank's action order
    (``actions``: rank -> compute actions in order): a micro-batch is held from its forward
    (``F``) until its backward is done (``B``, or ``W``, the weight half of a split backward,
    which frees what the input half ``I`` still needed).

    Example::

        >>> in_flight_counts(one_f_one_b_actions(stages=4, microbatches=8))
        {0: 4, 1: 3, 2: 2, 3: 1}
        >>> in_flight_counts(gpipe_actions(stages=2, microbatches=4))
        {0: 4, 1: 4}
    """
    counts: Dict[int, int] = {}
    for rank_actions in actions.values():
        held: Dict[int, set] = {}
        for stage, kind, mb in rank_actions:
            now = held.setdefault(stage, set())
            if kind == "F":
                now.add(mb)
            elif kind in ("B", "W"):
                now.discard(mb)
            counts[stage] = max(counts.get(stage, 0), len(now))
    return counts


def pipeline_step_seconds(actions: Mapping[int, Sequence[Action]], seconds: Mapping[int, Tuple[float, float]]) -> float:
    """The time of one pipeline step: each rank runs its compute actions in order, one at a
    time; a forward waits for the previous stage's forward of its micro-batch, a backward for the
    next stage's backward of it (and its own forward). ``seconds``: per stage, one micro-batch's
    ``(forward, backward)`` time (a split backward's halves take half each). Communication is
    not counted.

    Example (stage 1 starts after stage 0's first forward; stage 0's last backward waits for
    stage 1's)::

        >>> pipeline_step_seconds(one_f_one_b_actions(2, 2), {0: (1.0, 2.0), 1: (1.0, 2.0)})
        9.0
    """
    done: Dict[Tuple[int, str, Optional[int]], float] = {}
    stages = max(seconds) + 1
    queues = {rank: list(a) for rank, a in actions.items()}
    clock = {rank: 0.0 for rank in queues}
    while any(queues.values()):
        progressed = False
        for rank, queue in queues.items():
            while queue:
                stage, kind, mb = queue[0]
                deps = []
                if kind == "F" and stage > 0:
                    deps.append((stage - 1, "F", mb))
                if kind in ("B", "I") and stage < stages - 1:
                    deps.append((stage + 1, "B", mb))
                if kind in ("B", "I"):
                    deps.append((stage, "F", mb))
                if kind == "W":
                    deps.append((stage, "B", mb))
                if any(d not in done for d in deps):
                    break
                fwd, bwd = seconds[stage]
                cost = fwd if kind == "F" else bwd if kind == "B" else bwd / 2
                end = max([clock[rank]] + [done[d] for d in deps]) + cost
                clock[rank] = end
                # (an input half stands for the backward the previous stage waits for)
                done[(stage, "B" if kind == "I" else kind, mb)] = end
                queue.pop(0)
                progressed = True
        if not progressed:
            raise ValueError("pipeline_step_seconds: the action order waits on an action it never runs")
    return max(clock.values())


def pipeline_in_flight(schedule: Any, prober: Optional[Any] = None) -> Dict[int, int]:
    """Per stage of ``schedule`` (a ``torch.distributed.pipelining`` schedule), the most
    micro-batches it holds at once, read from the schedule's action order (see
    :func:`in_flight_counts`): what ``plan_memory(..., microbatches_in_flight=...)`` takes.

    Example (on every rank of 2; ``stage``: this rank's ``PipelineStage``)::

        pipeline_in_flight(Schedule1F1B(stage, 4, loss_fn=loss_fn))   # {0: 2, 1: 1}
        pipeline_in_flight(ScheduleGPipe(stage, 4, loss_fn=loss_fn))  # {0: 4, 1: 4}
    """
    view = (prober if prober is not None else active_backend().prober()).pipeline(schedule)
    return _in_flight(view)


def _in_flight(view: Any) -> Dict[int, int]:
    actions = view.actions()
    if not actions:
        raise ValueError(f"plan_pipeline: cannot read how many micro-batches each stage of a {view.kind} holds: it has "
                         "no action order (pipeline_order). Plan each stage with plan_memory(stage_layers, "
                         "step_fn, budget, microbatches_in_flight=k, group=False), k being the most micro-batches whose "
                         "forward has run and whose backward has not (group=False: each stage plans alone).")
    return in_flight_counts(actions)


class PipelinePlan:
    """What :func:`plan_pipeline` chose for this rank's stage, and what it predicts.

    Attributes:
        budget_bytes: the budget every rank was planned for.
        stage: this rank's stage index; ``plan``: its :class:`MemoryPlan` (``plan.layers``: the
            stage module's layer stack, ``plan.reserved_bytes``: what the schedule holds beside).
        in_flight: per stage, the micro-batches it holds at once (from the action order).
        reference_peak_bytes: this rank's measured peak of one step with nothing planned.
        stage_seconds: per stage, one micro-batch's predicted ``(forward, backward)`` seconds
            under its plan; ``reference_stage_seconds`` the same with nothing planned.
        predicted_step_s / reference_step_s: the pipeline step's time under the plans, and with
            nothing planned (the action order run on those seconds, communication left out).
    """

    def __init__(self, schedule: Any, actions: Mapping[int, Sequence[Action]], stage: int, plan: MemoryPlan,
                 budget_bytes: int, in_flight: Dict[int, int], reference_peak_bytes: int,
                 stage_seconds: Dict[int, Tuple[float, float]],
                 reference_stage_seconds: Dict[int, Tuple[float, float]]) -> None:
        self.schedule = schedule
        self.actions = actions
        self.stage = stage
        self.plan = plan
        self.budget_bytes = budget_bytes
        self.in_flight = in_flight
        self.reference_peak_bytes = reference_peak_bytes
        self.stage_seconds = stage_seconds
        self.reference_stage_seconds = reference_stage_seconds
        self.predicted_step_s = pipeline_step_seconds(actions, stage_seconds)
        self.reference_step_s = pipeline_step_seconds(actions, reference_stage_seconds)

    @property
    def kept_bytes_per_microbatch(self) -> int:
        """Bytes of what autograd saves in the stage's layers that the plan keeps on the device,
        per micro-batch (``LayerChoice.kept_bytes``, summed)."""
        return sum(c.kept_bytes for c in self.plan.choices)

    def apply(self) -> "PipelinePlan":
        """Wrap this rank's stage layers as planned (``MemoryPlan.apply``); returns the plan."""
        self.plan.apply()
        return self

    def report(self) -> str:
        """The stage plan's report (``MemoryPlan.report``) with the pipeline's lines: in-flight counts, the
        schedule's reserved bytes, the predicted step of the whole pipeline."""
        lines = [f"pipeline plan, stage {self.stage} of {len(self.in_flight)} ({type(self.schedule).__name__}): "
                 f"budget {format_bytes(self.budget_bytes)}",
                 f"  micro-batches in flight per stage: {dict(sorted(self.in_flight.items()))}",
                 f"  this rank, nothing planned: measured peak {format_bytes(self.reference_peak_bytes)}, of which the "
                 f"schedule's own buffers {format_bytes(self.plan.reserved_bytes)}",
                 f"  pipeline step: predicted {self.predicted_step_s * 1e3:.1f} ms, nothing planned "
                 f"{self.reference_step_s * 1e3:.1f} ms",
                 f"  kept per micro-batch on this stage: {format_bytes(self.kept_bytes_per_microbatch)}"]
        return "\n".join(lines) + "\n" + self.plan.report()

    def __repr__(self) -> str:
        return (f"PipelinePlan(stage={self.stage}, in_flight={self.in_flight.get(self.stage)}, "
                f"budget={format_bytes(self.budget_bytes)}, step={self.predicted_step_s * 1e3:.1f} ms, {self.plan!r})")


def plan_pipeline(schedule: Any, budget: Union[int, str], *args: Any, target: Any = None, group: Any = None,
                  prober: Optional[Any] = None, resolution: int = 2048, **kwargs: Any) -> PipelinePlan:
    """Plan this rank's stage of a ``torch.distributed.pipelining`` schedule for ``budget``
    (the peak of one ``schedule.step`` on this rank, as ``plan_memory``'s budget counts it), for
    the micro-batches the schedule keeps in flight on that stage.

    Every rank of the pipeline calls it at the same time with what it passes to
    ``schedule.step``: the first stage the batch (``*args``, ``**kwargs``), the last stage
    ``target=...``; it runs one step of the schedule (see the module docstring) and leaves the
    model as it found it (gradients, the generators). ``group``: the data-parallel group of this
    stage's replicas, which then get one plan (``plan_memory``'s ``group``); by default each stage
    is planned alone. One stage per rank (``ScheduleGPipe``, ``Schedule1F1B``, or any schedule
    with an action order); a schedule whose in-flight counts cannot be read, or a rank running
    several stages, is a ``ValueError`` that says how to plan it with ``plan_memory``.

    The returned plan is not applied: ``plan.apply()`` wraps the stage's layers.

    Example (every rank; ``torchrun --nproc_per_node=2``)::

        stage = PipelineStage(stage_module, rank, 2, device)
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
        plan = plan_pipeline(schedule, "2GiB", x) if rank == 0 else plan_pipeline(schedule, "2GiB", target=y)
        print(plan.report())
        plan.apply()                      # then train: schedule.step(x) / schedule.step(target=y)
    """
    prober = prober if prober is not None else active_backend().prober()
    budget_bytes = parse_budget(budget)
    view = prober.pipeline(schedule)
    if len(view.stages) != 1:
        raise ValueError(
            f"plan_pipeline: this rank runs stages {[s.index for s in view.stages]} of a {view.kind}; plan_pipeline "
            "plans one stage per rank. Plan each stage's layers with plan_memory(..., microbatches_in_flight="
            "pipeline_in_flight(schedule)[s], group=False) and budgets that add up to this rank's.")
    stage = view.stages[0]
    actions = view.actions()
    in_flight = _in_flight(view)
    k = in_flight[stage.index]
    measured = prober.measure_step(stage.device, view.step(args, kwargs, target))
    step_fn = view.stage_step(stage, target)

    def answer(planner: Planner, measure: Any) -> MemoryPlan:
        # What the measured step holds beyond the model of the stage left as it is: the schedule's.
        # (``measure`` runs one micro-batch: it cannot see the others in flight, so no check here)
        reserved = max(0, measured - planner.reference_peak())
        plan = planner.plan(budget_bytes, reserved_bytes=reserved)
        plan.notes.append(f"pipeline stage {stage.index} of {stage.num_stages} ({view.kind}): {k} micro-batch(es) in "
                          f"flight; one step of the schedule with nothing planned peaked at {measured} bytes on this "
                          f"rank, {reserved} more than the stage's model: the schedule's own buffers, reserved")
        return plan

    failure: Optional[Exception] = None
    try:
        with view.gradients_allocated(stage):  # (profiled as a micro-batch after the first: gradients accumulate)
            plan = make_plan(stage.module, step_fn, answer, prober=prober, group=False if group is None else group,
                             microbatches_in_flight=k, resolution=resolution, budget=budget_bytes)
        mine: Any = ("ok", {stage.index: ((plan.reference_forward_s, plan.predicted_step_s - plan.reference_forward_s),
                                          (plan.reference_forward_s, plan.reference_step_s - plan.reference_forward_s))})
    except Exception as exc:  # noqa: BLE001  (re-raised below, once every stage has heard of it)
        failure, mine = exc, ("error", f"{type(exc).__name__}: {exc}")
    # Every stage takes part in the gather, a failed one too: a stage whose plan failed (no plan
    # fits its share of the budget, say) must not leave the others waiting for its times.
    answers = view.collectives().all_gather(mine)
    if failure is not None:
        raise failure
    failed = [(s, msg) for s, (status, msg) in enumerate(answers) if status == "error"]
    if failed:
        raise RuntimeError(f"plan_pipeline: planning failed on pipeline rank {failed[0][0]}: {failed[0][1]}")
    everyone: Dict[int, Any] = {}
    for _, part in answers:
        everyone.update(part)
    return PipelinePlan(schedule, actions, stage.index, plan, budget_bytes, in_flight, measured,
                        {s: v[0] for s, v in everyone.items()}, {s: v[1] for s, v in everyone.items()})
