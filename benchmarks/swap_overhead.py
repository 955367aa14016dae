"""Per-tensor overhead of swapping, on ``SmallOpsNet`` (``--blocks`` blocks ``x + fc2(gelu(fc1(norm(x))))``, whose
saved tensors are tiny: the cost per saved tensor dominates). The rows (``OVERHEAD_VARIANTS``) on the benchmark harness,
weights fixed (lr 0), forward + backward timed interleaved; the peers doing what ours do on a CPU: ``copy_hooks``
(``save_on_cpu``'s copies; against ``ours_swap_wrapper``) and ``torch_sac_copy`` (PyTorch's selective checkpoint with
its cache copied out and back; against ``ours_ckpt_swap``). Pairs: each of ours against its counterparts. Targets:
``ours_swap_wrapper <= 1.5x copy_hooks``, ``ours_ckpt_swap <= 1.25x torch_sac_copy``.

Run::

    python benchmarks/swap_overhead.py                      # 48 blocks, dim 32, hidden 64, batch 8
    python benchmarks/swap_overhead.py --bucket-bytes 1048576        # small storages in buckets
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402

from hyper_parallel.bench import harness, report  # noqa: E402
from hyper_parallel.bench.model import SmallOpsNet  # noqa: E402
from hyper_parallel.bench.modes import OVERHEAD_VARIANTS, RECIPES  # noqa: E402
from hyper_parallel.bench.report import fmt, ratio  # noqa: E402
from hyper_parallel.core.activation_checkpoint import SwapManager  # noqa: E402

#: (ours, peer) -> the target for ours' median / peer's
TARGETS = {("ours_swap_wrapper", "copy_hooks"): 1.5, ("ours_ckpt_swap", "torch_sac_copy"): 1.25}


def pairs(rows: Dict[str, Dict[str, Any]], blocks: int) -> List[Dict[str, Any]]:
    """Each of our rows against each of its counterparts that ran."""
    out = []
    for ours, a in rows.items():
        for peer in RECIPES[ours].counterparts if RECIPES[ours].who == "ours" else ():
            b = rows.get(peer)
            if b is None:
                continue
            calls_a, calls_b = (sum(r["calls"].values()) if r["calls"] else None for r in (a, b))
            r, target = ratio(a["step_time_s"], b["step_time_s"]), TARGETS.get((ours, peer))
            out.append({"ours": ours, "peer": peer, "ratio": r, "target": target,
                        "met": None if target is None or r is None else r <= target,
                        "ratio_of_min": ratio(a["min_step_time_s"], b["min_step_time_s"]),
                        "us_per_block": (a["step_time_s"] - b["step_time_s"]) / blocks * 1e6,
                        "calls_ratio": ratio(calls_a, calls_b)})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = report.script_parser(__doc__, seed=0, device=False)
    for name, default in (("blocks", 48), ("dim", 32), ("hidden", 64), ("batch", 8)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated recipes (default: %s; 'none' always runs)" % ",".join(OVERHEAD_VARIANTS))
    ap.add_argument("--bucket-bytes", type=int, default=0, metavar="N",
                    help="SwapManager().set_bucket_bytes(N) for our variants (default 0: off)")
    args = ap.parse_args(argv)
    names = report.variant_names(args.variants, OVERHEAD_VARIANTS, RECIPES, ap)
    device, _ = report.script_setup(args, ap)
    SwapManager().set_bucket_bytes(args.bucket_bytes)
    print(f"swap_overhead on cpu, torch {torch.__version__}, {torch.get_num_threads()} thread(s): blocks={args.blocks} "
          f"dim={args.dim} hidden={args.hidden} batch={args.batch}; warmup {args.warmup}, 1 step counting calls, "
          f"{args.rounds} timed rounds (forward + backward); load average {report.load_average()}", flush=True)
    model = SmallOpsNet(args.blocks, args.dim, args.hidden, seed=args.seed)
    run = harness.run_variants(names, device=device, rounds=args.rounds, warmup=args.warmup, lr=0.0, seed=args.seed,
                               metered=False, count_calls=True, base_model=model,
                               batches=lambda i: model.make_batch(args.batch, args.seed + 1 + i))
    rows = {n: harness.summarize(v) for n, v in run.variants.items()}
    base = rows["none"]["step_time_s"] if "none" in rows else None
    print(report.table(
        ["variant", "who", "median ms", "min ms", "fwd ms", "bwd ms", "vs none", "KiB out", "KiB back", "tensors out",
         "loads", "us/block", "py calls", "C calls", "grads = none"],
        [[n, r["who"]] + [fmt(r[k] * 1e3, "%.2f") for k in ("step_time_s", "min_step_time_s", "forward_time_s",
                                                              "backward_time_s")]
         + [fmt(ratio(r["step_time_s"], base), "%.2fx"), "%.1f" % (r["bytes_moved_per_step"]["d2h"] / 1024),
            "%.1f" % (r["bytes_moved_per_step"]["h2d"] / 1024), fmt(r["tensors_out_per_step"], "%d"),
            fmt(r["load_launches_per_step"], "%d"),
            fmt(None if base is None else (r["step_time_s"] - base) / args.blocks * 1e6, "%.1f"),
            r["calls"]["python"], r["calls"]["builtin"], "yes" if r["grads_equal_to_none"] else "NO"]
         for n, r in rows.items()], align="ll" + "r" * 13))
    print(report.legend([(n, r["description"]) for n, r in rows.items()]))
    print("fwd / bwd ms: the medians of the two parts of the timed step; us/block: (median - none's) / blocks; "
          "tensors out: by a peer's hooks; loads: our load launches; py / C calls: in one untimed forward + backward")
    found = pairs(rows, args.blocks)
    print(report.table(
        ["ours", "peer", "ratio", "target", "", "ratio of min", "overhead us/block", "calls ratio"],
        [[p["ours"], p["peer"], fmt(p["ratio"], "%.2fx"), fmt(p["target"], "<= %.2fx"),
          {True: "met", False: "NOT MET", None: ""}[p["met"]], fmt(p["ratio_of_min"], "%.2fx"),
          fmt(p["us_per_block"], "%.1f"), fmt(p["calls_ratio"], "%.2fx")] for p in found], align="llrrlrrr"))
    print("ratio: of the medians (the target's), of the fastest steps; calls ratio: Python + C calls per step. "
          + report.CPU_TIMING_NOTE)
    errors = {**run.skipped, **run.errors}
    for n, why in errors.items():
        print(f"FAILED {n}: {why}")
    if args.json:
        report.write_json(args.json, {"kind": "swap_overhead", "environment": report.environment(device),
                                      "load_average": report.load_average(), "config": vars(args), "results": rows,
                                      "pairs": found, "errors": errors})
    return 1 if errors else 0 if all(r["grads_equal_to_none"] for r in rows.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
