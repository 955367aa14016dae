"""The planner where users train: Hugging Face families from small configs with their defaults,
real training steps (an optimizer, a scheduler, gradient accumulation, autocast, a gradient
scaler, frozen layers), shapes that change, the same plan twice.

Every peak here is measured by an independent meter (``MemoryMeter(track=...)``: the live
storages of the model, its optimizer and the batch, and what the step allocates), never by the
planner's own counters; training is compared bitwise against the same training unplanned."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")

from hyper_parallel.core.activation_checkpoint import MemoryPlan, SwapManager, plan_memory  # noqa: E402
from hyper_parallel.core.backend import active_backend  # noqa: E402
from hyper_parallel.planner import Planner  # noqa: E402
from hyper_parallel.planner import candidates as cand  # noqa: E402
from hyper_parallel.planner.planner import make_plan  # noqa: E402
from hyper_parallel.tools.memory import MemoryMeter  # noqa: E402
from hyper_parallel.bench.hf_models import FAMILIES, batch, build, loss  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    SwapManager().reset()
    yield
    SwapManager().reset()


def _measured_peak(model, step, *track):
    """The peak of one ``step()`` with ``model`` (and ``track``) live, by the independent meter."""
    with MemoryMeter("cpu", track=[model, *track], scan_gc=False) as meter:
        step()
    return meter.peak_bytes


def _plans_across(model, step, fractions):
    """Plans for budgets at ``fractions`` of the way from the smallest reachable peak (measured) to
    the step's peak with nothing wrapped, from one profile: ``plan_memory``'s path (profile, probes,
    each plan checked by running it), without profiling a second time to learn the range."""

    def answer(planner, measure):
        widest = planner.plan(planner.reference_peak(), measure=measure)
        low, high = widest.min_budget_bytes, widest.reference_peak_bytes
        assert low < high, widest.report()
        budgets = [int(low + (high - low) * f) for f in fractions]
        return [planner.plan(b, measure=measure) for b in budgets]

    return [(plan.budget_bytes, plan) for plan in make_plan(model, step, answer, prober=active_backend().prober())]


# ---------------------------------------------------------------------------- every family
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_fits_three_budgets_and_trains_bitwise(family):
    base = build(family, layers=3, hidden=64)
    ids = batch(family, batch=2, seq=48, seed=1)
    model = copy.deepcopy(base)
    step = lambda: loss(model, ids).backward()  # noqa: E731
    torch.manual_seed(5)
    reference = loss(copy.deepcopy(base), ids).detach()
    for fraction, (budget, plan) in zip((0.0, 0.35, 0.75), _plans_across(model, step, (0.0, 0.35, 0.75))):
        planned = copy.deepcopy(base)
        MemoryPlan.from_json(plan.to_json(), planned).apply()

        def run():
            torch.manual_seed(5)
            out = loss(planned, ids)
            out.backward()
            return out.detach()

        run()  # (the first step allocates the pool's host buffers)
        planned.zero_grad(set_to_none=True)
        holder = []
        peak = _measured_peak(planned, lambda: holder.append(run()), *ids.values())
        assert peak <= budget, f"{family} at {fraction}: {peak} > {budget}\n{plan.report()}"
        assert abs(plan.predicted_peak_bytes - peak) <= 0.01 * peak, (plan.predicted_peak_bytes, peak)
        assert torch.equal(holder[0], reference), (family, fraction)
        SwapManager().reset()


# ---------------------------------------------------------------------------- real training steps
STEPS = {
    "adam": dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)),
    "adam_fused": dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
    "sgd_scheduler": dict(optimizer=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), scheduler=True),
    "accumulation": dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), micro_batches=2),
    "autocast": dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), autocast=True),
    "grad_scaler": dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), autocast=True, scaler=True),
    "frozen_prefix": dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), frozen="prefix"),
    "frozen_base": dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), frozen="matrices"),
}


class _Trainer:
    """A model with its optimizer (scheduler, scaler) and the step a training loop repeats."""

    def __init__(self, model, optimizer, scheduler=False, scaler=False, autocast=False, micro_batches=1):
        self.model = model
        self.opt = optimizer([p for p in model.parameters() if p.requires_grad])
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 1, gamma=0.5) if scheduler else None
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaler else None
        self.autocast = autocast
        self.micro_batches = micro_batches

    def step(self, i):
        losses = []
        for m in range(self.micro_batches):
            torch.manual_seed(1000 * i + m)
            ids = batch("llama", batch=2, seq=48, seed=100 * i + m)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                out = loss(self.model, ids) / self.micro_batches
            (self.scaler.scale(out) if self.scaler else out).backward()
            losses.append(out.detach())
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        if self.sched:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return torch.stack(losses)


def _frozen(model, how):
    if how == "prefix":  # embeddings and the first layer: a partial fine-tune, no backward there
        model.model.embed_tokens.weight.requires_grad_(False)
        model.model.layers[0].requires_grad_(False)
    elif how == "matrices":  # every weight matrix frozen, the norms trained (as adapters on a frozen base)
        for p in model.parameters():
            if p.dim() == 2:
                p.requires_grad_(False)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(STEPS))
def test_a_real_training_step_is_planned_left_as_found_and_fits(kind):
    spec = dict(STEPS[kind])
    frozen = spec.pop("frozen", None)
    base = _frozen(build("llama", layers=3, hidden=64), frozen)
    plain, planning, planned = (_Trainer(copy.deepcopy(base), **spec) for _ in range(3))
    # planned before the first step: the optimizer's state does not exist yet (made lazily)
    [(budget, plan)] = _plans_across(planning.model, lambda: planning.step(0), [1 / 3])
    assert not planning.opt.state, "planning left optimizer state behind"
    MemoryPlan.from_json(plan.to_json(), planned.model).apply()
    for i in range(3):
        expected = plain.step(i)
        assert torch.equal(planning.step(i), expected), f"{kind}: planning changed the training (step {i})"
        holder = []
        peak = _measured_peak(planned.model, lambda: holder.append(planned.step(i)), planned.opt)
        assert torch.equal(holder[0], expected), f"{kind}: the planned model trains otherwise (step {i})"
        if i > 0:  # (from the second step on the optimizer's state is there: what the plan is for)
            assert peak <= budget, f"{kind} step {i}: {peak} > {budget}\n{plan.report()}"
            assert abs(plan.predicted_peak_bytes - peak) <= 0.01 * peak, (plan.predicted_peak_bytes, peak)
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), planned.model.parameters()))


def test_a_step_that_runs_the_layers_twice_in_one_forward_is_refused_clearly():
    model = build("llama", layers=2, hidden=32)
    ids = batch("llama", batch=1, seq=8, seed=0)

    def twice():
        loss(model, ids)
        loss(model, ids).backward()

    with pytest.raises(RuntimeError, match="once per micro-batch .* then the backward"):
        plan_memory(model, twice, "8GiB")


def test_a_step_fn_taking_a_batch_needs_batches():
    model = build("llama", layers=2, hidden=32)
    with pytest.raises(TypeError, match=r"takes arguments; planning calls it with none.*batches="):
        plan_memory(model, lambda ids: loss(model, ids).backward(), "8GiB")


# ---------------------------------------------------------------------------- shapes that change
@pytest.mark.slow
def test_a_bigger_batch_warns_or_raises_and_batches_plan_for_the_largest():
    base = build("llama", layers=3, hidden=64)
    small, big = (batch("llama", batch=b, seq=48, seed=b) for b in (2, 4))
    model = copy.deepcopy(base)
    [(budget, plan)] = _plans_across(model, lambda: loss(model, small).backward(), [0.5])
    assert plan.input_shape == (2, 48, 64) and plan.covers((1, 48, 64)) and not plan.covers((4, 48, 64))
    warned = copy.deepcopy(base)
    MemoryPlan.from_json(plan.to_json(), warned).apply()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for ids in (small, big, big):
            loss(warned, ids).backward()
    messages = [str(w.message) for w in seen if "memory plan" in str(w.message)]
    assert len(messages) == 1 and "(4, 48, 64)" in messages[0] and "(2, 48, 64)" in messages[0], messages
    # (it names the peak to expect: larger than the budget for twice the batch)
    assert plan.expected_peak((4, 48, 64)) > plan.budget_bytes
    SwapManager().reset()
    strict = copy.deepcopy(base)
    MemoryPlan.from_json(plan.to_json(), strict).apply(on_new_shape="raise")
    loss(strict, small).backward()
    with pytest.raises(RuntimeError, match=r"input is \(4, 48, 64\), the plan was made for \(2, 48, 64\)"):
        loss(strict, big)
    SwapManager().reset()
    # a sample of the loader's batches: the plan is made for the largest, and fits it
    sampled = plan_memory(model, lambda ids: loss(model, ids).backward(), budget * 3 // 2, batches=[small, big, small])
    assert sampled.input_shape == (4, 48, 64) and "largest of 3 batches" in sampled.report()
    fitted = copy.deepcopy(base)
    MemoryPlan.from_json(sampled.to_json(), fitted).apply(on_new_shape="raise")
    loss(fitted, big).backward()
    fitted.zero_grad(set_to_none=True)
    assert _measured_peak(fitted, lambda: loss(fitted, big).backward(), *big.values()) <= sampled.budget_bytes


# ---------------------------------------------------------------------------- one plan
def test_times_within_noise_of_each_other_do_not_change_the_plan():
    """The choice rests on the options' times grouped within noise (``Planner.seconds``): moving
    every measured time by a twentieth of its tolerance (less than the noise its probes showed)
    gives the same plan; and the same step planned twice gives the same plan."""
    base = build("llama", layers=3, hidden=32)
    ids = batch("llama", batch=2, seq=32, seed=1)
    prober = active_backend().prober()
    _, layers = prober.find_layers(base)
    planner = Planner(layers, prober.profile_step(layers, lambda: loss(base, ids).backward()), prober)
    budget = (planner.min_budget()[0] + planner.reference_peak()) // 2
    chosen = [c.option for c in planner.plan(budget).choices]
    measured = {k: e.seconds for k, e in planner.effects.items()}
    rng = torch.Generator().manual_seed(0)
    for _ in range(3):
        for (key, option), effect in planner.effects.items():
            if option.kind != "none":
                shift = (float(torch.rand(1, generator=rng)) - 0.5) * planner.tolerance(key) / 10
                effect.seconds = max(0.0, measured[(key, option)] + shift)
        assert [c.option for c in planner.plan(budget).choices] == chosen
    # an option plus swapping its inputs, measured faster than the option by far more than the
    # noise, costs the option's time: the two tie, and the one listed first is chosen
    key = next(iter(planner.options))
    rec, rec_in = (next(o for o in planner.options[key] if o == x) for x in (cand.RECOMPUTE, cand.RECOMPUTE_SWAP_INPUTS))
    planner.effects[(key, rec)].seconds = 1.0
    planner.effects[(key, rec_in)].seconds = 0.5
    planner._derived.clear()
    assert planner.seconds(key, rec_in) == planner.seconds(key, rec) == 1.0
    planner.effects[(key, rec_in)].seconds = 2.0
    planner._derived.clear()
    assert planner.seconds(key, rec_in) == 2.0 and planner.seconds(key, rec) == 1.0


@pytest.mark.slow
@pytest.mark.timing
def test_the_same_step_planned_twice_gives_the_same_plan():
    base = build("llama", layers=3, hidden=64)
    ids = batch("llama", batch=2, seq=48, seed=1)
    first = plan_memory(base, lambda: loss(base, ids).backward(), "8GiB")
    for fraction in (0.3, 0.7):
        budget = int(first.min_budget_bytes + (first.reference_peak_bytes - first.min_budget_bytes) * fraction)
        plans = [plan_memory(base, lambda: loss(base, ids).backward(), budget) for _ in range(2)]
        assert plans[0].to_json() != "" and [c.option for c in plans[0].choices] == [c.option for c in plans[1].choices], \
            "\n".join(p.report() for p in plans)
