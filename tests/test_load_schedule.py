"""The layer chain's schedule on a CPU build (the accelerator's launches and waits, each copy done
when it returns), a byte budget for what is prefetched ahead, loads of only the forward whose
backward runs (gradient accumulation), and the memory that buys."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
from hyper_parallel.bench.modes import swap_matmuls
from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper, wrap_layers
from hyper_parallel.core.swap_tensor import TensorState
from hyper_parallel.tools.memory import MemoryMeter

from support.swap_models import (ManagerSpy, ToyNet, add_swap, assert_tensors_equal, chain, grads,
                                 make_input)

N_LAYERS = 4

def _swapped_net(**kw) -> ToyNet:
    net = ToyNet(layers=N_LAYERS, **kw)
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    chain(net.layers)
    return net


def test_the_cpu_runs_the_accelerators_timetable():
    """Without a copy stream what is on the device when each layer's backward starts is what the
    accelerator's schedule holds there (its calls, the same on every backend, are checked in
    tests/test_layer_chain.py): the layer's own swapped tensors (loaded one layer earlier) and
    its predecessor's (prefetched now); every layer below holds only what never left (the inputs
    the caller held)."""
    mgr = SwapManager()
    assert mgr.prefetch_budget() is None
    net = _swapped_net(dropout=0.1)
    x = make_input(net)
    at_start = []

    def resident():
        return {i: mgr._group(f"layer_{i}").resident_swap_bytes() for i in range(N_LAYERS)}

    def note(i):  # a grad hook on layer i's output, registered after the chain's own
        return lambda g: at_start.append((i, resident()))

    for i, layer in enumerate(net.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: [out.register_hook(note(i)), None][1])
    torch.manual_seed(0)
    loss = net(x)
    # after forward: the last layer (never offloaded) and the input of the one before it (held by
    # the caller at its launch, and no later layer end retries it)
    after_forward = resident()
    assert after_forward[0] == after_forward[1] == 0 and after_forward[2] == x.nbytes
    loss.backward()
    whole = {i: mgr.stats()["groups"][f"layer_{i}"]["offloaded_bytes"] + after_forward[i] for i in range(N_LAYERS)}
    for i, seen in at_start:
        expected = {j: whole[j] if j in (i - 1, i) else 0 if j > i else after_forward[j] for j in range(N_LAYERS)}
        assert seen == expected, (i, seen, expected)
    assert [i for i, _ in at_start] == [3, 2, 1, 0]
    reference = ToyNet(layers=N_LAYERS, dropout=0.1)
    torch.manual_seed(0)
    reference(x).backward()
    assert_tensors_equal(grads(net), grads(reference), "the chain on a CPU build")
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
    assert mgr.prefetch_budget() is None  # back to the default


def test_limited_load_goes_in_backward_use_order_and_leaves_the_rest_on_the_host():
    mgr = SwapManager()
    storage = mgr.new_storage("g")
    sizes = [64, 128, 256]  # saved in this order: backward needs the last one first
    views = [add_swap(storage, torch.randn(n)) for n in sizes]
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


def _step_peaks(mode: str, budget=None):
    """(forward peak, step peak) of a small bench GPT, batch 4 (``budget``: the prefetch budget)."""
    cfg = GPTConfig(vocab=64, dim=64, heads=2, layers=6, seq=64, dropout=0.0)
    fwd, step, _ = _gpt_step(mode, cfg, batch=4, budget=budget)
    return fwd, step


@pytest.mark.slow
def test_swap_peaks_on_cpu_follow_the_schedule():
    """Live-storage meter, not the library's counters: a chained swap_wrapper stack holds a few
    layers' activations (in forward the running layer, its predecessor's offload and the last
    layer, never offloaded; in backward the running layer and its prefetched predecessor), well
    under half of what the plain stack holds; with a prefetch budget of 0 nothing is loaded ahead,
    so the step peaks where the forward does, lower than with the whole predecessor prefetched."""
    _, none = _step_peaks("none")
    forward, step = _step_peaks("swap_wrapper")
    lean_forward, lean_step = _step_peaks("swap_wrapper", budget=0)
    assert forward == lean_forward < step < none / 2
    assert lean_step == lean_forward


def _gpt_step(mode: str, cfg: GPTConfig, batch: int = 2, budget=None):
    """One metered step of the bench GPT: (forward peak, step peak, gradients)."""
    tokens, targets = make_batch(cfg, batch, seed=0)
    SwapManager().reset()
    SwapManager().set_prefetch_budget(budget)
    model = GPT(cfg, seed=0)
    if mode == "recompute":
        wrap_layers(model.layers, chain=False)
    elif mode == "swap_wrapper":
        wrap_layers(model.layers, swap=True)
    elif mode == "swap":
        wrap_layers(model.layers, policy_fn=swap_matmuls, swap_inputs=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients exist before the step in every mode
    with MemoryMeter("cpu", track=[model], scan_gc=False) as meter:
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        forward_peak = meter.peak_above_baseline
        loss.backward()
    return forward_peak, meter.peak_above_baseline, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradient_accumulation_with_the_backwards_in_reverse_order():
    """Two forwards of a chained GPT before their backwards, the second one's first: each backward
    loads its own forward's tensors, gradients bitwise."""
    cfg = GPTConfig(vocab=64, dim=128, heads=2, layers=3, seq=256, dropout=0.0)
    batches = [make_batch(cfg, 2, seed=s) for s in (0, 1)]

    def run(swap: bool):
        SwapManager().reset()
        model = GPT(cfg, seed=0)
        if swap:
            wrap_layers(model.layers, swap=True)
        losses = [torch.nn.functional.cross_entropy(model(t).flatten(0, 1), y.flatten()) for t, y in batches]
        for loss in reversed(losses):  # the second forward's backward first
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    expected = run(False)
    got = run(True)
    assert_tensors_equal(got, expected, "accumulated, backwards in reverse order")
    s = SwapManager().stats()
    assert 0 < s["loaded_bytes"] == s["offloaded_bytes"] and s["host_pool"]["in_use_bytes"] == 0


def test_the_chain_under_a_host_cap_keeps_the_rest_and_stays_bitwise():
    """The chain's offloads honour the host cap: what does not fit stays on the device (kept
    'host_limit'), the rest goes and comes back; gradients bitwise."""
    mgr = SwapManager()
    net = _swapped_net()
    x = make_input(net)
    reference = ToyNet(layers=N_LAYERS)
    reference(x).backward()
    per_layer = x.nbytes * 4  # well below one layer's saved activations
    mgr.set_host_memory_limit(per_layer)
    with ManagerSpy() as spy:
        net(x).backward()
    assert ("launch_offload", "layer_0") in spy.calls and ("wait_offload", "layer_0") in spy.calls
    s = mgr.stats()
    assert s["kept_bytes"].get("host_limit", 0) > 0 and 0 < s["offloaded_bytes"] == s["loaded_bytes"]
    assert s["host_pool"]["reserved_bytes"] <= per_layer and s["host_pool"]["in_use_bytes"] == 0
    assert_tensors_equal(grads(net), grads(reference), "the chain under a host cap")


def test_failing_copy_of_a_cpu_offload_leaves_the_tensor_usable(monkeypatch):
    """A copy that raises inside an offload where copies are synchronous: the error reaches the
    caller, the tensor whose copy failed stays on the device, readable, with its host buffer back
    in the pool; the one copied before it is on the host once waited; the rest was not looked at."""
    mgr = SwapManager()
    storage = mgr.new_storage("g")
    values = [torch.randn(8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    views = [add_swap(storage, v.clone()) for v in values]
    backend = mgr.backend
    real = type(backend).copy_bytes
    copies = []

    def flaky(self, dst, src, dst_offset=0):
        copies.append(1)
        if len(copies) == 2:
            raise RuntimeError("simulated copy failure")
        return real(self, dst, src, dst_offset)

    monkeypatch.setattr(type(backend), "copy_bytes", flaky)
    with pytest.raises(RuntimeError, match="simulated copy failure"):
        mgr.launch_offload("g")
    mgr.wait_offload("g")
    monkeypatch.setattr(type(backend), "copy_bytes", real)
    assert [v._swap_tensor.state for v in views] == [TensorState.HOST, TensorState.DEVICE, TensorState.DEVICE]
    pool = mgr.stats()["host_pool"]
    assert pool["in_use_bytes"] == values[0].nbytes and mgr.stats()["offloaded_bytes"] == values[0].nbytes
    assert torch.equal(views[1].get_val(), values[1])
    mgr.launch_offload("g")  # the rest goes now
    mgr.wait_offload("g")
    assert all(v._swap_tensor.state is TensorState.HOST for v in views)
    mgr.launch_load("g")
    mgr.wait_load("g")
    assert all(torch.equal(v.get_val(), val) for v, val in zip(views, values))
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0


def test_schedule_accounting_shared_once_and_one_load_per_offloaded_layer():
    """The statistics of the chain's offloads and loads, against what the model saves: in the
    layers that are offloaded (all but the last), the parent's mask (saved by every layer, held by
    the model) and the inputs the caller still holds stay 'shared', each storage counted once (the
    network input is retried and still held; the input of the layer before the last is never
    retried); layer 1's input, skipped at its layer's end and offloaded by the retry, is taken back
    out of 'shared'. Every other storage those layers save is offloaded, and backward loads each
    such layer in one launch."""
    mgr = SwapManager()
    net = _swapped_net()
    x = make_input(net)
    net(x).backward()
    s = mgr.stats()
    assert s["kept_bytes"]["shared"] == (N_LAYERS - 1) * net.mask.nbytes + 2 * x.nbytes, s["kept_bytes"]
    assert s["offloaded_bytes"] == s["loaded_bytes"] > 0
    assert s["load_launches"] == N_LAYERS - 1
    # every other storage of those layers left: what they save, less the two inputs that stayed
    saved = _bytes_saved_in_layers(ToyNet(layers=N_LAYERS), x, N_LAYERS - 1)
    assert s["offloaded_bytes"] == saved - 2 * x.nbytes, (s["offloaded_bytes"], saved)


def _bytes_saved_in_layers(net: ToyNet, x: torch.Tensor, layers: int) -> int:
    """The bytes of the distinct storages, parameters and buffers aside, that the first ``layers``
    layers of an unwrapped ``net`` save for backward in one forward of ``x``."""
    static = {t.untyped_storage().data_ptr() for t in list(net.parameters()) + list(net.buffers())}
    inside, saved = [False], {}
    for layer in net.layers[:layers]:
        layer.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in static:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = net(x)
    del loss
    return sum(saved.values())
