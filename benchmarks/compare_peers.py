"""hyper-parallel against its peers: peak memory, step time, bytes moved and loss equality.

The rows (default ``PEER_VARIANTS``: ``none``; PyTorch's ``torch_ckpt``, ``torch_sac``, ``save_on_cpu``; torchtune's
``OffloadActivations`` alone and with checkpoint, CUDA only, the ``peers`` extra; ours) side by side on the benchmark
harness, on the bench GPT; the headline is each of ours against the best peer and its counterparts. On an accelerator
also a pinned-copy bandwidth probe, achieved bandwidth and overlap from device events, and the targets. ``--sweep
layers`` / ``--sweep seq``: peak and time per row as the model deepens or the sequence grows. Exit status: 0, 1 when a
variant failed, 2 when losses differ from ``none``.

Run::

    python benchmarks/compare_peers.py                                 # CPU defaults, ~1-2 min
    python benchmarks/compare_peers.py --sweep layers                  # 4 -> 32 layers
    python benchmarks/compare_peers.py --device cuda --dtype bfloat16 --dim 2048 --heads 16 --layers 16 --seq 2048
"""

from __future__ import annotations

import copy
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402

from hyper_parallel.bench import harness, report  # noqa: E402
from hyper_parallel.bench.model import GPT, GPTConfig  # noqa: E402
from hyper_parallel.bench.modes import PEER_VARIANTS, RECIPES  # noqa: E402
from hyper_parallel.bench.report import MiB, fmt, ratio  # noqa: E402
from hyper_parallel.core.activation_checkpoint import SwapManager  # noqa: E402

SWEEP_DEFAULT_VARIANTS = ["none", "torch_ckpt", "save_on_cpu", "torchtune_offload", "ours_recompute",
                          "ours_save", "ours_swap_wrapper", "ours_ckpt_swap", "ours_recompute_swapin"]
SWEEP_DEFAULT_VALUES = {("layers", "cpu"): "4,8,16,32", ("layers", "acc"): "4,8,16,32",
                        ("seq", "cpu"): "64,128,256,512", ("seq", "acc"): "512,1024,2048,4096"}
MEMORY_NOTE = {"cpu": "CPU: live CPU storages (MemoryMeter), host copies of every offloading variant excluded, reloads "
                      "new device tensors: what a device would hold. CPU step times include synchronous memcpys.",
               "acc": "accelerator: the allocator's peak in one training step above what was allocated before it, "
                      "plus the variant's own parameters and buffers."}


def build_parser():
    p = report.script_parser(__doc__)
    for name, default, what in (("layers", None, "default 8"), ("dim", None, "default 128 (64 for sweeps)"),
                                ("heads", 4, "default 4"), ("seq", None, "default 256 (128 for sweeps)"),
                                ("batch", None, "default 4 (2 for sweeps)"), ("vocab", 512, "default 512")):
        p.add_argument(f"--{name}", type=int, default=default, help=what)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 9; 3 per sweep point)")
    p.add_argument("--warmup", type=int, default=1, help="unmetered warm-up steps per variant (default 1)")
    p.add_argument("--variants", default=None,
                   help="comma-separated variants (default: %s; any recipe of hyper_parallel.bench.modes: "
                        "%s; 'none' always runs)" % (",".join(PEER_VARIANTS), ",".join(
                            n for n in RECIPES if n not in PEER_VARIANTS)))
    p.add_argument("--sweep", choices=["layers", "seq"], default=None,
                   help="scaling curves instead of the single comparison")
    p.add_argument("--values", default=None,
                   help="sweep values, comma-separated (default layers 4,8,16,32; seq 64..512 on CPU, "
                        "512..4096 on accelerators)")
    p.add_argument("--png", default=None, metavar="PATH", help="write a chart (needs matplotlib)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write a Chrome trace of one step per variant to DIR/<variant>.json")
    p.add_argument("--trace-gz", action="store_true", help="gzip the traces (DIR/<variant>.json.gz)")
    p.add_argument("--probe", choices=["auto", "on", "off"], default="auto",
                   help="raw pinned copy bandwidth probe and copy-engine figures (auto: on accelerators)")
    p.add_argument("--probe-mib", type=int, default=1024, help="probe buffer size in MiB (default 1024)")
    p.add_argument("--loss-atol", type=float, default=None,
                   help="loss tolerance off CPU (default 1e-5 for float32, 2e-2 for 16-bit dtypes)")
    return p


def _cfg(args, **override) -> GPTConfig:
    return GPTConfig(**{"vocab": args.vocab, "dim": args.dim, "heads": args.heads, "layers": args.layers,
                        "seq": args.seq, "dropout": args.dropout, **override})


def _sizes(args, skip: str = "") -> str:
    return ", ".join(f"{k}={getattr(args, k)}" for k in ("layers", "dim", "heads", "seq", "batch") if k != skip)


def headline(results: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Each of our variants against the best peer (lowest peak; fastest) and its like-for-like counterparts; plus
    best-of-ours against best-of-peers."""
    ok = {n: r for n, r in results.items() if r["peak_bytes"] is not None and r["step_time_s"] is not None}
    peers = [n for n in ok if RECIPES[n].who == "peer"]
    ours = [n for n in ok if RECIPES[n].who == "ours"]
    out: Dict[str, Any] = {"per_variant": {}}
    if not peers:
        return out

    def best(names: List[str], key: str) -> str:
        return min(names, key=lambda n: ok[n][key])

    def vs(a: str, b: str, key: str) -> Optional[float]:
        return ratio(ok[a][key], ok[b][key])

    mem_peer, time_peer = best(peers, "peak_bytes"), best(peers, "step_time_s")
    out.update(best_memory_peer=mem_peer, best_time_peer=time_peer)
    for n in ours:
        out["per_variant"][n] = {
            "peak_vs_best_memory_peer": vs(n, mem_peer, "peak_bytes"),
            "time_vs_best_time_peer": vs(n, time_peer, "step_time_s"),
            "counterparts": {c: {"peak_ratio": vs(n, c, "peak_bytes"), "time_ratio": vs(n, c, "step_time_s")}
                             for c in RECIPES[n].counterparts if c in ok}}
    if ours:
        low = best(ours, "peak_bytes")
        out["lowest_peak"] = {"ours": low, "peer": mem_peer, "ratio": vs(low, mem_peer, "peak_bytes"),
                              "time_ratio": vs(low, mem_peer, "step_time_s")}
        off_peers = [n for n in peers if RECIPES[n].offloads]
        off_ours = [n for n in ours if RECIPES[n].offloads]
        if off_peers and off_ours:
            fastest, fastest_peer = best(off_ours, "step_time_s"), best(off_peers, "step_time_s")
            leanest, leanest_peer = best(off_ours, "peak_bytes"), best(off_peers, "peak_bytes")
            out["offloading"] = {"fastest_ours": fastest, "fastest_peer": fastest_peer,
                                 "time_ratio": vs(fastest, fastest_peer, "step_time_s"),
                                 "leanest_ours": leanest, "leanest_peer": leanest_peer,
                                 "peak_ratio": vs(leanest, leanest_peer, "peak_bytes")}
    return out


def targets(results: Dict[str, Dict[str, Any]], probe: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The accelerator targets, each with ``ok`` (True / False / None = not applicable)."""
    out: List[Dict[str, Any]] = []
    ok = {n: r for n, r in results.items() if r["step_time_s"] is not None}
    t = {n: r["step_time_s"] for n, r in ok.items()}
    if "d2h_gbps" in probe:
        for n in ("ours_ckpt_swap", "ours_swap_wrapper", "ours_recompute_swapin"):
            for d in ("d2h", "h2d") if (ok.get(n) or {}).get("copy_engine") else ():
                got = ok[n]["copy_engine"][d]["gbps"]
                frac = ratio(got, probe[f"{d}_gbps"])
                out.append({"target": f"{n} achieved {d.upper()} bandwidth >= 80% of probe", "value": frac,
                            "ok": None if frac is None else frac >= 0.8,
                            "detail": f"{fmt(got)} / {probe[f'{d}_gbps']:.1f} GB/s"})
        if "ours_ckpt_swap" in ok and "ours_save" in ok:
            moved, t_save = ok["ours_ckpt_swap"]["bytes_moved_per_step"], t["ours_save"]
            need_d2h, need_h2d = moved["d2h"] / (probe["d2h_gbps"] * 1e9), moved["h2d"] / (probe["h2d_gbps"] * 1e9)
            fits = need_d2h <= t_save / 3 and need_h2d <= 2 * t_save / 3
            r = ratio(t["ours_ckpt_swap"], t_save)
            out.append({"target": "ours_ckpt_swap step <= 1.05x ours_save (when transfers fit the compute window)",
                        "value": r, "ok": (r <= 1.05) if fits else None,
                        "detail": f"transfers at probe speed: D2H {need_d2h * 1e3:.1f} ms vs forward "
                                  f"~{t_save / 3 * 1e3:.1f} ms, H2D {need_h2d * 1e3:.1f} ms vs backward "
                                  f"~{2 * t_save / 3 * 1e3:.1f} ms: "
                                  + ("fit" if fits else "do not fit, target not applicable")})
    for n in ("ours_swap_wrapper", "ours_ckpt_swap") if "save_on_cpu" in ok else ():
        if n in ok:
            r = ratio(t[n], t["save_on_cpu"])
            out.append({"target": f"{n} never slower than save_on_cpu", "value": r, "ok": r <= 1.0})
    for n, peer in (("ours_swap_wrapper", "torchtune_offload"), ("ours_ckpt_swap", "torchtune_offload"),
                    ("ours_recompute_swapin", "torchtune_offload_ckpt")):
        if n in ok and peer in ok:
            pr, tr = ratio(ok[n]["peak_bytes"], ok[peer]["peak_bytes"]), ratio(t[n], t[peer])
            out.append({"target": f"{n} less peak than {peer} at equal or better step time", "value": pr,
                        "ok": pr < 1.0 and tr <= 1.0, "detail": f"peak {pr:.2f}x, time {tr:.2f}x"})
    return out


def format_table(results: Dict[str, Dict[str, Any]], with_copy: bool) -> str:
    base = results.get("none") or {}
    header = ["variant", "who", "peak MiB", "vs none", "step ms", "vs none", "D2H MiB", "H2D MiB", "loss = none"]
    header += ["D2H GB/s", "H2D GB/s", "overlap"] if with_copy else []
    rows = []
    for n, r in results.items():
        moved, eq = r["bytes_moved_per_step"], r["loss_equal_to_none"]
        row = [n, r["who"], fmt(r["peak_bytes"] and r["peak_bytes"] / MiB),
               fmt(ratio(r["peak_bytes"], base.get("peak_bytes")), "%.2fx"),
               fmt(r["step_time_s"] and r["step_time_s"] * 1e3),
               fmt(ratio(r["step_time_s"], base.get("step_time_s")), "%.2fx"),
               "%.1f" % (moved["d2h"] / MiB), "%.1f" % (moved["h2d"] / MiB),
               "baseline" if n == "none" else {True: "yes", False: "NO", None: "-"}[eq]]
        if with_copy:
            ce = r.get("copy_engine") or {}
            row += [fmt((ce.get("d2h") or {}).get("gbps")), fmt((ce.get("h2d") or {}).get("gbps")),
                    fmt((ce.get("total") or {}).get("overlap_fraction"), "%.2f")]
        rows.append(row)
    return report.table(header, rows, align="ll" + "r" * (len(header) - 2))


def format_headline(h: Dict[str, Any]) -> str:
    if "best_memory_peer" not in h:
        return "headline: no peer ran"
    lines = [f"headline (ratio ours / peer; < 1 is better). best peer on memory: {h['best_memory_peer']}, "
             f"on time: {h['best_time_peer']}"]
    for n, row in h["per_variant"].items():
        parts = [f"peak {fmt(row['peak_vs_best_memory_peer'], '%.2fx')} vs {h['best_memory_peer']}",
                 f"time {fmt(row['time_vs_best_time_peer'], '%.2fx')} vs {h['best_time_peer']}"]
        parts += [f"vs {c}: peak {fmt(cr['peak_ratio'], '%.2fx')} time {fmt(cr['time_ratio'], '%.2fx')}"
                  for c, cr in row["counterparts"].items()]
        lines.append(f"  {n:<22} " + "; ".join(parts))
    if "lowest_peak" in h:
        lp = h["lowest_peak"]
        lines.append(f"  lowest peak: {lp['ours']} at {fmt(lp['ratio'], '%.2fx')} of {lp['peer']} "
                     f"(step time {fmt(lp['time_ratio'], '%.2fx')})")
    if "offloading" in h:
        o = h["offloading"]
        lines.append(f"  offloading: fastest ours {o['fastest_ours']} at {fmt(o['time_ratio'], '%.2fx')} the time of "
                     f"{o['fastest_peer']}; leanest ours {o['leanest_ours']} at {fmt(o['peak_ratio'], '%.2fx')} "
                     f"the peak of {o['leanest_peer']}")
    return "\n".join(lines)


def _outputs(args, doc: Dict[str, Any], chart) -> None:
    """The JSON and the chart (``chart(path)``), where asked for."""
    if args.json:
        report.write_json(args.json, doc)
        print(f"json written to {args.json}")
    if args.png:
        ok, why = report.have_matplotlib()
        if ok:
            chart(args.png)
        print(f"chart written to {args.png}" if ok else why)


def run_compare(args, device: torch.device, dtype: torch.dtype, names: List[str]) -> int:
    rounds = 9 if args.rounds is None else args.rounds
    cfg, env, acc = _cfg(args), report.environment(device), device.type != "cpu"
    probe: Dict[str, Any] = {}
    use_probe = args.probe == "on" or (args.probe == "auto" and acc)
    try:
        probe = harness.probe_bandwidth(device, nbytes=args.probe_mib * MiB) if use_probe else {}
    except Exception as exc:  # (the figures it enables are optional)
        probe = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"compare_peers on {device} ({env.get('device_name', platform.machine())}), torch {torch.__version__}, "
          f"dtype {args.dtype}: layers={cfg.layers} dim={cfg.dim} heads={cfg.heads} seq={cfg.seq} "
          f"batch={args.batch} vocab={cfg.vocab} dropout={cfg.dropout}; warmup {args.warmup}, 1 metered step, "
          f"{rounds} timed rounds", flush=True)
    t0 = time.perf_counter()
    run = harness.run_variants(names, cfg, batch=args.batch, device=device, dtype=dtype, rounds=rounds,
                               warmup=args.warmup, lr=args.lr, seed=args.seed, trace_dir=args.trace,
                               profile_copies=use_probe and acc, trace_gz=args.trace_gz)
    results = {n: harness.summarize(v) for n, v in run.variants.items()}
    atol = args.loss_atol if args.loss_atol is not None else 1e-5 if args.dtype == "float32" else 2e-2
    losses = report.compare_losses(results, not acc, atol)
    head, tg, stats = headline(results), targets(results, probe) if acc else [], SwapManager().stats()
    elapsed = time.perf_counter() - t0

    print(format_table(results, with_copy=acc))
    print(report.legend([(n, RECIPES[n].what) for n in results]))
    print("loss comparison: " + (f"|diff| <= {atol:g}" if acc else "bitwise (cpu)"))
    report.print_problems(run.skipped, run.errors)
    print(format_headline(head))
    if probe:
        print(f"copy probe (pinned, {probe['bytes'] / MiB:.0f} MiB x {probe['reps']}): D2H {probe['d2h_gbps']:.1f} "
              f"GB/s, H2D {probe['h2d_gbps']:.1f} GB/s" if "d2h_gbps" in probe else f"copy probe: {probe}")
    for t in tg:
        state = {True: "met", False: "NOT MET", None: "n/a"}[t["ok"]]
        print(f"target {state:<7} {t['target']}: {fmt(t['value'], '%.2f')} {t.get('detail', '')}".rstrip())
    if not acc:
        print("copy-engine figures and targets: accelerator only; " + report.CPU_TIMING_NOTE)
    print("SwapManager().stats(): " + report.swap_stats_line(stats))
    if args.trace:
        print(f"chrome traces of one step per variant in {args.trace}")
    print(f"total {elapsed:.1f}s")
    doc = {"kind": "compare_peers", "environment": env, "dtype": args.dtype,
           "config": {**cfg.to_dict(), "batch": args.batch, "rounds": rounds, "warmup": args.warmup,
                      "lr": args.lr, "seed": args.seed, "optimizer": "SGD"},
           "memory_note": MEMORY_NOTE["acc" if acc else "cpu"], "results": results, "skipped": run.skipped,
           "errors": run.errors, "headline": head, "probe": probe, "targets": tg, "swap_manager_stats": stats,
           "total_time_s": elapsed}
    _outputs(args, doc, lambda png: report.bar_chart(
        png, results, f"{device} {args.dtype}: {_sizes(args)}", time_label="median fwd+bwd step (ms)"))
    return 1 if run.errors else 2 if any(v["equal"] is False for v in losses.values()) else 0


def run_sweep(args, device: torch.device, dtype: torch.dtype, names: List[str]) -> int:
    rounds = 3 if args.rounds is None else args.rounds
    acc = device.type != "cpu"
    values = [int(x) for x in (args.values or SWEEP_DEFAULT_VALUES[(args.sweep, "acc" if acc else "cpu")]).split(",")
              if x.strip()]
    print(f"compare_peers --sweep {args.sweep} {values} on {device}, torch {torch.__version__}, dtype {args.dtype}: "
          f"{_sizes(args, args.sweep)}; {rounds} timed rounds per point", flush=True)
    t0 = time.perf_counter()
    points: List[Dict[str, Any]] = []
    skipped: Dict[str, str] = {}
    errors: Dict[str, str] = {}
    doc: Dict[str, Any] = {"kind": f"sweep_{args.sweep}", "environment": report.environment(device), "axis": args.sweep,
                           "dtype": args.dtype, "values": values, "batch": args.batch, "rounds": rounds,
                           "points": points, "skipped": skipped, "errors": errors}
    # One model is built for the largest value (GPT's init is slow on CPU): the layer sweep copies
    # its first N blocks, the seq sweep feeds it shorter sequences (positions and mask are sliced).
    big = GPT(_cfg(args, **{args.sweep: max(values)}), seed=args.seed)
    for value in values:
        cfg = _cfg(args, **{args.sweep: value})
        base = harness.truncated_copy(big, value) if args.sweep == "layers" else copy.deepcopy(big)
        with harness.released_caches(device):
            run = harness.run_variants(names, cfg, batch=args.batch, device=device, dtype=dtype, rounds=rounds,
                                       warmup=args.warmup, lr=args.lr, seed=args.seed, base_model=base,
                                       log=lambda s: None)
            del base
            results = {n: harness.summarize(v) for n, v in run.variants.items()}
            point_stats = SwapManager().stats()
            del run.variants
        report.compare_losses(results, not acc, 1e-5 if args.dtype == "float32" else 2e-2)
        skipped.update(run.skipped)
        errors.update({f"{n}@{value}": e for n, e in run.errors.items()})
        points.append({"value": value, "config": cfg.to_dict(), "results": results, "swap_manager_stats": point_stats})
        print(f"  {args.sweep}={value}: done at {time.perf_counter() - t0:.1f}s", flush=True)
        if args.json and value != values[-1]:  # partial results survive a time limit
            report.write_json(args.json, {**doc, "partial": True})
    present = [n for n in names if any(n in p["results"] for p in points)]
    growth = {}
    for n in present:
        series = [p["results"][n]["peak_above_static_bytes"] for p in points if n in p["results"]]
        if len(series) >= 2 and series[0]:
            growth[n] = series[-1] / series[0]
    for title, key, scale in (("peak above params+buffers, MiB", "peak_above_static_bytes", 1 / MiB),
                              ("median fwd+bwd step, ms", "step_time_s", 1e3)):
        peak = key.startswith("peak")
        print(f"{title} ({args.sweep} = {', '.join(str(v) for v in values)})")
        rows = [[n] + [fmt(r[key] * scale if r and r[key] is not None else None)
                       for r in (p["results"].get(n) for p in points)]
                + ([fmt(growth.get(n), "%.2fx")] if peak else []) for n in present]
        header = ["variant"] + [str(v) for v in values] + (["growth"] if peak else [])
        print(report.table(header, rows, align="l" + "r" * (len(header) - 1)))
    bad = sorted({f"{n}@{p['value']}" for p in points for n, r in p["results"].items()
                  if r["loss_equal_to_none"] is False})
    if bad:
        print("losses differ from none: " + ", ".join(bad))
    report.print_problems(skipped, errors)
    print(f"growth = peak above params at {args.sweep}={values[-1]} / at {args.sweep}={values[0]} "
          f"({values[-1] / values[0]:.0f}x the {args.sweep})")
    if points:
        print(f"at {args.sweep}={points[-1]['value']}: SwapManager().stats(): "
              + report.swap_stats_line(points[-1]["swap_manager_stats"]))
    elapsed = time.perf_counter() - t0
    print(f"total {elapsed:.1f}s")
    doc.update(growth=growth, memory_note=MEMORY_NOTE["acc" if acc else "cpu"], total_time_s=elapsed)
    _outputs(args, doc, lambda png: report.sweep_chart(
        png, args.sweep, points, f"{device} {args.dtype}, sweep {args.sweep}: {_sizes(args, args.sweep)}"))
    return 1 if errors else 2 if bad else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The defaults are sized for 2 CPU cores: the comparison in about a minute, each sweep in about
    # a minute and a half. Accelerator runs pass their sizes explicitly (gpu_suite.sh).
    for name, normal, sweep in (("layers", 8, 8), ("dim", 128, 64), ("seq", 256, 128), ("batch", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, sweep if args.sweep else normal)
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be divisible by --heads ({args.heads})")
    names = report.variant_names(args.variants, SWEEP_DEFAULT_VARIANTS if args.sweep else PEER_VARIANTS, RECIPES,
                                 parser)
    device, dtype = report.script_setup(args, parser)
    SwapManager().reset()
    return (run_sweep if args.sweep else run_compare)(args, device, dtype, names)


if __name__ == "__main__":
    sys.exit(main())
