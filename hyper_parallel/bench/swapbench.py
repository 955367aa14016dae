"""The measurements behind ``benchmarks/swap_overhead.py`` and ``benchmarks/swap_memory.py``.

* **Per-tensor overhead** (:func:`run_overhead`): a model of many small ops (:class:`SmallOpsNet`,
  ``blocks`` x ``LayerNorm -> Linear(dim, hidden) -> GELU -> Linear(hidden, dim)`` + residual),
  every way of keeping its activations in ``OVERHEAD_VARIANTS``, timed interleaved (forward +
  backward, weights fixed), with the tensors and bytes each one copies out per step: ours counted
  by the engine (tensors whose offload started, ``SwapManager().stats()`` for the bytes), the
  peers by their hooks (:class:`~hyper_parallel.bench.modes.CopyHooks`).
* **Peak memory per phase** (:func:`run_memory`): one training step (forward, backward, SGD step)
  of a model with ``.layers`` per mode of ``MEMORY_MODES``, the peak and the live bytes at the end
  of every phase (:class:`PhaseMeter`), and an estimate of the lower bound (parameters + gradients
  + one layer's saved activations, :func:`saved_bytes_per_layer`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

from hyper_parallel.bench.modes import (
    RECIPES,
    ByteCounter,
    CopyHooks,
    HooksLayer,
    apply_variant,
    sac_host_copy_contexts,
)
from hyper_parallel.bench.floor_hooks import FloorSwapLayer
from hyper_parallel.bench.timing import interleaved, median, synchronize

__all__ = [
    "SmallOpsNet", "SMALL_OPS", "OverheadVariant", "OVERHEAD_VARIANTS", "OVERHEAD_PAIRS", "counting_offloads",
    "counting_calls", "run_overhead", "MEMORY_MODES", "PHASES", "PhaseMeter", "saved_bytes_per_layer", "grad_bytes",
    "run_memory", "layers_above",
]


# --------------------------------------------------------------------------- the many-small-ops model

class _SmallBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class SmallOpsNet(nn.Module):
    """``blocks`` residual blocks ``x + Linear(hidden, dim)(GELU(Linear(dim, hidden)(LayerNorm(x))))``
    on ``(batch, dim)`` inputs; the loss is the mean square of the output. A block saves about eight
    small tensors, so the cost per saved tensor dominates the step."""

    def __init__(self, blocks: int = 48, dim: int = 32, hidden: int = 64, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            self.layers = nn.ModuleList(_SmallBlock(dim, hidden) for _ in range(blocks))
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


#: The ops the selective variants single out (``nn.Linear`` on 2-D inputs reaches the dispatcher as
#: ``aten.addmm``; ``aten.mm`` for bias-free layers).
SMALL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def _ours_policy(keep: str) -> Callable:
    from hyper_parallel.core.activation_checkpoint import CheckpointPolicy

    keep_policy = getattr(CheckpointPolicy, keep)

    def policy_fn(ctx, op, *args, **kwargs):
        return keep_policy if op in SMALL_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


def _torch_policy(ctx, op, *args, **kwargs):
    P = torch.utils.checkpoint.CheckpointPolicy
    return P.MUST_SAVE if op in SMALL_OPS else P.PREFER_RECOMPUTE


@dataclass(frozen=True)
class OverheadVariant:
    name: str
    who: str     # "baseline", "peer" or "ours"
    what: str
    apply: Callable[[nn.Module], Optional[ByteCounter]]  # wraps model.layers in place
    swaps: bool = False  # ours, moving bytes through the engine


def _each(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> None:
    for i, layer in enumerate(model.layers):
        model.layers[i] = wrap(layer)


def _v_none(model):
    return None


def _v_save_on_cpu(model):
    _each(model, lambda b: HooksLayer(b, lambda: torch.autograd.graph.save_on_cpu(pin_memory=False)))
    return None


def _v_copy_hooks(model):
    counter = ByteCounter()
    _each(model, lambda b: HooksLayer(b, lambda: CopyHooks(counter)))
    return counter


def _v_floor_hooks(model):
    counter = ByteCounter()
    previous = None
    n = len(model.layers)
    for i, layer in enumerate(model.layers):
        previous = model.layers[i] = FloorSwapLayer(layer, counter, previous, retry=i < n - 1)
    return counter


def _v_torch_sac(model):
    ctx = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, _torch_policy)
    _each(model, lambda b: HooksLayer(b, contextlib.nullcontext, context_fn=ctx))
    return None


def _v_torch_sac_copy(model):
    counter = ByteCounter()
    _each(model, lambda b: HooksLayer(b, lambda: CopyHooks(counter),
                                      context_fn=lambda: sac_host_copy_contexts(_torch_policy, counter)))
    return counter


def _v_ours_swap_wrapper(model):
    from hyper_parallel.core.activation_checkpoint import wrap_layers

    wrap_layers(model.layers, swap=True)
    return None


def _v_ours_save(model):
    from hyper_parallel.core.activation_checkpoint import wrap_layers

    wrap_layers(model.layers, policy_fn=_ours_policy("MUST_SAVE"), chain=False)
    return None


def _v_ours_ckpt_swap(model):
    from hyper_parallel.core.activation_checkpoint import wrap_layers

    wrap_layers(model.layers, policy_fn=_ours_policy("MUST_SWAP"), swap_inputs=True)
    return None


OVERHEAD_VARIANTS: Dict[str, OverheadVariant] = {v.name: v for v in [
    OverheadVariant("none", "baseline", "no wrapper", _v_none),
    OverheadVariant("save_on_cpu", "peer", "torch.autograd.graph.save_on_cpu(pin_memory=False) per block: on CPU "
                                           "tensor.cpu() returns the tensor itself, so nothing is copied",
                    _v_save_on_cpu),
    OverheadVariant("copy_hooks", "peer", "saved_tensors_hooks per block copying every saved tensor (parameters "
                                          "too) out (torch.empty_like + copy_) and back (clone): save_on_cpu "
                                          "off-device", _v_copy_hooks),
    OverheadVariant("ours_swap_wrapper", "ours", "wrap_layers(blocks, swap=True): swap_wrapper per block, chained; "
                                                 "every saved activation offloaded (parameters kept; on CPU the "
                                                 "last block too, loads on use)", _v_ours_swap_wrapper, swaps=True),
    OverheadVariant("floor_hooks", "peer", "bench/floor_hooks.py: the least a hook pair does to move what "
                                           "ours_swap_wrapper moves on CPU, with its checks (a yardstick, not a "
                                           "peer library)", _v_floor_hooks),
    OverheadVariant("torch_sac", "peer", "PyTorch selective checkpoint per block: MUST_SAVE mm/addmm, "
                                         "PREFER_RECOMPUTE else; nothing copied", _v_torch_sac),
    OverheadVariant("torch_sac_copy", "peer", "torch_sac whose cached mm/addmm outputs are copied out and back "
                                              "(sac_host_copy_contexts), inside copy_hooks (which copy the block "
                                              "input checkpoint saves): the same bytes as ours_ckpt_swap",
                    _v_torch_sac_copy),
    OverheadVariant("ours_save", "ours", "checkpoint_wrapper(block, MUST_SAVE mm/addmm, PREFER_RECOMPUTE else), "
                                         "not chained: nothing copied", _v_ours_save),
    OverheadVariant("ours_ckpt_swap", "ours", "checkpoint_wrapper(block, MUST_SWAP mm/addmm, PREFER_RECOMPUTE else, "
                                              "swap_inputs=True), chained: mm/addmm outputs + block input offloaded",
                    _v_ours_ckpt_swap, swaps=True),
]}

#: ``(ours, peer, target ratio)``: the issue's per-tensor-overhead targets, and the reference pairs.
OVERHEAD_PAIRS: Tuple[Tuple[str, str, Optional[float]], ...] = (
    ("ours_swap_wrapper", "copy_hooks", 1.5),
    ("ours_swap_wrapper", "floor_hooks", None),
    ("floor_hooks", "copy_hooks", None),
    ("ours_ckpt_swap", "torch_sac_copy", 1.25),
    ("ours_swap_wrapper", "save_on_cpu", None),
    ("ours_ckpt_swap", "torch_sac", None),
    ("ours_save", "torch_sac", None),
)


@contextlib.contextmanager
def counting_offloads() -> Iterator[Dict[str, int]]:
    """Count the swapped tensors (storages whose device-to-host copy started) and the
    host-to-device copies issued to bring them back (one per bucket of small storages, or per
    storage) while inside: the engine's ``SwapManager().stats()`` counts bytes and launches, not
    tensors or copies. Instruments the way out (``SwapTensor.start_offload``) and back
    (``copy_in``) for the duration (use it around an untimed step)."""
    from hyper_parallel.core import swap_tensor

    cls = swap_tensor.SwapTensor
    originals = {name: getattr(cls, name) for name in ("start_offload", "copy_in")}
    counts = {"tensors": 0, "bytes": 0, "copies_back": 0}

    def out(name):
        def counted(self, *args, **kwargs):
            originals[name](self, *args, **kwargs)
            counts["tensors"] += 1
            counts["bytes"] += int(self.nbytes)
        return counted

    def copy_in(self, copy_stream, issue=True):
        originals["copy_in"](self, copy_stream, issue)
        counts["copies_back"] += int(issue)

    cls.start_offload, cls.copy_in = out("start_offload"), copy_in
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(cls, name, fn)


class counting_calls:
    """Count the calls the interpreter makes while inside, on this thread (``sys.setprofile``):
    ``python`` = calls of Python functions, ``builtin`` = calls of functions implemented in C
    (builtins, and the framework's named functions and methods called from Python, e.g.
    ``torch.empty`` or ``t.detach()``; operators such as ``a + b`` or ``a[0]`` go through C slots
    and are not reported). Unlike a time, the count does not depend on how busy the machine is: it
    measures the interpreter work a variant adds, step for step. Hooks that autograd calls from
    another thread (an accelerator's backward) are not seen: run the backward with
    ``torch.autograd.set_multithreading_enabled(False)`` (CPU backward runs on the calling thread
    anyway). A class rather than a generator context manager, so that leaving adds exactly one
    call of each kind, which is taken off. A profiler that was installed before (a Python function,
    or cProfile) is given back its hook on leaving.

    Example::

        >>> with counting_calls() as calls:
        ...     _ = sorted([3, 1, 2])
        >>> calls
        {'python': 0, 'builtin': 1}
    """

    def __init__(self) -> None:
        self.counts = {"python": 0, "builtin": 0}
        self._previous: Any = None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.counts["python"] += 1
        elif event == "c_call":
            self.counts["builtin"] += 1

    def __enter__(self) -> Dict[str, int]:
        previous = sys.getprofile()
        if previous is not None and not callable(previous) and not callable(getattr(previous, "enable", None)):
            raise RuntimeError(f"counting_calls: a profiler of type {type(previous).__name__} is installed and "
                               "could not be given back its hook afterwards; stop it first.")
        self._previous = previous
        sys.setprofile(self._profile)
        return self.counts

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)
        self.counts["python"] -= 1   # this __exit__
        self.counts["builtin"] -= 1  # the sys.setprofile above
        previous = self._previous
        if callable(previous):
            sys.setprofile(previous)
        elif previous is not None:  # a C-level profiler (cProfile's): it installs its own hook again
            previous.enable()


def _grads(model: nn.Module) -> List[Optional[torch.Tensor]]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _total_calls(row: Dict[str, Any]) -> int:
    return row["calls"]["python"] + row["calls"]["builtin"]


def run_overhead(names: Sequence[str], *, blocks: int, dim: int, hidden: int, batch: int, rounds: int,
                 warmup: int, seed: int = 0) -> Dict[str, Any]:
    """Every variant of ``names`` on its own copy of one :class:`SmallOpsNet`, the same input.

    Per variant: ``warmup`` steps, one untimed counting step (tensors and bytes copied out and
    back, gradients compared bitwise with ``none``'s), one untimed step under
    :class:`counting_calls` (``row["calls"]``), then ``rounds`` timed steps interleaved with the
    other variants. Returns ``{"results": {name: row}, "pairs": [...]}``."""
    from hyper_parallel.core.activation_checkpoint import SwapManager

    names = list(dict.fromkeys(["none"] + list(names)))
    for n in names:
        if n not in OVERHEAD_VARIANTS:
            raise ValueError(f"unknown variant {n!r}; choose from {', '.join(OVERHEAD_VARIANTS)}")
    base = SmallOpsNet(blocks, dim, hidden, seed=seed)
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(seed + 1))
    models: Dict[str, nn.Module] = {}
    counters: Dict[str, Optional[ByteCounter]] = {}
    for n in names:
        models[n] = copy.deepcopy(base)
        counters[n] = OVERHEAD_VARIANTS[n].apply(models[n])

    def zero_grads(n: str) -> None:
        for p in models[n].parameters():
            p.grad = None

    def fwd_bwd(n: str) -> torch.Tensor:
        loss = models[n](x)
        loss.backward()
        return loss

    def step(n: str) -> Tuple[float, float]:
        """``(seconds of forward + backward, seconds of the forward)`` (CPU: nothing to synchronise)."""
        zero_grads(n)
        t0 = time.perf_counter()
        loss = models[n](x)
        t1 = time.perf_counter()
        loss.backward()
        return time.perf_counter() - t0, t1 - t0

    for _ in range(warmup):
        for n in names:
            step(n)
    rows: Dict[str, Dict[str, Any]] = {}
    ref_grads = None
    for n in names:
        c = counters[n]
        before = (c.tensors, c.d2h, c.h2d) if c is not None else None
        stats0 = SwapManager().stats()
        with counting_offloads() as counted:
            step(n)
        stats1 = SwapManager().stats()
        grads = _grads(models[n])
        if n == "none":
            ref_grads = grads
        equal = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                    for a, b in zip(grads, ref_grads))
        if c is not None:
            moved = {"tensors": c.tensors - before[0], "d2h": c.d2h - before[1], "h2d": c.h2d - before[2],
                     "copies_back": None}
        elif OVERHEAD_VARIANTS[n].swaps:
            moved = {"tensors": counted["tensors"],
                     "d2h": stats1["offloaded_bytes"] - stats0["offloaded_bytes"],
                     "h2d": stats1["loaded_bytes"] - stats0["loaded_bytes"],
                     "copies_back": counted["copies_back"]}
        else:
            moved = {"tensors": 0, "d2h": 0, "h2d": 0, "copies_back": 0}
        # A step of its own (counting_offloads adds calls), forward + backward only (what is timed),
        # the backward on this thread so that its hooks are counted on an accelerator too.
        zero_grads(n)
        with torch.autograd.set_multithreading_enabled(False):
            with counting_calls() as calls:
                fwd_bwd(n)
        rows[n] = {"who": OVERHEAD_VARIANTS[n].who, "what": OVERHEAD_VARIANTS[n].what, "moved": moved,
                   "calls": calls, "grads_equal_to_none": equal, "times_s": [], "forward_s": []}
    for _, n in interleaved(names, rounds):
        total, forward = step(n)
        rows[n]["times_s"].append(total)
        rows[n]["forward_s"].append(forward)
    for n, r in rows.items():
        r["median_s"] = median(r["times_s"])
        r["min_s"] = min(r["times_s"]) if r["times_s"] else None
        r["forward_median_s"] = median(r["forward_s"])
        r["backward_median_s"] = median([t - f for t, f in zip(r["times_s"], r["forward_s"])])
    t_none = rows["none"]["median_s"]
    for n, r in rows.items():
        k = r["moved"]["tensors"]
        r["us_per_tensor_vs_none"] = ((r["median_s"] - t_none) / k * 1e6) if k and t_none is not None else None
    pairs = []
    for ours, peer, target in OVERHEAD_PAIRS:
        if ours not in rows or peer not in rows:
            continue
        a, b = rows[ours], rows[peer]
        ratio = a["median_s"] / b["median_s"] if b["median_s"] else None
        k = a["moved"]["tensors"]
        ratio_min = a["min_s"] / b["min_s"] if b["min_s"] else None
        pairs.append({"ours": ours, "peer": peer, "ratio": ratio, "ratio_of_min": ratio_min, "target": target,
                      "met": None if target is None or ratio is None else ratio <= target,
                      "tensors_ours": k, "tensors_peer": b["moved"]["tensors"],
                      "us_per_tensor": ((a["median_s"] - b["median_s"]) / k * 1e6) if k else None,
                      "calls_ratio": _total_calls(a) / _total_calls(b) if _total_calls(b) else None})
    SwapManager().reset()
    return {"results": rows, "pairs": pairs}


# --------------------------------------------------------------------------- peak memory per phase

#: ``benchmarks/swap_memory.py`` mode -> recipe of :mod:`hyper_parallel.bench.modes`.
MEMORY_MODES: Dict[str, str] = {
    "none": "none",
    "recompute": "ours_recompute",        # checkpoint_wrapper per layer
    "swap": "ours_ckpt_swap",             # MUST_SWAP mm/addmm/bmm + swap_inputs, chained
    "swap_wrapper": "ours_swap_wrapper",  # swap_wrapper per layer, chained
    "save_on_cpu": "save_on_cpu",         # copies counted as host memory (count_hooks)
}
PHASES = ("forward", "backward", "optimizer")


class PhaseMeter:
    """Peak and live device bytes at every phase of one region, each as params + buffers of the
    model + what the region added (the runner's convention, so numbers match compare_peers').

    CPU: one :class:`~hyper_parallel.tools.memory.MemoryMeter` (tracking the model, no gc scan)
    across the region, its peak read and reset at every :meth:`phase` (the reset reaches into the
    meter: it has no public per-phase reset). Accelerators: the allocator's counters
    (``memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats``)."""

    def __init__(self, device: torch.device, model: nn.Module) -> None:
        self.device = torch.device(device)
        self.model = model
        self.static = _module_bytes(model)
        self.phases: Dict[str, Dict[str, int]] = {}
        self._meter = None
        self._dm = None
        self._baseline = 0

    def __enter__(self) -> "PhaseMeter":
        synchronize(self.device)
        if self.device.type == "cpu":
            from hyper_parallel.tools.memory import MemoryMeter

            self._meter = MemoryMeter(self.device, track=[self.model], scan_gc=False).__enter__()
            if not hasattr(self._meter, "_tracker"):
                raise RuntimeError("MemoryMeter has no _tracker: per-phase peaks need its reset")
            self._baseline = self._meter.baseline_bytes
        else:
            self._dm = torch.get_device_module(self.device.type)
            self._dm.reset_peak_memory_stats(self.device)
            self._baseline = int(self._dm.memory_allocated(self.device))
        return self

    def phase(self, name: str) -> None:
        """Close phase ``name``: record its peak and the live bytes now, start the next one."""
        synchronize(self.device)
        if self._meter is not None:
            peak, now = self._meter.peak_bytes, self._meter.current_bytes
            self._meter._tracker.reset_peak()
        else:
            peak = int(self._dm.max_memory_allocated(self.device))
            now = int(self._dm.memory_allocated(self.device))
            self._dm.reset_peak_memory_stats(self.device)
        self.phases[name] = {"peak": self.static + max(0, peak - self._baseline),
                             "end": self.static + max(0, now - self._baseline)}

    def __exit__(self, *exc: Any) -> None:
        if self._meter is not None:
            self._meter.__exit__(*exc)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _module_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        k = _storage_key(t)
        if k not in seen:
            seen.add(k)
            total += t.untyped_storage().nbytes()
    return total


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients of all trainable parameters (shared parameters once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.requires_grad and _storage_key(p) not in seen:
            seen.add(_storage_key(p))
            total += p.numel() * p.element_size()
    return total


def saved_bytes_per_layer(model: nn.Module, batch: Tuple[torch.Tensor, ...]) -> List[int]:
    """Bytes of the distinct storages each layer of an unwrapped ``model`` saves for backward (its
    parameters and buffers excluded), from one forward of ``batch``: one layer's activations."""
    static = {_storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    per_layer: List[Dict[int, int]] = [dict() for _ in model.layers]
    current = [None]
    handles = []
    for i, layer in enumerate(model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))

    def pack(t):
        i = current[0]
        if i is not None and _storage_key(t) not in static:
            per_layer[i][_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*batch)
        del out
    finally:
        for h in handles:
            h.remove()
    return [sum(d.values()) for d in per_layer]


def run_memory(base: nn.Module, modes: Sequence[str], *, batch: Tuple[torch.Tensor, ...], device: Any = "cpu",
               warmup: int = 1, seed: int = 0, lr: float = 0.05,
               log: Callable[[str], None] = print) -> Dict[str, Any]:
    """One metered training step per mode (after ``warmup`` steps), each mode on its own copy of
    ``base`` with SGD (no optimizer state), the global RNG seeded the same way for every mode.
    ``modes`` are ``MEMORY_MODES`` names or recipe names. Returns per mode the phases' peaks and
    end bytes and the metered step's loss, and the lower-bound estimate."""
    from hyper_parallel.bench.runner import released_caches

    device = torch.device(device)
    base = base.to(device)
    per_layer = saved_bytes_per_layer(copy.deepcopy(base), batch)
    bound = {"static_bytes": _module_bytes(base), "grad_bytes": grad_bytes(base),
             "layer_saved_bytes": max(per_layer) if per_layer else 0, "saved_bytes_per_layer": per_layer}
    bound["lower_bound_bytes"] = bound["static_bytes"] + bound["grad_bytes"] + bound["layer_saved_bytes"]
    results: Dict[str, Dict[str, Any]] = {}
    errors: Dict[str, str] = {}
    for mode in modes:
        recipe = MEMORY_MODES.get(mode, mode)
        if recipe not in RECIPES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MEMORY_MODES)} or a recipe "
                             f"({', '.join(RECIPES)})")
        with released_caches(device):
            model = copy.deepcopy(base)
            try:
                apply_variant(model, recipe, device=device)
                opt = torch.optim.SGD(model.parameters(), lr=lr)
                loss_value = None
                for i in range(warmup + 1):
                    torch.manual_seed(seed + i)
                    opt.zero_grad(set_to_none=True)
                    if i < warmup:
                        model(*batch).backward()
                        opt.step()
                        continue
                    with PhaseMeter(device, model) as pm:
                        loss = model(*batch)
                        pm.phase("forward")
                        loss.backward()
                        pm.phase("backward")
                        opt.step()
                        pm.phase("optimizer")
                    loss_value = float(loss.detach().item())
                    del loss
            except Exception as exc:
                errors[mode] = f"{type(exc).__name__}: {exc}"
                log(f"mode {mode} failed: {errors[mode]}")
                continue
            finally:
                del model
        ph = pm.phases
        results[mode] = {"recipe": recipe, "what": RECIPES[recipe].what, "phases": ph,
                         "peak_bytes": max(p["peak"] for p in ph.values()), "loss": loss_value}
    return {"results": results, "errors": errors, "bound": bound}


def layers_above(nbytes: Optional[int], bound: Dict[str, Any]) -> Optional[float]:
    """How many layers' activations ``nbytes`` is above the lower bound."""
    if nbytes is None or not bound.get("layer_saved_bytes"):
        return None
    return (nbytes - bound["lower_bound_bytes"]) / bound["layer_saved_bytes"]

