"""Smoke tests of the benchmark scripts at tiny size: they run, write their JSON / chart / traces, and
report what they must (losses equal to the baseline, bytes moved, the headline, skip reasons).
The scripts are thin: their variants, timer, runner and reporter are ``hyper_parallel.bench``'s
(tests/test_bench_smoke.py). No timing assertions and no time limits (only a guard against a hung
process): the numbers themselves are for docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
HAVE_ACC = torch.accelerator.is_available()
# Only a guard against a hung subprocess, never a speed check: a busy machine must not fail a test.
HANG_GUARD_S = 60 * 60


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("OUT", None)
    env.update(extra)
    return env


def _run(argv, tmp_path, **env):
    proc = subprocess.run(argv, cwd=str(tmp_path), env=_env(**env), capture_output=True, text=True,
                          timeout=HANG_GUARD_S, stdin=subprocess.DEVNULL)
    return proc, f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


@pytest.mark.slow
def test_gpu_suite_tiny_runs_every_stage(tmp_path):
    """The whole suite at the smoke-test size (on CPU via SUITE_ALLOW_CPU when there is no GPU):
    the GPU stream tests (skipped without CUDA), compare_peers with traces, and both sweeps. At
    this size the suite sets no stage time limit."""
    out = tmp_path / "out"
    proc, report = _run(["bash", os.path.join(BENCH, "gpu_suite.sh")], tmp_path, OUT=str(out),
                        PYTHON=sys.executable, SUITE_QUICK="tiny", SUITE_ALLOW_CPU="1")
    assert proc.returncode == 0, report
    summary = (out / "summary.txt").read_text()
    for stage in ("gpu_streams", "compare", "sweep_layers", "sweep_seq", "bench_trace", "planner"):
        assert f"--- [{stage}] ok" in summary, summary
    assert summary.index("[gpu_streams]") < summary.index("[compare]")  # the ordering tests come first
    assert "TIMED OUT" not in summary
    assert (out / "env.txt").exists()
    if not torch.cuda.is_available():  # skipped, with its reason
        assert "needs a CUDA device" in (out / "gpu_streams.log").read_text()

    # --- compare_peers
    doc = json.loads((out / "compare.json").read_text())
    results = doc["results"]
    expected = {"none", "torch_ckpt", "torch_sac", "save_on_cpu", "ours_recompute", "ours_save",
                "ours_swap_wrapper", "ours_ckpt_swap", "ours_recompute_swapin"}
    assert expected <= set(results), sorted(results)
    assert not doc["errors"], doc["errors"]
    for name, r in results.items():
        assert r["loss_equal_to_none"] is True, (name, r["losses"], results["none"]["losses"])
        assert r["peak_bytes"] > 0 and r["step_time_s"] > 0, (name, r)
        assert r["peak_bytes"] >= r["static_bytes"]
    moved = {n: r["bytes_moved_per_step"] for n, r in results.items()}
    for n in ("save_on_cpu", "ours_swap_wrapper", "ours_ckpt_swap"):
        assert moved[n]["d2h"] > 0 and moved[n]["h2d"] > 0, (n, moved[n])
    for n in ("none", "torch_ckpt", "torch_sac", "ours_recompute", "ours_save"):
        assert moved[n] == {"d2h": 0, "h2d": 0}, (n, moved[n])
    # recompute keeps less than no checkpointing, whoever implements it
    assert results["torch_ckpt"]["peak_bytes"] < results["none"]["peak_bytes"]
    assert results["ours_recompute"]["peak_bytes"] < results["none"]["peak_bytes"]
    head = doc["headline"]
    assert set(head["per_variant"]) >= {"ours_recompute", "ours_ckpt_swap"}
    assert head["per_variant"]["ours_recompute"]["counterparts"]["torch_ckpt"]["peak_ratio"] > 0
    if not HAVE_ACC:
        for n in ("torchtune_offload", "torchtune_offload_ckpt"):
            assert "CUDA-only" in doc["skipped"][n]
    assert doc["swap_manager_stats"]["offloaded_bytes"] > 0
    log = (out / "compare.log").read_text()
    assert "SwapManager().stats()" in log and "headline" in log
    legend = log.split("legend:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in legend[:len(results)]] == list(results)  # one line per row
    # one Chrome trace per variant; the swap variants show the engine's named ranges
    from hyper_parallel.bench.trace import range_names

    traces = out / "traces"
    assert {p.name for p in traces.iterdir()} >= {f"{n}.json.gz" for n in expected}
    names = range_names(str(traces / "ours_swap_wrapper.json.gz"))
    assert any(n.startswith("hyper_parallel.launch_offload[") for n in names), names
    # (a load: on CPU one synchronous copy inside its launch range, no wait range)
    assert any(n.startswith("hyper_parallel.launch_load[") for n in names), names

    # --- sweeps
    for axis, values in (("layers", [2, 3]), ("seq", [8, 16])):
        sweep = json.loads((out / f"sweep_{axis}.json").read_text())
        assert sweep["axis"] == axis and sweep["values"] == values and "partial" not in sweep
        assert [p["value"] for p in sweep["points"]] == values
        for p in sweep["points"]:
            assert "ours_ckpt_swap" in p["results"] and "none" in p["results"]
            assert all(r["loss_equal_to_none"] for r in p["results"].values())
        assert "none" in sweep["growth"]
    # --- python -m hyper_parallel.bench --trace: one trace per mode, every mode matching none
    bench = json.loads((out / "bench.json").read_text())
    assert [r["mode"] for r in bench["results"]] == ["none", "recompute", "save", "swap"]
    assert all(r["matches_baseline"] for r in bench["results"])
    assert {p.name for p in (out / "bench_traces").iterdir()} == {f"{m}.json" for m in ("none", "recompute", "save", "swap")}
    # --- the planner beside the recipes: every plan within its budget, every row training like none
    planned = json.loads((out / "planner.json").read_text())["models"][0]
    plans = {n: r for n, r in planned["rows"].items() if n.startswith("plan@")}
    assert len(plans) == 2 and not planned["errors"], planned["errors"]
    assert all(r["peak_bytes"] <= r["budget_bytes"] for r in plans.values()), plans
    assert all(r["grads_equal_to_none"] for r in planned["rows"].values())
    if HAVE_MPL:
        for png in ("compare.png", "sweep_layers.png", "sweep_seq.png", "planner.png"):
            assert (out / png).stat().st_size > 1000, png


@pytest.mark.slow
@pytest.mark.skipif(HAVE_ACC, reason="checks the no-accelerator path")
def test_gpu_suite_fails_fast_without_an_accelerator(tmp_path):
    out = tmp_path / "out"
    proc, report = _run(["bash", os.path.join(BENCH, "gpu_suite.sh")], tmp_path, OUT=str(out),
                        PYTHON=sys.executable)
    assert proc.returncode == 3, report
    assert "no accelerator" in proc.stderr, report
    assert not out.exists()  # nothing ran, nothing written


@pytest.mark.slow
def test_compare_peers_rejects_unknown_variant(tmp_path):
    proc, report = _run([sys.executable, os.path.join(BENCH, "compare_peers.py"), "--variants", "nope"],
                        tmp_path)
    assert proc.returncode != 0 and "unknown variant" in (proc.stderr + proc.stdout), report


@pytest.mark.slow
def test_recompute_vs_torch_tiny(tmp_path):
    """Recompute against PyTorch's (whole-layer and selective), weights fixed: compare_peers' headline ratios."""
    out = tmp_path / "rvt.json"
    proc, report = _run([sys.executable, os.path.join(BENCH, "compare_peers.py"), "--variants",
                         "torch_ckpt,ours_recompute,torch_sac,ours_save", "--lr", "0", "--layers", "2", "--dim", "32",
                         "--heads", "2", "--seq", "16", "--batch", "2", "--rounds", "2", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, report
    per_variant = json.loads(out.read_text())["headline"]["per_variant"]
    assert per_variant["ours_recompute"]["counterparts"]["torch_ckpt"]["time_ratio"] > 0
    assert per_variant["ours_save"]["counterparts"]["torch_sac"]["time_ratio"] > 0
    assert "vs torch_ckpt: peak 1.00x" in proc.stdout and "vs torch_sac: peak 1.00x" in proc.stdout
