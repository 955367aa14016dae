"""Two-process (gloo, CPU) scenarios for ``tests/test_distributed.py``.

Starting two Python processes that import torch and join a gloo group costs several seconds on a
2-core machine, so the test module starts the pair once (:func:`run_scenarios`) and runs every
selected scenario in it, one after the other; each scenario returns a JSON-able dict per rank and
the tests assert on those. A scenario that raises is reported with its traceback; the others
still run.

Every scenario compares against a single process that trains the unwrapped model on the whole
batch (each rank computes that reference itself: the model is tiny).
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
LR = 0.1
ATOL = 1e-5


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, names: List[str], out_dir: str,
           table: Optional[Dict[str, Callable[[int, int], Dict[str, Any]]]] = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=45))
    from hyper_parallel.core.activation_checkpoint import SwapManager

    results: Dict[str, Any] = {}
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        for name in names:
            t0 = time.perf_counter()
            SwapManager().reset()
            try:
                res = dict((table or SCENARIOS)[name](rank, world))
                res["ok"] = True
            except Exception:  # noqa: BLE001  (reported to the test)
                res = {"ok": False, "error": traceback.format_exc()}
            res["seconds"] = round(time.perf_counter() - t0, 3)
            results[name] = res
            with open(path, "w") as f:  # partial results survive a hang in a later scenario
                json.dump(results, f)
            dist.barrier()
    finally:
        SwapManager().reset()
        dist.destroy_process_group()


def run_scenarios(names: Sequence[str], world: int = 2, timeout: float = 240.0,
                  table: Optional[Dict[str, Callable[[int, int], Dict[str, Any]]]] = None) -> List[Dict[str, Any]]:
    """Run ``names`` in ``world`` spawned processes; returns one ``{scenario: result}`` per rank.
    ``table``: where the scenarios are found (default: this module's ``SCENARIOS``); its
    functions must be module-level ones of an importable module (they are pickled by name)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), list(names), out_dir, table),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        error: Optional[str] = None
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    error = f"distributed scenarios timed out after {timeout:.0f} s"
                    break
        except Exception as exc:  # noqa: BLE001  a worker died outside a scenario
            error = f"worker failed: {exc}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        out = []
        for rank in range(world):
            path = os.path.join(out_dir, f"rank{rank}.json")
            res = json.load(open(path)) if os.path.exists(path) else {}
            for name in names:
                res.setdefault(name, {"ok": False, "error": error or "no result"})
            out.append(res)
        return out


# ----------------------------------------------------------------------------------------------
# models, data, reference
# ----------------------------------------------------------------------------------------------
def _api():
    from hyper_parallel.core import activation_checkpoint as ac
    return ac


def swap_matmuls(ctx, op, *args, **kwargs):
    ac = _api()
    aten = torch.ops.aten
    if op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        return ac.CheckpointPolicy.MUST_SWAP
    return ac.CheckpointPolicy.PREFER_RECOMPUTE


def gpt_config():
    from hyper_parallel.bench.model import GPTConfig
    # no dropout: the ranks' RNG streams differ from the single-process reference
    return GPTConfig(vocab=64, dim=32, heads=2, layers=3, seq=16, dropout=0.0)


def gpt_batch(step: int, global_batch: int = 4):
    from hyper_parallel.bench.model import make_batch
    return make_batch(gpt_config(), global_batch, seed=100 + step)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def wrap_gpt_layers(model: nn.Module, chain: bool = True) -> None:
    """Even layers: checkpoint with MUST_SWAP matmuls and swapped inputs; odd layers: swap_wrapper;
    consecutive layers chained with set_forward_prefetch_layer."""
    ac = _api()
    for i, layer in enumerate(model.layers):
        if i % 2 == 0:
            ac.checkpoint_wrapper(layer, policy_fn=swap_matmuls, swap_inputs=True)
        else:
            ac.swap_wrapper(layer)
    if chain:
        from hyper_parallel.bench.modes import chain_layers
        chain_layers(model.layers)


def gpt_reference(steps: Sequence[int]) -> Dict[str, torch.Tensor]:
    """The unwrapped model trained in one process on the whole batch of each step in ``steps``."""
    from hyper_parallel.bench.model import GPT
    model = GPT(gpt_config(), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in steps:
        x, y = gpt_batch(step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(state: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> float:
    assert set(state) == set(ref), (sorted(set(state) ^ set(ref)))
    return max(float((state[k].detach().float() - ref[k].float()).abs().max()) for k in ref)


def swap_summary() -> Dict[str, Any]:
    from hyper_parallel.core.activation_checkpoint import SwapManager
    from hyper_parallel.core.microbatch_schedule import resident_swap_bytes
    mgr = SwapManager()
    st = mgr.stats()
    return {"offloaded_bytes": st["offloaded_bytes"], "loaded_bytes": st["loaded_bytes"],
            "kept_bytes": st["kept_bytes"], "host_in_use_bytes": st["host_pool"]["in_use_bytes"],
            "resident_swap_bytes": resident_swap_bytes(mgr), "groups": mgr.group_names(),
            "current_group": mgr.get_current_group_name()}


def group_tensor_counts() -> Dict[str, int]:
    """Swap tensors still registered per group (0 everywhere = nothing of a step is alive)."""
    from hyper_parallel.core.activation_checkpoint import SwapManager
    mgr = SwapManager()
    return {n: len(mgr._groups[n]._tensors(*_all_states())) for n in mgr.group_names()}  # noqa: SLF001


def _all_states():
    from hyper_parallel.core.swap_tensor import TensorState
    return tuple(TensorState)


# ----------------------------------------------------------------------------------------------
# DDP / FSDP2
# ----------------------------------------------------------------------------------------------
def _train_gpt(module: nn.Module, params, rank: int, world: int, steps: Sequence[int]) -> List[float]:
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in steps:
        x, y = (shard(t, rank, world) for t in gpt_batch(step))
        loss = module(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def scenario_ddp(rank: int, world: int) -> Dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hyper_parallel.bench.model import GPT
    model = GPT(gpt_config(), seed=0)
    wrap_gpt_layers(model)
    ddp = DDP(model)
    losses = _train_gpt(ddp, ddp.parameters(), rank, world, [0, 1])
    out = {"losses": losses, "max_diff": max_diff(model.state_dict(), gpt_reference([0, 1]))}
    out.update(swap_summary())
    return out


def _full_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}


def scenario_fsdp2(rank: int, world: int) -> Dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from hyper_parallel.bench.model import GPT
    model = GPT(gpt_config(), seed=0)
    wrap_gpt_layers(model)  # the supported order: wrap for checkpoint/swap first ...
    for layer in model.layers:  # ... then shard, per layer and at the root
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model)

    # Inside the step: after the forward (layers 0..n-2 offloaded by the chain), every unsharded
    # parameter (a view of FSDP's all-gather output) must be intact on the device.
    x, y = (shard(t, rank, world) for t in gpt_batch(0))
    loss = model(x, y)
    intact = all(p.untyped_storage().nbytes() > 0 and torch.isfinite(p).all()
                 for layer in model.layers for p in layer.parameters())
    summary_after_forward = swap_summary()
    loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses = [float(loss)] + _train_gpt(model, model.parameters(), rank, world, [1])
    out = {"losses": losses, "max_diff": max_diff(_full_state(model), gpt_reference([0, 1])),
           "params_intact_after_offload": bool(intact),
           "offloaded_after_forward": summary_after_forward["offloaded_bytes"]}
    out.update(swap_summary())
    return out


def scenario_wrong_order(rank: int, world: int) -> Dict[str, Any]:
    """Shard (or wrap in DDP) first, then wrap layers for checkpoint/swap."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hyper_parallel.bench.model import GPT
    ac = _api()
    out: Dict[str, Any] = {}
    # FSDP2: fully_shard first
    model = GPT(gpt_config(), seed=0)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    try:
        wrap_gpt_layers(model)
        losses = _train_gpt(model, model.parameters(), rank, world, [0, 1])
        out["fsdp2"] = {"ok": True, "losses": losses,
                        "max_diff": max_diff(_full_state(model), gpt_reference([0, 1])),
                        "offloaded_bytes": ac.SwapManager().stats()["offloaded_bytes"]}
    except Exception as exc:  # noqa: BLE001
        out["fsdp2"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    ac.SwapManager().reset()
    # A selective checkpoint whose region contains fully_shard units (here: the root, wrapped
    # after its layers were sharded): FSDP's hooks of the inner units run inside the region, and
    # differently in forward and in recompute. This cannot work; it must fail with a clear message.
    model = GPT(gpt_config(), seed=0)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    try:
        ac.checkpoint_wrapper(model, policy_fn=swap_matmuls)
        _train_gpt(model, model.parameters(), rank, world, [0])
        out["fsdp2_root_selective"] = {"ok": True}
    except Exception as exc:  # noqa: BLE001
        out["fsdp2_root_selective"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    ac.SwapManager().reset()
    # DDP: DDP first, then wrap the layers of the wrapped module
    model = GPT(gpt_config(), seed=0)
    ddp = DDP(model)
    try:
        wrap_gpt_layers(ddp.module)
        losses = _train_gpt(ddp, ddp.parameters(), rank, world, [0, 1])
        out["ddp"] = {"ok": True, "losses": losses,
                      "max_diff": max_diff(model.state_dict(), gpt_reference([0, 1])),
                      "offloaded_bytes": ac.SwapManager().stats()["offloaded_bytes"]}
    except Exception as exc:  # noqa: BLE001
        out["ddp"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return out


class _Fault(nn.Module):
    """Raises in forward when armed and the call counter reaches ``at``."""

    def __init__(self) -> None:
        super().__init__()
        self.at: Optional[int] = None
        self.calls = 0

    def arm(self, at: Optional[int]) -> None:
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            if self.at is not None and self.calls == self.at:
                raise RuntimeError("injected fault")
            self.calls += 1
        return x


def scenario_fault_ddp(rank: int, world: int) -> Dict[str, Any]:
    """Rank 0 raises inside layer 1's forward in steps 1 and 2; rank 1 finishes its forward. Both
    learn it through a collective and abandon the step; the step is then retried. Step 1 recovers
    by only dropping the step's tensors; step 2 also calls SwapManager().reset() and re-declares
    the layer chain. Afterwards the parameters equal a clean 3-step run."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hyper_parallel.bench.model import GPT
    ac = _api()
    model = GPT(gpt_config(), seed=0)
    fault = _Fault()
    model.layers[1].attn.qkv.register_forward_pre_hook(lambda m, a: (fault(a[0]),))
    wrap_gpt_layers(model)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    out: Dict[str, Any] = {"after_abort": []}
    for step in range(3):
        for attempt in range(2):
            fault.arm(0 if (rank == 0 and attempt == 0 and step in (1, 2)) else None)
            x, y = (shard(t, rank, world) for t in gpt_batch(step))
            failed = torch.zeros(1)
            loss = None
            try:
                loss = ddp(x, y)
            except RuntimeError as exc:
                if "injected fault" not in str(exc):
                    raise
                failed += 1
            dist.all_reduce(failed)
            if failed.item() == 0:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                break
            # abandon the step on every rank
            del loss
            opt.zero_grad(set_to_none=True)
            if step == 2:
                ac.SwapManager().reset()
                from hyper_parallel.bench.modes import chain_layers
                chain_layers(model.layers)
            out["after_abort"].append({"step": step, "counts": group_tensor_counts(), **swap_summary()})
    out["max_diff"] = max_diff(model.state_dict(), gpt_reference([0, 1, 2]))
    return out


# ----------------------------------------------------------------------------------------------
# pipeline parallelism
# ----------------------------------------------------------------------------------------------
DIM, HIDDEN, LAYERS_PER_STAGE, N_MB, BATCH = 32, 128, 2, 4, 8


class MLPBlock(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def pipeline_model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[MLPBlock() for _ in range(stages * LAYERS_PER_STAGE)])


def pipeline_batch(step: int):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(BATCH, 16, DIM, generator=g), torch.randn(BATCH, 16, DIM, generator=g)


def pipeline_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def pipeline_reference(stages: int, steps: Sequence[int]) -> nn.Sequential:
    model = pipeline_model(stages)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in steps:
        x, y = pipeline_batch(step)
        pipeline_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


class _Probe:
    """Samples the device-resident swapped bytes (all groups) at the end of every forward of the
    stage module and when the gradient of its output arrives (the start of its backward): the
    two points where a stage holds the most activations."""

    def __init__(self, module: nn.Module) -> None:
        self.samples: List[int] = []
        self.enabled = False
        module.register_forward_hook(self._fwd)

    def _sample(self) -> None:
        from hyper_parallel.core.activation_checkpoint import SwapManager
        from hyper_parallel.core.microbatch_schedule import resident_swap_bytes
        if self.enabled:
            self.samples.append(resident_swap_bytes(SwapManager()))

    def _fwd(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        self._sample()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g: self._sample())


def _stage_module(rank: int, world: int, fault: Optional[nn.Module] = None) -> nn.Module:
    ac = _api()
    full = pipeline_model(world)
    blocks = list(full)[rank * LAYERS_PER_STAGE:(rank + 1) * LAYERS_PER_STAGE]
    for i, block in enumerate(blocks):
        if i % 2 == 0:
            ac.checkpoint_wrapper(block, policy_fn=swap_matmuls, swap_inputs=True)
        else:
            ac.swap_wrapper(block)
    mods = ([fault] if fault is not None else []) + blocks
    return nn.Sequential(*mods)


def _stage_state(submod: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in submod.state_dict().items()}


def _reference_state(rank: int, world: int, steps: Sequence[int], skip_first: int = 0) -> Dict[str, torch.Tensor]:
    ref = pipeline_reference(world, steps)
    blocks = list(ref)[rank * LAYERS_PER_STAGE:(rank + 1) * LAYERS_PER_STAGE]
    return {f"{i + skip_first}.{k}": v for i, b in enumerate(blocks) for k, v in b.state_dict().items()}


def _run_pipeline(rank: int, world: int, schedule_name: str, prefetch: Optional[int],
                  steps: int = 2) -> Dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from hyper_parallel.core.activation_checkpoint import SwapManager, pipeline_swap
    from hyper_parallel.tools.memory import MemoryMeter
    ac = _api()
    ac.SwapManager().reset()
    submod = _stage_module(rank, world)
    probe = _Probe(submod)
    stage = PipelineStage(submod, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = cls(stage, N_MB, loss_fn=pipeline_loss)
    if prefetch is not None:
        pipeline_swap(schedule, prefetch=prefetch, measure=True)
    opt = torch.optim.SGD(submod.parameters(), lr=LR)
    groups_after: List[List[str]] = []
    mb_samples: List[int] = []
    peak_mem = 0
    for step in range(steps):
        x, y = pipeline_batch(step)
        probe.enabled = step > 0  # step 0 includes the stage's metadata inference
        with MemoryMeter("cpu", track=[submod, opt], scan_gc=False) as meter:
            if rank == 0:
                schedule.step(x)
            else:
                losses: List[torch.Tensor] = []
                schedule.step(target=y, losses=losses)
        if step > 0:
            peak_mem = max(peak_mem, meter.peak_above_baseline)
        opt.step()
        opt.zero_grad(set_to_none=True)
        groups_after.append([n for n in SwapManager().group_names() if n.startswith("pp")])
    # bytes of one microbatch: a plain forward of one microbatch in one group
    mgr = SwapManager()
    mgr.set_current_group_name("probe.one_mb")
    one = submod(pipeline_batch(0)[0][:BATCH // N_MB].requires_grad_())
    from hyper_parallel.core.microbatch_schedule import resident_swap_bytes
    mb_bytes = resident_swap_bytes(mgr, "probe.one_mb")
    mgr.set_current_group_name(None)
    del one
    out: Dict[str, Any] = {
        "schedule": schedule_name, "prefetch": prefetch,
        "max_diff": max_diff(_stage_state(submod), _reference_state(rank, world, range(steps))),
        "peak_resident_swap_bytes": max(probe.samples) if probe.samples else 0,
        "microbatch_swap_bytes": mb_bytes,
        "peak_memory_above_baseline": peak_mem,
        "groups_after_step": groups_after,
        "offloaded_bytes": mgr.stats()["offloaded_bytes"],
        "host_in_use_bytes": mgr.stats()["host_pool"]["in_use_bytes"],
    }
    if prefetch is not None:
        sched = schedule.hp_swap_schedules[rank]
        out.update(sched_peak_bytes=sched.peak_resident_bytes,
                   sched_peak_microbatches=sched.peak_resident_microbatches,
                   offloads=sched.offloads, loads=sched.loads, cancelled=sched.cancelled,
                   steps=sched.steps)
    return out


PIPELINE_CONFIGS = [("gpipe", None), ("gpipe", 1), ("gpipe", 2), ("1f1b", None), ("1f1b", 0), ("1f1b", 1)]


def scenario_pipeline(rank: int, world: int) -> Dict[str, Any]:
    return {f"{s}-{p}": _run_pipeline(rank, world, s, p) for s, p in PIPELINE_CONFIGS}


def scenario_fault_pipeline(rank: int, world: int) -> Dict[str, Any]:
    """GPipe, prefetch=1. In step 1, stage 0 raises in the forward of microbatch 2 and stage 1 in
    the forward of microbatch 1 (after receiving it): every activation stage 0 sent is received,
    and both agree through a barrier before the exceptions (and the pending send handles their
    tracebacks hold) are dropped. The step is retried and training continues; the parameters
    equal a clean run."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from hyper_parallel.core.activation_checkpoint import SwapManager, pipeline_swap
    fault = _Fault()
    submod = _stage_module(rank, world, fault)
    stage = PipelineStage(submod, rank, world, torch.device("cpu"))
    schedule = pipeline_swap(ScheduleGPipe(stage, N_MB, loss_fn=pipeline_loss), prefetch=1)
    opt = torch.optim.SGD(submod.parameters(), lr=LR)
    out: Dict[str, Any] = {"aborts": []}
    for step in range(3):
        for attempt in range(2):
            fault.arm((2 if rank == 0 else 1) if (step == 1 and attempt == 0) else None)
            x, y = pipeline_batch(step)
            try:
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y)
                aborted = False
            except RuntimeError as exc:
                if "injected fault" not in repr(exc.__cause__) + str(exc):
                    raise
                # Agree to abandon the step *while the exception is alive*: its traceback keeps
                # the schedule's pending send handles alive; dropping them before the peer has
                # received would cancel a send that the peer's posted recv then takes from the
                # retry (a desynchronised pipeline).
                dist.barrier()
                aborted = True
            if aborted:  # (outside the except block: its traceback no longer holds the frames)
                opt.zero_grad(set_to_none=True)
                sched = schedule.hp_swap_schedules[rank]
                out["aborts"].append({"step": step, "sched_aborts": sched.aborts,
                                      "internal_losses": len(getattr(schedule, "_internal_losses", [])),
                                      "fwd_cache": len(stage.fwd_cache), "counts": group_tensor_counts(),
                                      **swap_summary()})
                continue
            opt.step()
            opt.zero_grad(set_to_none=True)
            break
    out["max_diff"] = max_diff(_stage_state(submod), _reference_state(rank, world, range(3), skip_first=1))
    out["groups_after"] = [n for n in SwapManager().group_names() if n.startswith("pp")]
    return out


# ----------------------------------------------------------------------------------------------
# zero-bubble schedules: the split backward recomputes once
# ----------------------------------------------------------------------------------------------
ZB_STAGES, ZB_MB = 4, 4


def zb_hidden(stage: int) -> int:
    """Each stage's hidden size differs, so an op count attributes every ``gelu`` to its stage."""
    return 48 + 16 * stage


class ZBBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, hidden)
        self.fc2 = nn.Linear(hidden, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def zb_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[ZBBlock(zb_hidden(s)) for s in range(ZB_STAGES)])


def zb_reference(steps: Sequence[int]) -> nn.Sequential:
    model = zb_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in steps:
        x, y = pipeline_batch(step)
        pipeline_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


class OpCounts(TorchDispatchMode):
    """Counts the ATen ops that run below it, under ``key(op, args)`` (ops keyed ``None`` are not
    counted): recomputation is read from the ops that ran, not from the library's counters."""

    def __init__(self, key: Callable[[Any, Tuple[Any, ...]], Any]) -> None:
        super().__init__()
        self.key = key
        self.counts: Dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        k = self.key(func, args)
        if k is not None:
            self.counts[k] = self.counts.get(k, 0) + 1
        return func(*args, **(kwargs or {}))


def _gelu_by_hidden(func: Any, args: Tuple[Any, ...]) -> Optional[int]:
    """``aten.gelu`` (forward and recomputation only: backward runs ``gelu_backward``), keyed by
    its input's hidden size, i.e. by stage."""
    return args[0].shape[-1] if func is torch.ops.aten.gelu.default else None


def _zb_stage_indices(kind: str, rank: int, world: int) -> List[int]:
    if kind == "zbv":
        return [rank, 2 * world - 1 - rank]  # the V: rank 0 holds the first and the last stage
    return [rank + world * i for i in range(ZB_STAGES // world)]  # interleaved loop


def _run_zero_bubble(rank: int, world: int, kind: str, wrap: Optional[str], adapter: Optional[str],
                     steps: int = 2) -> Dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
    from hyper_parallel.tools.memory import MemoryMeter
    ac = _api()
    ac.SwapManager().reset()
    model = zb_model()
    indices = _zb_stage_indices(kind, rank, world)
    mods = [model[i] for i in indices]
    for block in mods:
        if wrap == "whole":
            ac.checkpoint_wrapper(block)
        elif wrap == "selective_swap":  # MUST_SWAP matmuls, swapped inputs
            ac.checkpoint_wrapper(block, policy_fn=swap_matmuls, swap_inputs=True)
        elif wrap == "exclude":  # the norm kept, the MLP recomputed
            ac.checkpoint_exclude_wrapper(block.norm)
            ac.checkpoint_wrapper(block, policy_fn=[torch.ops.aten.addmm.default])
    stages = [PipelineStage(m, i, ZB_STAGES, torch.device("cpu")) for m, i in zip(mods, indices)]
    cls = {"zbv": ScheduleZBVZeroBubble, "izb": ScheduleInterleavedZeroBubble}[kind]
    schedule = cls(stages, ZB_MB, loss_fn=pipeline_loss)
    if adapter == "recompute":
        ac.pipeline_recompute(schedule)
    elif adapter == "swap":
        ac.pipeline_swap(schedule, prefetch=1)
    twice = None
    if adapter is not None:  # the two adapters are exclusive (pipeline_swap includes the sessions)
        try:
            (ac.pipeline_swap if adapter == "recompute" else ac.pipeline_recompute)(schedule)
        except ValueError as exc:
            twice = str(exc)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    gelu_per_step: List[Dict[int, int]] = []
    live_after: List[int] = []
    for step in range(steps):
        x, y = pipeline_batch(step)
        counter = OpCounts(_gelu_by_hidden)
        with MemoryMeter("cpu", track=[mods, opt], scan_gc=False) as meter:
            with counter:
                kwargs: Dict[str, Any] = {}
                if 0 in indices:
                    kwargs["x"] = x
                if ZB_STAGES - 1 in indices:
                    kwargs.update(target=y, losses=[])
                args = (kwargs.pop("x"),) if "x" in kwargs else ()
                out = schedule.step(*args, **kwargs)
            del out, kwargs, args
            gc.collect()
        live_after.append(meter.current_bytes - meter.baseline_bytes)
        gelu_per_step.append({str(i): counter.counts.get(zb_hidden(i), 0) for i in indices})
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref = zb_reference(range(steps))
    ref_state = {f"{i}.{k}": v for i in indices for k, v in ref[i].state_dict().items()}
    state = {f"{i}.{k}": v for i, m in zip(indices, mods) for k, v in m.state_dict().items()}
    mgr = ac.SwapManager()
    return {
        "kind": kind, "wrap": wrap, "adapter": adapter, "stages": indices, "second_adapter_error": twice,
        "max_diff": max_diff(state, ref_state),
        "gelu_per_step": gelu_per_step,  # per stage index: forward + recomputations
        "live_bytes_after_step": live_after,
        "open_sessions": sum(len(getattr(st, "_hp_sessions", {})) for st in stages),
        "groups_after": [n for n in mgr.group_names() if n.startswith("pp")],
        "host_in_use_bytes": mgr.stats()["host_pool"]["in_use_bytes"],
        "offloaded_bytes": mgr.stats()["offloaded_bytes"],
    }


ZB_CONFIGS = [  # (schedule, wrapping, adapter)
    ("izb", None, None),                  # not checkpointed: the memory baseline
    ("izb", "whole", "recompute"),
    ("izb", "selective_swap", "swap"),
    ("zbv", "whole", "recompute"),
    ("zbv", "selective_swap", "swap"),
    ("zbv", "exclude", "recompute"),
]


def scenario_zero_bubble(rank: int, world: int) -> Dict[str, Any]:
    return {f"{k}-{w}-{a}": _run_zero_bubble(rank, world, k, w, a) for k, w, a in ZB_CONFIGS}


# ----------------------------------------------------------------------------------------------
# tensor parallelism with functional collectives: recomputation never re-runs them
# ----------------------------------------------------------------------------------------------
def _tp_functions():
    c10d = torch.ops._c10d_functional

    class CopyToTP(torch.autograd.Function):
        """Megatron's f: identity forward, all-reduce of the gradient in backward."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, grad):
            return c10d.wait_tensor(c10d.all_reduce(grad.contiguous(), "sum", ctx.group)), None

    class ReduceFromTP(torch.autograd.Function):
        """Megatron's g: all-reduce forward, identity backward."""

        @staticmethod
        def forward(ctx, x, group):
            return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return CopyToTP, ReduceFromTP


class TPLayers(nn.Module):
    """The two ``MLPBlock`` s of ``pipeline_model(1)`` split across the ranks, Megatron style
    (column-parallel fc1, row-parallel fc2), as one module: checkpointed as one region, the first
    block's all-reduce feeds the second block, whose ops save tensors for backward, so a plain
    recomputation has to re-run that all-reduce."""

    def __init__(self, full: nn.Sequential, rank: int, world: int) -> None:
        super().__init__()
        part = HIDDEN // world
        rows = slice(rank * part, (rank + 1) * part)
        self.norms = nn.ModuleList(b.norm for b in full)
        self.w1 = nn.ParameterList(nn.Parameter(b.fc1.weight.detach()[rows].clone()) for b in full)
        self.b1 = nn.ParameterList(nn.Parameter(b.fc1.bias.detach()[rows].clone()) for b in full)
        self.w2 = nn.ParameterList(nn.Parameter(b.fc2.weight.detach()[:, rows].clone()) for b in full)
        self.b2 = nn.ParameterList(b.fc2.bias for b in full)
        self.group = dist.group.WORLD.group_name
        self.copy_to, self.reduce_from = _tp_functions()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, norm in enumerate(self.norms):
            h = self.copy_to.apply(norm(x), self.group)
            h = F.gelu(F.linear(h, self.w1[i], self.b1[i]))
            x = x + self.reduce_from.apply(F.linear(h, self.w2[i]), self.group) + self.b2[i]
        return x


def _run_tp(rank: int, world: int, mode: str) -> Dict[str, Any]:
    ac = _api()
    c10d = torch.ops._c10d_functional
    names = {c10d.all_reduce.default: "all_reduce", c10d.wait_tensor.default: "wait_tensor",
             torch.ops.aten.gelu.default: "gelu"}

    def key(func: Any, args: Tuple[Any, ...]) -> Optional[str]:
        return names.get(func)

    full = pipeline_model(1)  # 2 MLPBlocks
    layers = TPLayers(full, rank, world)
    if mode == "prefer_recompute":
        ac.checkpoint_wrapper(layers, policy_fn=lambda ctx, op, *a, **k: ac.CheckpointPolicy.PREFER_RECOMPUTE)
    elif mode == "keep_collectives":
        ac.checkpoint_wrapper(layers, policy_fn=ac.keep_collectives())
    elif mode == "whole":
        ac.checkpoint_wrapper(layers)
    x, y = pipeline_batch(0)
    x.requires_grad_()
    fwd, bwd = OpCounts(key), OpCounts(key)
    with fwd:
        loss = pipeline_loss(layers(x), y)
    with bwd:
        loss.backward()
    grads = {n: p.grad for n, p in layers.named_parameters()}
    # single process, whole model: the same gradients (summed in another order)
    pipeline_loss(full(x.detach()), y).backward()
    part = HIDDEN // world
    rows = slice(rank * part, (rank + 1) * part)
    ref = {}
    for i, b in enumerate(full):
        ref.update({f"norms.{i}.weight": b.norm.weight.grad, f"norms.{i}.bias": b.norm.bias.grad,
                    f"w1.{i}": b.fc1.weight.grad[rows], f"b1.{i}": b.fc1.bias.grad[rows],
                    f"w2.{i}": b.fc2.weight.grad[:, rows], f"b2.{i}": b.fc2.bias.grad})
    assert set(ref) == set(grads), (sorted(ref), sorted(grads))
    return {"forward": fwd.counts, "backward": bwd.counts,
            "grads": {k: v.tolist() for k, v in grads.items()},
            "max_diff_single_process": max((grads[k] - ref[k]).abs().max().item() for k in grads)}


def scenario_tp_collectives(rank: int, world: int) -> Dict[str, Any]:
    return {mode: _run_tp(rank, world, mode) for mode in ("plain", "prefer_recompute", "keep_collectives", "whole")}


SCENARIOS: Dict[str, Callable[[int, int], Dict[str, Any]]] = {
    "ddp": scenario_ddp,
    "fsdp2": scenario_fsdp2,
    "wrong_order": scenario_wrong_order,
    "fault_ddp": scenario_fault_ddp,
    "pipeline": scenario_pipeline,
    "fault_pipeline": scenario_fault_pipeline,
    "zero_bubble": scenario_zero_bubble,
    "tp_collectives": scenario_tp_collectives,
}


if __name__ == "__main__":  # PYTHONPATH=tests python -m support.dist_utils [scenario ...]: print the results
    chosen = sys.argv[1:] or list(SCENARIOS)
    t0 = time.perf_counter()
    print(json.dumps(run_scenarios(chosen), indent=1, default=str))
    print(f"{time.perf_counter() - t0:.1f} s")
