"""The memory planner on MindSpore (PyNative): its prober, plans on the MindSpore test GPT at a tight
and a loose budget (applied, trained bitwise like the plain model), the step's state put back,
clear budget errors, and the peak checked where MindSpore measures memory.

MindSpore's CPU build keeps no allocator statistics, so on a CPU the planner's memory numbers are
its own live-tensor count (an estimate, ``LiveTensorMeter``): the test that checks a plan's peak
against the budget with MindSpore's allocator skips there and says so; a second test checks the
plan against the same count the planner predicts with (its cost model's consistency, not a
measurement of the device). Planning probes copies of a layer many times, which takes a MindSpore
CPU build about a minute on this model: those tests are marked slow and share one planner."""

from __future__ import annotations

import doctest
import json
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, mint, nn, ops
from mindspore.utils import MsDispatchMode

from hyper_parallel.backends.mindspore import _shim
from hyper_parallel.core.activation_checkpoint import (CheckpointPolicy, MemoryPlan, SwapManager, checkpoint,
                                                       checkpoint_wrapper, plan_memory)
from hyper_parallel.core.wrapping import wrapper_of
from hyper_parallel.core.backend import active_backend
from hyper_parallel.planner import OpKey, OpTablePolicy, Planner, format_bytes
from hyper_parallel.planner import candidates as cand
from hyper_parallel.backends.mindspore import prober as mindspore_prober
from hyper_parallel.backends.mindspore.prober import LiveTensorMeter, MindSporeProber, memory_meter

import ms_model
from ms_helpers import assert_all_equal

KiB = 1 << 10
_CFG = dict(layers=2)  # the MindSpore test GPT (dim 32, 4 heads, seq 16, dropout 0.1), two blocks
_BATCH = 4
_ON_CPU = ms.get_context("device_target") not in ("Ascend", "GPU")
_NO_ALLOCATOR = ("MindSpore's CPU build keeps no allocator statistics (mindspore.runtime.max_memory_allocated() is "
                 "0 on a CPU by definition): nothing measures the device peak here; the planner's CPU numbers are its "
                 "own live-tensor count. Run with HP_MS_DEVICE=Ascend to check the measured peak.")


def _build(seed: int = 0) -> ms_model.GPT:
    return ms_model.build("none", seed=seed, **_CFG)


def _step_of(model: ms_model.GPT, batch_seed: int = 0) -> Callable[[], Any]:
    """One training forward + backward (no optimizer step), as ``plan_memory`` wants it."""
    idx, tgt = ms_model.make_batch(model.cfg, _BATCH, batch_seed)
    grad_fn = ms.value_and_grad(model, None, model.trainable_params())
    return lambda: grad_fn(idx, tgt)


def _train(model: ms_model.GPT, steps: int = 3) -> Tuple[List[float], Dict[str, np.ndarray]]:
    return ms_model.train(model, steps=steps, batch=_BATCH)


# ------------------------------------------------------------------------------ the prober (quick)
def test_the_mindspore_prober_is_the_planners_framework_part():
    prober = active_backend().prober()
    assert isinstance(prober, MindSporeProber) and prober.name == "mindspore"
    assert prober.is_layer(nn.Dense(2, 2)) and not prober.is_layer(Tensor(np.ones(2, np.float32)))


class _Keys(MsDispatchMode):
    """Records the planner's key of every op it sees (the PyNative pipeline off, as the library's modes do)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: List[OpKey] = []

    def __ms_dispatch__(self, func, args, kwargs=None):
        self.keys.append(active_backend().prober().key_of(func, args))
        return func(*args, **kwargs) if kwargs else func(*args)


def test_op_keys_are_the_op_name_and_the_shapes_of_its_tensor_arguments():
    dense, norm = nn.Dense(8, 4), nn.LayerNorm((8,))
    x = Tensor(np.ones((2, 8), np.float32))
    was_off = _shim.disable_pipeline()
    try:
        with _Keys() as mode:
            dense(norm(x))
    finally:
        _shim.restore_pipeline(was_off)
    labels = [k.label for k in mode.keys]
    assert labels == ["LayerNorm", "MatMul", "BiasAdd"]
    # a legacy primitive (LayerNorm) is dispatched as (primitive, name, inputs): its inputs' shapes count
    assert mode.keys[0].shapes == ((2, 8), (8,), (8,))
    assert mode.keys[1].shapes == ((2, 8), (4, 8)) and mode.keys[2].shapes == ((2, 4), (4,))


def test_a_generated_op_table_policy_drives_a_mindspore_checkpoint_bitwise():
    w1 = ms.Parameter(Tensor(np.random.RandomState(0).randn(6, 6).astype(np.float32)), name="w1")
    x = Tensor(np.random.RandomState(1).randn(4, 6).astype(np.float32))

    def block(x):
        return mint.sin(mint.matmul(mint.cos(x), w1))

    key_of = active_backend().prober().key_of
    matmul = OpKey("MatMulExt", ((4, 6), (6, 6)))
    cos = OpKey("Cos", ((4, 6),))
    policy = OpTablePolicy({matmul: CheckpointPolicy.MUST_SAVE, cos: CheckpointPolicy.PREFER_RECOMPUTE}, key_of)
    plain = ms.value_and_grad(lambda x: block(x).sum(), None, [w1])(x)
    planned = ms.value_and_grad(lambda x: checkpoint(block, x, policy_fn=policy).sum(), None, [w1])(x)
    assert_all_equal([plain[0].asnumpy(), plain[1][0].asnumpy()], [planned[0].asnumpy(), planned[1][0].asnumpy()])
    assert policy.unseen == 1 and policy.unseen_keys == [OpKey("Sin", ((4, 6),))]  # (not in the table: recomputed)


def test_the_cpu_meter_counts_each_storage_once_and_what_autograd_keeps_until_backward():
    if not _ON_CPU:
        pytest.skip("the live-tensor count is the CPU meter; an accelerator's planner reads the allocator")
    assert isinstance(memory_meter(), LiveTensorMeter)
    with LiveTensorMeter() as meter, meter.watching():
        x = mint.ones((256, 256))      # 256 KiB
        y = x.reshape(65536)           # a view: no new bytes
        assert meter.current_bytes == 256 * KiB
        del x, y
    assert meter.peak_bytes == 256 * KiB and meter.current_bytes == 0
    w = ms.Parameter(Tensor(np.ones((64, 64), np.float32)), name="w")
    a = Tensor(np.ones((64, 64), np.float32))
    with LiveTensorMeter() as meter, meter.watching():
        out, vjp_fn = ms.vjp(lambda a: mint.sin(mint.matmul(a, w)), a)
        del out
        held = meter.current_bytes  # the matmul's output, which Sin saved for its backward (and the mode's keys)
        assert held >= 16 * KiB, held
        vjp_fn(ops.ones_like(mint.ones((64, 64))))
        del vjp_fn
    assert meter.current_bytes < held
    assert set(meter.reached.values()) == {16 * KiB}  # w and a existed before: reached, not counted as made


def test_the_prober_module_examples_run():
    if not _ON_CPU:
        pytest.skip("the examples show the CPU meter")
    result = doctest.testmod(mindspore_prober, verbose=False)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------------------ clear errors (quick)
def test_bad_arguments_are_clear_errors():
    model = _build()
    with pytest.raises(TypeError, match="step_fn"):
        plan_memory(model.layers, None, "1GiB")
    with pytest.raises(ValueError, match="empty"):
        plan_memory([], lambda: None, "1GiB")
    with pytest.raises(TypeError, match="not a module"):
        plan_memory([model.layers[0], 3], lambda: None, "1GiB")
    with pytest.raises(ValueError, match="budget"):
        plan_memory(model.layers, lambda: None, "much")
    with pytest.raises(ValueError, match="budget"):
        plan_memory(model.layers, lambda: None, "-3MiB")
    checkpoint_wrapper(model.layers[1])
    with pytest.raises(ValueError, match="already wrapped"):
        plan_memory(model.layers, lambda: None, "1GiB")


def test_a_step_that_does_not_run_the_stack_is_refused():
    model = _build()
    x = Tensor(np.ones((2, model.cfg.seq, model.cfg.dim), np.float32))
    one_layer = ms.value_and_grad(lambda x: model.layers[0](x, mask=model.mask).sum(), None,
                                  model.layers[0].trainable_params())
    with pytest.raises(RuntimeError, match="every layer's forward once"):
        plan_memory(model.layers, lambda: one_layer(x), "1GiB")


# ------------------------------------------------------------------------------ plans on the test GPT (slow)
class _Setup:
    """One profiled model (``profiled``, with an outside BatchNorm in a hook of its first layer and
    a gradient accumulator written by its step) and the planner; plans are applied to fresh models."""

    def __init__(self) -> None:
        self.profiled = _build()
        self.norm = _hook_a_batchnorm(self.profiled)
        idx, tgt = ms_model.make_batch(self.profiled.cfg, _BATCH, 0)
        params = self.profiled.trainable_params()
        grad_fn = ms.value_and_grad(self.profiled, None, params)
        self.accumulator = ms.Parameter(Tensor(np.zeros(tuple(params[0].shape), np.float32)), name="acc",
                                        requires_grad=False)

        def step():
            loss, grads = grad_fn(idx, tgt)
            ops.assign_add(self.accumulator, grads[0])  # (gradient accumulation: an in-place write)
            return loss

        self.step = step
        self.before = _state_of(self.profiled, self.norm, self.accumulator)
        prober = active_backend().prober()
        self.profile = prober.profile_step(list(self.profiled.layers), self.step)
        self.planner = Planner(list(self.profiled.layers), self.profile, prober)
        self.minimum = self.planner.min_budget()[0]
        self.reference = self.planner.reference_peak()
        self.tight = self.planner.plan(self.minimum)
        self.loose = self.planner.plan(self.reference + 64 * KiB)
        self.after = _state_of(self.profiled, self.norm, self.accumulator)


def _hook_a_batchnorm(model: ms_model.GPT) -> nn.BatchNorm1d:
    """A BatchNorm outside the layers, run by a forward pre-hook of the first layer: its kernel
    writes the moving statistics in place (a legacy primitive with ``side_effect_mem``)."""
    norm = nn.BatchNorm1d(model.cfg.dim)
    norm.set_train(True)

    def pre(cell, args):
        x = args[0]
        b, s, d = x.shape
        return (x + 0.0 * norm(x.reshape(b * s, d)).reshape(b, s, d),)

    model.layers[0].register_forward_pre_hook(pre)
    return norm


def _state_of(model: ms_model.GPT, norm: nn.BatchNorm1d, accumulator: Any) -> Dict[str, np.ndarray]:
    state = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    state.update({"norm." + p.name: p.asnumpy().copy() for p in norm.get_parameters()})
    state["accumulator"] = accumulator.asnumpy().copy()
    state["rng"] = ms.get_rng_state().asnumpy().copy()
    return state


@pytest.fixture(scope="module")
def setup():
    SwapManager().reset()
    ms.set_seed(0)
    yield _Setup()
    SwapManager().reset()


def _applied(plan: MemoryPlan, seed: int = 0) -> ms_model.GPT:
    model = _build(seed)
    MemoryPlan.from_json(plan.to_json(), list(model.layers)).apply()
    return model


@pytest.mark.slow
def test_planning_leaves_the_step_as_it_found_it(setup):
    before, after = setup.before, setup.after
    assert before.keys() == after.keys()
    for name in before:  # parameters, the outside BatchNorm's moving statistics, the accumulator, the generator
        assert np.array_equal(before[name], after[name]), name
    # the dropout kernels did not draw: the profiled model's next step is a fresh twin's first
    twin = _build()
    _hook_a_batchnorm(twin)
    ms.set_seed(0)
    theirs = _train(twin, steps=1)
    ms.set_seed(0)
    ours = _train(setup.profiled, steps=1)
    assert theirs[0] == ours[0]
    assert_all_equal([theirs[1][k] for k in sorted(theirs[1])], [ours[1][k] for k in sorted(ours[1])])
    # (and the step does write them: what was put back had really changed)
    stats = setup.norm.moving_mean.asnumpy().copy()
    setup.step()
    assert not np.array_equal(setup.accumulator.asnumpy(), before["accumulator"])
    assert not np.array_equal(setup.norm.moving_mean.asnumpy(), stats)


@pytest.mark.slow
def test_a_tight_plan_wraps_layers_and_trains_bitwise_like_no_checkpointing(setup):
    plan = setup.tight
    assert plan.predicted_peak_bytes <= plan.budget_bytes == setup.minimum < setup.reference
    assert any(c.option.kind != "none" for c in plan.choices), plan.report()
    results = []
    for planned in (False, True):
        ms.set_seed(0)
        model = _applied(plan) if planned else _build()
        if planned:
            kinds = {wrapper_of(layer) for layer, c in zip(model.layers, plan.choices) if c.option.kind != "none"}
            assert kinds <= {"checkpoint_wrapper", "swap_wrapper"} and kinds
        results.append(_train(model, steps=3))
        SwapManager().reset()
    (l0, g0), (l1, g1) = results
    assert l0 == l1, (l0, l1)
    assert sorted(g0) == sorted(g1)
    assert_all_equal([g0[k] for k in sorted(g0)], [g1[k] for k in sorted(g1)])


@pytest.mark.slow
def test_a_loose_plan_wraps_nothing_and_trains_bitwise(setup):
    plan = setup.loose
    assert [c.option.kind for c in plan.choices] == ["none"] * _CFG["layers"]
    assert plan.predicted_step_s == setup.profile.step_s and not plan.swaps
    ms.set_seed(0)
    model = _applied(plan)
    assert all(wrapper_of(layer) is None for layer in model.layers)
    ms.set_seed(0)
    ours = _train(model, steps=2)
    ms.set_seed(0)
    theirs = _train(_build(), steps=2)
    assert ours[0] == theirs[0]
    assert_all_equal([ours[1][k] for k in sorted(ours[1])], [theirs[1][k] for k in sorted(theirs[1])])


@pytest.mark.slow
def test_generated_selective_policies_keep_what_they_name_and_train_bitwise(setup):
    """The fixed recipes among the options (save the matmuls; swap them and the inputs), as the
    planner wraps them: OpTablePolicy keyed by (op.name, shapes) knows every op the layers run."""
    ltype = next(iter(setup.profile.types.values()))
    seen = setup.planner.seen[ltype.key]
    profile = setup.profile
    options = {o.label: o for o in cand.candidate_options(ltype, profile.overlaps, profile.copy_bytes_per_s)}
    ms.set_seed(0)
    reference = _train(_build(), steps=2)
    for label in ("save matmuls", "swap matmuls + inputs"):
        option = options[label]
        assert {k.label for k, _ in option.keep} <= {"MatMul", "MatMulExt"}
        model = _build()
        policies = [active_backend().prober().wrap(layer, option, seen) for layer in model.layers]
        for first, second in zip(model.layers, list(model.layers)[1:]):
            SwapManager().set_forward_prefetch_layer(first, second)
        ms.set_seed(0)
        ours = _train(model, steps=2)
        assert ours[0] == reference[0], label
        assert_all_equal([ours[1][k] for k in sorted(ours[1])], [reference[1][k] for k in sorted(reference[1])])
        assert [p.unseen for p in policies] == [0] * len(policies), [p.unseen_keys for p in policies]
        if option.swaps:
            assert SwapManager().stats()["offloaded_bytes"] > 0
        SwapManager().reset()


@pytest.mark.slow
def test_the_measured_peak_is_within_the_budget(setup):
    if _ON_CPU:
        pytest.skip(_NO_ALLOCATOR)
    for plan in (setup.tight, setup.loose):
        model = _applied(plan)
        _step_of(model)()  # (first step: the host pool, one-off allocations)
        measured = active_backend().prober().measure_step(None, _step_of(model), list(model.layers))
        assert measured <= plan.budget_bytes, (format_bytes(measured), plan.report())
        SwapManager().reset()


@pytest.mark.slow
def test_the_plan_fits_the_budget_by_the_count_the_planner_predicts_with(setup):
    """On a CPU: the plan's peak by the live-tensor count (what the profile and the probes measured
    with, an estimate of device memory) is within the budget and near the prediction."""
    if not _ON_CPU:
        pytest.skip("on an accelerator the measured peak is checked (test_the_measured_peak_is_within_the_budget)")
    for plan in (setup.tight, setup.loose):
        model = _applied(plan)
        _step_of(model)()  # (first step: the host pool)
        counted = active_backend().prober().measure_step(None, _step_of(model), list(model.layers))
        assert counted <= plan.budget_bytes, (format_bytes(counted), plan.report())
        assert abs(counted - plan.predicted_peak_bytes) <= 0.1 * counted, (counted, plan.predicted_peak_bytes)
        SwapManager().reset()


@pytest.mark.slow
def test_a_budget_below_the_minimum_says_what_it_would_take(setup):
    minimum = setup.planner.min_budget()[0]  # (the plans' probes may have measured options that go lower)
    with pytest.raises(ValueError) as err:
        setup.planner.plan(minimum - 16 * KiB)
    text = str(err.value)
    assert str(minimum) in text and format_bytes(minimum) in text and "parameters" in text


@pytest.mark.slow
def test_the_report_and_json_say_what_was_measured(setup):
    plan = setup.tight
    again = MemoryPlan.from_json(plan.to_json(), list(_build().layers))
    assert json.loads(again.to_json()) == json.loads(plan.to_json())
    assert json.loads(plan.to_json())["framework"] == "mindspore"
    report = plan.report()
    assert "predicted peak" in report
    if _ON_CPU:
        assert "estimated" in report and any("estimated" in n for n in setup.profile.notes)


@pytest.mark.slow
def test_a_step_with_an_adam_step_is_planned_and_left_as_found():
    # nn.Adam runs its update as a compiled graph no dispatch mode sees: planning keeps every
    # parameter of every optimizer alive (moments, beta powers, the step count, the model's
    # parameters it updates) and puts them back, so training after planning is training without it.
    def trainer(seed: int = 0):
        model = _build(seed)
        opt = nn.Adam(model.trainable_params(), learning_rate=1e-2)
        grad_fn = ms.value_and_grad(model, None, opt.parameters)

        def step(i: int) -> float:
            idx, tgt = ms_model.make_batch(model.cfg, _BATCH, i)
            loss, grads = grad_fn(idx, tgt)
            opt(grads)
            return float(loss.asnumpy())
        return model, opt, step

    plain_model, _, plain = trainer()
    model, opt, step = trainer()
    before = {p.name: p.asnumpy().copy() for p in opt.get_parameters()}
    plan_memory(model.layers, lambda: step(0), "8GiB")
    after = {p.name: p.asnumpy() for p in opt.get_parameters()}
    changed = [name for name in before if not np.array_equal(before[name], after[name])]
    assert not changed, f"planning changed {changed[:5]}"
    assert [plain(i) for i in range(3)] == [step(i) for i in range(3)]
    assert_all_equal([p.asnumpy() for p in plain_model.trainable_params()], [p.asnumpy() for p in model.trainable_params()])
