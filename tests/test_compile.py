"""torch.compile of models whose layers use the wrappers: what runs compiled, what runs eagerly
(a graph break around it), and gradients equal to eager."""

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import (CheckpointPolicy, SwapManager, checkpoint_wrapper,
                                                       swap_wrapper, wrap_layers)

aten = torch.ops.aten
HEAVY = {aten.mm.default, aten.addmm.default}


def save_heavy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in HEAVY else CheckpointPolicy.PREFER_RECOMPUTE


def swap_heavy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SWAP if op in HEAVY else CheckpointPolicy.PREFER_RECOMPUTE


def make():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)])


def grads_of(model, x):
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


WRAPPINGS = {
    "recompute": lambda m: wrap_layers(m, chain=False),
    "policy": lambda m: wrap_layers(m, policy_fn=save_heavy, chain=False),
    "swap_policy": lambda m: wrap_layers(m, policy_fn=swap_heavy),
    "swap_wrapper": lambda m: wrap_layers(m, swap=True),
    "swap_inputs": lambda m: wrap_layers(m, policy_fn=swap_heavy, swap_inputs=True),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WRAPPINGS))
def test_compiled_model_with_wrapped_layers_matches_eager(name):
    x = torch.randn(4, 16)
    reference = grads_of(make(), x)
    model = make()
    WRAPPINGS[name](model)
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(2):  # the second call runs the cached graph
        for p in model.parameters():
            p.grad = None
        got = grads_of(compiled, x)
        for a, b in zip(reference, got):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if name == "swap_wrapper":
        # swap regions run eagerly (graph break), so they really swap
        assert SwapManager().stats()["offloaded_bytes"] > 0


@pytest.mark.slow
def test_swap_regions_run_eagerly_and_whole_recompute_compiles():
    """Each swap_wrapper region breaks the graph (it runs eagerly); whole-layer recompute regions
    are traced into the graph (PyTorch's checkpoint higher-order op)."""
    x = torch.randn(4, 16)
    graphs = {}
    for name, wrap in (("recompute", lambda m: wrap_layers(m, chain=False)),
                       ("swap", lambda m: wrap_layers(m, swap=True, chain=False))):
        torch._dynamo.reset()
        model = make()
        wrap(model)
        graphs[name] = torch._dynamo.explain(model)(x).graph_count
    assert graphs["recompute"] >= 1  # traced, checkpoint regions included
    assert graphs["swap"] == 0       # every layer is a swap region: all of it ran eagerly


@pytest.mark.slow
def test_selective_policies_of_compiled_regions_go_to_torch_compiled_checkpoint():
    """Under compile, the policy is asked by PyTorch's own selective checkpoint (with torch's
    context), and MUST_SWAP is kept on the device like torch's CPU_OFFLOAD."""
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(type(ctx).__module__)
        return swap_heavy(ctx, op, *args, **kwargs)

    model = make()
    wrap_layers(model, policy_fn=policy, chain=False)
    torch.compile(model, backend="aot_eager")(torch.randn(4, 16)).sum().backward()
    assert seen and set(seen) == {"torch.utils.checkpoint"}
    assert SwapManager().stats()["offloaded_bytes"] == 0


@pytest.mark.parametrize("wrap", [
    lambda m: swap_wrapper(m),
    lambda m: checkpoint_wrapper(m, policy_fn=save_heavy),
    lambda m: checkpoint_wrapper(m, swap_inputs=True),
], ids=["swap_wrapper", "policy", "swap_inputs"])
def test_wrapping_a_compiled_module_for_swap_or_policy_is_refused(wrap):
    compiled = torch.compile(make()[0], backend="aot_eager")
    with pytest.raises(ValueError, match="Wrap the original layers first and compile afterwards"):
        wrap(compiled)


@pytest.mark.slow
def test_whole_recompute_of_compiled_blocks_works():
    x = torch.randn(4, 16)
    reference = grads_of(make(), x)
    model = make()
    for i, layer in enumerate(model):
        model[i] = checkpoint_wrapper(torch.compile(layer, backend="aot_eager"))
    for a, b in zip(reference, grads_of(model, x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_inductor_compiled_gpt_with_swap_policy_matches_eager():
    """The CPU inductor backend end to end (C++ codegen: tens of seconds)."""
    from hyper_parallel.bench.model import GPT, GPTConfig, make_batch

    cfg = GPTConfig(vocab=64, dim=32, heads=2, layers=2, seq=16, dropout=0.0)
    tokens, targets = make_batch(cfg, 2, 0)

    def loss_grads(model):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(0)
    eager_loss, eager_grads = loss_grads(GPT(cfg))
    torch.manual_seed(0)
    model = GPT(cfg)
    wrap_layers(model.layers, policy_fn=swap_heavy)
    loss, grads = loss_grads(torch.compile(model))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(eager_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
