"""Train the test GPT for a few steps in one mode and print a JSON summary (one mode per process,
as the RFC asks: the modes must not share dropout-kernel state, swap groups or allocator state).

    python tests_mindspore/mode_runner.py MODE [--swap-wrapper] [--steps N] [--layers N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _msboot  # noqa: E402

_msboot.install()

import mindspore as ms  # noqa: E402

import ms_model  # noqa: E402
from hyper_parallel.core.activation_checkpoint import SwapManager  # noqa: E402


def _digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(arrays[name].tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("--swap-wrapper", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threshold", type=int, default=None)
    a = ap.parse_args()
    cfg = dict(layers=a.layers, dim=a.dim, seq=a.seq)
    if a.swap_wrapper:
        model = ms_model.build(swap_wrapper_mode=a.mode, swap_threshold_bytes=a.threshold, **cfg)
    else:
        model = ms_model.build(a.mode, **cfg)
    target = ms.get_context("device_target")
    if target != "CPU":
        ms.runtime.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses, grads = ms_model.train(model, steps=a.steps, batch=a.batch)
    seconds = time.perf_counter() - t0
    params = {p.name: p.asnumpy() for p in model.trainable_params()}
    stats = SwapManager().stats()
    stats.pop("groups", None)
    out = {
        "mode": a.mode,
        "swap_wrapper": a.swap_wrapper,
        "device_target": target,
        "losses": [float(x) for x in losses],
        "loss_hex": [float(x).hex() for x in losses],
        "grad_digest": _digest(grads),
        "param_digest": _digest(params),
        "param_names": sorted(params),
        # MindSpore's allocator statistics; on CPU they are always 0 (documented by MindSpore)
        "peak_device_bytes": int(ms.runtime.max_memory_allocated()) if target != "CPU" else None,
        "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "seconds": seconds,
        "swap_stats": stats,
    }
    print("HP_RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
