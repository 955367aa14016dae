"""Choosing one option per layer: the fastest assignment whose predicted peak fits the budget.

The cost model (:mod:`hyper_parallel.planner.cost`) makes every segment's bytes a sum of
per-layer effects, and a layer's effect on a segment depends only on how the two stand: its own
segments, the next layer's, the segments after it. So the bytes of layer ``j``'s segments are

    reference + T + effect(o[j-1], near relation) + effect(o[j], own relation)

where ``T`` sums the ``later`` effects of layers ``0 .. j-2``. A dynamic programme over the layers
with the state ``(T, o[j-1])`` is then exact: :func:`solve` keeps, for every value of ``T`` (in
steps of ``1/resolution`` of its range, rounded up: a plan it accepts fits) and every option of
the previous layer, the fastest way there; :func:`min_peak` keeps the smallest peak instead.
Rounding down instead of up gives a relaxation: :func:`lower_bound` (no mix of the options can be
faster at this budget). :func:`solve_milp` states the same problem as a mixed-integer programme
(``scipy.optimize.milp``, HiGHS; optional) to check the programme, and :func:`lp_bound` its LP
relaxation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .cost import contributions, relation, segment_bytes, unretried
from .profile import Effect, Segment

__all__ = ["Problem", "solve", "exact_peak", "min_peak", "lower_bound", "solve_milp", "lp_bound", "have_scipy"]

_INF = float("inf")
_TIE = 1e-12  # seconds: what one option further down a layer's list costs, to break ties


@dataclass
class Problem:
    """One planning problem: per layer its candidate effects (``options[i][k]``: layer ``i``'s
    ``k``-th option) and the reference segments."""

    segments: Sequence[Segment]
    options: Sequence[Sequence[Effect]]
    held: frozenset = frozenset()  # layers whose input the model holds (cost.relation)
    #: micro-batches whose forward has run and whose backward has not, the current one included
    #: (a pipeline stage): each other one keeps ``retained`` bytes plus every layer's effect at
    #: the end of the forward on top of every segment (see ``cost.predict``)
    in_flight: int = 1
    retained: float = 0.0

    def head_value(self, i: int, effect: Effect) -> float:
        """What layer ``i`` with ``effect`` keeps once the whole forward has run."""
        return _value(effect, relation(i, _head(self.layers), self.layers, self.held))

    def carried(self, i: int, effect: Effect) -> float:
        """What layer ``i`` with ``effect`` adds to the segments after the next layer's (``T``)."""
        # (an unretried layer's state before the head, next_fwd, is at most input_kept: the
        # programme charges the larger to every segment, the exact prediction tells them apart)
        return float(effect.bytes["input_kept" if unretried(i, self.layers, self.held) else "later"])

    @property
    def layers(self) -> int:
        return len(self.options)


# ---------------------------------------------------------------------------- the constraints
def _layer_constraints(problem: Problem) -> List[List[Tuple[float, Tuple[Tuple[str, int], ...], Tuple[Tuple[str, int], ...]]]]:
    """For each layer ``j``: the segments whose bytes are decided once ``o[j]`` is known, as
    ``(constant, relations of layer j-1, relations of layer j)``; ``constant`` is the reference
    peak plus the worst case of the ``after_bwd`` effects (about zero) of the layers after ``j`` and,
    in a later micro-step of gradient accumulation, of every layer's earlier micro-steps. Segments
    in which a layer ``i < j - 1`` stands other than ``later`` do not exist."""
    n = problem.layers
    worst_after = [max(e.bytes["after_bwd"] for e in problem.options[i]) for i in range(n)]
    per_layer: List[list] = [[] for _ in range(n)]
    for s in problem.segments:
        if s.kind == "pre":
            continue
        j = s.layer
        # the last layer whose relation to s is not "after_bwd": s is decided once it is placed
        owner = j
        earlier = s.micro_step * sum(worst_after[i] for i in range(n) if i not in (owner - 1, owner))
        constant = s.peak + sum(worst_after[i] for i in range(owner + 1, n)) + earlier
        prev = contributions(owner - 1, s, n, problem.held) if owner >= 1 else None
        own = contributions(owner, s, n, problem.held)
        for i in range(owner - 1):
            rel = relation(i, s, n, problem.held)
            carried = ("input_kept", "next_fwd") if unretried(i, n, problem.held) else ("later",)
            if rel is not None and (len(rel) != 1 or rel[0] not in [(c, 1) for c in carried]):
                raise AssertionError(f"segment {s.name}: layer {i} stands {rel}, not {carried!r}")
        per_layer[owner].append((constant, prev or (), own))
    return per_layer


def _value(effect: Effect, rel: Tuple[Tuple[str, int], ...]) -> float:
    return float(sum(sign * effect.bytes[name] for name, sign in rel))


def _pre_peak(problem: Problem) -> float:
    return max((s.peak for s in problem.segments if s.kind == "pre"), default=0.0)


# ---------------------------------------------------------------------------- the programme
class _Grid:
    """Values of ``T`` (the summed ``later`` effects of the layers before the previous one) on a
    grid of ``resolution`` steps over their possible range. ``up``: every step rounds up (a
    choice accepted on the grid fits); else down (a relaxation). Room is left for the rounding
    of ``layers`` steps on either side."""

    def __init__(self, problem: Problem, resolution: int, up: bool) -> None:
        olds = [[problem.carried(i, e) for e in opts] for i, opts in enumerate(problem.options)]
        low = float(min(0, sum(min(o) for o in olds)))
        high = float(max(0, sum(max(o) for o in olds)))
        self.step = max(high - low, 1.0) / max(1, resolution)
        self.pad = problem.layers + 2
        self.low = low - self.pad * self.step
        self.size = resolution + 2 * self.pad + 1
        self.up = up
        self.values = self.low + self.step * np.arange(self.size)  # the T each cell stands for

    def cells(self, delta: float) -> int:
        q = delta / self.step
        return int(math.ceil(q - 1e-9)) if self.up else int(math.floor(q + 1e-9))

    def origin(self) -> int:
        return self.cells(-self.low)


def _constant_matrix(constraints, prev: Sequence[Optional[Effect]], opts: Sequence[Effect]) -> np.ndarray:
    """``C[p, o]``: the largest of layer ``j``'s segments minus ``T`` (every segment adds ``T``
    once), with the previous layer's option ``p`` and this layer's ``o``."""
    out = np.full((len(prev), len(opts)), -_INF)
    for constant, prev_rel, own_rel in constraints:
        pv = np.array([_value(e, prev_rel) if e is not None else 0.0 for e in prev])
        ov = np.array([_value(e, own_rel) for e in opts])
        np.maximum(out, constant + pv[:, None] + ov[None, :], out=out)
    return out


def _shift_cells(a: np.ndarray, move: int) -> np.ndarray:
    """``a[:, k]`` moved to ``a[:, k + move]``; cells pushed past an edge merge into it (by their
    minimum: only a relaxation's rounding ever gets there, the grid has room for the rest)."""
    if move == 0:
        return a
    out = np.full_like(a, _INF)
    if move > 0:
        out[:, move:] = a[:, :-move]
        out[:, -1] = np.minimum(out[:, -1], a[:, -move:].min(axis=1))
    else:
        m = -move
        out[:, :-m] = a[:, m:]
        out[:, 0] = np.minimum(out[:, 0], a[:, :m].min(axis=1))
    return out


def _head(layers: int) -> Segment:
    return Segment("gap", layers - 1, 0, 0)


def _run(problem: Problem, budget: Optional[float], resolution: int, up: bool, minimise_peak: bool,
         cap: Optional[float] = None) -> Tuple[float, Optional[List[int]]]:
    """The dynamic programme: minimise the time under ``budget`` (or the peak, ``minimise_peak``).
    Returns the best value and the chosen option of every layer (``None`` if nothing fits).

    ``cap``: with micro-batches in flight, the most a micro-batch may keep at the end of its
    forward beyond the reference (every segment then carries ``in_flight - 1`` of them at that
    size, and a choice keeping more is refused)."""
    n = problem.layers
    if n == 0:
        raise ValueError("a plan needs at least one layer")
    pre = _pre_peak(problem)
    if budget is not None and pre > budget:
        return _INF, None
    extra = (problem.in_flight - 1) * (problem.retained + cap) if cap is not None else 0.0
    if budget is not None and pre + extra > budget:
        return _INF, None
    grid = _Grid(problem, resolution, up)
    constraints = [[(c + extra, prev, own) for c, prev, own in layer] for layer in _layer_constraints(problem)]
    # value[p, cell]: the best so far with the previous layer's option p and T in cell (layer 0
    # has no previous layer: one pseudo-option with no effects, at T = 0).
    value = np.full((1, grid.size), _INF)
    value[0, grid.origin()] = pre + extra if minimise_peak else 0.0
    prev: Sequence[Optional[Effect]] = [None]
    backs: List[np.ndarray] = []
    moves: List[List[int]] = []
    for j in range(n):
        opts = problem.options[j]
        # (ties go to the earlier option: the options of a layer come simplest first)
        seconds = np.array([e.seconds for e in opts]) + _TIE * np.arange(len(opts))
        c = _constant_matrix(constraints[j], prev, opts)
        move = [grid.cells(problem.carried(j - 1, pe)) if pe is not None else 0 for pe in prev]
        stacked = np.full((len(prev), len(opts), grid.size), _INF)
        for p in range(len(prev)):
            row = value[p]
            if not np.isfinite(row).any():
                continue
            if minimise_peak:
                cand = np.maximum(row[None, :], c[p][:, None] + grid.values[None, :])
            else:
                fits = c[p][:, None] + grid.values[None, :] <= budget
                cand = np.where(fits, row[None, :] + seconds[:, None], _INF)
            stacked[p] = _shift_cells(cand, move[p])
        back = np.argmin(stacked, axis=0)
        value = np.take_along_axis(stacked, back[None], axis=0)[0]
        backs.append(back)
        moves.append(move)
        prev = opts
    if cap is not None:  # what the choice keeps at the end of the forward must stay under the cap
        kept = np.array([problem.head_value(n - 1, e) for e in prev])[:, None] + grid.values[None, :]
        value = np.where(kept <= cap + 1e-9, value, _INF)
    best = float(value.min())
    if not np.isfinite(best):
        return _INF, None
    o, cell = (int(v) for v in np.unravel_index(int(np.argmin(value)), value.shape))
    choice = [0] * n
    for j in range(n - 1, -1, -1):
        choice[j] = o
        p = int(backs[j][o, cell])
        o, cell = p, int(min(max(cell - moves[j][p], 0), grid.size - 1))
    return best, choice


_CAPS = 16  # caps tried when micro-batches are in flight


def _caps(problem: Problem) -> List[Optional[float]]:
    """The caps on what a micro-batch keeps that :func:`solve` tries (``[None]``: one in flight)."""
    if problem.in_flight <= 1:
        return [None]
    n = problem.layers
    values = [[problem.head_value(i, e) for e in opts] for i, opts in enumerate(problem.options)]
    low, high = sum(min(v) for v in values), sum(max(v) for v in values)
    return [low + (high - low) * k / (_CAPS - 1) for k in range(_CAPS)]


def _best(problem: Problem, budget: Optional[float], resolution: int, up: bool, minimise_peak: bool
          ) -> Tuple[float, Optional[List[int]]]:
    """The programme over the caps (one run without micro-batches in flight): a coarse grid, then
    twice a finer one just below the best cap (a choice keeping less than its cap is also found
    with a tighter one, which charges the other micro-batches less)."""
    caps = _caps(problem)
    runs = {cap: _run(problem, budget, resolution, up, minimise_peak, cap) for cap in caps}
    for _ in range(2 if len(caps) > 1 else 0):
        ordered = sorted(runs)
        b = min(range(len(ordered)), key=lambda k: runs[ordered[k]][0])
        if b == 0 or not math.isfinite(runs[ordered[b]][0]):
            break
        low, high = ordered[b - 1], ordered[b]
        for k in range(1, _CAPS - 1):
            cap = low + (high - low) * k / (_CAPS - 1)
            runs[cap] = _run(problem, budget, resolution, up, minimise_peak, cap)
    return min(runs.values(), key=lambda r: r[0])


def _seconds(problem: Problem, choice: Sequence[int]) -> float:
    return sum(problem.options[i][k].seconds for i, k in enumerate(choice))


def exact_peak(problem: Problem, choice: Sequence[int]) -> float:
    """The predicted peak of ``choice`` without rounding (``cost.predict``'s, over the problem's
    segments)."""
    effects = [problem.options[i][k] for i, k in enumerate(choice)]
    extra = (problem.in_flight - 1) * (problem.retained + sum(problem.head_value(i, e) for i, e in enumerate(effects)))
    return max((segment_bytes(s, effects, problem.held) for s in problem.segments), default=0.0) + extra


def solve(problem: Problem, budget: float, resolution: int = 2048) -> Optional[List[int]]:
    """The fastest choice of one option per layer whose predicted peak fits ``budget`` (bytes are
    rounded up, so a choice returned fits), or ``None`` if none does. With micro-batches in
    flight, the programme runs once per cap on what each keeps (a grid of them, refined), which
    makes it exact up to that grid; with scipy installed the MILP, exact, has the last word. At the
    very edge, where the rounding refuses every choice,
    the one with the smallest peak is taken if its exact peak fits."""
    found = _best(problem, budget, resolution, up=True, minimise_peak=False)[1]
    if problem.in_flight > 1 and have_scipy():
        # The caps make the programme approximate here; the MILP states the problem exactly.
        exact = solve_milp(problem, budget)
        if exact is not None and (found is None or _seconds(problem, exact) < _seconds(problem, found)):
            found = exact
    if found is None:
        _, smallest = _best(problem, None, resolution, up=True, minimise_peak=True)
        if smallest is not None and exact_peak(problem, smallest) <= budget:
            return smallest
    return found


def min_peak(problem: Problem, resolution: int = 2048) -> Tuple[float, List[int]]:
    """The smallest predicted peak any choice reaches (bytes rounded up), and that choice."""
    best, choice = _best(problem, None, resolution, up=True, minimise_peak=True)
    assert choice is not None
    return best, choice


def lower_bound(problem: Problem, budget: float, resolution: int = 2048) -> float:
    """A lower bound on the time of any choice that fits ``budget``: the programme with bytes
    rounded down (a relaxation of the constraints); ``inf`` if not even that fits. (With
    micro-batches in flight, a bound over the caps tried.)"""
    return _best(problem, budget, resolution, up=False, minimise_peak=False)[0]


# ---------------------------------------------------------------------------- MILP (optional)
def have_scipy() -> bool:
    """Whether ``scipy.optimize.milp`` is available (the ``planner`` extra)."""
    try:
        from scipy.optimize import milp  # noqa: F401  (an optional dependency)
    except ImportError:
        return False
    return True


def _matrices(problem: Problem, budget: float):
    n = problem.layers
    offsets, total = [], 0
    for opts in problem.options:
        offsets.append(total)
        total += len(opts)
    rows, rhs = [], []
    carried = np.zeros(total)  # what each option keeps at the end of the forward (micro-batches in flight)
    for i, opts in enumerate(problem.options):
        for k, e in enumerate(opts):
            carried[offsets[i] + k] = problem.head_value(i, e)
    others = problem.in_flight - 1
    for s in problem.segments:
        row = others * carried
        for i in range(n):
            rel = contributions(i, s, n, problem.held)
            if not rel:
                continue
            for k, e in enumerate(problem.options[i]):
                row[offsets[i] + k] += _value(e, rel)
        rows.append(row)
        rhs.append(budget - s.peak - others * problem.retained)
    one_hot = np.zeros((n, total))
    for i, opts in enumerate(problem.options):
        one_hot[i, offsets[i]:offsets[i] + len(opts)] = 1.0
    cost = np.array([e.seconds for opts in problem.options for e in opts])
    return offsets, np.array(rows), np.array(rhs), one_hot, cost


def solve_milp(problem: Problem, budget: float) -> Optional[List[int]]:
    """The same problem as :func:`solve`, exactly, as a MILP (needs scipy)."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # an optional dependency

    offsets, a, b, one_hot, cost = _matrices(problem, budget)
    constraints = [LinearConstraint(one_hot, 1.0, 1.0)]
    if len(a):
        constraints.append(LinearConstraint(a, -np.inf, b))
    result = milp(cost, constraints=constraints, integrality=np.ones_like(cost), bounds=Bounds(0, 1))
    if result.x is None:
        return None
    x = result.x
    return [int(np.argmax(x[offsets[i]:offsets[i] + len(opts)])) for i, opts in enumerate(problem.options)]


def lp_bound(problem: Problem, budget: float) -> float:
    """The LP relaxation's optimum (needs scipy): no fractional mix of options is faster."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # an optional dependency

    _, a, b, one_hot, cost = _matrices(problem, budget)
    constraints = [LinearConstraint(one_hot, 1.0, 1.0)]
    if len(a):
        constraints.append(LinearConstraint(a, -np.inf, b))
    result = milp(cost, constraints=constraints, integrality=np.zeros_like(cost), bounds=Bounds(0, 1))
    return float(result.fun) if result.x is not None else _INF
