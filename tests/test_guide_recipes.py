"""Every Python snippet of docs/guide.md runs as written: after the setup snippet, in order, each
on a fresh model (names a snippet defines carry over, as the guide says). What a snippet builds
then trains one step, bitwise against the unwrapped model; every selective policy it defines
trains a wrapped model bitwise too (a recipe that returns nothing fails here)."""

import importlib.util
import inspect
import os
import re

import pytest
import torch

from hyper_parallel.bench.model import GPT
from hyper_parallel.core.activation_checkpoint import SwapManager, wrap_layers

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "guide.md")
BLOCKS = re.findall(r"```python\n(.*?)```", open(GUIDE).read(), flags=re.S)
SETUP, RECIPES = BLOCKS[0], BLOCKS[1:]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def fresh(namespace):
    """``namespace`` with the setup's model and batch made again (definitions kept)."""
    SwapManager().reset()
    torch.manual_seed(0)
    setup = {}
    exec(compile(SETUP, "guide.md: setup", "exec"), setup)
    namespace.update({k: setup[k] for k in ("model", "x", "targets", "loss")})
    return namespace


def step(model, x, targets):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the GPT's dropout
    loss = model(x, targets)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_trains_like_the_unwrapped(model, x, targets):
    reference = fresh({})
    loss0, grads0 = step(reference["model"], x, targets)
    loss1, grads1 = step(model, x, targets)
    assert torch.equal(loss0, loss1)
    assert len(grads0) == len(grads1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))


def selective_policies(before, namespace):
    """The ``(ctx, op, *args, **kwargs)`` functions a snippet defined."""
    found = []
    for name, value in namespace.items():
        if name in before or not inspect.isfunction(value):
            continue
        params = list(inspect.signature(value).parameters)
        if params[:2] == ["ctx", "op"]:
            found.append(value)
    return found


def test_the_setup_snippet_runs_and_the_guide_has_recipes():
    namespace = fresh({})
    assert isinstance(namespace["model"], GPT) and namespace["loss"].ndim == 0
    assert len(RECIPES) >= 8


def needs(block):
    if "transformers" in block and not HAS_TRANSFORMERS:
        return [pytest.mark.skip(reason="this snippet uses transformers, an optional extra: pip install -e '.[hf]'")]
    return []


@pytest.mark.parametrize("upto", [pytest.param(i, marks=needs(block), id=f"snippet{i + 1}")
                                  for i, block in enumerate(RECIPES)])
def test_every_guide_snippet_runs_as_written(upto):
    namespace = {}
    exec(compile(SETUP, "guide.md: setup", "exec"), namespace)
    for i, block in enumerate(RECIPES[:upto + 1]):
        if i < upto and "transformers" in block:
            continue  # an earlier Hugging Face snippet defines nothing later ones use
        fresh(namespace)
        before = set(namespace)
        exec(compile(block, f"guide.md: snippet {i + 1}", "exec"), namespace)
    model = namespace["model"]
    if isinstance(model, GPT):
        assert_trains_like_the_unwrapped(model, namespace["x"], namespace["targets"])
    else:  # the Hugging Face snippet: it trained its own model
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    for policy in selective_policies(before, namespace):
        wrapped = fresh(namespace)["model"]
        wrap_layers(wrapped.layers, policy_fn=policy, swap_inputs=True)
        assert_trains_like_the_unwrapped(wrapped, namespace["x"], namespace["targets"])
