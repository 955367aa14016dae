"""Ops that communicate are never re-run by recomputation unless the policy answers MUST_RECOMPUTE.

One process with PyTorch's fake process group (collectives return their input, instantly), so the
rule is checked in the quick suite; ``tests/test_distributed.py`` checks it on 2 gloo ranks with
tensor-parallel layers. Collectives are counted from the ops that run (``OpCounter``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts as torch_sac_contexts

from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint, keep_collectives
from hyper_parallel.core.backend import OpKind, active_backend

from support.helpers import OpCounter, aten

c10d = torch.ops._c10d_functional
ALL_REDUCE = c10d.all_reduce.default
WAIT = c10d.wait_tensor.default


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's row-parallel reduction: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, 16, generator=gen).requires_grad_(), torch.randn(16, 8, generator=gen).requires_grad_()]


def tp_region(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = _ReduceFromTP.apply(x @ w1, dist.group.WORLD.group_name)
    return F.gelu(h) @ w2


def run(policy: Any = "plain", torch_sac: Any = None):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    w1, w2 = _params()
    with OpCounter() as fwd:
        if torch_sac is not None:
            y = torch_checkpoint(tp_region, x, w1, w2, use_reentrant=False,
                                 context_fn=lambda: torch_sac_contexts(torch_sac))
        elif policy == "plain":
            y = tp_region(x, w1, w2)
        else:
            y = checkpoint(tp_region, x, w1, w2, policy_fn=policy)
    with OpCounter() as bwd:
        y.sum().backward()
    return fwd.counts, bwd.counts, [x.grad, w1.grad, w2.grad]


def prefer_recompute(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def must_recompute(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def must_recompute_all_reduce(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE if op == ALL_REDUCE else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.fixture(scope="module")
def plain():
    fwd, bwd, grads = run()
    assert fwd[ALL_REDUCE] == fwd[WAIT] == 1 and bwd[ALL_REDUCE] == bwd[WAIT] == 0
    return fwd, bwd, grads


def _same_grads(a, b) -> None:
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@pytest.mark.parametrize("policy", [prefer_recompute, [aten.mm.default], keep_collectives(),
                                    keep_collectives(prefer_recompute), keep_collectives([aten.mm.default])],
                         ids=["prefer_recompute", "list", "keep_collectives()", "keep_collectives(fn)",
                              "keep_collectives(list)"])
def test_prefer_answers_keep_collectives(policy, plain):
    fwd, bwd, grads = run(policy)
    _same_grads(grads, plain[2])
    assert fwd[ALL_REDUCE] == 1 and fwd[WAIT] == 1
    assert bwd[ALL_REDUCE] == 0 and bwd[WAIT] == 0       # collective counts equal forward's
    assert bwd[aten.gelu.default] == 1                    # the rest is recomputed


@pytest.mark.parametrize("policy", [must_recompute, keep_collectives(must_recompute), must_recompute_all_reduce],
                         ids=["must_recompute", "keep_collectives(must)", "must_all_reduce_only"])
def test_must_recompute_reruns_the_collective_and_its_wait(policy, plain):
    _, bwd, grads = run(policy)
    _same_grads(grads, plain[2])
    # a re-run all-reduce is always waited: its wait re-runs with it
    assert bwd[ALL_REDUCE] == 1 and bwd[WAIT] == 1


def test_only_the_wait_follows_a_rerun_collective():
    """all_reduce MUST_RECOMPUTE, then an all_gather of its (waited) result: the wait re-runs
    with the all_reduce, the all_gather is still kept."""
    group = dist.group.WORLD.group_name
    gather = c10d.all_gather_into_tensor.default

    def region(x, w):
        h = c10d.wait_tensor(c10d.all_reduce(x @ w, "sum", group))
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(h, 2, group))
        return F.gelu(g)

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    with OpCounter() as plain:
        region(x, w).sum().backward()
    with OpCounter() as counter:
        checkpoint(region, x, w, policy_fn=must_recompute_all_reduce).sum().backward()
    extra = {op: counter.counts[op] - plain.counts[op] for op in (ALL_REDUCE, WAIT, gather)}
    assert extra == {ALL_REDUCE: 1, WAIT: 1, gather: 0}


def test_whole_region_recompute_reruns_collectives_unless_given_the_helper(plain):
    _, bwd, grads = run(None)
    _same_grads(grads, plain[2])
    assert bwd[ALL_REDUCE] == 1  # documented: pass policy_fn=keep_collectives() to keep them
    _, bwd, _ = run(keep_collectives())
    assert bwd[ALL_REDUCE] == 0


def test_helper_works_with_pytorchs_own_selective_checkpoint(plain):
    _, bwd, grads = run(torch_sac=keep_collectives())
    _same_grads(grads, plain[2])
    assert bwd[ALL_REDUCE] == 0 and bwd[WAIT] == 0 and bwd[aten.gelu.default] == 1
    _, bwd, _ = run(torch_sac=lambda ctx, op, *a, **k: False)  # PyTorch alone re-runs them
    assert bwd[ALL_REDUCE] == 1


def test_classification():
    kind = active_backend().op_kind
    for op in (ALL_REDUCE, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
               c10d.all_to_all_single.default, torch.ops._c10d_functional_autograd.all_gather_into_tensor.default):
        assert kind(op) is OpKind.COLLECTIVE, op
    assert kind(WAIT) is OpKind.WAIT
    assert kind(c10d.all_reduce_.default) is OpKind.MUTATING  # in place: re-run like every write
    assert kind(c10d._wrap_tensor_autograd.default) is OpKind.PLAIN
    assert kind(aten.mm.default) is OpKind.PLAIN
