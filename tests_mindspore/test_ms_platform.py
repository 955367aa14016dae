"""Platform selection and the tensor operations the swap engine relies on."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

import hyper_parallel.core.activation_checkpoint  # noqa: F401  (binds the backend)
from hyper_parallel.core.backend import active_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _select(env_value):
    env = {k: v for k, v in os.environ.items() if k != "HYPER_PARALLEL_PLATFORM"}
    if env_value is not None:
        env["HYPER_PARALLEL_PLATFORM"] = env_value
    env["GLOG_v"] = "3"
    code = ("import hyper_parallel.core.activation_checkpoint; from hyper_parallel.core.backend import "
            "active_backend; print('NAME=' + active_backend().name)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("NAME="):
            return line[5:]
    raise AssertionError(proc.stderr[-3000:])


@pytest.mark.slow
def test_environment_variable_selects_mindspore():
    assert _select("mindspore") == "mindspore"


@pytest.mark.slow
def test_mindspore_is_the_default_without_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        assert _select(None) == "mindspore"
    else:
        pytest.skip("torch is installed in this environment: it stays the default")


def test_storage_copies_and_rebuilt_views_share_memory():
    p = active_backend()
    base = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)) * 1.0
    view = base.transpose(1, 0)[1:]
    meta = p.saved_facts(view, ()).meta
    again = p.rebuild_view(view, meta)  # over the storage of a saved tensor (a cancelled offload)
    assert again.stride() == view.stride() and again.storage_offset() == view.storage_offset()
    assert np.array_equal(again.asnumpy(), view.asnumpy()) and again.data_ptr() == view.data_ptr()
    host = p.empty_host_bytes(48)
    p.copy_bytes(host, view)  # the whole storage, not only the view's elements
    dev = p.empty_device_bytes(48, meta)
    p.copy_bytes(dev, host)
    copy = p.rebuild_view(dev, meta)
    assert np.array_equal(copy.asnumpy(), view.asnumpy()) and copy.data_ptr() != view.data_ptr()


def test_alias_shares_the_version_counter_and_has_no_graph():
    p = active_backend()
    t = Tensor(np.ones((2, 3), np.float32)) * 1.0
    alias = p.alias(t)
    assert alias.data_ptr() == t.data_ptr() and alias._grad_node is None
    before = p.version(alias)
    t.copy_(t * 2.0)
    assert p.version(alias) == before + 1


def test_unswappable_reasons_and_cpu_streams_are_noops():
    p = active_backend()
    assert p.saved_facts(Tensor(np.ones(3, np.float32)), ()).reason is None
    assert p.saved_facts(Tensor(np.ones(0, np.float32)), ()).reason == "empty"
    assert p.saved_facts(object(), ()).reason == "unsupported_tensor"
    assert p.storage_other_holders([Tensor(np.ones(3, np.float32))]) == 0
    if ms.get_context("device_target") == "CPU":
        assert p.current_stream() is None and p.new_copy_stream() is None
        assert p.record_event(None) is None
        with p.stream_context(None), p.trace_range("x"):
            pass


def test_pipeline_swap_is_not_available():
    from hyper_parallel.core.activation_checkpoint import pipeline_swap
    with pytest.raises(RuntimeError, match="MicrobatchSwapSchedule"):
        pipeline_swap(object())


def test_bucketing_is_off_and_refused_where_storages_cannot_be_sliced():
    from hyper_parallel.core.activation_checkpoint import SwapManager

    p = active_backend()
    assert p.supports_slots is False  # MindSpore 2.10's UntypedStorage has no slicing
    mgr = SwapManager()
    mgr.reset()
    assert mgr.bucket_bytes() == 0
    with pytest.raises(ValueError, match="cannot make a storage over part of another"):
        mgr.set_bucket_bytes(1 << 20)
    mgr.set_bucket_bytes(0)  # off is always fine


    p = active_backend()
    with pytest.raises(NotImplementedError, match="whole storages only"):
        p.copy_bytes(p.empty_host_bytes(64), Tensor(np.arange(4, dtype=np.float32)), 16)
