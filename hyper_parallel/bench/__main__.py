"""Mode comparison bench: ``python -m hyper_parallel.bench``.

Trains the small GPT of ``hyper_parallel.bench.model`` for a few steps under
each activation-memory mode (``hyper_parallel.bench.modes``), every mode in its
own subprocess so that peak memory is measured from a clean process, and
prints one table: peak device memory, bytes offloaded, step time, and whether
every step's loss equals the ``none`` baseline (bitwise on CPU, within 1e-5
elsewhere).

Examples::

    python -m hyper_parallel.bench                       # the 7 checkpoint_wrapper modes
    python -m hyper_parallel.bench --swap-wrapper        # none / swap / swap_with_policy
    python -m hyper_parallel.bench --modes none,swap --device cuda --json out.json --plot out.png

Every option is checked before any mode runs (the device, ``--plot``'s matplotlib, the sizes,
the output folders): a bad one exits 2 at once, with the reason. Exit status: 0 when every mode
ran and matched the baseline, 1 when a worker failed, 2 when a mode's losses differ from the baseline, 3 (only with
``--strict``) when an expected peak-memory ordering (none > save > recompute, swap ~ recompute) does not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from hyper_parallel.bench import report
from hyper_parallel.bench.modes import MODE_RECIPES, MODES, SWAP_WRAPPER_MODES, SWAP_WRAPPER_RECIPES, RECIPES
from hyper_parallel.bench.report import MiB
from hyper_parallel.bench.timing import median
_PROGRESS_TAG = "@@hyper_parallel.bench.progress"
_RESULT_TAG = "@@hyper_parallel.bench.result "
_DTYPES = ("float32", "bfloat16", "float16")
# Loss tolerance off CPU; on CPU losses must be bitwise equal.
LOSS_ATOL = 1e-5


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hyper_parallel.bench",
        description="Compare activation recompute / swap modes: peak memory, step time, loss equality.",
    )
    p.add_argument("--modes", default=None,
                   help="comma-separated modes, default all (%s; with --swap-wrapper: %s). "
                        "'none' always runs first as the baseline." % (",".join(MODES), ",".join(SWAP_WRAPPER_MODES)))
    p.add_argument("--swap-wrapper", action="store_true",
                   help="compare the swap_wrapper modes (%s) instead" % ",".join(SWAP_WRAPPER_MODES))
    p.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    p.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout probability (default 0.1)")
    p.add_argument("--steps", type=int, default=3, help="training steps per mode (default 3)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=1234, help="seed for init, batches and dropout (default 1234)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1, npu (default cpu)")
    p.add_argument("--dtype", choices=_DTYPES, default="float32", help="parameter/activation dtype (default float32)")
    p.add_argument("--swap-threshold-bytes", type=int, default=None,
                   help="size from which swap_with_policy swaps a tensor (default: the size of one "
                        "batch x heads x seq x seq attention matrix in --dtype)")
    p.add_argument("--budget", default=None,
                   help="also plan the model for this memory budget (plan_memory: bytes, or e.g. 40MiB, 1.5GB) and "
                        "train the plan beside the modes (row plan@BUDGET, with its prediction and report)")
    p.add_argument("--budget-sweep", type=int, default=None, metavar="N",
                   help="plan N budgets from the smallest reachable peak to the peak with nothing wrapped, train each "
                        "plan beside the modes, and write the measured step time against the measured peak as a PNG "
                        "(--plot, default budget_sweep.png) and a JSON (--json, default budget_sweep.json)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON to PATH")
    p.add_argument("--plot", metavar="PATH", default=None, help="save a bar chart to PATH (needs matplotlib)")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="also write a Chrome trace (torch.profiler) of one extra training step per mode "
                        "to DIR/<mode>.json")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for each worker (default: torch's own choice)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per mode (default 1800)")
    p.add_argument("--strict", action="store_true",
                   help="exit 3 when an expected memory ordering does not hold")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--worker", metavar="MODE", default=None, help=argparse.SUPPRESS)
    return p


def _config(args) -> Dict[str, Any]:
    return {
        "vocab": args.vocab, "dim": args.dim, "heads": args.heads, "layers": args.layers,
        "seq": args.seq, "dropout": args.dropout, "batch": args.batch, "steps": args.steps,
        "lr": args.lr, "seed": args.seed, "dtype": args.dtype,
        "swap_wrapper": bool(args.swap_wrapper),
        "swap_threshold_bytes": swap_threshold(args),
        "threads": args.threads,
    }


def attention_matrix_bytes(batch: int, heads: int, seq: int, dtype: str) -> int:
    """Bytes of one ``(batch, heads, seq, seq)`` attention score matrix."""
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return batch * heads * seq * seq * size


def swap_threshold(args) -> int:
    if args.swap_threshold_bytes is not None:
        return int(args.swap_threshold_bytes)
    return attention_matrix_bytes(args.batch, args.heads, args.seq, args.dtype)


def _mode_list(args, parser) -> List[str]:
    allowed = SWAP_WRAPPER_MODES if args.swap_wrapper else MODES
    if args.modes is None:
        modes = list(allowed)
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in allowed]
        if bad:
            parser.error("unknown mode(s) %s; choose from %s" % (", ".join(bad), ", ".join(allowed)))
    # The baseline first, each mode once.
    ordered = ["none"] + [m for m in modes if m != "none"]
    return list(dict.fromkeys(ordered))


# ------------------------------------------------------------------------ worker

def run_worker(args) -> int:
    """Train one mode in this process and print one JSON line on stdout."""
    import torch

    from hyper_parallel.bench.model import GPT, GPTConfig, train_steps
    from hyper_parallel.bench.modes import apply_mode
    from hyper_parallel.core.activation_checkpoint import SwapManager
    from hyper_parallel.tools.memory import MemoryMeter

    mode = args.worker
    allowed = SWAP_WRAPPER_MODES if args.swap_wrapper else MODES
    if mode == PLAN_RANGE or mode.startswith(PLAN_PREFIX):
        return run_plan_worker(args, mode)
    if mode not in allowed:
        print(f"unknown mode {mode!r}; choose from {', '.join(allowed)}", file=sys.stderr)
        return 2

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    swap_manager = SwapManager()
    cfg = GPTConfig(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers,
                    seq=args.seq, dropout=args.dropout)
    model = GPT(cfg, seed=args.seed).to(device=device, dtype=dtype)
    swap_manager.reset()
    apply_mode(model, mode, swap_wrapper=args.swap_wrapper, swap_threshold_bytes=swap_threshold(args))

    meters: List[Any] = []

    def make_meter(model_, optimizer):
        m = MemoryMeter(device, track=[model_, optimizer])
        meters.append(m)
        return m

    def on_step(step: int, loss: float) -> None:
        print(f"{_PROGRESS_TAG} {step + 1} {args.steps}", file=sys.stderr, flush=True)

    times: List[float] = []
    losses = train_steps(model, args.steps, args.batch, args.lr, args.seed, device,
                         meter=make_meter, times=times, on_step=on_step)
    peak = int(meters[0].peak_bytes) if meters else 0
    stats = report.plain(swap_manager.stats())
    offloaded = int(stats["offloaded_bytes"])
    if args.trace:  # one extra step, after the measured ones: results and stats above are unaffected
        from hyper_parallel.bench.trace import write_trace

        write_trace(lambda: train_steps(model, 1, args.batch, args.lr, args.seed + args.steps, device),
                    os.path.join(args.trace, f"{mode}.json"), device=device)
    result = {
        "mode": mode,
        "peak_bytes": peak,
        "offloaded_bytes": offloaded,
        "step_time_s": median(times) or 0.0,
        "step_times_s": times,
        "losses": losses,
        "stats": stats,
        "process_cpu_s": time.process_time(),
    }
    sys.stdout.write(_RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


PLAN_PREFIX = "plan@"
PLAN_RANGE = "plan-range"


def run_plan_worker(args, mode: str) -> int:
    """A memory plan in this process: plan a copy of the model (one Adam step first, so that the
    plan counts the optimizer's state; the planned step is a whole training step), then train the
    model under the plan as the modes train (``plan@BYTES``); or only report the range of budgets
    worth planning (``plan-range``: the smallest reachable peak and the peak with nothing wrapped)."""
    import copy
    import gc

    import torch

    from hyper_parallel.bench.model import GPT, GPTConfig, make_batch, train_steps
    from hyper_parallel.core.activation_checkpoint import MemoryPlan, SwapManager, plan_memory
    from hyper_parallel.tools.memory import MemoryMeter

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq,
                    dropout=args.dropout)
    model = GPT(cfg, seed=args.seed).to(device=device, dtype=getattr(torch, args.dtype))
    planned = copy.deepcopy(model)
    optimizer = torch.optim.Adam(planned.parameters(), lr=args.lr)
    tokens, targets = make_batch(cfg, args.batch, args.seed, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        planned(tokens, targets).backward()
        optimizer.step()

    step()  # (the optimizer's state exists from the second step on: plan for that)
    budget = "1TiB" if mode == PLAN_RANGE else int(mode[len(PLAN_PREFIX):])
    t0 = time.perf_counter()
    plan = plan_memory(planned.layers, step, budget)
    planning_s = time.perf_counter() - t0
    result: Dict[str, Any] = {"mode": mode, "min_budget_bytes": plan.min_budget_bytes,
                              "reference_peak_bytes": plan.reference_peak_bytes, "planning_s": planning_s}
    if mode == PLAN_RANGE:
        sys.stdout.write(_RESULT_TAG + json.dumps(result) + "\n")
        return 0
    text, report_text = plan.to_json(), plan.report()
    result.update(budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                  predicted_step_s=plan.predicted_step_s, lower_bound_step_s=plan.lower_bound_step_s,
                  report=report_text, options=[c.option.name() for c in plan.choices])
    del plan, planned, optimizer, step
    gc.collect()  # (the planned copy must not count in this process's memory)
    SwapManager().reset()
    MemoryPlan.from_json(text, model.layers).apply()
    meters: List[Any] = []

    def make_meter(model_, optimizer_):
        m = MemoryMeter(device, track=[model_, optimizer_])
        meters.append(m)
        return m

    times: List[float] = []
    losses = train_steps(model, args.steps, args.batch, args.lr, args.seed, device, meter=make_meter, times=times,
                         on_step=lambda s, loss: print(f"{_PROGRESS_TAG} {s + 1} {args.steps}", file=sys.stderr,
                                                       flush=True))
    stats = report.plain(SwapManager().stats())
    result.update(peak_bytes=int(meters[0].peak_bytes), offloaded_bytes=int(stats["offloaded_bytes"]),
                  step_time_s=median(times) or 0.0, step_times_s=times, losses=losses, stats=stats,
                  process_cpu_s=time.process_time())
    sys.stdout.write(_RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


def format_plans(results: List[Dict[str, Any]]) -> List[str]:
    """What each plan row predicted against what it measured, and its report."""
    lines = []
    for r in results:
        if not r["mode"].startswith(PLAN_PREFIX) or "error" in r:
            continue
        over = r["peak_bytes"] > r["budget_bytes"]
        lines.append(f"{_label(r['mode'])}: budget {r['budget_bytes'] / MiB:.1f} MiB, measured peak {r['peak_bytes'] / MiB:.1f} "
                     f"MiB ({'OVER' if over else 'within'}; predicted {r['predicted_peak_bytes'] / MiB:.1f} MiB, "
                     f"{100 * (r['predicted_peak_bytes'] / r['peak_bytes'] - 1):+.1f}%), step "
                     f"{r['step_time_s'] * 1e3:.0f} ms (predicted {r['predicted_step_s'] * 1e3:.0f} ms, "
                     f"{100 * (r['predicted_step_s'] / r['step_time_s'] - 1):+.1f}%; lower bound "
                     f"{r['lower_bound_step_s'] * 1e3:.0f} ms); planned in {r['planning_s']:.1f} s")
        if len([x for x in results if x["mode"].startswith(PLAN_PREFIX)]) == 1:
            lines.append(r["report"])
    return lines


def write_sweep_plot(path: str, results: List[Dict[str, Any]], title: str) -> None:
    """Measured step time against measured peak: the plans' curve and every mode as a point."""
    rows = {}
    for r in results:
        if "error" in r:
            continue
        rows[r["mode"]] = {"fwd_bwd_peak_bytes": r["peak_bytes"], "step_time_s": r["step_time_s"],
                           "who": "baseline" if r["mode"] == "none" else "ours", "budget_bytes": r.get("budget_bytes")}
    report.pareto_chart(path, [{"model": title, "rows": rows}])


# ------------------------------------------------------------------ orchestrator

class _Progress:
    """A dependency-free progress bar on stderr (one line per mode when not a tty)."""

    def __init__(self, total: int, enabled: bool, width: int = 28) -> None:
        self.total = max(1, total)
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self._last_len = 0

    def show(self, label: str) -> None:
        if not self.tty:
            return
        frac = min(1.0, self.done / self.total)
        filled = int(round(frac * self.width))
        line = "[%s%s] %3d%% %-28s %6.1fs" % ("#" * filled, "." * (self.width - filled), int(frac * 100),
                                                label[:28], time.perf_counter() - self.start)
        pad = max(0, self._last_len - len(line))
        sys.stderr.write("\r" + line + " " * pad)
        sys.stderr.flush()
        self._last_len = len(line)

    def log(self, message: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r" + " " * self._last_len + "\r")
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        self._last_len = 0

    def close(self) -> None:
        if self.tty and self._last_len:
            sys.stderr.write("\r" + " " * self._last_len + "\r")
            sys.stderr.flush()


def _worker_env() -> Dict[str, str]:
    env = dict(os.environ)
    # Make the package importable from the worker even when not installed.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parts = [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _worker_argv(args, mode: str) -> List[str]:
    """This command line again (its options were checked), for one mode in a process of its own."""
    return [sys.executable, "-m", "hyper_parallel.bench", *args.argv, "--worker", mode]


def run_mode(args, mode: str, progress: _Progress, base_done: int) -> Dict[str, Any]:
    """Run one worker subprocess; return its result dict or an error dict."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(_worker_argv(args, mode), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env=_worker_env())
    out_chunks: List[str] = []
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    timer = threading.Timer(args.timeout, proc.kill)
    timer.start()
    err_lines: List[str] = []
    try:
        progress.show(f"{mode}: starting")
        for line in proc.stderr:
            if line.startswith(_PROGRESS_TAG):
                try:
                    step = int(line.split()[1])
                except (IndexError, ValueError):
                    step = 0
                progress.done = base_done + step
                progress.show(f"{mode}: step {step}/{args.steps}")
            else:
                err_lines.append(line)
        rc = proc.wait()
    finally:
        timer.cancel()
        reader.join()
    elapsed = time.perf_counter() - t0
    stdout = "".join(out_chunks)
    stderr = "".join(err_lines)
    result = None
    for line in reversed(stdout.splitlines()):
        if line.startswith(_RESULT_TAG):
            try:
                result = json.loads(line[len(_RESULT_TAG):])
            except json.JSONDecodeError:
                result = None
            break
    if rc != 0 or result is None:
        reason = f"exit status {rc}" if rc != 0 else "no result line"
        if rc in (-9, 137) and elapsed >= args.timeout:
            reason = f"timed out after {args.timeout:.0f}s"
        return {"mode": mode, "error": reason, "returncode": rc, "stderr": stderr,
                "stdout": stdout, "wall_s": elapsed}
    result["wall_s"] = elapsed
    if stderr.strip():
        result["stderr"] = stderr
    return result


def losses_match(losses: Sequence[float], baseline: Sequence[float], exact: bool) -> bool:
    """Bitwise when ``exact`` (CPU), else within ``LOSS_ATOL``."""
    return report.loss_check(losses, baseline, exact, LOSS_ATOL)["equal"]


def memory_checks(results: List[Dict[str, Any]], swap_wrapper: bool) -> List[Dict[str, Any]]:
    """The peak-memory orderings the RFC expects (none > save > recompute, swap ~ recompute), evaluated
    on ``results``."""
    peak = {r["mode"]: r["peak_bytes"] for r in results if "error" not in r}
    checks: List[Dict[str, Any]] = []

    def greater(a: str, b: str) -> None:
        if a in peak and b in peak:
            checks.append({"check": f"{a} > {b}", "ok": peak[a] > peak[b]})

    if swap_wrapper:
        greater("none", "swap_with_policy")
        greater("swap_with_policy", "swap")
    else:
        greater("none", "save")
        greater("save", "recompute")
        greater("none", "recompute")
        if "swap" in peak and "recompute" in peak and "none" in peak:
            # "about equal": swap brings the peak down at least 2/3 as far as
            # recompute does.  (Around a layer boundary in backward the swap
            # schedule holds two layers' swapped tensors, the current one and the
            # prefetched predecessor, so it sits a little above recompute.)
            saved_recompute = peak["none"] - peak["recompute"]
            saved_swap = peak["none"] - peak["swap"]
            ratio = saved_swap / saved_recompute if saved_recompute > 0 else 0.0
            checks.append({"check": "swap ~ recompute", "ok": saved_recompute > 0 and ratio >= 2.0 / 3.0,
                           "ratio": ratio})
    return checks


def format_swap_stats(results: List[Dict[str, Any]], exact: bool) -> List[str]:
    """One line of ``SwapManager().stats()`` per mode that swapped anything (whole run), and what
    the figures mean."""
    swapped = [r for r in results if "error" not in r and ((r.get("stats") or {}).get("offloaded_bytes")
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


def _fmt_losses(losses: Sequence[float]) -> str:
    vals = ["%.5f" % v for v in losses]
    if len(vals) > 5:
        vals = vals[:2] + ["..."] + vals[-2:]
    return " ".join(vals)


def _label(mode: str) -> str:
    """A row's name: the mode, or ``plan@<budget in MiB>``."""
    if mode.startswith(PLAN_PREFIX):
        return f"{PLAN_PREFIX}{int(mode[len(PLAN_PREFIX):]) / MiB:.1f}MiB"
    return mode


def format_table(results: List[Dict[str, Any]]) -> str:
    base = next((r for r in results if r["mode"] == "none" and "error" not in r), None)
    base_peak = base["peak_bytes"] if base else 0
    header = ["mode", "peak MiB", "vs none", "offloaded MiB/step", "step ms", "losses", "matches none"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([_label(r["mode"]), "-", "-", "-", "-", "FAILED: " + r["error"], "-"])
            continue
        match = r.get("matches_baseline")
        rows.append([
            _label(r["mode"]),
            "%.1f" % (r["peak_bytes"] / MiB),
            "%.2fx" % (r["peak_bytes"] / base_peak) if base_peak else "-",
            "%.1f" % (r["offloaded_bytes"] / MiB / max(1, len(r["losses"]))),
            "%.0f" % (r["step_time_s"] * 1000.0),
            _fmt_losses(r["losses"]),
            "baseline" if r["mode"] == "none" else ("yes" if match else ("NO" if match is not None else "-")),
        ])
    return report.table(header, rows, align="lrrrrll")


def mode_legend(results: List[Dict[str, Any]], swap_wrapper: bool) -> str:
    """What each mode of the table wraps and how (from the recipes of ``bench.modes``)."""
    suite = SWAP_WRAPPER_RECIPES if swap_wrapper else MODE_RECIPES
    return report.legend([(r["mode"], RECIPES[suite[r["mode"]]].what) for r in results])


def reading(results: List[Dict[str, Any]], exact: bool) -> str:
    """The table in one line: the mode with the lowest peak (off CPU: at what time cost) and
    whether the losses match."""
    ok = [r for r in results if "error" not in r]
    base = next((r for r in ok if r["mode"] == "none"), None)
    if not ok or base is None:
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


def write_plot(path: str, results: List[Dict[str, Any]], title: str) -> None:
    """The bar chart of ``results`` (matplotlib was checked with the options)."""
    rows = {}
    for r in results:
        if "error" in r:
            continue
        steps, stats = max(1, len(r["losses"])), r.get("stats") or {}
        rows[r["mode"]] = {"who": "baseline" if r["mode"] == "none" else "ours", "peak_bytes": r["peak_bytes"],
                           "step_time_s": r["step_time_s"],
                           "bytes_moved_per_step": {"d2h": r["offloaded_bytes"] / steps,
                                                    "h2d": (stats.get("loaded_bytes") or 0) / steps}}
    report.bar_chart(path, rows, title)


def _plan_modes(args, progress: "_Progress") -> List[str]:
    """The ``plan@BYTES`` rows asked for: ``--budget``, and ``--budget-sweep N`` (from a first
    worker's range of budgets worth planning)."""
    from hyper_parallel.planner import parse_budget

    modes = []
    if args.budget is not None:
        modes.append(f"{PLAN_PREFIX}{parse_budget(args.budget)}")
    if args.budget_sweep:
        span = run_mode(args, PLAN_RANGE, progress, 0)
        if "error" in span:
            raise RuntimeError(f"planning the budget range failed: {span['error']}\n{span.get('stderr', '')}")
        low, high, n = span["min_budget_bytes"], span["reference_peak_bytes"], args.budget_sweep
        modes += [f"{PLAN_PREFIX}{int(low + (high - low) * k / max(1, n - 1))}" for k in range(n)]
    return modes


def run_comparison(args, parser) -> int:
    modes = _mode_list(args, parser)
    if args.budget is not None or args.budget_sweep:
        modes += _plan_modes(args, _Progress(total=1, enabled=False))
    config = _config(args)
    exact = args.device.split(":")[0] == "cpu"
    progress = _Progress(total=len(modes) * max(1, args.steps), enabled=not args.no_progress)
    t_start = time.perf_counter()
    results: List[Dict[str, Any]] = []
    for i, mode in enumerate(modes):
        r = run_mode(args, mode, progress, base_done=i * max(1, args.steps))
        progress.done = (i + 1) * max(1, args.steps)
        if "error" in r:
            progress.log(f"[{i + 1}/{len(modes)}] {mode}: FAILED ({r['error']}) after {r['wall_s']:.1f}s")
        else:
            progress.log(f"[{i + 1}/{len(modes)}] {mode}: done in {r['wall_s']:.1f}s")
        results.append(r)
    progress.close()
    total = time.perf_counter() - t_start

    base = results[0] if results and results[0]["mode"] == "none" and "error" not in results[0] else None
    for r in results:
        if "error" in r:
            r["matches_baseline"] = False
        elif base is None:
            r["matches_baseline"] = None
        else:
            r["matches_baseline"] = losses_match(r["losses"], base["losses"], exact)
    checks = memory_checks(results, args.swap_wrapper)

    kind = "swap_wrapper" if args.swap_wrapper else "checkpoint_wrapper"
    cfg_line = ("layers=%(layers)d dim=%(dim)d heads=%(heads)d seq=%(seq)d batch=%(batch)d "
                "vocab=%(vocab)d steps=%(steps)d dtype=%(dtype)s" % config)
    print(f"hyper-parallel bench ({kind} modes) on {args.device}: {cfg_line}")
    if args.swap_wrapper:
        print(f"swap_with_policy threshold: {config['swap_threshold_bytes']} bytes")
    print(format_table(results))
    print(mode_legend([r for r in results if not r["mode"].startswith(PLAN_PREFIX)], args.swap_wrapper))
    for line in format_plans(results):
        print(line)
    print(reading(results, exact))
    for line in format_swap_stats(results, exact):
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
        tail = r.get("stderr", "").strip().splitlines()[-80:]
        if tail:
            print("\n".join(tail), file=sys.stderr)
        out_tail = r.get("stdout", "").strip().splitlines()[-20:]
        if out_tail:
            print("--- stdout ---\n" + "\n".join(out_tail), file=sys.stderr)

    if args.json:
        import torch

        doc = {
            "device": args.device,
            "kind": kind,
            "torch": torch.__version__,
            "config": config,
            "results": [{k: v for k, v in r.items() if k != "stdout"} for r in results],
            "checks": checks,
            "total_time_s": total,
        }
        report.write_json(args.json, doc)
    if args.budget_sweep:
        sweep_json = args.json or "budget_sweep.json"
        if not args.json:
            report.write_json(sweep_json, {"device": args.device, "config": config,
                                           "results": [{k: v for k, v in r.items() if k != "stdout"} for r in results]})
        sweep_png = args.plot or "budget_sweep.png"
        if report.have_matplotlib()[0]:
            write_sweep_plot(sweep_png, results, f"bench GPT on {args.device}: {cfg_line}")
            print(f"budget sweep written to {sweep_json} and {sweep_png}")
        else:
            print(f"budget sweep written to {sweep_json} (no PNG: matplotlib is not installed)")
    elif args.plot:
        write_plot(args.plot, results, f"{kind} modes, {args.device}: {cfg_line}")
        print(f"plot written to {args.plot}")

    if failed:
        return 1
    if any(r["matches_baseline"] is False for r in results):
        bad = ", ".join(r["mode"] for r in results if r["matches_baseline"] is False)
        print(f"losses differ from the baseline for: {bad}", file=sys.stderr)
        return 2
    if args.strict and any(not c["ok"] for c in checks):
        return 3
    return 0


def device_problem(name: str) -> Optional[str]:
    """Why ``--device name`` cannot run here (``None``: it can): not a device this torch build knows,
    or an accelerator type (or index) it does not have."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        return f"--device {name!r} is not a device torch {torch.__version__} knows: {str(exc).splitlines()[0]}"
    if dev.type == "cpu":
        return None
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != dev.type:
        return (f"--device {name}: this torch build ({torch.__version__}) has no {dev.type} device (it has "
                f"{'a ' + acc.type if acc is not None else 'no accelerator'}); run with --device cpu")
    if dev.index is not None and dev.index >= torch.accelerator.device_count():
        return f"--device {name}: there are {torch.accelerator.device_count()} {dev.type} device(s)"
    return None


def _unwritable(folder: str) -> bool:
    """Whether ``folder`` can neither be written nor created (its nearest existing ancestor is not
    a writable directory)."""
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return not (os.path.isdir(folder) and os.access(folder, os.W_OK))


def check_options(args, parser: argparse.ArgumentParser) -> None:
    """Every option, before any mode runs (a mistake found after minutes of training costs those
    minutes): the sizes (as ``GPTConfig`` checks them), the modes, the device, matplotlib for
    ``--plot`` and the folders the outputs go to. Exits through ``parser.error`` (status 2)."""
    from hyper_parallel.bench.model import GPTConfig

    if args.steps < 1 or args.batch < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--steps, --batch and --threads must be >= 1")
    if args.timeout <= 0 or (args.swap_threshold_bytes is not None and args.swap_threshold_bytes < 0):
        parser.error("--timeout must be > 0 and --swap-threshold-bytes >= 0")
    try:
        GPTConfig(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq,
                  dropout=args.dropout)
    except ValueError as exc:
        parser.error(str(exc))
    if args.worker is None:
        _mode_list(args, parser)
    if args.budget is not None:
        from hyper_parallel.planner import parse_budget

        try:
            parse_budget(args.budget)
        except (TypeError, ValueError) as exc:
            parser.error(f"--budget: {exc}")
    if args.budget_sweep is not None and args.budget_sweep < 2:
        parser.error("--budget-sweep needs at least 2 budgets")
    if (args.budget is not None or args.budget_sweep) and args.swap_wrapper:
        parser.error("--budget and --budget-sweep plan the checkpoint_wrapper comparison; leave --swap-wrapper out")
    why = device_problem(args.device)
    if why:
        parser.error(why)
    if args.plot and not report.have_matplotlib()[0]:
        parser.error("--plot needs matplotlib, which is not installed: pip install -e '.[bench]' (or pip install "
                     "matplotlib), or leave --plot out")
    for flag, path, folder in (("--json", args.json, os.path.dirname), ("--plot", args.plot, os.path.dirname),
                               ("--trace", args.trace, str)):
        if path is not None and _unwritable(folder(path) or "."):
            parser.error(f"{flag}: cannot write to {os.path.abspath(folder(path) or '.')}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    check_options(args, parser)
    if args.worker is not None:
        return run_worker(args)
    return run_comparison(args, parser)


if __name__ == "__main__":
    sys.exit(main())
