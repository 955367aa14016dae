"""The RFC's own self-test, on CPU.

Each of the seven modes trains the built-in GPT-like model (dropout, layer norm, a causal mask
buffer passed to every layer) for three training steps in a process of its own (the bench's); every step's loss must
equal the ``none`` baseline bitwise, and the peak device memory measured by ``MemoryMeter`` must
order as ``none > save > recompute`` with ``swap`` within 30% of ``recompute`` and below ``save``.
The mixed wrappings of the RFC's test scope run in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hyper_parallel.bench.model import GPT, GPTConfig, train_steps
from hyper_parallel.bench.modes import MODES, chain_layers, swap_matmuls
from hyper_parallel.core.activation_checkpoint import SwapManager, checkpoint_wrapper, swap_wrapper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_GUARD_S = 60 * 60  # a guard against a hung subprocess, never a speed check
CONFIG = ["--layers", "8", "--dim", "64", "--heads", "2", "--seq", "64", "--batch", "4",
          "--vocab", "256", "--steps", "3", "--threads", "1"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every mode's result, as the bench (``python -m hyper_parallel.bench``) ran it in a process of its own."""
    out = tmp_path_factory.mktemp("selftest") / "bench.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "hyper_parallel.bench", *CONFIG, "--json", str(out), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_mode = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(by_mode) == sorted(MODES)
    return by_mode


@pytest.mark.slow
def test_every_mode_matches_the_baseline_bitwise(results):
    base = results["none"]["losses"]
    assert len(base) == 3
    for mode in MODES:
        assert results[mode]["losses"] == base, mode  # floats from JSON: exact equality


@pytest.mark.slow
def test_peak_memory_orders_as_the_rfc_expects(results):
    peak = {m: r["peak_bytes"] for m, r in results.items()}
    print({m: round(p / 2**20, 2) for m, p in peak.items()})
    assert peak["none"] > peak["save"] > peak["recompute"]
    assert peak["none"] > peak["funcsave"] > peak["funcrecompute"]
    assert peak["swap"] < peak["save"]
    assert abs(peak["swap"] - peak["recompute"]) <= 0.30 * peak["recompute"]
    assert peak["funcswap"] < peak["funcsave"]


@pytest.mark.slow
def test_swap_modes_really_offload(results):
    for mode in ("swap", "funcswap"):
        stats = results[mode]["stats"]
        assert stats["offloaded_bytes"] > 0 and stats["loaded_bytes"] == stats["offloaded_bytes"], mode
    for mode in ("none", "recompute", "save"):
        assert results[mode]["offloaded_bytes"] == 0, mode


# ----------------------------------------------------------------------------- mixed wrappings
CFG = GPTConfig(vocab=64, dim=32, heads=2, layers=4, seq=32, dropout=0.1)


def _train(model: torch.nn.Module) -> tuple:
    losses = train_steps(model, 3, 2, 1e-3, 7, "cpu")
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.mark.sim_device
def test_swap_wrapper_on_attention_and_swap_policy_on_mlp():
    base = _train(GPT(CFG, seed=3))
    model = GPT(CFG, seed=3)
    for layer in model.layers:
        layer.attn = swap_wrapper(layer.attn)
        layer.mlp = checkpoint_wrapper(layer.mlp, policy_fn=swap_matmuls, swap_inputs=True)
    chain_layers(model.layers)
    got = _train(model)
    _assert_same(got, base)
    stats = SwapManager().stats()
    assert stats["offloaded_bytes"] > 0 and stats["loaded_bytes"] == stats["offloaded_bytes"]


@pytest.mark.sim_device
def test_whole_layer_and_submodule_function_wrapping_mixed():
    base = _train(GPT(CFG, seed=5))
    model = GPT(CFG, seed=5)
    model.layers[0] = checkpoint_wrapper(model.layers[0], policy_fn=swap_matmuls, swap_inputs=True)
    model.layers[1] = checkpoint_wrapper(model.layers[1])
    for layer in model.layers[2:]:
        layer.attn = swap_wrapper(layer.attn, policy_fn=None)
        layer.mlp.forward = checkpoint_wrapper(layer.mlp.forward, policy_fn=swap_matmuls)
    chain_layers(model.layers)
    got = _train(model)
    _assert_same(got, base)
    assert SwapManager().stats()["offloaded_bytes"] > 0
