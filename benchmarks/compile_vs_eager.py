"""Step time and peak memory of each recipe eager and under ``torch.compile`` (inductor) on the bench GPT, side by side
on the benchmark harness; compiled losses within relative 1e-4 of the eager ones; compiled peaks on accelerators only
(the CPU meter's dispatch mode cannot see inside compiled kernels). Run::

    python benchmarks/compile_vs_eager.py                       # CPU, small config (minutes: compiles 5 models)
    python benchmarks/compile_vs_eager.py --device cuda --dim 1024 --seq 1024 --layers 8
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402

from hyper_parallel.bench import harness, report  # noqa: E402
from hyper_parallel.bench.model import GPTConfig  # noqa: E402
from hyper_parallel.bench.modes import RECIPES  # noqa: E402
from hyper_parallel.bench.report import MiB, ratio  # noqa: E402
from hyper_parallel.core.activation_checkpoint import SwapManager  # noqa: E402

DEFAULT_RECIPES = ["none", "ours_recompute", "ours_save", "ours_ckpt_swap", "ours_swap_wrapper"]


def main(argv: Optional[List[str]] = None) -> int:
    ap = report.script_parser(__doc__, seed=0, threads=False)
    ap.add_argument("--recipes", default=None, help="comma-separated (default %s)" % ",".join(DEFAULT_RECIPES))
    for name, default in (("layers", 2), ("dim", 64), ("heads", 2), ("seq", 64), ("batch", 4), ("rounds", 8),
                          ("warmup", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args(argv)
    names = report.variant_names(args.recipes, DEFAULT_RECIPES, RECIPES, ap)
    device, dtype = report.script_setup(args, ap)
    cfg = GPTConfig(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq, dropout=0.0)
    run = harness.run_variants([k for n in names for k in (n, n + harness.COMPILED)], cfg, batch=args.batch,
                               device=device, dtype=dtype, rounds=args.rounds, warmup=args.warmup, lr=0.0,
                               seed=args.seed)
    for name, why in {**run.skipped, **run.errors}.items():
        print(f"FAILED {name}: {why}", file=sys.stderr)
    rows, doc = [], {"device": str(device), "config": cfg.to_dict(), "batch": args.batch, "rows": {}}
    for name in names:
        e, c = (run.variants.get(k) for k in (name, name + harness.COMPILED))
        if e is None or c is None:
            continue
        te, tc = harness.median(e.times), harness.median(c.times)
        ok = len(e.losses) == len(c.losses) and all(  # within relative 1e-4: the compiler reorders reductions
            abs(x - y) <= 1e-4 * max(1.0, abs(x)) for x, y in zip(e.losses, c.losses))
        rows.append([name, "%.2f" % (te * 1e3), "%.2f" % (tc * 1e3), "%.2f" % (tc / te), "%.2f" % (e.peak_bytes / MiB),
                     "n/a" if c.peak_bytes is None else "%.2f" % (c.peak_bytes / MiB), "yes" if ok else "NO"])
        doc["rows"][name] = {"eager_s": te, "compiled_s": tc, "ratio": ratio(tc, te), "eager_peak": e.peak_bytes,
                             "compiled_peak": c.peak_bytes, "losses_close": ok}
    print(f"device={device} torch={torch.__version__} config={cfg.to_dict()} batch={args.batch} rounds={args.rounds}")
    print(report.table(["recipe", "eager ms", "compiled ms", "compiled/eager", "eager peak MiB",
                        "compiled peak MiB", "losses close"], rows, align="lrrrrrl"))
    print(report.legend([(n, RECIPES[n].what) for n in names]))
    print(report.swap_stats_line(SwapManager().stats()))
    if args.json:
        report.write_json(args.json, doc)
    return 0 if rows and len(rows) == len(names) and all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
