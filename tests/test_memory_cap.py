"""A hard memory cap on the CPU: ``MemoryMeter(cap=...)`` fails an op whose outputs would take the
live storages past it with ``torch.OutOfMemoryError``, as a device's allocator does. A plan made
for a budget then trains under a cap equal to that budget, where the step left as it is runs out
of memory; planning a step that does not fit says so clearly and leaves training as it was."""

from __future__ import annotations

import copy

import pytest
import torch

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
from hyper_parallel.core.activation_checkpoint import MemoryPlan, SwapManager, plan_memory
from hyper_parallel.core.backend import active_backend
from hyper_parallel.planner.planner import make_plan
from hyper_parallel.tools.memory import MemoryMeter

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh():
    SwapManager().reset()
    yield
    SwapManager().reset()


# ---------------------------------------------------------------------------- the cap itself
def test_an_op_past_the_cap_raises_out_of_memory_and_never_counts():
    with MemoryMeter("cpu", scan_gc=False, cap=4 * MiB) as meter:
        kept = torch.zeros(MiB // 2)  # 2 MiB of float32
        with pytest.raises(torch.OutOfMemoryError, match="past the meter's cap of 4194304 bytes"):
            torch.ones(3 * MiB // 4)  # 3 MiB more: 5 MiB live
        assert meter.current_bytes == 2 * MiB  # (the refused output is gone at once)
        assert meter.peak_bytes == 2 * MiB  # (and never counted in the peak)
        exactly = torch.ones(MiB // 2)  # 2 MiB more: 4 MiB live, the cap itself, allowed
        assert meter.current_bytes == 4 * MiB
        with pytest.raises(torch.OutOfMemoryError):
            kept.add(1)  # one float32 more than the cap allows
        del exactly
        kept.add_(1)  # (an in-place op allocates nothing)
    assert meter.peak_bytes == 4 * MiB
    assert torch.equal(kept, torch.ones(MiB // 2))


def test_the_cap_refuses_a_bad_value_and_a_start_already_past_it():
    with pytest.raises(ValueError, match="number of bytes"):
        MemoryMeter("cpu", cap=-1)
    with pytest.raises(ValueError, match="number of bytes"):
        MemoryMeter("cpu", cap="4MiB")
    big = torch.zeros(MiB)
    with pytest.raises(torch.OutOfMemoryError, match="live at the start"):
        with MemoryMeter("cpu", track=[big], scan_gc=False, cap=MiB):
            pass


def test_a_step_fits_a_cap_at_its_own_peak_and_not_one_byte_below():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)

    def step():
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)

    with MemoryMeter("cpu", track=[model, x], scan_gc=False) as free:
        step()
    with MemoryMeter("cpu", track=[model, x], scan_gc=False, cap=free.peak_bytes) as capped:
        step()
    assert capped.peak_bytes == free.peak_bytes
    with pytest.raises(torch.OutOfMemoryError):
        with MemoryMeter("cpu", track=[model, x], scan_gc=False, cap=free.peak_bytes - 1):
            step()


def test_host_buffers_never_count_against_the_cap():
    # a swap_wrapper'd chain allocates its host pool in a step: under a cap at the step's own peak
    # (measured with the pool made) a step that must make the pool again runs too, as on a device
    from hyper_parallel.bench.modes import chain_layers
    from hyper_parallel.core.activation_checkpoint import swap_wrapper

    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                     torch.nn.Linear(256, 64)) for _ in range(4))
    x = torch.randn(64, 64, requires_grad=True)

    def step():
        h = x
        for layer in layers:
            h = layer(h)
        h.square().mean().backward()
        layers.zero_grad(set_to_none=True)
        x.grad = None

    for layer in layers:
        swap_wrapper(layer)
    chain_layers(list(layers))
    step()  # (the host pool is made)
    with MemoryMeter("cpu", track=[layers, x], scan_gc=False) as made:
        step()
    assert SwapManager().release_host_cache() > 0  # (the next step makes the pool again)
    with MemoryMeter("cpu", track=[layers, x], scan_gc=False, cap=made.peak_bytes) as again:
        step()
    assert again.peak_bytes == made.peak_bytes
    assert SwapManager().stats()["offloaded_bytes"] > 0
    # and the backend's host buffer itself, past any cap: host memory, never the device's
    with MemoryMeter("cpu", scan_gc=False, cap=MiB) as meter:
        buf = active_backend().empty_host_bytes(8 * MiB)
        kept = torch.zeros(MiB // 8)  # 0.5 MiB of device memory: counted
    assert buf.numel() == 8 * MiB and meter.peak_bytes == kept.nbytes


def test_a_storage_counted_until_its_holder_dies_and_one_uncounted():
    # (how planning a step that does not fit counts a saved storage it moved to the host: as if
    # it stayed on the device until autograd lets go of its host copy)
    class Holder:
        pass

    with MemoryMeter("cpu", scan_gc=False, cap=3 * MiB) as meter:
        moved = torch.zeros(MiB // 4)  # 1 MiB
        holder = Holder()
        meter.count_until(moved.untyped_storage(), holder)
        del moved
        assert meter.current_bytes == MiB  # (dead, still counted: its holder lives)
        back = torch.zeros(MiB // 4)  # the copy made for backward: counted already, through the holder
        meter.uncount(back.untyped_storage())
        assert meter.current_bytes == MiB
        back.add_(1)
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(MiB // 2 + 1)  # 2 MiB and 4 bytes more: past the cap, the dead storage counted
        del holder
        assert meter.current_bytes == 0  # (the holder gone: so are its bytes; the uncounted copy never was)
        torch.zeros(MiB // 2 + 1)
    assert meter.peak_bytes == 2 * MiB + 4  # (the last: the refused one never counted)


# ---------------------------------------------------------------------------- training under a cap
def _gpt():
    cfg = GPTConfig(vocab=256, dim=64, heads=4, layers=4, seq=64, dropout=0.1)
    tokens, targets = make_batch(cfg, batch=4, seed=3)
    return GPT(cfg, seed=1), lambda model: model(tokens, targets), [tokens, targets]


def _hf(family):
    def make():
        from hyper_parallel.bench.hf_models import batch, build, loss

        ids = batch(family, batch=2, seq=48, seed=1)
        return build(family, layers=3, hidden=64), lambda model: loss(model, ids), list(ids.values())
    return make


MODELS = {"bench_gpt": _gpt, "llama": _hf("llama"), "qwen3": _hf("qwen3")}


def _train(model, forward, steps, cap=None, track=()):
    """``steps`` AdamW steps (dropout seeded per step); the losses and the parameters after them.
    ``cap``: every step runs under a hard cap of that many bytes (model, optimizer, batch and
    what the step allocates)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        if cap is None:
            out = forward(model)
            out.backward()
        else:
            with MemoryMeter("cpu", track=[model, opt, *track], scan_gc=False, cap=cap):
                out = forward(model)
                out.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(out.detach())
            continue
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_plan_trains_under_a_hard_cap_at_its_budget_where_the_plain_step_runs_out(name):
    if name != "bench_gpt":
        pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
    base, forward, track = MODELS[name]()
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)

    def step():  # (the step as training runs it: the optimizer's state is in the budget)
        forward(base).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def answer(planner, measure):  # (one profile: the budget halfway from the smallest peak to the plain step's)
        widest = planner.plan(planner.reference_peak(), measure=measure)
        low, high = widest.min_budget_bytes, widest.reference_peak_bytes
        return planner.plan((low + high) // 2, measure=measure)

    plan = make_plan(base, step, answer, prober=active_backend().prober())
    budget = plan.budget_bytes
    assert any(c.option.kind != "none" for c in plan.choices), plan.report()

    plain = copy.deepcopy(base)
    with pytest.raises(torch.OutOfMemoryError):
        _train(plain, forward, 2, cap=budget, track=track)  # (the second: the optimizer has its state)

    expected = _train(copy.deepcopy(base), forward, 2)
    planned = copy.deepcopy(base)
    MemoryPlan.from_json(plan.to_json(), planned).apply()
    got = _train(planned, forward, 2, cap=budget, track=track)
    for a, b in zip(expected[0] + expected[1], got[0] + got[1]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_planning_a_step_that_cannot_fit_says_so_and_leaves_training_as_it_was():
    # (a cap with no room for the gradients: the step runs out of memory as it is, and again with
    # every saved activation moved to the host while planning)
    base, forward, track = _gpt()
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step = lambda: (forward(model).backward(), opt.step(), opt.zero_grad(set_to_none=True))  # noqa: E731
    _train_step()  # (mid-training: the optimizer has its state)
    before = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    with MemoryMeter("cpu", track=[model, opt, *track], scan_gc=False) as free:
        torch.manual_seed(0)
        _train_step()
    for p, b in zip(model.parameters(), before):  # (that measuring step is undone by hand)
        p.data.copy_(b)
    opt.load_state_dict(copy.deepcopy(state))
    cap = free.baseline_bytes + sum(p.nbytes for p in model.parameters()) // 2
    with MemoryMeter("cpu", track=[model, opt, *track], scan_gc=False, cap=cap):
        with pytest.raises(torch.OutOfMemoryError, match="again with every activation autograd saves moved"):
            plan_memory(model.layers, _train_step, budget=cap)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    for key, value in opt.state_dict()["state"].items():
        for name, t in value.items():
            assert torch.equal(t, state["state"][key][name]), (key, name)


# ---------------------------------------------------------------------------- planning under a cap
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_step_that_does_not_fit_is_planned_and_trained_under_a_cap_at_its_budget(name):
    """Planning itself under a hard cap equal to the budget, below the plain step's peak: what autograd
    saves goes to the host while planning (the profile still counts it), the plan fits, trains bitwise."""
    if name != "bench_gpt":
        pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
    base, forward, track = MODELS[name]()
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)

    def step():
        forward(base).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def answer(planner, measure):  # (the range of budgets, planned without a cap)
        return planner.plan(planner.reference_peak(), measure=measure)

    free = make_plan(base, step, answer, prober=active_backend().prober())
    low, high = free.min_budget_bytes, free.reference_peak_bytes
    expected = _train(copy.deepcopy(base), forward, 2)
    # (the minimum itself, halfway, and the plain step's own peak: the step fits, probes beside it do not)
    for fraction in (0.0, 0.5, 1.0):
        budget = int(low + (high - low) * fraction)
        model = copy.deepcopy(base)
        trainer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def capped_step():
            forward(model).backward()
            trainer.step()
            trainer.zero_grad(set_to_none=True)

        with MemoryMeter("cpu", track=[model, trainer, *track], scan_gc=False, cap=budget) as meter:
            plan = plan_memory(model, capped_step, budget)
        assert meter.peak_bytes <= budget
        assert plan.min_budget_bytes == pytest.approx(low, rel=0.01), (plan.report(), free.report())
        assert plan.reference_peak_bytes == pytest.approx(high, rel=0.01), (plan.report(), free.report())
        assert not any(p.grad is not None for p in model.parameters()) and not trainer.state
        MemoryPlan.from_json(plan.to_json(), model).apply()
        got = _train(model, forward, 2, cap=budget, track=track)
        for a, b in zip(expected[0] + expected[1], got[0] + got[1]):
            assert torch.equal(a, b), (name, fraction)
        SwapManager().reset()
