"""Smoke tests of benchmarks/swap_overhead.py and benchmarks/swap_memory.py (issue 12's measurements)
at tiny size, and of the pieces of the benchmark harness they rest on: the copying peers, the byte
counts (``SwapManager().stats()``), memory per phase and call counts. No timing assertions:
the numbers are for docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hyper_parallel.bench import harness
from hyper_parallel.bench.model import SmallOpsNet
from hyper_parallel.bench.modes import (MEMORY_VARIANTS, OVERHEAD_VARIANTS, ByteCounter, CopyHooks, HooksLayer,
                                        _torch_policy, sac_host_copy_contexts)
from hyper_parallel.bench.harness import counting_calls, saved_bytes_per_layer
from hyper_parallel.tools.memory import MemoryMeter, mark_host

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
HANG_GUARD_S = 60 * 60  # a guard against a hung subprocess, never a speed check


def _run(argv, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable] + argv, cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, stdin=subprocess.DEVNULL)
    return proc, f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_copying_peers_are_bitwise_exact_and_count_what_they_copy():
    torch.manual_seed(0)
    base = SmallOpsNet(blocks=3, dim=8, hidden=16)
    x = torch.randn(2, 8)
    base(x).backward()
    want = _grads(base)

    hooks = ByteCounter()
    m = SmallOpsNet(blocks=3, dim=8, hidden=16)
    for i, b in enumerate(m.layers):
        m.layers[i] = HooksLayer(b, lambda: CopyHooks(hooks))
    m(x).backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(m), want))
    assert hooks.tensors > 0 and hooks.d2h > 0 and hooks.h2d == hooks.d2h  # every copy came back

    sac = ByteCounter()
    m = SmallOpsNet(blocks=3, dim=8, hidden=16)
    for i, b in enumerate(m.layers):
        m.layers[i] = HooksLayer(b, lambda: CopyHooks(sac),
                                 context_fn=lambda: sac_host_copy_contexts(_torch_policy, sac))
    m(x).backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(m), want))
    # per block: the input (outer hooks) and both addmm outputs (the cache) copied out
    per_block = 2 * 8 * 4 + 2 * 16 * 4 + 2 * 8 * 4
    assert sac.tensors == 3 * 3 and sac.d2h == 3 * per_block
    assert 0 < sac.h2d <= sac.d2h


def _run_small(names, **kw):
    model = SmallOpsNet(blocks=4, dim=8, hidden=16)
    return harness.run_variants(names, batch=2, device=torch.device("cpu"), rounds=1, warmup=1, lr=0.0, seed=0,
                                base_model=model, batches=lambda i: model.make_batch(2, i), **kw)


def test_harness_counts_our_bytes_from_the_engine_statistics(fresh_manager):
    """What ours move per step comes from SwapManager().stats(): every byte offloaded comes back
    (swap_wrapper), in one load launch per chained layer that was offloaded, buckets or not (a
    bucket cuts the copies inside a launch: tests/test_swap_bucket.py); the gradients stay bitwise
    those of the plain model."""
    plain = _run_small(["none", "ours_swap_wrapper", "copy_hooks"], metered=False).variants
    fresh_manager.set_bucket_bytes(1 << 20)
    bucketed = _run_small(["none", "ours_swap_wrapper"], metered=False).variants
    ours, peer = plain["ours_swap_wrapper"], plain["copy_hooks"]
    assert ours.moved["d2h"] == ours.moved["h2d"] > 0 and ours.tensors_out is None
    assert peer.moved["d2h"] == peer.moved["h2d"] > ours.moved["d2h"]  # the hooks copy the parameters too
    assert peer.tensors_out > ours.load_launches > 0 and peer.load_launches is None
    assert bucketed["ours_swap_wrapper"].moved == ours.moved
    assert bucketed["ours_swap_wrapper"].load_launches == ours.load_launches
    assert all(v.grads_equal_to_none for run in (plain, bucketed) for v in run.values())


def test_peers_mark_their_host_copies_in_the_metered_step_only():
    """On CPU the copying peers' host copies are host memory in the metered step (copy_hooks then
    holds what save_on_cpu holds; after the forward, less than none), and are not marked in the timed steps
    (marking is the meter's cost, not the peer's)."""
    run = _run_small(["none", "copy_hooks", "save_on_cpu"]).variants
    assert run["copy_hooks"].phases == run["save_on_cpu"].phases
    assert run["copy_hooks"].phases["forward"]["end"] < run["none"].phases["forward"]["end"]
    assert not run["copy_hooks"].counter.mark and not run["save_on_cpu"].counter.mark


def test_phases_from_one_meter_leave_host_buffers_out():
    """The harness's phases are one MemoryMeter split by reset_peak: each phase's peak and end, and a
    buffer marked as host memory right after its allocation counts in no phase."""
    with MemoryMeter("cpu", scan_gc=False) as meter:
        base = meter.current_bytes
        a = torch.empty(1 << 18)            # 1 MiB, freed in the next phase
        first = meter.reset_peak() - base, meter.current_bytes - base
        b = torch.empty(1 << 16)            # 256 KiB while a is alive
        del a
        host = torch.empty(1 << 20)          # 4 MiB swap copy: host memory
        mark_host(host)
        second = meter.reset_peak() - base, meter.current_bytes - base
        del b
        third = meter.reset_peak() - base, meter.current_bytes - base
    assert first == (1 << 20, 1 << 20)
    assert second == ((1 << 20) + (1 << 18), 1 << 18)
    assert third == (1 << 18, 0)


def test_a_metered_step_reads_every_phase_above_the_models_own_bytes():
    model = SmallOpsNet(blocks=2, dim=8, hidden=16)
    v = harness.build_variant("none", model, "cpu", lr=0.1)
    harness.metered_step(v, model.make_batch(64, 0), 0, "cpu")
    assert list(v.phases) == list(harness.PHASES)
    assert all(p["peak"] >= p["end"] >= v.static_bytes == harness.module_bytes(model) for p in v.phases.values())
    assert v.phases["forward"]["end"] > v.phases["optimizer"]["end"]  # the activations are gone after backward
    assert v.peak_bytes == max(p["peak"] for p in v.phases.values())


def _len_each(n):
    return [len([i]) for i in range(n)]  # per item: one call of len


def test_counting_calls_counts_exactly_the_calls_inside_and_restores_the_profiler():
    with counting_calls() as empty:
        pass
    assert empty == {"python": 0, "builtin": 0}
    with counting_calls() as calls:
        _len_each(5)
    # _len_each and its list comprehension (a function of its own before Python 3.12), and len five
    # times (making a range object is a type's call, which the profiler does not report)
    comprehension = 1 if sys.version_info < (3, 12) else 0
    assert calls == {"python": 1 + comprehension, "builtin": 5}
    outer = []

    def prof(frame, event, arg):
        outer.append(event)

    sys.setprofile(prof)
    try:
        with counting_calls():
            pass
        restored = sys.getprofile()
        seen = len(outer)
        _len_each(1)
        after = len(outer) - seen
    finally:
        sys.setprofile(None)
    assert restored is prof and after > 0  # the profiler that was there before is back, and sees calls


def test_counting_calls_under_cprofile_gives_cprofile_its_hook_back():
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    try:
        with counting_calls() as calls:
            _len_each(3)
        _len_each(2)  # after the block: cProfile records again
    finally:
        pr.disable()
    assert calls["builtin"] == 3
    called = {func[2]: stat[1] for func, stat in pstats.Stats(pr).stats.items()}
    assert called.get("_len_each") == 1  # the call after the block; the one inside was ours


def test_counting_calls_sees_the_hooks_of_a_backward():
    m = SmallOpsNet(blocks=2, dim=8, hidden=16)
    x = torch.randn(4, 8)
    with counting_calls() as plain:
        m(x).backward()
    copies = ByteCounter()
    m2 = SmallOpsNet(blocks=2, dim=8, hidden=16)
    for i, layer in enumerate(m2.layers):
        m2.layers[i] = HooksLayer(layer, lambda: CopyHooks(copies))
    with counting_calls() as hooked:
        m2(x).backward()
    # every saved tensor goes through a Python pack (forward) and unpack (backward) hook
    assert copies.tensors > 0
    assert hooked["python"] >= plain["python"] + 2 * copies.tensors


def test_saved_bytes_per_layer_counts_activations_not_parameters():
    m = SmallOpsNet(blocks=2, dim=8, hidden=16)
    per_layer = saved_bytes_per_layer(m, (torch.randn(4, 8),))
    assert len(per_layer) == 2 and per_layer[0] == per_layer[1] > 0
    assert per_layer[0] < sum(p.numel() * 4 for p in m.layers[0].parameters()) + 4 * 8 * 4 * 10


@pytest.mark.slow
def test_swap_overhead_tiny(tmp_path):
    out = tmp_path / "overhead.json"
    proc, log = _run([os.path.join(BENCH, "swap_overhead.py"), "--blocks", "3", "--dim", "8", "--hidden", "16",
                      "--batch", "2", "--rounds", "2", "--warmup", "1", "--bucket-bytes", str(1 << 20),
                      "--json", str(out)], tmp_path)
    assert proc.returncode == 0, log
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert list(rows) == list(OVERHEAD_VARIANTS) and not doc["errors"]
    assert all(r["grads_equal_to_none"] for r in rows.values())
    for n in ("save_on_cpu", "copy_hooks", "torch_sac_copy"):
        assert rows[n]["tensors_out_per_step"] > 0 and rows[n]["bytes_moved_per_step"]["d2h"] > 0, (n, rows[n])
    for n in ("ours_swap_wrapper", "ours_ckpt_swap"):
        assert rows[n]["load_launches_per_step"] > 0 and rows[n]["bytes_moved_per_step"]["d2h"] > 0, (n, rows[n])
    for n in ("none", "torch_sac", "ours_save"):
        assert rows[n]["bytes_moved_per_step"] == {"d2h": 0, "h2d": 0}, (n, rows[n])
    pairs = {(p["ours"], p["peer"]): p for p in doc["pairs"]}
    assert pairs[("ours_swap_wrapper", "copy_hooks")]["target"] == 1.5
    assert pairs[("ours_ckpt_swap", "torch_sac_copy")]["target"] == 1.25
    assert all(p["ratio"] > 0 for p in pairs.values())
    # the interpreter work of one step: hooks add calls, and ours more than none's
    assert all(r["calls"]["python"] > 0 and r["calls"]["builtin"] > 0 for r in rows.values())
    assert rows["copy_hooks"]["calls"]["python"] > rows["none"]["calls"]["python"]
    assert rows["ours_swap_wrapper"]["calls"]["python"] > rows["none"]["calls"]["python"]
    assert all(p["calls_ratio"] > 0 for p in pairs.values())
    for text in ("overhead us/block", "py calls", "calls ratio", "legend:", "load average"):
        assert text in proc.stdout, text


@pytest.mark.slow
def test_swap_memory_tiny(tmp_path):
    out = tmp_path / "memory.json"
    proc, log = _run([os.path.join(BENCH, "swap_memory.py"), "--gpt-layers", "2", "--gpt-dim", "16", "--gpt-heads", "2",
                      "--gpt-seq", "8", "--gpt-batch", "2", "--postln-layers", "2", "--postln-dim", "16",
                      "--postln-heads", "2", "--postln-seq", "8", "--postln-batch", "2", "--vocab", "32",
                      "--json", str(out)], tmp_path)
    assert proc.returncode == 0, log
    doc = json.loads(out.read_text())
    assert set(doc["models"]) == {"gpt", "postln"}
    for name, res in doc["models"].items():
        assert not res["errors"], res["errors"]
        assert list(res["results"]) == list(MEMORY_VARIANTS)
        for n, r in res["results"].items():
            assert set(r["phases"]) == {"forward", "backward", "optimizer"}
            assert r["peak_bytes"] == max(p["peak"] for p in r["phases"].values()) > 0
            assert r["loss_equal_to_none"] is True, (name, n)
        after_fwd = {m: r["phases"]["forward"]["end"] for m, r in res["results"].items()}
        assert after_fwd["ours_recompute"] < after_fwd["none"]
        assert res["bound"]["lower_bound_bytes"] > res["bound"]["static_bytes"]
        assert len(res["targets"]) == 4
        assert f"[{name}]" in proc.stdout
    assert "vs save_on_cpu" in proc.stdout and "lower bound (estimate)" in proc.stdout and "legend:" in proc.stdout
