"""Schedules run on the simulated asynchronous device with the stream-ordering checker on, bit for
bit against the unwrapped model: the RFC self-test's swap modes, the micro-batch (pipeline)
schedules, several compute streams, and random copy timings.

The engine, lifecycle, safety, layer-chain, swap-wrapper and RFC mixed-wrapping modules run
under the simulator too: they are marked ``sim_device`` (their ``[sim]`` test ids)."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from hyper_parallel.bench.model import GPT, GPTConfig, train_steps
from hyper_parallel.bench.modes import apply_mode
from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper
from hyper_parallel.core.microbatch_schedule import MicrobatchSwapSchedule
from hyper_parallel.testing import per_layer_streams, simulated_device

from support import sim_scenarios as sc

CFG = GPTConfig(vocab=64, dim=32, heads=2, layers=3, seq=16, dropout=0.1)
_BASE: Dict[int, Any] = {}


def _train(model: torch.nn.Module, steps: int = 2, on_step: Any = None) -> tuple:
    losses = train_steps(model, steps, 2, 1e-3, 7, "cpu", on_step=on_step)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _baseline() -> tuple:
    if not _BASE:
        _BASE[0] = _train(GPT(CFG, seed=3))
    return _BASE[0]


def _assert_same(got: tuple, base: tuple) -> None:
    assert got[0] == base[0]
    for k in base[1]:
        assert torch.equal(got[1][k], base[1][k]), k


# ------------------------------------------------------------------------------ the RFC's swap modes
@pytest.mark.parametrize("mode,swap_wrapper_mode", [("swap", False), ("funcswap", False), ("swap", True),
                                                    ("swap_with_policy", True)])
def test_rfc_swap_modes_on_the_simulated_device(mode, swap_wrapper_mode):
    base = _baseline()
    with simulated_device() as sim:
        model = apply_mode(GPT(CFG, seed=3), mode, swap_wrapper=swap_wrapper_mode,
                           **({"swap_threshold_bytes": 4096} if mode == "swap_with_policy" else {}))
        got = _train(model)
        stats = SwapManager().stats()
        assert stats["offloaded_bytes"] > 0 and stats["loaded_bytes"] == stats["offloaded_bytes"]
        assert sim.counts["queued_copies"] > 0 and sim.counts["eager_copies"] == 0
    _assert_same(got, base)


@pytest.mark.parametrize("seed", [0, 1])
def test_rfc_swap_mode_with_random_copy_timing(seed):
    """Copies also run at random earlier points (seeded): any order the events allow."""
    base = _baseline()
    with simulated_device(seed=seed, delay_prob=0.5):
        got = _train(apply_mode(GPT(CFG, seed=3), "swap"))
    _assert_same(got, base)


def test_rfc_swap_mode_with_each_layer_on_its_own_stream():
    """Several compute streams: each layer's forward (and its recomputation and backward) on its
    own stream, the layer chain offloading on one and prefetching on another."""
    base = _baseline()
    with simulated_device() as sim:
        model = apply_mode(GPT(CFG, seed=3), "swap")
        per_layer_streams(sim, model.layers)
        # The gradients are made on the layers' streams and read by the optimizer on the default
        # one: a step ends with a device synchronize, as a real training loop's does.
        got = _train(model, on_step=lambda i, loss: sim.synchronize())
    _assert_same(got, base)


# ------------------------------------------------------------------------------ micro-batch schedules
def _block() -> torch.nn.Module:
    torch.manual_seed(0)
    return swap_wrapper(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)))


def _inputs(n: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def _drive(order, prefetch: int, n: int = 4) -> List[torch.Tensor]:
    block = _block()
    sched = MicrobatchSwapSchedule(SwapManager(), prefix="t.", prefetch=prefetch)
    xs = _inputs(n)
    losses: Dict[int, torch.Tensor] = {}
    for kind, i in order:
        if kind == "F":
            sched.forward_start(i)
            losses[i] = block(xs[i]).pow(2).sum()
            sched.forward_end(i)
        else:
            sched.backward_start(i)
            losses.pop(i).backward()
            sched.backward_end(i)
    sched.step_end()
    assert sched.peak_resident_microbatches <= prefetch + 1
    return [p.grad.clone() for p in block.parameters()]


GPIPE = [("F", i) for i in range(4)] + [("B", i) for i in range(4)]
ONE_F_ONE_B = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]


@pytest.mark.parametrize("order,prefetch", [(GPIPE, 0), (GPIPE, 1), (GPIPE, 2), (ONE_F_ONE_B, 1)],
                         ids=["gpipe-0", "gpipe-1", "gpipe-2", "1f1b-1"])
def test_microbatch_schedule_on_the_simulated_device(order, prefetch):
    ref = _drive(order, prefetch)  # CPU backend (no swap ordering to get wrong)
    SwapManager().reset()
    with simulated_device() as sim:
        got = _drive(order, prefetch)
        assert sim.counts["queued_copies"] > 0
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert SwapManager().stats()["host_pool"]["in_use_bytes"] == 0


def test_microbatch_schedule_abort_mid_step_on_the_simulated_device():
    """An exception mid-step: the schedule aborts with copies in flight; nothing is left behind
    and the next step is exact."""
    with simulated_device():
        block = _block()
        mgr = SwapManager()
        sched = MicrobatchSwapSchedule(mgr, prefix="t.", prefetch=1)
        xs = _inputs(3)
        kept = []
        for i in range(2):
            sched.forward_start(i)
            kept.append(block(xs[i]).sum())
            sched.forward_end(i)
        sched.forward_start(2)
        sched.forward_end(2, failed=True)
        sched.abort()
        del kept
        assert not [n for n in mgr.group_names() if n.startswith("t.")]
        got = _drive(GPIPE, 1)
    assert all(torch.equal(a, b) for a, b in zip(got, _drive(GPIPE, 1)))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_microbatch_schedule_abort_leaves_no_copy_in_flight(where):
    """``abort()`` waits what is in flight before it drops the groups: right after it no copy is
    queued on any stream (the graphs of the aborted step are still alive, so nothing else would
    wait them). ``forward``: aborted while micro-batch 1's offload is in flight (a forward
    raised); ``backward``: while micro-batch 1's prefetch is in flight.

    Caught mutation: the ``_wait_offload`` (forward) or ``_wait_load`` (backward) call of
    ``MicrobatchSwapSchedule._finish`` deleted (the copies stay queued)."""
    with simulated_device() as sim:
        block = _block()
        sched = MicrobatchSwapSchedule(SwapManager(), prefix="t.", prefetch=1)
        xs = _inputs(3)
        kept = []
        for i in range(3 if where == "backward" else 2):
            sched.forward_start(i)
            kept.append(block(xs[i]).sum())
            sched.forward_end(i)
        if where == "forward":
            sched.forward_start(2)
            sched.forward_end(2, failed=True)
            assert sched.state(1) == "offloading"
        else:
            sched.backward_start(0)
            assert sched.state(1) == "loading"
        assert sim.pending_copies() > 0
        sched.abort()
        assert sim.pending_copies() == 0
        del kept
