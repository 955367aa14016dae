"""The memory-bounded load schedule of the layer chain: the CPU default (copies are synchronous:
offload at once, each tensor loaded when backward uses it), a byte budget for what is prefetched ahead, loads of only the
forward whose backward runs (gradient accumulation), and the memory that buys."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
from hyper_parallel.bench.modes import swap_matmuls
from hyper_parallel.core.activation_checkpoint import SwapManager, checkpoint_wrapper, swap_wrapper, wrap_layers
from hyper_parallel.core.swap_tensor import TensorState
from hyper_parallel.tools.memory import MemoryMeter

from support.swap_models import (ManagerSpy, ToyNet, add_swap, assert_tensors_equal, chain, follows_memory, grads,
                                 make_input)

N_LAYERS = 4

# CPU default: every layer's offload is waited right after its launch (the last one's too), its
# predecessor's input (held by the caller at the first launch) is retried, also waited at once, when
# the next layer ends (the chain retries only from a layer that has a successor, as on an
# accelerator, where nothing would wait a retry launched by the last layer); backward makes no load
# call: each offloaded tensor is loaded when autograd unpacks it.
CPU_FORWARD_CALLS = [
    ("launch_offload", "layer_0"), ("wait_offload", "layer_0"),
    ("launch_offload", "layer_1"), ("wait_offload", "layer_1"),
    ("retry_offload", "layer_0"), ("wait_offload", "layer_0"),
    ("launch_offload", "layer_2"), ("wait_offload", "layer_2"),
    ("retry_offload", "layer_1"), ("wait_offload", "layer_1"),
    ("launch_offload", "layer_3"), ("wait_offload", "layer_3"),
]
CPU_BACKWARD_CALLS: list = []


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
    at_start = []

    def note(i):  # a grad hook on layer i's output, registered after the chain's own
        return lambda g: at_start.append((i, mgr._group(f"layer_{i}").resident_swap_bytes()))

    for i, layer in enumerate(net.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: [out.register_hook(note(i)), None][1])
    with ManagerSpy() as spy:
        torch.manual_seed(0)
        loss = net(x)
        assert spy.calls == CPU_FORWARD_CALLS
        # after forward only the last two layers' inputs are left (held by the caller when their
        # groups were launched, and no later layer end retries them)
        assert mgr.resident_swap_bytes() <= 2 * x.nbytes
        after_forward = {i: mgr._group(f"layer_{i}").resident_swap_bytes() for i in range(N_LAYERS)}
        spy.clear()
        # When each layer's backward starts (its output's gradient is ready), none of its
        # offloaded tensors is on the device yet: they come back one by one as autograd uses them
        # (a per-layer load would have brought the whole layer back here).
        loss.backward()
        assert spy.calls == CPU_BACKWARD_CALLS
        assert [i for i, _ in at_start] == [3, 2, 1, 0]
        # what is resident then is what never left (the inputs held by the caller), not a load
        assert at_start == [(i, after_forward[i]) for i in (3, 2, 1, 0)], (at_start, after_forward)
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


def _step_peaks(mode: str):
    """(forward peak, step peak) of a small bench GPT, batch 4."""
    fwd, step, _ = _gpt_step(mode, GPTConfig(vocab=64, dim=64, heads=2, layers=6, seq=64, dropout=0.0), batch=4)
    return fwd, step


@pytest.mark.slow
def test_swap_peak_is_no_higher_than_recompute_on_cpu():
    """Live-storage meter, not the library's counters: with the default schedule a swap_wrapper
    stack holds, in backward, the running layer's reloaded tensors freed as they are used."""
    _, recompute = _step_peaks("recompute")
    _, swap = _step_peaks("swap_wrapper")
    _, none = _step_peaks("none")
    assert swap <= recompute < none


def _gpt_step(mode: str, cfg: GPTConfig, batch: int = 2):
    """One metered step of the bench GPT: (forward peak, step peak, gradients)."""
    tokens, targets = make_batch(cfg, batch, seed=0)
    SwapManager().reset()
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


def test_cpu_default_offloads_dropped_tensors_during_the_layer(monkeypatch):
    """Where copies are synchronous, what a chained layer saved and its forward already dropped is
    offloaded while the layer runs (every EARLY_OFFLOAD_CHUNK saved bytes), as save_on_cpu would:
    the forward peak falls below recompute's, which it does not when offloads wait for the layer's
    end; gradients stay bitwise equal. Live-storage meter, not the library's counters."""
    import hyper_parallel.core.storage as storage_module

    cfg = GPTConfig(vocab=64, dim=128, heads=2, layers=4, seq=256, dropout=0.0)  # ~1 MiB tensors
    assert follows_memory()
    fwd_none, _, expected = _gpt_step("none", cfg)
    fwd_recompute, step_recompute, _ = _gpt_step("recompute", cfg)
    fwd_swap, step_swap, got = _gpt_step("swap_wrapper", cfg)
    assert_tensors_equal(got, expected, "early offload")
    early = SwapManager().stats()
    assert early["offloaded_bytes"] == early["loaded_bytes"] > 0
    monkeypatch.setattr(storage_module, "EARLY_OFFLOAD_CHUNK", 1 << 40)  # offload at the layer's end only
    fwd_late, _, _ = _gpt_step("swap_wrapper", cfg)
    late = SwapManager().stats()
    assert early["offload_launches"] > late["offload_launches"]
    assert fwd_swap <= fwd_recompute < fwd_late < fwd_none
    assert step_swap <= step_recompute


def test_cpu_default_gradient_accumulation_with_early_offload():
    """Two forwards before their backwards, each layer saving ~1 MiB tensors (so the early offload
    runs): every offloaded tensor comes back when its own backward uses it, gradients bitwise."""
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
    assert_tensors_equal(got, expected, "accumulated, early offload")
    s = SwapManager().stats()
    assert 0 < s["loaded_bytes"] <= s["offloaded_bytes"] and s["host_pool"]["in_use_bytes"] == 0
    assert s["offload_launches"] > 2 * cfg.layers  # more than one launch per layer and forward: early ones


def test_cpu_default_offloads_swapped_outputs_between_the_ops_of_a_selective_region(monkeypatch):
    """MUST_SWAP matmul outputs (+ swapped inputs) of checkpointed, chained layers: where copies are
    synchronous, an output the forward has dropped leaves at the region's next op, so the forward
    peak is no higher than recompute's; only at the next swapped op or the layer's end (the
    control) it is higher. Gradients bitwise; live-storage meter."""
    from hyper_parallel.core.storage import Storage

    cfg = GPTConfig(vocab=64, dim=128, heads=2, layers=4, seq=256, dropout=0.0)
    _, _, expected = _gpt_step("none", cfg)
    fwd_recompute, step_recompute, _ = _gpt_step("recompute", cfg)
    fwd_swap, step_swap, got = _gpt_step("swap", cfg)
    assert_tensors_equal(got, expected, "selective swap, early offload")
    assert fwd_swap <= fwd_recompute and step_swap <= step_recompute
    monkeypatch.setattr(Storage, "offload_dropped", lambda self: None)
    fwd_late, _, _ = _gpt_step("swap", cfg)
    assert fwd_late > fwd_recompute


def test_cpu_offload_at_once_under_a_host_cap_keeps_the_rest_and_stays_bitwise():
    """The offload of the CPU schedule, waited at once, honours the host cap: what does not fit
    stays on the device (kept 'host_limit'), the rest goes and comes back; gradients bitwise."""
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
    assert_tensors_equal(grads(net), grads(reference), "cpu offload at once under a host cap")


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


def test_cpu_schedule_accounting_shared_once_and_one_load_per_tensor():
    """The statistics of the offloads and loads on use of the CPU schedule, against what the
    model saves: the parent's mask (saved by every layer, held by the model) and the inputs the
    caller still holds stay 'shared', each storage counted once (the network input is retried and
    still held; the last two layers' inputs are never retried); layer 1's input, skipped at its
    layer's end and offloaded by the retry, is taken back out of 'shared'. Backward loads each
    offloaded storage in one launch of its own: one per storage the layers save, less the mask and
    the three inputs that stay."""
    mgr = SwapManager()
    net = _swapped_net()
    x = make_input(net)
    net(x).backward()
    s = mgr.stats()
    assert s["kept_bytes"]["shared"] == N_LAYERS * net.mask.nbytes + 3 * x.nbytes, s["kept_bytes"]
    assert s["offloaded_bytes"] == s["loaded_bytes"] > 0
    assert s["load_launches"] == _storages_saved_in_layers(ToyNet(layers=N_LAYERS), x) - 3


def _storages_saved_in_layers(net: ToyNet, x: torch.Tensor) -> int:
    """How many distinct storages, parameters and buffers aside, the layers of an unwrapped
    ``net`` save for backward in one forward of ``x``."""
    static = {t.untyped_storage().data_ptr() for t in list(net.parameters()) + list(net.buffers())}
    inside, saved = [False], set()
    for layer in net.layers:
        layer.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] and t.untyped_storage().data_ptr() not in static:
            saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(x)
    return len(saved)
