"""The whole training step on a target, composed from traced phases: its peak bytes (what they are
made of), its time, and the fastest per-layer plan under a budget.

``backends/torch/hf_trace.py`` traces one step of a model cut down to a few layers; this module builds the
real step from it, with no framework: a *walk* over the step in the order the device runs it,

    embedding forward, layer 0 .. L-1 forward, loss head forward and backward,
    layer L-1 .. 0 backward, embedding backward, optimizer step,

keeping a running count of what is live (static parts + activations kept for backward) and
taking, at every phase, the live count plus that phase's own rise (its transient peak) as a
candidate for the step's peak. Per layer the walk takes the numbers of the option the plan gives
it, from the trace of that option (``none``, ``recompute`` = the ``full`` trace, ``selective``,
``hf-gc``); ``swap`` is modelled from the ``none`` trace (below). Layers of one kind are
identical, so the trace of one layer stands for all of its kind (cost linear in layers and
kinds: the walk, not the trace, is per layer).

What is **traced** (exact as the target's allocator rounds each request): activations kept and
transient per layer, the embedding, the loss head (with Hugging Face's float32 upcast of the
logits), the optimizer's temporaries (AdamW foreach's lists), every op's FLOPs and bytes.
What is **modelled** (arithmetic on the traced parameter shapes, each a stated rule):

- parameters: the master copy, sharded by FSDP2 (``ceil(numel / fsdp)`` per tensor); fp32 for the
  mixed recipes, the compute dtype otherwise;
- gathered parameters: the compute-dtype copy of a layer's parameters while it runs (FSDP2's
  all-gather output with ``MixedPrecisionPolicy(param_dtype=bfloat16)``, or autocast's cast copies
  without FSDP), for the running layer and the next one (FSDP2 prefetches one); without
  ``reshard_after_forward`` every layer's stays from its forward to its backward; with neither
  sharding nor a dtype change there is none (the parameters are used as they are);
- gradients: the master dtype, sharded; made during each layer's backward (or all live from the
  start with gradient accumulation); the layer's unsharded gradients in the reduce dtype (float32)
  while reduce-scattered (FSDP2) or cast (mixed precision), and DDP's buckets (a second copy of the
  gradients, ``gradient_as_bucket_view=False``, PyTorch's default) as communication buffers;
- optimizer state: AdamW's two states in the master dtype, sharded, and its step counter, a
  float32 scalar per parameter tensor, on the device where PyTorch puts it there (fused AdamW, or
  the device is the CPU: the ``exact`` allocator), on the host otherwise; SGD without momentum: none;
- buffers (a causal mask, rotary tables): as traced, on every rank, neither sharded nor cast (FSDP2
  leaves buffers as they are); a layer's with the layer, the rest with the embedding's stage;
- swap (a layer's saved activations offloaded to host memory after its forward, brought back
  before its backward, as ``core/swap_*`` schedules them): the layer keeps only its output on the
  device; the previous layer's saved bytes are still on the device while this layer runs (the
  offload is waited for when the next layer finishes; the prefetch of the previous layer starts
  when a layer's backward starts); a copy takes ``bytes / host link`` and hides behind the next
  layer's compute, what it does not hide is added to the step;
- pipeline stages (1F1B): a stage holds ``ceil(L / pp)`` layers; the first stage has ``min(pp,
  micro-batches)`` micro-batches in flight and the embedding, the last one micro-batch and the loss
  head; the larger of the two is the answer; the step takes ``(micro-batches + pp - 1)`` stage times.
- time: the sum of every traced op's roofline time on the target (``roofline.op_seconds``), the
  recompute included (it is traced in the backward), plus exposed swap copies; communication
  (all-gather, reduce-scatter, all-reduce) is not priced (a target has no interconnect figure).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .allocator import allocated_size, reserved_estimate
from .roofline import copy_seconds, op_seconds
from .roofline import bound as op_bound
from .targets import Target

__all__ = ["Run", "LayerCost", "StepModel", "Walk", "PLAN_OPTIONS"]

#: The per-layer options a plan chooses from, cheapest in time first.
PLAN_OPTIONS = ("none", "selective", "recompute", "swap")
#: Which trace stands for each option (``swap`` is modelled from ``none``).
TRACE_OF = {"none": "none", "selective": "selective", "recompute": "full", "swap": "none", "hf-gc": "hf-gc"}

PARTS = ("parameters", "buffers", "gathered parameters", "gradients", "optimizer state", "optimizer temporaries",
         "activations", "loss head", "communication buffers")


@dataclasses.dataclass(frozen=True)
class Run:
    """How the step runs (the command line's options)."""

    seq: int
    batch: int
    grad_accum: int
    precision: str
    optimizer: str
    dp: int
    fsdp: int
    reshard_after_forward: bool
    pp: int

    @property
    def mixed(self) -> bool:
        return self.precision in ("bf16-mixed", "fp16-amp")

    @property
    def master_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclasses.dataclass(frozen=True)
class Seconds:
    """The roofline time of a list of ops, and how much of it is compute- or HBM-bound."""

    total: float = 0.0
    compute: float = 0.0
    hbm: float = 0.0

    def __add__(self, other: "Seconds") -> "Seconds":
        return Seconds(self.total + other.total, self.compute + other.compute, self.hbm + other.hbm)

    def __mul__(self, k: float) -> "Seconds":
        return Seconds(self.total * k, self.compute * k, self.hbm * k)


def price(costs: Sequence[Any], target: Target) -> Seconds:
    """Every op's roofline time on ``target`` (``backends/torch/op_cost.OpCost`` tuples)."""
    total = compute = hbm = 0.0
    for c in costs:
        s = op_seconds(target, c.op_class, c.flops, c.bytes_moved, c.dtype)
        total += s
        if op_bound(target, c.op_class, c.flops, c.bytes_moved, c.dtype) == "compute":
            compute += s
        else:
            hbm += s
    return Seconds(total, compute, hbm)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer under one option: bytes relative to the live count when its phase starts
    (``fwd_rise``/``bwd_rise``: the transient peak above it; ``keep``: what the forward leaves
    for the backward; ``bwd_net``: what the backward changes, its own gradients left out: they are
    the step model's), the sizes kept / at the peaks (for the reserved estimate), the layer's
    parameters (element counts), its times, and for ``swap`` the bytes that travel."""

    option: str
    fwd_rise: int
    keep: int
    bwd_rise: int
    bwd_net: int
    kept_sizes: Tuple[int, ...]
    fwd_peak_sizes: Tuple[int, ...]
    bwd_peak_sizes: Tuple[int, ...]
    params: Tuple[int, ...]
    fwd_s: Seconds
    bwd_s: Seconds
    swapped: int = 0


@dataclasses.dataclass
class Walk:
    """A walk's answer: the peak allocated bytes and its parts, the sizes live at the peak (for
    the reserved estimate), and the time."""

    peak: int
    parts: Dict[str, int]
    sizes: List[int]
    seconds: Seconds
    exposed_copy_s: float
    stage: str

    @property
    def step_s(self) -> float:
        return self.seconds.total + self.exposed_copy_s


def _shard(numel: int, fsdp: int) -> int:
    return -(-numel // fsdp)


class StepModel:
    """The step of one model on one target (module docstring). ``traces``: ``{trace option:
    StepTrace}`` (``none`` at least); ``optimizer``: ``(transient bytes per byte of master
    parameters, op costs, parameter bytes the costs were traced over)``."""

    def __init__(self, traces: Dict[str, Any], run: Run, target: Target,
                 optimizer: Tuple[float, Sequence[Any], int]) -> None:
        self.traces = traces
        self.run = run
        self.target = target
        self.alloc = target.allocator
        base = traces["none"]
        self.kinds: List[str] = base.kinds
        self.layers = len(self.kinds)
        self._costs: Dict[Tuple[str, int], LayerCost] = {}
        self._priced: Dict[Tuple[str, str], Seconds] = {}
        self._memo: Dict[Any, Any] = {}
        self.opt_ratio, opt_costs, opt_bytes = optimizer
        self._opt_costs, self._opt_bytes = opt_costs, max(1, opt_bytes)

    # ------------------------------------------------------------------ bytes of parameters
    def _sized(self, numels: Sequence[int], nbytes: int, shard: bool = True) -> List[int]:
        # (memoised: a walk asks for every layer's sizes, a search walks many plans)
        key = (tuple(numels), nbytes, shard)
        sized = self._memo.get(key)
        if sized is None:
            f = self.run.fsdp if shard else 1
            sized = self._memo[key] = [allocated_size(_shard(n, f) * nbytes, self.alloc) for n in numels]
        return sized

    def _traced_grads(self, numels: Sequence[int]) -> int:
        """The gradients the trace made for these parameters (compute dtype, unsharded; none when
        they existed before the traced step: gradient accumulation)."""
        if self.traces["none"].accumulate:
            return 0
        return sum(self._sized(numels, self.run.compute_bytes, shard=False))

    def _gathers(self) -> bool:
        """Whether a compute-dtype copy of the running layer's parameters exists (module docstring)."""
        return self.run.fsdp > 1 or self.run.mixed

    def _gathered(self, numels: Sequence[int]) -> int:
        # (FSDP2 all-gathers a layer's parameters into one buffer: one request)
        if not self._gathers():
            return 0
        return allocated_size(sum(numels) * self.run.compute_bytes, self.alloc)

    def _reduce_buffer(self, numels: Sequence[int]) -> int:
        if not self._gathers():
            return 0
        return allocated_size(sum(numels) * 4, self.alloc)

    def _sum_sized(self, numels: Sequence[int], nbytes: int) -> int:
        key = ("sum", tuple(numels), nbytes)
        total = self._memo.get(key)
        if total is None:
            total = self._memo[key] = sum(self._sized(numels, nbytes))
        return total

    # ------------------------------------------------------------------ per layer
    def _phase_seconds(self, trace_option: str, phase: str) -> Seconds:
        key = (trace_option, phase)
        if key not in self._priced:
            self._priced[key] = price(self.traces[trace_option].phases[phase].costs, self.target)
        return self._priced[key]

    def layer_cost(self, option: str, i: int) -> LayerCost:
        """Layer ``i`` of the real model under ``option``."""
        trace = self.traces[TRACE_OF[option]]
        t = trace.traced_index(i)
        key = (option, t)
        if key in self._costs:
            return self._costs[key]
        fwd, bwd = trace.layer(i)
        params = tuple(trace.layer_params[t])
        grads = self._traced_grads(params)
        fwd_s = self._phase_seconds(TRACE_OF[option], fwd.name)
        bwd_s = self._phase_seconds(TRACE_OF[option], bwd.name)
        if option != "swap":
            cost = LayerCost(option, fwd.rise, fwd.net, bwd.rise, bwd.net - grads, tuple(fwd.kept_sizes),
                             tuple(fwd.peak_sizes), tuple(bwd.peak_sizes), params, fwd_s, bwd_s)
        else:
            out = allocated_size(self.run.batch * self.run.seq * self._hidden() * self.run.compute_bytes, self.alloc)
            swapped = max(0, fwd.net - out)
            cost = LayerCost(option, fwd.rise, out, swapped + bwd.rise, bwd.net - grads + swapped, (out,),
                             tuple(fwd.peak_sizes), tuple(bwd.peak_sizes), params, fwd_s, bwd_s, swapped)
        self._costs[key] = cost
        return cost

    def _hidden(self) -> int:
        hidden = self.traces["none"].hidden
        if not hidden:
            raise ValueError("the traced model names no hidden_size: a swapped layer's output cannot be sized")
        return hidden

    # ------------------------------------------------------------------ the walk
    def stages(self) -> List[Tuple[str, range, bool, bool, int]]:
        """``(name, layers, has embedding, has head, micro-batches in flight)`` for the stages the
        answer looks at: the whole model, or the first and the last pipeline stage."""
        if self.run.pp == 1:
            return [("", range(self.layers), True, True, 1)]
        per = -(-self.layers // self.run.pp)
        flight = min(self.run.pp, self.run.grad_accum)
        return [("first pipeline stage", range(0, per), True, False, flight),
                ("last pipeline stage", range(self.layers - per, self.layers), False, True, 1)]

    def walk(self, plan: Sequence[str], with_sizes: bool = False) -> Walk:
        """The step under ``plan`` (an option per layer): the largest of its stages' walks."""
        best: Optional[Walk] = None
        seconds: List[Seconds] = []
        exposed: List[float] = []
        for stage in self.stages():
            w = self._walk_stage(plan, *stage, with_sizes=with_sizes)
            seconds.append(w.seconds)
            exposed.append(w.exposed_copy_s)
            if best is None or w.peak > best.peak:
                best = w
        assert best is not None
        # (1F1B: every stage runs micro-batches + pp - 1 slots of the slowest stage's micro-batch)
        slowest = max(range(len(seconds)), key=lambda k: seconds[k].total + exposed[k])
        slots = self.run.grad_accum + self.run.pp - 1
        opt = self._optimizer_seconds(self.stages()[slowest][1])
        best.seconds = seconds[slowest] * slots + opt
        best.exposed_copy_s = exposed[slowest] * slots
        return best

    def _static(self, layers: range, embed: bool, head: bool) -> Tuple[Dict[str, List[int]], List[Tuple[int, ...]]]:
        key = ("static", layers.start, layers.stop, embed, head)
        if key not in self._memo:
            self._memo[key] = self._static_uncached(layers, embed, head)
        return self._memo[key]

    def _static_uncached(self, layers: range, embed: bool, head: bool
                         ) -> Tuple[Dict[str, List[int]], List[Tuple[int, ...]]]:
        tr = self.traces["none"]
        numels: List[int] = []
        groups: List[Tuple[int, ...]] = []
        for i in layers:
            groups.append(tuple(tr.layer_params[tr.traced_index(i)]))
            numels.extend(groups[-1])
        if embed:
            numels.extend(tr.embed_params)
        if head:
            numels.extend(tr.head_params)
        run = self.run
        out: Dict[str, List[int]] = {"parameters": self._sized(numels, run.master_bytes),
                                     "grads": self._sized(numels, run.master_bytes)}
        out["optimizer state"] = (out["parameters"] * 2) if run.optimizer.startswith("adamw") else []
        if run.optimizer == "adamw-fused" or (run.optimizer == "adamw" and self.alloc == "exact"):
            out["optimizer state"] += [allocated_size(4, self.alloc)] * len(numels)  # (the step counters)
        out["ddp buckets"] = self._sized(numels, run.master_bytes) if (run.dp > 1 and run.fsdp == 1) else []
        held = [n for i in layers for n in tr.layer_buffers[tr.traced_index(i)]] + (tr.other_buffers if embed else [])
        out["buffers"] = [allocated_size(n, self.alloc) for n in held if n]
        return out, groups

    def _walk_stage(self, plan: Sequence[str], name: str, layers: range, embed: bool, head: bool, flight: int,
                    with_sizes: bool) -> Walk:
        tr = self.traces["none"]
        run = self.run
        static, groups = self._static(layers, embed, head)
        key = ("sums", layers.start, layers.stop, embed, head)
        if key not in self._memo:
            self._memo[key] = tuple(sum(static[k]) for k in ("parameters", "optimizer state", "ddp buckets", "grads",
                                                             "buffers"))
        params, states, buckets, all_grads, buffers = self._memo[key]
        grad_sizes = static["grads"]
        costs = [self.layer_cost(plan[i], i) for i in layers]
        grads_all = run.grad_accum > 1  # (later micro-batches start with every gradient there)
        grads = all_grads if grads_all else 0
        act = 0       # activations kept for the backward
        lhead = 0     # what the loss head keeps
        kept: List[Sequence[int]] = []
        best: Tuple[int, Dict[str, int], Any] = (-1, {}, None)
        seconds = Seconds()
        exposed = 0.0
        always_gathered = 0

        def candidate(extra: Dict[str, int], sizes: Sequence[int] = ()) -> None:
            nonlocal best
            parts = {"parameters": params, "buffers": buffers, "gathered parameters": always_gathered,
                     "gradients": grads, "optimizer state": states, "optimizer temporaries": 0, "activations": act, "loss head": lhead,
                     "communication buffers": buckets}
            for k, v in extra.items():
                parts[k] += v
            total = sum(parts.values())
            if total > best[0]:
                best = (total, parts, (len(kept), tuple(sizes), grads) if with_sizes else None)

        def gathered(i: int, j: Optional[int]) -> int:
            g = self._gathered(costs[i].params)
            if j is not None and 0 <= j < len(costs):
                g += self._gathered(costs[j].params)
            return g

        # (the embedding's phases come from the trace of the first layer's option. What the model
        # passes every layer by keyword (position ids, ...) dies when the forward ends, unless a
        # checkpointed layer holds it for its recompute: then the head's phases are those of a
        # checkpointed trace, which keep it, and it dies in the backward of the first checkpointed
        # layer, which layer 0 of such a trace shows and a later layer does not: ``shared``)
        first = TRACE_OF[plan[0]]
        checkpointed = [i for i, o in enumerate(plan) if o in ("recompute", "selective", "hf-gc")]
        last = TRACE_OF[plan[checkpointed[0]]] if checkpointed else "none"
        etr, htr = self.traces[first], self.traces[last]
        shared = max(0, htr.phases["head.fwd"].net - tr.phases["head.fwd"].net)
        frees_shared = checkpointed[0] if checkpointed and checkpointed[0] > 0 else None

        # forward of the micro-batches in flight before the first backward (1F1B on a first stage)
        for m in range(flight):
            last_mb = m == flight - 1
            if embed:
                ph = etr.phases["embed.fwd"]
                candidate({"activations": ph.rise, "gathered parameters": self._gathered(tr.embed_params)},
                          ph.peak_sizes)
                act += ph.net
                kept.append(ph.kept_sizes)
                if last_mb:
                    seconds += self._phase_seconds(first, "embed.fwd")
            for k, c in enumerate(costs):
                inflight = costs[k - 1].swapped if k > 0 and costs[k - 1].option == "swap" else 0
                g = always_gathered if not run.reshard_after_forward else 0
                candidate({"activations": c.fwd_rise + inflight,
                           "gathered parameters": gathered(k, k + 1) if g == 0 else self._gathered(c.params)},
                          c.fwd_peak_sizes)
                act += c.keep
                kept.append(c.kept_sizes)
                if not run.reshard_after_forward:
                    always_gathered += self._gathered(c.params)
                if last_mb:
                    seconds += c.fwd_s
                    if c.option == "swap":
                        nxt = costs[k + 1].fwd_s.total if k + 1 < len(costs) else 0.0
                        exposed += max(0.0, copy_seconds(self.target, c.swapped) - nxt)
        if head:
            ph = htr.phases["head.fwd"]
            candidate({"loss head": ph.rise, "gathered parameters": self._gathered(tr.head_params)}, ph.peak_sizes)
            lhead += ph.net
            kept.append(ph.kept_sizes)
            seconds += self._phase_seconds(last, "head.fwd")
            ph = htr.phases["head.bwd"]
            candidate({"loss head": ph.rise, "gathered parameters": self._gathered(tr.head_params)}, ph.peak_sizes)
            lhead += ph.net - self._traced_grads(tr.head_params)
            kept.pop()  # (what the head kept is gone after its backward; a stack, as the backward runs)
            if not grads_all:
                grads += self._sum_sized(tr.head_params, run.master_bytes)
            seconds += self._phase_seconds(last, "head.bwd")
        for k in reversed(range(len(costs))):
            c = costs[k]
            prefetch = costs[k - 1].swapped if k > 0 and costs[k - 1].option == "swap" else 0
            g = gathered(k, k - 1) if run.reshard_after_forward else 0
            candidate({"activations": c.bwd_rise + prefetch, "gathered parameters": g,
                       "communication buffers": self._reduce_buffer(c.params)}, c.bwd_peak_sizes)
            act += c.bwd_net
            if layers[k] == frees_shared:
                act -= shared
            kept.pop()
            if not run.reshard_after_forward:
                always_gathered -= self._gathered(c.params)
            if not grads_all:
                grads += self._sum_sized(c.params, run.master_bytes)
            seconds += c.bwd_s
            if c.option == "swap":
                nxt = costs[k + 1].bwd_s.total if k + 1 < len(costs) else 0.0
                exposed += max(0.0, copy_seconds(self.target, c.swapped) - nxt)
        if embed:
            ph = etr.phases["embed.bwd"]
            candidate({"activations": ph.rise, "gathered parameters": self._gathered(tr.embed_params)},
                      ph.peak_sizes)
            act += ph.net - self._traced_grads(tr.embed_params)
            kept.pop()
            if not grads_all:
                grads += self._sum_sized(tr.embed_params, run.master_bytes)
            seconds += self._phase_seconds(first, "embed.bwd")
        # the optimizer step (after the last micro-batch; what is left of the activations is gone)
        act, lhead = 0, 0
        kept.clear()
        temporaries = int(self.opt_ratio * params)
        candidate({"optimizer temporaries": temporaries})
        total, parts, where = best
        sizes: List[int] = []
        if with_sizes and where is not None:
            n_kept, peak_sizes, grads_then = where
            sizes = list(static["parameters"]) + list(static["buffers"]) + list(static["optimizer state"]) + \
                list(static["ddp buckets"])
            sizes += grad_sizes if grads_then else []
            for group in kept[:n_kept]:
                sizes.extend(group)
            sizes.extend(peak_sizes)
            for name_ in ("gathered parameters", "communication buffers", "optimizer temporaries"):
                if parts[name_] and name_ != "communication buffers":
                    sizes.append(parts[name_])
            if parts["communication buffers"] - buckets > 0:
                sizes.append(parts["communication buffers"] - buckets)
            # (what the sizes miss, storages born before the current phase that the kept lists do not
            # name, is added as one block so that the estimate never sits below the allocated peak)
            missing = total - sum(sizes)
            if missing > 0:
                sizes.append(missing)
        return Walk(total, parts, sizes, seconds, exposed, name)

    def _optimizer_seconds(self, layers: range) -> Seconds:
        if not self._opt_costs:
            return Seconds()
        static, _ = self._static(layers, True, True)
        scale = sum(static["parameters"]) / self._opt_bytes
        return price(self._opt_costs, self.target) * scale

    # ------------------------------------------------------------------ answers
    def reserved(self, walk: Walk) -> int:
        """The allocator's reserved bytes at the walk's peak (``allocator.reserved_estimate`` of the
        sizes live there). The sizes name what each phase kept and made; a storage kept by a phase
        that died during the current one is still named, so the names' sum can pass the peak: that
        excess is taken off the estimate again (never below the allocated peak)."""
        sizes = [s for s in walk.sizes if s > 0]
        excess = max(0, sum(sizes) - walk.peak)
        return max(walk.peak, reserved_estimate(sizes, self.alloc) - excess)

    def evaluate(self, plan: Sequence[str]) -> Tuple[Walk, int]:
        walk = self.walk(plan, with_sizes=True)
        return walk, self.reserved(walk)

    def _ordered(self, counts: Dict[str, int]) -> List[str]:
        # (swap first: the earliest layers' copies have the most compute to hide behind; the layers
        # that keep the most last, nearest the loss, whose backward frees them first)
        plan: List[str] = []
        for option in ("swap", "recompute", "selective", "none"):
            plan.extend([option] * counts.get(option, 0))
        return plan

    def minimum(self) -> Tuple[List[str], Walk, int]:
        """The plan with the smallest reserved peak among ``s`` swapped layers first, one option
        for the layers up to the last, and one for the last layer (whose backward follows the loss
        head's at once): ``(plan, walk, reserved)``. Not every plan is tried (a walk each); the
        frugal ones are, and :meth:`plan` checks its answer against this one."""
        best: Optional[Tuple[List[str], Walk, int]] = None
        n = self.layers
        for swaps in range(0, n):
            for middle in ("recompute", "selective", "none"):
                for last in PLAN_OPTIONS[:3]:
                    if n - 1 - swaps == 0 and middle != "recompute":
                        continue  # (no middle block: one plan per last option)
                    plan = ["swap"] * swaps + [middle] * (n - 1 - swaps) + [last]
                    walk = self.walk(plan)
                    if best is not None and walk.peak > best[2]:
                        continue
                    walk, reserved = self.evaluate(plan)
                    if best is None or reserved < best[2]:
                        best = (plan, walk, reserved)
        assert best is not None
        return best

    def plan(self, budget: int, minimum: Optional[Tuple[List[str], Walk, int]] = None
             ) -> Optional[Tuple[List[str], Walk, int]]:
        """The fastest plan whose reserved peak is within ``budget``: every split of the layers
        into the options (how many of each; their order as :meth:`_ordered`), tried fastest first
        by the per-layer times, walked until one fits; else the :meth:`minimum` plan if it fits;
        ``None`` when none does.""" 
        n = self.layers
        unit = {o: self.layer_cost(o, n - 1) for o in PLAN_OPTIONS}
        swap_extra = max(0.0, copy_seconds(self.target, unit["swap"].swapped) - unit["none"].fwd_s.total) + \
            max(0.0, copy_seconds(self.target, unit["swap"].swapped) - unit["none"].bwd_s.total)
        tried = []
        for a in range(n + 1):
            for b in range(n + 1 - a):
                for c in range(n + 1 - a - b):
                    s = n - a - b - c
                    if s > max(0, n - 1):
                        continue
                    t = (a * (unit["none"].fwd_s.total + unit["none"].bwd_s.total)
                         + b * (unit["selective"].fwd_s.total + unit["selective"].bwd_s.total)
                         + c * (unit["recompute"].fwd_s.total + unit["recompute"].bwd_s.total)
                         + s * (unit["swap"].fwd_s.total + unit["swap"].bwd_s.total + swap_extra))
                    # (a cheap lower bound on the peak: what the layers keep at the end of the forward)
                    keep = a * unit["none"].keep + b * unit["selective"].keep + c * unit["recompute"].keep + \
                        s * unit["swap"].keep
                    tried.append((t, keep, {"none": a, "selective": b, "recompute": c, "swap": s}))
        # (equal times, e.g. a swap whose copies hide completely: the plan that moves least wins,
        # then the one that keeps least)
        tried.sort(key=lambda x: (x[0], x[2]["swap"], x[2]["recompute"], x[2]["selective"], x[1]))
        static, _ = self._static(range(n), True, True)
        floor = sum(static["parameters"]) + sum(static["buffers"]) + sum(static["optimizer state"]) + \
            (sum(static["grads"]) if self.run.grad_accum > 1 else 0)
        for _, keep, counts in tried:
            if self.run.pp == 1 and floor + keep > budget:  # (live at the end of the forward: cannot fit)
                continue
            plan = self._ordered(counts)
            walk = self.walk(plan)
            if walk.peak > budget:
                continue
            walk, reserved = self.evaluate(plan)
            if reserved <= budget:
                return plan, walk, reserved
        plan, walk, reserved = minimum or self.minimum()  # (a frugal layout the ordered splits do not cover)
        return (plan, walk, reserved) if reserved <= budget else None


def bound_of(walk: Walk) -> str:
    """What binds the step: ``compute``, ``hbm`` (the ops' roofline terms) or ``host link``
    (swap copies the compute does not hide), whichever takes the most time."""
    shares = {"compute": walk.seconds.compute, "hbm": walk.seconds.hbm, "host link": walk.exposed_copy_s}
    return max(shares, key=lambda k: shares[k])

