"""The mode-comparison bench (python -m hyper_parallel.bench) and its mode recipes."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hyper_parallel.bench import __main__ as bench
from hyper_parallel.bench.model import GPT, GPTConfig
from hyper_parallel.bench.modes import (
    MATMUL_OPS,
    MODES,
    SWAP_WRAPPER_MODES,
    apply_mode,
    apply_swap_wrapper_mode,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ARGS = ["--layers", "2", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "2"]


def _run_bench(extra, tmp_path, name):
    out = tmp_path / f"{name}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.bench", *TINY_ARGS, "--json", str(out), "--no-progress", *extra],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=900,
    )
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert out.exists(), report
    return json.loads(out.read_text()), proc


@pytest.mark.slow
def test_bench_checkpoint_wrapper_modes_match_baseline(tmp_path):
    doc, proc = _run_bench([], tmp_path, "ckpt")
    assert doc["device"] == "cpu"
    assert doc["config"]["layers"] == 2 and doc["config"]["steps"] == 2
    results = doc["results"]
    assert [r["mode"] for r in results] == list(MODES)
    for r in results:
        assert "error" not in r, r
        assert r["matches_baseline"] is True, (r["mode"], r["losses"], results[0]["losses"])
        assert len(r["losses"]) == 2
        assert r["peak_bytes"] > 0
        assert r["step_time_s"] > 0
        assert isinstance(r["stats"], dict)
    # the swap modes really offload (layers are chained); the others do not
    by_mode = {r["mode"]: r for r in results}
    for mode in ("swap", "funcswap"):
        assert by_mode[mode]["offloaded_bytes"] > 0, by_mode[mode]
    for mode in ("none", "recompute", "funcrecompute", "save", "funcsave"):
        assert by_mode[mode]["offloaded_bytes"] == 0, by_mode[mode]
    for mode in MODES:
        assert mode in proc.stdout


@pytest.mark.slow
def test_bench_swap_wrapper_modes_match_baseline(tmp_path):
    doc, _ = _run_bench(["--swap-wrapper"], tmp_path, "swapwrap")
    results = doc["results"]
    assert [r["mode"] for r in results] == list(SWAP_WRAPPER_MODES)
    for r in results:
        assert "error" not in r, r
        assert r["matches_baseline"] is True, (r["mode"], r["losses"], results[0]["losses"])
    by_mode = {r["mode"]: r for r in results}
    assert by_mode["swap"]["offloaded_bytes"] > 0
    # the policy swaps a subset of what plain swap offloads
    assert 0 < by_mode["swap_with_policy"]["offloaded_bytes"] <= by_mode["swap"]["offloaded_bytes"]


@pytest.mark.slow
def test_bench_reports_a_failing_worker(tmp_path):
    # a worker that cannot build its model (seq larger than the model allows is fine,
    # so use an impossible dtype/device instead) must make the bench exit non-zero
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.bench", *TINY_ARGS, "--modes", "none",
         "--device", "no_such_device", "--no-progress"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "failed" in proc.stderr.lower()
    assert "no_such_device" in proc.stderr  # the worker's own error is shown


# ---------------------------------------------------------------- fast checks


def test_mode_lists():
    assert MODES == ("none", "recompute", "funcrecompute", "save", "funcsave", "swap", "funcswap")
    assert SWAP_WRAPPER_MODES == ("none", "swap", "swap_with_policy")
    aten = torch.ops.aten
    assert MATMUL_OPS == {aten.mm.default, aten.addmm.default, aten.bmm.default}


def test_none_mode_leaves_model_untouched():
    model = GPT(GPTConfig(vocab=64, dim=32, heads=2, layers=2, seq=16), seed=0)
    layers = list(model.layers)
    assert apply_mode(model, "none") is model
    assert apply_swap_wrapper_mode(model, "none") is model
    assert list(model.layers) == layers
    assert "forward" not in vars(model.layers[0].attn)


def test_unknown_modes_are_rejected():
    model = GPT(GPTConfig(vocab=64, dim=32, heads=2, layers=2, seq=16), seed=0)
    with pytest.raises(ValueError, match="unknown mode"):
        apply_mode(model, "swap_with_policy")
    with pytest.raises(ValueError, match="unknown swap_wrapper mode"):
        apply_swap_wrapper_mode(model, "recompute")


def test_mode_order_puts_baseline_first():
    parser = bench.build_parser()
    args = parser.parse_args(["--modes", "swap,none,save,swap"])
    assert bench._mode_list(args, parser) == ["none", "swap", "save"]
    args = parser.parse_args(["--modes", "recompute"])
    assert bench._mode_list(args, parser) == ["none", "recompute"]
    args = parser.parse_args(["--swap-wrapper"])
    assert bench._mode_list(args, parser) == list(SWAP_WRAPPER_MODES)
    with pytest.raises(SystemExit):
        bench._mode_list(parser.parse_args(["--modes", "bogus"]), parser)


def test_loss_matching_rules():
    assert bench.losses_match([1.0, 2.0], [1.0, 2.0], exact=True)
    assert not bench.losses_match([1.0, 2.0 + 1e-12], [1.0, 2.0], exact=True)
    assert bench.losses_match([1.0, 2.0 + 1e-6], [1.0, 2.0], exact=False)
    assert not bench.losses_match([1.0, 2.0 + 1e-4], [1.0, 2.0], exact=False)
    assert not bench.losses_match([1.0], [1.0, 2.0], exact=True)


def test_memory_checks_and_table():
    mib = 1 << 20
    results = [
        {"mode": "none", "peak_bytes": 300 * mib, "offloaded_bytes": 0, "step_time_s": 0.5,
         "losses": [6.0, 5.9], "matches_baseline": True},
        {"mode": "save", "peak_bytes": 200 * mib, "offloaded_bytes": 0, "step_time_s": 0.6,
         "losses": [6.0, 5.9], "matches_baseline": True},
        {"mode": "recompute", "peak_bytes": 100 * mib, "offloaded_bytes": 0, "step_time_s": 0.7,
         "losses": [6.0, 5.9], "matches_baseline": True},
        {"mode": "swap", "peak_bytes": 110 * mib, "offloaded_bytes": 50 * mib, "step_time_s": 0.8,
         "losses": [6.0, 5.8], "matches_baseline": False},
        {"mode": "funcswap", "error": "exit status 1"},
    ]
    checks = {c["check"]: c["ok"] for c in bench.memory_checks(results, swap_wrapper=False)}
    assert checks == {"none > save": True, "save > recompute": True, "none > recompute": True,
                      "swap ~ recompute": True}
    table = bench.format_table(results)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["mode", "peak", "MiB"]
    assert "300.0" in lines[2] and "1.00x" in lines[2] and "baseline" in lines[2]
    assert "0.33x" in lines[4]
    assert lines[5].rstrip().endswith("NO") and "25.0" in lines[5]  # per step
    assert "FAILED" in lines[6]


def test_swap_threshold_default_is_one_attention_matrix():
    parser = bench.build_parser()
    args = parser.parse_args([])
    # batch 4 x heads 4 x 256 x 256 x 4 bytes
    assert bench.swap_threshold(args) == 4 * 4 * 256 * 256 * 4
    args = parser.parse_args(["--dtype", "bfloat16", "--batch", "2"])
    assert bench.swap_threshold(args) == 2 * 4 * 256 * 256 * 2
    args = parser.parse_args(["--swap-threshold-bytes", "123"])
    assert bench.swap_threshold(args) == 123
