"""PyTorch's eager sac_ilp as a peer of the planner benchmark (benchmarks/torch_sac_ilp.py): its plans
on a tiny GPT checkpoint more at a tight budget than at a loose one, fit its own bound, train bitwise
equal to the unwrapped model (dropout on), and say why when they cannot be made (pulp or pwlf missing,
a budget below its minimum, the roofline on a CPU). The pieces that make it apply cleanly (the
op-replaying policy, recomputing mutated tensors) are tested without pulp. Where the ``sac`` extra is
not installed the tests that solve are skipped with the reason (pip install -e '.[sac]')."""

import copy
import os
import sys

import pytest
import torch

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch, train_steps
from hyper_parallel.tools.memory import MemoryMeter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from torch_sac_ilp import (OpMatch, SacIlpInfeasible, SacIlpPolicy, SacIlpUnavailable,  # noqa: E402
                           _recompute_mutated, profile_sac_ilp, sac_ilp_available, sac_ilp_recipe)

AVAILABLE, REASON = sac_ilp_available()
needs_sac = pytest.mark.skipif(not AVAILABLE, reason=REASON or "sac_ilp available")
P = torch.utils.checkpoint.CheckpointPolicy
aten = torch.ops.aten
CFG = GPTConfig(layers=4, dim=64, heads=4, seq=64, vocab=128, dropout=0.1)
BATCH = 2


class _Ctx:
    is_recompute = False


# ------------------------------------------------------------------------------ pieces (no pulp needed)
def test_policy_replays_decisions_realigns_and_recomputes_the_unknown():
    match = OpMatch()
    skip = {aten.clone.default}
    policy = SacIlpPolicy(["addmm", "relu", "view", "where", "bmm", "native_dropout", "addmm"],
                          [1, 0, 0, 0, 1, 0, 1], skip, match, random_save=0)
    a = torch.ones(2, 2)
    calls = [(aten.addmm.default, P.PREFER_SAVE), (aten.clone.default, P.MUST_RECOMPUTE),  # skipped, not counted
             (aten.relu.default, P.MUST_RECOMPUTE),
             (aten.bmm.default, P.PREFER_SAVE),           # "view", "where" did not run: realigned
             (aten.sin.default, P.MUST_RECOMPUTE),        # never recorded: recomputed, count unchanged
             (aten.native_dropout.default, P.MUST_RECOMPUTE),
             (aten.bernoulli.default, P.MUST_RECOMPUTE),  # an unrecorded random op: the module's random choice
             (aten.addmm.default, P.PREFER_SAVE)]
    assert [policy(_Ctx(), op, a) for op, _ in calls] == [want for _, want in calls]
    assert (match.matched, match.realigned, match.unmatched) == (4, 1, 2)
    saving = SacIlpPolicy(["native_dropout"], [1], skip, OpMatch(), random_save=1)
    assert saving(_Ctx(), aten.bernoulli.default, a) is P.PREFER_SAVE


def _stats(force_store_random=False):
    from torch.distributed._tools.sac_estimator import SACEstimator, SACStats

    # addmm, empty_like -> bernoulli_ -> div_ (dropout as decomposed), mul, native_dropout, addmm
    stats = SACStats(func_names=["addmm", "empty_like", "bernoulli_", "div_", "mul", "native_dropout", "addmm"],
                     runtimes=[5, 1, 2, 1, 1, 2, 5], memory=[100, 100, 0, 0, 100, 100, 0], view_like_ops=[],
                     rand_ops=[2, 5], saved_autograd_ops=[], inplace_ops=[(2, 1), (3, 1)],
                     force_store_random=force_store_random)
    return stats, SACEstimator()._get_greedy_order_meta(stats)


def test_a_saved_tensor_mutated_later_is_recomputed_with_every_random_op():
    stats, meta = _stats()
    save, forced, mutable = _recompute_mutated(stats, meta, [1, 1, 1, 1, 1, 1, 1])
    # the dropout group (empty_like, bernoulli_, div_) and the other random op go; the rest stay saved
    assert save == [1, 0, 0, 0, 1, 0, 1] and forced == 4 and not mutable
    assert _recompute_mutated(stats, meta, [1, 0, 0, 0, 1, 0, 1]) == ([1, 0, 0, 0, 1, 0, 1], 0, False)
    stored, meta_stored = _stats(force_store_random=True)  # random ops must be stored: keep, allow mutation
    assert _recompute_mutated(stored, meta_stored, [1] * 7) == ([1] * 7, 0, True)


@pytest.mark.parametrize("missing", ["pulp", "pwlf"])
def test_without_pulp_or_pwlf_everything_says_how_to_install_them(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # import -> ImportError
    ok, reason = sac_ilp_available()
    assert not ok and missing in reason and "pip install -e '.[sac]'" in reason
    model, batch = GPT(CFG), make_batch(CFG, BATCH, 0)
    with pytest.raises(SacIlpUnavailable, match=r"pip install -e '\.\[sac\]'") as err:
        profile_sac_ilp(model, batch)
    assert err.value.reason == reason
    recipe = sac_ilp_recipe("4MiB", batch)
    with pytest.raises(RuntimeError, match=missing):  # the recipes' "cannot run here"
        recipe.apply(copy.deepcopy(model), torch.device("cpu"), None)


@needs_sac
def test_the_roofline_on_a_cpu_is_a_clear_skip():
    with pytest.raises(SacIlpUnavailable, match="needs CUDA"):
        profile_sac_ilp(GPT(CFG), make_batch(CFG, BATCH, 0), estimate_mode="operator-level-cost-model")


# ------------------------------------------------------------------------------ plans on a tiny GPT
class _Setup:
    def __init__(self) -> None:
        self.base = GPT(CFG, seed=3)
        self.batch = make_batch(CFG, BATCH, 0)
        before = [p.detach().clone() for p in self.base.parameters()]
        rng = torch.get_rng_state()
        self.profile = profile_sac_ilp(self.base, self.batch)
        self.left_alone = (torch.equal(rng, torch.get_rng_state())
                           and all(p.grad is None for p in self.base.parameters())
                           and all(torch.equal(a, b) for a, b in zip(before, self.base.parameters())))
        self.minimum = self.profile.min_budget_bytes()
        self.reference = self.profile.no_checkpoint_peak_bytes()
        self.tight = self.profile.plan(self.minimum)
        self.loose = self.profile.plan((self.minimum + self.reference) // 2)

    def peak(self, model) -> int:
        """One step's peak above the model's own parameters and buffers (the CPU meter, second step)."""
        model(*self.batch).backward()
        model.zero_grad(set_to_none=True)
        with MemoryMeter("cpu", track=[model], scan_gc=False) as meter:
            model(*self.batch).backward()
        model.zero_grad(set_to_none=True)
        return meter.peak_bytes


@pytest.fixture(scope="module")
def setup():
    if not AVAILABLE:
        pytest.skip(REASON)
    return _Setup()


@needs_sac
@pytest.mark.slow
def test_profiling_leaves_the_model_and_the_rng_as_they_were(setup):
    assert setup.left_alone
    units = setup.profile.units
    assert "layers.0" in units and "layers.3.mlp" in units and "" not in units
    assert not any(u.endswith(("qkv", "ln1", "act")) for u in units)  # leaves are never AC units
    p = setup.profile
    assert p.param_bytes == sum(t.numel() * 4 for t in setup.base.parameters())  # the tied head counted once
    buffers_and_batch = setup.base.mask.numel() + sum(t.numel() * 8 for t in setup.batch)
    assert p.outside_bytes() == buffers_and_batch and p.outside_bytes(p.param_bytes + 100) == 100


@needs_sac
@pytest.mark.slow
def test_tight_budget_checkpoints_more_than_loose_and_none_at_the_no_checkpoint_peak(setup):
    tight, loose = setup.tight, setup.loose
    none = setup.profile.plan(setup.reference)
    assert none.modules == [] and none.recompute_ms == 0 and none.recomputed_bytes == 0
    assert tight.recomputed_bytes > loose.recomputed_bytes > 0
    assert tight.recompute_ms > loose.recompute_ms > 0
    for plan in (tight, loose, none):
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        assert plan.predicted_peak_bytes == plan.sac_peak_bytes + plan.outside_bytes
        assert plan.sac_budget_gib == pytest.approx((plan.budget_bytes - plan.outside_bytes) / 2 ** 30)
        assert all(0 < m.discard <= 1 for m in plan.modules)
    assert any(m.whole for m in tight.modules) or all(m.discard > 0.5 for m in tight.modules)
    assert "layers." in tight.report() and f"{tight.budget_bytes} B" in tight.report()


@needs_sac
@pytest.mark.slow
def test_below_its_own_minimum_it_says_the_minimum(setup):
    with pytest.raises(SacIlpInfeasible) as err:
        setup.profile.plan(setup.minimum - 64 * 1024)
    assert err.value.min_budget_bytes == setup.minimum and str(setup.minimum) in str(err.value)
    assert isinstance(err.value, RuntimeError)
    with pytest.raises(SacIlpInfeasible, match="its own minimum"):
        sac_ilp_recipe(setup.minimum // 2, setup.batch, profile=setup.profile).apply(
            copy.deepcopy(setup.base), torch.device("cpu"), None)


@needs_sac
@pytest.mark.slow
def test_applied_plans_train_bitwise_equal_and_save_memory(setup):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    reference = copy.deepcopy(setup.base)
    losses = train_steps(reference, 3, BATCH, 1e-3, seed=11)  # dropout on, seeded
    grads = [p.grad for p in reference.parameters()]
    none_peak = setup.peak(copy.deepcopy(setup.base))
    peaks = {}
    for name, plan in (("tight", setup.tight), ("loose", setup.loose)):
        model = plan.apply(copy.deepcopy(setup.base))
        wrapped = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
        assert len(wrapped) == len(plan.modules) > 0
        assert train_steps(model, 3, BATCH, 1e-3, seed=11) == losses, name
        for p, g, q in zip(model.parameters(), grads, reference.parameters()):
            assert torch.equal(p.grad, g) and torch.equal(p, q), name
        selective = [m for m in plan.modules if not m.whole]
        if selective:
            assert plan.op_match.matched > 0 and plan.op_match.unmatched == 0, plan.op_match
        peaks[name] = setup.peak(plan.apply(copy.deepcopy(setup.base)))
    assert peaks["tight"] < peaks["loose"] < none_peak, (peaks, none_peak)


@needs_sac
@pytest.mark.slow
def test_the_recipe_wraps_fresh_copies_and_refuses_a_wrapped_one(setup):
    recipe = sac_ilp_recipe(setup.loose.budget_bytes, setup.batch, profile=setup.profile)
    assert recipe.who == "peer" and recipe.name == "torch_sac_ilp" and "sac_ilp" in recipe.what
    model = copy.deepcopy(setup.base)
    assert recipe.apply(model, torch.device("cpu"), None) is None  # (planned on first use)
    assert recipe.apply.plan().decisions == setup.loose.decisions
    with pytest.raises(ValueError, match="already checkpoint-wrapped"):
        recipe.apply(model, torch.device("cpu"), None)
