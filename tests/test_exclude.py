"""``checkpoint_exclude_wrapper``: a sub-module of a recomputed region runs once, in forward; its
outputs are reused (SAVE, or SWAP) when the region is recomputed, its own backward gets what it
saved, and everything is bit-exact. Re-runs are counted from the ops that run (``OpCounter``):
``aten._softmax.default`` only runs in the attention's forward, ``aten.gelu.default`` in the MLP's.
"""

from __future__ import annotations

import contextlib
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from hyper_parallel.core.activation_checkpoint import (RecomputeSession, SwapManager,
                                                       checkpoint, checkpoint_exclude_wrapper, checkpoint_wrapper)

from support.helpers import OpCounter, RecordingPolicy, aten, assert_state_equal, gpt_in_mode, train_snapshot

SOFTMAX = aten._softmax.default
GELU = aten.gelu.default
D = 16


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.softmax(self.q(x), -1)) * x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.drop = nn.Dropout(0.2)  # draws after the excluded call: the RNG must be moved past it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(x)
        return h + self.drop(self.fc2(F.gelu(self.fc1(h))))


def make(policy=None, exclude=True, swap=False, wrap=True) -> Block:
    torch.manual_seed(0)
    block = Block()
    if exclude:
        checkpoint_exclude_wrapper(block.attn, swap=swap)
    if wrap:
        checkpoint_wrapper(block, policy_fn=policy)
    return block


def run(block: nn.Module, offload: bool = False):
    """Forward + backward of one batch; ``offload``: the swap group goes to the host in between."""
    mgr = SwapManager()
    torch.manual_seed(5)
    x = torch.randn(4, 8, D, requires_grad=True)
    with OpCounter() as fwd:
        if offload:
            mgr.set_current_group_name("g")
        y = block(x)
        if offload:
            mgr.set_current_group_name(None)
            mgr.launch_offload("g")
            mgr.wait_offload("g")
    with OpCounter() as bwd:
        if offload:
            mgr.launch_load("g")
            mgr.wait_load("g")
        y.sum().backward()
    return fwd.counts, bwd.counts, [p.grad for p in block.parameters()] + [x.grad]


@pytest.fixture(scope="module")
def plain():
    return run(make(exclude=False, wrap=False))


@pytest.mark.parametrize("policy", [None, [aten.addmm.default]], ids=["whole", "selective"])
@pytest.mark.parametrize("swap", [False, True], ids=["save", "swap"])
def test_excluded_submodule_never_reruns_and_is_bit_exact(policy, swap, plain):
    fwd, bwd, grads = run(make(policy, swap=swap), offload=swap)
    for a, b in zip(grads, plain[2]):
        assert torch.equal(a, b)
    assert fwd[SOFTMAX] == 1 and bwd[SOFTMAX] == 0      # the attention: forward only
    assert fwd[GELU] == 1 and bwd[GELU] == 1            # the MLP: recomputed
    if swap:
        stats = SwapManager().stats()
        assert stats["offloaded_bytes"] > 0 and stats["loaded_bytes"] == stats["offloaded_bytes"]


def test_without_the_exclusion_the_submodule_is_recomputed(plain):
    fwd, bwd, grads = run(make(exclude=False))
    for a, b in zip(grads, plain[2]):
        assert torch.equal(a, b)
    assert bwd[SOFTMAX] == 1  # what the exclusion saves


def test_policy_is_not_asked_about_excluded_ops():
    policy = RecordingPolicy()
    run(make(policy))
    asked = set(policy.ops(False)) | set(policy.ops(True))
    assert SOFTMAX not in asked and GELU in asked


def test_outside_a_region_it_is_the_module(plain):
    fwd, bwd, grads = run(make(exclude=True, wrap=False))
    for a, b in zip(grads, plain[2]):
        assert torch.equal(a, b)
    assert fwd == plain[0] and bwd == plain[1]


def test_nested_exclusion_is_part_of_the_outer_one(plain):
    block = make()
    checkpoint_exclude_wrapper(block.attn.q)  # inside the excluded attention: nothing more to do
    fwd, bwd, grads = run(block)
    for a, b in zip(grads, plain[2]):
        assert torch.equal(a, b)
    assert bwd[SOFTMAX] == 0


def test_exclusion_inside_a_region_nested_in_an_excluded_module():
    """attn is excluded from the block's region; attn's q is a region of its own with its
    softmax-free Linear excluded: each region skips what is excluded from it."""
    block = make()
    inner = nn.Sequential(nn.Linear(D, D), nn.Tanh())
    torch.manual_seed(1)
    ref_inner = copy.deepcopy(inner)
    checkpoint_exclude_wrapper(inner[0])
    checkpoint_wrapper(inner)
    block.attn.q = inner
    ref = make(exclude=False, wrap=False)
    ref.attn.q = ref_inner
    _, bwd, grads = run(block)
    _, _, ref_grads = run(ref)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)
    assert bwd[SOFTMAX] == 0 and bwd[aten.tanh.default] == 1  # inner region recomputes its tanh only


def test_split_backward_with_exclusion_recomputes_once():
    block, ref = make([aten.addmm.default]), make(exclude=False, wrap=False)
    results = []
    for model, session in ((block, RecomputeSession()), (ref, None)):
        torch.manual_seed(5)
        x = torch.randn(4, 8, D, requires_grad=True)
        with OpCounter() as counter:
            y = model(x)
            with session if session is not None else contextlib.nullcontext():
                _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], model.parameters())
            with session.last_half() if session is not None else contextlib.nullcontext():
                stage_backward_weight(model.parameters(), groups)
        results.append((counter.counts, [p.grad for p in model.parameters()] + [x.grad]))
    (counts, grads), (ref_counts, ref_grads) = results
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)
    assert counts[SOFTMAX] == 1 and counts[GELU] == 2 and ref_counts[GELU] == 1


def test_gpt_with_attention_excluded_trains_like_plain():
    """The tiny GPT (dropout 0.1 everywhere): every layer recomputed except its attention."""
    plain = train_snapshot(gpt_in_mode("none"))
    model = gpt_in_mode("none")
    for layer in model.layers:
        checkpoint_exclude_wrapper(layer.attn)
        checkpoint_wrapper(layer)
    losses, params, grads = train_snapshot(model)
    assert losses == plain[0]
    assert_state_equal(params, plain[1])
    assert_state_equal(grads, plain[2])


def test_modifying_an_input_in_place_is_a_clear_error():
    relu = checkpoint_exclude_wrapper(nn.ReLU(inplace=True))
    lin = nn.Linear(D, D)
    with pytest.raises(RuntimeError, match="modified one of its inputs in place"):
        checkpoint(lambda x: relu(lin(x)).sum(), torch.randn(2, D, requires_grad=True))


def test_output_modified_in_place_later_is_a_clear_error():
    lin = checkpoint_exclude_wrapper(nn.Linear(D, D))

    def region(x):
        h = lin(x)
        h.mul_(2)
        return (h * x).sum()

    loss = checkpoint(region, torch.randn(2, D, requires_grad=True))
    with pytest.raises(RuntimeError, match="in-place"):
        loss.backward()


def test_second_backward_without_a_session_is_a_clear_error():
    block = make()
    y = block(torch.randn(2, D, requires_grad=True)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="released by the first backward"):
        y.backward()


def test_wrapping_keeps_names_pickles_and_rejects_bad_arguments():
    block = make(exclude=False, wrap=False)
    keys = sorted(block.state_dict())
    checkpoint_exclude_wrapper(block.attn)
    assert sorted(block.state_dict()) == keys
    clone = pickle.loads(pickle.dumps(block))
    assert type(clone.attn).__name__ == "ExcludedAttn" and clone.attn._hp_exclude_swap is False
    with pytest.raises(ValueError, match="already wrapped"):
        checkpoint_exclude_wrapper(block.attn)
    with pytest.raises(TypeError, match="swap must be a bool"):
        checkpoint_exclude_wrapper(nn.Linear(2, 2), swap="yes")
    with pytest.raises(TypeError, match="expects"):
        checkpoint_exclude_wrapper(3)


def test_function_form(plain):
    lin = nn.Linear(D, D)
    torch.manual_seed(0)
    fn = checkpoint_exclude_wrapper(lambda x: torch.softmax(lin(x), -1))
    x = torch.randn(3, D, requires_grad=True)
    with OpCounter() as counter:
        checkpoint(lambda t: fn(t).sum() * 2, x).backward()
    assert counter.counts[SOFTMAX] == 1
