"""MindSpore test suite: selects the MindSpore platform *before* the library is imported.

This directory is separate from ``tests/`` so that the torch suite never imports MindSpore; run it
with ``make test-mindspore`` (its own virtualenv: mindspore==2.10.0, numpy<2, pytest).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _msboot  # noqa: E402

_msboot.install()

import mindspore as ms  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_swap_manager_and_rng():
    from hyper_parallel.core.activation_checkpoint import SwapManager

    SwapManager().reset()
    ms.set_seed(0)
    yield
    SwapManager().reset()
    # An exception that escapes value_and_grad leaves MindSpore 2.10's executor recording every
    # later forward; reset it so that one test's expected error does not change the next test.
    from mindspore.graph.api import _pynative_executor
    if _pynative_executor.requires_grad():
        _pynative_executor.clear_res()


def pytest_report_header(config):
    return (f"mindspore {ms.__version__}, device_target={ms.get_context('device_target')}, "
            f"HYPER_PARALLEL_PLATFORM={os.environ.get('HYPER_PARALLEL_PLATFORM')}")
