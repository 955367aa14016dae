"""One mode of the bench trained in a process of its own: ``worker_result`` trains it in this process,
``run_mode`` in a worker process forked from a warm server (so that every mode's peak is measured
from a clean process, without every process paying torch's import)."""

from __future__ import annotations

import argparse
import copy
import gc
import json
import multiprocessing
import os
import time
import traceback
from typing import Any, Dict, List

import torch

from hyper_parallel.bench import report
from hyper_parallel.bench.harness import Variant, median, optimizer_for, train_step
from hyper_parallel.bench.model import GPT, GPTConfig, make_batch, train_steps
from hyper_parallel.bench.modes import apply_mode
from hyper_parallel.bench.trace import write_trace
from hyper_parallel.core.activation_checkpoint import MemoryPlan, SwapManager, plan_memory
from hyper_parallel.tools.memory import MemoryMeter

__all__ = ["worker_result", "run_mode", "swap_threshold", "PLAN_PREFIX", "PLAN_RANGE"]

#: A mode trains a memory plan for this many bytes (``plan@BYTES``), or reports the budgets worth planning
PLAN_PREFIX = "plan@"
PLAN_RANGE = "plan-range"


def swap_threshold(args) -> int:
    """``--swap-threshold-bytes``, default the bytes of one ``(batch, heads, seq, seq)`` attention matrix."""
    if args.swap_threshold_bytes is not None:
        return int(args.swap_threshold_bytes)
    return args.batch * args.heads * args.seq * args.seq * (4 if args.dtype == "float32" else 2)


def worker_result(args) -> Dict[str, Any]:
    """Train one mode (or a memory plan: ``plan@BYTES``; ``plan-range`` only reports the budgets worth planning) in this
    process; its result."""
    mode = args.worker
    planned = mode == PLAN_RANGE or mode.startswith(PLAN_PREFIX)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq,
                    dropout=args.dropout)
    model = GPT(cfg, seed=args.seed).to(device=device, dtype=getattr(torch, args.dtype))
    SwapManager().reset()
    result: Dict[str, Any] = {"mode": mode}
    if planned:  # the planned step is a whole training step of the harness, on a copy
        copied = copy.deepcopy(model)
        v = Variant(mode, "none", copied, optimizer_for(copied, args.lr))
        batch = make_batch(cfg, args.batch, args.seed, device=device)
        t0 = time.perf_counter()
        plan = plan_memory(v.model.layers, lambda: train_step(v, batch, args.seed, device),
                           "1TiB" if mode == PLAN_RANGE else int(mode[len(PLAN_PREFIX):]))
        result.update(min_budget_bytes=plan.min_budget_bytes, reference_peak_bytes=plan.reference_peak_bytes,
                      planning_s=time.perf_counter() - t0)
        if mode == PLAN_RANGE:
            return result
        result.update(budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                      predicted_step_s=plan.predicted_step_s, lower_bound_step_s=plan.lower_bound_step_s,
                      report=plan.report(), options=[c.option.name() for c in plan.choices])
        text = plan.to_json()
        del plan, v, copied
        gc.collect()  # (the planned copy must not count in this process's memory)
        SwapManager().reset()
        MemoryPlan.from_json(text, model.layers).apply()
    else:
        apply_mode(model, mode, swap_wrapper=args.swap_wrapper, swap_threshold_bytes=swap_threshold(args))
    meters: List[Any] = []

    def make_meter(model_, optimizer):
        meters.append(MemoryMeter(device, track=[model_, optimizer]))
        return meters[-1]

    times: List[float] = []
    losses = train_steps(model, args.steps, args.batch, args.lr, args.seed, device, meter=make_meter, times=times)
    stats = SwapManager().stats()
    if args.trace:  # one extra step, after the measured ones: results and stats above are unaffected
        write_trace(lambda: train_steps(model, 1, args.batch, args.lr, args.seed + args.steps, device),
                    os.path.join(args.trace, f"{mode}.json"), device=device)
    result.update(peak_bytes=int(meters[0].peak_bytes), offloaded_bytes=int(stats["offloaded_bytes"]),
                  step_time_s=median(times) or 0.0, step_times_s=times, losses=losses, stats=stats,
                  process_cpu_s=time.process_time())
    return json.loads(json.dumps(result, default=report.json_value))  # (plain values: it crosses processes)


def _worker(args: argparse.Namespace, conn: Any) -> None:
    """A worker process's body: the result of ``args.worker``, or the error that stopped it, sent down ``conn``."""
    try:
        conn.send(("result", worker_result(args)))
    except BaseException:  # noqa: BLE001  (the parent reports it, with the worker's traceback)
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_mode(args, mode: str) -> Dict[str, Any]:
    """Run ``mode`` (the options ``args`` were checked) in a worker process of its own, so that its peak is measured from a
    clean process; return its result dict or an error dict.

    Workers fork from a server process that has imported torch and ``torch._dynamo`` and nothing else (an
    optimizer's first step imports the latter: 3-4 s of every fresh process on a 2-core CPU). The server is started
    afresh and never touches an accelerator, so a worker may initialise one."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch._dynamo"])
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_worker, args=(argparse.Namespace(**{**vars(args), "worker": mode}), send),
                             name=f"hyper_parallel.bench[{mode}]")
    t0 = time.perf_counter()
    worker.start()
    send.close()  # (the worker holds the other end: a worker that dies closes it)
    timed_out, message = not receive.poll(args.timeout), None
    if not timed_out:
        try:
            message = receive.recv()
        except EOFError:  # (it died before sending anything)
            pass
    if timed_out:
        worker.kill()
    worker.join()
    wall = time.perf_counter() - t0
    if message is None:
        reason = f"timed out after {args.timeout:g}s" if timed_out else f"exit status {worker.exitcode} without a result"
        return {"mode": mode, "error": reason, "returncode": worker.exitcode, "stderr": "", "wall_s": wall}
    kind, value = message
    if kind == "error":
        last = value.strip().splitlines()[-1]
        return {"mode": mode, "error": last, "returncode": worker.exitcode, "stderr": value, "wall_s": wall}
    return {**value, "wall_s": wall}
