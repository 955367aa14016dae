"""Shared fixtures: every test starts and ends with a clean swap manager and a known RNG."""

import os
import sys

import pytest
import torch

# make ``import helpers`` work whatever the rootdir / import mode
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean_swap_manager_and_rng():
    from hyper_parallel.core.activation_checkpoint import SwapManager

    SwapManager().reset()
    torch.manual_seed(0)
    yield
    SwapManager().reset()
    torch.manual_seed(0)
