"""Swap engine, unit level: the SwapTensor state machine, Storage dedup, SwapGroup and the
SwapManager's atomic API, statistics, host pool and host memory cap."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import KeepReason, SwapManager, swap_wrapper
from hyper_parallel.core.swap_tensor import SwapView, TensorState
from hyper_parallel.tools.memory import MemoryMeter

from support.swap_models import (ToyNet, add_swap, assert_tensors_equal, grads, group, make_input, round_trip,
                                 train)

# Every test also runs on the simulated asynchronous device, stream-ordering checker on ([sim]).
pytestmark = pytest.mark.sim_device




def _fresh(n: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, n, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ state machine
def test_singleton():
    assert SwapManager() is SwapManager()


def test_state_machine_walk_and_reads(fresh_manager):
    mgr = fresh_manager
    storage = mgr.new_storage("g")
    expected = _fresh()
    view = add_swap(storage, expected.clone())  # nobody else holds the clone
    assert isinstance(view, SwapView)
    st = view._swap_tensor
    assert st.state is TensorState.DEVICE and st.nbytes == expected.nbytes
    assert torch.equal(view.get_val(), expected)

    mgr.launch_offload("g")
    assert st.state is TensorState.D2H
    # During the D2H copy the source is intact on the device and may be read.
    assert torch.equal(view.get_val(), expected)
    assert mgr.stats()["host_pool"]["in_use_bytes"] == expected.nbytes

    mgr.wait_offload("g")
    assert st.state is TensorState.HOST
    with pytest.raises(RuntimeError, match=r"state 'host'.*launch_load\('g'\).*wait_load\('g'\)"):
        view.get_val()

    mgr.launch_load("g")
    assert st.state is TensorState.H2D
    with pytest.raises(RuntimeError, match=r"state 'h2d'.*wait_load\('g'\)"):
        view.get_val()

    mgr.wait_load("g")
    assert st.state is TensorState.DEVICE
    got = view.get_val()
    assert torch.equal(got, expected) and got.stride() == expected.stride()
    stats = mgr.stats()
    assert stats["offloaded_bytes"] == stats["loaded_bytes"] == expected.nbytes
    assert stats["offload_launches"] == stats["load_launches"] == 1
    assert stats["host_pool"]["in_use_bytes"] == 0
    assert stats["host_pool"]["reserved_bytes"] == expected.nbytes


def test_source_storage_freed_at_wait_offload(fresh_manager):
    mgr = fresh_manager
    storage = mgr.new_storage("g")
    t = _fresh(64)
    ref = weakref.ref(t.untyped_storage())
    view = add_swap(storage, t)
    del t
    mgr.launch_offload("g")
    gc.collect()
    assert ref() is not None, "the source must stay alive until its D2H copy is waited"
    mgr.wait_offload("g")
    gc.collect()
    assert ref() is None, "wait_offload must release the swap system's last reference"
    mgr.launch_load("g")
    mgr.wait_load("g")
    assert torch.equal(view.get_val(), _fresh(64))


def test_aliases_of_one_storage_are_one_swap_tensor(fresh_manager):
    mgr = fresh_manager
    storage = mgr.new_storage("g")
    base = _fresh(8)
    expected = base.clone()
    views = [add_swap(storage, v) for v in (base[:, :4], base.t(), base[2:6].view(-1), base)]
    del base
    assert len(storage.swap_tensors) == 1
    assert len({id(v._swap_tensor) for v in views}) == 1
    round_trip("g")
    assert mgr.stats()["offloaded_bytes"] == expected.nbytes  # one copy for all aliases
    a, t, flat, whole = (v.get_val() for v in views)
    assert torch.equal(a, expected[:, :4]) and a.stride() == (8, 1)
    assert torch.equal(t, expected.t()) and t.stride() == (1, 8)
    assert torch.equal(flat, expected[2:6].reshape(-1)) and flat.storage_offset() == 16
    assert torch.equal(whole, expected)
    ptrs = {x.untyped_storage().data_ptr() for x in (a, t, flat, whole)}
    assert len(ptrs) == 1, "reloaded aliases must share one storage"


def test_saving_into_a_storage_in_flight_is_an_error(fresh_manager):
    mgr = fresh_manager
    storage = mgr.new_storage("g")
    view = add_swap(storage, _fresh())
    mgr.launch_offload("g")
    st = view._swap_tensor
    assert st.state is TensorState.D2H
    with pytest.raises(RuntimeError, match="swap group 'g'.*already d2h.*before launching its offload"):
        st.add_alias(mgr.backend.saved_facts(torch.zeros(1), ()))
    mgr.wait_offload("g")
    mgr.launch_load("g")
    mgr.wait_load("g")
    assert torch.equal(view.get_val(), _fresh())


def test_storage_held_elsewhere_is_kept_shared(fresh_manager):
    mgr = fresh_manager
    storage = mgr.new_storage("g")
    base = _fresh(8)
    view = add_swap(storage, base[:4])
    round_trip("g")
    st = view._swap_tensor
    # skipped by this launch (not kept for good: a later launch tries again) and reported
    assert st.kept_reason is None and st.shared_skips == 1 and st.state is TensorState.DEVICE
    assert mgr.stats()["kept_bytes"] == {"shared": base.nbytes}
    assert mgr.stats()["offloaded_bytes"] == 0
    got = view.get_val()
    assert got.data_ptr() == base.data_ptr(), "a kept tensor is the original, not a copy"
    # While it is held, the next launch does not copy it either.
    round_trip("g")
    assert mgr.stats()["offloaded_bytes"] == 0
    # Once nobody else holds it, a launch moves it (it was never kept for good).
    del base, got
    round_trip("g")
    assert mgr.stats()["offloaded_bytes"] == st.nbytes
    assert torch.equal(view.get_val(), _fresh(8)[:4])


def test_pending_offload_cancelled_by_launch_load(fresh_manager):
    mgr = fresh_manager
    storage = mgr.new_storage("g")
    view = add_swap(storage, _fresh())
    mgr.launch_offload("g")
    assert view._swap_tensor.state is TensorState.D2H
    mgr.launch_load("g")  # the offload was never waited: its source is intact, keep it
    assert view._swap_tensor.state is TensorState.DEVICE
    assert torch.equal(view.get_val(), _fresh())
    mgr.wait_load("g")
    assert torch.equal(view.get_val(), _fresh())
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0
    # The user did launch an offload: the error says that launch_load cancelled it, not "launch first".
    with pytest.raises(RuntimeError, match=r"offload of group 'g' was cancelled by launch_load\('g'\)"):
        mgr.wait_offload("g")


# ------------------------------------------------------------------------------ misuse
def test_wait_offload_without_launch(fresh_manager):
    fresh_manager.set_current_group_name("mb0")
    with pytest.raises(RuntimeError, match=r"wait_offload\('mb0'\).*launch_offload\('mb0'\) first"):
        fresh_manager.wait_offload("mb0")


def test_wait_load_without_launch(fresh_manager):
    fresh_manager.set_current_group_name("mb0")
    with pytest.raises(RuntimeError, match=r"wait_load\('mb0'\).*launch_load\('mb0'\) first"):
        fresh_manager.wait_load("mb0")


def test_second_wait_offload_is_an_error(fresh_manager):
    mgr = fresh_manager
    storage = mgr.new_storage("g")
    view = add_swap(storage, _fresh())
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    with pytest.raises(RuntimeError, match="launch_offload"):
        mgr.wait_offload("g")
    mgr.launch_load("g")
    mgr.wait_load("g")
    with pytest.raises(RuntimeError, match="launch_load"):
        mgr.wait_load("g")
    assert torch.equal(view.get_val(), _fresh())


@pytest.mark.parametrize("method", ["launch_offload", "wait_offload", "launch_load", "wait_load"])
def test_unknown_group_lists_known_groups(fresh_manager, method):
    alive = fresh_manager.new_storage("alpha")  # noqa: F841  (keeps group 'alpha' alive)
    fresh_manager.set_current_group_name("beta")
    with pytest.raises(KeyError, match=r"unknown swap group 'nope'; known groups: 'alpha', 'beta'.*"
                                       r"set_current_group_name"):
        getattr(fresh_manager, method)("nope")


def test_unknown_group_when_none_exist(fresh_manager):
    with pytest.raises(KeyError, match="known groups: none"):
        fresh_manager.launch_offload("nope")


@pytest.mark.parametrize("bad", ["", 3, b"mb0"])
def test_set_current_group_name_validates(fresh_manager, bad):
    with pytest.raises(TypeError, match="group name"):
        fresh_manager.set_current_group_name(bad)
    assert fresh_manager.get_current_group_name() is None


def test_set_host_memory_limit_validates(fresh_manager):
    with pytest.raises(ValueError, match=">= 0"):
        fresh_manager.set_host_memory_limit(-1)


# ------------------------------------------------------------------------------ atomic API
@pytest.mark.parametrize("explicit_stream", [False, True])
def test_atomic_api_manual_group(fresh_manager, explicit_stream):
    """Item 5: set_current_group_name('mb0'); forward; offload frees device memory; load;
    backward gives the baseline gradients."""
    mgr = fresh_manager
    base = ToyNet(dim=32, hidden=64, seq=16)
    x = make_input(base)
    base(x).backward()
    expected = grads(base)

    net = ToyNet(dim=32, hidden=64, seq=16)
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    kwargs = {"copy_stream": None} if explicit_stream else {}
    with MemoryMeter("cpu", track=[net, x], scan_gc=False) as meter:
        mgr.set_current_group_name("mb0")
        loss = net(x)
        mgr.set_current_group_name(None)
        assert mgr.get_current_group_name() is None
        after_forward = meter.current_bytes
        mgr.launch_offload("mb0", **kwargs)
        mgr.wait_offload("mb0")
        offloaded = mgr.stats()["groups"]["mb0"]["offloaded_bytes"]
        assert offloaded > 0
        assert after_forward - meter.current_bytes == offloaded, \
            "every offloaded byte must leave the device at wait_offload"
        mgr.launch_load("mb0", **kwargs)
        mgr.wait_load("mb0")
        assert meter.current_bytes == after_forward
        loss.backward()
    assert_tensors_equal(grads(net), expected, "grads after atomic round trip")
    stats = mgr.stats()["groups"]["mb0"]
    assert stats["loaded_bytes"] == stats["offloaded_bytes"]
    assert stats["kept_bytes"].get("parameter", 0) > 0
    assert stats["kept_bytes"].get("shared", 0) >= net.mask.nbytes


def test_add_storage_moves_a_storage_with_another_group(fresh_manager):
    mgr = fresh_manager
    storage = mgr.new_storage("a")
    view = add_swap(storage, _fresh())
    mgr.add_storage("b", storage)  # now also scheduled with group "b"
    assert "b" in mgr.group_names()
    mgr.launch_offload("b")
    mgr.wait_offload("b")
    assert view._swap_tensor.state is TensorState.HOST
    mgr.launch_load("b")
    mgr.wait_load("b")
    assert torch.equal(view.get_val(), _fresh())


def test_empty_group_round_trip_is_harmless(fresh_manager):
    fresh_manager.set_current_group_name("empty")
    round_trip("empty")
    s = fresh_manager.stats()["groups"]["empty"]
    assert s["offloaded_bytes"] == s["loaded_bytes"] == 0


# ------------------------------------------------------------------------------ stats, pool
def test_stats_totals_are_sums_of_groups(fresh_manager):
    mgr = fresh_manager
    views = []  # what autograd would hold: a storage nobody holds a view of is released
    for name, n in (("a", 8), ("b", 16)):
        storage = mgr.new_storage(name)
        views.append(add_swap(storage, _fresh(n)))
        storage.add(mgr.backend.saved_facts(torch.zeros(25), ()), KeepReason.POLICY_SAVE)  # 100 bytes kept
        round_trip(name)
    s = mgr.stats()
    assert set(s["groups"]) == {"a", "b"}
    assert s["offloaded_bytes"] == s["loaded_bytes"] == (64 + 256) * 4
    assert s["kept_bytes"] == {"policy_save": 200}
    assert s["offload_launches"] == s["load_launches"] == 2
    for key in ("wait_offload_s", "wait_load_s"):
        assert s[key] >= 0.0
    assert set(s["host_pool"]) == {"reserved_bytes", "in_use_bytes", "allocations", "limit_bytes"}


def test_host_buffers_are_pooled_and_not_counted_as_device_memory(fresh_manager):
    mgr = fresh_manager
    nbytes = 16 * 16 * 4
    with MemoryMeter("cpu", scan_gc=False) as meter:
        for step in range(3):
            storage = mgr.new_storage("g")
            view = add_swap(storage, _fresh(seed=step) * 1)  # made inside the meter: counted
            live = meter.current_bytes
            mgr.launch_offload("g")
            mgr.wait_offload("g")
            # the device copy is gone and the host buffer is not device memory
            assert meter.current_bytes == live - nbytes
            mgr.launch_load("g")
            mgr.wait_load("g")
            assert meter.current_bytes == live
            assert torch.equal(view.get_val(), _fresh(seed=step))
            del storage, view
            gc.collect()
            pool = mgr.stats()["host_pool"]
            assert pool["allocations"] == 1 and pool["reserved_bytes"] == nbytes
            assert pool["in_use_bytes"] == 0


def test_host_buffer_returned_when_graph_dies_while_offloaded(fresh_manager):
    mgr = fresh_manager
    storage = mgr.new_storage("g")
    view = add_swap(storage, _fresh())
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 16 * 16 * 4
    del storage, view
    gc.collect()
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0


def test_host_memory_limit_keeps_tensors_on_device(fresh_manager):
    """Item 9: past the cap tensors stay on the device ('host_limit'); grads stay bitwise."""
    mgr = fresh_manager
    base = ToyNet(dim=32, hidden=64, seq=16)
    x = make_input(base)
    base(x).backward()
    expected = grads(base)

    # First measure what the region offloads without a cap.
    net = ToyNet(dim=32, hidden=64, seq=16)
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    with group("mb0"):
        loss = net(x)
    round_trip("mb0")
    loss.backward()
    uncapped = mgr.stats()["groups"]["mb0"]["offloaded_bytes"]
    assert_tensors_equal(grads(net), expected, "uncapped")

    mgr.reset()
    cap = uncapped // 3
    mgr.set_host_memory_limit(cap)
    net.zero_grad(set_to_none=True)
    with group("mb0"):
        loss = net(x)
    round_trip("mb0")
    s = mgr.stats()
    assert s["host_pool"]["limit_bytes"] == cap
    assert 0 < s["offloaded_bytes"] <= cap
    assert s["kept_bytes"].get("host_limit", 0) > 0
    assert s["offloaded_bytes"] + s["kept_bytes"]["host_limit"] == uncapped
    assert s["host_pool"]["reserved_bytes"] <= cap
    loss.backward()
    assert_tensors_equal(grads(net), expected, "capped")


def test_host_memory_limit_zero_keeps_everything(fresh_manager):
    mgr = fresh_manager
    mgr.set_host_memory_limit(0)
    storage = mgr.new_storage("g")
    view = add_swap(storage, _fresh())
    round_trip("g")
    assert view._swap_tensor.kept_reason == "host_limit"
    assert mgr.stats()["kept_bytes"] == {"host_limit": 16 * 16 * 4}
    assert mgr.stats()["offloaded_bytes"] == 0
    assert torch.equal(view.get_val(), _fresh())
    mgr.set_host_memory_limit(None)
    assert mgr.stats()["host_pool"]["limit_bytes"] is None


# ------------------------------------------------------------------------------ reset
def _chained_swap_net(**kw):
    from support.swap_models import chain
    net = ToyNet(**kw)
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    chain(net.layers)
    return net


def test_reset_forgets_everything(fresh_manager):
    mgr = fresh_manager
    net = _chained_swap_net()
    fresh_manager.set_current_group_name("mb7")
    assert len(net.layers[0]._forward_pre_hooks) == 1 and len(net.layers[0]._forward_hooks) == 1
    net(make_input(net)).backward()
    assert mgr.stats()["offloaded_bytes"] > 0
    mgr.reset()
    assert mgr.group_names() == []
    assert mgr.stats()["groups"] == {} and mgr.stats()["offloaded_bytes"] == 0
    assert mgr.get_current_group_name() is None
    assert all(len(l._forward_pre_hooks) == 0 and len(l._forward_hooks) == 0 for l in net.layers)
    assert mgr.layer_group_name(net.layers[0]) is None
    assert mgr.stats()["host_pool"]["reserved_bytes"] == 0


def test_reset_live_region_not_yet_offloaded_works_as_save(fresh_manager):
    mgr = fresh_manager
    base = ToyNet()
    x = make_input(base)
    base(x).backward()
    net = ToyNet()
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    with group("mb0"):
        loss = net(x)
    mgr.reset()
    loss.backward()
    assert_tensors_equal(grads(net), grads(base), "graph that outlived reset()")
    # A graph created after the reset is plain SAVE (nothing schedules it).
    net.zero_grad(set_to_none=True)
    net(x).backward()
    assert mgr.stats()["offloaded_bytes"] == 0
    assert_tensors_equal(grads(net), grads(base), "after reset")


def test_reset_live_region_already_offloaded_still_backprops(fresh_manager):
    mgr = fresh_manager
    base = ToyNet()
    x = make_input(base)
    base(x).backward()
    net = _chained_swap_net()
    loss = net(x)
    assert mgr.stats()["offloaded_bytes"] > 0
    mgr.reset()
    loss.backward()
    assert_tensors_equal(grads(net), grads(base), "offloaded graph that outlived reset()")


def test_training_with_cap_is_bitwise(fresh_manager):
    base = ToyNet(dropout=0.1)
    ref_losses, _ = train(base, steps=2)
    net = _chained_swap_net(dropout=0.1)
    fresh_manager.set_host_memory_limit(4096)
    losses, _ = train(net, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert_tensors_equal(grads(net), grads(base), "grads with cap")
    s = fresh_manager.stats()
    assert s["kept_bytes"].get("host_limit", 0) > 0 and s["offloaded_bytes"] > 0


def test_backward_while_offload_in_flight_reads_the_intact_source(fresh_manager):
    mgr = fresh_manager
    x0 = _fresh(32)
    x = x0.clone().requires_grad_()
    (x * 2).sin().sum().backward()
    expected = x.grad.clone()
    x = x0.clone().requires_grad_()
    with group("h"):
        out = swap_wrapper(lambda t: (t * 2).sin().sum())(x)
    mgr.launch_offload("h")  # state d2h: the source is still on the device
    out.backward()
    assert torch.equal(x.grad, expected)
    del out
    gc.collect()
    mgr.wait_offload("h")  # the launched offload may still be waited
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0
    assert "h" not in mgr.group_names()


def test_region_offloading_its_own_group_mid_forward(fresh_manager):
    """Storages saved, offloaded (freed) and new ones saved by the same region: a freed storage's
    identity can be reused by the next one; every saved tensor must still come back."""
    mgr = fresh_manager
    x0 = _fresh(64)

    def body(x, offload):
        acc = 0
        for i in range(6):
            acc = acc + (x * (i + 2)).sin().sum()  # saves a fresh temporary
            if offload:
                mgr.launch_offload("g")
                mgr.wait_offload("g")
        return acc

    x = x0.clone().requires_grad_()
    body(x, False).backward()
    expected = x.grad.clone()
    x = x0.clone().requires_grad_()
    with group("g"):
        out = swap_wrapper(body)(x, True)
    s = mgr.stats()["groups"]["g"]
    assert s["offloaded_bytes"] == 6 * x0.nbytes and s["offload_launches"] == 6
    mgr.launch_load("g")
    mgr.wait_load("g")
    out.backward()
    assert torch.equal(x.grad, expected)
    assert mgr.stats()["loaded_bytes"] == 6 * x0.nbytes


def test_empty_saved_tensor_is_kept(fresh_manager):
    x = torch.randn(4, 8, requires_grad=True)
    with group("g"):
        out = swap_wrapper(lambda t: (t[:0] * 2).sin().sum() + (t * 3).cos().sum())(x)
    round_trip("g")
    s = fresh_manager.stats()["groups"]["g"]
    assert s["kept_bytes"].get("empty", 0) == 0 and "empty" in s["kept_bytes"]
    assert s["offloaded_bytes"] == x.nbytes
    out.backward()
    x2 = x.detach().clone().requires_grad_()
    ((x2[:0] * 2).sin().sum() + (x2 * 3).cos().sum()).backward()
    assert torch.equal(x.grad, x2.grad)


def test_host_limit_with_changing_shapes_reuses_idle_budget(fresh_manager):
    mgr = fresh_manager
    net = _chained_swap_net()
    gen = torch.Generator().manual_seed(0)

    def step(batch):
        before = mgr.stats()
        net(torch.randn(batch, net.seq, net.dim, generator=gen)).backward()
        after = mgr.stats()
        return (after["offloaded_bytes"] - before["offloaded_bytes"],
                after["kept_bytes"].get("host_limit", 0) - before["kept_bytes"].get("host_limit", 0))

    need4, _ = step(4)
    mgr.set_host_memory_limit(2 * need4)
    for batch in (4, 5):
        step(batch)
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0
    offloaded6, kept6 = step(6)
    assert offloaded6 == need4 * 6 // 4 <= 2 * need4  # everything this step needs fits the cap
    assert kept6 == 0


def test_copy_stream_lookup_is_cached_even_without_streams(fresh_manager, monkeypatch):
    """A backend without streams answers ``None`` for a copy stream: that answer is remembered
    too, not asked again for every launch."""
    mgr = fresh_manager
    calls = []
    real = type(mgr.backend).new_copy_stream
    monkeypatch.setattr(type(mgr.backend), "new_copy_stream",
                        lambda self, device=None: calls.append(device) or real(self, device))
    first = mgr._copy_stream_for(None)
    assert mgr._copy_stream_for(None) is first and len(calls) == 1


@pytest.mark.parametrize("bad", [3, ""])
def test_new_storage_validates_the_group_name(fresh_manager, bad):
    with pytest.raises(TypeError, match="new_storage: the group name must be a non-empty str or None"):
        fresh_manager.new_storage(bad)
    assert bad not in fresh_manager.group_names()
