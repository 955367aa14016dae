"""The memory planner against every fixed recipe and PyTorch's eager sac_ilp, budget by budget.

Models (``--models``, default all): the bench GPT, a post-LN ``nn.MultiheadAttention`` transformer and Hugging Face
models from small configs in code (no download), trained as their users run them (train mode, the config's defaults,
``model(input_ids=..., labels=...).loss.backward()``): Llama, Mistral (sliding window), Phi-3 (fused qkv and gate_up),
Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, GPT-2 and the encoder BERT (masked-LM head). Per model the planner profiles the step
once and plans ``--budgets`` budgets from its smallest reachable peak to the unwrapped peak; every plan, the ``FIXED``
recipes and PyTorch's ``sac_ilp`` plans (``torch_sac_ilp.py``) train side by side on the benchmark harness. The checks
and the summary line of each model are printed after its table.

Run::

    python benchmarks/planner.py                           # every model, 8 budgets each, CPU
    python benchmarks/planner.py --models llama,phi3 --budgets 4
    python benchmarks/planner.py --models gpt --plot planner.png --json planner.json
"""

from __future__ import annotations

import collections
import copy
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
from torch import nn  # noqa: E402

from hyper_parallel.bench import harness, report  # noqa: E402
from hyper_parallel.bench.model import GPT, GPTConfig, make_batch  # noqa: E402
from hyper_parallel.bench.modes import RECIPES, Recipe, layer_stack  # noqa: E402
from hyper_parallel.bench.postln import PostLNConfig, PostLNTransformer  # noqa: E402
from hyper_parallel.bench.report import MiB, fmt  # noqa: E402
from hyper_parallel.bench import hf_models  # noqa: E402
from hyper_parallel.core.activation_checkpoint import MemoryPlan, SwapManager, plan_memory  # noqa: E402
from hyper_parallel.planner import format_bytes  # noqa: E402

FIXED = ("none", "torch_ckpt", "torch_sac", "ours_swap_wrapper", "ours_ckpt_swap")
NOISE = 1.03
VOCAB = 512
MODELS = ("gpt", "postln") + tuple(hf_models.FAMILIES)


def build(name: str, args, device: torch.device) -> Tuple[nn.Module, Callable[[int], Any]]:
    """The model ``name`` on ``device`` and its batches (``batches(i)``: step ``i``'s)."""
    if name in hf_models.FAMILIES:
        model = hf_models.build(name, layers=args.hf_layers, hidden=args.hf_dim, seed=args.seed).to(device)
        return model, lambda i: hf_models.batch(name, batch=args.batch, seq=args.seq, seed=args.seed + i, device=device)
    if name == "gpt":
        cfg = GPTConfig(layers=args.gpt_layers, dim=args.gpt_dim, heads=4, seq=args.seq, vocab=VOCAB, dropout=0.1)
        model: nn.Module = GPT(cfg, seed=args.seed)
    else:  # (main checked the names)
        cfg = PostLNConfig(layers=args.postln_layers, dim=args.postln_dim, heads=4, seq=args.seq, vocab=VOCAB)
        model = PostLNTransformer(cfg, seed=args.seed)
    return model.to(device), lambda i: make_batch(cfg, args.batch, args.seed + i, device=device)


def plan_budgets(model: nn.Module, batches: Callable[[int], Any], count: int) -> Tuple[List[MemoryPlan], Dict]:
    """Plan ``count`` budgets from the smallest reachable peak to the step's peak with nothing wrapped (one profile of
    a copy of ``model`` for the range, one for the plans), as users do: ``plan_memory``; what planning cost."""
    profiled = copy.deepcopy(model)
    batch, calls = batches(0), [0]

    def step_fn() -> None:
        calls[0] += 1
        harness.forward_loss(profiled, batch).backward()

    t0 = time.perf_counter()
    first = plan_memory(profiled, step_fn, 1 << 50)
    t1 = time.perf_counter()
    minimum, reference = first.min_budget_bytes, first.reference_peak_bytes
    budgets = [int(minimum + (reference - minimum) * k / max(1, count - 1)) for k in range(count)]
    plans = plan_memory(profiled, step_fn, budgets)
    t2 = time.perf_counter()
    return plans, {"step_fn_calls": calls[0], "range_s": t1 - t0, "plans_s": t2 - t1,
                   "probes": sum(p.probes for p in plans[:1]), "layers": len(plans[0].choices),
                   "min_budget_bytes": minimum, "reference_peak_bytes": reference}


def plan_recipe(plan: MemoryPlan, name: str) -> Recipe:
    text = plan.to_json()

    def apply(model: nn.Module, device: torch.device, threshold: Optional[int]) -> None:
        MemoryPlan.from_json(text, model).apply()  # (the model: a Hugging Face one turns its cache off above)

    return Recipe(name, "ours", f"plan_memory at {format_bytes(plan.budget_bytes)}", apply, offloads=plan.swaps)


def sac_ilp_recipes(model: nn.Module, batches: Callable[[int], Any], budgets: List[int]) -> Dict[str, Recipe]:
    """PyTorch's sac_ilp plan at each budget as recipes, from one profile (none without the ``sac`` extra); its budget
    counts parameters and buffers as the harness's meter does; a budget below its minimum is skipped with it."""
    from torch_sac_ilp import SacIlpUnavailable, profile_sac_ilp, sac_ilp_recipe

    t0 = time.perf_counter()
    try:
        profile = profile_sac_ilp(model, batches(0))
    except SacIlpUnavailable as exc:
        print(f"sac_ilp: skipped ({exc.reason})")
        return {}
    print(f"sac_ilp: profiled in {time.perf_counter() - t0:.1f} s")
    static = harness.module_bytes(model)
    return {f"sac_ilp@{k}": sac_ilp_recipe(b, batches(0), profile=profile, name=f"sac_ilp@{k}", baseline_bytes=static)
            for k, b in enumerate(budgets)}


def run_model(name: str, args, device: torch.device) -> Dict[str, Any]:
    model, batches = build(name, args, device)
    print(f"\n== {name} ({type(model).__name__}): {len(layer_stack(model))} layers, batch {args.batch}, seq {args.seq}")
    plans, cost = plan_budgets(model, batches, args.budgets)
    print(f"planning: the range in {cost['range_s']:.1f} s, {len(plans)} plans in {cost['plans_s']:.1f} s "
          f"({cost['probes']} probes, {cost['step_fn_calls']} step_fn calls in all, each plan checked by running it)")
    recipes: Dict[str, Recipe] = {n: RECIPES[n] for n in FIXED}
    recipes.update({f"plan@{k}": plan_recipe(plan, f"plan@{k}") for k, plan in enumerate(plans)})
    sac = sac_ilp_recipes(model, batches, [p.budget_bytes for p in plans]) if args.sac_ilp else {}
    recipes.update(sac)
    SwapManager().reset()
    result = harness.run_variants(list(recipes), device=device, rounds=args.rounds, warmup=1, lr=1e-3, seed=args.seed,
                                  base_model=model, batches=batches, recipes=recipes)
    rows: Dict[str, Dict[str, Any]] = {}
    for n, v in result.variants.items():
        rows[n] = harness.summarize(v, recipes)
        rows[n]["fwd_bwd_peak_bytes"] = max(v.phases[p]["peak"] for p in ("forward", "backward"))
    for k, plan in enumerate(plans):
        if f"plan@{k}" in rows:
            rows[f"plan@{k}"].update(budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                                     predicted_step_s=plan.predicted_step_s, lower_bound_step_s=plan.lower_bound_step_s,
                                     options=[c.option.name() for c in plan.choices])
    for key in sac:
        if key in rows:
            rows[key]["budget_bytes"] = plans[int(key.split("@")[1])].budget_bytes
    checks = check(rows, len(plans), cost)
    print_table(rows)
    for line in checks["lines"]:
        print(line)
    return {"model": name, "planning": cost, "rows": rows, "skipped": result.skipped, "errors": result.errors,
            "checks": checks["passed"], "summary": checks["summary"]}


def check(rows: Dict[str, Dict[str, Any]], count: int, cost: Dict[str, Any]) -> Dict[str, Any]:
    """The targets, row by row, and the model's line of the summary."""
    planned = [(k, rows[f"plan@{k}"]) for k in range(count) if f"plan@{k}" in rows]
    others = {n: r for n, r in rows.items() if not n.startswith("plan@")}

    def fastest_fitting(r: Dict[str, Any], names) -> Tuple[str, float]:
        return min(((n, others[n]["step_time_s"]) for n in names if n in others
                    and others[n]["fwd_bwd_peak_bytes"] <= r["budget_bytes"]), key=lambda x: x[1], default=(None, None))

    over = [f"plan@{k} {fmt(r['fwd_bwd_peak_bytes'] / MiB)} > {fmt(r['budget_bytes'] / MiB)} MiB" for k, r in planned
            if r["fwd_bwd_peak_bytes"] > r["budget_bytes"]]
    times = [r["step_time_s"] for _, r in planned]
    slow, vs_fixed = [], []
    for k, r in planned:
        name, best = fastest_fitting(r, others)
        if name:
            r["vs_fastest_fitting"] = {"name": name, "ratio": r["step_time_s"] / best}
            slow += [f"plan@{k} {r['step_time_s'] / best:.2f}x {name}"] if r["step_time_s"] / best > NOISE else []
        name, best = fastest_fitting(r, FIXED)
        vs_fixed += [r["step_time_s"] / best] if name else []
    top = planned[-1][1]["step_time_s"] / rows["none"]["step_time_s"] if planned and "none" in rows else None
    t_err = [r["predicted_step_s"] / r["step_time_s"] - 1 for _, r in planned]
    p_err = [r["predicted_peak_bytes"] / r["fwd_bwd_peak_bytes"] - 1 for _, r in planned]
    worst_t, worst_p = max(map(abs, t_err), default=0), max(map(abs, p_err), default=0)
    losses = rows.get("none", {}).get("losses")
    differ = [n for n, r in rows.items() if r.get("grads_equal_to_none") is False
              or (losses is not None and r["losses"] != losses)]
    verdicts = [("peak within budget", not over, ", ".join(over) or "every plan"),
                ("time non-increasing in the budget", all(b <= a * NOISE for a, b in zip(times, times[1:])),
                 " ".join(f"{t * 1e3:.1f}" for t in times) + " ms"),
                ("<= 1.03x the fastest fitting recipe / sac_ilp plan", not slow, ", ".join(slow) or "at every budget"),
                ("at the no-checkpoint peak <= 1.03x none", top is not None and top <= NOISE, f"{top or 0:.3f}x"),
                ("predicted time within 10%", worst_t <= 0.10, f"worst {100 * worst_t:.1f}%"),
                ("predicted peak within 5%", worst_p <= 0.05, f"worst {100 * worst_p:.1f}%"),
                ("losses and gradients bitwise equal to none", not differ, ", ".join(differ) or "every row")]
    summary = {"within": len(planned) - len(over), "plans": len(planned), "peak_error": max(p_err, key=abs, default=0),
               "time_error": max(t_err, key=abs, default=0), "bitwise": not differ,
               "vs_fixed": (min(vs_fixed), max(vs_fixed)) if vs_fixed else None}
    return {"lines": [f"  [{'ok' if ok else 'MISS'}] {name}: {detail}" for name, ok, detail in verdicts],
            "passed": {name: ok for name, ok, _ in verdicts}, "summary": summary}


def print_table(rows: Dict[str, Dict[str, Any]]) -> None:
    table = []
    for n, r in rows.items():
        budget, pred, pt, opts = (r.get(k) for k in ("budget_bytes", "predicted_peak_bytes", "predicted_step_s",
                                                     "options"))
        counts = collections.Counter(opts or ())
        table.append((n, fmt(budget / MiB) if budget else "", fmt(r["fwd_bwd_peak_bytes"] / MiB),
                      fmt(pred / MiB) if pred else "",
                      f"{100 * (pred / r['fwd_bwd_peak_bytes'] - 1):+.1f}%" if pred else "",
                      fmt(r["step_time_s"] * 1e3), fmt(pt * 1e3) if pt else "",
                      f"{100 * (pt / r['step_time_s'] - 1):+.1f}%" if pt else "",
                      fmt(r["lower_bound_step_s"] * 1e3) if r.get("lower_bound_step_s") else "",
                      ", ".join(f"{c}x {o}" for o, c in counts.items()) if opts else r["description"][:48]))
    print(report.table(("row", "budget MiB", "peak MiB", "pred MiB", "err", "step ms", "pred ms", "err", "lower ms",
                        "options"), table, "lrrrrrrrrl"))


def print_summary(models: List[Dict[str, Any]]) -> None:
    """One line per model: the table the docs quote."""
    rows = []
    for m in models:
        s = m["summary"]
        rows.append([m["model"], f"{s['within']} of {s['plans']}", f"{100 * s['peak_error']:+.1f}%",
                     f"{100 * s['time_error']:+.1f}%",
                     "-" if s["vs_fixed"] is None else "%.2f-%.2fx" % s["vs_fixed"], "yes" if s["bitwise"] else "NO"])
    print("\nsummary: plans within budget (measured); worst prediction errors, predicted / measured - 1; plan step "
          "time / the fastest fixed recipe whose peak fits its budget; every row bitwise like none")
    print(report.table(["model", "within budget", "peak error", "time error", "plan / best fitting fixed",
                        "bitwise"], rows, "llrrrl"))


def main(argv: Optional[List[str]] = None) -> int:
    ap = report.script_parser(__doc__)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, default all: {', '.join(MODELS)}")
    ap.add_argument("--budgets", type=int, default=8, help="budgets per model (default 8)")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per row (default 5)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    for name, layers, dim in (("gpt", 8, 128), ("postln", 16, 128)):
        ap.add_argument(f"--{name}-layers", type=int, default=layers)
        ap.add_argument(f"--{name}-dim", type=int, default=dim)
    ap.add_argument("--hf-layers", "--llama-layers", type=int, default=8, help="Hugging Face models' layers")
    ap.add_argument("--hf-dim", "--llama-dim", type=int, default=128, help="Hugging Face models' width")
    ap.add_argument("--no-sac-ilp", dest="sac_ilp", action="store_false", help="leave PyTorch's sac_ilp out")
    ap.add_argument("--no-deep", dest="deep", action="store_false", help="skip planning a 32-layer GPT (its time)")
    ap.add_argument("--plot", default=None, help="PNG of step time against measured peak (needs matplotlib)")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.budgets < 1 or args.hf_dim % 4:
        ap.error("--budgets must be >= 1 and --hf-dim a multiple of the 4 heads")
    if args.plot and not report.have_matplotlib()[0]:
        ap.error(f"--plot needs matplotlib: {report.have_matplotlib()[1]}")
    device, _ = report.script_setup(args, ap)
    doc: Dict[str, Any] = {"environment": report.environment(device), "models": []}
    for name in names:
        doc["models"].append(run_model(name, args, device))
        SwapManager().reset()
    print_summary(doc["models"])
    if args.deep:  # (planning three budgets for a 32-layer GPT of the benchmark's width, everything included)
        deep = copy.copy(args)
        deep.gpt_layers, deep.seq = 32, 64
        cost = plan_budgets(*build("gpt", deep, device), 3)[1]
        doc["plan_32_layers_s"] = cost["range_s"] + cost["plans_s"]
        print(f"\nplanning 3 budgets for 32 layers: {doc['plan_32_layers_s']:.1f} s, {cost['step_fn_calls']} step_fn calls")
    if args.json:
        report.write_json(args.json, doc)
    if args.plot:
        report.pareto_chart(args.plot, doc["models"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
