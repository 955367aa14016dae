"""Swap on MindSpore: saved_tensors_hooks-based swap_wrapper, checkpoint-input swap, the atomic
group API, the Cell layer chain, aliases, leaks and misuse errors."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, mint, nn, ops
from mindspore.graph.api import _pynative_executor

from hyper_parallel.core.activation_checkpoint import (CheckpointPolicy, SwapManager, checkpoint,
                                                       checkpoint_wrapper, swap_wrapper)

from ms_helpers import assert_all_equal, grads, make_params, region


def _ones_like(t):
    return ops.ones_like(t)


def _vjp_grads(vjp_fn, out):
    g = vjp_fn(_ones_like(out))
    return [a.asnumpy() for a in g[1]]


def _swap_tensors(mgr, name):
    return [t for s in mgr._group(name).storages() for t in s.swap_tensors]


# ------------------------------------------------------------------------------ atomic API
def test_atomic_offload_load_roundtrip_and_reading_on_host_is_an_error():
    x, w1, w2 = make_params()
    ref = grads(lambda x: region(x, w1, w2).sum(), [w1, w2], x)
    mgr = SwapManager()
    block = swap_wrapper(region)

    def f(x):
        return block(x, w1, w2).sum()

    # forward into group "mb0", offload it, then try backward without loading: an error
    mgr.set_current_group_name("mb0")
    out, vjp_fn = ms.vjp(f, x, weights=[w1, w2])
    mgr.set_current_group_name(None)
    assert len(_swap_tensors(mgr, "mb0")) >= 3
    mgr.launch_offload("mb0")
    mgr.wait_offload("mb0")
    assert all(t.state.value == "host" for t in _swap_tensors(mgr, "mb0"))
    with pytest.raises(RuntimeError, match="state 'host'"):
        vjp_fn(_ones_like(out))
    del out, vjp_fn
    gc.collect()

    # the same with a load before backward: bit-exact gradients
    mgr.set_current_group_name("mb0")
    out, vjp_fn = ms.vjp(f, x, weights=[w1, w2])
    mgr.set_current_group_name(None)
    mgr.launch_offload("mb0")
    mgr.wait_offload("mb0")
    mgr.launch_load("mb0")
    mgr.wait_load("mb0")
    got = _vjp_grads(vjp_fn, out)
    assert np.array_equal(out.asnumpy(), ref[0])
    assert_all_equal(ref[1], got)
    stats = mgr.stats()
    assert stats["offloaded_bytes"] > 0 and stats["loaded_bytes"] == stats["groups"]["mb0"]["offloaded_bytes"] // 2


def test_wait_without_launch_and_unknown_group_are_errors():
    mgr = SwapManager()
    mgr.set_current_group_name("g")
    with pytest.raises(RuntimeError, match="launch_offload"):
        mgr.wait_offload("g")
    with pytest.raises(RuntimeError, match="launch_load"):
        mgr.wait_load("g")
    mgr.set_current_group_name(None)
    with pytest.raises(KeyError, match="unknown swap group"):
        mgr.launch_offload("nope")


def test_aliases_come_back_as_aliases_and_stride0_views():
    """MindSpore's CPU kernels save contiguous copies of view inputs, so autograd never hands the
    swap system two views of one storage there; the engine's alias handling is exercised directly:
    views registered into one Storage share one copy and come back as views of one storage."""
    from hyper_parallel.core.storage import Storage

    mgr = SwapManager()
    mgr.set_current_group_name("views")
    storage = mgr.new_storage()
    mgr.set_current_group_name(None)
    base = Tensor(np.arange(24, dtype=np.float32).reshape(4, 6)) * 1.0
    small = Tensor(np.arange(3, dtype=np.float32)) * 1.0
    views = [base, base.transpose(1, 0), base[1:3, 2:5], base.reshape(24)[5:],
             ops.broadcast_to(small, (4, 3))]
    expect = [v.asnumpy().copy() for v in views]
    handles = [storage.add(mgr.backend.saved_facts(v, ())) for v in views]
    assert isinstance(storage, Storage) and len(storage.swap_tensors) == 2  # base's and small's
    del views
    mgr.launch_offload("views")
    mgr.wait_offload("views")
    assert all(t.state.value == "host" for t in storage.swap_tensors)
    mgr.launch_load("views")
    mgr.wait_load("views")
    got = [h.get_val() for h in handles]
    for g, e in zip(got, expect):
        assert np.array_equal(g.asnumpy(), e)
    assert got[1].stride() == [1, 6] and got[2].storage_offset() == 8 and got[4].stride() == [0, 1]
    ptr = got[0].untyped_storage().data_ptr()
    assert all(g.untyped_storage().data_ptr() == ptr for g in got[:4])  # aliases again
    assert got[4].untyped_storage().data_ptr() != ptr


def test_in_place_change_after_saving_is_an_error():
    x, w1, w2 = make_params()

    def fn(x):
        h = mint.matmul(x, w1)
        return h, mint.sin(h)  # sin saves h

    wrapped = swap_wrapper(fn)

    def loss(x):
        h, y = wrapped(x)
        h.copy_(h * 0.0)
        return y.sum()

    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        grads(loss, [w1], x)
    # also when the offload is launched first: the storage is kept (reason "modified_in_place")
    mgr = SwapManager()
    mgr.set_current_group_name("m")
    out, vjp_fn = ms.vjp(loss, x, weights=[w1])
    mgr.set_current_group_name(None)
    mgr.launch_offload("m")
    assert mgr.stats()["kept_bytes"].get("modified_in_place", 0) > 0
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        vjp_fn(_ones_like(out))


def test_swap_policy_and_parameters_are_kept():
    x, w1, w2 = make_params()
    seen = []

    def every_other(t):
        seen.append(t.shape)
        return CheckpointPolicy.MUST_SAVE if len(seen) % 2 else CheckpointPolicy.MUST_SWAP

    wrapped = swap_wrapper(region, policy_fn=every_other)
    ref = grads(lambda x: region(x, w1, w2).sum(), [w1, w2], x)
    got = grads(lambda x: wrapped(x, w1, w2).sum(), [w1, w2], x)
    assert_all_equal([ref[0]] + ref[1], [got[0]] + got[1])
    kept = SwapManager().stats()["kept_bytes"]
    assert kept["parameter"] > 0 and kept["policy_save"] > 0
    bad = swap_wrapper(region, policy_fn=lambda t: CheckpointPolicy.PREFER_RECOMPUTE)
    with pytest.raises(TypeError, match="swap_wrapper policy_fn returned"):
        grads(lambda x: bad(x, w1, w2).sum(), [w1, w2], x)
    with pytest.raises(TypeError, match="callable"):
        swap_wrapper(region, policy_fn=42)


def test_checkpoint_swap_inputs_puts_the_inputs_in_the_storage():
    x, w1, w2 = make_params()

    def loss(x):
        h = mint.cos(x)  # a non-leaf input to the region: swappable
        return checkpoint(region, h, w1, w2, policy_fn=["MatMulExt"], swap_inputs=True).sum()

    ref = grads(lambda x: region(mint.cos(x), w1, w2).sum(), [w1, w2], x)
    mgr = SwapManager()
    mgr.set_current_group_name("in")
    out, vjp_fn = ms.vjp(loss, x, weights=[w1, w2])
    mgr.set_current_group_name(None)
    nbytes = {t.nbytes for t in _swap_tensors(mgr, "in")}
    assert 6 * 5 * 4 in nbytes  # the region's input h
    kept = mgr.stats()["kept_bytes"]
    assert kept.get("parameter", 0) >= 2 * 5 * 5 * 4  # w1, w2 are inputs too, but parameters
    mgr.launch_offload("in")
    mgr.wait_offload("in")
    mgr.launch_load("in")
    mgr.wait_load("in")
    assert_all_equal(ref[1], _vjp_grads(vjp_fn, out))


def test_host_memory_limit_keeps_tensors_on_device():
    x, w1, w2 = make_params()
    mgr = SwapManager()
    mgr.set_host_memory_limit(0)
    wrapped = swap_wrapper(region)
    mgr.set_current_group_name("lim")
    out, vjp_fn = ms.vjp(lambda x: wrapped(x, w1, w2).sum(), x, weights=[w1, w2])
    mgr.set_current_group_name(None)
    mgr.launch_offload("lim")
    mgr.wait_offload("lim")
    assert mgr.stats()["kept_bytes"]["host_limit"] > 0 and mgr.stats()["offloaded_bytes"] == 0
    ref = grads(lambda x: region(x, w1, w2).sum(), [w1, w2], x)
    assert_all_equal(ref[1], _vjp_grads(vjp_fn, out))
    mgr.set_host_memory_limit(None)


# ------------------------------------------------------------------------------ leaks
def test_forward_without_backward_leaves_nothing_behind():
    """A step that fails after its forward (skipped step): once MindSpore drops that graph (it
    keeps the last one until the next grad call), no group, host buffer or storage is left."""
    x, w1, w2 = make_params()
    mgr = SwapManager()
    wrapped = swap_wrapper(region)

    def failing_step(x):
        mgr.set_current_group_name("fwd_only")
        try:
            loss = wrapped(x, w1, w2).sum()
        finally:
            mgr.set_current_group_name(None)
        mgr.launch_offload("fwd_only")
        mgr.wait_offload("fwd_only")
        assert mgr.stats()["host_pool"]["in_use_bytes"] > 0
        raise KeyError("skip this step")

    with pytest.raises(KeyError):
        grads(failing_step, [w1, w2], x)
    # MindSpore 2.10 leaves its executor recording after an exception escapes value_and_grad
    # (later plain forwards are still recorded); its own recompute resets it like this:
    _pynative_executor.clear_res()
    ref = grads(lambda x: region(x, w1, w2).sum(), [w1, w2], x)  # the next step
    gc.collect()
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0
    assert "fwd_only" not in mgr.group_names()
    # eval-style forward (nothing recorded for a backward): no storage at all
    before = mgr.stats()["groups"]
    y = wrapped(x, w1, w2)
    assert np.array_equal(y.asnumpy(), region(x, w1, w2).asnumpy())
    assert mgr.stats()["groups"] == before
    assert ref[0] is not None


def test_gradient_accumulation_two_microbatches():
    x, w1, w2 = make_params()
    x2 = x * 0.5
    ref1 = grads(lambda x: region(x, w1, w2).sum(), [w1, w2], x)[1]
    ref2 = grads(lambda x: region(x, w1, w2).sum(), [w1, w2], x2)[1]
    mgr = SwapManager()
    wrapped = swap_wrapper(region)
    runs = []
    for name, inp in (("mb0", x), ("mb1", x2)):
        mgr.set_current_group_name(name)
        runs.append(ms.vjp(lambda x: wrapped(x, w1, w2).sum(), inp, weights=[w1, w2]))
        mgr.set_current_group_name(None)
        mgr.launch_offload(name)
    mgr.wait_offload("mb0")
    mgr.wait_offload("mb1")
    got = []
    for name, (out, vjp_fn) in zip(("mb1", "mb0"), reversed(runs)):
        mgr.launch_load(name)
        mgr.wait_load(name)
        got.append(_vjp_grads(vjp_fn, out))
    assert_all_equal(ref2, got[0])
    assert_all_equal(ref1, got[1])


# ------------------------------------------------------------------------------ layer chain
class _Layer(nn.Cell):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Dense(d, d)

    def construct(self, x):
        return x + mint.sin(self.fc(x))


class _Stack(nn.Cell):
    def __init__(self, n=3, d=8, twice=False):
        super().__init__()
        self.layers = nn.CellList([_Layer(d) for _ in range(n)])
        self.twice = twice

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
            if self.twice:
                x = layer(x)  # a layer called twice per step
        return x.sum()


def _stack(seed=0, **kw):
    ms.set_seed(seed)
    return _Stack(**kw)


def _x(d=8):
    return Tensor(np.random.RandomState(1).randn(4, d).astype(np.float32))


def _chain(layers):
    mgr = SwapManager()
    layers = list(layers)
    for a, b in zip(layers, layers[1:]):
        mgr.set_forward_prefetch_layer(a, b)


@pytest.mark.parametrize("kind", ["swap_wrapper", "checkpoint_swap", "outer_recompute", "twice"])
def test_layer_chain_offloads_and_prefetches(kind):
    ref_net = _stack(twice=(kind == "twice"))
    ref = grads(ref_net, ref_net.trainable_params(), _x())
    net = _stack(twice=(kind == "twice"))
    if kind in ("swap_wrapper", "twice"):
        for layer in net.layers:
            swap_wrapper(layer)
        body = net
    elif kind == "checkpoint_swap":
        for layer in net.layers:
            checkpoint_wrapper(layer, policy_fn=lambda c, o, *a, **k: CheckpointPolicy.MUST_SWAP
                               if o.name == "MatMul" else CheckpointPolicy.MUST_RECOMPUTE, swap_inputs=True)
        body = net
    else:  # the chained layers are re-run inside an outer recompute: their hooks must not fire then
        for layer in net.layers:
            swap_wrapper(layer)  # inside a checkpoint region swap does not apply
        body = checkpoint_wrapper(net)
    _chain(net.layers)
    mgr = SwapManager()
    for step in range(2):
        got = grads(body, net.trainable_params(), _x())
        assert_all_equal([ref[0]] + ref[1], [got[0]] + got[1])
        assert mgr.get_current_group_name() is None
    stats = mgr.stats()
    calls_per_step = 2 if kind == "twice" else 1
    # the RFC's schedule, on every device, offloads 2 of the 3 layers (the last one is never)
    assert stats["offload_launches"] == 2 * 2 * calls_per_step  # 2 steps
    if kind != "outer_recompute":
        assert stats["offloaded_bytes"] > 0 and stats["loaded_bytes"] == stats["offloaded_bytes"]
    assert stats["host_pool"]["in_use_bytes"] == 0


def test_host_pool_reaches_steady_state():
    net = _stack()
    for layer in net.layers:
        swap_wrapper(layer)
    _chain(net.layers)
    mgr = SwapManager()
    allocations = []
    for _ in range(3):
        grads(net, net.trainable_params(), _x())
        allocations.append(mgr.stats()["host_pool"]["allocations"])
    assert allocations[0] > 0 and allocations[0] == allocations[-1]


def test_exception_in_a_chained_layer_restores_the_current_group():
    net = _stack()
    _chain(net.layers)
    mgr = SwapManager()
    mgr.set_current_group_name("outer")

    def bad(x):
        raise ValueError("bad layer")

    object.__setattr__(net.layers[1], "construct", bad)
    with pytest.raises(ValueError, match="bad layer"):
        grads(net, net.trainable_params(), _x())
    assert mgr.get_current_group_name() == "outer"
    mgr.set_current_group_name(None)


def test_chain_rejects_non_cells():
    with pytest.raises(TypeError, match="nn.Cell"):
        SwapManager().set_forward_prefetch_layer(object(), nn.Dense(2, 2))


def test_a_storage_still_held_elsewhere_is_copied_but_never_freed_under_its_owner():
    """MindSpore has no storage use count, so a saved tensor that the caller still holds is swapped
    too; the caller's tensor stays valid (the swap system only drops its own references)."""
    x, w1, w2 = make_params()
    held = []
    wrapped = swap_wrapper(lambda h: mint.sin(h) * 2.0)

    def f(w):
        h = mint.cos(w)       # needs grad: the region saves it for sin's backward ...
        held.append(h)        # ... and the caller keeps it too
        return wrapped(h).sum()

    mgr = SwapManager()
    mgr.set_current_group_name("shared")
    out, vjp_fn = ms.vjp(f, w1, weights=[w1])
    mgr.set_current_group_name(None)
    expect = held[0].asnumpy().copy()
    mgr.launch_offload("shared")
    mgr.wait_offload("shared")
    assert mgr.stats()["offloaded_bytes"] >= held[0].nbytes
    assert np.array_equal(held[0].asnumpy(), expect)  # still readable, unchanged
    mgr.launch_load("shared")
    mgr.wait_load("shared")
    ref = grads(lambda w: (mint.sin(mint.cos(w)) * 2.0).sum(), [w1], w1)
    assert_all_equal(ref[1], _vjp_grads(vjp_fn, out))


@pytest.mark.slow
def test_mixed_swap_wrapper_and_selective_checkpoint_in_one_model():
    """swap_wrapper on each layer's attention, a selective checkpoint (swap the matmuls) on each
    MLP's construct as a function, whole layers chained: bit-exact with the plain model."""
    import ms_model

    ref_losses, ref_grads = ms_model.train(ms_model.build("none", layers=3), steps=2)
    model = ms_model.build("none", layers=3)
    for layer in model.layers:
        swap_wrapper(layer.attn)
        layer.mlp.construct = checkpoint_wrapper(layer.mlp.construct, policy_fn=ms_model.swap_matmuls)
    ms_model.chain_layers(model.layers)
    losses, got = ms_model.train(model, steps=2)
    assert [float(v).hex() for v in losses] == [float(v).hex() for v in ref_losses]
    assert sorted(got) == sorted(ref_grads)
    assert_all_equal([ref_grads[k] for k in sorted(ref_grads)], [got[k] for k in sorted(got)])
    stats = SwapManager().stats()
    assert stats["offloaded_bytes"] > 0 and stats["loaded_bytes"] == stats["offloaded_bytes"]


def test_microbatch_schedule_driven_by_hand():
    """The framework-neutral per-microbatch schedule (what pipeline_swap drives on PyTorch) works
    on MindSpore when driven by hand: 3 microbatches forward, then their backwards, prefetch 1.
    MindSpore 2.10 PyNative can only run the backwards of several outstanding ``vjp`` graphs in
    reverse order ("Can not find top cell for backward" otherwise), so they run last-in first-out
    here; GPipe's in-order backwards need one graph per microbatch at a time on MindSpore."""
    from hyper_parallel.core.microbatch_schedule import MicrobatchSwapSchedule

    x, w1, w2 = make_params()
    inputs = [x * float(i + 1) for i in range(3)]
    refs = [grads(lambda x: region(x, w1, w2).sum(), [w1, w2], inp)[1] for inp in inputs]
    wrapped = swap_wrapper(region)
    mgr = SwapManager()
    sched = MicrobatchSwapSchedule(mgr, prefix="ms.", prefetch=1)
    runs = []
    for i, inp in enumerate(inputs):
        sched.forward_start(i)
        runs.append(ms.vjp(lambda x: wrapped(x, w1, w2).sum(), inp, weights=[w1, w2]))
        sched.forward_end(i)
    got = {}
    for i in reversed(range(len(runs))):
        out, vjp_fn = runs[i]
        sched.backward_start(i)
        got[i] = _vjp_grads(vjp_fn, out)
        sched.backward_end(i)
    sched.step_end()
    for i, r in enumerate(refs):
        assert_all_equal(r, got[i])
    assert mgr.stats()["offloaded_bytes"] > 0
    assert not [n for n in mgr.group_names() if n.startswith("ms.")]
