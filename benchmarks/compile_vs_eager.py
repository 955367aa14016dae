"""Step time and peak memory of each mode eager and under ``torch.compile``, on the bench GPT.

For every recipe (``hyper_parallel.bench.modes``) two copies of the same model: one eager, one
``torch.compile(model)`` (default inductor backend). Compilation happens during warm-up; the
rounds are interleaved (one step of each per round), and the table reports median forward+backward
time, the compiled/eager ratio, peak memory of one step (``MemoryMeter``) and whether the losses
of the compiled copy stay within the compiler's tolerance of the eager ones.

On CPU the memory meter counts storages through a dispatch mode, which cannot see inside compiled
kernels (and changes how dynamo runs the compiled copy), so compiled peaks are reported on
accelerators only (the allocator counts everything there).

Run::

    python benchmarks/compile_vs_eager.py                       # CPU, small config (minutes: compiles 5 models)
    python benchmarks/compile_vs_eager.py --device cuda --dim 1024 --seq 1024 --layers 8
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402

from hyper_parallel.bench import report  # noqa: E402
from hyper_parallel.bench.model import GPT, GPTConfig, make_batch  # noqa: E402
from hyper_parallel.bench.modes import RECIPES, apply_variant  # noqa: E402
from hyper_parallel.bench.timing import interleaved, median, synchronize, timed  # noqa: E402
from hyper_parallel.core.activation_checkpoint import SwapManager  # noqa: E402
from hyper_parallel.tools.memory import MemoryMeter  # noqa: E402

DEFAULT_RECIPES = ["none", "ours_recompute", "ours_save", "ours_ckpt_swap", "ours_swap_wrapper"]


def step(model: torch.nn.Module, batch, seed: int) -> float:
    tokens, targets = batch
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = None
    loss = model(tokens, targets)
    loss.backward()
    return float(loss.detach())


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default=",".join(DEFAULT_RECIPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    cfg = GPTConfig(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq, dropout=0.0)
    batch = make_batch(cfg, args.batch, seed=0, device=device)
    base = GPT(cfg, seed=0).to(device)
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    models: Dict[str, torch.nn.Module] = {}
    for name in names:
        if name not in RECIPES:
            ap.error(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
        model = copy.deepcopy(base)
        apply_variant(model, name, device=device)
        models[f"{name} eager"] = model
        models[f"{name} compiled"] = torch.compile(model)

    losses: Dict[str, List[float]] = {k: [] for k in models}
    for i in range(args.warmup):  # compiles every compiled copy
        for key, model in models.items():
            losses[key].append(step(model, batch, i))
    times: Dict[str, List[float]] = {k: [] for k in models}
    for r, key in interleaved(list(models), args.rounds):
        _, dt = timed(lambda: step(models[key], batch, r), device)
        times[key].append(dt)
    peaks: Dict[str, Optional[int]] = {}
    for key, model in models.items():
        if device.type == "cpu" and key.endswith("compiled"):
            peaks[key] = None
            continue
        synchronize(device)
        with MemoryMeter(device, track=[model], scan_gc=False) as meter:
            losses[key].append(step(model, batch, 99))
        peaks[key] = meter.peak_above_baseline

    rows, doc = [], {"device": str(device), "config": cfg.to_dict(), "batch": args.batch, "rows": {}}
    for name in names:
        e, c = f"{name} eager", f"{name} compiled"
        te, tc = median(times[e]), median(times[c])
        close = all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(losses[e], losses[c]))
        rows.append([name, "%.2f" % (te * 1e3), "%.2f" % (tc * 1e3), "%.2f" % (tc / te),
                     "%.2f" % (peaks[e] / 2**20), "n/a" if peaks[c] is None else "%.2f" % (peaks[c] / 2**20),
                     "yes" if close else "NO"])
        doc["rows"][name] = {"eager_s": te, "compiled_s": tc, "ratio": tc / te, "eager_peak": peaks[e],
                             "compiled_peak": peaks[c], "losses_close": close}
    print(f"device={device} torch={torch.__version__} config={cfg.to_dict()} batch={args.batch} rounds={args.rounds}")
    print(report.table(["recipe", "eager ms", "compiled ms", "compiled/eager", "eager peak MiB",
                        "compiled peak MiB", "losses close"], rows, align="lrrrrrl"))
    print(report.swap_stats_line(SwapManager().stats()))
    if args.json:
        report.write_json(args.json, doc)
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
