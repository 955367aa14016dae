"""Ordering points that the broad mutation tests (``tests/test_stream_mutations.py``) do not reach:
the hazard classes of host buffers reused across copy streams and devices, storages saved or
allocated on side streams, launches split over several copy streams, partial cancels, and the
layer chain's prefetch of one forward among several. Today's code is correct at each; each test
here runs one schedule on the simulated device, checks it is clean and exact, and fails when the
one point it protects is mutated. Its docstring names that mutation (solo: each storage copied
by itself; buckets: the toy's small storages share one host buffer, whose guard is the bucket's);
each was applied by hand and seen to fail the test."""

from __future__ import annotations

import gc

import pytest

from hyper_parallel.core.activation_checkpoint import SwapManager

from support import sim_scenarios as sc


@pytest.fixture(autouse=True, params=[0, 1 << 20], ids=["solo", "buckets"])
def bucketing(request, monkeypatch):
    """Each schedule runs twice: every storage copied by itself, and in buckets."""
    monkeypatch.setattr(sc, "BUCKET_BYTES", request.param)
    return request.param


def _assert_clean(scenario):
    """Run ``scenario`` on a fresh simulated device: no stream hazard, nothing poisoned, no host
    buffer left in use, and (if it returns gradients) gradients equal to the unwrapped net's."""
    pool = {}

    def run(sim):
        result = scenario(sim)
        gc.collect()  # (every graph of the schedule is dead by now: each host buffer is back)
        pool.update(SwapManager().stats()["host_pool"])
        return result

    result, violations, sim = sc.run_simulated(run)
    assert not violations, violations[:2]
    assert not isinstance(result, Exception), repr(result)
    assert sim.counts["poisoned"] == 0, sim.counts
    assert pool["in_use_bytes"] == 0, pool
    if result is not None:
        assert sc.equal_grads(result)
    return sim


def test_cancelled_offload_buffer_is_guarded(bucketing):
    """Class 1: a cancelled offload's host buffer goes back to the pool guarded by its D2H event;
    a later offload on another copy stream that reuses it waits that event.

    Caught mutations: ``t.set_copy_event(event)`` deleted in ``SwapGroup._issued`` (solo and
    buckets: the D2H of ``b`` on copy1 writes the buffer before the cancelled D2H on copy0 is
    known to be done); solo: ``self._release_host(self._host_guard)`` -> ``_release_host(None)`` in
    ``SwapTensor.cancel_offload``. (In buckets the latter is backed up by the bucket's guard,
    which ``set_copy_event`` set.)"""
    _assert_clean(sc.cancelled_offload_buffer_reused)


def test_failed_copy_returns_its_buffer_guarded(bucketing):
    """Class 2: a copy that fails gives its host buffer back guarded by an event of its copy
    stream, which had waited the buffer's old guard (an abandoned H2D on copy0 still reading it):
    the offload on copy2 that takes the buffer next is ordered after that H2D.

    Caught mutation: the guard of the failure-path release -> ``None``: solo,
    ``self.pool.release(host, t.nbytes, None)`` in ``SwapGroup._start_offloads``'s solo branch;
    buckets, ``bucket.release(None)`` in its bucket branch (the D2H on copy2 rewrites the buffer
    before the H2D on copy0 that reads it is known to be done). Buckets also: that release
    deleted (the bucket's buffer is never given back: the pool is not idle at the end)."""
    _assert_clean(sc.failed_copy_buffer_reused)


def test_reload_remembers_its_own_copy_stream(bucketing):
    """Class 3: a storage offloaded on copy0 and loaded on copy1 whose graph dies mid-H2D is
    ``record_stream``-ed on copy1, the stream of the load.

    Caught mutation: ``self._copy_stream = copy_stream`` deleted in ``SwapTensor.copy_in`` (the
    offload's copy0 is remembered: the destination is freed while the H2D on copy1 writes it)."""
    sim = _assert_clean(sc.reload_on_another_copy_stream_dies)
    assert sim.counts["record_stream"] > 0


def test_host_buffer_of_one_device_is_guarded_for_another(bucketing):
    """Class 4: host buffers are one pool for all devices. A buffer that device 0's reload read
    goes back guarded by that H2D's event, so device 1's offload into it waits the event (device
    1's copy stream waits only device 1's compute, which never waited device 0).

    Caught mutation: solo, ``self._release_host(self._host_guard)`` -> ``_release_host(None)`` in
    ``SwapTensor.wait_load``; buckets, ``self._pool.release(self.host, self.nbytes, None)`` in
    ``HostBucket.release`` (the D2H on copy0@dev1 rewrites the buffer before the H2D on
    copy0@dev0 that reads it is known to be done). On one device either is only a backup: the
    next offload's copy stream waits compute, which waited the H2D."""
    sim = _assert_clean(sc.host_buffer_shared_by_two_devices)
    assert {s.device for s in sim.streams if s.kind == "copy" and s.copies} == {0, 1}


def test_load_waited_on_another_stream_protects_its_blocks(bucketing):
    """Class 5: a load launched on the default stream and waited on stream ``other``: the
    destinations belong to the default stream's pool, which never waited the H2D, so they are
    ``record_stream``-ed on ``other``; the graph then dies before any unpack.

    Caught mutation: ``self._protect(self._block, waiter)`` deleted in ``SwapTensor.wait_load``
    (the blocks are freed while the H2D on copy0 is not ordered before the free, and nothing else
    protects them: no unpack ran, so ``_order_use_after_load`` never did)."""
    sim = _assert_clean(sc.load_waited_on_another_stream_graph_dies)
    assert sim.counts["record_stream"] > 0


# ------------------------------------------------------------------ found by the mutation runner
def test_storage_saved_on_two_streams_is_protected(bucketing):
    """A storage saved on the default stream and again on a side stream, released (wait_offload on
    the default stream) before that stream waits the side stream: the copy stream waits both
    producers, and the source is ``record_stream``-ed on it, which covers the side stream's read.

    Caught mutation: ``self.producers.append(stream)`` deleted, or ``stream = facts.stream`` ->
    ``None``, in ``SwapTensor.add_alias`` (the side stream is not known as a producer: nothing
    protects the source, freed while ``aten.cos`` on compute1 may still read it)."""
    _assert_clean(sc.storage_saved_on_two_streams)


def test_graph_dying_mid_d2h_protects_its_sources(bucketing):
    """An abandoned step: the graph dies while its offload is in flight, and with it the sources
    the D2H still reads; ``SwapTensor.__del__`` ``record_stream``-s each on the copy stream.

    Caught mutation: ``self._protect(self._src, self._copy_stream)`` deleted in
    ``SwapTensor.__del__`` (a source freed while the D2H on copy0 reads it: poisoned)."""
    sim = _assert_clean(sc.graph_dies_mid_d2h)
    assert sim.counts["record_stream"] > 0


# ------------------------------------------------------------------ launches on several copy streams
def test_one_wait_waits_a_load_split_over_two_copy_streams(bucketing):
    """A load split in two launches, on copy streams 1 and 2 (``limit_bytes``, then the rest), and
    one ``wait_load``: compute waits both launches' events, not only the last one's (a copy
    stream orders only its own copies).

    Caught mutation: ``SwapGroup._wait`` waiting only the last event per device (the first
    half's H2D on copy1 is never waited: backward reads the fresh 0xFF destinations)."""
    _assert_clean(sc.load_split_over_two_copy_streams)


def test_one_wait_waits_two_offload_launches_on_two_copy_streams(bucketing):
    """Two forwards into one group, offloaded on copy streams 1 and 2, then one ``wait_offload``:
    both launches' D2H are waited before their sources are released.

    Caught mutation: ``SwapGroup._wait`` waiting only the last event per device (the first
    forward's sources are freed while their D2H on copy1 is queued: poisoned)."""
    result, violations, sim = sc.run_simulated(sc.two_offload_launches_one_wait)
    assert not violations, violations[:2]
    assert sim.counts["poisoned"] == 0, sim.counts
    assert not isinstance(result, Exception), repr(result)
    assert sc.equal_grads(result, sc.reference_two_forwards())


def test_a_partial_cancel_drops_only_the_cancelled_part(bucketing):
    """A load of the tensors backward needs first while the group's offload is in flight cancels
    those offloads only: ``wait_offload`` then waits the rest and releases it, so only the
    cancelled bytes stay on the device.

    Caught mutation: ``SwapGroup._cancel_offloads`` dropping the whole flight (``wait_offload``
    raises a false "cancelled" error and the other tensors' sources are never released)."""
    out = {}

    def run(sim):
        result, resident = sc.partial_cancel(sim)
        out.update(resident)
        return result

    _assert_clean(run)
    assert 0 < out["after_wait_offload"] <= out["limit"] < out["forward"], out


def test_a_source_allocated_on_a_side_stream_is_protected(bucketing):
    """A storage allocated and saved on a side stream and saved again on the default stream,
    whose offload is waited on the default stream: its block goes back to the side stream's
    pool, which never waited the D2H, so it is ``record_stream``-ed on the copy stream.

    Caught mutation: ``any`` -> ``all`` in ``SwapTensor.wait_offload`` (one producer is the
    waiter, so nothing protects the block: freed while the D2H on copy0 is not ordered before)."""
    sim = _assert_clean(sc.allocated_on_a_side_stream)
    assert sim.counts["record_stream"] > 0


def test_a_backward_prefetches_only_the_forward_that_fed_it(bucketing):
    """Two forwards of a chained net alive, then the second one's backward: each layer's backward
    prefetches the predecessor's forward that fed it, so the first forward's offloaded layers
    stay on the host (what is resident after that backward is the first forward's last layer,
    which the chain never offloads).

    Caught mutation: ``LayerChain.backward_start`` loading every forward of the predecessor
    (``theirs = None``: the first forward's layers come back early)."""
    out = {}

    def run(sim):
        result, resident = sc.two_forwards_then_the_second_backward(sim)
        out.update(resident)
        return result

    result, violations, sim = sc.run_simulated(run)
    assert not violations, violations[:2]
    assert not isinstance(result, Exception), repr(result)
    assert sc.equal_grads(result, sc.reference_two_forwards())
    assert out["first_forward"] < out["both_forwards"]
    assert 0 < out["second_backward"] == out["second_backward_last_layer"], out
