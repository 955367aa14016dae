"""Per-tensor overhead of swapping, on a model of many small ops (issue 12's first targets).

The model (``hyper_parallel.bench.swapbench.SmallOpsNet``): ``--blocks`` residual blocks
``x + Linear(hidden, dim)(GELU(Linear(dim, hidden)(LayerNorm(x))))`` on ``(batch, dim)`` inputs,
where a block's saved tensors are tiny and the cost per saved tensor dominates. Every variant of
``swapbench.OVERHEAD_VARIANTS`` runs on its own copy, forward + backward timed interleaved (one
step of each per round, the order reversed every other round) with medians:

- ``none``: no wrapper; ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu()`` per block (on CPU
  ``tensor.cpu()`` returns the tensor itself: nothing is copied);
- ``copy_hooks`` (peer of ``ours_swap_wrapper``): a ``saved_tensors_hooks`` pair per block that copies
  every saved tensor, parameters included, out (``torch.empty_like`` + ``copy_``) and back
  (``clone``): what ``save_on_cpu`` does off-device;
- ``ours_swap_wrapper``: ``wrap_layers(blocks, swap=True)``: every saved activation offloaded
  (parameters stay; the last block is not offloaded) and reloaded;
- ``torch_sac``: PyTorch selective checkpoint (MUST_SAVE mm/addmm, PREFER_RECOMPUTE else);
- ``torch_sac_copy`` (peer of ``ours_ckpt_swap``): ``torch_sac`` whose cached mm/addmm outputs are
  copied out and back, inside ``copy_hooks`` which copy the block input the checkpoint saves. An
  outer ``save_on_cpu`` alone would copy only that input: PyTorch keeps selective-checkpoint outputs
  in its own cache, not as saved tensors. PyTorch's early stop never takes back the last cached
  output of a block, hence fewer bytes back than out;
- ``ours_save``: ``checkpoint_wrapper`` with MUST_SAVE mm/addmm (reference for ``torch_sac``);
- ``ours_ckpt_swap``: ``checkpoint_wrapper(block, MUST_SWAP mm/addmm, PREFER_RECOMPUTE else,
  swap_inputs=True)``, chained: the mm/addmm outputs and the block input offloaded.

Columns: tensors and bytes copied out / back per step (ours: storages whose offload started,
counted in an untimed step, and ``SwapManager().stats()`` bytes; peers: their hooks' counters),
``fwd ms`` / ``bwd ms`` = the medians of the forward and of the backward part of the timed steps,
``copies back`` = the host-to-device copies ours issued (one per bucket of small storages, or per
storage: ``SwapManager().set_bucket_bytes``), ``us/tensor`` = (median - none's) / tensors out,
``py calls`` / ``C calls`` = the calls of Python / C functions the interpreter made in the forward
+ backward of one more untimed step (``swapbench.counting_calls``: a measure of the interpreter
work that a busy machine does not blur), and whether the gradients equal ``none``'s bitwise.
Pairs: ratio ours / peer, the overhead per swapped tensor, (ours - peer) / ours' tensors, and the
ratio of the calls per step.
Targets (issue 12): ``ours_swap_wrapper <= 1.5x copy_hooks``, ``ours_ckpt_swap <= 1.25x torch_sac_copy``.

Run::

    python benchmarks/swap_overhead.py                      # 48 blocks, dim 32, hidden 64, batch 8
    python benchmarks/swap_overhead.py --rounds 60 --json out.json
    python benchmarks/swap_overhead.py --bucket-bytes 1048576        # small storages in buckets
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402

from hyper_parallel.bench import report  # noqa: E402
from hyper_parallel.bench.report import fmt  # noqa: E402
from hyper_parallel.bench.swapbench import OVERHEAD_VARIANTS, run_overhead  # noqa: E402
from hyper_parallel.core.activation_checkpoint import SwapManager  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    ap.add_argument("--variants", default=",".join(OVERHEAD_VARIANTS),
                    help="comma-separated, of: %s ('none' always runs)" % ", ".join(OVERHEAD_VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--bucket-bytes", type=int, default=0, metavar="N",
                    help="SwapManager().set_bucket_bytes(N) for our variants (default 0: off)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    bad = [n for n in names if n not in OVERHEAD_VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(OVERHEAD_VARIANTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    SwapManager().set_bucket_bytes(args.bucket_bytes)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"swap_overhead on cpu, torch {torch.__version__}, {torch.get_num_threads()} thread(s): blocks={args.blocks} "
          f"dim={args.dim} hidden={args.hidden} batch={args.batch}; warmup {args.warmup}, 1 counting step, "
          f"{args.rounds} timed rounds (forward + backward); load average "
          + ("-" if load is None else " ".join("%.2f" % v for v in load)), flush=True)
    out = run_overhead(names, blocks=args.blocks, dim=args.dim, hidden=args.hidden, batch=args.batch,
                       rounds=args.rounds, warmup=args.warmup, seed=args.seed)
    rows, base = out["results"], out["results"]["none"]["median_s"]
    print(report.table(
        ["variant", "who", "median ms", "min ms", "fwd ms", "bwd ms", "vs none", "tensors out", "KiB out", "KiB back",
         "copies back", "us/tensor", "py calls", "C calls", "grads = none"],
        [[n, r["who"], fmt(r["median_s"] * 1e3, "%.2f"), fmt(r["min_s"] * 1e3, "%.2f"),
          fmt(r["forward_median_s"] * 1e3, "%.2f"), fmt(r["backward_median_s"] * 1e3, "%.2f"),
          fmt(report.ratio(r["median_s"], base), "%.2fx"), r["moved"]["tensors"],
          "%.1f" % (r["moved"]["d2h"] / 1024), "%.1f" % (r["moved"]["h2d"] / 1024),
          "-" if r["moved"]["copies_back"] is None else r["moved"]["copies_back"],
          fmt(r["us_per_tensor_vs_none"], "%.1f"), r["calls"]["python"], r["calls"]["builtin"],
          "yes" if r["grads_equal_to_none"] else "NO"]
         for n, r in rows.items()], align="ll" + "r" * 13))
    print(report.legend([(n, r["what"]) for n, r in rows.items()]))
    print("copies back = host-to-device copies ours issued per step (one per bucket of small storages, "
          "or per storage; SwapManager().set_bucket_bytes); '-': a peer, one per tensor back")
    print("fwd ms / bwd ms = medians of the forward and of the backward part of the timed steps")
    print("us/tensor = (median - none's median) / tensors copied out per step")
    print("py calls / C calls = calls of Python functions / of C functions (named tensor functions and methods "
          "included) in the forward + backward of one untimed step (sys.setprofile): the interpreter work, independent "
          "of how busy the machine is")
    print(report.table(
        ["ours", "peer", "ratio", "target", "", "ratio of min", "tensors ours", "tensors peer", "overhead us/tensor",
         "calls ratio"],
        [[p["ours"], p["peer"], fmt(p["ratio"], "%.2fx"), fmt(p["target"], "<= %.2fx"),
          {True: "met", False: "NOT MET", None: ""}[p["met"]], fmt(p["ratio_of_min"], "%.2fx"), p["tensors_ours"],
          p["tensors_peer"], fmt(p["us_per_tensor"], "%.1f"), fmt(p["calls_ratio"], "%.2fx")]
         for p in out["pairs"]], align="llrrlrrrrr"))
    print("ratio = of the medians (the target's); ratio of min = of the fastest steps (less sensitive to a busy "
          "machine); overhead us/tensor = (ours' median - peer's median) / tensors ours copies out per step; "
          "calls ratio = ours' calls per step / peer's (Python + C)")
    print("note: on CPU every copy is a synchronous memcpy with no copy engine to overlap it, so these times measure "
          "the per-tensor bookkeeping and the copies themselves, not what a GPU would hide")
    if args.json:
        report.write_json(args.json, {"kind": "swap_overhead", "environment": report.environment(torch.device("cpu")),
                                      "load_average": load, "config": vars(args), **out})
    return 0 if all(r["grads_equal_to_none"] for r in rows.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
