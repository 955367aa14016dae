"""Shared machinery of ``benchmarks/compare_peers.py``: the variants (PyTorch, torchtune and
hyper-parallel ways to cut activation memory, all on the same GPT), one training step, the memory
meter around it, byte counters, the copy-engine probe and the plots.

Everything runs in one process: every variant gets its own copy of the same initial model and
its own optimizer, and the rounds are interleaved, so machine noise hits all variants alike.

How memory is counted (see docs/benchmarks.md, "What the memory column means"):

* on an accelerator, the caching allocator's counters: the peak of allocated device bytes during
  one training step, minus what was allocated before it, plus the variant's own parameters and
  buffers (other variants' models live in the same process and are not counted);
* on CPU, ``MemoryMeter`` counts live CPU storages. Host copies are CPU storages too, so to make
  the CPU numbers a model of what a device would hold, every offloading variant's host copies are
  counted as host memory (ours via ``mark_host`` in the library; ``save_on_cpu``'s through the
  harness, which also makes the copy that ``tensor.cpu()`` skips on a CPU tensor) and every reload
  as a new device allocation. Timings on CPU say nothing about copy engines.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint as torch_ckpt
from torch import nn

from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
from hyper_parallel.bench.modes import MATMUL_OPS, chain_layers, save_matmuls, swap_matmuls
from hyper_parallel.core.activation_checkpoint import SwapManager, checkpoint_wrapper, swap_wrapper
from hyper_parallel.tools.memory import MemoryMeter, is_host_storage, mark_host

MiB = 1024 * 1024

# --------------------------------------------------------------------------- variants

#: name -> (who, one-line description). Order = table order.
VARIANTS: Dict[str, Tuple[str, str]] = {
    "none": ("baseline", "no checkpointing"),
    "torch_ckpt": ("peer", "torch.utils.checkpoint (non-reentrant) per layer"),
    "torch_sac": ("peer", "PyTorch selective checkpoint per layer: save mm/addmm/bmm, recompute the rest"),
    "save_on_cpu": ("peer", "torch.autograd.graph.save_on_cpu per layer (pin_memory on accelerators)"),
    "torchtune_offload": ("peer", "torchtune OffloadActivations around each layer (streams, pinned)"),
    "torchtune_offload_ckpt": ("peer", "torchtune OffloadActivations + torch.utils.checkpoint per layer "
                                       "(torchtune's recommended pairing: offloads the checkpoint inputs)"),
    "ours_recompute": ("ours", "checkpoint_wrapper(layer): whole-layer recompute"),
    "ours_save": ("ours", "checkpoint_wrapper(layer, policy_fn=save_matmuls)"),
    "ours_swap_wrapper": ("ours", "swap_wrapper(layer), layers chained: every saved tensor swapped"),
    "ours_ckpt_swap": ("ours", "checkpoint_wrapper(layer, policy_fn=swap_matmuls, swap_inputs=True), "
                               "layers chained: matmul outputs + inputs swapped, the rest recomputed"),
    "ours_recompute_swapin": ("ours", "checkpoint_wrapper(layer, swap_inputs=True), layers chained: "
                                      "whole-layer recompute, checkpoint inputs swapped"),
}
PEERS = [n for n, (who, _) in VARIANTS.items() if who == "peer"]
OURS = [n for n, (who, _) in VARIANTS.items() if who == "ours"]
#: Variants that move activations between device and host.
OFFLOADING = {"save_on_cpu", "torchtune_offload", "torchtune_offload_ckpt", "ours_swap_wrapper",
              "ours_ckpt_swap", "ours_recompute_swapin"}
#: Like-for-like peers of each of our variants (the same memory technique).
COUNTERPARTS: Dict[str, List[str]] = {
    "ours_recompute": ["torch_ckpt"],
    "ours_save": ["torch_sac"],
    "ours_swap_wrapper": ["save_on_cpu", "torchtune_offload"],
    "ours_ckpt_swap": ["save_on_cpu", "torchtune_offload", "torchtune_offload_ckpt"],
    "ours_recompute_swapin": ["torchtune_offload_ckpt", "torch_ckpt"],
}


def _torch_policy(ctx, op, *args, **kwargs):
    P = torch_ckpt.CheckpointPolicy
    return P.MUST_SAVE if op in MATMUL_OPS else P.PREFER_RECOMPUTE


class TorchCheckpointLayer(nn.Module):
    """PyTorch's own way: ``torch.utils.checkpoint.checkpoint`` around a layer."""

    def __init__(self, inner: nn.Module, selective: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.context_fn = (functools.partial(torch_ckpt.create_selective_checkpoint_contexts, _torch_policy)
                           if selective else torch_ckpt.noop_context_fn)

    def forward(self, x, *, mask):
        return torch_ckpt.checkpoint(self.inner, x, mask=mask, use_reentrant=False, context_fn=self.context_fn)


class HooksLayer(nn.Module):
    """Run a layer (optionally checkpointed) under a ``saved_tensors_hooks`` context."""

    def __init__(self, inner: nn.Module, hooks: Callable[[], Any], checkpointed: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.hooks = hooks
        self.checkpointed = checkpointed

    def forward(self, x, *, mask):
        with self.hooks():
            if self.checkpointed:
                return torch_ckpt.checkpoint(self.inner, x, mask=mask, use_reentrant=False)
            return self.inner(x, mask=mask)


@dataclass
class ByteCounter:
    d2h: int = 0
    h2d: int = 0


def count_hooks(hooks: Any, counter: ByteCounter, *, model_device_on_cpu: bool) -> Any:
    """Wrap the pack/unpack hooks of a ``save_on_cpu``-like ``saved_tensors_hooks`` instance whose
    packed value is ``(device, host_tensor)``: count the bytes moved, and on a CPU-only machine
    model the device<->host traffic (see the module docstring)."""
    pack, unpack = hooks.pack_hook, hooks.unpack_hook

    def pack_hook(t: torch.Tensor) -> Any:
        dev, host = pack(t)
        if model_device_on_cpu:
            if host.untyped_storage()._cdata == t.untyped_storage()._cdata:
                host = t.detach().clone()  # what tensor.cpu() would copy off a real device
            mark_host(host)
        counter.d2h += host.numel() * host.element_size()
        return dev, host

    def unpack_hook(packed: Any) -> torch.Tensor:
        out = unpack(packed)
        counter.h2d += out.numel() * out.element_size()
        if model_device_on_cpu and is_host_storage(out):
            out = out.clone()  # the reload is a new device tensor
        return out

    hooks.pack_hook, hooks.unpack_hook = pack_hook, unpack_hook
    return hooks


def count_torchtune_hooks(hooks: Any, counter: ByteCounter) -> Any:
    """Count the bytes torchtune's ``OffloadActivations`` moves (it tracks what it offloaded)."""
    pack, unpack = hooks.pack_hook, hooks.unpack_hook

    def pack_hook(t: torch.Tensor) -> Any:
        tid = pack(t)
        entry = hooks.tracker.get(tid)
        if entry is not None and entry[1]:
            counter.d2h += t.numel() * t.element_size()
        return tid

    def unpack_hook(tid: Any) -> torch.Tensor:
        entry = hooks.tracker.get(tid)
        stashed = getattr(hooks, "fwd_stash", {})
        if entry is not None and entry[1] and tid not in stashed:
            counter.h2d += entry[0].numel() * entry[0].element_size()
        return unpack(tid)

    hooks.pack_hook, hooks.unpack_hook = pack_hook, unpack_hook
    return hooks


def torchtune_offload_class(device: torch.device) -> Tuple[Optional[type], str]:
    """torchtune's ``OffloadActivations`` when it can run here, else ``(None, reason)``."""
    if device.type != "cuda":
        return None, (f"torchtune's OffloadActivations is CUDA-only (it calls torch.cuda.default_stream()); "
                      f"device is {device.type}")
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchtune.training import OffloadActivations
    except Exception as exc:  # ImportError, or torchtune/torchao version mismatches
        return None, (f"torchtune is not usable ({type(exc).__name__}: {exc}); "
                      "install the optional extra: pip install -e '.[peers]'")
    return OffloadActivations, ""


@dataclass
class Variant:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    counter: Optional[ByteCounter] = None  # peers that move bytes
    uses_manager: bool = False             # ours that move bytes (counted by SwapManager.stats())
    static_bytes: int = 0
    losses: List[float] = field(default_factory=list)
    times: List[float] = field(default_factory=list)
    peak_bytes: Optional[int] = None
    moved: Dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    trace_path: Optional[str] = None
    copy_engine: Optional[Dict[str, Any]] = None


def module_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def truncated_copy(model: GPT, layers: int) -> GPT:
    """A deep copy of ``model`` keeping only its first ``layers`` blocks (building a deep GPT is
    slow: its init draws every weight from a CPU generator, so a layer sweep builds the deepest
    model once and copies prefixes of it)."""
    full, cfg = model.layers, model.cfg
    model.layers = nn.ModuleList(list(full)[:layers])
    model.cfg = GPTConfig(**{**cfg.to_dict(), "layers": layers})
    try:
        return copy.deepcopy(model)
    finally:
        model.layers, model.cfg = full, cfg


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients of all trainable parameters (what a full backward allocates)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = p.untyped_storage()._cdata
        if p.requires_grad and key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def build_variant(name: str, base: nn.Module, device: torch.device, lr: float) -> Variant:
    """A fresh copy of ``base`` (already on ``device``) set up as variant ``name``.

    Raises ``RuntimeError`` with the reason when the variant cannot run here."""
    model = copy.deepcopy(base)
    layers = model.layers
    counter: Optional[ByteCounter] = None
    uses_manager = False
    on_cpu = device.type == "cpu"
    if name == "none":
        pass
    elif name in ("torch_ckpt", "torch_sac"):
        for i, layer in enumerate(layers):
            layers[i] = TorchCheckpointLayer(layer, selective=(name == "torch_sac"))
    elif name == "save_on_cpu":
        counter = ByteCounter()
        pin = not on_cpu  # nothing to pin without an accelerator
        factory = functools.partial(_save_on_cpu, pin, device.type, counter, on_cpu)
        for i, layer in enumerate(layers):
            layers[i] = HooksLayer(layer, factory)
    elif name in ("torchtune_offload", "torchtune_offload_ckpt"):
        cls, reason = torchtune_offload_class(device)
        if cls is None:
            raise RuntimeError(reason)
        counter = ByteCounter()
        hooks = count_torchtune_hooks(cls(use_pin_memory=True, use_streams=True), counter)
        for i, layer in enumerate(layers):
            layers[i] = HooksLayer(layer, lambda h=hooks: h, checkpointed=(name == "torchtune_offload_ckpt"))
    elif name == "ours_recompute":
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    elif name == "ours_save":
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, policy_fn=save_matmuls)
    elif name == "ours_swap_wrapper":
        for i, layer in enumerate(layers):
            layers[i] = swap_wrapper(layer)
        chain_layers(layers)
        uses_manager = True
    elif name == "ours_ckpt_swap":
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, policy_fn=swap_matmuls, swap_inputs=True)
        chain_layers(layers)
        uses_manager = True
    elif name == "ours_recompute_swapin":
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, swap_inputs=True)
        chain_layers(layers)
        uses_manager = True
    else:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    # SGD without momentum keeps no optimizer state: the memory column is params + grads +
    # activations, and the models of all variants fit side by side in one process.
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return Variant(name, model, opt, counter=counter, uses_manager=uses_manager,
                   static_bytes=module_bytes(model))


def _save_on_cpu(pin: bool, device_type: str, counter: ByteCounter, on_cpu: bool) -> Any:
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=pin, device_type=device_type if pin else "cuda")
    return count_hooks(hooks, counter, model_device_on_cpu=on_cpu)


# --------------------------------------------------------------------------- one step

def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _manager_bytes() -> Tuple[int, int]:
    s = SwapManager().stats()
    return int(s["offloaded_bytes"]), int(s["loaded_bytes"])


def train_step(v: Variant, batch: Tuple[torch.Tensor, torch.Tensor], seed: int,
               device: torch.device) -> Tuple[float, float, Dict[str, int]]:
    """One SGD step of variant ``v``: ``(loss, forward+backward seconds, bytes moved)``.

    The global RNG is seeded from ``seed`` first, so dropout is the same in every variant. The
    timed region is forward + backward (what the variants change); the optimizer step follows."""
    tokens, targets = batch
    torch.manual_seed(seed)
    v.optimizer.zero_grad(set_to_none=True)
    before_c = (v.counter.d2h, v.counter.h2d) if v.counter is not None else (0, 0)
    before_m = _manager_bytes() if v.uses_manager else (0, 0)
    sync(device)
    t0 = time.perf_counter()
    loss = v.model(tokens, targets)
    loss.backward()
    sync(device)
    dt = time.perf_counter() - t0
    v.optimizer.step()
    value = float(loss.detach().item())
    del loss
    moved = {"d2h": 0, "h2d": 0}
    if v.counter is not None:
        moved = {"d2h": v.counter.d2h - before_c[0], "h2d": v.counter.h2d - before_c[1]}
    elif v.uses_manager:
        after = _manager_bytes()
        moved = {"d2h": after[0] - before_m[0], "h2d": after[1] - before_m[1]}
    return value, dt, moved


def metered_step(v: Variant, batch, seed: int, device: torch.device) -> Tuple[float, int, Dict[str, int]]:
    """One step under ``MemoryMeter``: ``(loss, peak bytes, bytes moved)``; peak = own static bytes +
    the step's peak above what was allocated before it."""
    # Drop the previous step's gradients first: inside the meter they would count as baseline.
    v.optimizer.zero_grad(set_to_none=True)
    sync(device)
    with MemoryMeter(device, track=[v.model], scan_gc=False) as meter:
        loss, _, moved = train_step(v, batch, seed, device)
    return loss, v.static_bytes + max(0, meter.peak_above_baseline), moved


@dataclass
class RunResult:
    variants: Dict[str, Variant]
    skipped: Dict[str, str]
    errors: Dict[str, str]
    config: Dict[str, Any]


def run_variants(names: Sequence[str], cfg: GPTConfig, *, batch: int, device: torch.device,
                 dtype: torch.dtype, rounds: int, warmup: int, lr: float, seed: int,
                 trace_dir: Optional[str] = None, profile_copies: bool = False, trace_gz: bool = False,
                 base_model: Optional[nn.Module] = None, log: Callable[[str], None] = print) -> RunResult:
    """Build every variant from one base model and run them interleaved.

    Step order for every variant: ``warmup`` unmetered steps, one metered step (peak memory), then
    ``rounds`` timed steps, one per variant per round, the order reversed every other round. Every
    variant sees the same batches in the same order, so the loss sequences must agree. Optionally
    one more step per variant under ``torch.profiler`` (``trace_dir``: Chrome traces;
    ``profile_copies``: copy-engine figures from the device events).

    ``base_model``: the model to copy for every variant (moved to ``device`` / ``dtype`` in place;
    default a fresh ``GPT(cfg, seed)``); ``cfg`` then only shapes the batches."""
    from hyper_parallel.bench.trace import analyze_copies, write_trace

    base = (base_model if base_model is not None else GPT(cfg, seed=seed)).to(device=device, dtype=dtype)
    variants: Dict[str, Variant] = {}
    skipped: Dict[str, str] = {}
    errors: Dict[str, str] = {}
    for name in names:
        try:
            variants[name] = build_variant(name, base, device, lr)
        except Exception as exc:  # e.g. torchtune absent, or its constructor failing here
            skipped[name] = str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"
            log(f"skipping {name}: {skipped[name]}")
    del base
    total_steps = warmup + 1 + rounds + (1 if (trace_dir or profile_copies) else 0)
    batches = [make_batch(cfg, batch, seed + i, device=device) for i in range(total_steps)]
    order = list(variants)

    def guarded(name: str, fn: Callable[[], Any]) -> Any:
        if name in errors:
            return None
        try:
            return fn()
        except Exception as exc:  # one broken variant must not sink the comparison
            errors[name] = f"{type(exc).__name__}: {exc}"
            log(f"variant {name} failed: {errors[name]}")
            return None

    step = 0
    for _ in range(warmup):
        for name in order:
            v = variants[name]
            r = guarded(name, lambda v=v: train_step(v, batches[step], seed + step, device))
            if r is not None:
                v.losses.append(r[0])
        step += 1
    for name in order:  # the metered step
        v = variants[name]
        r = guarded(name, lambda v=v: metered_step(v, batches[step], seed + step, device))
        if r is not None:
            v.losses.append(r[0])
            v.peak_bytes = r[1]
            v.moved = r[2]
    step += 1
    for rnd in range(rounds):
        for name in (order if rnd % 2 == 0 else order[::-1]):
            v = variants[name]
            r = guarded(name, lambda v=v: train_step(v, batches[step], seed + step, device))
            if r is not None:
                v.losses.append(r[0])
                v.times.append(r[1])
        step += 1
    if trace_dir or profile_copies:
        folder = trace_dir or _tempdir()
        for name in order:
            v = variants[name]
            path = os.path.join(folder, f"{name}.json" + (".gz" if trace_gz and trace_dir else ""))
            losses: List[float] = []

            def one(v=v, losses=losses):
                losses.append(train_step(v, batches[step], seed + step, device)[0])

            if guarded(name, lambda: write_trace(one, path, device=device)) is None:
                continue
            v.losses.extend(losses)
            v.trace_path = path if trace_dir else None
            if profile_copies and name in OFFLOADING and device.type != "cpu":
                v.copy_engine = guarded(name, lambda: analyze_copies(path))
            if not trace_dir:
                os.unlink(path)
    for name in errors:
        variants.pop(name, None)
    return RunResult(variants, skipped, errors, {})


def _tempdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="hp_traces_")


# --------------------------------------------------------------------------- summaries

def summarize(v: Variant) -> Dict[str, Any]:
    med = statistics.median(v.times) if v.times else None
    return {
        "who": VARIANTS[v.name][0],
        "description": VARIANTS[v.name][1],
        "peak_bytes": v.peak_bytes,
        "static_bytes": v.static_bytes,
        "grad_bytes": grad_bytes(v.model),
        "peak_above_static_bytes": (v.peak_bytes - v.static_bytes) if v.peak_bytes is not None else None,
        "step_time_s": med,
        "step_times_s": v.times,
        "bytes_moved_per_step": dict(v.moved),
        "losses": v.losses,
        "trace": v.trace_path,
        "copy_engine": v.copy_engine,
    }


def loss_check(results: Dict[str, Dict[str, Any]], exact: bool, atol: float) -> Dict[str, Any]:
    """Every variant's loss sequence against ``none`` (bitwise when ``exact``)."""
    base = results.get("none")
    out: Dict[str, Any] = {}
    for name, r in results.items():
        if base is None:
            out[name] = {"equal": None, "max_abs_diff": None}
            continue
        a, b = r["losses"], base["losses"]
        if len(a) != len(b):
            out[name] = {"equal": False, "max_abs_diff": None}
            continue
        diff = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
        equal = all(x == y for x, y in zip(a, b)) if exact else diff <= atol
        out[name] = {"equal": equal, "max_abs_diff": diff}
    return out


def environment(device: torch.device) -> Dict[str, Any]:
    env: Dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.type != "cpu":
        try:
            dm = torch.get_device_module(device.type)
            env["device_name"] = dm.get_device_name(device)
            props = dm.get_device_properties(device)
            env["device_memory_bytes"] = int(getattr(props, "total_memory", 0))
        except Exception as exc:  # pragma: no cover - depends on the accelerator
            env["device_name"] = f"unknown ({exc})"
        env["cuda"] = getattr(torch.version, "cuda", None)
    try:
        import torchtune  # noqa: F401

        env["torchtune"] = getattr(sys.modules["torchtune"], "__version__", "?")
    except Exception:
        env["torchtune"] = None
    return env


# --------------------------------------------------------------------------- copy engine probe

def probe_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 8) -> Dict[str, Any]:
    """Raw pinned host<->device copy bandwidth (GB/s, 1e9 B/s) of one big buffer, timed with
    device events on a side stream: the physical limit of this machine's link."""
    if device.type == "cpu":
        return {"skipped": "no accelerator: host and device are the same memory"}
    dm = torch.get_device_module(device.type)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = dm.Stream()
    out: Dict[str, Any] = {"bytes": nbytes, "reps": reps}
    for direction, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        with dm.stream(stream):
            for _ in range(2):
                dst.copy_(src, non_blocking=True)
            start, end = dm.Event(enable_timing=True), dm.Event(enable_timing=True)
            start.record(stream)
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        out[f"{direction}_gbps"] = nbytes * reps / seconds / 1e9
    del host, dev
    return out


# --------------------------------------------------------------------------- plots

def have_matplotlib() -> Tuple[bool, str]:
    try:
        import matplotlib  # noqa: F401

        return True, ""
    except ImportError:
        return False, ("matplotlib is not installed: pip install -e '.[bench]' (or pip install "
                       "matplotlib); no PNG written")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_chart(path: str, results: Dict[str, Dict[str, Any]], title: str) -> None:
    plt = _plt()
    names = [n for n in results if results[n]["peak_bytes"] is not None]
    colors = ["tab:gray" if results[n]["who"] == "baseline" else
              ("tab:blue" if results[n]["who"] == "ours" else "tab:orange") for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    xs = list(range(len(names)))
    panels = [
        ("peak device memory (MiB)", [results[n]["peak_bytes"] / MiB for n in names], "%.0f"),
        ("median fwd+bwd step (ms)", [(results[n]["step_time_s"] or 0) * 1e3 for n in names], "%.0f"),
        ("moved per step, D2H+H2D (MiB)",
         [(results[n]["bytes_moved_per_step"]["d2h"] + results[n]["bytes_moved_per_step"]["h2d"]) / MiB
          for n in names], "%.0f"),
    ]
    for ax, (label, vals, fmt) in zip(axes, panels):
        ax.bar(xs, vals, color=colors)
        ax.set_xticks(xs, names, rotation=40, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        for x, val in zip(xs, vals):
            ax.text(x, val, fmt % val, ha="center", va="bottom", fontsize=7)
    from matplotlib.patches import Patch

    axes[0].legend(handles=[Patch(color="tab:gray", label="baseline"), Patch(color="tab:orange", label="peers"),
                            Patch(color="tab:blue", label="hyper-parallel")], fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_chart(path: str, axis: str, points: List[Dict[str, Any]], title: str) -> None:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names: List[str] = []
    for p in points:
        for n in p["results"]:
            if n not in names:
                names.append(n)
    markers = "osD^v<>ph*"
    for k, n in enumerate(names):
        xs, mem, tm = [], [], []
        for p in points:
            r = p["results"].get(n)
            if r is None or r["peak_bytes"] is None:
                continue
            xs.append(p["value"])
            mem.append(r["peak_above_static_bytes"] / MiB)
            tm.append((r["step_time_s"] or 0) * 1e3)
        style = "-" if VARIANTS[n][0] == "ours" else ("--" if VARIANTS[n][0] == "peer" else ":")
        ax1.plot(xs, mem, style, marker=markers[k % len(markers)], label=n, alpha=0.85)
        ax2.plot(xs, tm, style, marker=markers[k % len(markers)], label=n, alpha=0.85)
    gx = [p["value"] for p in points if p["results"]]
    gy = [next(iter(p["results"].values()))["grad_bytes"] / MiB for p in points if p["results"]]
    ax1.plot(gx, gy, color="black", linestyle=(0, (1, 3)), label="gradients of all params")
    ax1.set_xlabel(axis)
    ax1.set_ylabel("peak above params+buffers (MiB)")
    ax1.set_title("peak memory (activations + grads)", fontsize=10)
    ax2.set_xlabel(axis)
    ax2.set_ylabel("median fwd+bwd step (ms)")
    ax2.set_title("step time", fontsize=10)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextlib.contextmanager
def released_caches(device: torch.device):
    """After a block: drop the swap manager's layer chain and pooled host buffers, and the
    framework's cached device / pinned host memory, so the next sweep point starts clean."""
    try:
        yield
    finally:
        SwapManager().reset()
        import gc

        gc.collect()
        if device.type != "cpu":
            torch.accelerator.synchronize()
            dm = torch.get_device_module(device.type)
            if hasattr(dm, "empty_cache"):
                dm.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)
            if host_empty is not None:
                host_empty()
