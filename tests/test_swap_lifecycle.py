"""Lifecycle: forwards without backward, no_grad, exceptions,
gradient accumulation, modules called twice, many steps, throwaway micro-batch groups --
correct gradients, and device memory and the host pool back to their level afterwards."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from hyper_parallel.core.backend import active_backend
from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper
from hyper_parallel.tools.memory import MemoryMeter

from support.swap_models import (ManagerSpy, ToyNet, assert_tensors_equal, chain, grads, group,
                         live_tensor_count, make_input)

# Every test also runs on the simulated asynchronous device, stream-ordering checker on ([sim]).
pytestmark = pytest.mark.sim_device




def _chained(**kw) -> ToyNet:
    net = ToyNet(**kw)
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    chain(net.layers)
    return net


def _pool():
    return dict(SwapManager().stats()["host_pool"])


def _baseline_grads(*inputs, **kw):
    base = ToyNet(**kw)
    loss = sum(base(x) for x in inputs)
    loss.backward()
    return grads(base)


def _step(net, x):
    net.zero_grad(set_to_none=True)
    net(x).backward()
    return grads(net)


class _Meter:
    """MemoryMeter around a scenario; ``settled()`` = live device bytes after a gc."""

    def __init__(self, net, *tensors):
        # Tensors made before the region that ops view inside it (the input) must be tracked,
        # or the CPU meter counts them when their first view appears.
        self.meter = MemoryMeter("cpu", track=[net, *tensors], scan_gc=False)

    def __enter__(self):
        self.meter.__enter__()
        return self

    def __exit__(self, *exc):
        self.meter.__exit__(*exc)

    def settled(self) -> int:
        gc.collect()
        # On the simulated device a copy still queued holds its source, as the allocator keeps a
        # record_stream'ed block, until the copy has run: settle the device first.
        sync = getattr(active_backend(), "synchronize", None)
        if sync is not None:
            sync()
        return self.meter.current_bytes - self.meter.baseline_bytes


def _launches_per_forward(net) -> int:
    """Offload launches of the layer chain in one forward: every layer but the last launches its
    own group, and every layer but the first and the last relaunches its predecessor for the input
    the caller still held at the first launch."""
    n = len(net.layers)
    return (n - 1) + (n - 2)


# ------------------------------------------------------------------------------ scenarios
def test_forward_without_backward_releases_everything():
    net = _chained()
    x = make_input(net)
    expected = _baseline_grads(x)
    assert_tensors_equal(_step(net, x), expected, "warm-up step")
    net.zero_grad(set_to_none=True)
    pool = _pool()
    launches = SwapManager().stats()["offload_launches"]
    with _Meter(net, x) as m:
        loss = net(x)  # e.g. an eval loss computed with grad enabled, or a skipped step
        assert SwapManager().stats()["offload_launches"] == launches + _launches_per_forward(net)
        assert _pool()["in_use_bytes"] > 0
        del loss
        assert m.settled() == 0
    assert _pool()["in_use_bytes"] == 0
    assert _pool()["reserved_bytes"] == pool["reserved_bytes"]
    assert _pool()["allocations"] == pool["allocations"]
    assert_tensors_equal(_step(net, x), expected, "step after a dropped graph")


def test_forward_under_no_grad():
    net = _chained()
    x = make_input(net)
    expected = _baseline_grads(x)
    plain_out = ToyNet()(x).detach()
    with _Meter(net, x) as m:
        with torch.no_grad():
            out = net(x)
        assert torch.equal(out, plain_out)
        del out
        s = SwapManager().stats()
        assert s["offload_launches"] == 0 and s["offloaded_bytes"] == 0
        assert SwapManager().get_current_group_name() is None
        assert m.settled() == 0
    assert _pool()["allocations"] == 0
    assert_tensors_equal(_step(net, x), expected, "step after no_grad")


class _Boom(Exception):
    pass


def test_exception_mid_forward_in_a_chained_layer():
    net = _chained()
    x = make_input(net)
    expected = _baseline_grads(x)
    _step(net, x)
    net.zero_grad(set_to_none=True)
    pool = _pool()
    armed = [True]

    def boom(module, args):
        if armed[0]:
            raise _Boom("mid-forward")

    handle = net.layers[2].fc2.register_forward_pre_hook(boom)  # inside chained layer 2
    with _Meter(net, x) as m:
        with group("outer"):
            with pytest.raises(_Boom):
                net(x)
            assert SwapManager().get_current_group_name() == "outer", "current group restored"
        assert SwapManager().get_current_group_name() is None
        assert m.settled() == 0
    assert _pool()["in_use_bytes"] == 0
    assert _pool()["reserved_bytes"] == pool["reserved_bytes"]
    armed[0] = False
    handle.remove()
    before = SwapManager().stats()
    with ManagerSpy() as spy:
        got = _step(net, x)
    assert_tensors_equal(got, expected, "step after an exception")
    after = SwapManager().stats()
    moved = after["offloaded_bytes"] - before["offloaded_bytes"]
    assert moved > 0 and after["loaded_bytes"] - before["loaded_bytes"] == moved, "the whole schedule ran"
    assert spy.calls[-1] == ("wait_load", "layer_0")


def test_gradient_accumulation_two_forwards_one_backward():
    net = _chained(dropout=0.1)
    x1, x2 = make_input(net, seed=1), make_input(net, seed=2)
    torch.manual_seed(0)
    expected = _baseline_grads(x1, x2, dropout=0.1)
    with _Meter(net, x1, x2) as m:
        torch.manual_seed(0)
        loss = net(x1) + net(x2)
        s = SwapManager().stats()
        assert s["offload_launches"] == 2 * _launches_per_forward(net)
        loss.backward()
        del loss
        assert_tensors_equal(grads(net), expected, "accumulated")
        s = SwapManager().stats()
        assert s["loaded_bytes"] == s["offloaded_bytes"] > 0
        net.zero_grad(set_to_none=True)
        assert m.settled() == 0
    assert _pool()["in_use_bytes"] == 0


def test_gradient_accumulation_separate_backwards_in_reverse_order():
    net = _chained()
    x1, x2 = make_input(net, seed=1), make_input(net, seed=2)
    expected = _baseline_grads(x1, x2)
    loss1 = net(x1)
    loss2 = net(x2)
    loss2.backward()
    loss1.backward()
    assert_tensors_equal(grads(net), expected, "two backwards")
    s = SwapManager().stats()
    assert s["loaded_bytes"] == s["offloaded_bytes"] > 0
    assert _pool()["in_use_bytes"] == 0


def test_chained_stack_called_twice_per_step():
    """Weight sharing: every chained layer runs twice per forward."""

    def twice(model, x):
        for _ in range(2):
            for layer in model.layers:
                x = layer(x, mask=model.mask)
        return model.head(x).square().mean()

    base = ToyNet()
    x = make_input(base)
    twice(base, x).backward()
    expected = grads(base)  # outside the meter: viewing base's grads inside it would count them
    net = _chained()
    with _Meter(net, x) as m:
        loss = twice(net, x)
        s = SwapManager().stats()
        assert s["offload_launches"] == 2 * _launches_per_forward(net)
        loss.backward()
        del loss
        assert_tensors_equal(grads(net), expected, "called twice")
        s = SwapManager().stats()
        assert s["loaded_bytes"] == s["offloaded_bytes"] > 0
        net.zero_grad(set_to_none=True)
        assert m.settled() == 0
    assert _pool()["in_use_bytes"] == 0


def test_swapped_module_called_twice_on_a_manual_group():
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 16, generator=gen)

    def make():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(16, 16), nn.GELU())

    base = make()
    base(base(x0)).sum().backward()
    expected = grads(base)
    mod = swap_wrapper(make())
    with _Meter(mod, x0) as m:
        with group("mb0"):
            loss = mod(mod(x0)).sum()
        mgr = SwapManager()
        mgr.launch_offload("mb0")
        mgr.wait_offload("mb0")
        mgr.launch_load("mb0")
        mgr.wait_load("mb0")
        loss.backward()
        del loss
        assert_tensors_equal(grads(mod), expected, "module called twice")
        assert mgr.stats()["offloaded_bytes"] > 0
        mod.zero_grad(set_to_none=True)
        assert m.settled() == 0
    assert _pool()["in_use_bytes"] == 0


def test_micro_batch_schedule_with_throwaway_groups():
    """A pipeline-like schedule: each micro-batch in its own group, all forwards, then loads and
    backwards in reverse order; gradients equal plain accumulation."""
    net = ToyNet()
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    xs = [make_input(net, seed=s) for s in range(3)]
    expected = _baseline_grads(*xs)
    mgr = SwapManager()
    with _Meter(net, *xs) as m:
        losses = []
        for i, x in enumerate(xs):
            with group(f"mb{i}"):
                losses.append(net(x))
            mgr.launch_offload(f"mb{i}")
            if i:
                mgr.wait_offload(f"mb{i - 1}")
        mgr.wait_offload(f"mb{len(xs) - 1}")
        for i in reversed(range(len(xs))):
            mgr.launch_load(f"mb{i}")
            mgr.wait_load(f"mb{i}")
            losses.pop().backward()
        assert_tensors_equal(grads(net), expected, "micro-batches")
        s = mgr.stats()
        assert all(s["groups"][f"mb{i}"]["offloaded_bytes"] > 0 for i in range(len(xs)))
        assert s["loaded_bytes"] == s["offloaded_bytes"]
        net.zero_grad(set_to_none=True)
        assert m.settled() == 0
    assert _pool()["in_use_bytes"] == 0


# ------------------------------------------------------------------------------ groups
def test_group_without_storages_is_forgotten_when_current_moves_on():
    mgr = SwapManager()
    mgr.set_current_group_name("mb0")
    assert "mb0" in mgr.group_names()
    mgr.set_current_group_name("mb1")
    assert mgr.group_names() == ["mb1"]
    mgr.set_current_group_name(None)
    assert mgr.group_names() == []


def test_layer_chain_groups_persist():
    net = _chained()
    _step(net, make_input(net))
    gc.collect()
    assert SwapManager().group_names() == [f"layer_{i}" for i in range(len(net.layers))]


@pytest.mark.parametrize("schedule", ["offload_and_load", "never_launched"])
def test_throwaway_micro_batch_groups_disappear_with_their_graph(schedule):
    net = ToyNet()
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    mgr = SwapManager()
    for i in range(3):
        with group(f"mb{i}"):
            loss = net(make_input(net, seed=i))
        assert f"mb{i}" in mgr.group_names()
        if schedule == "offload_and_load":
            mgr.launch_offload(f"mb{i}")
            mgr.wait_offload(f"mb{i}")
            mgr.launch_load(f"mb{i}")
            mgr.wait_load(f"mb{i}")
        loss.backward()
        del loss
    gc.collect()
    assert mgr.group_names() == []


# ------------------------------------------------------------------------------ many steps
@pytest.mark.slow
def test_hundred_steps_no_growth():
    net = _chained(dropout=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    torch.manual_seed(0)
    x = make_input(net)
    pool_after_first = tensors_after_first = None
    for step in range(100):
        opt.zero_grad(set_to_none=True)
        net(x).backward()
        opt.step()
        if step == 0:
            pool_after_first = _pool()
            tensors_after_first = live_tensor_count()
            assert pool_after_first["allocations"] > 0
        elif step % 33 == 0 or step == 99:
            pool = _pool()
            assert pool["allocations"] == pool_after_first["allocations"], step
            assert pool["reserved_bytes"] == pool_after_first["reserved_bytes"], step
            assert pool["in_use_bytes"] == 0
            assert live_tensor_count() == tensors_after_first, step
    s = SwapManager().stats()
    assert s["offload_launches"] == 100 * _launches_per_forward(net)
    assert s["loaded_bytes"] == s["offloaded_bytes"] > 0


def test_groups_of_skipped_steps_with_a_launch_in_flight_disappear():
    """A step whose offload was launched but never waited, then abandoned (graph dropped), leaves
    no group behind: per-step names must not accumulate."""
    mgr = SwapManager()
    block = swap_wrapper(nn.Sequential(nn.Linear(16, 16), nn.GELU()))
    for step in range(3):
        with group(f"step{step}"):
            loss = block(torch.randn(4, 16)).sum()
        mgr.launch_offload(f"step{step}")
        del loss
    gc.collect()
    assert mgr.group_names() == []
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0


# ------------------------------------------------------------------------------ forgetting groups
def test_discard_group_leaves_its_tensors_where_they_are_and_says_so_in_backward():
    """``discard_group`` forgets a group without moving anything: a tensor of it that was offloaded
    stays on the host, backward names the group and the calls that would have loaded it, and the
    host buffers go back to the pool when the graph dies."""
    net = ToyNet()
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    mgr = SwapManager()
    with group("mb0"):
        loss = net(make_input(net))
    mgr.launch_offload("mb0")
    mgr.wait_offload("mb0")
    assert mgr.stats()["offloaded_bytes"] > 0 and _pool()["in_use_bytes"] > 0
    mgr.discard_group("mb0")
    assert "mb0" not in mgr.group_names()
    with pytest.raises(RuntimeError, match=r"swap group 'mb0' is on the host.*launch_load\('mb0'\)"):
        loss.backward()
    del loss
    gc.collect()
    sync = getattr(active_backend(), "synchronize", None)
    if sync is not None:
        sync()
    assert _pool()["in_use_bytes"] == 0


def test_discard_group_refuses_a_layer_chain_group_and_changes_nothing():
    net = _chained()
    reference = _baseline_grads(make_input(net))
    mgr = SwapManager()
    loss = net(make_input(net))
    with pytest.raises(ValueError, match=r"discard_group\('layer_0'\): the group belongs to the layer chain"):
        mgr.discard_group("layer_0")
    assert "layer_0" in mgr.group_names()
    loss.backward()
    assert_tensors_equal(grads(net), reference, "after a refused discard_group")


def test_a_group_whose_last_storage_dies_while_another_thread_holds_the_lock_is_forgotten_later():
    """A storage's finalizer never waits for the manager's lock: when another thread holds it, the
    forget is deferred to the next call that takes the lock (``new_storage`` here)."""
    import threading

    mgr = SwapManager()
    storage = mgr.new_storage("throwaway")
    held, done = threading.Event(), threading.Event()

    def hold_the_lock():
        with mgr.lock:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    held.wait(30)
    try:
        del storage
        gc.collect()
        assert "throwaway" in mgr.group_names()  # deferred: the lock was busy
    finally:
        done.set()
        holder.join()
    mgr.new_storage("next")
    assert "throwaway" not in mgr.group_names()


@pytest.mark.no_sim("checks the PyTorch CPU backend itself")
def test_discard_group_takes_the_group_of_a_chained_layer_that_died():
    """Once its layer is gone nothing uses a chain group: ``discard_group`` may drop it (a second
    model's chain is untouched), as before the refusal of live chain groups."""
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    third, fourth = nn.Linear(4, 4), nn.Linear(4, 4)
    mgr = SwapManager()
    mgr.set_forward_prefetch_layer(first, second)
    mgr.set_forward_prefetch_layer(third, fourth)
    names = {mgr.layer_group_name(m) for m in (first, second)}
    del first, second
    gc.collect()
    for name in sorted(names):
        mgr.discard_group(name)
    assert mgr.group_names() == sorted({mgr.layer_group_name(third), mgr.layer_group_name(fourth)})
    with pytest.raises(ValueError, match="belongs to the layer chain"):
        mgr.discard_group(mgr.layer_group_name(third))


@pytest.mark.no_sim("checks the PyTorch CPU backend itself")
def test_making_the_manager_and_chaining_layers_start_no_accelerator_runtime(monkeypatch):
    """Asking the backend for a stream starts an accelerator's runtime (CUDA's lazy init, Ascend's
    runtime): the manager, its groups and the chain must not ask before the first forward, since a
    process may set its device or fork after wrapping its model."""
    from hyper_parallel.backends.torch.backend import TorchBackend
    from hyper_parallel.core.activation_checkpoint import wrap_layers

    asked = []
    real = TorchBackend.current_stream
    monkeypatch.setattr(TorchBackend, "current_stream",
                        lambda self, device=None: asked.append(1) or real(self, device))
    mgr = SwapManager()
    mgr.reset()
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    wrap_layers(layers, swap=True)
    mgr.set_current_group_name("mb0")
    mgr.set_current_group_name(None)
    mgr.set_host_memory_limit(1 << 20)
    assert asked == []
    h = torch.randn(2, 4, requires_grad=True)
    for layer in layers:
        h = layer(h)
    assert asked  # the first forward asks (once the device is set)
