"""The per-layer schedule of SwapManager().set_forward_prefetch_layer: the order of the
launch/wait calls, the first/last layer rules, silence during recompute, registration rules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy, SwapManager, checkpoint_wrapper, swap_wrapper)

from support.swap_models import (ManagerSpy, ToyNet, assert_tensors_equal, chain, grads, group,
                                 make_input)

# Every test also runs on the simulated asynchronous device, stream-ordering checker on ([sim]).
pytestmark = pytest.mark.sim_device

N_LAYERS = 4

FORWARD_CALLS = [
    ("launch_offload", "layer_0"),
    # layer 1 ends: own offload, wait the predecessor's, then offload again what the first launch
    # skipped because the caller still held it (layer 0's input)
    ("launch_offload", "layer_1"), ("wait_offload", "layer_0"), ("retry_offload", "layer_0"),
    # layer 2 ends: the same, and the retry launched one layer earlier is waited
    ("launch_offload", "layer_2"), ("wait_offload", "layer_1"), ("retry_offload", "layer_1"),
    ("wait_offload", "layer_0"),
    # the last layer: no offload of its own; waits its predecessor and the retry launched before
    ("wait_offload", "layer_2"), ("wait_offload", "layer_1"),
]
BACKWARD_CALLS = [
    ("launch_load", "layer_2"),  # last layer: prefetch predecessor; its own group was never offloaded
    ("launch_load", "layer_1"), ("wait_load", "layer_2"),
    ("launch_load", "layer_0"), ("wait_load", "layer_1"),
    ("wait_load", "layer_0"),  # first layer: nothing to prefetch
]




def _must_swap_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SWAP
    return CheckpointPolicy.MUST_RECOMPUTE


def _net(kind: str, **kw) -> ToyNet:
    net = ToyNet(layers=N_LAYERS, **kw)
    for i, layer in enumerate(net.layers):
        if kind == "swap_wrapper":
            net.layers[i] = swap_wrapper(layer)
        elif kind == "checkpoint_must_swap":
            net.layers[i] = checkpoint_wrapper(layer, policy_fn=_must_swap_matmuls, swap_inputs=True)
        elif kind != "plain":
            raise ValueError(kind)
    chain(net.layers)
    return net


def _baseline_grads(x, **kw):
    base = ToyNet(layers=N_LAYERS, **kw)
    base(x).backward()
    return grads(base)


@pytest.mark.parametrize("kind", ["swap_wrapper", "checkpoint_must_swap"])
def test_call_order(kind):
    """Item 6: forward launches layer i's offload, then waits layer i-1's (and retries what layer
    i-1's launch skipped because the caller still held it); backward launches the
    predecessor's load, then waits its own. Checkpointed layers (whose recompute re-runs their
    forward) give exactly the same calls: the hooks do not fire during recompute. (The RFC's
    schedule, the default on every device.)"""
    net = _net(kind, dropout=0.1)
    x = make_input(net)
    mgr = SwapManager()
    assert [mgr.layer_group_name(layer) for layer in net.layers] == [f"layer_{i}" for i in range(N_LAYERS)]
    with ManagerSpy() as spy:
        torch.manual_seed(0)
        loss = net(x)
        assert spy.calls == FORWARD_CALLS
        assert not any(spy.in_backward)
        spy.clear()
        loss.backward()
        assert spy.calls == BACKWARD_CALLS
        assert all(spy.in_backward)
    torch.manual_seed(0)
    assert_tensors_equal(grads(net), _baseline_grads(x, dropout=0.1), kind)
    s = mgr.stats()
    assert s["offloaded_bytes"] > 0 and s["loaded_bytes"] == s["offloaded_bytes"]
    last = s["groups"][f"layer_{N_LAYERS - 1}"]
    assert last["offload_launches"] == 0 and last["offloaded_bytes"] == 0, "last layer never offloaded"
    assert s["groups"]["layer_0"]["load_launches"] == 1
    for i in range(N_LAYERS - 1):
        assert s["groups"][f"layer_{i}"]["offloaded_bytes"] > 0, i
    assert s["host_pool"]["in_use_bytes"] == 0


def test_hooks_silent_while_recomputing_chained_sublayers():
    """Chained layers inside a recomputed (checkpointed) region: recompute re-runs their forward
    (their module hooks fire) during backward; the chain must ignore those calls."""
    x = make_input(ToyNet(layers=N_LAYERS))
    expected = _baseline_grads(x)

    counts = {}
    for recompute in (False, True):
        SwapManager().reset()
        net = ToyNet(layers=N_LAYERS)
        chain(net.layers)
        stack = net.layers

        def body(h, stack=stack, mask=net.mask):
            for layer in stack:
                h = layer(h, mask=mask)
            return h

        if recompute:
            body = checkpoint_wrapper(body)
        names = ("launch_offload", "wait_offload", "launch_load", "wait_load", "set_current_group_name")
        fired = []
        for layer in stack:
            layer.register_forward_pre_hook(lambda m, a: fired.append(torch._C._current_graph_task_id() != -1))
        with ManagerSpy(names) as spy:
            loss = net.head(body(x)).square().mean()
            forward_calls = list(spy.calls)
            spy.clear()
            loss.backward()
            backward_calls = list(spy.calls)
        assert_tensors_equal(grads(net), expected, f"recompute={recompute}")
        if recompute:
            assert fired.count(True) == N_LAYERS, "the recompute must re-run the chained layers' forward"
        assert not any(name in ("launch_offload", "wait_offload", "set_current_group_name")
                       for name, _ in backward_calls), backward_calls
        counts[recompute] = (forward_calls, backward_calls)
    assert counts[True] == counts[False]


def test_backward_entered_in_the_middle_loads_on_demand():
    """The loss depends on layer 1 only: layer 1's group was offloaded (layer 2 ran after it)
    and nothing prefetched it; its backward loads it rather than fail (one launch when its
    backward starts, waited there)."""
    net = _net("swap_wrapper")
    x = make_input(net)
    base = ToyNet(layers=N_LAYERS)
    outs, h = [], x
    for layer in base.layers:
        h = layer(h, mask=base.mask)
        outs.append(h)
    outs[1].square().mean().backward()

    outs, h = [], x
    for layer in net.layers:
        h = layer(h, mask=net.mask)
        outs.append(h)
    before = SwapManager().stats()["groups"]["layer_1"]
    assert before["offloaded_bytes"] > 0
    with ManagerSpy() as spy:
        outs[1].square().mean().backward()
    after = SwapManager().stats()["groups"]["layer_1"]
    assert after["loaded_bytes"] - before["loaded_bytes"] > 0
    assert ("launch_load", "layer_1") in spy.calls and ("wait_load", "layer_1") in spy.calls
    assert_tensors_equal(grads(net), grads(base), "middle entry")


def test_chain_restores_the_callers_current_group():
    net = _net("swap_wrapper")
    mgr = SwapManager()
    with group("outer"):
        loss = net(make_input(net))
        assert mgr.get_current_group_name() == "outer"
    loss.backward()
    assert mgr.get_current_group_name() is None


def test_unchained_layer_has_no_group_name():
    assert SwapManager().layer_group_name(nn.Linear(2, 2)) is None


# ------------------------------------------------------------------------------ registration
def test_registration_is_idempotent():
    net = _net("swap_wrapper")
    mgr = SwapManager()
    names = mgr.group_names()
    hooks = [(len(l._forward_pre_hooks), len(l._forward_hooks)) for l in net.layers]
    assert hooks == [(1, 1)] * N_LAYERS
    chain(net.layers)  # again
    mgr.set_forward_prefetch_layer(net.layers[0], net.layers[1])
    assert mgr.group_names() == names
    assert [(len(l._forward_pre_hooks), len(l._forward_hooks)) for l in net.layers] == hooks
    assert [mgr.layer_group_name(l) for l in net.layers] == [f"layer_{i}" for i in range(N_LAYERS)]
    with ManagerSpy() as spy:
        net(make_input(net)).backward()
    assert spy.calls == FORWARD_CALLS + BACKWARD_CALLS


def test_conflicting_links_are_value_errors():
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    mgr = SwapManager()
    mgr.set_forward_prefetch_layer(a, b)
    with pytest.raises(ValueError, match=r"\(layer_0\) already has a different successor \(layer_1\)"):
        mgr.set_forward_prefetch_layer(a, c)
    with pytest.raises(ValueError, match=r"\(layer_1\) already has a different predecessor \(layer_0\)"):
        mgr.set_forward_prefetch_layer(c, b)
    with pytest.raises(ValueError, match="same layer"):
        mgr.set_forward_prefetch_layer(a, a)
    with pytest.raises(TypeError, match="nn.Module"):
        mgr.set_forward_prefetch_layer(a.forward, b.forward)


def test_cycle_is_rejected():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    SwapManager().set_forward_prefetch_layer(a, b)
    with pytest.raises(ValueError):
        SwapManager().set_forward_prefetch_layer(b, a)


def test_rejected_non_module_registration_leaves_no_group():
    mgr = SwapManager()
    with pytest.raises(TypeError):
        mgr.set_forward_prefetch_layer(lambda x: x, lambda x: x)
    assert mgr.group_names() == []


def test_rejected_conflicting_registration_leaves_no_hooks():
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    mgr = SwapManager()
    mgr.set_forward_prefetch_layer(a, b)
    with pytest.raises(ValueError):
        mgr.set_forward_prefetch_layer(a, c)
    assert mgr.layer_group_name(c) is None
    assert len(c._forward_pre_hooks) == 0 and len(c._forward_hooks) == 0


def test_failing_earlier_pre_hook_keeps_the_callers_group():
    a, b = swap_wrapper(nn.Linear(4, 4)), swap_wrapper(nn.Linear(4, 4))

    def boom(module, args):
        raise RuntimeError("user pre-hook failed")

    a.register_forward_pre_hook(boom)  # runs before the chain's pre-hook
    SwapManager().set_forward_prefetch_layer(a, b)
    with group("outer"):
        with pytest.raises(RuntimeError, match="user pre-hook failed"):
            a(torch.randn(2, 4, requires_grad=True))
        assert SwapManager().get_current_group_name() == "outer"


def test_swap_inputs_offloads_layer_inputs_once_the_caller_moved_on():
    """The chain retries storages its first launch skipped because the caller still held them:
    with whole-layer recompute + swap_inputs, every layer input but the last two's is offloaded
    (the last layer is never offloaded; its predecessor's input is still bound when it ends)."""
    from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
    from hyper_parallel.tools.memory import MemoryMeter

    cfg = GPTConfig(vocab=64, dim=32, heads=2, layers=6, seq=32, dropout=0.1)
    tokens, targets = make_batch(cfg, 2, seed=0)

    def run(swap_inputs: bool):
        SwapManager().reset()
        model = GPT(cfg, seed=0)
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer, swap_inputs=swap_inputs)
        chain(model.layers)
        torch.manual_seed(0)
        with MemoryMeter("cpu", track=[model]) as meter:
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            after_forward = meter.current_bytes - meter.baseline_bytes
            loss.backward()
        return grads(model), after_forward, SwapManager().stats()

    plain_grads, plain_bytes, plain_stats = run(False)
    swap_grads, swap_bytes, stats = run(True)
    assert plain_stats["offloaded_bytes"] == 0
    layer_input = 2 * cfg.seq * cfg.dim * 4
    assert stats["offloaded_bytes"] == (cfg.layers - 2) * layer_input
    assert stats["loaded_bytes"] == stats["offloaded_bytes"]
    assert plain_bytes - swap_bytes == (cfg.layers - 2) * layer_input  # live device bytes after forward
    assert_tensors_equal(swap_grads, plain_grads, "swap_inputs")
