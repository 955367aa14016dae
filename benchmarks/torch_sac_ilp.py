"""PyTorch's eager ``sac_ilp`` planner as a peer of ``benchmarks/planner.py`` (the ``sac`` extra: pulp, pwlf).

PyTorch's pipeline (``torch.distributed._tools``): estimators measure memory and time per module and op, ``ilp_utils``
fits each module's recompute-time vs discarded-memory trade-off with ``pwlf``, ``sac_milp`` chooses the modules to
checkpoint and the share of their memory to discard under a budget, a knapsack per module the ops to recompute.
:func:`profile_sac_ilp` runs the estimators once on a fake copy of the model (on a CPU the benchmark mode on the CPU
clock: neither of PyTorch's estimate modes runs there); ``profile.plan(budget)`` solves one budget;
``plan.apply(model)`` wraps the chosen modules with PyTorch's ``checkpoint_wrapper``; :func:`sac_ilp_recipe` is a plan
as a recipe.

The budget is the absolute peak of one step as the harness meters it; ``sac_milp``'s estimate leaves out buffers and the
batch, so it is given ``budget - outside`` (``outside = baseline - parameters``) and its peak reported plus ``outside``.
So that every plan trains bit-exact, a tensor an in-place op mutates later is recomputed rather than cached, the policy
realigns where the real forward skips ops the fake one recorded, and a Hugging Face model's KV cache is off (as Hugging
Face's own checkpointing does in training). Example::

    from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
    cfg = GPTConfig(layers=8, dim=128, heads=4, seq=256, vocab=512)
    print(profile_sac_ilp(GPT(cfg), make_batch(cfg, 4, seed=0)).plan("100MiB").report())
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hyper_parallel.bench.harness import forward_loss, storage_bytes
from hyper_parallel.bench.modes import Recipe
from hyper_parallel.planner import format_bytes, parse_budget

_WHOLE = 1.0 - 1e-4  # a discard ratio from which a module is checkpointed whole (sac_milp rounds to 4 places)
_GiB = 1 << 30


class SacIlpUnavailable(RuntimeError):
    """PyTorch's sac_ilp cannot give a plan here; ``reason`` is one line (a benchmark's skip reason)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SacIlpInfeasible(SacIlpUnavailable):
    """``sac_milp`` found no plan at ``budget_bytes``; ``min_budget_bytes`` is its own minimum."""

    def __init__(self, reason: str, budget_bytes: int, min_budget_bytes: int) -> None:
        super().__init__(reason)
        self.budget_bytes, self.min_budget_bytes = budget_bytes, min_budget_bytes


def _tools() -> Dict[str, Any]:
    """PyTorch's pieces, imported on first use; :class:`SacIlpUnavailable` says what is missing."""
    try:
        import pulp
        import pwlf  # noqa: F401  (ilp_utils fits the trade-off curves with it)
        from torch.distributed._tools import ilp_utils, sac_ilp
        from torch.distributed._tools.mem_tracker import MemTracker, _ModState
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP, SACEstimator
    except ImportError as exc:
        raise SacIlpUnavailable(f"PyTorch's sac_ilp needs pulp and pwlf, optional peer dependencies: "
                                f"pip install -e '.[sac]' ({type(exc).__name__}: {exc})") from exc
    with _quiet():
        if not pulp.PULP_CBC_CMD(msg=0).available():
            raise SacIlpUnavailable(f"pulp {pulp.__version__} is installed but its CBC solver cannot run here "
                                    "(sac_milp solves with PULP_CBC_CMD)")
    return dict(ilp_utils=ilp_utils, sac_ilp=sac_ilp, MemTracker=MemTracker, ModState=_ModState,
                RuntimeEstimator=RuntimeEstimator, SACEstimator=SACEstimator, skip=OPS_TO_ALWAYS_SKIP)


def sac_ilp_available() -> Tuple[bool, str]:
    """``(True, "")`` when sac_ilp can solve here (pulp, pwlf, CBC), else ``(False, reason)``."""
    try:
        _tools()
    except SacIlpUnavailable as exc:
        return False, exc.reason
    return True, ""


class _Collect(logging.Handler):
    def __init__(self, into: Optional[List[str]]) -> None:
        super().__init__(logging.WARNING)
        self.into = into if into is not None else []

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@contextlib.contextmanager
def _quiet(into: Optional[List[str]] = None) -> Iterator[None]:
    """Collect what sac_ilp's logger says into ``into`` (not stderr), and silence pulp 3.3's deprecations of how
    PyTorch's sac_ilp builds and solves its models (not ours to fix)."""
    logger = logging.getLogger("torch.distributed._tools.sac_ilp")
    handler, propagate = _Collect(into), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=r"(PULP_CBC_CMD is deprecated|"
                                    r"Constructing LpVariable|LpVariable\.matrix is deprecated)")
            yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _cpu_estimate(fake_mode: Any, counts: Dict[str, int]) -> Callable[..., Tuple[Any, float]]:
    """PyTorch's ``operator-level-benchmark`` estimate on the CPU clock: ``(fake outputs, mean ms)`` of the op run on
    random inputs like its fake ones, as PyTorch makes them, 2 warm-up and 3 timed runs; view ops cost 0 ms, as in
    PyTorch, and so does an op that fails on random data (counted ``untimed``)."""
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._pytree import tree_flatten, tree_unflatten
    from torch.utils._runtime_estimation import _FLOAT_TYPES, _VIEW_OPS

    def real_like(x: Any) -> Any:
        if not fake_mode.is_our_fake(x):
            return x
        return (torch.rand_like if x.dtype in _FLOAT_TYPES else torch.ones_like)(x, device=x.fake_device)

    def estimate(func: Any, args: Any, kwargs: Any) -> Tuple[Any, float]:
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in _VIEW_OPS or torch.Tag.inplace_view in func.tags:
            return out, 0.0
        flat, spec = tree_flatten((args, kwargs or {}))
        try:
            with no_dispatch():
                r_args, r_kwargs = tree_unflatten([real_like(a) for a in flat], spec)
                for _ in range(3):
                    func(*r_args, **r_kwargs)
                t0 = time.perf_counter()
                for _ in range(3):
                    func(*r_args, **r_kwargs)
                return out, (time.perf_counter() - t0) * 1e3 / 3
        except Exception:  # an op that cannot run on random data
            counts["untimed"] = counts.get("untimed", 0) + 1
            return out, 0.0

    return estimate


@dataclass
class ModuleDecision:
    """One module of a plan: ``discard``, ``sac_milp``'s share of its activation memory to discard; ``whole``, or
    ``save`` (1 saved, 0 recomputed) per op of its forward (``func_names``)."""

    name: str
    discard: float
    whole: bool
    func_names: List[str] = field(default_factory=list)
    save: List[int] = field(default_factory=list)
    kept_fraction: float = 0.0       # bytes of the saved ops / of all its ops
    allow_cache_entry_mutation: bool = False
    random_save: Optional[int] = None  # the decision of its random ops (all alike), None when it has none
    recomputed_bytes: int = 0

    def describe(self) -> str:
        saved = ", ".join(sorted({n for n, s in zip(self.func_names, self.save) if s})) or "-"
        return (f"discard {self.discard:.4f}: " + ("whole-module checkpoint" if self.whole else f"selective, saves "
                f"{sum(self.save)} of {len(self.save)} ops ({self.kept_fraction:.1%} of their bytes): {saved}"))


@dataclass
class OpMatch:
    """How the applied policies' op calls lined up with the recorded ops: ``matched``, ``realigned`` (found a few
    further on: Hugging Face attention builds a mask only under the fake mode) or ``unmatched`` (recomputed)."""

    matched: int = 0
    realigned: int = 0
    unmatched: int = 0


class SacIlpPolicy:
    """A selective-checkpoint ``policy_fn`` replaying one module's decisions by position: the n-th op of its forward
    (``skip`` ops not counted) is ``PREFER_SAVE`` when ``save[n]``, else ``MUST_RECOMPUTE``; an op found among the next
    ``window`` recorded ones moves the count there, one not found is recomputed; random ops take ``random_save``."""

    def __init__(self, func_names: Sequence[str], save: Sequence[int], skip: Any,
                 match: Optional[OpMatch] = None, random_save: Optional[int] = None, window: int = 32) -> None:
        self.func_names, self.save, self.skip = list(func_names), list(save), skip
        self.match = match if match is not None else OpMatch()
        self.random_save, self.window = random_save, window
        self._next = {False: 0, True: 0}  # forward, recompute (torch < 2.13 also asks in recompute)

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        policy = torch.utils.checkpoint.CheckpointPolicy
        if func in self.skip:
            return policy.MUST_RECOMPUTE
        phase = bool(getattr(ctx, "is_recompute", False))
        name, n = func._overloadpacket.__name__, self._next[phase]
        ahead = self.func_names[n:n + 1 + self.window]
        k = n + ahead.index(name) if name in ahead else None
        if k is None:
            self.match.unmatched += 1
        else:
            self.match.matched += k == n
            self.match.realigned += k != n
            self._next[phase] = k + 1
        if self.random_save is not None and torch.Tag.nondeterministic_seeded in func.tags:
            save = self.random_save
        else:
            save = self.save[k] if k is not None else 0
        return policy.PREFER_SAVE if save else policy.MUST_RECOMPUTE


def _recompute_mutated(stats: Any, meta: Any, save: Sequence[int]) -> Tuple[List[int], int, bool]:
    """Decisions ``create_selective_checkpoint_contexts`` can apply: sac_ilp may save an op and the in-place op mutating
    its output (dropout's ``empty_like().bernoulli_()``), a mutated cache entry PyTorch refuses: such a group is
    recomputed (bit-exact), with every random op of the module when it holds one, unless the module must store its
    random ops (then mutation is allowed). Returns the decisions, how many became recomputed, whether to allow it."""
    save = list(save)
    parent_of, rand = dict(stats.inplace_ops), set(stats.rand_ops)
    groups = [set(g) for h, g in meta.inplace_op_groups.items() if h not in parent_of and len(g) > 1]
    todo = [g for g in groups if any(save[i] for i in g)]
    if not todo:
        return save, 0, False
    if stats.force_store_random and any(g & rand for g in todo):
        return save, 0, True
    drop: set = set()
    while todo:
        g = todo.pop()
        if not g <= drop:
            drop |= g
            if g & rand:
                drop |= rand
                todo += [h for h in groups if h & rand and not h <= drop]
    forced = sum(1 for i in drop if save[i])
    return [0 if i in drop else s for i, s in enumerate(save)], forced, False


@dataclass
class SacIlpProfile:
    """The estimators' view of one model and batch: ``sac_milp``'s module tree and the SAC statistics per module (names
    relative to the model)."""

    graph: Any
    root: str
    sac_stats: Dict[str, Any]
    order_meta: Dict[str, Any]       # the SAC estimator's greedy-order metadata (in-place and random op groups)
    units: List[str]                 # the modules sac_milp may checkpoint
    estimate_mode: str
    param_bytes: int                 # sac_ilp's parameter bytes (graph node 0)
    default_baseline_bytes: int      # param_bytes + buffers + batch
    sac_no_ac_peak_bytes: int        # its peak estimate without checkpointing, in its terms
    compute_ms: float                # its forward + backward estimate
    timings_s: Dict[str, float]
    skip: Any = field(default=None, repr=False)
    notes: List[str] = field(default_factory=list)
    _min_bytes: Optional[int] = field(default=None, repr=False)

    def outside_bytes(self, baseline_bytes: Optional[int] = None) -> int:
        """What is live at the start of the step but outside sac_ilp's estimate (see the module doc)."""
        return (self.default_baseline_bytes if baseline_bytes is None else int(baseline_bytes)) - self.param_bytes

    def no_checkpoint_peak_bytes(self, baseline_bytes: Optional[int] = None) -> int:
        """sac_ilp's estimate of the no-checkpoint peak, absolute."""
        return self.sac_no_ac_peak_bytes + self.outside_bytes(baseline_bytes)

    def _milp(self, sac_budget_bytes: float, log: Optional[List[str]] = None) -> Tuple[Dict[str, float], float, int]:
        if not self.units:
            return {}, 0.0, self.sac_no_ac_peak_bytes if sac_budget_bytes >= self.sac_no_ac_peak_bytes else -1
        with _quiet(log):
            return _tools()["sac_ilp"].sac_milp(self.graph, memory_budget=sac_budget_bytes / _GiB, world_size=1,
                                                ac_units=[f"{self.root}.{u}" for u in self.units])

    def min_budget_bytes(self, baseline_bytes: Optional[int] = None) -> int:
        """sac_ilp's own minimum, absolute, by bisection over ``sac_milp`` to 0.1% of its no-checkpoint peak (at least 4
        KiB); cached."""
        if self._min_bytes is None:
            lo, hi = float(self.param_bytes), float(self.sac_no_ac_peak_bytes)  # (below the parameters nothing fits)
            hi = lo if self._milp(lo)[2] != -1 else hi
            while hi - lo > max(4096.0, self.sac_no_ac_peak_bytes * 1e-3):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if self._milp(mid)[2] == -1 else (lo, mid)
            self._min_bytes = int(math.ceil(hi))
        return self._min_bytes + self.outside_bytes(baseline_bytes)

    def plan(self, budget: Union[int, str], *, baseline_bytes: Optional[int] = None) -> "SacIlpPlan":
        """``sac_milp`` at ``budget`` (bytes, or e.g. ``"150MiB"``) and, per chosen module, PyTorch's knapsack of which
        ops to recompute. :class:`SacIlpInfeasible` when it finds none."""
        budget_bytes, outside = parse_budget(budget), self.outside_bytes(baseline_bytes)
        log: List[str] = []
        t0 = time.perf_counter()
        decisions, recompute_ms, peak = self._milp(budget_bytes - outside, log)
        solve_s = time.perf_counter() - t0
        if peak == -1:
            minimum = self.min_budget_bytes(baseline_bytes)
            raise SacIlpInfeasible(
                f"sac_ilp finds no plan at {budget_bytes} B ({format_bytes(budget_bytes)}): its budget there is "
                f"{(budget_bytes - outside) / _GiB:.6f} GiB after the {format_bytes(outside)} outside its estimate "
                f"(buffers, batch); its own minimum is {minimum} B ({format_bytes(minimum)}), parameters "
                f"{format_bytes(self.param_bytes)}, its no-checkpoint peak "
                f"{format_bytes(self.no_checkpoint_peak_bytes(baseline_bytes))}", budget_bytes, minimum)
        chosen = [self._decide(name[len(self.root) + 1:], ratio, log)
                  for name, ratio in sorted(decisions.items())]
        return SacIlpPlan(budget_bytes, outside, (budget_bytes - outside) / _GiB, int(peak), int(peak) + outside,
                          float(recompute_ms), chosen, self, dict(self.timings_s, milp=solve_s), log)

    def _decide(self, name: str, ratio: float, log: List[str]) -> ModuleDecision:
        stats, meta = self.sac_stats[name], self.order_meta[name]
        total = sum(stats.memory)
        if ratio >= _WHOLE:
            return ModuleDecision(name, ratio, whole=True, recomputed_bytes=total)
        with _quiet(log):
            save = _tools()["sac_ilp"].get_optimal_checkpointing_policy_per_module(stats, memory_budget=1 - ratio)
        if not save:
            log.append(f"{name}: the per-module knapsack found no policy at {1 - ratio:.4f}; every op recomputed")
        save, forced, mutable = _recompute_mutated(stats, meta, save or [0] * len(stats.memory))
        if forced:
            log.append(f"{name}: {forced} ops recomputed against the per-module choice: they make a tensor that "
                       "an in-place op mutates later, which PyTorch's selective checkpoint cannot keep cached")
        kept = sum(m for m, s in zip(stats.memory, save) if s)
        rand = {save[i] for i in stats.rand_ops}
        return ModuleDecision(name, ratio, False, list(stats.func_names), save, kept / total if total else 0.0, mutable,
                              rand.pop() if len(rand) == 1 else None, total - kept)


@dataclass
class SacIlpPlan:
    """``sac_milp``'s answer at one budget, ready to apply (terms: see the module doc)."""

    budget_bytes: int
    outside_bytes: int
    sac_budget_gib: float
    sac_peak_bytes: int
    predicted_peak_bytes: int
    recompute_ms: float
    modules: List[ModuleDecision]
    profile: SacIlpProfile
    timings_s: Dict[str, float]
    notes: List[str] = field(default_factory=list)
    op_match: OpMatch = field(default_factory=OpMatch)

    @property
    def decisions(self) -> Dict[str, float]:
        """Module name -> discard ratio."""
        return {m.name: m.discard for m in self.modules}

    @property
    def recomputed_bytes(self) -> int:
        """Bytes of op outputs the plan does not keep (the SAC estimator's count)."""
        return sum(m.recomputed_bytes for m in self.modules)

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap, in place, every chosen module of ``model`` (a fresh copy of the profiled model) with PyTorch's
        non-reentrant ``checkpoint_wrapper``: whole, or with a :class:`SacIlpPolicy`."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, CheckpointWrapper,
                                                                                 checkpoint_wrapper)
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        def context_fn(m: ModuleDecision) -> Tuple[Any, Any]:
            policy = SacIlpPolicy(m.func_names, m.save, self.profile.skip, self.op_match, m.random_save)
            return create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=m.allow_cache_entry_mutation)

        targets = []  # (all checked before any is wrapped: a chosen module inside another chosen one is found too)
        for m in self.modules:
            try:
                module = model.get_submodule(m.name)
            except AttributeError as exc:
                raise ValueError(f"the plan checkpoints {m.name!r}, which this model does not have (apply a plan to "
                                 "a model of the structure it was profiled on)") from exc
            parent_name, _, attr = m.name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if isinstance(module, CheckpointWrapper) or isinstance(parent, CheckpointWrapper):
                raise ValueError(f"{m.name!r} is already checkpoint-wrapped: apply a plan to a fresh, unwrapped copy")
            targets.append((m, module, parent, attr))
        if getattr(getattr(model, "config", None), "use_cache", False):
            model.config.use_cache = False  # (see the module doc)
        for m, module, parent, attr in targets:
            kwargs = {} if m.whole else {"context_fn": functools.partial(context_fn, m)}
            setattr(parent, attr, checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs))
        return model

    def report(self) -> str:
        """What it decided, in a few lines."""
        p, m = self.profile, self.op_match
        lines = [f"PyTorch sac_ilp plan: budget {format_bytes(self.budget_bytes)} ({self.budget_bytes} B) = "
                 f"{self.sac_budget_gib:.6f} GiB for sac_milp + {format_bytes(self.outside_bytes)} outside its "
                 f"estimate; predicted peak {format_bytes(self.predicted_peak_bytes)} (no checkpoint: "
                 f"{format_bytes(p.no_checkpoint_peak_bytes())}); recompute {self.recompute_ms:.2f} ms on a step of "
                 f"{p.compute_ms:.2f} ms by its estimate ({p.estimate_mode})"]
        lines += [f"  {d.name}: {d.describe()}" for d in self.modules] or ["  no module checkpointed"]
        lines.append(f"  applied: {m.matched} op calls matched the recorded ops, {m.realigned} realigned, "
                     f"{m.unmatched} unmatched (recomputed); planning: "
                     + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings_s.items()))
        return "\n".join(lines + [f"  note: {n}" for n in p.notes + self.notes])


def profile_sac_ilp(model: nn.Module, batch: Any, *, estimate_mode: str = "operator-level-benchmark") -> SacIlpProfile:
    """Run PyTorch's estimators on one step ``forward_loss(model, batch).backward()`` (``batch``: a tuple of arguments,
    a dict of keyword arguments, or a callable returning one) on a fake copy of ``model`` (the model, its gradients and
    the RNG are left as they were) and return the profile; ``sac_milp`` may checkpoint every module with sub-modules
    below the root. :class:`SacIlpUnavailable` with the reason where it cannot run."""
    tools = _tools()
    device = next(iter(list(model.parameters()) + list(model.buffers())), torch.empty(0)).device
    cpu = device.type == "cpu"
    if cpu and estimate_mode != "operator-level-benchmark":
        raise SacIlpUnavailable(f"RuntimeEstimator's {estimate_mode!r} needs CUDA (the roofline reads the GPU's "
                                "FLOPs and bandwidth); on a CPU use 'operator-level-benchmark'")
    import numpy as np
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    batch = batch() if callable(batch) else batch
    values = list(batch.values()) if isinstance(batch, dict) else list(batch)
    timings: Dict[str, float] = {}
    notes: List[str] = []
    counts: Dict[str, int] = {}
    numpy_rng = np.random.get_state()
    t0 = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), contextlib.redirect_stdout(None):
            fake_mode = FakeTensorMode()
            with FakeCopyMode(fake_mode):
                fake_model = copy.deepcopy(model)
            fake_model.zero_grad(set_to_none=True)
            if getattr(getattr(fake_model, "config", None), "use_cache", False):
                fake_model.config.use_cache = False  # (as apply() does: see the module doc)
            with fake_mode:
                fake = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in values]
                fake_batch = dict(zip(batch, fake)) if isinstance(batch, dict) else tuple(fake)
                mem_tracker = tools["MemTracker"]()
                mem_tracker.track_external(fake_model)
                runtime = tools["RuntimeEstimator"]()(estimate_mode_type=estimate_mode)
                sac = tools["SACEstimator"]()(estimate_mode_type=estimate_mode)
                if cpu:
                    runtime._estimate = sac._estimate_runtime = _cpu_estimate(fake_mode, counts)
                for name, estimator in (("mem_tracker", mem_tracker), ("runtime_estimator", runtime),
                                        ("sac_estimator", sac)):
                    t = time.perf_counter()
                    with estimator:
                        loss = forward_loss(fake_model, fake_batch)
                        if estimator is not sac:  # (the SAC estimator sees the forward only)
                            loss.backward()
                        if estimator is mem_tracker:
                            last = mem_tracker.get_tracker_snapshot("current")
                    if estimator is sac:
                        loss.backward()
                    fake_model.zero_grad(set_to_none=True)
                    timings[name] = time.perf_counter() - t
                # A module whose inputs need no gradient gets no post-backward hook, one whose outputs need
                # none (a rotary embedding) no backward: its backward snapshots are the step's last (every
                # gradient accumulated), which aggregate_stats needs for every module.
                states = tools["ModState"]
                tracked = list(mem_tracker.memory_tracking.values())
                missing = sorted(t.mod_fqn for t in tracked if states.PRE_BW not in t.snapshots)
                if missing:
                    notes.append(f"modules with no backward, taken at the end of the step: {', '.join(missing)}")
                for stats in tracked:
                    for state in (states.PRE_BW, states.PEAK_BW, states.POST_BW):
                        stats.snapshots.setdefault(state, [copy.deepcopy(last)])
                np.random.seed(0)  # (pwlf's differential evolution draws from numpy's global RNG: one fit per run)
                graph = tools["ilp_utils"].parse_module_info(tools["ilp_utils"].aggregate_stats(
                    fake_model, mem_tracker, runtime, sac, device))
    except SacIlpUnavailable:
        raise
    except Exception as exc:
        raise SacIlpUnavailable(f"PyTorch's sac_ilp estimators cannot run on {type(model).__name__} "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    finally:
        np.random.set_state(numpy_rng)
    timings["profile_total"] = time.perf_counter() - t0
    root = graph.nodes[0]["fqn"]
    rel = {n["fqn"]: n["fqn"][len(root) + 1:] for n in graph.nodes[1:]}
    param_bytes = int(graph.nodes[0]["param_per_module"])
    no_ac_peak, compute_ms = tools["ilp_utils"].get_peak_memory_runtime_baseline(graph)
    if counts.get("untimed"):
        notes.append(f"{counts['untimed']} op calls could not be timed on random inputs (0 ms)")
    params = list(model.parameters())
    return SacIlpProfile(graph, root, {rel[k]: v for k, v in sac.sac_mod_stats.items() if k in rel},
                         {rel[k]: v for k, v in sac.sac_mod_greedy_order_meta.items() if k in rel},
                         [rel[n["fqn"]] for n in graph.nodes[1:] if not n["is_leaf"]],
                         estimate_mode + (" (CPU clock)" if cpu else ""), param_bytes,
                         param_bytes + storage_bytes(params + list(model.buffers()) + values) - storage_bytes(params),
                         int(no_ac_peak), float(compute_ms), timings, tools["skip"], notes)


def sac_ilp_recipe(budget: Union[int, str], batch: Any, *, profile: Optional[SacIlpProfile] = None,
                   name: str = "torch_sac_ilp", baseline_bytes: Optional[int] = None) -> Recipe:
    """A recipe (``who="peer"``) for PyTorch's sac_ilp at ``budget``: ``apply`` profiles the first model (or uses
    ``profile``), plans once and wraps every model it is given; :class:`SacIlpUnavailable` (a ``RuntimeError``, the
    recipes' "cannot run here") with the reason. ``recipe.apply.plan()`` gives the plan once made."""
    budget_bytes = parse_budget(budget)
    state: Dict[str, Any] = {"profile": profile, "plan": None}

    def apply(model: nn.Module, device: Any, threshold: Any) -> None:
        if state["plan"] is None:
            state["profile"] = state["profile"] or profile_sac_ilp(model, batch)
            state["plan"] = state["profile"].plan(budget_bytes, baseline_bytes=baseline_bytes)
        state["plan"].apply(model)

    apply.plan = lambda: state["plan"]  # type: ignore[attr-defined]
    return Recipe(name, "peer", f"PyTorch sac_ilp (torch.distributed._tools) at {format_bytes(budget_bytes)}: "
                                "checkpoint_wrapper with selective policies on the modules its MILP chooses", apply)
