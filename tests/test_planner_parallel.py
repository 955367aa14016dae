"""The planner in parallel training: data-parallel ranks agreeing on one plan, FSDP2, pipeline
stages (``docs/parallel.md``, "The planner in parallel training").

In this process: how ranks combine profiles and probes (times at their maximum, bytes equal or a
clear error), the agreement protocol itself on two ranks simulated by threads (one solves, the
other serves, every failure reaches both), and how the micro-batches a stage holds and a
pipeline step's time are read from a schedule's action order. On 2 gloo processes (one spawn for
all scenarios, ``tests/support/planner_scenarios.py``): DDP ranks with different timing noise
apply byte-identical plans and train bitwise like the unplanned run; FSDP2 plans fit their
budget as measured and train bitwise; the stages of a 1F1B pipeline, planned for one budget,
each fit it as measured, the first keeps less per micro-batch than the last, the pipeline is
faster than with the first stage's plan everywhere, and it trains bitwise like one process.
"""

from __future__ import annotations

import contextlib
import doctest
import threading
from typing import Any, Dict, List, Optional

import pytest

from hyper_parallel.core.activation_checkpoint import MemoryPlan, pipeline_in_flight, plan_memory
from hyper_parallel.planner import gpipe_actions, in_flight_counts, one_f_one_b_actions, pipeline_step_seconds
from hyper_parallel.planner.distributed import combine_effects, combine_profiles, summarize
from hyper_parallel.planner.options import OpKey
from hyper_parallel.planner.profile import RELATIONS, Effect, LayerRecord, LayerType, OpRecord, Segment, StepProfile

MiB = 1 << 20


# ------------------------------------------------------------------------------ a synthetic framework
class _Layer:
    """A layer of the synthetic framework (the fake prober's ``is_layer``)."""


def _profile(layers: int, slow: float, peak_shift: int = 0, input_bytes: int = MiB, device: str = "cpu") -> StepProfile:
    """Three layers of one kind, each saving 8 MiB; times scaled by ``slow``, the first layer's
    forward peaking ``peak_shift`` bytes higher."""
    ops = [OpRecord(OpKey("mm", ((8, 8), (8, 8))), 4 * MiB, True, expensive=True),
           OpRecord(OpKey("gelu", ((8, 8),)), 4 * MiB, True)]
    records = [LayerRecord(j, "T", ops, [4 * MiB, 4 * MiB], input_bytes, forward_s=0.01 * slow, backward_s=0.02 * slow)
               for j in range(layers)]
    segments = [Segment("pre", -1, 10 * MiB, 10 * MiB)]
    for j in range(layers):
        segments += [Segment("fwd", j, (10 + 8 * j) * MiB, (11 + 8 * j) * MiB + (peak_shift if j == 0 else 0)),
                     Segment("gap", j, (10 + 8 * (j + 1)) * MiB, (10 + 8 * (j + 1)) * MiB)]
    segments += [Segment("bwd", j, (10 + 8 * (j + 1)) * MiB, (12 + 8 * (j + 1)) * MiB) for j in range(layers - 1, -1, -1)]
    return StepProfile(device, segments, records, {"T": LayerType("T", list(range(layers)), records[0])},
                       10 * MiB, max(s.peak for s in segments), 0.1 * slow, 4 * MiB, 4 * MiB, 1e9, False)


class _FakeProber:
    """The framework part of a synthetic framework: a profile of three 8-MiB layers and probes
    whose bytes depend on the option only and whose seconds on the rank's slowness."""

    name = "fake"

    def __init__(self, group: Any, slow: float = 1.0, input_bytes: int = MiB, failing_probe: bool = False,
                 probe_extra: int = 0) -> None:
        self.group, self.slow, self.input_bytes, self.failing_probe = group, slow, input_bytes, failing_probe
        self.probe_extra = probe_extra  # (bytes this rank's probes see more: ranks that disagree)
        self.probes = 0

    def collectives(self, group: Any) -> Any:
        return self.group if group is None else group

    def profile_step(self, layers, step_fn):
        step_fn()
        return _profile(len(layers), self.slow, input_bytes=self.input_bytes)

    def op_seconds(self, ltype):
        return {op.key: 0.001 * self.slow for op in ltype.record.ops}

    def probe(self, ltype, option, seen, reference=None):
        self.probes += 1
        if self.failing_probe:
            raise RuntimeError("the probe ran out of something")
        drop = -8 * MiB if option.kind == "swap" or option.whole_recompute else -4 * MiB
        effect = {r: drop for r in RELATIONS}
        effect.update(own_fwd=self.probe_extra, last_fwd=0, own_bwd=0, last_bwd=0, after=0)
        return Effect(effect, (0.006 if option.kind == "swap" else 0.004) * self.slow, measured=True), reference

    @staticmethod
    def is_layer(x):
        return isinstance(x, _Layer)

    @staticmethod
    def is_stack(x):
        return isinstance(x, list)

    def wrap(self, layer, option, seen):
        return None

    def is_container(self, x):
        return False

    @contextlib.contextmanager
    def in_training(self, step_fn):
        yield

    def measure_plan(self, stack, layers, options, seen, step_fn):
        return None


class _ThreadGroup:
    """Object collectives between threads (each thread one "rank"); a rank that never arrives
    breaks the barrier after 20 s instead of hanging the test."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots: List[Any] = [None] * size

    def member(self, rank: int) -> "_Member":
        return _Member(self, rank)


class _Member:
    def __init__(self, group: _ThreadGroup, rank: int) -> None:
        self.g, self.rank, self.size = group, rank, group.size

    def all_gather(self, obj):
        self.g.slots[self.rank] = obj
        self.g.barrier.wait()
        out = list(self.g.slots)
        self.g.barrier.wait()
        return out

    def broadcast(self, obj):
        if self.rank == 0:
            self.g.slots[0] = obj
        self.g.barrier.wait()
        out = self.g.slots[0]
        self.g.barrier.wait()
        return out


def _on_two_ranks(budget: int, budget1: Optional[int] = None, **rank1: Any) -> List[Dict[str, Any]]:
    """``plan_memory`` on two thread "ranks" (rank 1 built with ``rank1``, planning for ``budget1``
    if given); per rank: the plan's JSON or the exception, and its prober."""
    group = _ThreadGroup(2)
    out: List[Dict[str, Any]] = [{}, {}]

    def rank(r: int) -> None:
        prober = _FakeProber(group.member(r), **(rank1 if r == 1 else {}))
        out[r]["prober"] = prober
        try:
            mine = budget1 if r == 1 and budget1 is not None else budget
            out[r]["plan"] = plan_memory([_Layer() for _ in range(3)], lambda: None, mine, prober=prober)
        except Exception as exc:  # noqa: BLE001  (asserted by the tests)
            out[r]["error"] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ------------------------------------------------------------------------------ ranks agreeing
def test_ranks_combine_times_and_timelines_at_their_maximum_and_refuse_different_steps():
    fast, slow = _profile(3, 1.0), _profile(3, 1.5)
    combined = combine_profiles(fast, [summarize(fast), summarize(slow)])
    assert combined.step_s == slow.step_s and combined.layers[1].forward_s == slow.layers[1].forward_s
    assert combined.types["T"].record.backward_s == slow.layers[0].backward_s
    assert combined.segments == fast.segments and "the same bytes on each" in combined.notes[-1]
    assert "on rank 1" in combined.notes[-1]
    # where an asynchronous free falls against a layer boundary is timing: a segment counts at its largest
    later = _profile(3, 1.0, peak_shift=4096)
    combined = combine_profiles(fast, [summarize(fast), summarize(later)])
    assert combined.segments[1].peak == fast.segments[1].peak + 4096 and combined.segments[2:] == fast.segments[2:]
    assert combined.peak_bytes == max(s.peak for s in combined.segments) and "up to 4096 bytes" in combined.notes[-1]
    # each rank has its own accelerator: the device's kind must agree, not its index
    on_one, on_other = _profile(3, 1.0, device="cuda:0"), _profile(3, 1.0, device="cuda:1")
    assert combine_profiles(on_one, [summarize(on_one), summarize(on_other)]).device == "cuda:0"
    other = _profile(3, 1.0, input_bytes=2 * MiB)  # rank 1 runs another step (larger inputs)
    with pytest.raises(RuntimeError, match=r"layer 0: input bytes is \d+ on rank 0 and \d+ on rank 1"):
        combine_profiles(fast, [summarize(fast), summarize(other)])
    a = Effect({r: -MiB for r in RELATIONS}, 0.01, measured=True)
    b = Effect({r: -MiB for r in RELATIONS}, 0.03, measured=True)
    assert combine_effects([a, b], "a probe").seconds == 0.03
    c = Effect(dict(a.bytes, own_gap=0), 0.01, measured=True)
    with pytest.raises(RuntimeError, match="disagree on a probe: bytes changed: own_gap is .* on rank 1"):
        combine_effects([a, c], "a probe")


def test_one_rank_solves_every_rank_probes_and_both_get_the_same_plan():
    out = _on_two_ranks(30 * MiB, slow=2.0)
    for r in range(2):
        assert "error" not in out[r], out[r].get("error")
    texts = [o["plan"].to_json() for o in out]
    assert texts[0] == texts[1]
    plan = out[0]["plan"]
    assert any(c.option.kind != "none" for c in plan.choices) and plan.predicted_peak_bytes <= 30 * MiB
    assert plan.reference_step_s == _profile(3, 2.0).step_s  # the slower rank's
    assert out[0]["prober"].probes == out[1]["prober"].probes > 0  # every probe ran on both ranks
    assert isinstance(MemoryPlan.from_json(texts[1], [_Layer()] * 3, out[1]["prober"]), MemoryPlan)


def test_every_failure_reaches_every_rank():
    # a budget below the minimum: found by the solving rank only, raised on both
    out = _on_two_ranks(8 * MiB)
    assert all(isinstance(o.get("error"), ValueError) for o in out), out
    assert "raised on the planning rank 0" in str(out[1]["error"])
    # the ranks pass different budgets: both raise before any work, naming them
    out = _on_two_ranks(30 * MiB, budget1=31 * MiB)
    assert all(isinstance(o.get("error"), ValueError) and "different budgets" in str(o["error"]) for o in out), out
    assert out[0]["prober"].probes == out[1]["prober"].probes == 0
    # rank 1 profiles another step: both raise, naming it
    out = _on_two_ranks(30 * MiB, input_bytes=2 * MiB)
    assert all(isinstance(o.get("error"), RuntimeError) and "rank 1" in str(o["error"]) for o in out), out
    # rank 1's probes measure other bytes: both raise the disagreement, and rank 0 sends nothing after it
    # (a message nobody receives would leave it waiting, or pair with the group's next collective)
    out = _on_two_ranks(30 * MiB, probe_extra=4096)
    assert all(isinstance(o.get("error"), RuntimeError) and "disagree on the probe" in str(o["error"]) for o in out), out
    # a probe raising on rank 1 (the serving one): its own error there, a RuntimeError naming it on rank 0
    out = _on_two_ranks(30 * MiB, failing_probe=True)
    assert "ran out of something" in str(out[1]["error"])
    assert isinstance(out[0]["error"], RuntimeError) and "failed on rank 1" in str(out[0]["error"])


# ------------------------------------------------------------------------------ pipeline schedules
def test_in_flight_counts_come_from_the_action_order():
    assert in_flight_counts(one_f_one_b_actions(4, 8)) == {0: 4, 1: 3, 2: 2, 3: 1}
    assert in_flight_counts(one_f_one_b_actions(2, 4)) == {0: 2, 1: 1}
    assert in_flight_counts(gpipe_actions(2, 4)) == {0: 4, 1: 4}
    # a split backward frees a micro-batch at its weight half
    split = {0: [(0, "F", 0), (0, "F", 1), (0, "I", 0), (0, "F", 2), (0, "W", 0), (0, "I", 1), (0, "W", 1),
                 (0, "I", 2), (0, "W", 2)]}
    assert in_flight_counts(split) == {0: 3}


def test_pipeline_step_time_runs_the_action_order():
    seconds = {0: (1.0, 2.0), 1: (1.0, 2.0)}
    # 1F1B, 2 stages, 2 micro-batches: F0 F1 on stage 0 (0-2), stage 1: F0 (1-2) B0 (2-4) F1 (4-5) B1 (5-7),
    # stage 0: B0 (4-6) B1 (7-9)
    assert pipeline_step_seconds(one_f_one_b_actions(2, 2), seconds) == 9.0
    # GPipe: stage 1 runs its forwards 1-3, backwards 3-7; stage 0's last backward ends at 9
    assert pipeline_step_seconds(gpipe_actions(2, 2), seconds) == 9.0
    faster = {0: (1.0, 2.0), 1: (1.0, 1.0)}
    assert pipeline_step_seconds(one_f_one_b_actions(2, 4), faster) < pipeline_step_seconds(
        one_f_one_b_actions(2, 4), seconds)
    with pytest.raises(ValueError, match="never runs"):
        pipeline_step_seconds({0: [(0, "B", 0)]}, {0: (1.0, 1.0), 1: (1.0, 1.0)})


def test_docstring_examples_of_the_pipeline_planner():
    from hyper_parallel.planner import pipeline as module
    result = doctest.testmod(module, verbose=False)
    assert result.attempted >= 4 and result.failed == 0


class _NoOrderStage:
    stage_index, num_stages, is_first, is_last, submod, device, group = 0, 2, True, False, None, "cpu", None


class _NoOrderSchedule:
    """A schedule of one stage without an action table (as a hand-written schedule may be)."""

    _stage = _NoOrderStage()
    _n_microbatches = 4
    pipeline_order = None


def test_a_schedule_whose_in_flight_counts_cannot_be_read_is_a_clear_error():
    with pytest.raises(ValueError, match="_NoOrderSchedule holds: it has no action order.*microbatches_in_flight"):
        pipeline_in_flight(_NoOrderSchedule())
    with pytest.raises(TypeError, match="pipelining schedule"):
        pipeline_in_flight(object())


# ------------------------------------------------------------------------------ on 2 gloo processes
@pytest.fixture(scope="module")
def ranks() -> List[Dict[str, Any]]:
    """Every scenario of ``planner_scenarios`` in one spawn of 2 processes; per rank its results."""
    from support import dist_utils, planner_scenarios
    return dist_utils.run_scenarios(list(planner_scenarios.SCENARIOS), table=planner_scenarios.SCENARIOS)


def _results(ranks: List[Dict[str, Any]], name: str) -> List[Dict[str, Any]]:
    per_rank = [r[name] for r in ranks]
    for rank, res in enumerate(per_rank):
        assert res["ok"], f"rank {rank}, scenario {name!r}:\n{res.get('error')}"
    return per_rank


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timing
def test_ddp_ranks_with_different_timing_noise_apply_one_plan_and_train_bitwise(ranks):
    r0, r1 = _results(ranks, "agree_ddp")
    assert r0["json"] == r1["json"]  # byte-identical plan JSON on both ranks
    assert any(c != "none" for c in r0["choices"])
    # rank 1's layers spin 2 ms more per forward: the plan's times are its (the slowest rank's)
    assert "on rank 1" in r0["notes"][-1] and "profiled on 2 data-parallel ranks" in r0["notes"][-1]
    for res in (r0, r1):
        assert res["min_budget"] <= res["budget"] < res["unplanned_peak"]
        assert res["planned_peak"] <= res["budget"], res  # measured, on a fresh DDP model under the plan
        assert res["train_bitwise"] and res["left_as_found"], res
        # rank 1 runs a batch of one: the ranks' bytes differ, a clear error on both
        assert res["mismatch"] is not None and "disagree" in res["mismatch"] and "on rank 1" in res["mismatch"]
    assert r0["digest"] == r1["digest"]  # the trained parameters are equal across the ranks


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timing  # (no time asserted: it shares the one spawn of the scenarios with the timing tests)
def test_a_ddp_step_that_does_not_fit_plans_and_trains_under_a_hard_cap_at_the_budget(ranks):
    """Under ``MemoryMeter(cap=budget)`` on both ranks (an allocator stand-in), the plain DDP step
    runs out of memory; planning (with what autograd saves moved to the host while profiling)
    stays within the cap, and two training steps under the plan too, bitwise the unplanned
    training, the same on both ranks."""
    r0, r1 = _results(ranks, "capped_ddp")
    assert r0["json"] == r1["json"] and r0["digest"] == r1["digest"]
    for res in (r0, r1):
        assert res["budget"] < res["unplanned_peak"] and res["refused"].startswith("MemoryMeter"), res
        assert "ran out of device memory as it is" in res["notes"][0], res["notes"]
        assert res["planning_peak"] <= res["budget"] and res["training_peak"] <= res["budget"], res
        assert any(c != "none" for c in res["choices"]) and res["train_bitwise"], res


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timing
def test_fsdp2_plans_fit_their_budget_as_measured_and_train_bitwise(ranks):
    r0, r1 = _results(ranks, "fsdp2")
    assert r0["json"] == r1["json"]
    for res in (r0, r1):
        # the profile sees the gathered parameters of the running and the prefetched layer: its
        # peak with nothing planned is the measured one (within 0.5%)
        assert abs(res["reference_peak"] - res["unplanned_peak"]) <= 0.005 * res["unplanned_peak"], res
        assert res["min_budget"] <= res["budget"] < res["unplanned_peak"]
        assert res["planned_peak"] <= res["budget"], res
        assert abs(res["planned_peak"] - res["predicted_peak"]) <= 0.02 * res["planned_peak"], res
        assert res["grads_bitwise"] and res["params_bitwise"] and res["left_as_found"], res


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timing
def test_pipeline_stages_fit_one_budget_each_for_its_micro_batches(ranks):
    r0, r1 = _results(ranks, "pipeline")
    for res in (r0, r1):
        assert res["in_flight"] == {"0": 2, "1": 1} and res["gpipe_in_flight"] == {"0": 4, "1": 4}
        assert res["budget"] < res["unplanned_peak"]  # one budget, below what either stage needs unplanned
        assert res["planned_peak"] <= res["budget"], res  # measured: a fresh schedule's first step
        # the model (k micro-batches in flight, each keeping what the plan leaves, plus the
        # schedule's own buffers measured once unplanned) predicts the planned step's peak
        assert abs(res["planned_peak"] - res["predicted_peak"]) <= 0.03 * res["planned_peak"], res
        assert res["measured_reference"] >= res["unplanned_peak"]  # (the planner's own measurement of it)
        assert res["params_bitwise"] and res["left_as_found"], res  # one SGD step, against one process
    # the first stage holds two micro-batches, the last one: the first keeps less of each
    assert r0["kept_per_microbatch"] < r1["kept_per_microbatch"]
    # the pipeline with a plan per stage is faster than with the first stage's plan on both (predicted)
    assert r0["predicted_step_s"] < r0["predicted_uniform_step_s"]


@pytest.mark.timing
def test_a_pipeline_stage_that_cannot_fit_the_budget_fails_on_every_stage(ranks):
    """One budget between the stages' smallest reachable peaks: the stage it is too small for raises
    the planner's ValueError, the other a RuntimeError naming that stage, and neither waits for the
    other (the scenario ends)."""
    r0, r1 = _results(ranks, "pipeline")
    mins = r0["min_budgets"]
    assert mins == r1["min_budgets"] and mins[0] != mins[1], mins
    short = 0 if mins[0] > mins[1] else 1
    failures = [r0["tight_failure"], r1["tight_failure"]]
    assert failures[short] and failures[short].startswith("ValueError: plan_memory: no plan fits"), failures
    assert failures[1 - short] and f"planning failed on pipeline rank {short}" in failures[1 - short], failures
