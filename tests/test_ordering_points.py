"""The five hazard classes of issue 25: ordering points that no test caught when the *code* was
mutated (``python -m hyper_parallel.testing.mutations``). Today's code is correct at each of them;
each test here runs one schedule on the simulated device, checks it is clean and exact, and fails
when the one point it protects is mutated. Its docstring names that mutation (solo: each storage
copied by itself; buckets: the toy's small storages share one host buffer, whose guard is the
bucket's); each was applied by hand once and seen to fail the test, and the mutation runner
applies them all again."""

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
