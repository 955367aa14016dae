"""A recomputed region whose forward changes state outside its tensors through an argument (a cache
that grows, a list appended to, a counter) is a clear error in forward that names the argument,
not a size mismatch in backward or silently doubled state."""

import doctest
import functools

import pytest
import torch
from torch import nn

import hyper_parallel.core.argument_state as argument_state
from hyper_parallel.core.backend import active_backend
from hyper_parallel.core.activation_checkpoint import (CheckpointPolicy, checkpoint, checkpoint_exclude_wrapper,
                                                       checkpoint_wrapper, swap_wrapper)

aten = torch.ops.aten


def save_mm(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


class KVCache:
    """A cache in the style of a Hugging Face DynamicCache: layers whose keys grow by torch.cat."""

    class Layer:
        def __init__(self):
            self.keys = None

    def __init__(self, layers=1):
        self.layers = [KVCache.Layer() for _ in range(layers)]

    def update(self, k, i=0):
        layer = self.layers[i]
        layer.keys = k if layer.keys is None else torch.cat([layer.keys, k], dim=0)
        return layer.keys


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x, cache=None):
        k = self.w(x)
        if cache is not None:
            k = cache.update(k)
        return (x @ k.t()).softmax(-1) @ k


def x_in():
    return torch.randn(3, 4, requires_grad=True)


@pytest.mark.parametrize("policy_fn", [None, save_mm], ids=["whole", "selective"])
def test_a_growing_cache_is_an_error_in_forward_naming_the_argument(policy_fn):
    layer = checkpoint_wrapper(Attn(), policy_fn=policy_fn)
    cache = KVCache()
    with pytest.raises(RuntimeError) as info:
        layer(x_in(), cache=cache)
    message = str(info.value)
    assert message.startswith("checkpoint: the region's forward changed its argument `cache` (a KVCache): "
                              "`cache.layers[0].keys` was None, is now a Tensor.")
    assert "use_cache=False" in message and "wrap_model" in message and "swap_wrapper" in message
    # Once the cache holds keys, the next forward replaces them: named as such.
    with pytest.raises(RuntimeError, match=r"`cache.layers\[0\].keys` was replaced by another Tensor"):
        layer(x_in(), cache=cache)


def test_a_list_appended_to_and_a_counter_are_errors():
    def region(x, log):
        log.append(1)
        return x.sin()

    with pytest.raises(RuntimeError, match=r"argument `log` \(a list\): it was a list of 0 items, is now a list of "
                                           r"1 item\."):
        checkpoint(region, x_in(), [])

    class Counter:
        def __init__(self):
            self.calls = 0

    def counted(x, *, counter):
        counter.calls += 1
        return x.cos()

    with pytest.raises(RuntimeError, match=r"argument `counter` \(a Counter\): `counter.calls` was 0, is now 1\."):
        checkpoint(counted, x_in(), counter=Counter())

    def keyed(x, state):
        state["seen"] = True
        return x.exp()

    with pytest.raises(RuntimeError, match=r"argument `state` \(a dict\): it was a dict of 1 item, is now a dict "
                                           r"of 2 items\."):
        checkpoint(keyed, x_in(), {"other": 1})


def test_state_held_by_a_partial_is_watched_too():
    def region(x, log):
        log.append(x)
        return x.sin()

    with pytest.raises(RuntimeError, match=r"argument `log` \(a list\)"):
        checkpoint(functools.partial(region, log=[]), x_in())


def test_arguments_without_python_state_cost_nothing_and_are_not_errors():
    # Tensors (their data is autograd's to watch), tuples of tensors, modules, scalars, None and
    # callables are not snapshotted at all.
    lin = nn.Linear(4, 4)

    def region(x, pair, module, flag, fn, mask=None):
        return module(x * pair[0] + pair[1]).relu() * flag + fn(x)

    args = (x_in(), (torch.ones(3, 4), torch.zeros(3, 4)), lin, 2, torch.sin)
    kwargs = dict(mask=None)
    assert argument_state.watch_arguments(active_backend(), region, args, kwargs) is argument_state._NO_WATCH
    out = checkpoint(region, *args, **kwargs)
    out.sum().backward()
    # Unchanged state passed along is fine as well (read-only use of a cache object).
    cache = KVCache()
    cache.layers[0].keys = torch.randn(2, 4)

    def reads(x, cache):
        return x + cache.layers[0].keys.sum()

    checkpoint(reads, x_in(), cache).sum().backward()


def test_no_check_where_nothing_is_recomputed():
    cache = KVCache()
    layer = checkpoint_wrapper(Attn())
    with torch.no_grad():  # generation: no backward, the cache works as usual
        layer(x_in(), cache=cache)
        layer(x_in(), cache=cache)
    assert cache.layers[0].keys.shape == (6, 4)
    swapped = swap_wrapper(Attn())  # no recompute: the forward runs once
    x = x_in()
    swapped(x, cache=cache).sum().backward()
    assert cache.layers[0].keys.shape == (9, 4) and x.grad is not None


def test_a_change_inside_an_excluded_submodule_is_not_an_error():
    # The excluded attention runs once, in forward: the cache it updates is not updated again.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = checkpoint_exclude_wrapper(Attn())
            self.mlp = nn.Linear(4, 4)

        def forward(self, x, cache):
            return self.mlp(self.attn(x, cache=cache)).relu()

    torch.manual_seed(0)
    plain = Block()
    torch.manual_seed(0)
    block = checkpoint_wrapper(Block())
    c0, c1 = KVCache(), KVCache()
    x0, x1 = x_in(), None
    x1 = x0.detach().clone().requires_grad_()
    plain(x0, c0).sum().backward()
    block(x1, c1).sum().backward()
    assert c1.layers[0].keys.shape == c0.layers[0].keys.shape == (3, 4)
    assert torch.equal(x0.grad, x1.grad)


def test_cycles_and_large_objects_are_bounded():
    class Node:
        def __init__(self):
            self.me = self
            self.items = list(range(2 * argument_state.MAX_ENTRIES))

    node = Node()

    def region(x, node):
        return x.sin()

    checkpoint(region, x_in(), node).sum().backward()


def test_docstring_examples():
    result = doctest.testmod(argument_state, verbose=False)
    assert result.attempted > 0 and result.failed == 0
