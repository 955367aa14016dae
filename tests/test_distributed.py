"""Recompute + swap under DDP, FSDP2 and pipeline parallelism (2 processes, gloo, CPU).

The two processes are started once for the whole module (starting them and importing the
distributed packages costs most of the time on a 2-core machine); every selected test names the
scenario it needs, the fixture runs exactly those in one pair of processes (see
``tests/support/dist_utils.py``), and each test checks its scenario's per-rank results.

The ``MicrobatchSwapSchedule`` unit tests at the end run in this process.
"""

from __future__ import annotations

import gc
from typing import Any, Dict, List

import pytest
import torch

from support import dist_utils
from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper
from hyper_parallel.core.microbatch_schedule import (MicrobatchSwapSchedule,
                                                                          resident_swap_bytes)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ATOL = dist_utils.ATOL


def uses(name: str):
    """Mark a test as reading the results of distributed scenario ``name``."""
    def deco(fn):
        fn._dist_scenario = name
        return fn
    return deco


@pytest.fixture(scope="module")
def dist_results(request) -> List[Dict[str, Any]]:
    names = []
    for item in request.session.items:
        name = getattr(getattr(item, "function", None), "_dist_scenario", None)
        if name is not None and name not in names and item.module is request.module:
            names.append(name)
    return dist_utils.run_scenarios(names)


def results(dist_results, name: str) -> List[Dict[str, Any]]:
    per_rank = [r[name] for r in dist_results]
    for rank, res in enumerate(per_rank):
        assert res["ok"], f"rank {rank}, scenario {name!r}:\n{res.get('error')}"
    return per_rank


def _assert_clean(res: Dict[str, Any]) -> None:
    assert res["host_in_use_bytes"] == 0, res
    assert res["resident_swap_bytes"] == 0, res
    assert res["current_group"] is None, res


# ---------------------------------------------------------------------------------------------
# DDP and FSDP2
# ---------------------------------------------------------------------------------------------
@uses("ddp")
def test_ddp_recompute_and_swap_match_single_process(dist_results):
    for res in results(dist_results, "ddp"):
        assert res["max_diff"] <= ATOL, res
        # On CPU backward loads each tensor when autograd uses it, and the checkpointed layers'
        # early stop never asks for their last swapped matmul output: it is not loaded at all.
        assert 0 < res["loaded_bytes"] <= res["offloaded_bytes"], res
        assert res["kept_bytes"].get("parameter", 0) > 0, res  # parameters are never candidates
        assert res["kept_bytes"].get("shared", 0) > 0, res     # the mask / layer inputs stay
        _assert_clean(res)


@uses("fsdp2")
def test_fsdp2_recompute_and_swap_match_single_process(dist_results):
    for res in results(dist_results, "fsdp2"):
        assert res["max_diff"] <= ATOL, res
        assert res["offloaded_after_forward"] > 0, res
        # unsharded parameters (views of FSDP's all-gather outputs) are kept, and stay intact
        assert res["kept_bytes"].get("parameter", 0) > 0, res
        assert res["params_intact_after_offload"], res
        _assert_clean(res)


@uses("wrong_order")
def test_shard_first_then_wrap_layers_works(dist_results):
    for res in results(dist_results, "wrong_order"):
        for kind in ("fsdp2", "ddp"):
            assert res[kind]["ok"], res[kind]
            assert res[kind]["max_diff"] <= ATOL, res[kind]
            assert res[kind]["offloaded_bytes"] > 0, res[kind]


@uses("wrong_order")
def test_selective_checkpoint_around_fsdp_units_fails_clearly(dist_results):
    for res in results(dist_results, "wrong_order"):
        outcome = res["fsdp2_root_selective"]
        assert not outcome["ok"]
        assert "fully_shard" in outcome["error"] or "FSDP" in outcome["error"], outcome["error"]


# ---------------------------------------------------------------------------------------------
# pipeline parallelism
# ---------------------------------------------------------------------------------------------
def _pipeline(dist_results) -> List[Dict[str, Dict[str, Any]]]:
    per_rank = results(dist_results, "pipeline")
    return [{k: v for k, v in r.items() if isinstance(v, dict)} for r in per_rank]


@uses("pipeline")
def test_pipeline_matches_non_pipelined_reference(dist_results):
    for rank, configs in enumerate(_pipeline(dist_results)):
        assert set(configs) == {f"{s}-{p}" for s, p in dist_utils.PIPELINE_CONFIGS}
        for name, res in configs.items():
            assert res["max_diff"] <= ATOL, (rank, name, res)
            if res["prefetch"] is not None and res["schedule"] == "gpipe":
                assert res["offloaded_bytes"] > 0, (rank, name, res)


@uses("pipeline")
def test_pipeline_swapped_bytes_on_device_are_bounded(dist_results):
    n_mb = dist_utils.N_MB
    for rank, configs in enumerate(_pipeline(dist_results)):
        mb = configs["gpipe-None"]["microbatch_swap_bytes"]
        assert mb > 0
        # without the helper GPipe keeps every microbatch's activations on the device
        assert configs["gpipe-None"]["peak_resident_swap_bytes"] == n_mb * mb, (rank, configs["gpipe-None"])
        for name, res in configs.items():
            p = res["prefetch"]
            if p is None:
                continue
            assert res["peak_resident_swap_bytes"] <= (p + 1) * mb, (rank, name, res)
            assert res["sched_peak_microbatches"] <= p + 1, (rank, name, res)
            assert res["sched_peak_bytes"] <= (p + 1) * mb, (rank, name, res)
        # GPipe: the bound is reached, and is the knob
        assert configs["gpipe-1"]["peak_resident_swap_bytes"] == 2 * mb
        assert configs["gpipe-2"]["peak_resident_swap_bytes"] == 3 * mb
        # 1F1B with prefetch=0 keeps one microbatch on the first stage instead of two
        if rank == 0:
            assert configs["1f1b-None"]["peak_resident_swap_bytes"] == 2 * mb
            assert configs["1f1b-0"]["peak_resident_swap_bytes"] == mb


@uses("pipeline")
def test_pipeline_groups_of_a_finished_step_are_gone(dist_results):
    for rank, configs in enumerate(_pipeline(dist_results)):
        for name, res in configs.items():
            assert res["groups_after_step"] == [[], []], (rank, name, res)
            assert res["host_in_use_bytes"] == 0, (rank, name, res)
            if res["prefetch"] is not None:
                assert res["steps"] == 2, (rank, name, res)


@uses("pipeline")
def test_pipeline_last_stage_of_1f1b_offloads_nothing(dist_results):
    # F_i is immediately followed by B_i there: copying out what is needed next would be waste
    last = _pipeline(dist_results)[1]
    assert last["1f1b-1"]["offloads"] == 0 and last["1f1b-1"]["cancelled"] == 0


# ---------------------------------------------------------------------------------------------
# zero-bubble schedules (split backward): one recomputation per micro-batch per stage
# ---------------------------------------------------------------------------------------------
def _zero_bubble(dist_results) -> List[Dict[str, Dict[str, Any]]]:
    per_rank = results(dist_results, "zero_bubble")
    return [{k: v for k, v in r.items() if isinstance(v, dict)} for r in per_rank]


@uses("zero_bubble")
def test_zero_bubble_schedules_match_single_process(dist_results):
    for rank, configs in enumerate(_zero_bubble(dist_results)):
        assert set(configs) == {f"{k}-{w}-{a}" for k, w, a in dist_utils.ZB_CONFIGS}
        for name, res in configs.items():
            assert res["max_diff"] <= ATOL, (rank, name, res["max_diff"])


@uses("zero_bubble")
def test_zero_bubble_recomputes_once_per_microbatch_per_stage(dist_results):
    """``gelu`` runs in forward and when a region is recomputed (backward runs ``gelu_backward``);
    each stage has its own hidden size, so the op counts say which stage ran it. Step 1 is counted
    (step 0 adds the stages' shape inference: one more forward, and one more backward on every
    stage but the first)."""
    n = dist_utils.ZB_MB
    for rank, configs in enumerate(_zero_bubble(dist_results)):
        for name, res in configs.items():
            counts = res["gelu_per_step"][1]
            assert len(counts) == 2, (rank, name, counts)  # two stages per rank
            expected = n if res["wrap"] is None else 2 * n  # forward + exactly one recomputation
            assert all(c == expected for c in counts.values()), (rank, name, counts)


@uses("zero_bubble")
def test_zero_bubble_frees_what_the_weight_half_needed(dist_results):
    """After each step, the live bytes the step created (gradients, losses, outputs) are those of
    the same schedule without checkpointing: no recomputed activation, kept op output, swap
    group or host buffer survives the step, and no recompute session is left open."""
    for rank, configs in enumerate(_zero_bubble(dist_results)):
        baseline = configs["izb-None-None"]["live_bytes_after_step"]
        zbv = configs["zbv-whole-recompute"]["live_bytes_after_step"]
        for name, res in configs.items():
            assert res["live_bytes_after_step"] == (baseline if res["kind"] == "izb" else zbv), (rank, name, res)
            assert res["open_sessions"] == 0 and res["groups_after"] == [], (rank, name, res)
            assert res["host_in_use_bytes"] == 0, (rank, name, res)
            if res["adapter"] == "swap":
                assert res["offloaded_bytes"] > 0, (rank, name, res)
            if res["adapter"] is not None:
                assert "already has pipeline_swap or pipeline_recompute" in res["second_adapter_error"], res


# ---------------------------------------------------------------------------------------------
# tensor parallelism: recomputation never re-runs a collective
# ---------------------------------------------------------------------------------------------
@uses("tp_collectives")
def test_tensor_parallel_recompute_issues_no_extra_collectives(dist_results):
    for rank, modes in enumerate(results(dist_results, "tp_collectives")):
        plain = modes["plain"]
        assert plain["forward"] == {"all_reduce": 2, "wait_tensor": 2, "gelu": 2}, plain["forward"]
        for mode in ("prefer_recompute", "keep_collectives"):
            res = modes[mode]
            assert res["forward"] == plain["forward"], (rank, mode, res["forward"])
            # the backward's own all-reduces (column-parallel input gradients) and nothing more
            assert res["backward"]["all_reduce"] == plain["backward"]["all_reduce"], (rank, mode, res)
            assert res["backward"]["wait_tensor"] == plain["backward"]["wait_tensor"], (rank, mode, res)
            assert res["backward"]["gelu"] == 2, (rank, mode, res)  # the rest was recomputed
        # documented: whole-region recompute (no policy) re-runs the first block's all-reduce
        # (the second one comes after the region's last saved tensor: early stop skips it)
        assert modes["whole"]["backward"]["all_reduce"] == plain["backward"]["all_reduce"] + 1
        for mode in ("plain", "prefer_recompute", "keep_collectives", "whole"):
            res = modes[mode]
            assert res["grads"] == plain["grads"], (rank, mode)   # bit for bit
            assert res["max_diff_single_process"] <= ATOL, (rank, mode, res["max_diff_single_process"])


# ---------------------------------------------------------------------------------------------
# faults
# ---------------------------------------------------------------------------------------------
@uses("fault_ddp")
def test_rank_raising_mid_step_leaves_no_swap_state(dist_results):
    for rank, res in enumerate(results(dist_results, "fault_ddp")):
        assert [a["step"] for a in res["after_abort"]] == [1, 2], res
        for snap in res["after_abort"]:
            assert all(n == 0 for n in snap["counts"].values()), (rank, snap)
            _assert_clean(snap)
        # the retried steps (one recovered by dropping tensors, one by reset + re-chain) match
        assert res["max_diff"] <= ATOL, (rank, res["max_diff"])


@uses("fault_pipeline")
def test_pipeline_step_aborted_and_retried(dist_results):
    for rank, res in enumerate(results(dist_results, "fault_pipeline")):
        assert len(res["aborts"]) == 1, res
        snap = res["aborts"][0]
        assert snap["step"] == 1 and snap["sched_aborts"] == 1, snap
        assert snap["internal_losses"] == 0 and snap["fwd_cache"] == 0, snap
        assert not [g for g in snap["groups"] if g.startswith("pp")], snap
        assert all(n == 0 for n in snap["counts"].values()), snap
        _assert_clean(snap)
        assert res["groups_after"] == []
        assert res["max_diff"] <= ATOL, (rank, res["max_diff"])


# ---------------------------------------------------------------------------------------------
# MicrobatchSwapSchedule, driven by hand in this process
# ---------------------------------------------------------------------------------------------
def _block(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return swap_wrapper(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)))


def _inputs(n: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def _reference_grads(n: int) -> List[torch.Tensor]:
    block = _block()
    for x in _inputs(n):
        block(x).pow(2).sum().backward()
    return [p.grad.clone() for p in block.parameters()]


def _drive(order: List[Any], prefetch: int, n: int = 4, measure: bool = True):
    """Run ``order`` (("F", i) / ("B", i)) with one schedule; returns (schedule, grads, peak microbatches
    observed in resident_swap_bytes at every event)."""
    block = _block()
    sched = MicrobatchSwapSchedule(SwapManager(), prefix="t.", prefetch=prefetch, measure_bytes=measure)
    xs = _inputs(n)
    losses: Dict[int, torch.Tensor] = {}
    mb_bytes = 0
    for kind, i in order:
        if kind == "F":
            sched.forward_start(i)
            losses[i] = block(xs[i]).pow(2).sum()
            sched.forward_end(i)
            mb_bytes = max(mb_bytes, resident_swap_bytes(SwapManager(), sched.group_name(i)))
        else:
            sched.backward_start(i)
            assert sched.state(i) == "device"
            losses.pop(i).backward()
            sched.backward_end(i)
    sched.step_end()
    return sched, [p.grad.clone() for p in block.parameters()], mb_bytes


GPIPE = [("F", i) for i in range(4)] + [("B", i) for i in range(4)]
ONE_F_ONE_B_FIRST = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
ONE_F_ONE_B_LAST = [x for i in range(4) for x in (("F", i), ("B", i))]


@pytest.mark.parametrize("order", [GPIPE, ONE_F_ONE_B_FIRST, ONE_F_ONE_B_LAST], ids=["gpipe", "1f1b-first", "1f1b-last"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_schedule_keeps_gradients_and_bound(order, prefetch):
    sched, grads, mb_bytes = _drive(order, prefetch)
    for a, b in zip(grads, _reference_grads(4)):
        assert torch.equal(a, b)
    assert sched.peak_resident_microbatches <= prefetch + 1
    assert 0 < sched.peak_resident_bytes <= (prefetch + 1) * mb_bytes
    assert not [n for n in SwapManager().group_names() if n.startswith("t.")]
    assert SwapManager().stats()["host_pool"]["in_use_bytes"] == 0
    if order is ONE_F_ONE_B_LAST:
        assert sched.offloads == 0
    if order is GPIPE:
        assert sched.offloads == 4 and sched.loads == 4 and sched.cancelled == 0
        assert sched.peak_resident_microbatches == prefetch + 1


def test_schedule_byte_measurement_is_opt_in():
    sched, _, _ = _drive(GPIPE, 1, measure=False)
    assert sched.peak_resident_bytes == 0 and sched.peak_resident_microbatches == 2


def test_schedule_abort_mid_forward_restores_and_frees():
    block = _block()
    mgr = SwapManager()
    mgr.set_current_group_name("outer")
    sched = MicrobatchSwapSchedule(mgr, prefix="t.", prefetch=1)
    xs = _inputs(3)
    kept = []
    for i in range(2):
        sched.forward_start(i)
        kept.append(block(xs[i]).sum())
        sched.forward_end(i)
    sched.forward_start(2)
    try:
        block(xs[2])
        raise RuntimeError("boom")
    except RuntimeError:
        sched.forward_end(2, failed=True)
        sched.abort()
    assert mgr.get_current_group_name() == "outer"
    assert not [n for n in mgr.group_names() if n.startswith("t.")]
    assert sched.aborts == 1 and not sched.active
    del kept
    gc.collect()
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0
    # the schedule is usable again, with the same microbatch ids
    sched.forward_start(0)
    loss = block(xs[0]).sum()
    sched.forward_end(0)
    sched.backward_start(0)
    loss.backward()
    sched.backward_end(0)
    sched.step_end()
    sched.abort()  # idempotent, counts nothing when there is no state
    assert sched.aborts == 1 and sched.steps == 1
    mgr.set_current_group_name(None)


def test_schedule_misuse_is_an_error():
    mgr = SwapManager()
    with pytest.raises(ValueError, match="prefetch"):
        MicrobatchSwapSchedule(mgr, "t.", prefetch=-1)
    with pytest.raises(TypeError, match="prefix"):
        MicrobatchSwapSchedule(mgr, "", prefetch=1)
    sched = MicrobatchSwapSchedule(mgr, "t.", prefetch=1)
    with pytest.raises(RuntimeError, match="never forwarded"):
        sched.backward_start(0)
    with pytest.raises(RuntimeError, match="without forward_start"):
        sched.forward_end(0)
    sched.forward_start(0)
    with pytest.raises(RuntimeError, match="has not ended"):
        sched.forward_start(1)
    sched.forward_end(0)
    with pytest.raises(RuntimeError, match="already forwarded"):
        sched.forward_start(0)
    sched.abort()


def test_pipeline_swap_rejects_non_schedules():
    from hyper_parallel.core.activation_checkpoint import pipeline_recompute, pipeline_swap
    with pytest.raises(TypeError, match="schedule"):
        pipeline_swap(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="schedule"):
        pipeline_recompute(torch.nn.Linear(2, 2))
