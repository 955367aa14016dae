"""The eight stream hazards of issue 11, each shown on the simulated device (``hyper_parallel.testing``).

Every test here failed before its fix (the failure is quoted in its docstring) and runs under the
happens-before checker: any unordered access, unsafe free or allocation on a copy stream fails it."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper
from hyper_parallel.core.swap_tensor import TensorState
from hyper_parallel.testing import simulated_device

from support import sim_scenarios as sc
from support.swap_models import ToyNet, add_swap, assert_tensors_equal, chain, grads, make_input

sim_only = pytest.mark.sim_only


def _group_tensors(name):
    return [t for s in SwapManager()._group(name).storages() for t in s.swap_tensors]


# ------------------------------------------------------------------------------ 1. side-stream producer
@sim_only
def test_h1_activation_produced_on_a_side_stream(sim):
    """Before: "device 0 storage ... (allocated on compute1@dev0) was freed while the D2H copy on
    copy0@dev0 was not ordered before the free": the source was released after a wait on the
    default stream only, while its block belongs to the side stream."""
    assert_tensors_equal(sc.side_stream_producer(sim), sc.reference_grads(), "grads")


@sim_only
def test_h1_each_layer_on_its_own_stream(sim):
    """Several compute streams: every layer's forward on its own stream, replayed there in
    backward, with the layer chain offloading and prefetching."""
    assert_tensors_equal(sc.chained_step(sim, layer_streams=True), sc.reference_grads(), "grads")


# ------------------------------------------------------------------------------ 2. consumer on another stream
@sim_only
def test_h2_backward_on_another_stream_than_wait_load(sim):
    """Before: "read of device 0 storage ... by aten.… on compute1@dev0 is not ordered after its
    write by the H2D copy on copy0@dev0": compute waited the load on the stream that called
    wait_load, not on the one that used the tensor."""
    assert_tensors_equal(sc.consumer_on_another_stream(sim), sc.reference_grads(), "grads")


# ------------------------------------------------------------------------------ 3. two devices
@sim_only
def test_h3_copy_streams_belong_to_the_tensors_device(sim):
    """A model on device 1 while device 0 is current (``model.to("cuda:1")`` without
    ``set_device``). Before: the copy stream was made on device 0, so no copy stream issued any
    copy (``copy_streams == []``): every copy of device-1 memory ran on device 1's compute stream,
    synchronously, with no overlap."""
    net = sc.swapped_net()
    sim.place(net, 1)
    chain(net.layers)
    x = sim.place(make_input(net), 1)
    assert sim.current_device() == 0
    net(x).backward()
    assert_tensors_equal(sim.place(grads(net), 0), sc.reference_grads(), "grads")
    copy_streams = [s for s in sim.streams if s.kind == "copy" and s.copies]
    assert copy_streams and all(s.device == 1 for s in copy_streams), copy_streams
    assert sim.counts["eager_copies"] == 0, sim.counts


# ------------------------------------------------------------------------------ 4. record_stream only when needed
@sim_only
def test_h4_no_record_stream_on_a_normal_reload(sim):
    """Before: one ``record_stream`` per reloaded tensor (``counts['record_stream'] == 9``), which
    keeps every reloaded block from reuse until the busy copy stream catches up."""
    assert_tensors_equal(sc.atomic_round_trip(sim), sc.reference_grads(), "grads")
    assert sim.counts["record_stream"] == 0, sim.counts


@sim_only
def test_h4_tensor_dying_mid_h2d_is_protected(sim):
    """A graph dropped while its load is in flight: its destinations are freed while the H2D still
    writes them, which is safe only with ``record_stream`` on the copy stream (the checker raises
    otherwise); exactly those tensors get one. (This passed before too, when every reload got a
    ``record_stream``: it keeps the fix of the test above from dropping the one that is needed.)"""
    sc.graph_dies_mid_h2d(sim)
    gc.collect()
    assert 0 < sim.counts["record_stream"] <= len(sc.reference_grads()) * 2
    assert SwapManager().stats()["host_pool"]["in_use_bytes"] == 0


# ------------------------------------------------------------------------------ 5. cancel
@sim_only
def test_h5_cancelled_offload_makes_compute_wait_for_nothing(sim):
    """Before: ``launch_load`` of a group whose offload was still in flight made the compute stream
    wait for that D2H (``is_ordered_after(compute, d2h) is True``), which it never needs."""
    mgr = SwapManager()
    net = sc.swapped_net()
    mgr.set_current_group_name("g")
    loss = net(make_input(net))
    mgr.set_current_group_name(None)
    mgr.launch_offload("g")
    copy = next(s for s in sim.streams if s.kind == "copy")
    d2h_done = copy.record_event()
    mgr.launch_load("g")  # cancels: the sources are still on the device
    compute = sim.current_stream()
    assert not sim.is_ordered_after(compute, d2h_done)
    assert all(t.state is TensorState.DEVICE for t in _group_tensors("g"))
    mgr.wait_load("g")
    loss.backward()
    del loss
    assert_tensors_equal(grads(net), sc.reference_grads(), "grads")
    # the sources die while the cancelled D2H may still read them: record_stream covers it
    sim.synchronize()


# ------------------------------------------------------------------------------ 6. failure mid-launch
def _failing_on(sim, primitive, nth):
    calls = [0]

    def hook(*args):
        calls[0] += 1
        if calls[0] == nth:
            raise RuntimeError(f"injected failure in {primitive}")

    sim.before_call[primitive] = hook


@sim_only
def test_h6_failure_on_the_second_copy_of_an_offload(sim):
    """Before: ``in_use_bytes`` was 6144 with one 2048-byte copy in flight (the failed tensor's host
    buffer was never given back), and the started tensor was left in 'd2h' without its event
    (``offload_pending`` was set after the loop, which the exception skipped)."""
    mgr = SwapManager()
    net = sc.swapped_net()
    mgr.set_current_group_name("g")
    loss = net(make_input(net))
    mgr.set_current_group_name(None)
    _failing_on(sim, "copy_bytes", 2)
    with pytest.raises(RuntimeError, match="injected"):
        mgr.launch_offload("g")
    del sim.before_call["copy_bytes"]
    tensors = _group_tensors("g")
    in_flight = [t for t in tensors if t.state is TensorState.D2H]
    assert len(in_flight) == 1
    assert mgr.stats()["host_pool"]["in_use_bytes"] == in_flight[0].nbytes
    mgr.wait_offload("g")  # the started copy has its event
    mgr.launch_offload("g")  # the rest can still go
    mgr.wait_offload("g")
    mgr.launch_load("g")
    mgr.wait_load("g")
    loss.backward()
    assert_tensors_equal(grads(net), sc.reference_grads(), "grads")
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0


@sim_only
def test_h6_failure_on_the_second_allocation_of_a_load(sim):
    """Before: the first tensor was left in 'h2d' over a fresh (0xFF) destination that no copy
    would ever fill (``[SwapTensor(state=h2d)]``); a retried load skips tensors in 'h2d'."""
    mgr = SwapManager()
    net = sc.swapped_net()
    mgr.set_current_group_name("g")
    loss = net(make_input(net))
    mgr.set_current_group_name(None)
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    _failing_on(sim, "empty_device_bytes", 2)
    with pytest.raises(RuntimeError, match="injected"):
        mgr.launch_load("g")
    del sim.before_call["empty_device_bytes"]
    assert not [t for t in _group_tensors("g") if t.state is TensorState.H2D]
    mgr.launch_load("g")  # retry
    mgr.wait_load("g")
    loss.backward()
    assert_tensors_equal(grads(net), sc.reference_grads(), "grads")


# ------------------------------------------------------------------------------ 7. rounding-aware host accounting
def test_h7_host_pool_counts_what_the_pinned_allocator_reserves():
    """Before: a 3000-byte buffer counted 3000 bytes while PyTorch's caching host allocator
    reserves 4096, so a 6000-byte cap let two of them (8192 bytes) through, and
    ``release_host_cache()`` left the freed blocks in the allocator's cache."""
    with simulated_device(host_rounding=True) as sim:
        mgr = SwapManager()
        mgr.set_host_memory_limit(6000)
        storage = mgr.new_storage("g")
        g = torch.Generator().manual_seed(0)
        values = [torch.randn(750, generator=g) for _ in range(2)]  # 3000 bytes each
        views = [add_swap(storage, v.clone()) for v in values]
        mgr.launch_offload("g")
        mgr.wait_offload("g")
        stats = mgr.stats()
        assert stats["host_pool"]["reserved_bytes"] == sim.host_live_bytes == 4096
        assert stats["kept_bytes"].get("host_limit") == 3000
        mgr.launch_load("g")
        mgr.wait_load("g")
        for view, value in zip(views, values):
            assert torch.equal(view.get_val(), value)
        del views, storage
        gc.collect()
        assert mgr.release_host_cache() == 4096
        assert sim.host_live_bytes == 0 and sim.host_cached_bytes == 0
        assert sim.counts["empty_host_cache"] >= 1


# ------------------------------------------------------------------------------ 8. two threads
@sim_only
def test_h8_two_threads_cannot_both_pass_the_host_cap(sim):
    """Thread A is inside the host allocation of its offload (past the cap check) when thread B
    offloads too. Before: B also passed the check (no lock) and the pool reserved 2 buffers under
    a 1-buffer cap."""
    mgr = SwapManager()
    tensors = {}
    for name in ("a", "b"):
        storage = mgr.new_storage(name)
        tensors[name] = (storage, add_swap(storage, torch.randn(256, 4)))
    nbytes = 256 * 4 * 4
    mgr.set_host_memory_limit(nbytes)
    inside = {"a": threading.Event(), "b": threading.Event()}

    def pause(n):
        me = threading.current_thread().name
        inside[me].set()
        if me == "a":
            inside["b"].wait(timeout=0.3)  # B gets its chance to enter meanwhile

    sim.before_call["empty_host_bytes"] = pause
    errors = []

    def run(name):
        try:
            if name == "b":
                inside["a"].wait(timeout=5)
            mgr.launch_offload(name)
            mgr.wait_offload(name)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del sim.before_call["empty_host_bytes"]
    assert not errors, errors
    pool = mgr.stats()["host_pool"]
    assert pool["reserved_bytes"] <= nbytes, pool
    assert mgr.stats()["kept_bytes"].get("host_limit") == nbytes


@sim_only
def test_h8_backward_hooks_from_two_threads(sim):
    """Two chained nets, forwarded on this thread, run backward in two threads at once (autograd
    runs one thread per device): the layer chain's hooks drive the manager from both. (A stress
    test; it passed before too. The test above is the deterministic one.)"""
    nets = [sc.swapped_net() for _ in range(2)]
    for net in nets:
        chain(net.layers)
    losses = [net(make_input(net)) for net in nets]
    errors = []

    def backward(loss):
        try:
            with sim.checking():
                loss.backward()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    for _ in range(1):
        threads = [threading.Thread(target=backward, args=(loss,)) for loss in losses]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for net in nets:
        assert_tensors_equal(grads(net), sc.reference_grads(), "grads")


def test_h7_a_buffer_that_fits_the_cap_to_the_byte_after_an_eviction_is_allocated():
    """The host cap is inclusive: with a 1024-byte buffer in use and an idle 512-byte one, a
    2048-byte offload under a 3072-byte cap evicts the idle buffer and then fits exactly, so it
    goes to the host (``>`` -> ``>=`` in the second check of ``HostBufferPool.acquire`` keeps it
    on the device, 'host_limit')."""
    with simulated_device():
        mgr = SwapManager()
        mgr.set_host_memory_limit(3072)
        g = torch.Generator().manual_seed(0)
        held = {}
        for name, numel in (("a", 256), ("b", 128), ("c", 512)):  # 1024, 512 and 2048 bytes
            storage = mgr.new_storage(name)
            value = torch.randn(numel, generator=g)
            held[name] = (storage, add_swap(storage, value.clone()), value)
            mgr.launch_offload(name)
            mgr.wait_offload(name)
            if name == "b":  # back on the device: its buffer idles in the pool
                mgr.launch_load(name)
                mgr.wait_load(name)
        stats = mgr.stats()
        assert stats["groups"]["c"]["offloaded_bytes"] == 2048 and not stats["kept_bytes"], stats["kept_bytes"]
        assert stats["host_pool"]["reserved_bytes"] == 3072
        for name in ("a", "c"):
            mgr.launch_load(name)
            mgr.wait_load(name)
        for storage, view, value in held.values():
            assert torch.equal(view.get_val(), value)
