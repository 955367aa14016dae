"""Peak memory at every phase of one training step, swap against recompute and save_on_cpu (issue 12).

Two models: the bench GPT (``hyper_parallel.bench.model.GPT``, ``python -m hyper_parallel.bench``'s
default shape) and a post-LN transformer with ``nn.MultiheadAttention`` and a ReLU feed-forward block
(``hyper_parallel.bench.postln``, the original HyperParallel test shape scaled down for a CPU). Modes
(``swapbench.MEMORY_MODES``, recipes of ``hyper_parallel.bench.modes``):

- ``none``: no wrapper;
- ``recompute``: ``checkpoint_wrapper(layer)`` per layer;
- ``swap``: ``checkpoint_wrapper(layer, policy_fn=swap_matmuls, swap_inputs=True)``, chained: mm/addmm/bmm
  outputs and the layer input swapped, the rest recomputed;
- ``swap_wrapper``: ``swap_wrapper(layer)`` per layer, chained;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu`` per layer; on CPU its host copies are made
  and marked as host memory and every reload is a new tensor (as ``benchmarks/compare_peers.py``
  counts it), so all offloading modes' host bytes are excluded alike.

Each mode runs on its own copy of the model (SGD, no optimizer state), ``--warmup`` steps and then
one metered step: the peak and the live bytes at the end of the forward, the backward and the
optimizer step. Memory = parameters + buffers + what the step added (CPU: live CPU storages counted
by ``MemoryMeter``, the engine's host buffers excluded; accelerators: the allocator's counters).
The lower bound is an estimate: parameters + buffers + gradients + the largest saved activations
of one layer (measured on an unwrapped forward). Targets (issue 12): at every phase swap modes <=
recompute; swap peak <= 1.15x save_on_cpu's.

Run::

    python benchmarks/swap_memory.py                        # both models, CPU defaults
    python benchmarks/swap_memory.py --models postln --postln-layers 16 --postln-dim 512
    python benchmarks/swap_memory.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402

from hyper_parallel.bench import report  # noqa: E402
from hyper_parallel.bench.model import GPT, GPTConfig, make_batch  # noqa: E402
from hyper_parallel.bench.postln import PostLNConfig, PostLNTransformer  # noqa: E402
from hyper_parallel.bench.report import MiB, fmt, ratio  # noqa: E402
from hyper_parallel.bench.swapbench import MEMORY_MODES, PHASES, layers_above, run_memory  # noqa: E402

SWAP_MODES = ("swap", "swap_wrapper")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt,postln", help="comma-separated: gpt, postln (default both)")
    ap.add_argument("--modes", default=",".join(MEMORY_MODES),
                    help="comma-separated: %s, or any recipe of hyper_parallel.bench.modes" % ", ".join(MEMORY_MODES))
    g = ap.add_argument_group("bench GPT (defaults: python -m hyper_parallel.bench's)")
    g.add_argument("--gpt-layers", type=int, default=8)
    g.add_argument("--gpt-dim", type=int, default=128)
    g.add_argument("--gpt-heads", type=int, default=4)
    g.add_argument("--gpt-seq", type=int, default=256)
    g.add_argument("--gpt-batch", type=int, default=4)
    g.add_argument("--gpt-dropout", type=float, default=0.1)
    p = ap.add_argument_group("post-LN transformer")
    p.add_argument("--postln-layers", type=int, default=16)
    p.add_argument("--postln-dim", type=int, default=256)
    p.add_argument("--postln-heads", type=int, default=4)
    p.add_argument("--postln-seq", type=int, default=128)
    p.add_argument("--postln-batch", type=int, default=4)
    p.add_argument("--postln-mlp-ratio", type=int, default=4)
    p.add_argument("--postln-dropout", type=float, default=0.0)
    p.add_argument("--postln-sdpa", action="store_true",
                   help="need_weights=False: attention through scaled_dot_product_attention (default: bmm + softmax)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=1, help="unmetered steps per mode first (default 1)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default 1 on CPU)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    return ap


def _model(name: str, args, device: torch.device, dtype: torch.dtype):
    if name == "gpt":
        cfg = GPTConfig(vocab=args.vocab, dim=args.gpt_dim, heads=args.gpt_heads, layers=args.gpt_layers,
                        seq=args.gpt_seq, dropout=args.gpt_dropout)
        model, batch = GPT(cfg, seed=args.seed), args.gpt_batch
    elif name == "postln":
        cfg = PostLNConfig(vocab=args.vocab, dim=args.postln_dim, heads=args.postln_heads, layers=args.postln_layers,
                           seq=args.postln_seq, mlp_ratio=args.postln_mlp_ratio, dropout=args.postln_dropout,
                           need_weights=not args.postln_sdpa)
        model, batch = PostLNTransformer(cfg, seed=args.seed), args.postln_batch
    else:
        raise SystemExit(f"unknown model {name!r}; choose gpt or postln")
    return model.to(device=device, dtype=dtype), cfg, make_batch(cfg, batch, args.seed, device=device), batch


def _targets(res: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    rows = res["results"]
    for m in SWAP_MODES:
        if m not in rows:
            continue
        if "recompute" in rows:
            r = {ph: ratio(rows[m]["phases"][ph]["peak"], rows["recompute"]["phases"][ph]["peak"]) for ph in PHASES}
            out.append({"target": f"{m} peak <= recompute's at every phase", "ok": all(v <= 1.0 for v in r.values()),
                        "detail": ", ".join(f"{ph} {v:.2f}x" for ph, v in r.items())})
        if "save_on_cpu" in rows:
            r = ratio(rows[m]["peak_bytes"], rows["save_on_cpu"]["peak_bytes"])
            out.append({"target": f"{m} peak <= 1.15x save_on_cpu's", "ok": r <= 1.15, "detail": "%.2fx" % r})
    return out


def _print_model(name: str, cfg, batch: int, res: Dict[str, Any]) -> None:
    rows, bound = res["results"], res["bound"]
    print(f"\n[{name}] {type(cfg).__name__}({', '.join(f'{k}={v}' for k, v in cfg.to_dict().items())}), batch={batch}")
    header = ["mode", "fwd peak", "after fwd", "bwd peak", "after bwd", "opt peak", "step peak", "vs recompute",
              "vs save_on_cpu", "layers above LB", "loss = none"]
    rec, soc, base = rows.get("recompute"), rows.get("save_on_cpu"), rows.get("none")
    table = []
    for mode, r in rows.items():
        ph = r["phases"]
        eq = "baseline" if mode == "none" else ("-" if base is None else ("yes" if r["loss"] == base["loss"] else "NO"))
        table.append([mode] + ["%.1f" % (ph[p][k] / MiB) for p, k in (("forward", "peak"), ("forward", "end"),
                                                                        ("backward", "peak"), ("backward", "end"),
                                                                        ("optimizer", "peak"))]
                     + ["%.1f" % (r["peak_bytes"] / MiB),
                        fmt(ratio(r["peak_bytes"], rec and rec["peak_bytes"]), "%.2fx"),
                        fmt(ratio(r["peak_bytes"], soc and soc["peak_bytes"]), "%.2fx"),
                        fmt(layers_above(r["peak_bytes"], bound), "%.2f"), eq])
    print(report.table(header, table, align="l" + "r" * (len(header) - 1)))
    print(f"lower bound (estimate) {bound['lower_bound_bytes'] / MiB:.1f} MiB = params+buffers "
          f"{bound['static_bytes'] / MiB:.1f} + grads {bound['grad_bytes'] / MiB:.1f} + one layer's saved activations "
          f"{bound['layer_saved_bytes'] / MiB:.1f} (largest of {len(bound['saved_bytes_per_layer'])} layers, unwrapped "
          f"forward)")
    for m in SWAP_MODES:
        if m in rows:
            print(f"{m}: peak / recompute = {fmt(ratio(rows[m]['peak_bytes'], rec and rec['peak_bytes']), '%.2fx')}, "
                  f"peak / save_on_cpu = {fmt(ratio(rows[m]['peak_bytes'], soc and soc['peak_bytes']), '%.2fx')}")
    for t in res["targets"]:
        print(f"target {'met' if t['ok'] else 'NOT MET':<7} {t['target']} {t['detail']}".rstrip())
    for mode, err in res["errors"].items():
        print(f"FAILED {mode}: {err}")


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if args.threads is None and device.type == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"swap_memory on {device}, torch {torch.__version__}, dtype {args.dtype}, {torch.get_num_threads()} "
          f"thread(s); modes {', '.join(modes)}; warmup {args.warmup}, 1 metered step per mode; load average "
          + ("-" if load is None else " ".join("%.2f" % v for v in load)), flush=True)
    doc: Dict[str, Any] = {"kind": "swap_memory", "environment": report.environment(device), "load_average": load,
                           "config": vars(args), "models": {}}
    failed = mismatch = False
    for name in [n.strip() for n in args.models.split(",") if n.strip()]:
        model, cfg, batch, bsz = _model(name, args, device, dtype)
        res = run_memory(model, modes, batch=batch, device=device, warmup=args.warmup, seed=args.seed)
        res["targets"] = _targets(res)
        res["config"] = {**cfg.to_dict(), "batch": bsz}
        _print_model(name, cfg, bsz, res)
        doc["models"][name] = res
        failed |= bool(res["errors"])
        base = res["results"].get("none")
        mismatch |= base is not None and any(r["loss"] != base["loss"] for r in res["results"].values())
    print("\nMiB; peak = highest during the phase, after = live at its end; LB = lower bound; "
          + ("CPU: live CPU storages (MemoryMeter), host copies of every offloading mode excluded"
             if device.type == "cpu" else "allocator counters"))
    if args.json:
        report.write_json(args.json, doc)
    return 1 if failed else (2 if mismatch else 0)


if __name__ == "__main__":
    sys.exit(main())
