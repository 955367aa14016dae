"""Recompute + swap under FSDP2 (``torch.distributed.fsdp.fully_shard``).

    torchrun --nproc_per_node=2 examples/fsdp2_swap.py            # CPU: gloo; GPUs: nccl
    torchrun --nproc_per_node=2 examples/fsdp2_swap.py --no-swap

The supported order: wrap and chain the layers (``wrap_layers``, or checkpoint_wrapper / swap_wrapper
plus ``SwapManager().set_forward_prefetch_layer``), *then* ``fully_shard`` every layer and the root.
FSDP's unsharded parameters, their views and its all-gather buffers are never offloaded:
``stats()`` reports them under ``kept_bytes['parameter']`` (FSDP frees them itself after each
layer's forward). Prints each rank's loss and peak device memory per step. (The set-up the
examples share is in ``_common.py``: the process group, the policy, the model and the training loop.)
"""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard

from _common import SwapManager, finish, gpt_args, say, setup, train_gpt, wrapped_gpt


def main() -> None:
    args = gpt_args("recompute + swap under FSDP2")
    device, rank, world = setup()
    model, cfg = wrapped_gpt(device, swap=not args.no_swap)  # 1. wrap + chain the layers
    for layer in model.layers:  # 2. then shard: every layer, then the root
        fully_shard(layer)
    fully_shard(model)
    train_gpt(model, model, cfg, args, device, rank, world)
    kept = SwapManager().stats()["kept_bytes"]
    if kept:
        say(f"[rank {rank}] kept on the device, never offloaded: "
            + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(kept.items())))
    finish()


if __name__ == "__main__":
    main()
