"""Recompute + swap under DistributedDataParallel.

    torchrun --nproc_per_node=2 examples/ddp_swap.py            # CPU: gloo; GPUs: nccl
    torchrun --nproc_per_node=2 examples/ddp_swap.py --no-swap  # the same without recompute/swap

The supported order: wrap and chain the layers (``wrap_layers``, or checkpoint_wrapper / swap_wrapper
plus ``SwapManager().set_forward_prefetch_layer``), *then* wrap the model in DDP. Every rank trains on its
shard of a global batch; DDP averages the gradients, so training equals one process on the whole
batch. Prints each rank's loss and peak device memory per step.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

try:  # run from a checkout without `pip install -e .`
    import hyper_parallel  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch  # noqa: E402
from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, SwapManager, wrap_layers  # noqa: E402
from hyper_parallel.tools.memory import MemoryMeter  # noqa: E402

HEAVY = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def swap_matmuls(ctx, op, *args, **kwargs):
    """Matmul outputs swapped to host memory, everything else recomputed in backward."""
    return CheckpointPolicy.MUST_SWAP if op in HEAVY else CheckpointPolicy.PREFER_RECOMPUTE


def say(line: str) -> None:
    """One write per line, so that the ranks' lines do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def setup():
    """Join the group torchrun describes, on this rank's accelerator if there is one."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.accelerator.is_available():
        device = torch.device(torch.accelerator.current_accelerator().type,
                              local_rank % torch.accelerator.device_count())
        torch.accelerator.set_device_index(device.index)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group(backend=dist.get_default_backend_for_device(device))
    return device, dist.get_rank(), dist.get_world_size()


def main() -> None:
    parser = argparse.ArgumentParser(description="recompute + swap under DDP")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--no-swap", action="store_true")
    args = parser.parse_args()

    device, rank, world = setup()
    cfg = GPTConfig(vocab=256, dim=128, heads=4, layers=4, seq=128, dropout=0.0)
    model = GPT(cfg, seed=0).to(device)
    if not args.no_swap:
        # 1. wrap + chain in one call: every layer recomputes with its matmul outputs (and its
        #    inputs) swapped; layer i is offloaded while layer i+1 computes and prefetched during
        #    layer i+1's backward
        wrap_layers(model.layers, policy_fn=swap_matmuls, swap_inputs=True)
    # 3. then DDP
    ddp = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    for step in range(args.steps):
        tokens, targets = make_batch(cfg, args.batch * world, seed=step, device=device)
        tokens, targets = (t[rank * args.batch:(rank + 1) * args.batch] for t in (tokens, targets))
        with MemoryMeter(device, track=[model, opt], scan_gc=False) as meter:
            loss = ddp(tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        offloaded = SwapManager().stats()["offloaded_bytes"]
        say(f"[rank {rank}] step {step} loss {loss.item():.4f} | peak memory "
            f"{meter.peak_bytes / 2**20:.2f} MiB ({meter.peak_above_baseline / 2**20:.2f} MiB above "
            f"the step's start) | offloaded so far {offloaded / 2**20:.2f} MiB")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
