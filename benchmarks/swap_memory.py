"""Peak memory at every phase of one training step, swap against recompute and save_on_cpu, on the bench GPT and a
post-LN ``nn.MultiheadAttention`` transformer: ``MEMORY_VARIANTS`` on the benchmark harness, one metered step each (peak
and live bytes at the end of forward, backward and optimizer step). Lower bound (an estimate): parameters + buffers +
gradients + one layer's largest saved activations. Targets: the swap rows <= recompute at every phase, their step peak
<= 1.15x save_on_cpu's. Run::

    python benchmarks/swap_memory.py                        # both models, CPU defaults
    python benchmarks/swap_memory.py --models postln --postln-layers 16 --postln-dim 512
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402

from hyper_parallel.bench import harness, report  # noqa: E402
from hyper_parallel.bench.model import GPT, GPTConfig, make_batch  # noqa: E402
from hyper_parallel.bench.modes import MEMORY_VARIANTS, RECIPES  # noqa: E402
from hyper_parallel.bench.postln import PostLNConfig, PostLNTransformer  # noqa: E402
from hyper_parallel.bench.report import MiB, fmt, ratio  # noqa: E402

SWAP_ROWS = ("ours_ckpt_swap", "ours_swap_wrapper")
PHASE_COLUMNS = (("forward", "peak"), ("forward", "end"), ("backward", "peak"), ("backward", "end"),
                 ("optimizer", "peak"))


def _parser():
    ap = report.script_parser(__doc__)
    ap.add_argument("--models", default="gpt,postln", help="comma-separated: gpt, postln (default both)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated recipes (default: %s; 'none' always runs)" % ",".join(MEMORY_VARIANTS))
    g = ap.add_argument_group("bench GPT (defaults: python -m hyper_parallel.bench's)")
    p = ap.add_argument_group("post-LN transformer")
    for group, prefix, sizes, dropout in ((g, "gpt", (8, 128, 4, 256, 4), .1), (p, "postln", (16, 256, 4, 128, 4), 0.)):
        for name, default in zip(("layers", "dim", "heads", "seq", "batch"), sizes):
            group.add_argument(f"--{prefix}-{name}", type=int, default=default)
        group.add_argument(f"--{prefix}-dropout", type=float, default=dropout)
    p.add_argument("--postln-mlp-ratio", type=int, default=4)
    p.add_argument("--postln-sdpa", action="store_true",
                   help="need_weights=False: attention through scaled_dot_product_attention (default: bmm + softmax)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=1, help="unmetered steps per mode first (default 1)")
    return ap


def _model(name: str, args) -> Tuple[torch.nn.Module, GPTConfig, int]:
    if name == "gpt":
        cfg = GPTConfig(vocab=args.vocab, dim=args.gpt_dim, heads=args.gpt_heads, layers=args.gpt_layers,
                        seq=args.gpt_seq, dropout=args.gpt_dropout)
        return GPT(cfg, seed=args.seed), cfg, args.gpt_batch
    if name == "postln":
        cfg = PostLNConfig(vocab=args.vocab, dim=args.postln_dim, heads=args.postln_heads, layers=args.postln_layers,
                           seq=args.postln_seq, mlp_ratio=args.postln_mlp_ratio, dropout=args.postln_dropout,
                           need_weights=not args.postln_sdpa)
        return PostLNTransformer(cfg, seed=args.seed), cfg, args.postln_batch
    raise SystemExit(f"unknown model {name!r}; choose gpt or postln")


def lower_bound(model: torch.nn.Module, batch: Tuple[torch.Tensor, ...]) -> Dict[str, Any]:
    """Parameters + buffers + gradients + the largest saved activations of one layer (an estimate of the least any
    schedule must hold)."""
    per_layer = harness.saved_bytes_per_layer(copy.deepcopy(model), batch)
    bound = {"static_bytes": harness.module_bytes(model), "grad_bytes": harness.grad_bytes(model),
             "layer_saved_bytes": max(per_layer, default=0), "saved_bytes_per_layer": per_layer}
    bound["lower_bound_bytes"] = bound["static_bytes"] + bound["grad_bytes"] + bound["layer_saved_bytes"]
    return bound


def _targets(rows: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    rec, soc = rows.get("ours_recompute"), rows.get("save_on_cpu")
    for m in [m for m in SWAP_ROWS if m in rows]:
        if rec is not None:
            r = {ph: ratio(rows[m]["phases"][ph]["peak"], rec["phases"][ph]["peak"]) for ph in harness.PHASES}
            out.append({"target": f"{m} peak <= ours_recompute's at every phase",
                        "ok": all(v <= 1.0 for v in r.values()),
                        "detail": ", ".join(f"{ph} {v:.2f}x" for ph, v in r.items())})
        if soc is not None:
            r = ratio(rows[m]["peak_bytes"], soc["peak_bytes"])
            out.append({"target": f"{m} peak <= 1.15x save_on_cpu's", "ok": r <= 1.15, "detail": "%.2fx" % r})
    return out


def _print_model(name: str, cfg, batch: int, res: Dict[str, Any]) -> None:
    rows, bound = res["results"], res["bound"]
    print(f"\n[{name}] {type(cfg).__name__}({', '.join(f'{k}={v}' for k, v in cfg.to_dict().items())}), batch={batch}")
    header = ["variant", "fwd peak", "after fwd", "bwd peak", "after bwd", "opt peak", "step peak", "vs recompute",
              "vs save_on_cpu", "layers above LB", "loss = none"]
    rec, soc = rows.get("ours_recompute"), rows.get("save_on_cpu")
    table = []
    for n, r in rows.items():
        above = (r["peak_bytes"] - bound["lower_bound_bytes"]) / max(1, bound["layer_saved_bytes"])
        eq = "baseline" if n == "none" else {True: "yes", False: "NO", None: "-"}[r["loss_equal_to_none"]]
        sizes = [r["phases"][p][k] for p, k in PHASE_COLUMNS] + [r["peak_bytes"]]
        table.append([n] + ["%.1f" % (x / MiB) for x in sizes]
                     + [fmt(ratio(r["peak_bytes"], other and other["peak_bytes"]), "%.2fx") for other in (rec, soc)]
                     + ["%.2f" % above, eq])
    print(report.table(header, table, align="l" + "r" * (len(header) - 1)))
    print(report.legend([(n, RECIPES[n].what) for n in rows]))
    print(f"lower bound (estimate) {bound['lower_bound_bytes'] / MiB:.1f} MiB = params+buffers "
          f"{bound['static_bytes'] / MiB:.1f} + grads {bound['grad_bytes'] / MiB:.1f} + one layer's saved activations "
          f"{bound['layer_saved_bytes'] / MiB:.1f} (largest of {len(bound['saved_bytes_per_layer'])} layers, unwrapped "
          f"forward)")
    for t in res["targets"]:
        print(f"target {'met' if t['ok'] else 'NOT MET':<7} {t['target']} {t['detail']}".rstrip())
    for n, err in res["errors"].items():
        print(f"FAILED {n}: {err}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    names = report.variant_names(args.variants, MEMORY_VARIANTS, RECIPES, parser)
    device, dtype = report.script_setup(args, parser)
    print(f"swap_memory on {device}, torch {torch.__version__}, dtype {args.dtype}, {torch.get_num_threads()} "
          f"thread(s); warmup {args.warmup}, 1 metered step per variant; load average {report.load_average()}",
          flush=True)
    doc: Dict[str, Any] = {"kind": "swap_memory", "environment": report.environment(device),
                           "load_average": report.load_average(), "config": vars(args), "models": {}}
    failed = mismatch = False
    for name in [n.strip() for n in args.models.split(",") if n.strip()]:
        model, cfg, bsz = _model(name, args)
        model = model.to(device=device, dtype=dtype)
        bound = lower_bound(model, make_batch(cfg, bsz, args.seed, device=device))
        with harness.released_caches(device):
            run = harness.run_variants(names, cfg, batch=bsz, device=device, dtype=dtype, rounds=0,
                                       warmup=args.warmup, lr=0.05, seed=args.seed, base_model=model,
                                       log=lambda s: None)
        rows = {n: harness.summarize(v) for n, v in run.variants.items()}
        report.compare_losses(rows, device.type == "cpu", 1e-5)
        res = {"results": rows, "errors": {**run.skipped, **run.errors}, "bound": bound,
               "config": {**cfg.to_dict(), "batch": bsz}, "targets": _targets(rows)}
        _print_model(name, cfg, bsz, res)
        doc["models"][name] = res
        failed |= bool(res["errors"])
        mismatch |= any(r["loss_equal_to_none"] is False for r in rows.values())
    print("\nMiB; peak = highest during the phase, after = live at its end; LB = lower bound; "
          + ("CPU: live CPU storages (MemoryMeter), host copies of every offloading variant excluded"
             if device.type == "cpu" else "allocator counters"))
    if args.json:
        report.write_json(args.json, doc)
    return 1 if failed else (2 if mismatch else 0)


if __name__ == "__main__":
    sys.exit(main())
