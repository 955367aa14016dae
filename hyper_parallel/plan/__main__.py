"""``python -m hyper_parallel.plan``: plan a training step for an accelerator you do not have.

Describe the run the way you think of it: a Hugging Face model (a built-in configuration, or the
path of a ``config.json``) or a model factory (``package.module:name``, a ``ModelFactory`` or a
function of no arguments returning one: ``backends/torch/phase_trace.py``), the sequence length
and batch, precision, optimizer, data parallelism, FSDP2 sharding, pipeline stages, and the
activation recipe; and the accelerator (a built-in target, ``this`` machine calibrated by a
micro-benchmark, or a JSON file). It prints whether the step fits, its peak allocated and
reserved bytes against the target's memory, the smallest peak any plan reaches and what it is
made of, the plan per layer, the step time and what binds it, every number marked measured or
modelled (``--json``: the same as JSON).

Examples::

    python -m hyper_parallel.plan llama3-8b --seq 8192 --target h100-sxm --recipe full
    python -m hyper_parallel.plan llama3-70b --seq 8192 --fsdp 8 --target h200 --recipe plan --budget 120GiB
    python -m hyper_parallel.plan path/to/config.json --seq 4096 --batch 2 --target my_card.json --json
    python -m hyper_parallel.plan hyper_parallel.bench.model:model_factory --seq 256 --precision fp32 --target this
    python -m hyper_parallel.plan --list-targets

Exit status: 0 when the report was printed, 2 for a bad input (the message says what to do),
1 when the planner could not answer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hyper_parallel.plan._stub import plan_for_target
from hyper_parallel.planner.budget import format_bytes, parse_budget
from hyper_parallel.planner.model_configs import MODEL_CONFIGS, resolve_model
from hyper_parallel.planner.targets import TARGETS, Target, load_target_file, table_rows, target
from hyper_parallel.backends.torch.calibrate import calibrate_this_machine
from hyper_parallel.backends.torch.phase_trace import ModelFactory

__all__ = ["main", "build_parser", "format_report", "condense_plan", "plan_runs", "resolve_target", "resolve_factory",
           "list_targets"]

PRECISIONS = ("bf16-mixed", "bf16", "fp16-amp", "fp32")
OPTIMIZERS = ("adamw", "adamw-fused", "sgd")
RECIPES = ("none", "full", "selective", "hf-gc", "plan")
_PROG = "python -m hyper_parallel.plan"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (give a positive integer)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive (give an integer >= 1)")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line's options (argparse exits 2 on a bad one, with its message)."""
    p = argparse.ArgumentParser(
        prog=_PROG,
        description="Plan a training step's memory (recompute / swap per layer) and time for an accelerator "
                    "you do not have: bytes from a meta-device trace, time from a roofline of the target's "
                    "published figures (docs/targets.md).")
    p.add_argument("model", nargs="?",
                   help=f"a built-in configuration ({', '.join(MODEL_CONFIGS)}), the path of a Hugging Face "
                        "config.json (or of the folder holding it), or a model factory as package.module:name")
    p.add_argument("--seq", type=_positive_int, help="sequence length in tokens (required)")
    p.add_argument("--batch", type=_positive_int, default=1, help="micro-batch size per device (default 1)")
    p.add_argument("--grad-accum", type=_positive_int, default=1, dest="grad_accum",
                   help="micro-batches accumulated per optimizer step (default 1)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed",
                   help="bf16-mixed: bf16 compute with fp32 master weights (default); bf16: pure bf16; "
                        "fp16-amp: fp16 autocast with a grad scaler; fp32")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw (foreach, default), adamw-fused, sgd")
    p.add_argument("--dp", type=_positive_int, default=1, help="data-parallel replicas (DDP; default 1)")
    p.add_argument("--fsdp", type=_positive_int, default=1,
                   help="FSDP2 sharding degree (1: no sharding, the default)")
    p.add_argument("--no-reshard-after-forward", action="store_false", dest="reshard_after_forward",
                   help="FSDP2 keeps the gathered parameters from forward to backward (needs --fsdp > 1)")
    p.add_argument("--pp", type=_positive_int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--recipe", choices=RECIPES, default="none",
                   help="activation recipe: none, full (recompute every layer), selective (torchtitan's per-op "
                        "policy), hf-gc (Hugging Face gradient checkpointing), plan (the planner's choice under "
                        "--budget)")
    p.add_argument("--budget", help="peak memory budget for --recipe plan, e.g. 70GiB or 75GB")
    p.add_argument("--target", default="h100-sxm",
                   help=f"the accelerator: a built-in ({', '.join(TARGETS)}), 'this' (this machine, calibrated by "
                        "a short micro-benchmark) or the path of a JSON target file (default h100-sxm)")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    p.add_argument("--list-targets", action="store_true", dest="list_targets",
                   help="list the built-in targets with their figures, and exit")
    return p


def resolve_target(spec: str) -> Target:
    """A built-in target's name, ``this`` (calibrated now) or the path of a JSON target file."""
    if spec.strip().lower() in ("this", "this-machine"):
        return calibrate_this_machine()
    if spec.endswith(".json") or os.path.sep in spec or os.path.exists(spec):
        return load_target_file(spec)
    try:
        return target(spec)
    except ValueError as e:
        raise ValueError(f"{e}; or 'this' for this machine") from None


def resolve_factory(spec: str) -> Any:
    """``package.module:name``: the user's model factory (a ``ModelFactory``, or a function of no
    arguments returning one), imported as the command line is asked to (the user's own code)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for the model factory {spec!r}: {e}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ValueError(f"{module_name} has no {attr!r} (the model factory {spec!r})")
    if not isinstance(factory, ModelFactory) and callable(factory):
        factory = factory()
    if not isinstance(factory, ModelFactory):
        raise ValueError(f"{spec} is a {type(factory).__name__}, not a ModelFactory (or a function of no arguments "
                         "returning one)")
    return factory


def list_targets(as_json: bool = False) -> str:
    """The built-in targets, as a table or JSON."""
    if as_json:
        return json.dumps({key: t.to_json() for key, t in TARGETS.items()}, indent=2)
    header = ("target", "name", "memory GiB", "bf16 TFLOP/s", "HBM TB/s", "host link GB/s")
    rows = [header] + table_rows()
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("dense peaks (no sparsity), host link one direction; the sources of every number: "
                 "--list-targets --json, or docs/targets.md")
    lines.append("also: --target this (this machine, calibrated by a micro-benchmark), --target file.json")
    return "\n".join(lines)


def condense_plan(plan: Sequence[str]) -> str:
    """How many layers take each option, in the order they first appear.

    >>> condense_plan(["recompute"] * 30 + ["none"] * 2)
    '30x recompute, 2x none'
    """
    counts: Dict[str, int] = {}
    for option in plan:
        counts[option] = counts.get(option, 0) + 1
    return ", ".join(f"{n}x {option}" for option, n in counts.items()) or "(no layers)"


def plan_runs(plan: Sequence[str], limit: int = 8) -> str:
    """Runs of consecutive layers with one option.

    >>> plan_runs(["swap"] * 2 + ["recompute"] * 29 + ["none"])
    'layers 0-1 swap; 2-30 recompute; 31 none'
    """
    runs: List[Tuple[int, int, str]] = []
    for i, option in enumerate(plan):
        if runs and runs[-1][2] == option:
            runs[-1] = (runs[-1][0], i, option)
        else:
            runs.append((i, i, option))
    parts = [f"{a}-{b} {o}" if a != b else f"{a} {o}" for a, b, o in runs[:limit]]
    more = f"; ... ({len(runs) - limit} more runs)" if len(runs) > limit else ""
    return ("layers " + "; ".join(parts) + more) if parts else "(no layers)"


def _share(nbytes: float, memory: int) -> str:
    return f"{100.0 * nbytes / memory:.0f}% of {format_bytes(memory)}"


def format_report(result: Dict[str, Any], *, model: str, source: str, target: Target, run: Dict[str, Any]) -> str:
    """The human-readable answer (module docstring). A number the planner does not mark is shown
    as modelled: on a target you do not have nothing was measured."""
    marks = result.get("measured_or_modelled") or {}

    def mark(key: str, fallback: str = "modelled") -> str:
        return str(marks.get(key, fallback))

    memory = target.memory_bytes
    lines = [f"{_PROG}: {model} on {target.name}"]
    if source:
        lines.append(f"  model:  {source}")
    shard = run["fsdp"]
    lines.append(
        f"  run:    seq {run['seq']}, batch {run['batch']}, grad-accum {run['grad_accum']}, {run['precision']}, "
        f"{run['optimizer']}, dp {run['dp']}, fsdp {shard}"
        + (f" ({'' if run['reshard_after_forward'] else 'no '}reshard after forward)" if shard > 1 else "")
        + f", pp {run['pp']}, recipe {run['recipe']}"
        + (f" (budget {format_bytes(run['budget'])})" if run.get("budget") else ""))
    lines.append(f"  target: {target.summary()}")
    lines.append("")
    rows: List[Tuple[str, str, str]] = []
    allocated, reserved = result.get("peak_allocated_bytes"), result.get("peak_reserved_bytes")
    fits = result.get("fits")
    verdict = "yes" if fits else "NO" if fits is not None else "?"
    rows.append(("fits", verdict, ""))
    if allocated is not None:
        rows.append(("peak allocated", f"{format_bytes(allocated)}  ({_share(allocated, memory)})",
                     mark("peak_allocated_bytes")))
    if reserved is not None:
        rows.append(("peak reserved", f"{format_bytes(reserved)}  ({_share(reserved, memory)})",
                     mark("peak_reserved_bytes")))
    if result.get("minimum_bytes") is not None:
        rows.append(("smallest reachable peak", format_bytes(result["minimum_bytes"]), mark("minimum_bytes")))
        for name, nbytes in result.get("minimum_parts") or ():
            rows.append((f"  {name}", format_bytes(nbytes), mark(str(name), mark("minimum_bytes"))))
    plan = list(result.get("plan") or ())
    if plan:
        rows.append((f"plan ({len(plan)} layers)", condense_plan(plan), ""))
        rows.append(("", plan_runs(plan), ""))
    if result.get("step_s") is not None:
        step = float(result["step_s"])
        rows.append(("step time", f"{step * 1e3:.1f} ms" if step < 1 else f"{step:.3f} s", mark("step_s")))
    if result.get("bound"):
        rows.append(("bound", str(result["bound"]), mark("bound")))
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows if r[2]) if any(r[2] for r in rows) else 0
    for label, value, how in rows:
        lines.append(f"  {label.ljust(width)}  {value.ljust(value_width)}  {how}".rstrip())
    notes = list(result.get("notes") or ())
    if target.calibrated:
        notes.append("the target's rates were measured on this machine (calibrated); the step's numbers are "
                     "modelled from them unless marked measured")
    else:
        notes.append("the target's figures are published ones (sources: docs/targets.md); the step's numbers "
                     "are modelled from them")
    lines.append("")
    lines.append("notes:")
    lines.extend(f"  - {n}" for n in notes)
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (module docstring); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)  # (exits 2 on a malformed option, with argparse's message)
    if args.list_targets:
        print(list_targets(args.json))
        return 0
    if args.model is None:
        parser.error(f"give a model: a built-in configuration ({', '.join(MODEL_CONFIGS)}) or the path of a "
                     "Hugging Face config.json (or --list-targets to see the accelerators)")
    if args.seq is None:
        parser.error("give the sequence length: --seq N (tokens per sample, e.g. --seq 8192)")
    if not args.reshard_after_forward and args.fsdp == 1:
        parser.error("--no-reshard-after-forward is an FSDP2 option: add --fsdp N (N > 1) or drop it")
    if args.recipe == "plan" and args.budget is None:
        parser.error("--recipe plan needs a budget: add --budget X (e.g. --budget 70GiB)")
    if args.recipe != "plan" and args.budget is not None:
        parser.error(f"--budget is the plan recipe's budget: add --recipe plan (the recipe {args.recipe!r} "
                     "takes no budget)")
    try:
        if ":" in args.model and not os.path.exists(args.model):
            config = resolve_factory(args.model)
            label, source = config.name, args.model
        else:
            label, config, source = resolve_model(args.model)
    except ValueError as e:
        parser.error(str(e))
    layers = config.layers if isinstance(config, ModelFactory) else config.get("num_hidden_layers")
    if isinstance(layers, int) and args.pp > layers:
        parser.error(f"--pp {args.pp} is more pipeline stages than the model's {layers} layers "
                     "(give at most one stage per layer)")
    try:
        device = resolve_target(args.target)
    except ValueError as e:
        parser.error(str(e))
    budget = None
    if args.budget is not None:
        try:
            budget = parse_budget(args.budget)
        except ValueError as e:
            parser.error(f"--budget: {e}")
        if budget > device.memory_bytes:
            parser.error(f"--budget {args.budget} ({format_bytes(budget)}) is more than {device.name}'s memory "
                         f"({format_bytes(device.memory_bytes)}): lower the budget or pick a larger --target")
    max_positions = None if isinstance(config, ModelFactory) else config.get("max_position_embeddings")
    if isinstance(max_positions, int) and args.seq > max_positions:
        print(f"{_PROG}: note: --seq {args.seq} is longer than the model's max_position_embeddings "
              f"({max_positions})", file=sys.stderr)
    run = {"seq": args.seq, "batch": args.batch, "grad_accum": args.grad_accum, "precision": args.precision,
           "optimizer": args.optimizer, "dp": args.dp, "fsdp": args.fsdp,
           "reshard_after_forward": args.reshard_after_forward, "pp": args.pp, "recipe": args.recipe,
           "budget": budget}
    try:
        result = plan_for_target(config, target=device, **run)
    except ValueError as e:  # (a budget below what any plan reaches, a model the planner cannot trace, ...)
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": label, "model_source": source, "run": run, "target": device.to_json(),
                          **result}, indent=2, default=_jsonable))
    else:
        print(format_report(result, model=label, source=source, target=device, run=run))
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


if __name__ == "__main__":
    sys.exit(main())
