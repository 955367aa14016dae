"""Per-microbatch activation swap under pipeline parallelism (``torch.distributed.pipelining``).

    torchrun --nproc_per_node=2 examples/pipeline_swap.py                  # GPipe, prefetch 1
    torchrun --nproc_per_node=2 examples/pipeline_swap.py --schedule 1f1b
    torchrun --nproc_per_node=2 examples/pipeline_swap.py --prefetch 2
    torchrun --nproc_per_node=2 examples/pipeline_swap.py --no-swap        # for comparison

Each rank holds one stage (a slice of the layers). The layers are wrapped for swap as usual (not
chained: in a pipeline the swap groups are per microbatch), and ``pipeline_swap(schedule,
prefetch)`` makes the schedule offload each microbatch's activations after its forward and
prefetch them ``prefetch`` microbatches ahead of its backward: at most ``prefetch + 1``
microbatches' swapped activations are on a stage's device at once, and the groups of a step are
gone when ``step()`` returns. Prints each rank's loss (last stage) and peak device memory per step.
(The process group and the policy come from ``_common.py``, shared by the examples.)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from _common import finish, say, setup, swap_matmuls
from hyper_parallel.bench.model import ResidualMLP
from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper, pipeline_swap, swap_wrapper
from hyper_parallel.tools.memory import MemoryMeter

DIM, HIDDEN, SEQ = 256, 1024, 128


def main() -> None:
    parser = argparse.ArgumentParser(description="per-microbatch swap under pipeline parallelism")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split into microbatches")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-swap", action="store_true")
    args = parser.parse_args()

    device, rank, world = setup()
    torch.manual_seed(0)  # every rank builds the whole model the same way and keeps its slice
    layers = [ResidualMLP(DIM, HIDDEN) for _ in range(world * args.layers_per_stage)]
    mine = layers[rank * args.layers_per_stage:(rank + 1) * args.layers_per_stage]
    if not args.no_swap:  # 1. wrap the stage's layers for swap (no layer chain in a pipeline)
        for i, block in enumerate(mine):
            if i % 2 == 0:
                checkpoint_wrapper(block, policy_fn=swap_matmuls, swap_inputs=True)
            else:
                swap_wrapper(block)
    submod = nn.Sequential(*mine).to(device)
    stage = PipelineStage(submod, rank, world, device)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = cls(stage, args.microbatches, loss_fn=F.mse_loss)
    if not args.no_swap:  # 2. one swap group per (stage, microbatch), driven by the schedule
        schedule = pipeline_swap(schedule, prefetch=args.prefetch, measure=True)
    opt = torch.optim.AdamW(submod.parameters(), lr=1e-3)

    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch, SEQ, DIM, generator=g).to(device)
        y = torch.randn(args.batch, SEQ, DIM, generator=g).to(device)
        losses = []
        with MemoryMeter(device, track=[submod, opt], scan_gc=False) as meter:
            if stage.is_first:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss = f"{torch.stack([l.detach() for l in losses]).mean().item():.4f}" if losses else "  -   "
        say(f"[rank {rank}] step {step} loss {loss} | peak memory {meter.peak_bytes / 2**20:.2f} MiB "
            f"({meter.peak_above_baseline / 2**20:.2f} MiB above the step's start)")
    if not args.no_swap:
        sched = schedule.hp_swap_schedules[stage.stage_index]
        say(f"[rank {rank}] stage {stage.stage_index}: peak swapped bytes on the device "
            f"{sched.peak_resident_bytes / 2**20:.2f} MiB = {sched.peak_resident_microbatches} of "
            f"{args.microbatches} microbatches (bound: prefetch + 1 = {sched.max_resident_microbatches}); "
            f"{sched.offloads} offloads, {sched.loads} loads in {sched.steps} steps")
    finish()


if __name__ == "__main__":
    main()
