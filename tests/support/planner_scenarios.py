"""Two-process (gloo, CPU) scenarios of the planner in parallel training, for
``tests/test_planner_parallel.py`` (run with ``dist_utils.run_scenarios(..., table=SCENARIOS)``).

Peaks are measured with the live-storage meter around a step, tracking what the step reaches
(the model, its inputs; a pipeline's first step on a fresh schedule, so that the schedule's own
buffers are made, and counted, inside it): the quantity a budget bounds. Every plan is applied
from its JSON to a fresh model.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_parallel.planner import pipeline_step_seconds
from support.dist_utils import MLPBlock

LR = 0.1


def _api():
    from hyper_parallel.core import activation_checkpoint as ac
    return ac


def _meter(*track: Any):
    from hyper_parallel.tools.memory import MemoryMeter
    return MemoryMeter("cpu", track=list(track), scan_gc=False)


def _unplanned_and_budget(model: nn.Module, step: Callable[[], None], *inputs: Any) -> "tuple[int, int]":
    """This rank's measured peak of one unplanned step, and the group's budget: 0.8x the smallest
    rank's (one budget for the group: the ranks' peaks can differ a little)."""
    model.zero_grad(set_to_none=True)
    with _meter(model, *inputs) as meter:
        step()
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes, int(0.8 * min(_gather(meter.peak_bytes)))


def _digest(tensors: List[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _gather(obj: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------------------------
# data parallel (DDP): ranks with different timing noise agree
# ----------------------------------------------------------------------------------------------
def _gpt_config():
    from hyper_parallel.bench.model import GPTConfig
    return GPTConfig(vocab=64, dim=64, heads=2, layers=3, seq=64, dropout=0.0)


def _gpt_batch(rank: int, step: int, per_rank: int = 2):
    from hyper_parallel.bench.model import make_batch
    x, y = make_batch(_gpt_config(), 2 * per_rank, seed=10 + step)
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def _spin(seconds: float) -> None:
    """Busy CPU time (the planner times steps on CPU time when torch runs one thread: a sleep
    would not show)."""
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        pass


def _gpt(rank: int, noisy: bool, plan_text: Optional[str] = None) -> nn.Module:
    from hyper_parallel.bench.model import GPT
    model = GPT(_gpt_config(), seed=0)
    if noisy and rank == 1:  # rank 1's layers take 2 ms longer per forward
        for layer in model.layers:
            layer.register_forward_hook(lambda m, a, o: _spin(0.002))
    if plan_text is not None:
        _api().MemoryPlan.from_json(plan_text, list(model.layers)).apply()
    return model


def _train(module: nn.Module, rank: int, steps: int = 2) -> List[torch.Tensor]:
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    for step in range(steps):
        x, y = _gpt_batch(rank, step)
        module(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in module.parameters()]


def _ddp_step(rank: int, noisy: bool) -> "tuple[nn.Module, Any, Any, Callable[[], None]]":
    """A DDP GPT on this rank's batch: ``(model, x, y, step)``, the step run once (DDP's first
    step rebuilds its buckets)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _gpt(rank, noisy=noisy)
    ddp = DDP(model)
    x, y = _gpt_batch(rank, 0)

    def step() -> None:
        ddp(x, y).backward()

    step()
    return model, x, y, step


def scenario_agree_ddp(rank: int, world: int) -> Dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    ac = _api()
    model, x, y, step = _ddp_step(rank, noisy=True)
    unplanned, budget = _unplanned_and_budget(model, step, x, y)
    t0 = time.perf_counter()
    plan = ac.plan_memory(model.layers, step, budget)  # (torch.distributed is initialized: the ranks agree)
    plan_s = time.perf_counter() - t0
    text = plan.to_json()
    left_as_found = all(p.grad is None for p in model.parameters())
    ac.SwapManager().reset()
    # the plan's measured peak, on a fresh model
    fresh = _gpt(rank, noisy=True, plan_text=text)
    fresh_ddp = DDP(fresh)
    fresh_ddp(x, y).backward()
    fresh.zero_grad(set_to_none=True)
    with _meter(fresh, x, y) as meter:
        fresh_ddp(x, y).backward()
    planned_peak = meter.peak_bytes
    del fresh_ddp, fresh
    ac.SwapManager().reset()
    # training: planned against unplanned, 2 SGD steps each
    plain = _train(DDP(_gpt(rank, noisy=True)), rank)
    ac.SwapManager().reset()
    planned = _train(DDP(_gpt(rank, noisy=True, plan_text=text)), rank)
    ac.SwapManager().reset()
    # ranks whose steps differ in bytes (rank 1 runs a batch of one): a clear error on both
    other = _gpt(rank, noisy=False)
    ox, oy = (x, y) if rank == 0 else (x[:1], y[:1])
    mismatch = None
    try:
        ac.plan_memory(other.layers, lambda: other(ox, oy).backward(), budget)
    except RuntimeError as exc:
        mismatch = str(exc)
    return {"json": text, "budget": budget, "unplanned_peak": unplanned, "planned_peak": planned_peak,
            "predicted_peak": plan.predicted_peak_bytes, "min_budget": plan.min_budget_bytes,
            "choices": [c.option.name() for c in plan.choices], "notes": plan.notes, "plan_s": round(plan_s, 2),
            "left_as_found": left_as_found,
            "train_bitwise": all(torch.equal(a, b) for a, b in zip(plain, planned)),
            "digest": _digest(planned), "mismatch": mismatch}


def scenario_capped_ddp(rank: int, world: int) -> Dict[str, Any]:
    """A DDP step that does not fit: planned and trained under a hard cap (``MemoryMeter(cap=)``,
    an allocator stand-in) at a budget below the plain step's peak, on both ranks."""
    from hyper_parallel.tools.memory import MemoryMeter
    from torch.nn.parallel import DistributedDataParallel as DDP
    ac = _api()
    model, x, y, step = _ddp_step(rank, noisy=False)
    unplanned, _ = _unplanned_and_budget(model, step, x, y)
    minimum = ac.plan_memory(model.layers, step, unplanned).min_budget_bytes
    budget = int(min(_gather(minimum + (unplanned - minimum) // 4)))
    ac.SwapManager().reset()
    refused = None
    try:
        with MemoryMeter("cpu", track=[model, x, y], scan_gc=False, cap=budget):
            step()
    except torch.OutOfMemoryError as exc:
        refused = str(exc)[:80]
    model.zero_grad(set_to_none=True)
    fresh = _gpt(rank, noisy=False)
    fresh_ddp = DDP(fresh)
    fx = lambda: fresh_ddp(x, y).backward()  # noqa: E731
    fx()
    fresh.zero_grad(set_to_none=True)
    with MemoryMeter("cpu", track=[fresh, x, y], scan_gc=False, cap=budget) as meter:
        plan = ac.plan_memory(fresh.layers, fx, budget)
    planning_peak = meter.peak_bytes
    text = plan.to_json()
    ac.SwapManager().reset()
    plain = _train(DDP(_gpt(rank, noisy=False)), rank)
    ac.SwapManager().reset()
    planned_model = _gpt(rank, noisy=False, plan_text=text)
    planned_ddp = DDP(planned_model)
    with MemoryMeter("cpu", track=[planned_model, x, y], scan_gc=False, cap=budget) as meter:
        planned = _train(planned_ddp, rank)
    ac.SwapManager().reset()
    return {"json": text, "budget": budget, "unplanned_peak": unplanned, "refused": refused,
            "planning_peak": planning_peak, "training_peak": meter.peak_bytes,
            "choices": [c.option.name() for c in plan.choices], "notes": plan.notes,
            "train_bitwise": all(torch.equal(a, b) for a, b in zip(plain, planned)), "digest": _digest(planned)}


# ----------------------------------------------------------------------------------------------
# FSDP2: fully_shard per layer and at the root
# ----------------------------------------------------------------------------------------------
def _fsdp_gpt(rank: int, plan_text: Optional[str] = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    model = _gpt(rank, noisy=False)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    if plan_text is not None:  # (wrapping a sharded layer: the supported "shard first" order)
        _api().MemoryPlan.from_json(plan_text, list(model.layers)).apply()
    return model


def _full(model: nn.Module) -> List[torch.Tensor]:
    return [v.full_tensor() if hasattr(v, "full_tensor") else v for v in model.state_dict().values()]


def _local_grads(model: nn.Module) -> List[torch.Tensor]:
    return [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for p in model.parameters()]


def _fsdp_train(model: nn.Module, rank: int, steps: int = 2):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = None
    for step in range(steps):
        x, y = _gpt_batch(rank, step)
        model(x, y).backward()
        grads = grads if grads is not None else _local_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, _full(model)


def scenario_fsdp2(rank: int, world: int) -> Dict[str, Any]:
    ac = _api()
    model = _fsdp_gpt(rank)
    x, y = _gpt_batch(rank, 0)

    def step() -> None:
        model(x, y).backward()

    step()  # (FSDP's lazy initialisation)
    unplanned, budget = _unplanned_and_budget(model, step, x, y)
    plan = ac.plan_memory(model.layers, step, budget)
    text = plan.to_json()
    left_as_found = all(p.grad is None for p in model.parameters())
    ac.SwapManager().reset()
    fresh = _fsdp_gpt(rank, text)
    fresh(x, y).backward()
    fresh.zero_grad(set_to_none=True)
    with _meter(fresh, x, y) as meter:
        fresh(x, y).backward()
    planned_peak = meter.peak_bytes
    del fresh
    ac.SwapManager().reset()
    plain_grads, plain_state = _fsdp_train(_fsdp_gpt(rank), rank)
    ac.SwapManager().reset()
    planned_grads, planned_state = _fsdp_train(_fsdp_gpt(rank, text), rank)
    ac.SwapManager().reset()
    layer = model.layers[0]  # what fully_shard gathers for one layer (its unsharded parameters)
    gathered = sum(p.numel() * p.element_size() for p in layer.parameters())
    return {"json": text, "budget": budget, "unplanned_peak": unplanned, "planned_peak": planned_peak,
            "predicted_peak": plan.predicted_peak_bytes, "reference_peak": plan.reference_peak_bytes,
            "min_budget": plan.min_budget_bytes, "choices": [c.option.name() for c in plan.choices],
            "gathered_layer_bytes": gathered, "left_as_found": left_as_found,
            "grads_bitwise": all(torch.equal(a, b) for a, b in zip(plain_grads, planned_grads)),
            "params_bitwise": all(torch.equal(a, b) for a, b in zip(plain_state, planned_state))}


# ----------------------------------------------------------------------------------------------
# pipeline: 2 stages of 3 blocks, 1F1B, 4 micro-batches
# ----------------------------------------------------------------------------------------------
DIM, HIDDEN, SEQ, BATCH, MICROBATCHES, PER_STAGE = 64, 256, 32, 8, 4, 3


def _blocks(world: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[MLPBlock(DIM, HIDDEN) for _ in range(PER_STAGE * world)])


def _stage_module(rank: int, world: int, plan_text: Optional[str] = None) -> nn.Sequential:
    module = nn.Sequential(*list(_blocks(world))[rank * PER_STAGE:(rank + 1) * PER_STAGE])
    if plan_text is not None:
        _api().MemoryPlan.from_json(plan_text, list(module)).apply()
    return module


def _pipeline_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)


def _schedule(module: nn.Module, rank: int, world: int, kind: str = "1f1b"):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    return {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[kind](stage, MICROBATCHES, loss_fn=F.mse_loss)


def _step(schedule: Any, rank: int, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    return (lambda: schedule.step(x)) if rank == 0 else (lambda: schedule.step(target=y))


def _first_step_peak(module: nn.Module, schedule: Any, rank: int, x, y) -> int:
    """The peak of a fresh schedule's first step (its buffers are made inside it)."""
    with _meter(module, x if rank == 0 else y) as meter:
        _step(schedule, rank, x, y)()
    module.zero_grad(set_to_none=True)
    return meter.peak_bytes


def scenario_pipeline(rank: int, world: int) -> Dict[str, Any]:
    ac = _api()
    x, y = _pipeline_batch()
    unplanned_module = _stage_module(rank, world)
    unplanned = _first_step_peak(unplanned_module, _schedule(unplanned_module, rank, world), rank, x, y)
    peaks = _gather(unplanned)
    budget = peaks[-1] - (peaks[0] - peaks[-1]) // 4  # one budget: below every stage's unplanned peak
    module = _stage_module(rank, world)
    schedule = _schedule(module, rank, world)
    t0 = time.perf_counter()
    plan = ac.plan_pipeline(schedule, budget, x) if rank == 0 else ac.plan_pipeline(schedule, budget, target=y)
    plan_s = time.perf_counter() - t0
    left_as_found = all(p.grad is None for p in module.parameters())
    texts = _gather(plan.plan.to_json())
    # measured: this stage's plan, and the first stage's plan on every stage (the uniform one)
    runs: Dict[str, Any] = {}
    for name, text in (("planned", texts[rank]), ("uniform", texts[0])):
        ac.SwapManager().reset()
        m = _stage_module(rank, world, text)
        s = _schedule(m, rank, world)
        runs[name] = {"module": m, "step": _step(s, rank, x, y), "peak": _first_step_peak(m, s, rank, x, y), "times": []}
    for _ in range(5):  # interleaved, the median of each
        for run in runs.values():
            dist.barrier()
            t0 = time.perf_counter()
            run["step"]()
            run["times"].append(time.perf_counter() - t0)
            run["module"].zero_grad(set_to_none=True)
    # a budget between the stages' smallest reachable peaks: the stage that cannot fit it fails, and
    # the other hears of it (instead of waiting for its times)
    mins = _gather(plan.plan.min_budget_bytes)
    failure = None
    try:
        tight = (min(mins) + max(mins)) // 2
        fresh = _schedule(_stage_module(rank, world), rank, world)
        ac.plan_pipeline(fresh, tight, x) if rank == 0 else ac.plan_pipeline(fresh, tight, target=y)
    except Exception as exc:  # noqa: BLE001  (the test reads it)
        failure = f"{type(exc).__name__}: {exc}"
    extra0 = plan.stage_seconds[0][1] - plan.reference_stage_seconds[0][1]  # what the first stage's plan adds
    uniform_seconds = {s: (f, b + extra0) for s, (f, b) in plan.reference_stage_seconds.items()}
    # one SGD step of the planned pipeline against one process accumulating the micro-batches' gradients
    ac.SwapManager().reset()
    trained = _stage_module(rank, world, texts[rank])
    opt = torch.optim.SGD(trained.parameters(), lr=LR)
    _step(_schedule(trained, rank, world), rank, x, y)()
    opt.step()
    reference = _blocks(world)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for xm, ym in zip(torch.tensor_split(x, MICROBATCHES), torch.tensor_split(y, MICROBATCHES)):
        F.mse_loss(reference(xm), ym).backward()
    for p in reference.parameters():
        p.grad.div_(MICROBATCHES)  # (the schedule scales the accumulated gradients by the micro-batch count)
    ref_opt.step()
    mine = list(trained.parameters())
    theirs = [p for b in list(reference)[rank * PER_STAGE:(rank + 1) * PER_STAGE] for p in b.parameters()]
    gpipe = ac.pipeline_in_flight(_schedule(_stage_module(rank, world), rank, world, "gpipe"))
    ac.SwapManager().reset()
    return {"budget": budget, "unplanned_peak": unplanned, "in_flight": plan.in_flight, "gpipe_in_flight": gpipe,
            "planned_peak": runs["planned"]["peak"], "uniform_peak": runs["uniform"]["peak"],
            "predicted_peak": plan.plan.predicted_peak_bytes, "reserved": plan.plan.reserved_bytes,
            "measured_reference": plan.reference_peak_bytes, "kept_per_microbatch": plan.kept_bytes_per_microbatch,
            "choices": [c.option.name() for c in plan.plan.choices],
            "predicted_step_s": plan.predicted_step_s, "reference_step_s": plan.reference_step_s,
            "predicted_uniform_step_s": pipeline_step_seconds(plan.actions, uniform_seconds),
            "measured_step_s": statistics.median(runs["planned"]["times"]),
            "measured_uniform_step_s": statistics.median(runs["uniform"]["times"]),
            "plan_s": round(plan_s, 2), "left_as_found": left_as_found, "min_budgets": mins, "tight_failure": failure,
            "params_bitwise": all(torch.equal(a, b) for a, b in zip(mine, theirs)),
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(mine, theirs))}


SCENARIOS: Dict[str, Callable[[int, int], Dict[str, Any]]] = {
    "agree_ddp": scenario_agree_ddp,
    "capped_ddp": scenario_capped_ddp,
    "fsdp2": scenario_fsdp2,
    "pipeline": scenario_pipeline,
}


if __name__ == "__main__":  # PYTHONPATH=tests python -m support.planner_scenarios [scenario ...]: print the results
    import json
    import sys

    from support import dist_utils

    chosen = sys.argv[1:] or list(SCENARIOS)
    for rank, res in enumerate(dist_utils.run_scenarios(chosen, table=SCENARIOS)):
        for name, value in res.items():
            print(rank, name, json.dumps({k: v for k, v in value.items() if k != "json"}, default=str))
