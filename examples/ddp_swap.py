"""Recompute + swap under DistributedDataParallel.

    torchrun --nproc_per_node=2 examples/ddp_swap.py            # CPU: gloo; GPUs: nccl
    torchrun --nproc_per_node=2 examples/ddp_swap.py --no-swap  # the same without recompute/swap

The supported order: wrap and chain the layers (``wrap_layers``, or checkpoint_wrapper / swap_wrapper
plus ``SwapManager().set_forward_prefetch_layer``), *then* wrap the model in DDP. Every rank trains on its
shard of a global batch; DDP averages the gradients, so training equals one process on the whole
batch. Prints each rank's loss and peak device memory per step. (The set-up the examples share is
in ``_common.py``: the process group, the policy, the model and the training loop.)
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from _common import finish, gpt_args, setup, train_gpt, wrapped_gpt


def main() -> None:
    args = gpt_args("recompute + swap under DDP")
    device, rank, world = setup()
    model, cfg = wrapped_gpt(device, swap=not args.no_swap)  # 1. wrap + chain the layers
    ddp = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)  # 2. then DDP
    train_gpt(ddp, model, cfg, args, device, rank, world)
    finish()


if __name__ == "__main__":
    main()
