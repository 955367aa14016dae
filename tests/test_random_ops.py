"""Ops tagged ``nondeterministic_seeded`` follow the policy: attention can be saved and swapped, and
a kept op that drew random numbers leaves the generator where forward left it."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.backends.torch.backend import TorchBackend
from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, SwapManager, checkpoint

aten = torch.ops.aten
ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def attention_block(x, w, p_attn):
    q = (x @ w).view(2, 4, 8, 16)
    a = F.scaled_dot_product_attention(q, q, q, dropout_p=p_attn)
    return F.dropout(a, 0.3, training=True).relu().flatten(0, 1)


def reference(fn, x, w, *args, seed=1):
    torch.manual_seed(seed)
    y = fn(x, w, *args)
    y.sum().backward()
    g, w.grad = w.grad.clone(), None
    return y.detach(), g


@pytest.mark.parametrize("answer", [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SWAP])
def test_attention_without_dropout_is_kept_not_rerun(answer):
    x, w = torch.randn(64, 16), torch.randn(16, 16, requires_grad=True)
    y0, g0 = reference(attention_block, x, w, 0.0)

    def policy(ctx, op, *args, **kwargs):
        return answer if op is ATTENTION else CheckpointPolicy.PREFER_RECOMPUTE

    mgr = SwapManager()
    mgr.set_current_group_name("attn")
    torch.manual_seed(1)
    with OpCounter() as counter:
        y1 = checkpoint(attention_block, x, w, 0.0, policy_fn=policy)
        mgr.set_current_group_name(None)
        if answer is CheckpointPolicy.MUST_SWAP:
            mgr.launch_offload("attn"); mgr.wait_offload("attn")
            mgr.launch_load("attn"); mgr.wait_load("attn")
        y1.sum().backward()
    assert torch.equal(y0, y1) and torch.equal(g0, w.grad)
    assert counter.counts[ATTENTION] == 1  # forward only: recompute handed back the kept output
    if answer is CheckpointPolicy.MUST_SWAP:
        assert mgr.stats()["offloaded_bytes"] > 0


def test_attention_with_dropout_stays_bit_exact():
    x, w = torch.randn(64, 16), torch.randn(16, 16, requires_grad=True)
    y0, g0 = reference(attention_block, x, w, 0.2)
    torch.manual_seed(1)
    y1 = checkpoint(attention_block, x, w, 0.2, policy_fn=lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE)
    y1.sum().backward()
    assert torch.equal(y0, y1) and torch.equal(g0, w.grad)


def two_dropouts(x, w):
    d1 = torch.native_dropout(x @ w, 0.5, True)[0]
    return torch.native_dropout(d1 @ w, 0.5, True)[0]


def keep_first_dropout(answer):
    calls = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op is aten.native_dropout.default:
            calls[ctx.is_recompute] += 1
            return answer if calls[ctx.is_recompute] == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@pytest.mark.parametrize("answer", [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SWAP])
def test_kept_random_op_leaves_the_generator_where_forward_left_it(answer):
    x, w = torch.randn(3, 16), torch.randn(16, 16, requires_grad=True)
    y0, g0 = reference(two_dropouts, x, w, seed=5)
    torch.manual_seed(5)
    with OpCounter() as counter:
        y1 = checkpoint(two_dropouts, x, w, policy_fn=keep_first_dropout(answer))
        y1.sum().backward()
    assert torch.equal(y0, y1) and torch.equal(g0, w.grad)
    assert counter.counts[aten.native_dropout.default] == 3  # 2 in forward, only the second again


def test_without_restoring_the_generator_later_random_ops_differ(monkeypatch):
    """The mutation proof of the test above: drop the restore and the second dropout's mask changes."""
    x, w = torch.randn(3, 16), torch.randn(16, 16, requires_grad=True)
    _, g0 = reference(two_dropouts, x, w, seed=5)
    monkeypatch.setattr(TorchBackend, "set_rng_state", lambda self, state: None)
    torch.manual_seed(5)
    checkpoint(two_dropouts, x, w, policy_fn=keep_first_dropout(CheckpointPolicy.MUST_SAVE)).sum().backward()
    assert not torch.equal(g0, w.grad)
