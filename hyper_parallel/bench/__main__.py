"""Mode comparison bench: ``python -m hyper_parallel.bench``.

Trains the bench GPT a few steps of the benchmark harness under each mode of ``hyper_parallel.bench.modes``, every mode
in a process of its own (its peak from a clean process), and prints one table: peak memory, bytes offloaded, step time,
and whether every loss equals the ``none`` baseline's (bitwise on CPU, within 1e-5 elsewhere). Every option is checked
before any mode runs: a bad one exits 2 with the reason. Exit status: 0; 1 a worker failed; 2 losses differ; 3 (with
``--strict``) an expected memory ordering (none > save > recompute, swap ~ recompute) does not hold. Examples::

    python -m hyper_parallel.bench                       # the 7 checkpoint_wrapper modes
    python -m hyper_parallel.bench --swap-wrapper        # none / swap / swap_with_policy
    python -m hyper_parallel.bench --budget 40MiB        # and a memory plan beside them
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from hyper_parallel.bench import report
from hyper_parallel.bench.modes import MODE_RECIPES, MODES, RECIPES, SWAP_WRAPPER_MODES, SWAP_WRAPPER_RECIPES
from hyper_parallel.bench.report import MiB
from hyper_parallel.bench.worker import PLAN_PREFIX, PLAN_RANGE, run_mode, swap_threshold

LOSS_ATOL = 1e-5  # off CPU; on CPU losses must be bitwise equal


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hyper_parallel.bench", description="Compare activation recompute / "
                                "swap modes: peak memory, step time, loss equality.")
    p.add_argument("--modes", default=None, help="comma-separated modes, default all (%s; with --swap-wrapper: %s); "
                   "'none' always runs first" % (",".join(MODES), ",".join(SWAP_WRAPPER_MODES)))
    p.add_argument("--swap-wrapper", action="store_true",
                   help="compare the swap_wrapper modes (%s) instead" % ",".join(SWAP_WRAPPER_MODES))
    for name, default, what in (("layers", 8, "transformer layers"), ("dim", 128, "model width"),
                                ("heads", 4, "attention heads"), ("seq", 256, "sequence length"),
                                ("batch", 4, "batch size"), ("vocab", 512, "vocabulary size"),
                                ("steps", 3, "training steps per mode")):
        p.add_argument(f"--{name}", type=int, default=default, help=f"{what} (default {default})")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout probability (default 0.1)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--seed", type=int, default=1234, help="seed of init, batches and dropout (default 1234)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, npu... (default cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--swap-threshold-bytes", type=int, default=None, help="size from which swap_with_policy swaps "
                   "a tensor (default: one batch x heads x seq x seq attention matrix in --dtype)")
    p.add_argument("--budget", default=None, help="also plan the model for this budget (bytes, or e.g. 40MiB) and "
                   "train the plan beside the modes (row plan@BUDGET, with its prediction and report)")
    p.add_argument("--budget-sweep", type=int, default=None, metavar="N", help="plan N budgets from the smallest "
                   "reachable peak to the unwrapped peak, train each plan, and draw step time against peak "
                   "(--plot, default budget_sweep.png; --json, default budget_sweep.json)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON to PATH")
    p.add_argument("--plot", metavar="PATH", default=None, help="save a bar chart to PATH (needs matplotlib)")
    p.add_argument("--trace", metavar="DIR", default=None, help="also write a Chrome trace of one more step per mode "
                   "to DIR/<mode>.json")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each worker")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per mode (default 1800)")
    p.add_argument("--strict", action="store_true", help="exit 3 when an expected memory ordering does not hold")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return p


def _config(args) -> Dict[str, Any]:
    keys = ("vocab", "dim", "heads", "layers", "seq", "dropout", "batch", "steps", "lr", "seed", "dtype", "threads")
    return {**{k: getattr(args, k) for k in keys}, "swap_wrapper": bool(args.swap_wrapper),
            "swap_threshold_bytes": swap_threshold(args), "optimizer": "SGD"}


def _mode_list(args, parser) -> List[str]:
    allowed = SWAP_WRAPPER_MODES if args.swap_wrapper else MODES
    modes = list(allowed) if args.modes is None else [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in allowed]
    if bad:
        parser.error("unknown mode(s) %s; choose from %s" % (", ".join(bad), ", ".join(allowed)))
    return list(dict.fromkeys(["none"] + modes))  # the baseline first, each mode once


def losses_match(losses: Sequence[float], baseline: Sequence[float], exact: bool) -> bool:
    """Bitwise when ``exact`` (CPU), else within ``LOSS_ATOL``."""
    return report.loss_check(losses, baseline, exact, LOSS_ATOL)["equal"]


def memory_checks(results: List[Dict[str, Any]], swap_wrapper: bool) -> List[Dict[str, Any]]:
    """The peak-memory orderings the RFC expects (none > save > recompute, swap ~ recompute)."""
    peak = {r["mode"]: r["peak_bytes"] for r in results if "error" not in r}
    pairs = ([("none", "swap_with_policy"), ("swap_with_policy", "swap")] if swap_wrapper else
             [("none", "save"), ("save", "recompute"), ("none", "recompute")])
    checks = [{"check": f"{a} > {b}", "ok": peak[a] > peak[b]} for a, b in pairs if a in peak and b in peak]
    if not swap_wrapper and {"swap", "recompute", "none"} <= set(peak):
        # "about equal": swap brings the peak down at least 2/3 as far as recompute does (around a
        # layer boundary in backward the swap schedule holds two layers' swapped tensors, the current
        # one and the prefetched predecessor, so it sits a little above recompute)
        saved_recompute, saved_swap = peak["none"] - peak["recompute"], peak["none"] - peak["swap"]
        ratio = saved_swap / saved_recompute if saved_recompute > 0 else 0.0
        checks.append({"check": "swap ~ recompute", "ok": saved_recompute > 0 and ratio >= 2.0 / 3.0, "ratio": ratio})
    return checks


def _label(mode: str) -> str:
    """A row's name: the mode, or ``plan@<budget in MiB>``."""
    return f"{PLAN_PREFIX}{int(mode[len(PLAN_PREFIX):]) / MiB:.1f}MiB" if mode.startswith(PLAN_PREFIX) else mode


def format_swap_stats(results: List[Dict[str, Any]], exact: bool) -> List[str]:
    """One line of ``SwapManager().stats()`` per mode that swapped anything (whole run), and what the figures mean."""
    swapped = [r for r in results if "error" not in r and (r["stats"].get("offloaded_bytes")
                                                           or r["stats"].get("kept_bytes"))]
    lines = [f"swap stats {_label(r['mode'])}: {report.swap_stats_line(r['stats'])}" for r in swapped]
    if lines:
        lines.append("swap stats are totals over all steps" + (
            "; on a CPU build every chained layer is offloaded, the last one too" if exact else ""))
    if any(r["stats"].get("loaded_bytes", 0) < r["stats"].get("offloaded_bytes", 0) for r in swapped):
        lines.append("loaded < offloaded: a swapped tensor is loaded when backward reads it, and a recomputed layer "
                     "stops recomputing once the tensors its backward still holds are back; which those are depends "
                     "on when Python's garbage collector frees leftover pieces of the forward, so some swapped outputs "
                     "are freed on the host unread (a margin that varies from run to run; equal with gc.disable())")
    return lines


def format_plans(results: List[Dict[str, Any]]) -> List[str]:
    """What each plan row predicted against what it measured, and (one plan) its report."""
    plans, lines = [r for r in results if r["mode"].startswith(PLAN_PREFIX) and "error" not in r], []
    for r in plans:
        lines.append(f"{_label(r['mode'])}: budget {r['budget_bytes'] / MiB:.1f} MiB, measured peak "
                     f"{r['peak_bytes'] / MiB:.1f} MiB ({'OVER' if r['peak_bytes'] > r['budget_bytes'] else 'within'}; "
                     f"predicted {r['predicted_peak_bytes'] / MiB:.1f} MiB, "
                     f"{100 * (r['predicted_peak_bytes'] / r['peak_bytes'] - 1):+.1f}%), step "
                     f"{r['step_time_s'] * 1e3:.0f} ms (predicted {r['predicted_step_s'] * 1e3:.0f} ms, "
                     f"{100 * (r['predicted_step_s'] / r['step_time_s'] - 1):+.1f}%; lower bound "
                     f"{r['lower_bound_step_s'] * 1e3:.0f} ms); planned in {r['planning_s']:.1f} s")
        if len(plans) == 1:
            lines.append(r["report"])
    return lines


def format_table(results: List[Dict[str, Any]]) -> str:
    base = next((r for r in results if r["mode"] == "none" and "error" not in r), None)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([_label(r["mode"]), "-", "-", "-", "-", "FAILED: " + r["error"], "-"])
            continue
        losses, steps = ["%.5f" % v for v in r["losses"]], max(1, len(r["losses"]))
        rows.append([_label(r["mode"]), "%.1f" % (r["peak_bytes"] / MiB),
                     report.fmt(report.ratio(r["peak_bytes"], base and base["peak_bytes"]), "%.2fx"),
                     "%.1f" % (r["offloaded_bytes"] / MiB / steps), "%.0f" % (r["step_time_s"] * 1e3),
                     " ".join(losses if len(losses) <= 5 else losses[:2] + ["..."] + losses[-2:]),
                     "baseline" if r["mode"] == "none" else {True: "yes", False: "NO"}.get(r["matches_baseline"], "-")])
    return report.table(["mode", "peak MiB", "vs none", "offloaded MiB/step", "step ms", "losses", "matches none"],
                        rows, align="lrrrrll")


def mode_legend(results: List[Dict[str, Any]], swap_wrapper: bool) -> str:
    """What each mode of the table wraps and how (from the recipes of ``bench.modes``)."""
    suite = SWAP_WRAPPER_RECIPES if swap_wrapper else MODE_RECIPES
    return report.legend([(r["mode"], RECIPES[suite[r["mode"]]].what) for r in results])


def reading(results: List[Dict[str, Any]], exact: bool) -> str:
    """The table in one line: the mode with the lowest peak (off CPU: at what time cost) and whether the losses match.
    """
    ok = [r for r in results if "error" not in r]
    base = next((r for r in ok if r["mode"] == "none"), None)
    if base is None:
        return "reading: no baseline, nothing to compare"
    low = min(ok, key=lambda r: r["peak_bytes"])
    peak = "%.1f MiB, %s of none" % (low["peak_bytes"] / MiB, report.fmt(report.ratio(low["peak_bytes"],
                                                                                     base["peak_bytes"]), "%.2fx"))
    # CPU step times are not a measurement of the modes (see CPU_TIMING_NOTE): not in the reading
    cost = "" if exact else " at %s none's step time" % report.fmt(
        report.ratio(low["step_time_s"], base["step_time_s"]), "%.2fx")
    differ = [_label(r["mode"]) for r in results if r.get("matches_baseline") is False]
    losses = (f"losses differ from none for {', '.join(differ)}" if differ else
              "every mode's losses equal none's" + (" bitwise" if exact else f" within {LOSS_ATOL:g}"))
    return f"reading: {_label(low['mode'])} has the lowest peak ({peak}){cost}; {losses}."


def _chart_rows(results: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    rows = {}
    for r in results:
        if "error" not in r:
            steps = max(1, len(r["losses"]))
            rows[r["mode"]] = {"who": "baseline" if r["mode"] == "none" else "ours", "peak_bytes": r["peak_bytes"],
                               "fwd_bwd_peak_bytes": r["peak_bytes"], "step_time_s": r["step_time_s"],
                               "budget_bytes": r.get("budget_bytes"),
                               "bytes_moved_per_step": {"d2h": r["offloaded_bytes"] / steps,
                                                        "h2d": r["stats"].get("loaded_bytes", 0) / steps}}
    return rows


def _plan_modes(args) -> List[str]:
    """The ``plan@BYTES`` rows asked for: ``--budget``, and ``--budget-sweep N`` (from a first worker's range of budgets
    worth planning)."""
    from hyper_parallel.planner import parse_budget

    modes = [f"{PLAN_PREFIX}{parse_budget(args.budget)}"] if args.budget is not None else []
    if args.budget_sweep:
        span = run_mode(args, PLAN_RANGE)
        if "error" in span:
            raise RuntimeError(f"planning the budget range failed: {span['error']}\n{span.get('stderr', '')}")
        low, high, n = span["min_budget_bytes"], span["reference_peak_bytes"], args.budget_sweep
        modes += [f"{PLAN_PREFIX}{int(low + (high - low) * k / max(1, n - 1))}" for k in range(n)]
    return modes


def run_comparison(args, parser) -> int:
    modes = _mode_list(args, parser) + _plan_modes(args)
    config, exact = _config(args), args.device.split(":")[0] == "cpu"
    t_start = time.perf_counter()
    results: List[Dict[str, Any]] = []
    for i, mode in enumerate(modes):
        results.append(run_mode(args, mode))
        if not args.no_progress:
            r = results[-1]
            print(f"[{i + 1}/{len(modes)}] {mode}: {'FAILED (%s)' % r['error'] if 'error' in r else 'done'} in "
                  f"{r['wall_s']:.1f}s", file=sys.stderr)
    total = time.perf_counter() - t_start

    base = results[0] if results[0]["mode"] == "none" and "error" not in results[0] else None
    for r in results:
        r["matches_baseline"] = (False if "error" in r else None if base is None else
                                 losses_match(r["losses"], base["losses"], exact))
    checks = memory_checks(results, args.swap_wrapper)
    kind = "swap_wrapper" if args.swap_wrapper else "checkpoint_wrapper"
    cfg_line = ("layers=%(layers)d dim=%(dim)d heads=%(heads)d seq=%(seq)d batch=%(batch)d "
                "vocab=%(vocab)d steps=%(steps)d dtype=%(dtype)s" % config)
    print(f"hyper-parallel bench ({kind} modes) on {args.device}: {cfg_line}")
    if args.swap_wrapper:
        print(f"swap_with_policy threshold: {config['swap_threshold_bytes']} bytes")
    print(format_table(results))
    print(mode_legend([r for r in results if not r["mode"].startswith(PLAN_PREFIX)], args.swap_wrapper))
    for line in format_plans(results) + [reading(results, exact)] + format_swap_stats(results, exact):
        print(line)
    print("loss comparison: %s" % ("bitwise (cpu)" if exact else f"|diff| <= {LOSS_ATOL:g}"))
    for c in checks:
        extra = " (swap saves %.0f%% of what recompute saves)" % (100 * c["ratio"]) if "ratio" in c else ""
        print("memory check %-22s %s%s" % (c["check"], "ok" if c["ok"] else "NOT MET", extra))
    if exact:
        print(report.CPU_TIMING_NOTE)
    print("total %.1fs" % total)

    failed = [r for r in results if "error" in r]
    for r in failed:
        print(f"\n===== worker {r['mode']!r} failed: {r['error']} =====", file=sys.stderr)
        print("\n".join(r.get("stderr", "").strip().splitlines()[-80:]), file=sys.stderr)
        out_tail = r.get("stdout", "").strip().splitlines()[-20:]
        if out_tail:
            print("--- stdout ---\n" + "\n".join(out_tail), file=sys.stderr)

    import torch

    doc = {"device": args.device, "kind": kind, "torch": torch.__version__, "config": config,
           "results": [{k: v for k, v in r.items() if k != "stdout"} for r in results], "checks": checks,
           "total_time_s": total}
    if args.json or args.budget_sweep:
        report.write_json(args.json or "budget_sweep.json", doc)
    title = f"{args.device}: {cfg_line}"
    if args.budget_sweep:
        png = args.plot or "budget_sweep.png"
        if report.have_matplotlib()[0]:
            report.pareto_chart(png, [{"model": f"bench GPT on {title}", "rows": _chart_rows(results)}])
        print(f"budget sweep written to {args.json or 'budget_sweep.json'}"
              + (f" and {png}" if report.have_matplotlib()[0] else " (no PNG: matplotlib is not installed)"))
    elif args.plot:
        report.bar_chart(args.plot, _chart_rows(results), f"{kind} modes, {title}")
        print(f"plot written to {args.plot}")

    if failed:
        return 1
    if any(r["matches_baseline"] is False for r in results):
        bad = ", ".join(r["mode"] for r in results if r["matches_baseline"] is False)
        print(f"losses differ from the baseline for: {bad}", file=sys.stderr)
        return 2
    return 3 if args.strict and any(not c["ok"] for c in checks) else 0


def check_options(args, parser: argparse.ArgumentParser) -> None:
    """Every option, before any mode runs (a mistake found after minutes of training costs those minutes): the sizes (as
    ``GPTConfig`` checks them), the modes, the budgets, the device, matplotlib for ``--plot`` and the folders the
    outputs go to. Exits through ``parser.error`` (status 2)."""
    from hyper_parallel.bench.model import GPTConfig
    from hyper_parallel.planner import parse_budget

    if args.steps < 1 or args.batch < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--steps, --batch and --threads must be >= 1")
    if args.timeout <= 0 or (args.swap_threshold_bytes is not None and args.swap_threshold_bytes < 0):
        parser.error("--timeout must be > 0 and --swap-threshold-bytes >= 0")
    try:
        GPTConfig(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq,
                  dropout=args.dropout)
    except ValueError as exc:
        parser.error(str(exc))
    if args.budget is not None:
        try:
            parse_budget(args.budget)
        except (TypeError, ValueError) as exc:
            parser.error(f"--budget: {exc}")
    _mode_list(args, parser)
    if args.budget_sweep is not None and args.budget_sweep < 2:
        parser.error("--budget-sweep needs at least 2 budgets")
    if (args.budget is not None or args.budget_sweep) and args.swap_wrapper:
        parser.error("--budget and --budget-sweep plan the checkpoint_wrapper comparison; leave --swap-wrapper out")
    why = report.device_problem(args.device)
    if why:
        parser.error(why + "; run with --device cpu")
    if args.plot and not report.have_matplotlib()[0]:
        parser.error("--plot needs matplotlib, which is not installed: pip install -e '.[bench]' (or pip install "
                     "matplotlib), or leave --plot out")
    for flag, path, folder in (("--json", args.json, os.path.dirname), ("--plot", args.plot, os.path.dirname),
                               ("--trace", args.trace, str)):
        target = os.path.abspath(folder(path) or ".") if path is not None else None
        while target is not None and not os.path.exists(target):
            target = os.path.dirname(target)
        if target is not None and not (os.path.isdir(target) and os.access(target, os.W_OK)):
            parser.error(f"{flag}: cannot write to {os.path.abspath(folder(path) or '.')}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_options(args, parser)
    return run_comparison(args, parser)


if __name__ == "__main__":
    sys.exit(main())
