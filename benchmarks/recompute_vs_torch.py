"""Step time of hyper-parallel's recompute against PyTorch's own, on the same model.

Four variants, timed interleaved (one step of each per round, many rounds) so that machine noise
hits all of them alike; medians are reported with the ratio ours / PyTorch's:

- ``torch_full``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around each layer
- ``ours_full``: ``checkpoint_wrapper(layer)``
- ``torch_sac``: PyTorch selective checkpoint (``create_selective_checkpoint_contexts``) saving
  ``mm/addmm/bmm`` and recomputing the rest
- ``ours_sac``: ``checkpoint_wrapper(layer, policy_fn=...)`` with the same policy

Run::

    python benchmarks/recompute_vs_torch.py            # defaults sized for 2 CPU cores
    python benchmarks/recompute_vs_torch.py --device cuda --dim 2048 --layers 8 --seq 2048
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.utils.checkpoint as torch_ckpt
from torch import nn

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint_wrapper

HEAVY = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def torch_policy(ctx, op, *args, **kwargs):
    P = torch_ckpt.CheckpointPolicy
    return P.MUST_SAVE if op in HEAVY else P.PREFER_RECOMPUTE


def our_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in HEAVY else CheckpointPolicy.PREFER_RECOMPUTE


class TorchCheckpointed(nn.Module):
    """PyTorch's way: a wrapper module around each layer."""

    def __init__(self, inner: nn.Module, selective: bool) -> None:
        super().__init__()
        self.inner = inner
        self.context_fn = (functools.partial(torch_ckpt.create_selective_checkpoint_contexts, torch_policy)
                           if selective else torch_ckpt.noop_context_fn)

    def forward(self, x, *, mask):
        return torch_ckpt.checkpoint(self.inner, x, mask=mask, use_reentrant=False,
                                     context_fn=self.context_fn)


def build(variant: str, cfg: GPTConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    model = GPT(cfg, seed=0).to(device=device, dtype=dtype)
    for i, layer in enumerate(model.layers):
        if variant == "torch_full":
            model.layers[i] = TorchCheckpointed(layer, selective=False)
        elif variant == "torch_sac":
            model.layers[i] = TorchCheckpointed(layer, selective=True)
        elif variant == "ours_full":
            model.layers[i] = checkpoint_wrapper(layer)
        elif variant == "ours_sac":
            model.layers[i] = checkpoint_wrapper(layer, policy_fn=our_policy)
        else:
            raise ValueError(variant)
    return model


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def make_step(model: nn.Module, cfg: GPTConfig, batch: int, device: torch.device) -> Callable[[], float]:
    tokens, targets = make_batch(cfg, batch, seed=0)
    tokens, targets = tokens.to(device), targets.to(device)

    def step() -> float:
        sync(device)
        t0 = time.perf_counter()
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        sync(device)
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return dt

    return step


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--json", default=None, help="write the medians and ratios here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cfg = GPTConfig(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq, dropout=0.0)
    variants = ["torch_full", "ours_full", "torch_sac", "ours_sac"]
    steps = {v: make_step(build(v, cfg, device, dtype), cfg, args.batch, device) for v in variants}
    for _ in range(args.warmup):
        for v in variants:
            steps[v]()
    times: Dict[str, List[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]  # alternate order: no position bias
        for v in order:
            times[v].append(steps[v]())
    med = {v: statistics.median(ts) for v, ts in times.items()}
    ratios = {"full": med["ours_full"] / med["torch_full"], "selective": med["ours_sac"] / med["torch_sac"]}
    print(f"device={device} torch={torch.__version__} config={cfg.to_dict()} batch={args.batch} "
          f"rounds={args.rounds}")
    print(f"{'variant':<12}{'median ms':>12}{'min ms':>10}")
    for v in variants:
        print(f"{v:<12}{med[v] * 1e3:>12.2f}{min(times[v]) * 1e3:>10.2f}")
    print(f"ratio full recompute  ours/torch = {ratios['full']:.3f}")
    print(f"ratio selective (SAC) ours/torch = {ratios['selective']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "config": cfg.to_dict(),
                       "median_s": med, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
