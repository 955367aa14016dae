"""PyTorch's eager ``sac_ilp`` planner as a recipe of the benchmark: its plan at a budget, applied the
way PyTorch intends.

PyTorch ships a memory planner for eager mode in ``torch.distributed._tools``: ``MemTracker``
(memory per module), ``RuntimeEstimator`` (time per module), ``SACEstimator`` (per module, every
op's output bytes and time, and a greedy order of what to recompute first), ``ilp_utils``
(``aggregate_stats`` and ``parse_module_info`` make a module tree with those statistics) and
``sac_ilp`` (``sac_milp``: a MILP, solved by ``pulp``'s CBC, that chooses which modules to
checkpoint and what fraction of their activation memory to discard so that its peak estimate stays
under a budget with the least recompute time; ``get_optimal_checkpointing_policy_per_module``: a
knapsack that turns one module's discard ratio into a save/recompute decision per op). This module
runs that pipeline on a model of the benchmark and turns its answer into a plan that trains:

* :func:`profile_sac_ilp` runs the three estimators once, on a fake copy of the model (what
  PyTorch's own test does: everything under ``FakeTensorMode``), and returns a
  :class:`SacIlpProfile`; ``profile.plan(budget)`` solves ``sac_milp`` for one budget (cheap: the
  benchmark solves many budgets from one profile) and returns a :class:`SacIlpPlan`;
* :func:`sac_ilp_plan` does both at once;
* ``plan.apply(model)`` wraps every module the ILP chose with PyTorch's ``checkpoint_wrapper``
  (non-reentrant ``torch.utils.checkpoint``): whole-module checkpoint where the discard ratio is 1,
  otherwise a selective-checkpoint ``context_fn`` whose policy saves the ops that the per-module
  knapsack (or the estimator's greedy order) chose, as PyTorch's auto-SAC does;
* ``plan.recipe()`` / :func:`sac_ilp_recipe` give a :class:`~hyper_parallel.bench.modes.Recipe`
  (``who="peer"``) that the benchmark applies to each fresh copy of its model.

What runs on a CPU (torch 2.13). Neither of ``RuntimeEstimator``'s modes does:
``operator-level-benchmark`` times every op with ``torch.cuda.Event`` ("Tried to instantiate dummy
base class Event" on a CPU build) and ``operator-level-cost-model`` (the roofline) asserts
``torch.cuda.is_available()`` to read the device's FLOPs and bandwidth. On a CPU this module keeps
PyTorch's benchmark mode and changes only its clock (``estimate_mode="operator-level-benchmark"``,
the default): every op seen under the fake mode is run for real on random inputs of its fake
inputs' shapes, dtypes and strides (as PyTorch's benchmark mode makes them: ``rand_like`` for
floating point, ``ones_like`` otherwise), once plus 2 warm-up and 3 timed runs, and timed with
``time.perf_counter`` (CPU kernels are synchronous, so the wall clock is the kernel time); the
outputs stay the fake mode's own. Measured op times rather than a roofline: on a CPU there is no
device model to read, and measured times are what the benchmark compares against. On an
accelerator PyTorch's estimators run unchanged, with either of its two modes.

``sac_ilp`` also needs ``pwlf`` (``aggregate_stats`` fits a 2-segment piecewise-linear curve to
every module's recompute-time vs discarded-memory trade-off). When ``pwlf`` is not installed the fit
is done here with numpy (:class:`_PiecewiseLinFit`: the same continuous least-squares model, the
breakpoint found by a dense search; deterministic, where ``pwlf`` searches with differential
evolution); PyTorch's curve construction around it is unchanged. ``profile.tradeoff_fit`` says which.

The budget. Ours is the absolute peak of one step (forward + backward) as the benchmark's meter
counts it. ``sac_milp``'s is in GiB and bounds its own estimate: at every module boundary,
parameters + the gradients accumulated so far + the activations live after that module's forward +
the module's activation-gradient temporaries, less what the chosen modules discard. Its estimate
does not contain buffers (the causal mask), the batch, or anything else live in the process; its
parameters and gradients are exact. So the budget handed to ``sac_milp`` is::

    sac_budget_bytes = budget_bytes - outside_bytes
    outside_bytes    = baseline_bytes - P           (P: sac_ilp's parameter bytes, graph node 0)
    baseline_bytes   = what the meter counts live at the start of the step; by default
                       P + the model's buffers + the batch's tensors (distinct storages)
    memory_budget    = sac_budget_bytes / 2**30     (GiB, the unit sac_milp takes)

and its answer is reported back in absolute bytes the same way (``predicted_peak_bytes =
sac_peak_bytes + outside_bytes``). Nothing else is calibrated: the error of its activation estimate
(peaks inside a module, the loss head, allocator rounding) is its own and shows in the measured
peak. A benchmark whose meter counts more than the model and the batch at the start of a step (other
objects alive in the process) passes that count as ``baseline_bytes``.

Applying. A module's discard ratio ``r`` becomes per-op decisions as PyTorch's auto-SAC does:
``get_optimal_checkpointing_policy_per_module(stats, 1 - r)`` (or the greedy order,
``per_module="greedy"``), replayed by position by :class:`SacIlpPolicy` (saved: ``PREFER_SAVE``,
else ``MUST_RECOMPUTE``). Two things are added so that every plan trains, bit-exact: a tensor that
an in-place op mutates later is recomputed rather than cached (PyTorch's selective checkpoint stops
on a mutated cache entry; see :func:`_recompute_mutated`, counted in the plan's notes), and the
policy realigns when the real forward skips ops the fake one recorded (Hugging Face attention
builds a mask and repeats the KV heads only under the fake mode), counted in ``plan.op_match``.

Errors: :class:`SacIlpUnavailable` (a ``RuntimeError``; ``.reason`` is the one line a benchmark
prints as its skip reason) when ``pulp`` or its CBC solver is missing or the estimators cannot run
on the model; :class:`SacIlpInfeasible` (a subclass) when the ILP has no solution at the budget,
with ``sac_ilp``'s own minimum budget found by bisection over ``sac_milp`` itself.

Example::

    import copy
    from hyper_parallel.bench.model import GPT, GPTConfig, make_batch
    cfg = GPTConfig(layers=8, dim=128, heads=4, seq=256, vocab=512)
    model, batch = GPT(cfg), make_batch(cfg, 4, seed=0)
    profile = profile_sac_ilp(model, batch)          # the estimators, once
    plan = profile.plan("100MiB")                    # sac_milp at that budget (no checkpoint: 182 MiB)
    print(plan.report())
    trained = plan.apply(copy.deepcopy(model))       # checkpoint_wrapper on the chosen modules
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import sys
import time
import unittest.mock
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hyper_parallel.bench.modes import Recipe
from hyper_parallel.planner.budget import format_bytes, parse_budget

__all__ = [
    "SacIlpUnavailable", "SacIlpInfeasible", "SacIlpProfile", "SacIlpPlan", "SacIlpPolicy", "ModuleDecision", "OpMatch",
    "sac_ilp_available", "profile_sac_ilp", "sac_ilp_plan", "sac_ilp_recipe", "ESTIMATE_MODES", "PER_MODULE",
]

#: Runtime estimate modes: PyTorch's two names. On a CPU only the benchmark one runs (timed with
#: ``time.perf_counter``); on an accelerator both run as PyTorch implements them.
ESTIMATE_MODES = ("operator-level-benchmark", "operator-level-cost-model")
#: How a module's discard ratio becomes per-op decisions: ``"optimal"``, PyTorch's
#: ``get_optimal_checkpointing_policy_per_module`` (a knapsack per module, solved by CBC), or
#: ``"greedy"``, recompute in the SAC estimator's greedy order (most memory per recompute time first,
#: the order on which ``sac_milp``'s trade-off curve is built) until the ratio is discarded.
PER_MODULE = ("optimal", "greedy")
#: A discard ratio at least this is a whole-module checkpoint (``sac_milp`` rounds ratios to 4 decimals).
_WHOLE = 1.0 - 1e-4
_MiB = 1 << 20
_GiB = 1 << 30
_SAC_LOGGER = "torch.distributed._tools.sac_ilp"


class SacIlpUnavailable(RuntimeError):
    """PyTorch's sac_ilp cannot give a plan here; ``reason`` is one line (a benchmark's skip reason)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SacIlpInfeasible(SacIlpUnavailable):
    """``sac_milp`` found no plan at the budget. ``min_budget_bytes`` is the smallest absolute budget
    at which it finds one (its own minimum, by bisection), ``budget_bytes`` the budget asked for."""

    def __init__(self, reason: str, budget_bytes: int, min_budget_bytes: int) -> None:
        super().__init__(reason)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes


def sac_ilp_available() -> Tuple[bool, str]:
    """``(True, "")`` when PyTorch's sac_ilp can solve here (``pulp`` importable, its CBC solver
    runnable), else ``(False, reason)``."""
    try:
        _torch_tools()
    except SacIlpUnavailable as exc:
        return False, exc.reason
    return True, ""


def _torch_tools() -> Dict[str, Any]:
    """PyTorch's pieces, imported on first use (``sac_ilp`` raises ImportError without pulp)."""
    try:
        import pulp  # noqa: F401
        from torch.distributed._tools import ilp_utils, sac_ilp
        from torch.distributed._tools.mem_tracker import MemTracker, _ModState
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP, SACEstimator
    except ImportError as exc:
        raise SacIlpUnavailable(f"PyTorch's sac_ilp needs pulp, an optional peer dependency: "
                                f"pip install -e '.[sac]' ({type(exc).__name__}: {exc})") from exc
    with warnings.catch_warnings():
        _quiet_pulp()
        runnable = pulp.PULP_CBC_CMD(msg=0).available()
    if not runnable:
        raise SacIlpUnavailable(f"pulp {pulp.__version__} is installed but its CBC solver cannot run here "
                                "(sac_milp solves with PULP_CBC_CMD)")
    return {"ilp_utils": ilp_utils, "sac_ilp": sac_ilp, "MemTracker": MemTracker, "ModState": _ModState,
            "RuntimeEstimator": RuntimeEstimator, "SACEstimator": SACEstimator,
            "OPS_TO_ALWAYS_SKIP": OPS_TO_ALWAYS_SKIP}


# --------------------------------------------------------------------------- pieces for a CPU

class _PiecewiseLinFit:
    """The part of ``pwlf.PiecewiseLinFit`` that ``SACEstimator.pwlf_sac_tradeoff_curve`` uses, in
    numpy: a continuous piecewise-linear least-squares fit of ``y`` on ``x`` with ``n_segments``
    segments, the outer breakpoints at ``min(x)`` and ``max(x)``, the inner ones placed to minimise
    the squared error (a dense search, then coordinate refinement). Used only when ``pwlf`` is not
    installed.

    Example::

        >>> import numpy as np
        >>> fit = _PiecewiseLinFit([0, 1, 2, 3, 4], [0, 0, 0, 1, 2]); breaks = fit.fit(2)
        >>> [round(float(b), 3) for b in breaks], [round(float(s), 3) for s in fit.calc_slopes()]
        ([0.0, 2.0, 4.0], [0.0, 1.0])
    """

    def __init__(self, x: Sequence[float], y: Sequence[float]) -> None:
        import numpy as np

        self._np = np
        self.x_data = np.asarray(x, dtype=float)
        self.y_data = np.asarray(y, dtype=float)
        self.fit_breaks = np.array([])
        self.beta = np.array([])
        self.slopes = np.array([])
        self.intercepts = np.array([])

    def _basis(self, x: Any, breaks: Any) -> Any:
        np = self._np
        cols = [np.ones_like(x), x - breaks[0]] + [np.maximum(x - b, 0.0) for b in breaks[1:-1]]
        return np.stack(cols, axis=1)

    def _ssr(self, breaks: Any) -> Tuple[float, Any]:
        np = self._np
        a = self._basis(self.x_data, breaks)
        beta, *_ = np.linalg.lstsq(a, self.y_data, rcond=None)
        r = a @ beta - self.y_data
        return float(r @ r), beta

    def fit(self, n_segments: int) -> Any:
        """Fit and return the breakpoints (``n_segments + 1`` of them, ends included)."""
        np = self._np
        n = max(int(n_segments), 1)
        lo, hi = float(self.x_data.min()), float(self.x_data.max())
        inner = list(np.linspace(lo, hi, n + 1)[1:-1])
        if inner and hi > lo:
            grid = np.unique(np.concatenate([np.linspace(lo, hi, 65)[1:-1], self.x_data]))
            grid = grid[(grid > lo) & (grid < hi)]
            for _ in range(1 if len(inner) == 1 else 3):  # coordinate search over the inner breakpoints
                for k in range(len(inner)):
                    def ssr_at(b: float) -> float:
                        trial = sorted(inner[:k] + [b] + inner[k + 1:])
                        return self._ssr(np.array([lo] + trial + [hi]))[0]

                    best = min(grid, key=ssr_at)
                    # refine between the grid neighbours (golden section: the error is smooth there)
                    i = int(np.searchsorted(grid, best))
                    a, b = (grid[i - 1] if i > 0 else lo), (grid[i + 1] if i + 1 < len(grid) else hi)
                    for _ in range(30):
                        c, d = b - (b - a) / 1.618033988749895, a + (b - a) / 1.618033988749895
                        if ssr_at(c) < ssr_at(d):
                            b = d
                        else:
                            a = c
                    mid = (a + b) / 2
                    inner[k] = mid if ssr_at(mid) <= ssr_at(best) else float(best)
                inner.sort()
        self.fit_breaks = np.array([lo] + inner + [hi])
        _, self.beta = self._ssr(self.fit_breaks)
        self.calc_slopes()
        return self.fit_breaks

    def predict(self, x: Sequence[float]) -> Any:
        """The fitted function at ``x``."""
        return self._basis(self._np.asarray(x, dtype=float), self.fit_breaks) @ self.beta

    def calc_slopes(self) -> Any:
        """Each segment's slope (and sets ``intercepts``), as ``pwlf`` computes them."""
        np = self._np
        y = self.predict(self.fit_breaks)
        dx = np.diff(self.fit_breaks)
        self.slopes = np.divide(np.diff(y), dx, out=np.zeros_like(dx), where=dx > 0)
        self.intercepts = y[:-1] - self.slopes * self.fit_breaks[:-1]
        return self.slopes


def _pwlf_module() -> Tuple[Any, str]:
    """``pwlf`` when installed, else a stand-in module holding :class:`_PiecewiseLinFit`."""
    try:
        import pwlf  # type: ignore[import-untyped,import-not-found]

        return pwlf, "pwlf"
    except ImportError:
        import types

        shim = types.ModuleType("pwlf")
        shim.PiecewiseLinFit = _PiecewiseLinFit  # type: ignore[attr-defined]
        return shim, "numpy (pwlf not installed)"


def _cpu_benchmark_estimate(fake_mode: Any, counts: Dict[str, int], warmup: int = 2, iters: int = 3,
                            memo: Optional[Dict[Any, float]] = None) -> Callable[..., Tuple[Any, float]]:
    """PyTorch's ``operator-level-benchmark`` estimate with a CPU clock: ``estimate(func, args,
    kwargs) -> (fake outputs, mean milliseconds)``. The op is run for real on random inputs of its
    fake inputs' shapes, dtypes and strides (``rand_like`` for floating point, ``ones_like``
    otherwise, as PyTorch's benchmark mode makes them), once and ``warmup`` times, then timed over
    ``iters`` runs with ``time.perf_counter``; the outputs are the fake mode's own (exact shapes,
    strides and aliasing). View ops are not timed (0 ms), as in PyTorch; an op that fails on random
    data is counted in ``counts["untimed"]`` and costs 0 ms. With ``memo`` (a dict), an op called
    again on inputs of the same shapes, strides and dtypes and the same other arguments (the same op
    of the next identical layer, or of the next estimator) takes the time measured first."""
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._pytree import tree_flatten, tree_unflatten
    from torch.utils._runtime_estimation import _FLOAT_TYPES, _VIEW_OPS

    def real_like(x: Any) -> Any:
        if not fake_mode.is_our_fake(x):
            return x
        make = torch.rand_like if x.dtype in _FLOAT_TYPES else torch.ones_like
        return make(x, device=x.fake_device)

    def estimate(func: Any, args: Any, kwargs: Any) -> Tuple[Any, float]:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in _VIEW_OPS or torch.Tag.inplace_view in func.tags:
            return out, 0.0
        key = None
        if memo is not None:
            flat_in, _ = tree_flatten((args, kwargs))
            key = (func,) + tuple((a.dtype, tuple(a.shape), tuple(a.stride()), str(a.device))
                                  if isinstance(a, torch.Tensor) else a for a in flat_in)
            try:
                if key in memo:
                    counts["memoised"] = counts.get("memoised", 0) + 1
                    return out, memo[key]
            except TypeError:  # an unhashable argument: time it
                key = None
        try:
            with no_dispatch():
                flat, spec = tree_flatten((args, kwargs))
                r_args, r_kwargs = tree_unflatten([real_like(a) for a in flat], spec)
                for _ in range(1 + warmup):
                    func(*r_args, **r_kwargs)
                t0 = time.perf_counter()
                for _ in range(iters):
                    func(*r_args, **r_kwargs)
                ms = (time.perf_counter() - t0) * 1e3 / iters
        except Exception:  # an op that cannot run on random data: untimed
            counts["untimed"] = counts.get("untimed", 0) + 1
            return out, 0.0
        counts["timed"] = counts.get("timed", 0) + 1
        if key is not None:
            memo[key] = ms
        return out, ms

    return estimate


def _quiet_pulp() -> None:
    """Ignore (inside a ``warnings.catch_warnings``) pulp 3.3's deprecations of ``LpVariable(...)``,
    ``LpVariable.matrix`` and ``PULP_CBC_CMD``: how PyTorch's sac_ilp builds and solves its models,
    not ours to fix."""
    warnings.filterwarnings("ignore", category=DeprecationWarning,
                            message=r"(PULP_CBC_CMD is deprecated|Constructing LpVariable|LpVariable\.matrix is deprecated)")


@contextlib.contextmanager
def _captured_log(name: str, into: List[str]) -> Iterator[None]:
    """Collect what logger ``name`` says (its warnings and errors go to ``into``, not to stderr), and
    silence pulp 3.3's deprecations of how PyTorch's sac_ilp uses it (:func:`_quiet_pulp`)."""
    logger = logging.getLogger(name)
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    _quiet_pulp()

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            into.append(record.getMessage())

    handler, propagate = _Collect(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        stack.close()


# --------------------------------------------------------------------------- the policy

@dataclass
class ModuleDecision:
    """What the plan does to one module: ``discard`` is ``sac_milp``'s ratio of its activation
    memory to discard; ``whole`` a whole-module checkpoint; otherwise ``func_names`` (the ops of
    its forward as the SAC estimator saw them, ``OPS_TO_ALWAYS_SKIP`` left out) and ``save`` (1:
    saved, 0: recomputed, one per op)."""

    name: str
    discard: float
    whole: bool
    func_names: List[str] = field(default_factory=list)
    save: List[int] = field(default_factory=list)
    #: memory of the saved ops / of all ops, from the SAC estimator (what the knapsack kept)
    kept_fraction: float = 0.0
    #: ops the per-module policy saved that are recomputed because an in-place op mutates their output
    #: later (see ``_recompute_mutated``)
    forced_recompute: int = 0
    #: the selective-checkpoint cache may hold mutated entries (only where random ops must be stored)
    allow_cache_entry_mutation: bool = False
    #: the decision for the module's random ops (all alike), None when it has none
    random_save: Optional[int] = None
    #: bytes of the op outputs this module does not keep (all of them for a whole checkpoint), as the
    #: SAC estimator counted them
    recomputed_bytes: int = 0

    def describe(self) -> str:
        if self.whole:
            return f"checkpoint (whole module), discard {self.discard:.4f}"
        saved = sorted({n for n, s in zip(self.func_names, self.save) if s})
        return (f"selective checkpoint, discard {self.discard:.4f}: saves {sum(self.save)} of {len(self.save)} "
                f"ops ({self.kept_fraction:.1%} of their bytes): {', '.join(saved) or '-'}")


@dataclass
class OpMatch:
    """How the applied policies' op calls lined up with the ops the SAC estimator recorded, over
    every checkpointed forward of every model a plan was applied to: ``matched`` (the next recorded
    op), ``realigned`` (found a few ops further on: the recorded ops in between did not run, e.g.
    Hugging Face's attention materialises a mask and repeats the KV heads under the fake mode
    only), ``unmatched`` (not found: recomputed)."""

    matched: int = 0
    realigned: int = 0
    unmatched: int = 0


class SacIlpPolicy:
    """A selective-checkpoint ``policy_fn`` replaying one module's per-op decisions: the n-th op of
    the module's forward (``OPS_TO_ALWAYS_SKIP`` not counted, as in the SAC estimator) is saved
    (``PREFER_SAVE``) when ``save[n]`` is 1, else ``MUST_RECOMPUTE`` (PyTorch's auto-SAC mapping).

    An op whose name is not the n-th recorded one is looked for among the next ``window`` recorded
    ops and, when found, the count jumps there (the recorded ops in between did not run); otherwise
    it is recomputed and the count stays (as PyTorch's auto-SAC does). A random op takes the
    module's random-op decision whatever its position (``random_save``: random ops are all saved or
    all recomputed, or the recompute would draw other numbers). ``match`` counts what happened.
    One instance serves one checkpointed forward (``context_fn`` makes a new one per call)."""

    def __init__(self, func_names: Sequence[str], save: Sequence[int], skip: Any,
                 match: Optional[OpMatch] = None, random_save: Optional[int] = None, window: int = 32) -> None:
        self.func_names, self.save, self.skip = list(func_names), list(save), skip
        self.match = match if match is not None else OpMatch()
        self.random_save, self.window = random_save, window
        self._next = {False: 0, True: 0}  # forward, recompute (torch < 2.13 also asks in recompute)

    def _decision(self, func: Any, n: Optional[int]) -> Any:
        policy = torch.utils.checkpoint.CheckpointPolicy
        if self.random_save is not None and torch.Tag.nondeterministic_seeded in func.tags:
            save = self.random_save
        else:
            save = self.save[n] if n is not None else 0
        return policy.PREFER_SAVE if save else policy.MUST_RECOMPUTE

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func in self.skip:
            return torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE
        phase = bool(getattr(ctx, "is_recompute", False))
        name, n = func._overloadpacket.__name__, self._next[phase]
        ahead = self.func_names[n:n + 1 + self.window]
        if name not in ahead:
            self.match.unmatched += 1
            return self._decision(func, None)
        k = n + ahead.index(name)
        if k == n:
            self.match.matched += 1
        else:
            self.match.realigned += 1
        self._next[phase] = k + 1
        return self._decision(func, k)


# --------------------------------------------------------------------------- profile and plan

def _distinct_bytes(tensors: Iterable[Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


@dataclass
class SacIlpProfile:
    """PyTorch's estimators' view of one model and batch (:func:`profile_sac_ilp`): the module tree
    ``sac_milp`` solves on, the SAC statistics per module, and how they were obtained. ``plan``
    solves for a budget; ``min_budget_bytes`` is sac_ilp's own minimum."""

    graph: Any                       # ilp_utils.Graph
    root: str                        # the root module's name in the graph ("GPT")
    sac_stats: Dict[str, Any]        # relative module name -> SACStats
    greedy: Dict[str, Any]           # relative module name -> SACGreedyOrderMeta
    units: List[str]                 # the modules sac_milp may checkpoint (relative names)
    device: torch.device
    estimate_mode: str
    tradeoff_fit: str
    param_bytes: int                 # sac_ilp's parameter bytes (graph node 0)
    default_baseline_bytes: int      # param_bytes + buffers + batch (distinct storages)
    sac_no_ac_peak_bytes: int        # its peak estimate without checkpointing (its terms)
    compute_ms: float                # its forward + backward time estimate
    timings_s: Dict[str, float]
    notes: List[str] = field(default_factory=list)
    _skip: Any = field(default=None, repr=False)          # OPS_TO_ALWAYS_SKIP
    _min_cache: Dict[float, int] = field(default_factory=dict, repr=False)

    def outside_bytes(self, baseline_bytes: Optional[int] = None) -> int:
        """What is live at the start of the step but outside sac_ilp's estimate (see the module doc)."""
        baseline = self.default_baseline_bytes if baseline_bytes is None else int(baseline_bytes)
        return baseline - self.param_bytes

    def no_checkpoint_peak_bytes(self, baseline_bytes: Optional[int] = None) -> int:
        """sac_ilp's estimate of the no-checkpoint peak, absolute."""
        return self.sac_no_ac_peak_bytes + self.outside_bytes(baseline_bytes)

    def _milp(self, sac_budget_bytes: float) -> Tuple[Dict[str, float], float, int, List[str]]:
        log: List[str] = []
        sac_ilp = _torch_tools()["sac_ilp"]
        units = [f"{self.root}.{u}" for u in self.units]
        with _captured_log(_SAC_LOGGER, log):
            if not units:
                feasible = sac_budget_bytes >= self.sac_no_ac_peak_bytes
                return {}, 0.0, self.sac_no_ac_peak_bytes if feasible else -1, log
            decisions, recompute_ms, peak = sac_ilp.sac_milp(self.graph, memory_budget=sac_budget_bytes / _GiB,
                                                             world_size=1, ac_units=units)
        return decisions, recompute_ms, peak, log

    def min_budget_bytes(self, baseline_bytes: Optional[int] = None,
                         resolution_bytes: Optional[int] = None) -> int:
        """sac_ilp's own minimum, absolute: the smallest budget at which ``sac_milp`` finds a plan, by
        bisection over ``sac_milp`` itself (to ``resolution_bytes``, default 0.1% of its
        no-checkpoint peak, at least 4 KiB; about a dozen solves). Cached per resolution."""
        hi = float(self.sac_no_ac_peak_bytes)
        step = float(resolution_bytes or max(4096.0, hi * 1e-3))
        if step not in self._min_cache:
            lo = float(self.param_bytes)  # below the parameters nothing fits
            if self._milp(lo)[2] != -1:
                hi = lo
            while hi - lo > step:
                mid = (lo + hi) / 2
                if self._milp(mid)[2] == -1:
                    lo = mid
                else:
                    hi = mid
            self._min_cache[step] = int(math.ceil(hi))
        return self._min_cache[step] + self.outside_bytes(baseline_bytes)

    def plan(self, budget: Union[int, str], *, baseline_bytes: Optional[int] = None,
             per_module: str = "optimal") -> "SacIlpPlan":
        """``sac_milp`` at ``budget`` (absolute bytes, or a string such as ``"150MiB"``), translated as
        the module doc says, and each chosen module's decisions (``per_module``: see
        :data:`PER_MODULE`). :class:`SacIlpInfeasible` (with sac_ilp's minimum) when it finds none."""
        if per_module not in PER_MODULE:
            raise ValueError(f"per_module must be one of {PER_MODULE}, got {per_module!r}")
        budget_bytes = parse_budget(budget)
        outside = self.outside_bytes(baseline_bytes)
        sac_budget = budget_bytes - outside
        t0 = time.perf_counter()
        decisions, recompute_ms, peak, log = self._milp(sac_budget)
        solve_s = time.perf_counter() - t0
        if peak == -1:
            minimum = self.min_budget_bytes(baseline_bytes)
            raise SacIlpInfeasible(
                f"sac_ilp finds no plan at {budget_bytes} B ({format_bytes(budget_bytes)}): its budget there is "
                f"{sac_budget / _GiB:.6f} GiB after the {format_bytes(outside)} outside its estimate "
                f"(buffers, batch); its own minimum is {minimum} B ({format_bytes(minimum)}), parameters "
                f"{format_bytes(self.param_bytes)}, its no-checkpoint peak "
                f"{format_bytes(self.no_checkpoint_peak_bytes(baseline_bytes))}",
                budget_bytes, minimum)
        t1 = time.perf_counter()
        chosen = [self._decide(name[len(self.root) + 1:], ratio, per_module, log)
                  for name, ratio in sorted(decisions.items())]
        policy_s = time.perf_counter() - t1
        return SacIlpPlan(budget_bytes=budget_bytes, outside_bytes=outside, sac_budget_gib=sac_budget / _GiB,
                          sac_peak_bytes=int(peak), predicted_peak_bytes=int(peak) + outside,
                          recompute_ms=float(recompute_ms), compute_ms=self.compute_ms, modules=chosen,
                          per_module=per_module, profile=self,
                          timings_s=dict(self.timings_s, milp=solve_s, per_module=policy_s), notes=log)

    def _decide(self, name: str, ratio: float, per_module: str, log: List[str]) -> ModuleDecision:
        stats = self.sac_stats[name]
        total = sum(stats.memory)
        if ratio >= _WHOLE:
            return ModuleDecision(name, ratio, whole=True, recomputed_bytes=total)
        save: List[int] = []
        if per_module == "optimal":
            sac_ilp = _torch_tools()["sac_ilp"]
            with _captured_log(_SAC_LOGGER, log):
                save = sac_ilp.get_optimal_checkpointing_policy_per_module(stats, memory_budget=1.0 - ratio)
            if not save:
                log.append(f"{name}: the per-module knapsack found no policy at {1 - ratio:.4f}; greedy order used")
        if not save:
            save = _greedy_policy(stats, self.greedy[name], 1.0 - ratio)
        save, forced, mutable = _recompute_mutated(stats, self.greedy[name], save)
        if forced:
            log.append(f"{name}: {forced} ops recomputed against the per-module choice: they make a tensor that "
                       "an in-place op mutates later, which PyTorch's selective checkpoint cannot keep cached")
        kept = sum(m for m, s in zip(stats.memory, save) if s)
        rand = {save[i] for i in stats.rand_ops}
        if len(rand) > 1:
            log.append(f"{name}: its random ops are not all saved or all recomputed "
                       "(the policy keeps each as decided)")
        random_save = rand.pop() if len(rand) == 1 else None
        return ModuleDecision(name, ratio, whole=False, func_names=list(stats.func_names), save=list(save),
                              random_save=random_save, kept_fraction=kept / total if total else 0.0,
                              forced_recompute=forced,
                              allow_cache_entry_mutation=mutable, recomputed_bytes=total - kept)


def _recompute_mutated(stats: Any, meta: Any, save: Sequence[int]) -> Tuple[List[int], int, bool]:
    """Make per-op decisions appliable with ``create_selective_checkpoint_contexts``.

    sac_ilp ties every in-place op to the op that made its tensor (``x[op] == x[parent]``), so it
    may save both: PyTorch's selective checkpoint then caches the parent's output, the in-place op
    bumps its version, and the recompute stops with "Tensor cached during selective activation
    checkpoint has been mutated" (the post-LN model's ``zeros_like(mask).masked_fill_``, dropout's
    ``empty_like().bernoulli_()``). Such a group is recomputed instead (recomputing it re-runs the
    same ops in the same order: bit-exact), and when it holds a random op, every random op of the
    module with it (random ops are all saved or all recomputed, or the recompute would draw other
    numbers). Only where the module must store its random ops (``force_store_random``: no tensor
    inputs) are the decisions kept and the cache allowed to hold mutated entries. Returns the
    decisions, how many were turned to recompute, and whether to allow cached mutation."""
    save = list(save)
    parent_of = dict(stats.inplace_ops)
    rand = set(stats.rand_ops)
    groups = [set(g) for h, g in meta.inplace_op_groups.items() if h not in parent_of and len(g) > 1]
    todo = [g for g in groups if any(save[i] for i in g)]
    if not todo:
        return save, 0, False
    if stats.force_store_random and any(g & rand for g in todo):
        return save, 0, True
    drop: set = set()
    while todo:
        g = todo.pop()
        if g <= drop:
            continue
        drop |= g
        if g & rand:
            drop |= rand
            todo += [h for h in groups if h & rand and not h <= drop]
    forced = sum(1 for i in drop if save[i])
    for i in drop:
        save[i] = 0
    return save, forced, False


def _greedy_policy(stats: Any, meta: Any, keep_fraction: float) -> List[int]:
    """Save everything, then recompute in the SAC estimator's greedy order (the ops it always
    recomputes first, then its candidates by memory per recompute time, each with its in-place and
    random groups) until at most ``keep_fraction`` of the module's op memory is kept; the ops it
    always stores stay saved."""
    n, total = len(stats.memory), sum(stats.memory)

    def group(i: int) -> set:
        out = {i} | set(meta.inplace_op_groups.get(i, ())) | set(meta.random_ops_group.get(i, ()))
        return out

    stored = set().union(*(group(i) for i in meta.stored_ops)) if meta.stored_ops else set()
    recompute = set().union(*(group(i) for i in meta.recomputed_ops)) if meta.recomputed_ops else set()
    recompute -= stored
    kept = total - sum(stats.memory[i] for i in recompute)
    for cand in meta.msps_meta:
        if kept <= keep_fraction * total:
            break
        new = group(cand.op_idx) - recompute - stored
        recompute |= new
        kept -= sum(stats.memory[i] for i in new)
    return [0 if i in recompute else 1 for i in range(n)]


@dataclass
class SacIlpPlan:
    """``sac_milp``'s answer at one budget, ready to apply (see the module doc for the terms).

    ``modules``: the checkpointed modules (relative names, e.g. ``layers.3``) with their discard
    ratio and decisions; ``predicted_peak_bytes``: its peak bound, absolute; ``sac_peak_bytes``: the
    same in its own terms; ``recompute_ms`` / ``compute_ms``: its recompute time and its forward +
    backward time estimate (milliseconds); ``op_match``: how the applied policies' op calls
    lined up with the recorded ops (:class:`OpMatch`), over every model this plan was applied to."""

    budget_bytes: int
    outside_bytes: int
    sac_budget_gib: float
    sac_peak_bytes: int
    predicted_peak_bytes: int
    recompute_ms: float
    compute_ms: float
    modules: List[ModuleDecision]
    per_module: str
    profile: SacIlpProfile
    timings_s: Dict[str, float]
    notes: List[str] = field(default_factory=list)
    op_match: OpMatch = field(default_factory=OpMatch)

    @property
    def decisions(self) -> Dict[str, float]:
        """Module name -> discard ratio (``sac_milp``'s first answer, names relative to the model)."""
        return {m.name: m.discard for m in self.modules}

    @property
    def recomputed_bytes(self) -> int:
        """Bytes of op outputs the plan does not keep, summed over its modules (SAC estimator's count)."""
        return sum(m.recomputed_bytes for m in self.modules)

    @property
    def predicted_step_ms(self) -> float:
        """Its estimate of the step: forward + backward + recompute (milliseconds)."""
        return self.compute_ms + self.recompute_ms

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap, in place, every chosen module of ``model`` (a model of the profiled structure, e.g.
        a fresh deep copy) with PyTorch's ``checkpoint_wrapper`` (non-reentrant
        ``torch.utils.checkpoint``): no ``context_fn`` for a whole-module checkpoint, else
        ``create_selective_checkpoint_contexts`` with a :class:`SacIlpPolicy`. Returns ``model``."""
        import functools

        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                                 CheckpointWrapper,
                                                                                 checkpoint_wrapper)
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        skip = self.profile._skip
        targets = []
        for m in self.modules:
            try:
                module = model.get_submodule(m.name)
            except AttributeError as exc:
                raise ValueError(f"the plan checkpoints {m.name!r}, which this model does not have "
                                 f"(apply a plan to a model of the structure it was profiled on)") from exc
            parent_name, _, attr = m.name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if isinstance(module, CheckpointWrapper) or isinstance(parent, CheckpointWrapper):
                raise ValueError(f"{m.name!r} is already checkpoint-wrapped: apply a plan to a fresh, unwrapped copy")
            targets.append((m, module, parent, attr))

        def context_fn(decision: ModuleDecision) -> Tuple[Any, Any]:
            policy = SacIlpPolicy(decision.func_names, decision.save, skip, self.op_match, decision.random_save)
            return create_selective_checkpoint_contexts(
                policy, allow_cache_entry_mutation=decision.allow_cache_entry_mutation)

        for m, module, parent, attr in targets:
            kwargs = {} if m.whole else {"context_fn": functools.partial(context_fn, m)}
            setattr(parent, attr, checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs))
        return model

    def recipe(self, name: str = "torch_sac_ilp") -> Recipe:
        """This plan as a benchmark recipe (``who="peer"``): ``apply(model, device, threshold)`` wraps
        ``model`` in place (see :meth:`apply`) and returns no byte counter."""

        def apply(model: nn.Module, device: Any, threshold: Any) -> None:
            self.apply(model)

        return Recipe(name, "peer", self.what(), apply)

    def what(self) -> str:
        """One line for a legend."""
        whole = sum(m.whole for m in self.modules)
        return (f"PyTorch sac_ilp at {format_bytes(self.budget_bytes)} (its budget {self.sac_budget_gib:.4f} GiB): "
                f"checkpoint_wrapper on {len(self.modules)} modules ({whole} whole, {len(self.modules) - whole} "
                f"selective, {self.per_module} per-module policy)")

    def report(self) -> str:
        """What it decided and why, in a few lines."""
        p = self.profile
        lines = [
            f"PyTorch sac_ilp plan: budget {format_bytes(self.budget_bytes)} ({self.budget_bytes} B) = "
            f"{self.sac_budget_gib:.6f} GiB for sac_milp + {format_bytes(self.outside_bytes)} outside its estimate",
            f"  predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"(its bound {format_bytes(self.sac_peak_bytes)} "
            f"+ outside); no-checkpoint peak by its estimate {format_bytes(p.no_checkpoint_peak_bytes())}",
            f"  recompute {self.recompute_ms:.2f} ms on a step of {self.compute_ms:.2f} ms by its estimate "
            f"({p.estimate_mode}, trade-off fit: {p.tradeoff_fit})",
        ]
        if not self.modules:
            lines.append("  no module checkpointed")
        lines += [f"  {m.name}: {m.describe()}" for m in self.modules]
        m = self.op_match
        if m.matched or m.realigned or m.unmatched:
            lines.append(f"  applied: {m.matched} op calls matched the recorded ops, {m.realigned} realigned, "
                         f"{m.unmatched} unmatched (recomputed)")
        lines.append("  planning: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings_s.items()))
        lines += [f"  note: {n}" for n in (p.notes + self.notes)]
        return "\n".join(lines)


class _NotALoss(TypeError):
    """``model(*batch)`` did not return a scalar loss (a usage error, not a skip reason)."""


def _batch_of(batch: Union[Sequence[Any], Callable[[], Sequence[Any]]]) -> Tuple[Any, ...]:
    batch = batch() if callable(batch) else batch
    if isinstance(batch, torch.Tensor):
        return (batch,)
    return tuple(batch)


def profile_sac_ilp(model: nn.Module, batch: Union[Sequence[Any], Callable[[], Sequence[Any]]], *,
                    ac_units: Optional[Iterable[str]] = None,
                    estimate_mode: str = "operator-level-benchmark",
                    benchmark_runs: Tuple[int, int] = (2, 3), memoize_op_times: bool = False) -> SacIlpProfile:
    """Run PyTorch's estimators on ``model`` for one step ``model(*batch).backward()`` (``batch``: the
    step's arguments, or a zero-argument callable returning them; the call must return the scalar
    loss) and return the :class:`SacIlpProfile` that plans for any budget.

    As PyTorch's test does, everything runs on a fake copy (``FakeCopyMode`` deep copy,
    ``FakeTensorMode``): ``MemTracker`` over one forward + backward, ``RuntimeEstimator`` over one
    forward + backward, ``SACEstimator`` over one forward; then ``aggregate_stats`` and
    ``parse_module_info``. ``model`` itself, its gradients and the RNG state are left as they were.

    ``ac_units``: the modules ``sac_milp`` may checkpoint (names relative to ``model``, e.g.
    ``layers.0``); default every module below the root that has sub-modules (leaves are never AC
    units for sac_milp; the root is left out because a plan wraps modules in place). ``estimate_mode``:
    one of :data:`ESTIMATE_MODES` (on a CPU only the benchmark one, timed by the CPU clock). The
    trade-off fit has ``aggregate_stats``'s 2 segments. ``benchmark_runs``: on a CPU, the warm-up and
    timed runs of every op (PyTorch's benchmark mode: 2 and 3); fewer make a faster, noisier profile.
    ``memoize_op_times``: on a CPU, time an op once per input shapes/strides/dtypes and arguments
    (identical layers, and the SAC estimator's forward after the runtime estimator's, reuse it);
    PyTorch's benchmark mode times every call, which is the default here.

    :class:`SacIlpUnavailable` with the reason when pulp is missing or an estimator cannot run.
    """
    tools = _torch_tools()
    if estimate_mode not in ESTIMATE_MODES:
        raise ValueError(f"estimate_mode must be one of {ESTIMATE_MODES}, got {estimate_mode!r}")
    device = _model_device(model)
    if device.type == "cpu" and estimate_mode != "operator-level-benchmark":
        raise SacIlpUnavailable(f"RuntimeEstimator's {estimate_mode!r} needs CUDA (the roofline reads the GPU's "
                                "FLOPs and bandwidth); on a CPU use 'operator-level-benchmark'")
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    args = _batch_of(batch)
    timings: Dict[str, float] = {}
    notes: List[str] = []
    counts: Dict[str, int] = {}
    memo: Optional[Dict[Any, float]] = {} if memoize_op_times else None
    pwlf, tradeoff_fit = _pwlf_module()
    printed = io.StringIO()
    rng_devices = [device] if device.type == "cuda" else []
    t_all = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=rng_devices), contextlib.redirect_stdout(printed):
            t0 = time.perf_counter()
            fake_mode = FakeTensorMode()
            with FakeCopyMode(fake_mode):
                fake_model = copy.deepcopy(model)
            fake_model.zero_grad(set_to_none=True)
            with fake_mode:
                fake_args = tuple(fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            timings["fake_copy"] = time.perf_counter() - t0
            # PyTorch's benchmark mode times with torch.cuda.Event: on a CPU the same runs, the CPU clock
            cpu_estimate = _cpu_benchmark_estimate(fake_mode, counts, *benchmark_runs, memo=memo)

            def step() -> None:
                loss = fake_model(*fake_args)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise _NotALoss(f"model(*batch) must return the scalar loss, got {type(loss).__name__}"
                                    + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
                loss.backward()

            with fake_mode:
                t0 = time.perf_counter()
                mem_tracker = tools["MemTracker"]()
                mem_tracker.track_external(fake_model)
                with mem_tracker:
                    step()
                    last = mem_tracker.get_tracker_snapshot("current")
                # A module whose inputs need no gradient gets no post-backward hook (PyTorch's test fills
                # it in with the last snapshot); one whose outputs need none (a rotary embedding) has no
                # backward at all: its pre- and peak-backward snapshots are the last one too (every
                # gradient accumulated, no temporaries), which aggregate_stats needs for every module.
                states = tools["ModState"]
                no_backward = []
                for stats in mem_tracker.memory_tracking.values():
                    if states.PRE_BW not in stats.snapshots:
                        no_backward.append(stats.mod_fqn)
                    for state in (states.PRE_BW, states.PEAK_BW, states.POST_BW):
                        if state not in stats.snapshots:
                            stats.snapshots.setdefault(state, []).append(copy.deepcopy(last))
                if no_backward:
                    notes.append(f"modules with no backward (their outputs need no gradient), taken at the end of "
                                 f"the step: {', '.join(sorted(no_backward))}")
                fake_model.zero_grad(set_to_none=True)
                timings["mem_tracker"] = time.perf_counter() - t0

                t0 = time.perf_counter()
                runtime_estimator = tools["RuntimeEstimator"]()
                with runtime_estimator(estimate_mode_type=estimate_mode):
                    if device.type == "cpu":
                        runtime_estimator._estimate = cpu_estimate
                    step()
                fake_model.zero_grad(set_to_none=True)
                timings["runtime_estimator"] = time.perf_counter() - t0

                t0 = time.perf_counter()
                sac_estimator = tools["SACEstimator"]()
                sac_estimator(estimate_mode_type=estimate_mode)
                if device.type == "cpu":
                    sac_estimator._estimate_runtime = cpu_estimate
                with sac_estimator:
                    loss = fake_model(*fake_args)
                loss.backward()
                fake_model.zero_grad(set_to_none=True)
                timings["sac_estimator"] = time.perf_counter() - t0

                t0 = time.perf_counter()
                with unittest.mock.patch.dict(sys.modules, {"pwlf": pwlf}):
                    info = tools["ilp_utils"].aggregate_stats(fake_model, mem_tracker, runtime_estimator,
                                                              sac_estimator, device)
                graph = tools["ilp_utils"].parse_module_info(info)
                timings["aggregate"] = time.perf_counter() - t0
    except (SacIlpUnavailable, _NotALoss):
        raise
    except Exception as exc:
        raise SacIlpUnavailable(f"PyTorch's sac_ilp estimators cannot run on {type(model).__name__} "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    timings["profile_total"] = time.perf_counter() - t_all

    root = graph.nodes[0]["fqn"]
    rel = {n["fqn"]: n["fqn"][len(root) + 1:] for n in graph.nodes[1:]}
    candidates = [rel[n["fqn"]] for n in graph.nodes[1:] if not n["is_leaf"]]
    if ac_units is None:
        units = candidates
    else:
        units = list(ac_units)
        unknown = sorted(set(units) - set(candidates))
        if unknown:
            raise ValueError(f"ac_units {unknown} are not non-leaf modules sac_ilp profiled; choose from {candidates}")
    sac_stats = {rel[k]: v for k, v in sac_estimator.sac_mod_stats.items() if k in rel}
    greedy = {rel[k]: v for k, v in sac_estimator.sac_mod_greedy_order_meta.items() if k in rel}
    param_bytes = int(graph.nodes[0]["param_per_module"])
    params = list(model.parameters())
    default_baseline = param_bytes + _distinct_bytes(list(model.buffers()) + list(args), exclude=params)
    no_ac_peak, compute_ms = tools["ilp_utils"].get_peak_memory_runtime_baseline(graph)
    if counts.get("untimed"):
        notes.append(f"{counts['untimed']} op calls could not be timed on random inputs (0 ms)")
    return SacIlpProfile(graph=graph, root=root, sac_stats=sac_stats, greedy=greedy, units=units, device=device,
                         estimate_mode=estimate_mode + (" (CPU clock)" if device.type == "cpu" else ""),
                         tradeoff_fit=tradeoff_fit, param_bytes=param_bytes, default_baseline_bytes=default_baseline,
                         sac_no_ac_peak_bytes=int(no_ac_peak), compute_ms=float(compute_ms), timings_s=timings,
                         notes=notes, _skip=tools["OPS_TO_ALWAYS_SKIP"])


def sac_ilp_plan(model: nn.Module, batch: Union[Sequence[Any], Callable[[], Sequence[Any]]],
                 budget: Union[int, str], *, baseline_bytes: Optional[int] = None, per_module: str = "optimal",
                 **profile_kwargs: Any) -> SacIlpPlan:
    """:func:`profile_sac_ilp` then ``profile.plan(budget, ...)``: PyTorch's sac_ilp plan for one
    step ``model(*batch).backward()`` at ``budget`` (absolute peak bytes of that step, or a string
    such as ``"150MiB"``). Raises :class:`SacIlpUnavailable` / :class:`SacIlpInfeasible`."""
    profile = profile_sac_ilp(model, batch, **profile_kwargs)
    return profile.plan(budget, baseline_bytes=baseline_bytes, per_module=per_module)


def sac_ilp_recipe(budget: Union[int, str], batch: Union[Sequence[Any], Callable[[], Sequence[Any]]], *,
                   profile: Optional[SacIlpProfile] = None, name: str = "torch_sac_ilp",
                   baseline_bytes: Optional[int] = None, per_module: str = "optimal",
                   **profile_kwargs: Any) -> Recipe:
    """A :class:`~hyper_parallel.bench.modes.Recipe` (``who="peer"``) for PyTorch's sac_ilp at
    ``budget``: its ``apply(model, device, threshold)`` profiles the first model it is given (or uses
    ``profile``), plans once, and wraps every model it is given with that plan (the benchmark hands
    it fresh copies of one model). It raises :class:`SacIlpUnavailable` (a ``RuntimeError``, the
    recipes' way to say "cannot run here") with the reason, e.g. pulp missing or the budget below
    sac_ilp's minimum. ``recipe.plan()`` (an attribute of the apply function) gives the plan once made."""
    budget_bytes = parse_budget(budget)
    state: Dict[str, Any] = {"profile": profile, "plan": None}

    def apply(model: nn.Module, device: Any, threshold: Any) -> None:
        if state["plan"] is None:
            if state["profile"] is None:
                state["profile"] = profile_sac_ilp(model, batch, **profile_kwargs)
            state["plan"] = state["profile"].plan(budget_bytes, baseline_bytes=baseline_bytes, per_module=per_module)
        state["plan"].apply(model)

    apply.plan = lambda: state["plan"]  # type: ignore[attr-defined]
    return Recipe(name, "peer", f"PyTorch sac_ilp (torch.distributed._tools) at {format_bytes(budget_bytes)}: "
                                "checkpoint_wrapper with selective policies on the modules its MILP chooses", apply)
