"""Shared fixtures: every test starts and ends with a clean swap manager and a known RNG."""

import pytest
import torch

# One intra-op thread for the whole session: these small models only pay thread hand-offs, which
# cost 10-20x on a busy 2-core machine. Session-wide (not per test) so that module-scoped
# reference results and the tests comparing against them reduce in the same order, bit for bit.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_manager():
    """A clean SwapManager (groups, chain, stats, host pool and limit) before and after each test,
    and a known RNG."""
    from hyper_parallel.core.activation_checkpoint import SwapManager

    mgr = SwapManager()
    mgr.reset()
    torch.manual_seed(0)
    yield mgr
    mgr.reset()
    torch.manual_seed(0)
