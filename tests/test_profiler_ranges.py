"""Observability: the swap engine's offload/load launches and waits are named ranges in
``torch.profiler`` traces; ``hyper_parallel.bench.trace`` writes a Chrome trace of one step and reads
copy-engine figures back from device events. No timing assertions."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
from hyper_parallel.bench.modes import chain_layers, swap_matmuls
from hyper_parallel.bench.trace import (analyze_copies, profiler_activities, range_names, trace_events,
                                        write_trace)
from hyper_parallel.core.activation_checkpoint import SwapManager, checkpoint_wrapper, swap_wrapper

CFG = GPTConfig(vocab=64, dim=32, heads=2, layers=3, seq=16, dropout=0.0)
KINDS = ("launch_offload", "wait_offload", "launch_load", "wait_load")


def _chained_model(kind: str) -> GPT:
    model = GPT(CFG, seed=0)
    for i, layer in enumerate(model.layers):
        if kind == "swap_wrapper":
            model.layers[i] = swap_wrapper(layer)
        else:
            model.layers[i] = checkpoint_wrapper(layer, policy_fn=swap_matmuls, swap_inputs=True)
    chain_layers(model.layers)
    return model


def _step(model: GPT) -> None:
    tokens, targets = make_batch(CFG, 2, 0)
    model(tokens, targets).backward()


def _expected(model: GPT):
    """Range names the layer chain must produce (at least): offloads and loads for every layer but
    the last (with a copy stream the last is never offloaded, so never loaded; on CPU it is, and its
    ranges may appear too). On CPU (no copy stream) an offload is waited right after its launch and
    backward loads each tensor when it is used, through the same launch and wait."""
    mgr = SwapManager()
    groups = [mgr.layer_group_name(layer) for layer in model.layers]
    assert all(groups), groups
    names = set()
    for g in groups[:-1]:
        for kind in KINDS:
            names.add(f"hyper_parallel.{kind}[{g}]")
    return names


@pytest.mark.parametrize("kind", ["swap_wrapper", "checkpoint_wrapper"])
def test_layer_chain_step_emits_named_ranges(kind):
    model = _chained_model(kind)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model)
    found = set(range_names(prof))
    missing = _expected(model) - found
    assert not missing, f"missing ranges {sorted(missing)}; found {sorted(found)}"
    assert SwapManager().stats()["offloaded_bytes"] > 0


def test_atomic_api_ranges_carry_the_group_name():
    block = swap_wrapper(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16)))
    mgr = SwapManager()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        mgr.set_current_group_name("mb7")
        loss = block(torch.randn(8, 16, requires_grad=True)).sum()
        mgr.set_current_group_name(None)
        mgr.launch_offload("mb7")
        mgr.wait_offload("mb7")
        mgr.launch_load("mb7")
        mgr.wait_load("mb7")
        loss.backward()
    found = set(range_names(prof))
    assert {f"hyper_parallel.{k}[mb7]" for k in KINDS} <= found, sorted(found)


def test_write_trace_writes_a_chrome_trace_with_the_ranges(tmp_path):
    model = _chained_model("swap_wrapper")
    path = write_trace(lambda: _step(model), tmp_path / "sub" / "swap.json", warmup=1)
    assert path.endswith("swap.json")
    with open(path) as f:
        doc = json.load(f)
    assert isinstance(doc.get("traceEvents"), list) and doc["traceEvents"]
    found = set(range_names(path))
    assert "hyper_parallel.step" in found
    assert _expected(model) <= found, sorted(found)
    # the loaded dict and the event list give the same answer
    assert set(range_names(doc)) == found == set(range_names(trace_events(doc)))


def test_write_trace_without_swap_has_no_engine_ranges(tmp_path):
    model = GPT(CFG, seed=0)
    path = write_trace(lambda: _step(model), tmp_path / "none.json")
    assert range_names(path) == ["hyper_parallel.step"]


def test_profiler_activities_cpu():
    acts = profiler_activities("cpu")
    assert acts == [ProfilerActivity.CPU]
    if not torch.accelerator.is_available():
        assert profiler_activities() == [ProfilerActivity.CPU]


def _ev(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_analyze_copies_bandwidth_and_overlap_from_events():
    events = [
        _ev("kernel", "gemm", 0, 10, stream=7),
        _ev("kernel", "softmax", 8, 4, stream=7),            # overlaps the first: union [0, 12)
        _ev("kernel", "gemm", 20, 10, stream=7),
        # D2H on the copy stream, [5, 25): covered by kernels on [5, 12) and [20, 25) -> 12 of 20 us
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 5, 20, stream=20, bytes=40_000),
        # H2D [40, 50): nothing runs -> fully exposed
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 40, 10, stream=20, bytes=10_000),
        # loss.item(): pageable, not counted
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 60, 1, stream=7, bytes=4),
        {"ph": "i", "name": "marker", "ts": 1},               # not a complete event
    ]
    out = analyze_copies({"traceEvents": events})
    d2h, h2d, total = out["d2h"], out["h2d"], out["total"]
    assert d2h["count"] == 1 and d2h["bytes"] == 40_000
    assert d2h["busy_s"] == pytest.approx(20e-6)
    assert d2h["gbps"] == pytest.approx(40_000 / 20e-6 / 1e9)
    assert d2h["hidden_s"] == pytest.approx(12e-6)
    assert d2h["overlap_fraction"] == pytest.approx(0.6)
    assert h2d["overlap_fraction"] == pytest.approx(0.0)
    assert h2d["gbps"] == pytest.approx(1.0)
    assert total["bytes"] == 50_000
    assert total["overlap_fraction"] == pytest.approx(12 / 30)
    assert out["kernel_busy_s"] == pytest.approx(22e-6)
    # counting pageable copies too
    everything = analyze_copies(events, pinned_only=False)
    assert everything["d2h"]["count"] == 2


def test_analyze_copies_without_device_events():
    out = analyze_copies([])
    assert out["total"]["count"] == 0
    assert out["total"]["gbps"] is None and out["total"]["overlap_fraction"] is None


def test_write_trace_gzip(tmp_path):
    model = _chained_model("checkpoint_wrapper")
    path = write_trace(lambda: _step(model), tmp_path / "swap.json.gz")
    with open(path, "rb") as f:
        assert f.read(2) == b"\x1f\x8b"  # gzip magic
    assert _expected(model) <= set(range_names(path))
