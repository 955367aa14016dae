"""The distributed examples run as their docstrings say (``torchrun --nproc_per_node=2
examples/<name>.py``, CPU/gloo here), each with one or two steps, and print what they promise:
every rank's loss and peak memory, bytes offloaded, the pipeline's bound. No time limits (only a
guard against a hung process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_GUARD_S = 60 * 60


def _torchrun(name: str, *args: str) -> str:
    env = dict(os.environ)
    # this checkout's package, whatever an installed one says
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            os.path.join(ROOT, "examples", f"{name}.py"), *args]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _losses(out: str) -> dict:
    """``{(rank, step): loss}`` from the examples' per-step lines."""
    return {(int(r), int(s)): float(v) for r, s, v in re.findall(r"\[rank (\d)\] step (\d+) loss ([\d.]+)", out)}


def test_ddp_and_fsdp2_examples_swap_and_train_the_same_model_alike():
    ddp, fsdp2 = _torchrun("ddp_swap", "--steps", "2"), _torchrun("fsdp2_swap", "--steps", "2")
    assert len(_losses(ddp)) == 4 and _losses(ddp) == _losses(fsdp2), (ddp, fsdp2)
    for out in (ddp, fsdp2):
        offloaded = [float(v) for v in re.findall(r"offloaded so far ([\d.]+) MiB", out)]
        assert len(offloaded) == 4 and min(offloaded) > 0, out
    assert fsdp2.count("kept on the device, never offloaded") == 2, fsdp2


def test_pipeline_example_keeps_its_swapped_microbatches_within_the_bound():
    out = _torchrun("pipeline_swap", "--steps", "1")
    assert re.search(r"\[rank 1\] step 0 loss [\d.]+", out), out  # the last stage has the loss
    bounds = re.findall(r"= (\d) of 4 microbatches \(bound: prefetch \+ 1 = (\d)\)", out)
    assert len(bounds) == 2 and all(int(peak) <= int(bound) for peak, bound in bounds), out
