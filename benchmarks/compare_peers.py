"""hyper-parallel against its peers: peak memory, step time, bytes moved and loss equality.

On the same GPT-like model and data, in one process with interleaved repetitions (one step of each
variant per round, the order reversed every other round) and medians:

- baseline ``none``: no checkpointing;
- peers: ``torch_ckpt`` (``torch.utils.checkpoint`` per layer), ``torch_sac`` (PyTorch selective
  checkpoint saving the matmuls), ``save_on_cpu`` (``torch.autograd.graph.save_on_cpu`` per layer,
  ``pin_memory=True`` on accelerators), ``torchtune_offload`` and ``torchtune_offload_ckpt``
  (torchtune's ``OffloadActivations``, alone and with per-layer checkpointing; CUDA only, needs the
  ``peers`` extra: skipped with the reason printed otherwise);
- ours: ``ours_recompute``, ``ours_save``, ``ours_swap_wrapper``, ``ours_ckpt_swap``
  (``checkpoint_wrapper`` with MUST_SWAP matmuls + ``swap_inputs``) and ``ours_recompute_swapin``.

Reported per variant: peak device memory of one training step, median forward+backward time,
bytes moved per step (device->host, host->device) and whether every step's loss equals ``none``
(bitwise on CPU). On an accelerator also the copy-engine figures: a raw pinned-copy bandwidth
probe, each offloading variant's achieved copy bandwidth and the share of its copy time hidden
under compute (from the profiler's device events), and the issue's targets, met or not. The
headline is each of our variants' ratios against the best peer.

``--sweep layers`` / ``--sweep seq`` instead measure peak memory and step time per variant as the
model deepens or the sequence grows (``--values``), and draw them.

Run::

    python benchmarks/compare_peers.py                                 # CPU defaults, ~1-2 min
    python benchmarks/compare_peers.py --sweep layers                  # 4 -> 32 layers
    python benchmarks/compare_peers.py --sweep seq
    python benchmarks/compare_peers.py --device cuda --dtype bfloat16 --dim 2048 --heads 16 \\
        --layers 16 --seq 2048 --batch 2 --json out.json --png out.png  # see benchmarks/gpu_suite.sh

Exit status: 0 when every variant that ran matched the baseline's losses; 1 when a variant
failed; 2 when some variant's losses differ from ``none``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402

from hyper_parallel.bench import report, runner  # noqa: E402
from hyper_parallel.bench.model import GPT, GPTConfig  # noqa: E402
from hyper_parallel.bench.modes import PEER_VARIANTS, RECIPES  # noqa: E402
from hyper_parallel.bench.report import MiB, fmt as _fmt, ratio as _ratio  # noqa: E402
from hyper_parallel.core.activation_checkpoint import SwapManager  # noqa: E402

SWEEP_DEFAULT_VARIANTS = ["none", "torch_ckpt", "save_on_cpu", "torchtune_offload", "ours_recompute",
                          "ours_save", "ours_swap_wrapper", "ours_ckpt_swap", "ours_recompute_swapin"]
SWEEP_DEFAULT_VALUES = {("layers", "cpu"): "4,8,16,32", ("layers", "acc"): "4,8,16,32",
                        ("seq", "cpu"): "64,128,256,512", ("seq", "acc"): "512,1024,2048,4096"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, npu, ... or 'auto' (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, default=None, help="default 8")
    p.add_argument("--dim", type=int, default=None, help="default 128 (64 for sweeps)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=None, help="default 256 (128 for sweeps)")
    p.add_argument("--batch", type=int, default=None, help="default 4 (2 for sweeps)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds (default 9; 3 per sweep point)")
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
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--png", default=None, metavar="PATH", help="write a chart (needs matplotlib)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write a Chrome trace of one step per variant to DIR/<variant>.json")
    p.add_argument("--trace-gz", action="store_true", help="gzip the traces (DIR/<variant>.json.gz)")
    p.add_argument("--probe", choices=["auto", "on", "off"], default="auto",
                   help="raw pinned copy bandwidth probe and copy-engine figures (auto: on accelerators)")
    p.add_argument("--probe-mib", type=int, default=1024, help="probe buffer size in MiB (default 1024)")
    p.add_argument("--loss-atol", type=float, default=None,
                   help="loss tolerance off CPU (default 1e-5 for float32, 2e-2 for 16-bit dtypes)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: 1 on CPU, which keeps medians stable on a shared "
                        "machine; untouched on accelerators)")
    return p


def _variants(args) -> List[str]:
    if args.variants is None:
        names = list(SWEEP_DEFAULT_VARIANTS) if args.sweep else list(PEER_VARIANTS)
    else:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        bad = [n for n in names if n not in RECIPES]
        if bad:
            raise SystemExit(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(RECIPES)}")
    return list(dict.fromkeys(["none"] + names))


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return acc if acc is not None else torch.device("cpu")
    dev = torch.device(name)
    if dev.type != "cpu" and not torch.accelerator.is_available():
        raise SystemExit(f"device {name!r} requested but this torch build ({torch.__version__}) sees no accelerator")
    return dev


def _cfg(args, **override) -> GPTConfig:
    kw = dict(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq,
              dropout=args.dropout)
    kw.update(override)
    return GPTConfig(**kw)


# --------------------------------------------------------------------------- analysis

def headline(results: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Each of our variants against the best peer (lowest peak; fastest) and its like-for-like
    counterparts; plus best-of-ours against best-of-peers."""
    ok = {n: r for n, r in results.items() if r["peak_bytes"] is not None and r["step_time_s"] is not None}
    peers = [n for n in ok if RECIPES[n].who == "peer"]
    ours = [n for n in ok if RECIPES[n].who == "ours"]
    out: Dict[str, Any] = {"per_variant": {}}
    if not peers:
        return out
    mem_peer = min(peers, key=lambda n: ok[n]["peak_bytes"])
    time_peer = min(peers, key=lambda n: ok[n]["step_time_s"])
    off_peers = [n for n in peers if RECIPES[n].offloads]
    out["best_memory_peer"] = mem_peer
    out["best_time_peer"] = time_peer
    for n in ours:
        row: Dict[str, Any] = {
            "peak_vs_best_memory_peer": _ratio(ok[n]["peak_bytes"], ok[mem_peer]["peak_bytes"]),
            "time_vs_best_time_peer": _ratio(ok[n]["step_time_s"], ok[time_peer]["step_time_s"]),
            "counterparts": {},
        }
        for c in RECIPES[n].counterparts:
            if c in ok:
                row["counterparts"][c] = {"peak_ratio": _ratio(ok[n]["peak_bytes"], ok[c]["peak_bytes"]),
                                          "time_ratio": _ratio(ok[n]["step_time_s"], ok[c]["step_time_s"])}
        out["per_variant"][n] = row
    if ours:
        best_mem_ours = min(ours, key=lambda n: ok[n]["peak_bytes"])
        out["lowest_peak"] = {"ours": best_mem_ours, "peer": mem_peer,
                              "ratio": _ratio(ok[best_mem_ours]["peak_bytes"], ok[mem_peer]["peak_bytes"]),
                              "time_ratio": _ratio(ok[best_mem_ours]["step_time_s"], ok[mem_peer]["step_time_s"])}
        if off_peers:
            ours_off = [n for n in ours if RECIPES[n].offloads]
            best_off_peer_t = min(off_peers, key=lambda n: ok[n]["step_time_s"])
            best_off_peer_m = min(off_peers, key=lambda n: ok[n]["peak_bytes"])
            if ours_off:
                fastest = min(ours_off, key=lambda n: ok[n]["step_time_s"])
                leanest = min(ours_off, key=lambda n: ok[n]["peak_bytes"])
                out["offloading"] = {
                    "fastest_ours": fastest, "fastest_peer": best_off_peer_t,
                    "time_ratio": _ratio(ok[fastest]["step_time_s"], ok[best_off_peer_t]["step_time_s"]),
                    "leanest_ours": leanest, "leanest_peer": best_off_peer_m,
                    "peak_ratio": _ratio(ok[leanest]["peak_bytes"], ok[best_off_peer_m]["peak_bytes"]),
                }
    return out


def targets(results: Dict[str, Dict[str, Any]], probe: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The issue's accelerator targets, each with ``ok`` (True / False / None = not applicable)."""
    out: List[Dict[str, Any]] = []
    ok = {n: r for n, r in results.items() if r["step_time_s"] is not None}

    def t(n):
        return ok[n]["step_time_s"] if n in ok else None

    probe_ok = "d2h_gbps" in probe
    for n in ("ours_ckpt_swap", "ours_swap_wrapper", "ours_recompute_swapin"):
        ce = (ok.get(n) or {}).get("copy_engine")
        if not (probe_ok and ce):
            continue
        for d in ("d2h", "h2d"):
            got = ce[d]["gbps"]
            frac = _ratio(got, probe[f"{d}_gbps"])
            out.append({"target": f"{n} achieved {d.upper()} bandwidth >= 80% of probe",
                        "value": frac, "ok": None if frac is None else frac >= 0.8,
                        "detail": f"{_fmt(got, '%.1f')} / {probe[f'{d}_gbps']:.1f} GB/s"})
    if "ours_ckpt_swap" in ok and "ours_save" in ok and probe_ok:
        moved = ok["ours_ckpt_swap"]["bytes_moved_per_step"]
        t_save = t("ours_save")
        need_d2h = moved["d2h"] / (probe["d2h_gbps"] * 1e9)
        need_h2d = moved["h2d"] / (probe["h2d_gbps"] * 1e9)
        fits = need_d2h <= t_save / 3 and need_h2d <= 2 * t_save / 3
        r = _ratio(t("ours_ckpt_swap"), t_save)
        out.append({"target": "ours_ckpt_swap step <= 1.05x ours_save (when transfers fit the compute window)",
                    "value": r, "ok": (r <= 1.05) if fits else None,
                    "detail": (f"transfers at probe speed: D2H {need_d2h * 1e3:.1f} ms vs forward ~{t_save / 3 * 1e3:.1f} ms, "
                               f"H2D {need_h2d * 1e3:.1f} ms vs backward ~{2 * t_save / 3 * 1e3:.1f} ms: "
                               + ("fit" if fits else "do not fit, target not applicable"))})
    if "save_on_cpu" in ok:
        for n in ("ours_swap_wrapper", "ours_ckpt_swap"):
            if n in ok:
                r = _ratio(t(n), t("save_on_cpu"))
                out.append({"target": f"{n} never slower than save_on_cpu", "value": r, "ok": r <= 1.0})
    for n, peer in (("ours_swap_wrapper", "torchtune_offload"), ("ours_ckpt_swap", "torchtune_offload"),
                    ("ours_recompute_swapin", "torchtune_offload_ckpt")):
        if n in ok and peer in ok:
            pr = _ratio(ok[n]["peak_bytes"], ok[peer]["peak_bytes"])
            tr = _ratio(t(n), t(peer))
            out.append({"target": f"{n} less peak than {peer} at equal or better step time",
                        "value": pr, "ok": pr < 1.0 and tr <= 1.0,
                        "detail": f"peak {pr:.2f}x, time {tr:.2f}x"})
    return out


# --------------------------------------------------------------------------- printing

def format_table(results: Dict[str, Dict[str, Any]], losses: Dict[str, Any], with_copy: bool) -> str:
    base = results.get("none") or {}
    header = ["variant", "who", "peak MiB", "vs none", "step ms", "vs none", "D2H MiB", "H2D MiB", "loss = none"]
    if with_copy:
        header += ["D2H GB/s", "H2D GB/s", "overlap"]
    rows = []
    for n, r in results.items():
        moved = r["bytes_moved_per_step"]
        eq = losses.get(n, {}).get("equal")
        row = [n, r["who"], _fmt(r["peak_bytes"] and r["peak_bytes"] / MiB),
               _fmt(_ratio(r["peak_bytes"], base.get("peak_bytes")), "%.2fx"),
               _fmt(r["step_time_s"] and r["step_time_s"] * 1e3),
               _fmt(_ratio(r["step_time_s"], base.get("step_time_s")), "%.2fx"),
               "%.1f" % (moved["d2h"] / MiB), "%.1f" % (moved["h2d"] / MiB),
               "baseline" if n == "none" else ("yes" if eq else ("NO" if eq is False else "-"))]
        if with_copy:
            ce = r.get("copy_engine") or {}
            row += [_fmt((ce.get("d2h") or {}).get("gbps")), _fmt((ce.get("h2d") or {}).get("gbps")),
                    _fmt((ce.get("total") or {}).get("overlap_fraction"), "%.2f")]
        rows.append(row)
    return report.table(header, rows, align="ll" + "r" * (len(header) - 2))


def format_headline(h: Dict[str, Any]) -> str:
    lines = []
    if "best_memory_peer" not in h:
        return "headline: no peer ran"
    lines.append(f"headline (ratio ours / peer; < 1 is better). best peer on memory: {h['best_memory_peer']}, "
                 f"on time: {h['best_time_peer']}")
    for n, row in h["per_variant"].items():
        parts = [f"peak {_fmt(row['peak_vs_best_memory_peer'], '%.2fx')} vs {h['best_memory_peer']}",
                 f"time {_fmt(row['time_vs_best_time_peer'], '%.2fx')} vs {h['best_time_peer']}"]
        for c, cr in row["counterparts"].items():
            parts.append(f"vs {c}: peak {_fmt(cr['peak_ratio'], '%.2fx')} time {_fmt(cr['time_ratio'], '%.2fx')}")
        lines.append(f"  {n:<22} " + "; ".join(parts))
    if "lowest_peak" in h:
        lp = h["lowest_peak"]
        lines.append(f"  lowest peak: {lp['ours']} at {_fmt(lp['ratio'], '%.2fx')} of {lp['peer']} "
                     f"(step time {_fmt(lp['time_ratio'], '%.2fx')})")
    if "offloading" in h:
        o = h["offloading"]
        lines.append(f"  offloading: fastest ours {o['fastest_ours']} at {_fmt(o['time_ratio'], '%.2fx')} the time of "
                     f"{o['fastest_peer']}; leanest ours {o['leanest_ours']} at {_fmt(o['peak_ratio'], '%.2fx')} "
                     f"the peak of {o['leanest_peer']}")
    return "\n".join(lines)


def format_stats(stats: Dict[str, Any]) -> str:
    return "SwapManager().stats(): " + report.swap_stats_line(stats)


def _write_json(path: str, doc: Dict[str, Any], quiet: bool = False) -> None:
    report.write_json(path, doc)
    if not quiet:
        print(f"json written to {path}")


# --------------------------------------------------------------------------- runs

def loss_check(results: Dict[str, Dict[str, Any]], exact: bool, atol: float) -> Dict[str, Any]:
    """Every variant's loss sequence against ``none``'s (bitwise when ``exact``)."""
    base = results.get("none")
    if base is None:
        return {n: {"equal": None, "max_abs_diff": None} for n in results}
    return {n: report.loss_check(r["losses"], base["losses"], exact, atol) for n, r in results.items()}


def _loss_atol(args) -> float:
    if args.loss_atol is not None:
        return args.loss_atol
    return 1e-5 if args.dtype == "float32" else 2e-2


def run_compare(args, device: torch.device, dtype: torch.dtype) -> int:
    names = _variants(args)
    rounds = 9 if args.rounds is None else args.rounds
    cfg = _cfg(args)
    env = report.environment(device)
    probe: Dict[str, Any] = {}
    use_probe = args.probe == "on" or (args.probe == "auto" and device.type != "cpu")
    if use_probe:
        try:
            probe = runner.probe_bandwidth(device, nbytes=args.probe_mib * MiB)
        except Exception as exc:
            probe = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"compare_peers on {device} ({env.get('device_name', platform_name())}), torch {torch.__version__}, "
          f"dtype {args.dtype}: layers={cfg.layers} dim={cfg.dim} heads={cfg.heads} seq={cfg.seq} "
          f"batch={args.batch} vocab={cfg.vocab} dropout={cfg.dropout}; warmup {args.warmup}, 1 metered step, "
          f"{rounds} timed rounds", flush=True)
    t0 = time.perf_counter()
    run = runner.run_variants(names, cfg, batch=args.batch, device=device, dtype=dtype, rounds=rounds,
                         warmup=args.warmup, lr=args.lr, seed=args.seed, trace_dir=args.trace,
                         profile_copies=use_probe and device.type != "cpu", trace_gz=args.trace_gz)
    results = {n: runner.summarize(v) for n, v in run.variants.items()}
    exact = device.type == "cpu"
    losses = loss_check(results, exact, _loss_atol(args))
    for n, r in results.items():
        r["loss_equal_to_none"] = losses[n]["equal"]
        r["loss_max_abs_diff"] = losses[n]["max_abs_diff"]
    head = headline(results)
    tg = targets(results, probe) if device.type != "cpu" else []
    stats = SwapManager().stats()
    elapsed = time.perf_counter() - t0

    print(format_table(results, losses, with_copy=device.type != "cpu"))
    print(report.legend([(n, RECIPES[n].what) for n in results]))
    print("loss comparison: " + ("bitwise (cpu)" if exact else f"|diff| <= {_loss_atol(args):g}"))
    for n, reason in run.skipped.items():
        print(f"skipped {n}: {reason}")
    for n, err in run.errors.items():
        print(f"FAILED {n}: {err}")
    print(format_headline(head))
    if probe:
        if "d2h_gbps" in probe:
            print(f"copy probe (pinned, {probe['bytes'] / MiB:.0f} MiB x {probe['reps']}): "
                  f"D2H {probe['d2h_gbps']:.1f} GB/s, H2D {probe['h2d_gbps']:.1f} GB/s")
        else:
            print(f"copy probe: {probe}")
    for t in tg:
        state = {True: "met", False: "NOT MET", None: "n/a"}[t["ok"]]
        print(f"target {state:<7} {t['target']}: {_fmt(t['value'], '%.2f')} {t.get('detail', '')}".rstrip())
    if device.type == "cpu":
        print("copy-engine figures and targets: accelerator only (CPU copies are synchronous memcpy)")
        print(report.CPU_TIMING_NOTE)
    print(format_stats(stats))
    if args.trace:
        print(f"chrome traces of one step per variant in {args.trace}")
    print(f"total {elapsed:.1f}s")

    doc = {"kind": "compare_peers", "environment": env, "dtype": args.dtype,
           "config": {**cfg.to_dict(), "batch": args.batch, "rounds": rounds, "warmup": args.warmup,
                      "lr": args.lr, "seed": args.seed, "optimizer": "SGD"},
           "memory_note": MEMORY_NOTE_CPU if device.type == "cpu" else MEMORY_NOTE_ACC,
           "results": results, "skipped": run.skipped, "errors": run.errors, "headline": head,
           "probe": probe, "targets": tg, "swap_manager_stats": stats, "total_time_s": elapsed}
    if args.json:
        _write_json(args.json, doc)
    if args.png:
        ok, why = report.have_matplotlib()
        if ok:
            report.bar_chart(args.png, results, f"{device} {args.dtype}: layers={cfg.layers} dim={cfg.dim} "
                                           f"seq={cfg.seq} batch={args.batch}",
                             time_label="median fwd+bwd step (ms)")
            print(f"chart written to {args.png}")
        else:
            print(why)
    if run.errors:
        return 1
    if any(v["equal"] is False for v in losses.values()):
        return 2
    return 0


def run_sweep(args, device: torch.device, dtype: torch.dtype) -> int:
    names = _variants(args)
    rounds = 3 if args.rounds is None else args.rounds
    kind = "cpu" if device.type == "cpu" else "acc"
    values = [int(x) for x in (args.values or SWEEP_DEFAULT_VALUES[(args.sweep, kind)]).split(",") if x.strip()]
    env = report.environment(device)
    print(f"compare_peers --sweep {args.sweep} {values} on {device}, torch {torch.__version__}, dtype {args.dtype}: "
          + ", ".join(f"{k}={getattr(args, k)}" for k in ("layers", "dim", "heads", "seq", "batch") if k != args.sweep)
          + "; "
          f"{rounds} timed rounds per point", flush=True)
    t0 = time.perf_counter()
    points: List[Dict[str, Any]] = []
    skipped: Dict[str, str] = {}
    errors: Dict[str, str] = {}
    exact = device.type == "cpu"
    # One model is built for the largest value (GPT's init is slow on CPU): the layer sweep copies
    # its first N blocks, the seq sweep feeds it shorter sequences (positions and mask are sliced).
    big = GPT(_cfg(args, **{args.sweep: max(values)}), seed=args.seed)
    for value in values:
        cfg = _cfg(args, **{args.sweep: value})
        base = runner.truncated_copy(big, value) if args.sweep == "layers" else copy.deepcopy(big)
        with runner.released_caches(device):
            run = runner.run_variants(names, cfg, batch=args.batch, device=device, dtype=dtype, rounds=rounds,
                                 warmup=args.warmup, lr=args.lr, seed=args.seed, base_model=base,
                                 log=lambda s: None)
            del base
            results = {n: runner.summarize(v) for n, v in run.variants.items()}
            point_stats = SwapManager().stats()
            del run.variants
        losses = loss_check(results, exact, _loss_atol(args))
        for n, r in results.items():
            r["loss_equal_to_none"] = losses[n]["equal"]
        skipped.update(run.skipped)
        errors.update({f"{n}@{value}": e for n, e in run.errors.items()})
        points.append({"value": value, "config": cfg.to_dict(), "results": results,
                       "swap_manager_stats": point_stats})
        print(f"  {args.sweep}={value}: done at {time.perf_counter() - t0:.1f}s", flush=True)
        if args.json and value != values[-1]:  # partial results survive a time limit
            _write_json(args.json, {"kind": f"sweep_{args.sweep}", "partial": True, "environment": env,
                                    "dtype": args.dtype, "axis": args.sweep, "values": values,
                                    "batch": args.batch, "rounds": rounds, "points": points,
                                    "skipped": skipped, "errors": errors}, quiet=True)
    elapsed = time.perf_counter() - t0

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
        rows = [[n] + [_fmt(r[key] * scale if r and r[key] is not None else None)
                       for r in (p["results"].get(n) for p in points)]
                + ([_fmt(growth.get(n), "%.2fx")] if peak else []) for n in present]
        header = ["variant"] + [str(v) for v in values] + (["growth"] if peak else [])
        print(report.table(header, rows, align="l" + "r" * (len(header) - 1)))
    bad = sorted({f"{n}@{p['value']}" for p in points for n, r in p["results"].items()
                  if r["loss_equal_to_none"] is False})
    if bad:
        print("losses differ from none: " + ", ".join(bad))
    for n, reason in skipped.items():
        print(f"skipped {n}: {reason}")
    for n, err in errors.items():
        print(f"FAILED {n}: {err}")
    print(f"growth = peak above params at {args.sweep}={values[-1]} / at {args.sweep}={values[0]} "
          f"({values[-1] / values[0]:.0f}x the {args.sweep})")
    if points:
        print(f"at {args.sweep}={points[-1]['value']}: " + format_stats(points[-1]["swap_manager_stats"]))
    print(f"total {elapsed:.1f}s")
    doc = {"kind": f"sweep_{args.sweep}", "environment": env, "dtype": args.dtype, "axis": args.sweep,
           "values": values, "batch": args.batch, "rounds": rounds, "points": points, "growth": growth,
           "memory_note": MEMORY_NOTE_CPU if device.type == "cpu" else MEMORY_NOTE_ACC,
           "skipped": skipped, "errors": errors, "total_time_s": elapsed}
    if args.json:
        _write_json(args.json, doc)
    if args.png:
        ok, why = report.have_matplotlib()
        if ok:
            report.sweep_chart(args.png, args.sweep, points,
                          f"{device} {args.dtype}, sweep {args.sweep}: " + ", ".join(
                              f"{k}={getattr(args, k)}" for k in ("layers", "dim", "heads", "seq", "batch")
                              if k != args.sweep))
            print(f"chart written to {args.png}")
        else:
            print(why)
    if errors:
        return 1
    return 2 if bad else 0


MEMORY_NOTE_CPU = ("CPU: live CPU storages counted by MemoryMeter; host copies of every offloading variant "
                   "(ours and save_on_cpu) are counted as host memory and reloads as new device tensors, so the "
                   "column models what a device would hold. Step times on CPU include synchronous memcpy and say "
                   "nothing about copy engines.")
MEMORY_NOTE_ACC = ("accelerator: allocator counters; peak allocated during one training step above what was "
                   "allocated before it, plus the variant's own parameters and buffers.")


def platform_name() -> str:
    import platform

    return platform.processor() or platform.machine()


def _fill_defaults(args) -> None:
    """The defaults are sized for 2 CPU cores: the comparison in about a minute, each sweep in
    about a minute and a half. Accelerator runs pass their sizes explicitly (gpu_suite.sh)."""
    small = args.sweep is not None
    for name, normal, sweep in (("layers", 8, 8), ("dim", 128, 64), ("seq", 256, 128), ("batch", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, sweep if small else normal)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _fill_defaults(args)
    if args.dim % args.heads:
        raise SystemExit(f"--dim ({args.dim}) must be divisible by --heads ({args.heads})")
    device = _resolve_device(args.device)
    if args.threads is None and device.type == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    SwapManager().reset()
    if args.sweep:
        return run_sweep(args, device, dtype)
    return run_compare(args, device, dtype)


if __name__ == "__main__":
    sys.exit(main())
