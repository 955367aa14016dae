"""Swap that nothing schedules says so (once) and is counted; ``reset_stats`` clears the
statistics alone, ``reset`` the layer chain too."""

from __future__ import annotations

import warnings

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper, wrap_layers


def _block():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _steps(module, n=2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            module(torch.randn(32, 64)).sum().backward()
    return [w for w in caught if "nothing offloads that group" in str(w.message)]


def test_swap_without_a_chain_or_a_group_is_said_once_and_counted():
    block = swap_wrapper(_block())
    said = _steps(block, 3)
    assert len(said) == 1 and "'default'" in str(said[0].message) and "wrap_layers" in str(said[0].message)
    stats = SwapManager().stats()
    assert stats["offloaded_bytes"] == 0
    assert stats["unscheduled_bytes"] > 0 and stats["unscheduled_bytes"] % 3 == 0  # three steps, the same bytes


def test_chained_or_scheduled_swap_is_not_unscheduled():
    layers = wrap_layers(torch.nn.ModuleList(_block() for _ in range(3)), swap=True)
    assert _steps(torch.nn.Sequential(*layers)) == []
    assert SwapManager().stats()["unscheduled_bytes"] == 0
    assert SwapManager().stats()["offloaded_bytes"] > 0
    SwapManager().reset()
    block = swap_wrapper(_block())
    mgr = SwapManager()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.set_current_group_name("mb0")
        loss = block(torch.randn(32, 64)).sum()
        mgr.set_current_group_name(None)
        mgr.launch_offload("mb0"); mgr.wait_offload("mb0")
        mgr.launch_load("mb0"); mgr.wait_load("mb0")
        loss.backward()
        del loss
    assert not [w for w in caught if "nothing offloads" in str(w.message)]
    assert mgr.stats()["unscheduled_bytes"] == 0


def test_reset_stats_keeps_the_chain_reset_removes_it():
    layers = wrap_layers(torch.nn.ModuleList(_block() for _ in range(3)), swap=True)
    model = torch.nn.Sequential(*layers)
    _steps(model, 1)
    mgr = SwapManager()
    assert mgr.stats()["offloaded_bytes"] > 0
    mgr.reset_stats()
    stats = mgr.stats()
    assert stats["offloaded_bytes"] == 0 and stats["groups"]  # the chain's groups live on, counting from zero
    assert all(g["offloaded_bytes"] == g["offload_launches"] == 0 for g in stats["groups"].values())
    _steps(model, 1)
    moved = mgr.stats()["offloaded_bytes"]
    assert moved > 0  # still chained
    mgr.reset()
    said = _steps(model, 1)
    assert mgr.stats()["offloaded_bytes"] == 0 and len(said) == 1  # the chain went with reset()


@pytest.fixture(autouse=True)
def _fresh():
    SwapManager().reset()
    yield
    SwapManager().reset()
