"""Mutation proof of the stream ordering: each test removes one wait or one ``record_stream`` of the
engine (monkeypatching its ordering-point method to a no-op) and shows that the simulated device
catches it -- as poisoned data (NaN or wrong gradients), as a hazard of the happens-before
checker, or both. ``test_scenario_is_clean`` shows that the same schedules are clean and exact
when nothing is removed. The ordering points are the rows of the stream-ordering table in
``docs/architecture.md``."""

from __future__ import annotations

import pytest

from hyper_parallel.core.host_pool import HostBufferPool
from hyper_parallel.core.swap_group import SwapGroup
from hyper_parallel.core.swap_tensor import SwapTensor

from support import sim_scenarios as sc

SCENARIOS = {
    "atomic": sc.atomic_round_trip,
    "chained": sc.chained_step,
    "layer_streams": lambda sim: sc.chained_step(sim, layer_streams=True),
    "cancel": sc.cancelled_offload,
    "dies_mid_h2d": sc.graph_dies_mid_h2d,
    "dies_mid_d2h": sc.graph_dies_mid_d2h,
    "side_stream": sc.side_stream_producer,
    "unordered_side_stream": sc.offload_from_an_unordered_stream,
    "other_consumer": sc.consumer_on_another_stream,
    "host_reuse": sc.host_buffer_reused_on_another_copy_stream,
}


@pytest.fixture(autouse=True, params=[0, 1 << 20], ids=["solo", "buckets"])
def bucketing(request, monkeypatch):
    """Every schedule and mutation runs twice: each storage copied by itself, and the toy's small
    storages in buckets (one host buffer and one load copy per region: ``core/swap_bucket.py``)."""
    monkeypatch.setattr(sc, "BUCKET_BYTES", request.param)
    return request.param


def _noop(*args, **kwargs):
    return None


def _caught(violations, needle):
    return [v for v in violations if needle in v]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_is_clean(name):
    result, violations, sim = sc.run_simulated(SCENARIOS[name])
    assert not violations, violations[:3]
    assert not isinstance(result, Exception), result
    if result is not None:
        assert sc.equal_grads(result)
    assert sim.counts["poisoned"] == 0


def test_without_copy_waits_compute_before_d2h(monkeypatch):
    """The D2H may read an activation before compute finished writing it: the checker sees a
    read on the copy stream not ordered after compute's write."""
    monkeypatch.setattr(SwapGroup, "_order_d2h_after_producers", _noop)
    result, violations, _ = sc.run_simulated(sc.atomic_round_trip)
    assert _caught(violations, "by D2H copy on copy0@dev0 is not ordered after its write"), violations[:2]


def test_without_compute_waits_d2h_before_source_release(monkeypatch):
    """The sources are freed while their D2H is still queued: the simulator poisons them (the
    block's next owner overwrites it), so the reloaded activations are NaN; the checker sees a
    free not ordered after the copy's read."""
    monkeypatch.setattr(SwapGroup, "_order_release_after_d2h", _noop)
    result, violations, sim = sc.run_simulated(sc.atomic_round_trip)
    assert sim.counts["poisoned"] > 0 and sc.has_nan(result)
    assert _caught(violations, "was freed while the D2H copy on copy0@dev0 was not ordered"), violations[:2]


def test_without_copy_waits_compute_after_reload_allocation(monkeypatch):
    """The H2D may write a destination block that compute work issued before its allocation still
    uses: the checker sees the copy's write not ordered after the allocation."""
    monkeypatch.setattr(SwapGroup, "_order_h2d_after_allocation", _noop)
    result, violations, _ = sc.run_simulated(sc.atomic_round_trip)
    assert _caught(violations, "by H2D copy on copy0@dev0 is not ordered after its write by the allocation"), \
        violations[:2]


def test_without_compute_waits_h2d_before_use(monkeypatch):
    """Backward reads the reload destinations before the queued H2D ran: they are still the fresh
    0xFF allocation (NaN), and the checker sees the read not ordered after the copy."""
    monkeypatch.setattr(SwapGroup, "_order_use_after_h2d", _noop)
    result, violations, _ = sc.run_simulated(sc.atomic_round_trip)
    assert sc.has_nan(result)
    assert _caught(violations, "is not ordered after its write by the H2D copy"), violations[:2]


def test_without_compute_waits_h2d_in_the_layer_chain(monkeypatch):
    """The same wait removed under the layer chain's schedule."""
    monkeypatch.setattr(SwapGroup, "_order_use_after_h2d", _noop)
    result, violations, _ = sc.run_simulated(sc.chained_step)
    assert not sc.equal_grads(result)
    assert _caught(violations, "is not ordered after its write by the H2D copy"), violations[:2]


def test_without_host_buffer_reuse_guard(monkeypatch):
    """A pooled host buffer whose H2D (copy stream 1, never waited: its graph died) may still be
    reading it is overwritten by a D2H on copy stream 2."""
    monkeypatch.setattr(HostBufferPool, "_order_reuse_after_guard", _noop)
    result, violations, _ = sc.run_simulated(sc.host_buffer_reused_on_another_copy_stream)
    assert _caught(violations, "is reused (written by D2H copy on copy1@dev0) before the H2D copy on copy0@dev0"), \
        violations[:2]


@pytest.mark.parametrize("name,needle", [
    ("dies_mid_h2d", "was freed while the H2D copy on copy0@dev0"),   # a destination dying mid-H2D
    ("dies_mid_d2h", "was freed while the D2H copy on copy0@dev0"),   # a source dying mid-D2H
    ("cancel", "was freed while the D2H copy on copy0@dev0"),         # a cancelled offload's source
    ("side_stream", "was freed while the D2H copy on copy0@dev0"),    # a source made on a side stream
    ("layer_streams", "was freed while the D2H copy on copy0@dev0"),  # sources of per-layer streams
    ("other_consumer", "(allocated on compute0@dev0) was freed while the aten"),  # a reload used elsewhere
], ids=["dies_mid_h2d", "dies_mid_d2h", "cancel", "side_stream", "layer_streams", "other_consumer"])
def test_without_record_stream(monkeypatch, name, needle):
    """Each place the engine calls ``record_stream`` (``SwapTensor._protect``), removed: a block is
    freed while another stream's copy or read of it may still be in flight."""
    monkeypatch.setattr(SwapTensor, "_protect", _noop)
    result, violations, _ = sc.run_simulated(SCENARIOS[name])
    assert _caught(violations, needle), violations[:2]


def test_without_consumer_stream_wait(monkeypatch):
    """A reloaded tensor unpacked on a stream that never waited the load (the backward of a forward
    run under another stream): the checker sees the read not ordered after the H2D."""
    monkeypatch.setattr(SwapTensor, "_order_use_after_load", _noop)
    result, violations, _ = sc.run_simulated(sc.consumer_on_another_stream)
    assert _caught(violations, "on compute1@dev0 is not ordered after its write by the H2D copy"), violations[:2]


def test_without_waiting_the_producer_side_stream(monkeypatch):
    """The copy stream waits only the current stream, not the side stream that produced the
    activations (and that the current stream was not ordered after)."""
    def current_only(self, copy_stream, device, tensors):
        p = self.backend
        p.wait_event(copy_stream, p.record_event(p.current_stream(device)))

    monkeypatch.setattr(SwapGroup, "_order_d2h_after_producers", current_only)
    result, violations, _ = sc.run_simulated(sc.offload_from_an_unordered_stream)
    assert _caught(violations, "by D2H copy on copy0@dev0 is not ordered after its write"), violations[:2]
