"""Shared fixtures: every test starts and ends with a clean swap manager and a known RNG.

Simulated device: a test (or module, ``pytestmark``) marked ``sim_device`` runs twice, on the CPU
backend (``[cpu]``) and under :class:`hyper_parallel.testing.SimDevice` with its happens-before
checker on (``[sim]``); one marked ``sim_only`` runs only under it. ``--sim-device`` runs every
test under it. The ``sim`` fixture is the simulated device of a ``[sim]`` run.
"""

import pytest
import torch

# One intra-op thread for the whole session: these small models only pay thread hand-offs, which
# cost 10-20x on a busy 2-core machine. Session-wide (not per test) so that module-scoped
# reference results and the tests comparing against them reduce in the same order, bit for bit.
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--sim-device", action="store_true",
                     help="run every test under the simulated asynchronous device (hyper_parallel.testing)")


def pytest_configure(config):
    config.addinivalue_line("markers", "sim_device: also run the test under the simulated asynchronous device "
                                       "with the stream-ordering checker on (test id suffix [sim])")
    config.addinivalue_line("markers", "sim_only: run the test only under the simulated asynchronous device")
    config.addinivalue_line("markers", "no_sim(reason): never run the test under the simulated device")


def pytest_generate_tests(metafunc):
    if "swap_backend" not in metafunc.fixturenames or metafunc.config.getoption("--sim-device"):
        return
    if metafunc.definition.get_closest_marker("no_sim") is not None:
        return
    if metafunc.definition.get_closest_marker("sim_only") is not None:
        metafunc.parametrize("swap_backend", ["sim"], indirect=True)
    elif metafunc.definition.get_closest_marker("sim_device") is not None:
        metafunc.parametrize("swap_backend", ["cpu", "sim"], indirect=True)


@pytest.fixture
def swap_backend(request):
    """``None`` (the CPU backend), or the active :class:`SimDevice` of a ``[sim]`` run; at the end
    of a ``[sim]`` run every queued copy is run and any stream hazard fails the test."""
    kind = getattr(request, "param", "sim" if request.config.getoption("--sim-device") else "cpu")
    if request.node.get_closest_marker("no_sim") is not None:
        kind = "cpu"
    if kind == "cpu":
        yield None
        return
    from hyper_parallel.testing import simulated_device

    with simulated_device() as sim:
        yield sim


@pytest.fixture
def sim(swap_backend):
    """The simulated device of a ``sim_device`` / ``sim_only`` test's ``[sim]`` run."""
    if swap_backend is None:
        pytest.skip("runs only under the simulated device")
    return swap_backend


@pytest.fixture(autouse=True)
def fresh_manager(swap_backend):
    """A clean SwapManager (groups, chain, stats, host pool and limit) before and after each test,
    and a known RNG."""
    from hyper_parallel.core.activation_checkpoint import SwapManager

    mgr = SwapManager()
    mgr.reset()
    torch.manual_seed(0)
    yield mgr
    mgr.reset()
    torch.manual_seed(0)
