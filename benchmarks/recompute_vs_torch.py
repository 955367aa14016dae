"""Step time of hyper-parallel's recompute against PyTorch's own, on the same model: ``RECOMPUTE_VS_TORCH``'s four
variants (``torch_full`` = ``torch_ckpt``, ``ours_full`` = ``ours_recompute``, ``torch_sac`` = ``torch_sac``: PyTorch's
selective checkpoint saving the matmuls, ``ours_sac`` = ``ours_save``: the same policy), weights fixed (lr 0), forward +
backward timed interleaved over many rounds on the benchmark harness; medians and the ratios ours / PyTorch's.

Run::

    python benchmarks/recompute_vs_torch.py            # defaults sized for 2 CPU cores
    python benchmarks/recompute_vs_torch.py --device cuda --dim 2048 --layers 8 --seq 2048
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402

from hyper_parallel.bench import harness, report  # noqa: E402
from hyper_parallel.bench.model import GPTConfig  # noqa: E402
from hyper_parallel.bench.modes import RECOMPUTE_VS_TORCH  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    ap = report.script_parser(__doc__, seed=0, threads=False)
    for name, default in (("layers", 4), ("dim", 256), ("heads", 4), ("seq", 256), ("batch", 4), ("rounds", 15),
                          ("warmup", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args(argv)
    device, dtype = report.script_setup(args, ap)
    cfg = GPTConfig(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq, dropout=0.0)
    run = harness.run_variants(list(RECOMPUTE_VS_TORCH.values()), cfg, batch=args.batch, device=device, dtype=dtype,
                               rounds=args.rounds, warmup=args.warmup, lr=0.0, seed=args.seed, metered=False)
    for name, why in {**run.skipped, **run.errors}.items():
        print(f"FAILED {name}: {why}", file=sys.stderr)
    if run.skipped or run.errors:
        return 1
    times = {row: run.variants[recipe].times for row, recipe in RECOMPUTE_VS_TORCH.items()}
    med = {row: harness.median(ts) for row, ts in times.items()}
    ratios = {"full": med["ours_full"] / med["torch_full"], "selective": med["ours_sac"] / med["torch_sac"]}
    print(f"device={device} torch={torch.__version__} config={cfg.to_dict()} batch={args.batch} rounds={args.rounds}")
    print(report.table(["variant", "median ms", "min ms"],
                       [[row, "%.2f" % (med[row] * 1e3), "%.2f" % (min(times[row]) * 1e3)] for row in times],
                       align="lrr"))
    print(f"ratio full recompute  ours/torch = {ratios['full']:.3f}")
    print(f"ratio selective (SAC) ours/torch = {ratios['selective']:.3f}")
    if args.json:
        report.write_json(args.json, {"device": str(device), "torch": torch.__version__, "config": cfg.to_dict(),
                                      "median_s": med, "ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
