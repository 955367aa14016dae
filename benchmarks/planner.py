"""The memory planner against every fixed recipe and PyTorch's eager sac_ilp, budget by budget (issue 27).

For each model (the bench GPT, a 16-layer post-LN transformer with ``nn.MultiheadAttention`` and a
ReLU feed-forward block, a Hugging Face Llama built from a config), the planner profiles the step
once (``step_fn`` = forward + backward of one batch; it calls it twice) and plans ``--budgets``
budgets spread from its smallest reachable peak to the step's peak with nothing wrapped. Every plan,
the fixed recipes (``none``, ``torch_ckpt``: full recompute, ``torch_sac``: PyTorch's selective
checkpoint saving the matmuls, ``ours_swap_wrapper``: swap_wrapper + the layer chain,
``ours_ckpt_swap``: MUST_SWAP for the matmuls + swap_inputs + the chain) and, with ``pulp``
installed, PyTorch's ``sac_ilp`` plan at each budget then train side by side in one process on the
shared runner (``hyper_parallel.bench.runner``: a copy of one model each, interleaved rounds).

Measured, per row: the peak of forward + backward (the quantity a budget bounds: the model's
parameters and buffers plus what the step allocates; the CPU ``MemoryMeter`` counts live storages,
host copies excluded; an accelerator's allocator its own counters) and the median forward +
backward time; per plan also its budget, the prediction and the error. The checks printed at the
end are the issue's targets: every measured peak within its budget; the plan's time non-increasing
with the budget (3% noise) and within 1.03x of the fastest recipe or sac_ilp plan whose measured
peak fits; at the no-checkpoint peak within 1.03x of ``none``; predicted time within 10% and peak
within 5%; solving under 2 s for 32 layers; losses and last gradients bitwise equal to ``none``.

Run::

    python benchmarks/planner.py                           # three models, 8 budgets each, CPU
    python benchmarks/planner.py --models gpt --budgets 4 --plot planner.png --json planner.json
    python benchmarks/planner.py --device cuda
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
from torch import nn  # noqa: E402

from hyper_parallel.bench import report, runner  # noqa: E402
from hyper_parallel.bench.model import GPT, GPTConfig, make_batch  # noqa: E402
from hyper_parallel.bench.modes import RECIPES, Recipe  # noqa: E402
from hyper_parallel.bench.postln import PostLNConfig, PostLNTransformer  # noqa: E402
from hyper_parallel.bench.report import MiB, fmt  # noqa: E402
from hyper_parallel.bench.sac_ilp import profile_sac_ilp, sac_ilp_available, sac_ilp_recipe  # noqa: E402
from hyper_parallel.core.activation_checkpoint import MemoryPlan, SwapManager  # noqa: E402
from hyper_parallel.planner import Planner, active_prober, format_bytes, solver  # noqa: E402

FIXED = ("none", "torch_ckpt", "torch_sac", "ours_swap_wrapper", "ours_ckpt_swap")
NOISE = 1.03


# ------------------------------------------------------------------------------ the models
class LlamaLM(nn.Module):
    """A Hugging Face ``LlamaForCausalLM`` from a small config, called as the runner calls a model
    (``loss = model(tokens, targets)``), its decoder layers as ``.layers``."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int, seed: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM  # (optional: the hf extra)

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=int(2.75 * dim),
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                          max_position_embeddings=seq, attn_implementation="sdpa")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.lm = LlamaForCausalLM(cfg)
        self.layers = self.lm.model.layers

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=tokens, use_cache=False).logits
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build(name: str, args: argparse.Namespace, device: torch.device) -> Tuple[nn.Module, Callable[[int], tuple]]:
    """The model ``name`` on ``device`` and its batches (``batches(i)``: step ``i``'s)."""
    if name == "gpt":
        cfg = GPTConfig(layers=args.gpt_layers, dim=args.gpt_dim, heads=4, seq=args.seq, vocab=512, dropout=0.1)
        model: nn.Module = GPT(cfg, seed=args.seed)
    elif name == "postln":
        cfg = PostLNConfig(layers=args.postln_layers, dim=args.postln_dim, heads=4, seq=args.seq, vocab=512)
        model = PostLNTransformer(cfg, seed=args.seed)
    elif name == "llama":
        cfg = GPTConfig(layers=args.llama_layers, dim=args.llama_dim, heads=4, seq=args.seq, vocab=512)
        model = LlamaLM(cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq, args.seed)
    else:
        raise ValueError(f"unknown model {name!r}; choose from gpt, postln, llama")
    model.to(device)
    return model, lambda i: make_batch(cfg, args.batch, args.seed + i, device=device)


# ------------------------------------------------------------------------------ planning
def plan_budgets(model: nn.Module, batches: Callable[[int], tuple], count: int, device: torch.device
                 ) -> Tuple[List[MemoryPlan], Dict[str, Any]]:
    """Profile a copy of ``model`` once and plan ``count`` budgets from the smallest reachable
    peak to the step's peak with nothing wrapped; what planning cost."""
    profiled = copy.deepcopy(model)
    batch = batches(0)
    calls = [0]

    def step_fn() -> None:
        calls[0] += 1
        profiled(*batch).backward()

    prober = active_prober()
    t0 = time.perf_counter()
    profile = prober.profile_step(list(profiled.layers), step_fn)
    t1 = time.perf_counter()
    planner = Planner(list(profiled.layers), profile, prober)
    minimum = planner.min_budget()[0]
    reference = planner.reference_peak()
    budgets = [int(minimum + (reference - minimum) * k / max(1, count - 1)) for k in range(count)]
    plans = [planner.plan(b) for b in budgets]
    t2 = time.perf_counter()
    problem, _ = planner._problem()
    t3 = time.perf_counter()
    for b in budgets:  # every option is measured by now: this is the solving alone
        solver.solve(problem, b)
    solve_s = (time.perf_counter() - t3) / len(budgets)
    cost = {"step_fn_calls": calls[0], "profile_s": t1 - t0, "probe_and_plan_s": t2 - t1, "probes": planner.probes,
            "solve_s_per_budget": solve_s, "layers": len(profiled.layers), "min_budget_bytes": minimum,
            "reference_peak_bytes": reference, "layer_types": len(profile.types)}
    return plans, cost


def solve_time_32(device: torch.device, args: argparse.Namespace) -> float:
    """Seconds to solve one budget for a 32-layer stack (a GPT of the benchmark's width, profiled
    and probed first: only the programme is timed)."""
    model, batches = build("gpt", argparse.Namespace(**{**vars(args), "gpt_layers": 32, "seq": 64}), device)
    batch = batches(0)
    prober = active_prober()
    profile = prober.profile_step(list(model.layers), lambda: model(*batch).backward())
    planner = Planner(list(model.layers), profile, prober)
    minimum = planner.min_budget()[0]
    budget = (minimum + planner.reference_peak()) // 2
    planner.plan(budget)  # (probes what it uses)
    problem, _ = planner._problem()
    t0 = time.perf_counter()
    solver.solve(problem, budget)
    return time.perf_counter() - t0


def plan_recipe(plan: MemoryPlan, name: str) -> Recipe:
    text = plan.to_json()

    def apply(model: nn.Module, device: torch.device, threshold: Optional[int]) -> None:
        MemoryPlan.from_json(text, list(model.layers)).apply()

    return Recipe(name, "ours", f"plan_memory at {format_bytes(plan.budget_bytes)}", apply, offloads=plan.swaps)


def sac_ilp_recipes(model: nn.Module, batches: Callable[[int], tuple], budgets: List[int],
                    log: Callable[[str], None]) -> Dict[str, Recipe]:
    """PyTorch's sac_ilp plan at each budget, as recipes, from one profile of the model (none
    without ``pulp``: ``pip install -e '.[sac]'``). Its budget counts the model's parameters and
    buffers as the runner's meter does (``baseline_bytes``); a budget below its own minimum is
    skipped with that minimum."""
    ok, why = sac_ilp_available()
    if not ok:
        log(f"sac_ilp: skipped ({why})")
        return {}
    t0 = time.perf_counter()
    profile = profile_sac_ilp(model, batches(0))
    log(f"sac_ilp: profiled in {time.perf_counter() - t0:.1f} s")
    static = runner.module_bytes(model)
    return {f"sac_ilp@{k}": sac_ilp_recipe(b, batches(0), profile=profile, name=f"sac_ilp@{k}", baseline_bytes=static)
            for k, b in enumerate(budgets)}


# ------------------------------------------------------------------------------ one model
def run_model(name: str, args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    model, batches = build(name, args, device)
    print(f"\n== {name}: {len(model.layers)} layers, batch {args.batch}, seq {args.seq}")
    plans, cost = plan_budgets(model, batches, args.budgets, device)
    print(f"planning: {cost['step_fn_calls']} step_fn calls, profile {cost['profile_s']:.1f} s, "
          f"{cost['probes']} probes + {len(plans)} plans {cost['probe_and_plan_s']:.1f} s, "
          f"solving {cost['solve_s_per_budget'] * 1e3:.0f} ms per budget")
    recipes: Dict[str, Recipe] = {n: RECIPES[n] for n in FIXED}
    for k, plan in enumerate(plans):
        recipes[f"plan@{k}"] = plan_recipe(plan, f"plan@{k}")
    sac = sac_ilp_recipes(model, batches, [p.budget_bytes for p in plans], print) if args.sac_ilp else {}
    recipes.update(sac)
    SwapManager().reset()
    result = runner.run_variants(list(recipes), batch=args.batch, device=device, rounds=args.rounds, warmup=1,
                                 lr=1e-3, seed=args.seed, base_model=model, batches=batches, recipes=recipes)
    rows: Dict[str, Dict[str, Any]] = {}
    for n, v in result.variants.items():
        row = runner.summarize(v, recipes)
        row["fwd_bwd_peak_bytes"] = max(v.phases[p]["peak"] for p in ("forward", "backward"))
        rows[n] = row
    for k, plan in enumerate(plans):
        row = rows.get(f"plan@{k}")
        if row is not None:
            row.update(budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                       predicted_step_s=plan.predicted_step_s, lower_bound_step_s=plan.lower_bound_step_s,
                       options=[c.option.name() for c in plan.choices])
    for k, key in enumerate(sorted(sac)):
        if key in rows:
            rows[key]["budget_bytes"] = plans[int(key.split("@")[1])].budget_bytes
    checks = check(rows, plans, cost)
    print_table(rows)
    for line in checks["lines"]:
        print(line)
    return {"model": name, "planning": cost, "rows": rows, "skipped": result.skipped, "errors": result.errors,
            "checks": checks["passed"]}


def check(rows: Dict[str, Dict[str, Any]], plans: List[MemoryPlan], cost: Dict[str, Any]) -> Dict[str, Any]:
    """The issue's targets, row by row."""
    lines, passed = [], {}
    planned = [(k, rows[f"plan@{k}"]) for k in range(len(plans)) if f"plan@{k}" in rows]
    fixed = {n: r for n, r in rows.items() if not n.startswith("plan@")}

    def verdict(name: str, ok: bool, detail: str) -> None:
        passed[name] = ok
        lines.append(f"  [{'ok' if ok else 'MISS'}] {name}: {detail}")

    over = [(k, r) for k, r in planned if r["fwd_bwd_peak_bytes"] > r["budget_bytes"]]
    verdict("peak within budget", not over,
            "every plan" if not over else ", ".join(f"plan@{k} {fmt(r['fwd_bwd_peak_bytes'] / MiB)} > "
                                                    f"{fmt(r['budget_bytes'] / MiB)} MiB" for k, r in over))
    times = [r["step_time_s"] for _, r in planned]
    monotone = all(b <= a * NOISE for a, b in zip(times, times[1:]))
    verdict("time non-increasing in the budget", monotone, " ".join(f"{t * 1e3:.1f}" for t in times) + " ms")
    slow = []
    for k, r in planned:
        fits = [(n, f["step_time_s"]) for n, f in fixed.items() if f["fwd_bwd_peak_bytes"] <= r["budget_bytes"]]
        if fits:
            best_n, best_t = min(fits, key=lambda x: x[1])
            ratio = r["step_time_s"] / best_t
            r["vs_fastest_fitting"] = {"name": best_n, "ratio": ratio}
            if ratio > NOISE:
                slow.append(f"plan@{k} {ratio:.2f}x {best_n}")
    verdict("<= 1.03x the fastest fitting recipe / sac_ilp plan", not slow, ", ".join(slow) or "at every budget")
    if planned and "none" in rows:
        top = planned[-1][1]["step_time_s"] / rows["none"]["step_time_s"]
        verdict("at the no-checkpoint peak <= 1.03x none", top <= NOISE, f"{top:.3f}x")
    t_err = [abs(r["predicted_step_s"] / r["step_time_s"] - 1) for _, r in planned]
    p_err = [abs(r["predicted_peak_bytes"] / r["fwd_bwd_peak_bytes"] - 1) for _, r in planned]
    verdict("predicted time within 10%", max(t_err, default=0) <= 0.10, f"worst {100 * max(t_err, default=0):.1f}%")
    verdict("predicted peak within 5%", max(p_err, default=0) <= 0.05, f"worst {100 * max(p_err, default=0):.1f}%")
    verdict("profiling <= 2 step_fn calls", cost["step_fn_calls"] <= 2, f"{cost['step_fn_calls']}")
    exact = [n for n, r in rows.items() if r.get("grads_equal_to_none") is False]
    losses = rows.get("none", {}).get("losses")
    diverged = [n for n, r in rows.items() if losses is not None and r["losses"] != losses]
    verdict("losses and gradients bitwise equal to none", not exact and not diverged,
            ", ".join(exact + diverged) or "every row")
    return {"lines": lines, "passed": passed}


def print_table(rows: Dict[str, Dict[str, Any]]) -> None:
    header = ("row", "budget MiB", "peak MiB", "pred MiB", "err", "step ms", "pred ms", "err", "lower ms", "options")
    table = []
    for n, r in rows.items():
        budget = r.get("budget_bytes")
        pred, pt = r.get("predicted_peak_bytes"), r.get("predicted_step_s")
        opts = r.get("options")
        table.append((n, fmt(budget / MiB) if budget else "", fmt(r["fwd_bwd_peak_bytes"] / MiB),
                      fmt(pred / MiB) if pred else "",
                      f"{100 * (pred / r['fwd_bwd_peak_bytes'] - 1):+.1f}%" if pred else "",
                      fmt(r["step_time_s"] * 1e3), fmt(pt * 1e3) if pt else "",
                      f"{100 * (pt / r['step_time_s'] - 1):+.1f}%" if pt else "",
                      fmt(r["lower_bound_step_s"] * 1e3) if r.get("lower_bound_step_s") else "",
                      _options(opts) if opts else r["description"][:48]))
    print(report.table(header, table, "lrrrrrrrrl"))


def _options(names: List[str]) -> str:
    counts: Dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"{c}x {n}" for n, c in counts.items())


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt,postln,llama", help="comma-separated: gpt, postln, llama")
    ap.add_argument("--budgets", type=int, default=8, help="budgets per model (default 8)")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per row (default 5)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--gpt-layers", type=int, default=8)
    ap.add_argument("--gpt-dim", type=int, default=128)
    ap.add_argument("--postln-layers", type=int, default=16)
    ap.add_argument("--postln-dim", type=int, default=128)
    ap.add_argument("--llama-layers", type=int, default=8)
    ap.add_argument("--llama-dim", type=int, default=128)
    ap.add_argument("--no-sac-ilp", dest="sac_ilp", action="store_false", help="leave PyTorch's sac_ilp out")
    ap.add_argument("--no-solve-32", dest="solve_32", action="store_false", help="skip the 32-layer solve timing")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: steadier on a shared CPU)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG of step time against measured peak (needs matplotlib)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.plot:
        ok, why = report.have_matplotlib()
        if not ok:
            ap.error(f"--plot needs matplotlib: {why}")
    torch.set_num_threads(args.threads)
    doc: Dict[str, Any] = {"environment": report.environment(device), "models": []}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        doc["models"].append(run_model(name, args, device))
        SwapManager().reset()
    if args.solve_32:
        doc["solve_32_layers_s"] = solve_time_32(device, args)
        print(f"\nsolving one budget for 32 layers: {doc['solve_32_layers_s'] * 1e3:.0f} ms "
              f"[{'ok' if doc['solve_32_layers_s'] < 2 else 'MISS'}: < 2 s]")
    if args.json:
        report.write_json(args.json, doc)
    if args.plot:
        report.pareto_chart(args.plot, doc["models"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
