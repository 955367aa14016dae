"""The simulated asynchronous device itself (``hyper_parallel.testing``), on hand-written stream
programs: every missing wait shows as poison or as a hazard, and correct programs are clean."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.core.backend import Backend
from hyper_parallel.testing import POISON_BYTE, SimDevice, StreamHazard


@pytest.fixture
def dev():
    sim = SimDevice(strict=False)
    with sim.checking():
        yield sim


def _meta(sim, t):
    """What ``empty_device_bytes`` needs to allocate like ``t`` (a swap candidate's view meta)."""
    return sim.saved_facts(t, ()).meta


def _d2h(sim, src, copy):
    host = sim.empty_host_bytes(src.untyped_storage().nbytes())
    sim.wait_event(copy, sim.record_event(sim.current_stream()))
    with sim.stream_context(copy):
        sim.copy_bytes(host, src)
    return host, sim.record_event(copy)


def test_is_a_backend():
    assert isinstance(SimDevice(), Backend)


def test_fresh_device_memory_is_poison(dev):
    t = dev.empty_device_bytes(8, _meta(dev, torch.zeros(2)))
    assert t.tolist() == [POISON_BYTE] * 8
    f = torch.empty(3)
    assert torch.isnan(f).all()


def test_queued_copy_runs_only_when_a_wait_forces_it(dev):
    src = torch.arange(4.0)
    copy = dev.new_copy_stream()
    host, done = _d2h(dev, src, copy)
    assert dev.pending_copies() == 1 and not done.query()
    dev.wait_event(dev.current_stream(), done)
    assert dev.pending_copies() == 0 and done.query()
    assert torch.equal(host.view(torch.float32), src)
    assert not dev.violations


def test_reading_a_reload_without_waiting_reads_poison_and_is_a_hazard(dev):
    src = torch.arange(4.0)
    copy = dev.new_copy_stream()
    host, done = _d2h(dev, src, copy)
    dev.wait_event(dev.current_stream(), done)
    dst = dev.empty_device_bytes(16, _meta(dev, src))
    dev.wait_event(copy, dev.record_event(dev.current_stream()))
    with dev.stream_context(copy):
        dev.copy_bytes(dst, host)
    # no wait on the load: compute reads the fresh (poisoned) destination
    value = dst.view(torch.float32) * 1
    assert torch.isnan(value).all()
    assert any("not ordered after its write by the H2D copy" in v for v in dev.violations)


def test_freeing_a_source_under_a_queued_d2h_poisons_it(dev):
    copy = dev.new_copy_stream()
    src = torch.arange(4.0) * 1  # allocated on the compute stream, under the checker
    host, done = _d2h(dev, src, copy)
    del src  # no wait, no record_stream: the block may be reused before the copy reads it
    dev.synchronize()
    assert dev.counts["poisoned"] == 1
    assert torch.isnan(host.view(torch.float32)).all()
    assert any("was freed while the D2H copy" in v for v in dev.violations)


def test_record_stream_keeps_a_freed_source_for_its_copy(dev):
    copy = dev.new_copy_stream()
    src = torch.arange(4.0) * 1
    host, done = _d2h(dev, src, copy)
    dev.mark_used_by(src, copy)
    del src
    dev.synchronize()
    assert dev.counts["poisoned"] == 0 and not dev.violations
    assert torch.equal(host.view(torch.float32), torch.arange(4.0))


def test_copy_not_ordered_after_the_producer_is_a_hazard(dev):
    copy = dev.new_copy_stream()
    src = torch.arange(4.0) * 1
    host = dev.empty_host_bytes(16)
    with dev.stream_context(copy):  # no wait on compute first
        dev.copy_bytes(host, src)
    assert any("D2H copy on copy0@dev0 is not ordered after its write" in v for v in dev.violations)


def test_allocation_while_a_copy_stream_is_current_is_a_hazard(dev):
    copy = dev.new_copy_stream()
    like = _meta(dev, torch.zeros(1))
    with dev.stream_context(copy):
        dev.empty_device_bytes(8, like)
        torch.zeros(4) + 1
    assert sum("copy stream copy0@dev0 is current" in v for v in dev.violations) >= 2


def test_host_buffer_reused_by_another_copy_stream_before_its_read_is_done(dev):
    s1, s2 = dev.new_copy_stream(), dev.new_copy_stream()
    host = dev.empty_host_bytes(16)
    dst = dev.empty_device_bytes(16, _meta(dev, torch.zeros(4)))
    dev.wait_event(s1, dev.record_event(dev.current_stream()))
    with dev.stream_context(s1):
        dev.copy_bytes(dst, host)  # H2D reads the host buffer
    src = torch.arange(4.0) * 1
    dev.wait_event(s2, dev.record_event(dev.current_stream()))
    with dev.stream_context(s2):
        dev.copy_bytes(host, src)  # D2H overwrites it: not ordered after the read
    assert any("is reused (written by D2H copy on copy1@dev0) before the H2D copy" in v for v in dev.violations)


def test_strict_mode_raises_at_the_faulty_call():
    sim = SimDevice()
    copy = sim.new_copy_stream()
    with sim.checking():
        with pytest.raises(StreamHazard, match="copy stream copy0@dev0 is current"):
            with sim.stream_context(copy):
                sim.empty_device_bytes(8, _meta(sim, torch.zeros(1)))


def test_random_mode_is_deterministic_per_seed():
    def run(seed):
        sim = SimDevice(seed=seed, delay_prob=0.5, strict=False)
        order = []
        with sim.checking():
            copy = sim.new_copy_stream()
            for i in range(12):
                src = torch.full((4,), float(i))
                _d2h(sim, src, copy)
                order.append(sim.pending_copies())
            sim.synchronize()
        return order

    assert run(1) == run(1)
    assert run(1) != run(2) or run(3) != run(1)
    assert max(run(1)) < 12  # some copies ran early


def test_streams_and_events_across_two_copy_streams(dev):
    s1, s2 = dev.new_copy_stream(), dev.new_copy_stream()
    e1 = dev.record_event(s1)
    dev.wait_event(s2, e1)
    assert dev.is_ordered_after(s2, e1)
    assert dev.current_stream(1).device == 1 and dev.new_copy_stream(1).device == 1
