"""Reporting and command lines for every benchmark: tables, legends, loss comparison, the ``SwapManager().stats()``
line, the environment, JSON, charts (with matplotlib, the ``bench`` extra), and the options the scripts of
``benchmarks/`` share (:func:`script_parser`, :func:`script_setup`, :func:`variant_names`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import textwrap
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

MiB = 1024 * 1024

#: What CPU step times of the copying and re-running variants mean (printed with CPU results).
CPU_TIMING_NOTE = ("note: on CPU the swap copies are synchronous memcpys (no copy engine to overlap them with "
                   "compute) and save/recompute re-run ops on the same few cores, so these step times say "
                   "nothing about a GPU; the peak memory column models what a device would hold")


def fmt(x: Optional[float], spec: str = "%.1f") -> str:
    """``spec % x``, or ``-`` for ``None``."""
    return "-" if x is None else spec % x


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, or ``None`` when either is missing or ``b`` is 0."""
    return None if a is None or b is None or b == 0 else a / b


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str) -> str:
    """A plain-text table: the header, a rule, the rows; ``align`` has one ``l`` or ``r`` per column."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(row: Sequence[Any]) -> str:
        return "  ".join(str(c).rjust(w) if a == "r" else str(c).ljust(w)
                         for c, w, a in zip(row, widths, align)).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def legend(rows: Sequence[Tuple[str, str]], title: str = "legend") -> str:
    """``title:`` then one line per ``(name, what it does)``."""
    width = max((len(n) for n, _ in rows), default=0)
    return "\n".join([f"{title}:"] + [f"  {n.ljust(width)}  {what}" for n, what in rows])


def loss_check(losses: Sequence[float], baseline: Sequence[float], exact: bool, atol: float) -> Dict[str, Any]:
    """``{"equal", "max_abs_diff"}`` of one loss sequence against the baseline's: bitwise when ``exact`` (CPU), else
    within ``atol``; sequences of different lengths are not equal."""
    if len(losses) != len(baseline):
        return {"equal": False, "max_abs_diff": None}
    diff = max((abs(a - b) for a, b in zip(losses, baseline)), default=0.0)
    equal = all(a == b for a, b in zip(losses, baseline)) if exact else diff <= atol
    return {"equal": equal, "max_abs_diff": diff}


def compare_losses(rows: Mapping[str, Dict[str, Any]], exact: bool, atol: float) -> Dict[str, Dict[str, Any]]:
    """Every row's ``losses`` against the ``none`` row's (:func:`loss_check`), written into each row as
    ``loss_equal_to_none`` / ``loss_max_abs_diff`` (``None`` without a ``none`` row) and returned."""
    base = rows.get("none")
    out = {n: ({"equal": None, "max_abs_diff": None} if base is None else
               loss_check(r["losses"], base["losses"], exact, atol)) for n, r in rows.items()}
    for n, r in rows.items():
        r["loss_equal_to_none"], r["loss_max_abs_diff"] = out[n]["equal"], out[n]["max_abs_diff"]
    return out


def print_problems(skipped: Mapping[str, str], errors: Mapping[str, str]) -> None:
    """The variants skipped (cannot run here) and failed, each with its reason."""
    for kind, found in (("skipped", skipped), ("FAILED", errors)):
        for name, why in found.items():
            print(f"{kind} {name}: {why}")


def swap_stats_line(stats: Mapping[str, Any]) -> str:
    """``SwapManager().stats()`` (or its JSON form) in one line."""
    pool = stats.get("host_pool") or {}
    kept = ", ".join(f"{k}={v / MiB:.1f} MiB" for k, v in sorted((stats.get("kept_bytes") or {}).items())) or "none"
    return (f"offloaded {stats.get('offloaded_bytes', 0) / MiB:.1f} MiB in {stats.get('offload_launches', 0)} "
            f"launches, loaded {stats.get('loaded_bytes', 0) / MiB:.1f} MiB in {stats.get('load_launches', 0)} "
            f"launches, host waits offload {stats.get('wait_offload_s', 0) * 1e3:.1f} ms / load "
            f"{stats.get('wait_load_s', 0) * 1e3:.1f} ms, kept on device: {kept}; host pool "
            f"{pool.get('reserved_bytes', 0) / MiB:.1f} MiB reserved in {pool.get('allocations', 0)} buffers")


def environment(device: torch.device) -> Dict[str, Any]:
    """Device, versions and thread count, for a result document."""
    env: Dict[str, Any] = {"device": str(device), "torch": torch.__version__, "python": sys.version.split()[0],
                           "platform": platform.platform(), "cpu_threads": torch.get_num_threads()}
    if device.type != "cpu":
        dm = torch.get_device_module(device.type)
        env.update(device_name=dm.get_device_name(device), cuda=torch.version.cuda,
                   device_memory_bytes=int(getattr(dm.get_device_properties(device), "total_memory", 0)))
    try:
        env["torchtune"] = importlib.metadata.version("torchtune")
    except importlib.metadata.PackageNotFoundError:
        env["torchtune"] = None
    return env


def load_average() -> str:
    """The machine's load average (1, 5, 15 minutes) as text, ``-`` where the OS has none."""
    return " ".join("%.2f" % v for v in os.getloadavg()) if hasattr(os, "getloadavg") else "-"


def json_value(obj: Any) -> Any:
    """``json``'s ``default``: what has no JSON form as a number where it converts (tensors, numpy scalars), else
    its ``str``."""
    try:
        return float(obj)
    except (TypeError, ValueError):
        return str(obj)


def write_json(path: str, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` to ``path`` (folders created; replaced atomically, so a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, default=json_value)
        f.write("\n")
    os.replace(tmp, path)


def device_problem(name: str) -> Optional[str]:
    """Why ``--device name`` cannot run here (``None``: it can): not a device this torch build knows, or an accelerator
    type (or index) it does not have."""
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        return f"--device {name!r} is not a device torch {torch.__version__} knows: {str(exc).splitlines()[0]}"
    if dev.type == "cpu":
        return None
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != dev.type:
        return (f"--device {name}: this torch build ({torch.__version__}) has no {dev.type} device (it has "
                f"{'a ' + acc.type if acc is not None else 'no accelerator'})")
    if dev.index is not None and dev.index >= torch.accelerator.device_count():
        return f"--device {name}: there are {torch.accelerator.device_count()} {dev.type} device(s)"
    return None


def variant_names(spec: Optional[str], default: Sequence[str], known: Iterable[str],
                  parser: argparse.ArgumentParser) -> List[str]:
    """``none`` first, then the comma-separated names of ``spec`` (default ``default``), each once; a name not in
    ``known`` is a usage error that lists the known ones."""
    names = list(default) if spec is None else [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        parser.error(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(known)}")
    return list(dict.fromkeys(["none"] + names))


def script_parser(doc: str, *, seed: int = 1234, device: bool = True, threads: bool = True) -> argparse.ArgumentParser:
    """A script's parser (described by ``doc``'s first line) with the options every script shares: ``--device``
    (``auto``: the accelerator if any), ``--dtype``, ``--seed``, ``--threads`` (default 1 on CPU), ``--json``."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    if device:
        p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, npu, ... or 'auto' (default cpu)")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=seed, help=f"seed of init, batches and dropout (default {seed})")
    if threads:
        p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default 1 on CPU)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    return p


def script_setup(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Tuple[torch.device, torch.dtype]:
    """The device (checked: a bad one is a usage error), the dtype, and the intra-op threads."""
    name = getattr(args, "device", "cpu")
    if name == "auto":
        name = str(torch.accelerator.current_accelerator()) if torch.accelerator.is_available() else "cpu"
    why = device_problem(name)
    if why:
        parser.error(why)
    device = torch.device(name)
    threads = getattr(args, "threads", None)
    if threads is None and device.type == "cpu" and hasattr(args, "threads"):
        threads = args.threads = 1
    if threads:
        torch.set_num_threads(threads)
    return device, getattr(torch, getattr(args, "dtype", "float32"))


def have_matplotlib() -> Tuple[bool, str]:
    """``(True, "")`` or ``(False, why no chart is written)``."""
    if importlib.util.find_spec("matplotlib") is not None:
        return True, ""
    return False, "matplotlib is not installed: pip install -e '.[bench]' (or pip install matplotlib); no chart written"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    return __import__("matplotlib.pyplot").pyplot


def _save(fig: Any, path: str) -> None:
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    _plt().close(fig)


_COLORS = {"baseline": "tab:gray", "peer": "tab:orange", "ours": "tab:blue"}


def bar_chart(path: str, rows: Mapping[str, Mapping[str, Any]], title: str,
              time_label: str = "median step (ms)") -> None:
    """Three panels per row name: peak memory, median step time, bytes moved per step. Each row has ``who``,
    ``peak_bytes``, ``step_time_s`` and ``bytes_moved_per_step`` (``d2h``, ``h2d``)."""
    plt = _plt()
    names = [n for n in rows if rows[n]["peak_bytes"] is not None]
    colors = [_COLORS.get(rows[n]["who"], "tab:blue") for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(min(16.0, max(9.0, 1.2 * len(names) + 4)), 4.8))
    xs = list(range(len(names)))
    panels = [("peak device memory (MiB)", [rows[n]["peak_bytes"] / MiB for n in names]),
              (time_label, [(rows[n]["step_time_s"] or 0) * 1e3 for n in names]),
              ("moved per step, D2H+H2D (MiB)", [sum(rows[n]["bytes_moved_per_step"].values()) / MiB for n in names])]
    for ax, (label, vals) in zip(axes, panels):
        ax.bar(xs, vals, color=colors)
        ax.set_xticks(xs, names, rotation=40, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        for x, val in zip(xs, vals):
            ax.text(x, val, "%.0f" % val, ha="center", va="bottom", fontsize=7)
    from matplotlib.patches import Patch

    whos = [w for w in _COLORS if any(rows[n]["who"] == w for n in names)]
    labels = {"baseline": "baseline", "peer": "peers", "ours": "hyper-parallel"}
    axes[0].legend(handles=[Patch(color=_COLORS[w], label=labels[w]) for w in whos], fontsize=8)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def sweep_chart(path: str, axis: str, points: List[Dict[str, Any]], title: str) -> None:
    """Peak above parameters and buffers, and median step time, of every row against the swept ``axis`` (``points``:
    ``{"value", "results": {name: row}}``)."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names: List[str] = []
    for p in points:
        names += [n for n in p["results"] if n not in names]
    markers = "osD^v<>ph*"
    for k, n in enumerate(names):
        xs, mem, tm, who = [], [], [], "ours"
        for p in points:
            r = p["results"].get(n)
            if r is None or r["peak_bytes"] is None:
                continue
            who = r["who"]
            xs.append(p["value"])
            mem.append(r["peak_above_static_bytes"] / MiB)
            tm.append((r["step_time_s"] or 0) * 1e3)
        style = {"ours": "-", "peer": "--"}.get(who, ":")
        ax1.plot(xs, mem, style, marker=markers[k % len(markers)], label=n, alpha=0.85)
        ax2.plot(xs, tm, style, marker=markers[k % len(markers)], label=n, alpha=0.85)
    done = [p for p in points if p["results"]]
    ax1.plot([p["value"] for p in done], [next(iter(p["results"].values()))["grad_bytes"] / MiB for p in done],
             color="black", linestyle=(0, (1, 3)), label="gradients of all params")
    ax1.set(xlabel=axis, ylabel="peak above params+buffers (MiB)", title="peak memory (activations + grads)")
    ax2.set(xlabel=axis, ylabel="median fwd+bwd step (ms)", title="step time")
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def pareto_chart(path: str, models: List[Dict[str, Any]]) -> None:
    """Step time against measured peak, a panel per model (``benchmarks/planner.py``'s results): plans and sac_ilp's as
    curves in budget order, every fixed recipe as a labelled point."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.4), squeeze=False)
    for ax, m in zip(axes[0], models):
        rows = m["rows"]
        for prefix, style, label in (("plan@", "o-", "plan_memory"), ("sac_ilp@", "s--", "sac_ilp")):
            pts = sorted((r["budget_bytes"], r["fwd_bwd_peak_bytes"] / MiB, r["step_time_s"] * 1e3)
                         for n, r in rows.items() if n.startswith(prefix) and r.get("budget_bytes"))
            if pts:
                ax.plot([p[1] for p in pts], [p[2] for p in pts], style, label=label, alpha=0.85)
        for n, r in rows.items():
            if "@" in n:
                continue
            ax.plot(r["fwd_bwd_peak_bytes"] / MiB, r["step_time_s"] * 1e3, "D", color=_COLORS.get(r["who"], "k"))
            ax.annotate(n, (r["fwd_bwd_peak_bytes"] / MiB, r["step_time_s"] * 1e3), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="measured peak of forward + backward (MiB)", ylabel="median forward + backward (ms)")
        ax.set_title(textwrap.fill(m["model"], 70), fontsize=8)  # (a long title kept inside the panel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("memory plans against the fixed recipes", fontsize=10)
    _save(fig, path)
