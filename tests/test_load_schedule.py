"""The memory-bounded load schedule of the layer chain: the CPU default (copies are synchronous:
offload at once, load on demand), a byte budget for what is prefetched ahead, loads of only the
forward whose backward runs (gradient accumulation), and the memory that buys."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
from hyper_parallel.core.activation_checkpoint import SwapManager, checkpoint_wrapper, swap_wrapper, wrap_layers
from hyper_parallel.core.swap_tensor import TensorState
from hyper_parallel.tools.memory import MemoryMeter

from support.swap_models import ManagerSpy, ToyNet, assert_tensors_equal, chain, grads, make_input

N_LAYERS = 4

# CPU default: every layer offloads and waits at once (the last one too), its predecessor's input
# (held by the caller at the first launch) is retried when the next layer ends and waited one
# layer later; backward loads each layer on demand, nothing ahead.
CPU_FORWARD_CALLS = [
    ("launch_offload", "layer_0"), ("wait_offload", "layer_0"),
    ("launch_offload", "layer_1"), ("wait_offload", "layer_1"), ("launch_offload", "layer_0"),
    ("launch_offload", "layer_2"), ("wait_offload", "layer_2"), ("launch_offload", "layer_1"),
    ("wait_offload", "layer_0"),
    ("launch_offload", "layer_3"), ("wait_offload", "layer_3"), ("wait_offload", "layer_1"),
]
CPU_BACKWARD_CALLS = [
    ("launch_load", "layer_3"), ("wait_load", "layer_3"),
    ("launch_load", "layer_2"), ("wait_load", "layer_2"),
    ("launch_load", "layer_1"), ("wait_load", "layer_1"),
    ("launch_load", "layer_0"), ("wait_load", "layer_0"),
]


def _swapped_net(**kw) -> ToyNet:
    net = ToyNet(layers=N_LAYERS, **kw)
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    chain(net.layers)
    return net


def test_cpu_default_offloads_at_once_and_loads_on_demand():
    mgr = SwapManager()
    assert not mgr.copies_overlap() and mgr.prefetch_budget() == 0
    net = _swapped_net(dropout=0.1)
    x = make_input(net)
    with ManagerSpy() as spy:
        torch.manual_seed(0)
        loss = net(x)
        assert spy.calls == CPU_FORWARD_CALLS
        # after forward only the last two layers' inputs are left (held by the caller when their
        # groups were launched, and no later layer end retries them)
        assert mgr.resident_swap_bytes() <= 2 * x.nbytes
        spy.clear()
        loss.backward()
        assert spy.calls == CPU_BACKWARD_CALLS
    reference = ToyNet(layers=N_LAYERS, dropout=0.1)
    torch.manual_seed(0)
    reference(x).backward()
    assert_tensors_equal(grads(net), grads(reference), "cpu default schedule")
    s = mgr.stats()
    assert s["offloaded_bytes"] == s["loaded_bytes"] > 0 and s["host_pool"]["in_use_bytes"] == 0


def test_budget_none_restores_the_rfc_schedule_and_validates():
    mgr = SwapManager()
    mgr.set_prefetch_budget(None)
    assert mgr.prefetch_budget() is None
    mgr.set_prefetch_budget(1 << 20)
    assert mgr.prefetch_budget() == 1 << 20
    for bad in (-1, 1.5, "1MB", True):
        with pytest.raises(TypeError, match="number of bytes"):
            mgr.set_prefetch_budget(bad)
    mgr.reset()
    assert mgr.prefetch_budget() == 0  # back to the device's default


def test_limited_load_goes_in_backward_use_order_and_leaves_the_rest_on_the_host():
    mgr = SwapManager()
    storage = mgr.new_storage("g")
    sizes = [64, 128, 256]  # saved in this order: backward needs the last one first
    views = [storage.add_swap(torch.randn(n)) for n in sizes]
    values = [v.get_val().clone() for v in views]
    mgr.launch_offload("g"); mgr.wait_offload("g")
    tensors = [v._swap_tensor for v in views]
    mgr.launch_load("g", limit_bytes=(256 + 128) * 4)
    assert [t.state for t in tensors] == [TensorState.HOST, TensorState.H2D, TensorState.H2D]
    mgr.wait_load("g")
    assert mgr.stats()["loaded_bytes"] == (256 + 128) * 4
    mgr.launch_load("g"); mgr.wait_load("g")  # the rest, on demand
    assert all(torch.equal(v.get_val(), value) for v, value in zip(views, values))
    with pytest.raises(TypeError, match="limit_bytes"):
        mgr.launch_load("g", limit_bytes=-5)


def test_budgeted_prefetch_brings_back_at_most_the_budget_ahead():
    mgr = SwapManager()
    net = _swapped_net()
    x = make_input(net)
    ahead = {}

    def watch(index):
        def hook(module, grad_input, grad_output):  # this layer's backward is done
            if index > 0:  # what was prefetched of the predecessor while this layer ran backward
                ahead[index] = mgr.stats()["groups"][f"layer_{index - 1}"]["loaded_bytes"]
        return hook

    for i, layer in enumerate(net.layers):
        layer.register_full_backward_hook(watch(i))
    loss = net(x)
    budget = mgr.stats()["groups"]["layer_1"]["offloaded_bytes"] // 2
    mgr.set_prefetch_budget(budget)
    loss.backward()
    assert sorted(ahead) == [1, 2, 3] and all(0 < n <= budget for n in ahead.values()), ahead
    s = mgr.stats()
    assert s["loaded_bytes"] == s["offloaded_bytes"]  # the rest came back on demand
    reference = ToyNet(layers=N_LAYERS)
    reference(x).backward()
    assert_tensors_equal(grads(net), grads(reference), "budgeted prefetch")


def test_gradient_accumulation_loads_only_the_forward_whose_backward_runs():
    mgr = SwapManager()
    net = _swapped_net()
    x1, x2 = make_input(net, seed=1), make_input(net, seed=2)
    loss1 = net(x1)
    loss2 = net(x2)

    def on_host():
        return sum(1 for name in mgr.group_names() for t in mgr._group(name)._tensors(TensorState.HOST))

    assert on_host() > 0
    loss1.backward()
    # Only the first forward came back: the second one's tensors are still on the host ...
    assert 0 < mgr.stats()["loaded_bytes"] < mgr.stats()["offloaded_bytes"] and on_host() > 0
    loss2.backward()
    # ... until its own backward.
    assert mgr.stats()["loaded_bytes"] == mgr.stats()["offloaded_bytes"] and on_host() == 0

    reference = ToyNet(layers=N_LAYERS)
    reference(x1).backward()
    reference(x2).backward()
    assert_tensors_equal(grads(net), grads(reference), "accumulated")


def _step_peaks(mode: str):
    cfg = GPTConfig(vocab=64, dim=64, heads=2, layers=6, seq=64, dropout=0.0)
    tokens, targets = make_batch(cfg, 4, seed=0)
    SwapManager().reset()
    model = GPT(cfg, seed=0)
    if mode == "recompute":
        wrap_layers(model.layers, chain=False)
    elif mode == "swap_wrapper":
        wrap_layers(model.layers, swap=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients exist before the step in every mode
    with MemoryMeter("cpu", track=[model], scan_gc=False) as meter:
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        forward_peak = meter.peak_above_baseline
        loss.backward()
    return forward_peak, meter.peak_above_baseline


@pytest.mark.slow
def test_swap_peak_is_no_higher_than_recompute_on_cpu():
    """Live-storage meter, not the library's counters: with the default schedule a swap_wrapper
    stack holds, in backward, the running layer's reloaded tensors freed as they are used."""
    _, recompute = _step_peaks("recompute")
    _, swap = _step_peaks("swap_wrapper")
    _, none = _step_peaks("none")
    assert swap <= recompute < none
