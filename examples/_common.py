"""What the distributed examples share: joining the process group torchrun describes, the swap
policy, one printed line per rank, and (``ddp_swap.py``, ``fsdp2_swap.py``) the wrapped GPT and its
training loop. Not an example itself: run the scripts next to it."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Tuple

import torch
import torch.distributed as dist
from torch import nn

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


def setup() -> Tuple[torch.device, int, int]:
    """Join the group torchrun describes, on this rank's accelerator if there is one; returns
    ``(device, rank, world size)``."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.accelerator.is_available():
        device = torch.device(torch.accelerator.current_accelerator().type,
                              local_rank % torch.accelerator.device_count())
        torch.accelerator.set_device_index(device.index)
    else:
        device = torch.device("cpu")
        # the ranks share the cores: without this each one starts a thread per core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group(backend=dist.get_default_backend_for_device(device))
    return device, dist.get_rank(), dist.get_world_size()


def finish() -> None:
    """Leave the process group once every rank is done."""
    dist.barrier()
    dist.destroy_process_group()


def gpt_args(description: str) -> argparse.Namespace:
    """The options of the GPT examples: ``--steps``, ``--batch`` (per rank), ``--no-swap``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--no-swap", action="store_true", help="the same model without recompute or swap")
    return parser.parse_args()


def wrapped_gpt(device: torch.device, swap: bool) -> Tuple[GPT, GPTConfig]:
    """The same GPT on every rank (seeded), its layers wrapped and chained unless ``swap`` is
    false: the first step of the supported order, before DDP or ``fully_shard``."""
    cfg = GPTConfig(vocab=256, dim=128, heads=4, layers=4, seq=128, dropout=0.0)
    model = GPT(cfg, seed=0).to(device)
    if swap:
        # wrap + chain in one call: every layer recomputes with its matmul outputs (and its
        # inputs) swapped; layer i is offloaded while layer i+1 computes and prefetched during
        # layer i+1's backward
        wrap_layers(model.layers, policy_fn=swap_matmuls, swap_inputs=True)
    return model, cfg


def train_gpt(forward: Callable[..., torch.Tensor], model: nn.Module, cfg: GPTConfig, args: argparse.Namespace,
              device: torch.device, rank: int, world: int) -> None:
    """``args.steps`` AdamW steps of ``forward`` (the parallel wrapper around ``model``, or the
    model itself), each rank on its shard of one global batch; prints each rank's loss, peak
    device memory and the bytes offloaded so far."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        tokens, targets = make_batch(cfg, args.batch * world, seed=step, device=device)
        tokens, targets = (t[rank * args.batch:(rank + 1) * args.batch] for t in (tokens, targets))
        with MemoryMeter(device, track=[model, opt], scan_gc=False) as meter:
            loss = forward(tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        offloaded = SwapManager().stats()["offloaded_bytes"]
        say(f"[rank {rank}] step {step} loss {loss.item():.4f} | peak memory "
            f"{meter.peak_bytes / 2**20:.2f} MiB ({meter.peak_above_baseline / 2**20:.2f} MiB above "
            f"the step's start) | offloaded so far {offloaded / 2**20:.2f} MiB")
