"""What a new user hits: one-call layer wrapping, copies of chained models, bounded statistics,
clear errors, and buffers (BatchNorm) updated once per forward under recomputation."""

import copy
import doctest
import pickle

import pytest
import torch
from torch import nn

from support.helpers import OpCounter
from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
from hyper_parallel.core.activation_checkpoint import (CheckpointPolicy, SwapManager, checkpoint,
                                                       checkpoint_exclude_wrapper, checkpoint_wrapper, swap_wrapper,
                                                       wrap_layers)
from hyper_parallel.core.storage import Storage
import hyper_parallel.core.wrapping as wrapping

aten = torch.ops.aten


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab=64, dim=32, heads=2, layers=3, seq=16, dropout=0.0))


def step(model, seed=3):
    tokens, targets = make_batch(model.cfg, 2, seed)
    torch.manual_seed(seed)
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- wrap_layers
@pytest.mark.parametrize("kwargs", [dict(), dict(swap=True),
                                    dict(policy_fn=lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SWAP
                                         if op in (aten.mm.default, aten.addmm.default)
                                         else CheckpointPolicy.PREFER_RECOMPUTE, swap_inputs=True)])
def test_wrap_layers_wraps_and_chains_bit_exact(kwargs):
    plain, wrapped = tiny_gpt(), tiny_gpt()
    assert wrap_layers(wrapped.layers, **kwargs) is wrapped.layers
    names = [SwapManager().layer_group_name(layer) for layer in wrapped.layers]
    assert None not in names and len(set(names)) == 3
    loss0, g0 = step(plain)
    loss1, g1 = step(wrapped)
    assert torch.equal(loss0, loss1) and all(torch.equal(g0[k], g1[k]) for k in g0)
    if kwargs:
        assert SwapManager().stats()["offloaded_bytes"] > 0
    assert list(plain.state_dict()) == list(wrapped.state_dict())


def test_wrap_layers_rejects_bad_input():
    with pytest.raises(TypeError, match="expects a layer stack"):
        wrap_layers(42)
    with pytest.raises(ValueError, match="empty"):
        wrap_layers([])
    with pytest.raises(ValueError, match="swap_inputs applies to checkpoint_wrapper"):
        wrap_layers([nn.Linear(2, 2)], swap=True, swap_inputs=True)
    with pytest.raises(TypeError, match="nn.Module"):
        wrap_layers([nn.Linear(2, 2), "layer"])


class TitanLike(nn.Module):
    """torchtitan keeps its layer stack in an nn.ModuleDict keyed by layer index."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(8, 8), nn.GELU()) for i in range(3)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def titan_step(model):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = model(x).square().sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kwargs", [dict(), dict(swap=True), dict(policy_fn=lambda ctx, op, *a, **k: CheckpointPolicy.
                                                                  MUST_SWAP, swap_inputs=True)],
                         ids=["whole", "swap", "selective"])
def test_wrap_layers_takes_a_module_dict_values_in_order(kwargs):
    plain, wrapped = TitanLike(), TitanLike()
    assert wrap_layers(wrapped.layers, **kwargs) is wrapped.layers
    assert all(type(layer).__name__.endswith("Sequential") and type(layer) is not nn.Sequential
               for layer in wrapped.layers.values())
    mgr = SwapManager()
    names = [mgr.layer_group_name(layer) for layer in wrapped.layers.values()]
    assert None not in names and len(set(names)) == 3
    values = list(wrapped.layers.values())
    mgr.set_forward_prefetch_layer(values[0], values[1])  # chained in this order: registering it again is harmless
    with pytest.raises(ValueError, match="already has a different successor"):
        mgr.set_forward_prefetch_layer(values[0], values[2])
    loss0, g0 = titan_step(plain)
    loss1, g1 = titan_step(wrapped)
    assert torch.equal(loss0, loss1) and all(torch.equal(g0[k], g1[k]) for k in g0)
    if kwargs:
        assert mgr.stats()["offloaded_bytes"] > 0
    assert list(plain.state_dict()) == list(wrapped.state_dict())


@pytest.mark.parametrize("make, match", [
    (lambda layers: (layer for layer in layers), "generator .a one-shot iterator.: wrapping would use it up"),
    (lambda layers: iter(list(layers)), "list_iterator .a one-shot iterator."),
    (lambda layers: {str(i): layer for i, layer in enumerate(layers)}, r"plain dict; .*nn.ModuleDict\(d\), or "
                                                                        r"list\(d.values\(\)\)"),
    (lambda layers: set(layers), "set, which has no order"),
], ids=["generator", "iterator", "dict", "set"])
def test_wrap_layers_refuses_one_shot_and_unordered_stacks_and_wraps_nothing(make, match):
    model = TitanLike()
    with pytest.raises(TypeError, match=match):
        wrap_layers(make(model.layers.values()))
    assert all(type(layer) is nn.Sequential for layer in model.layers.values())
    assert SwapManager().layer_group_name(model.layers["0"]) is None


# ----------------------------------------------------------------------------- one wrapper per module
@pytest.mark.parametrize("first, second", [(checkpoint_wrapper, swap_wrapper), (swap_wrapper, checkpoint_wrapper)],
                         ids=["checkpoint_then_swap", "swap_then_checkpoint"])
def test_mixed_wrapping_is_a_value_error_saying_which_to_keep(first, second):
    layer = first(nn.Linear(2, 2))
    before = type(layer)
    with pytest.raises(ValueError) as info:
        second(layer)
    message = str(info.value)
    assert f"this Linear is already wrapped by {first.__name__}; a module takes one wrapper" in message
    assert "Keep checkpoint_wrapper (recompute; it swaps too with a policy answering CheckpointPolicy.MUST_SWAP " \
           "or with swap_inputs=True) or swap_wrapper (no recompute" in message
    assert type(layer) is before
    x = torch.randn(3, 2, requires_grad=True)
    layer(x).sum().backward()  # still works with its one wrapper


@pytest.mark.parametrize("wrapper", [checkpoint_wrapper, swap_wrapper, checkpoint_exclude_wrapper])
def test_the_same_wrapper_twice_is_a_value_error(wrapper):
    layer = wrapper(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=f"{wrapper.__name__}: this Linear is already wrapped by {wrapper.__name__}: "
                                         "wrap each module once"):
        wrapper(layer)


@pytest.mark.parametrize("first, second", [(checkpoint_exclude_wrapper, checkpoint_wrapper),
                                           (checkpoint_wrapper, checkpoint_exclude_wrapper),
                                           (swap_wrapper, checkpoint_exclude_wrapper)])
def test_exclusion_shares_no_module_with_another_wrapper(first, second):
    layer = first(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="keep checkpoint_exclude_wrapper on the sub-module and put "
                                         "checkpoint_wrapper on the layer that contains it"):
        second(layer)


def test_wrap_layers_over_a_partly_wrapped_stack_wraps_nothing():
    model = tiny_gpt()
    checkpoint_wrapper(model.layers[1])
    with pytest.raises(ValueError, match="already wrapped by checkpoint_wrapper; a module takes one wrapper"):
        wrap_layers(model.layers, swap=True)
    assert type(model.layers[0]).__name__ == "Block" and type(model.layers[2]).__name__ == "Block"
    assert SwapManager().layer_group_name(model.layers[0]) is None


# ----------------------------------------------------------------------------- policy kinds
def op_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SWAP


def tensor_policy(t):
    return CheckpointPolicy.MUST_SWAP if t.numel() >= 64 else CheckpointPolicy.MUST_SAVE


def test_a_policy_of_the_wrong_kind_is_a_type_error_at_wrap_time():
    with pytest.raises(TypeError, match=r"swap_wrapper: policy_fn is called as policy_fn\(tensor\) .* "
                                        r"op_policy\(ctx, op, \*args, \*\*kwargs\) cannot take that; it takes "
                                        r"\(ctx, op, ...\): that is a selective checkpoint policy"):
        swap_wrapper(nn.Linear(2, 2), op_policy)
    with pytest.raises(TypeError, match=r"checkpoint_wrapper: policy_fn is called as policy_fn\(ctx, op, \*args, "
                                        r"\*\*kwargs\) .* tensor_policy\(t\) cannot take that; it takes one "
                                        r"argument: that is the form of a swap_wrapper policy"):
        checkpoint_wrapper(nn.Linear(2, 2), tensor_policy)
    with pytest.raises(TypeError, match=r"write it as def policy_fn\(ctx, op, \*args, \*\*kwargs\)"):
        checkpoint_wrapper(nn.Linear(2, 2), lambda ctx, op: CheckpointPolicy.MUST_SAVE)
    with pytest.raises(TypeError, match=r"write it as def policy_fn\(tensor\)"):
        swap_wrapper(lambda x: x, lambda: CheckpointPolicy.MUST_SAVE)
    model = tiny_gpt()
    with pytest.raises(TypeError, match=r"wrap_layers\(swap=True\): policy_fn is called as policy_fn\(tensor\).*"
                                        r"to wrap_layers\(..., policy_fn=...\) without swap=True"):
        wrap_layers(model.layers, swap=True, policy_fn=op_policy)
    with pytest.raises(TypeError, match=r"wrap_layers\(swap=True\)"):
        wrap_layers(model.layers, swap=True, swap_policy_fn=op_policy)
    with pytest.raises(TypeError, match=r"wrap_layers: policy_fn is called as policy_fn\(ctx, op"):
        wrap_layers(model.layers, policy_fn=tensor_policy)
    assert all(type(layer).__name__ == "Block" for layer in model.layers)  # nothing was wrapped
    # Policies whose signature cannot be read (builtins), and lists of ops, are not refused.
    checkpoint_wrapper(nn.Linear(2, 2), [aten.addmm.default])


def test_wrap_layers_swap_policy_fn_and_the_old_spelling_agree():
    losses = []
    for kwargs in (dict(swap=True, swap_policy_fn=tensor_policy), dict(swap=True, policy_fn=tensor_policy)):
        SwapManager().reset()
        model = tiny_gpt()
        wrap_layers(model.layers, **kwargs)
        loss, _ = step(model)
        stats = SwapManager().stats()
        losses.append((loss, stats["offloaded_bytes"], stats["kept_bytes"].get("policy_save", 0)))
    assert losses[0][1] > 0 and losses[0][2] > 0
    assert torch.equal(losses[0][0], losses[1][0]) and losses[0][1:] == losses[1][1:]
    with pytest.raises(ValueError, match="swap_policy_fn is the tensor policy of swap=True"):
        wrap_layers(tiny_gpt().layers, swap_policy_fn=tensor_policy)
    with pytest.raises(ValueError, match="give the tensor policy once, as swap_policy_fn"):
        wrap_layers(tiny_gpt().layers, swap=True, swap_policy_fn=tensor_policy, policy_fn=tensor_policy)


def test_use_reentrant_true_is_a_value_error_in_checkpoint_wrapper_too():
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="always non-reentrant"):
        checkpoint_wrapper(layer, use_reentrant=True)
    with pytest.raises(ValueError, match="always non-reentrant"):
        checkpoint(lambda x: x.sin(), torch.ones(2, requires_grad=True), use_reentrant=True)
    assert type(layer) is nn.Linear
    checkpoint_wrapper(layer, use_reentrant=False)(torch.ones(3, 2, requires_grad=True)).sum().backward()


# ----------------------------------------------------------------------------- copies
def test_deepcopy_of_a_chained_model_gets_its_own_working_chain():
    model = tiny_gpt()
    wrap_layers(model.layers, swap=True)
    clone = copy.deepcopy(model)
    mgr = SwapManager()
    original_names = [mgr.layer_group_name(layer) for layer in model.layers]
    clone_names = [mgr.layer_group_name(layer) for layer in clone.layers]
    assert None not in clone_names and not set(original_names) & set(clone_names)
    loss0, g0 = step(model)
    offloaded = mgr.stats()["offloaded_bytes"]
    loss1, g1 = step(clone)
    assert torch.equal(loss0, loss1) and all(torch.equal(g0[k], g1[k]) for k in g0)
    # The copy's chain really moves its activations, as much as the original's did.
    assert offloaded > 0 and mgr.stats()["offloaded_bytes"] == 2 * offloaded


def test_pickling_a_chained_model_says_what_to_do():
    model = tiny_gpt()
    wrap_layers(model.layers)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(model)
    SwapManager().reset()  # removes the chain's hooks: pickling works again
    again = pickle.loads(pickle.dumps(model))
    assert list(again.state_dict()) == list(model.state_dict())


def test_shallow_copy_of_a_chained_layer_is_a_clear_error():
    model = tiny_gpt()
    wrap_layers(model.layers)
    layer = copy.copy(model.layers[0])
    with pytest.raises(RuntimeError, match="copy.deepcopy"):
        layer(torch.randn(2, 16, 32))


# ----------------------------------------------------------------------------- statistics
def test_statistics_stay_bounded_with_a_fresh_group_name_per_step():
    mgr = SwapManager()
    block = swap_wrapper(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)))
    sizes = []
    for i in range(300):
        mgr.set_current_group_name(f"step{i}")
        loss = block(torch.randn(4, 8)).sum()
        mgr.set_current_group_name(None)
        mgr.launch_offload(f"step{i}"); mgr.wait_offload(f"step{i}")
        mgr.launch_load(f"step{i}"); mgr.wait_load(f"step{i}")
        loss.backward()
        del loss
        stats = mgr.stats()
        sizes.append((len(stats["groups"]), len(mgr.group_names()), len(mgr._stats)))
    assert max(s[0] for s in sizes[100:]) == max(s[0] for s in sizes[:100]) <= 65
    assert max(s[1] for s in sizes) <= 2 and max(s[2] for s in sizes) <= 65
    stats = mgr.stats()
    assert stats["retired_groups"]["count"] == 300 - 64
    per_step = stats["groups"]["step299"]["offloaded_bytes"]
    assert per_step > 0 and stats["offloaded_bytes"] == 300 * per_step  # totals keep everything


# ----------------------------------------------------------------------------- errors
def test_an_exception_inside_policy_fn_propagates_with_its_message_and_the_op():
    def policy(ctx, op, *args, **kwargs):
        raise TypeError("my policy cannot handle this")

    w = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(TypeError, match="my policy cannot handle this") as info:
        checkpoint(lambda x: (x @ w).relu(), torch.randn(2, 4), policy_fn=policy)
    assert "unsupported operand" not in str(info.value)
    assert any("raised by policy_fn for op aten.mm.default" in note for note in info.value.__notes__)


def test_wait_offload_after_launch_load_names_the_cancel():
    mgr = SwapManager()
    block = swap_wrapper(nn.Linear(8, 8))
    mgr.set_current_group_name("g")
    loss = block(torch.randn(4, 8)).pow(2).sum()
    mgr.set_current_group_name(None)
    mgr.launch_offload("g")
    mgr.launch_load("g")
    with pytest.raises(RuntimeError, match=r"cancelled by launch_load\('g'\)"):
        mgr.wait_offload("g")
    mgr.wait_load("g")
    loss.backward()


@pytest.mark.parametrize("value", ["1GB", 1.5, True])
def test_host_memory_limit_must_be_bytes(value):
    with pytest.raises(TypeError, match="number of bytes"):
        SwapManager().set_host_memory_limit(value)


def test_add_storage_rejects_what_is_not_a_storage():
    with pytest.raises(TypeError, match="expects a swap Storage"):
        SwapManager().add_storage("g", object())
    with pytest.raises(TypeError, match="non-empty str"):
        SwapManager().add_storage("", SwapManager().new_storage("h"))
    assert isinstance(SwapManager().new_storage("h"), Storage)


# ----------------------------------------------------------------------------- buffers
def bn_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())


def _wrap_forward(m):
    m.forward = checkpoint_wrapper(m.forward)
    return m


@pytest.mark.parametrize("wrap", [
    checkpoint_wrapper,
    lambda m: checkpoint_wrapper(m, policy_fn=lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE),
    lambda m: checkpoint_wrapper(m, policy_fn=lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE
                                 if op is aten.convolution.default else CheckpointPolicy.PREFER_RECOMPUTE),
    _wrap_forward,
], ids=["recompute", "selective", "save_convs", "function"])
def test_batchnorm_updates_its_running_statistics_once_per_forward(wrap):
    torch.manual_seed(0)
    plain = bn_net()
    wrapped = wrap(copy.deepcopy(plain))
    x = torch.randn(4, 3, 8, 8, requires_grad=True)
    for model in (plain, wrapped):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    a, b = plain.state_dict(), wrapped.state_dict()
    assert b["1.num_batches_tracked"].item() == 3
    for key in a:
        assert torch.equal(a[key], b[key]), key
    plain.eval(), wrapped.eval()
    with torch.no_grad():
        assert torch.equal(plain(x), wrapped(x))


def test_recompute_still_reruns_the_batchnorm_op():
    """Buffers are protected by running the op on a copy, not by skipping it."""
    model = checkpoint_wrapper(bn_net())
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with OpCounter() as counter:
        model(x).sum().backward()
    assert counter.counts[aten.native_batch_norm.default] == 4  # 2 in forward, 2 in recompute


def test_docstring_examples_of_the_wrappers():
    result = doctest.testmod(wrapping, verbose=False)
    assert result.attempted > 0 and result.failed == 0
