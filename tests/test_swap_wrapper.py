"""swap_wrapper end to end: the RFC's swap_wrapper modes on the GPT-like model (bitwise vs no
swap, memory ordering, statistics), behaviour without a schedule (= SAVE), and policy checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy, SwapManager, checkpoint, checkpoint_wrapper, swap_wrapper)
from hyper_parallel.tools.memory import MemoryMeter

from support.swap_models import (ToyNet, assert_tensors_equal, grads, group, make_input, params, round_trip,
                         train)

# Every test also runs on the simulated asynchronous device, stream-ordering checker on ([sim]).
pytestmark = pytest.mark.sim_device

bench_model = pytest.importorskip("hyper_parallel.bench.model")
bench_modes = pytest.importorskip("hyper_parallel.bench.modes")




# ------------------------------------------------------------------------------ item 1
GPT_CFG = dict(vocab=64, dim=16, heads=2, layers=4, seq=32, dropout=0.1)
BATCH = 2


def _run_gpt_mode(mode: str, threshold: int):
    """3 Adam steps; the memory meter wraps the first step only (the CPU
    meter costs a Python call per op; every step has the same activation peak)."""
    SwapManager().reset()
    cfg = bench_model.GPTConfig(**GPT_CFG)
    model = bench_model.GPT(cfg, seed=0)
    bench_modes.apply_swap_wrapper_mode(model, mode, swap_threshold_bytes=threshold)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model.train()
    losses, peak = [], None
    for step in range(3):
        tokens, targets = bench_model.make_batch(cfg, BATCH, step)
        opt.zero_grad(set_to_none=True)
        if step == 0:
            with MemoryMeter("cpu", track=[model, opt], scan_gc=False) as meter:
                loss = model(tokens, targets)
                loss.backward()
            peak = meter.peak_above_baseline
        else:
            loss = model(tokens, targets)
            loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    stats = SwapManager().stats()
    grads_ = {n: p.grad.clone() for n, p in model.named_parameters()}
    return losses, params(model), grads_, peak, stats


@pytest.mark.slow
def test_swap_wrapper_modes_bitwise_and_memory_ordering():
    """Item 1: swap_wrapper on every layer's attention, layers chained; modes none / swap /
    swap_with_policy (threshold = one attention probability matrix) over 3 Adam steps."""
    cfg = bench_model.GPTConfig(**GPT_CFG)
    scores_bytes = BATCH * cfg.heads * cfg.seq * cfg.seq * 4
    results = {mode: _run_gpt_mode(mode, scores_bytes) for mode in ("none", "swap", "swap_with_policy")}

    ref_losses, ref_params, ref_grads, ref_peak, ref_stats = results["none"]
    assert ref_stats["offloaded_bytes"] == 0
    for mode in ("swap", "swap_with_policy"):
        losses, params_, grads_, _, stats = results[mode]
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), f"{mode}: losses differ"
        assert_tensors_equal(params_, ref_params, f"{mode} params")
        assert_tensors_equal(grads_, ref_grads, f"{mode} grads")
        assert stats["offloaded_bytes"] > 0, mode
        assert stats["loaded_bytes"] == stats["offloaded_bytes"], mode
        assert stats["kept_bytes"].get("parameter", 0) > 0, mode
        last = stats["groups"][f"layer_{cfg.layers - 1}"]["offloaded_bytes"]
        assert last == 0, "the RFC's schedule never offloads the last layer"
        assert stats["host_pool"]["in_use_bytes"] == 0
    policy_stats = results["swap_with_policy"][4]
    assert policy_stats["kept_bytes"].get("policy_save", 0) > 0
    assert policy_stats["offloaded_bytes"] < results["swap"][4]["offloaded_bytes"]

    peaks = {mode: r[3] for mode, r in results.items()}
    assert peaks["none"] > peaks["swap_with_policy"] > peaks["swap"], peaks


# ------------------------------------------------------------------------------ item 7
def _swap_wrapped_toy(**kw):
    net = ToyNet(**kw)
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    return net


def _must_swap_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SWAP
    return CheckpointPolicy.MUST_RECOMPUTE


@pytest.mark.parametrize("kind", ["swap_wrapper", "checkpoint_must_swap"])
def test_no_schedule_behaves_as_save(kind):
    """Item 7: without a chain and without launches, swapped tensors never leave the device."""
    base = ToyNet(dropout=0.1)
    ref_losses, _ = train(base, steps=2)
    if kind == "swap_wrapper":
        net = _swap_wrapped_toy(dropout=0.1)
    else:
        net = ToyNet(dropout=0.1)
        for i, layer in enumerate(net.layers):
            net.layers[i] = checkpoint_wrapper(layer, policy_fn=_must_swap_matmuls, swap_inputs=True)
    losses, _ = train(net, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert_tensors_equal(grads(net), grads(base), kind)
    assert_tensors_equal(params(net), params(base), kind)
    s = SwapManager().stats()
    assert s["offloaded_bytes"] == s["loaded_bytes"] == 0
    assert s["offload_launches"] == s["load_launches"] == 0
    assert s["host_pool"]["allocations"] == 0 and s["host_pool"]["reserved_bytes"] == 0


def test_swap_wrapper_state_dict_and_names_unchanged():
    plain = ToyNet()
    net = _swap_wrapped_toy()
    assert list(net.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in net.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert net.layers[0].fc1 is net.layers[0]._modules["fc1"]


def test_swap_wrapper_on_a_function_with_manual_group():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def block(x):
        return torch.tanh(lin(x)).sigmoid() * x

    block(x.requires_grad_()).sum().backward()
    ref = (x.grad.clone(), lin.weight.grad.clone())
    x.grad = None
    lin.zero_grad(set_to_none=True)
    wrapped = swap_wrapper(block)
    assert wrapped.__name__ == "block"
    with group("fn"):
        out = wrapped(x).sum()
    round_trip("fn")
    out.backward()
    assert torch.equal(x.grad, ref[0]) and torch.equal(lin.weight.grad, ref[1])
    s = SwapManager().stats()["groups"]["fn"]
    assert s["offloaded_bytes"] > 0 and s["loaded_bytes"] == s["offloaded_bytes"]
    # x is a leaf requiring grad and lin.weight a parameter (of another owner): never swapped.
    assert s["kept_bytes"].get("parameter", 0) >= lin.weight.nbytes + x.nbytes


def test_swap_wrapper_under_no_grad_saves_nothing():
    net = _swap_wrapped_toy()
    x = make_input(net)
    with torch.no_grad():
        with group("nograd"):
            out = net(x)
    assert torch.equal(out, ToyNet()(x).detach())
    assert "nograd" not in SwapManager().group_names()
    assert SwapManager().stats()["groups"].get("nograd", {}).get("kept_bytes", {}) == {}


def test_swap_wrapper_inside_checkpoint_does_not_swap():
    """A checkpoint region owns what is saved inside it: swap does not apply there."""
    base = ToyNet()
    x = make_input(base)
    base(x).backward()
    net = _swap_wrapped_toy()
    loss = checkpoint(net, x)
    assert "default" not in SwapManager().group_names(), "no storage may be created"
    loss.backward()
    assert_tensors_equal(grads(net), grads(base), "swap inside checkpoint")
    assert SwapManager().stats()["offloaded_bytes"] == 0


# ------------------------------------------------------------------------------ policies
def test_policy_controls_what_is_swapped():
    seen = []

    def policy(t):
        seen.append(t)
        return CheckpointPolicy.MUST_SWAP if t.numel() >= 4 * 8 * 32 else CheckpointPolicy.PREFER_SAVE

    base = ToyNet()
    x = make_input(base)
    base(x).backward()
    net = ToyNet()
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer, policy_fn=policy)
    with group("p"):
        loss = net(x)
    assert seen and all(isinstance(t, torch.Tensor) for t in seen)
    # The wrapped layer's own parameters and buffers (and views such as fc1.weight.t()) are never
    # offered to the policy. (The parent's `mask` buffer is offered: it is kept as 'shared'.)
    own = {t.untyped_storage().data_ptr() for layer in net.layers
           for t in list(layer.parameters()) + list(layer.buffers())}
    assert not any(t.untyped_storage().data_ptr() in own for t in seen), \
        "the region's parameters and buffers are never offered to the policy"
    del seen[:]
    round_trip("p")
    loss.backward()
    assert_tensors_equal(grads(net), grads(base), "policy")
    s = SwapManager().stats()
    assert s["offloaded_bytes"] > 0 and s["kept_bytes"].get("policy_save", 0) > 0


def test_must_save_policy_swaps_nothing():
    net = ToyNet()
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer, policy_fn=lambda t: CheckpointPolicy.MUST_SAVE)
    with group("p"):
        loss = net(make_input(net))
    round_trip("p")
    loss.backward()
    s = SwapManager().stats()
    assert s["offloaded_bytes"] == 0 and s["kept_bytes"]["policy_save"] > 0


@pytest.mark.parametrize("bad", [True, False, None, "swap", CheckpointPolicy.MUST_RECOMPUTE,
                                 CheckpointPolicy.PREFER_RECOMPUTE, 4])
def test_policy_returning_bad_value_is_type_error(bad):
    net = ToyNet()
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer, policy_fn=lambda t: bad)
    with pytest.raises(TypeError, match=r"swap_wrapper policy_fn returned .*MUST_SWAP"):
        net(make_input(net))
    assert SwapManager().get_current_group_name() is None


def test_non_callable_policy_rejected_at_wrap_time():
    with pytest.raises(TypeError, match="policy_fn"):
        swap_wrapper(nn.Linear(2, 2), policy_fn=CheckpointPolicy.MUST_SWAP)
    with pytest.raises(TypeError, match="nn.Module or a callable"):
        swap_wrapper(42)


def test_double_swap_wrap_rejected():
    layer = swap_wrapper(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already wrapped"):
        swap_wrapper(layer)
