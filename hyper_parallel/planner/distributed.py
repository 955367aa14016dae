"""Every rank of a data-parallel group plans alike: profiles combined, one rank solves, one plan.

Data-parallel ranks run the same step on equally shaped batches, so their memory is the same,
byte for byte, and only their times differ (noise, a slower host). If each rank planned alone,
timing noise could give them different plans, and a collective inside a region that one rank
recomputes and another does not would diverge. :class:`AgreeingProber` wraps the framework's
prober so that:

- every rank profiles its own step (its collectives, DDP's all-reduce or FSDP2's all-gathers,
  run in step on every rank); the profiles are gathered and combined: what the step is made of
  in bytes (every layer's op calls with their output bytes, the saved tensors' sizes, the
  inputs, the bytes live at the start, parameters, gradients) must be equal on every rank, else
  a ``RuntimeError`` names what differed and on which rank; the memory timeline's segments
  (the same segments on every rank) count at their largest, since where an asynchronous free
  falls against a layer boundary is timing (FSDP2's reshards and prefetches move a layer's
  gathered parameters from one segment to the next, on one rank and not the other, from run to
  run); times are the slowest rank's (the maximum), the copy bandwidth the lowest;
- the first rank of the group solves; every probe and op timing it asks for is run on every rank
  (it broadcasts the request, the others serve it) and combined the same way: bytes must agree,
  seconds are the maximum;
- its plan's JSON is broadcast, and every rank (the first one too) makes its plan from that text,
  so every rank applies byte-identical plan JSON.

A failure on any rank (a probe raising, a budget below the minimum) reaches every rank as an
exception instead of leaving the others waiting in a collective. The collectives themselves are
the framework's (:class:`Collectives`; PyTorch's are in ``backends/torch/collectives.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from .options import LayerOption, OpKey
from .profile import Effect, LayerType, StepProfile

__all__ = ["Collectives", "AgreeingProber", "summarize", "combine_profiles", "combine_effects", "combine_op_seconds"]


class Collectives(Protocol):
    """Object collectives over one process group (the framework supplies them)."""

    #: this process's rank in the group, and the group's size
    rank: int
    size: int

    def all_gather(self, obj: Any) -> List[Any]:
        """``obj`` of every rank of the group, by rank."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """The first rank's ``obj`` (what the others pass is ignored)."""
        ...


def summarize(profile: StepProfile) -> Dict[str, Any]:
    """What ranks compare of a profile, as plain values under readable names: everything in bytes
    (compared exactly) and, under ``"timeline"`` (each segment's bytes at its start and its
    peak), ``"times"`` and ``"copy bytes/s"``, what is combined instead."""
    # (the device's kind: each rank has its own accelerator, cuda:0, cuda:1, ...)
    out: Dict[str, Any] = {"device": profile.device.split(":")[0], "copies overlap compute": profile.overlaps}
    for r in profile.layers:
        out[f"layer {r.index}"] = {
            "kind": r.type_key, "input bytes": r.input_bytes,
            "op calls": [f"{o.key} -> {o.new_bytes} B{' saved' if o.saved else ''}{' mutating' if o.mutating else ''}"
                         for o in r.ops],
            "saved tensor bytes": list(r.saved_sizes), "input held by the model": r.input_held}
    out["segments"] = [seg.name for seg in profile.segments]
    out.update({"bytes live at the start": profile.baseline_bytes,
                "parameter bytes": profile.param_bytes, "gradient bytes": profile.grad_bytes,
                "timeline": [(seg.start, seg.peak) for seg in profile.segments],
                "times": {"step_s": profile.step_s, "forward_s": [r.forward_s for r in profile.layers],
                          "backward_s": [r.backward_s for r in profile.layers]},
                "copy bytes/s": profile.copy_bytes_per_s})
    return out


_COMBINED = ("times", "copy bytes/s", "timeline")


def _first_difference(a: Any, b: Any, where: str) -> Optional[Tuple[str, Any, Any]]:
    """Where two summaries first differ: ``(path, a's value, b's value)``, or ``None``."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return where or "the parts", list(a), list(b)
        for k in a:
            found = _first_difference(a[k], b[k], f"{where}: {k}" if where else str(k))
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where} (how many)", len(a), len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{where} [{i}]")
            if found:
                return found
        return None
    return None if a == b else (where, a, b)


def _disagreement(what: str, path: str, first: Any, other: Any, rank: int) -> RuntimeError:
    return RuntimeError(
        f"plan_memory: the data-parallel ranks disagree on {what}: {path} is {first!r} on rank 0 and {other!r} on "
        f"rank {rank}. One plan must fit every rank, so every rank must run the same step on the same shapes (the "
        "same model, the same batch size per rank); plan each rank alone with group=False where they differ.")


def combine_profiles(local: StepProfile, summaries: Sequence[Dict[str, Any]]) -> StepProfile:
    """This rank's profile ``local`` with every segment's bytes and every time at their maximum
    over the ranks (the copy bandwidth at its minimum), after checking that what every rank's
    step is made of equals rank 0's (``summaries``: :func:`summarize` of each rank's profile)."""
    first = {k: v for k, v in summaries[0].items() if k not in _COMBINED}
    for rank, summary in enumerate(summaries[1:], start=1):
        other = {k: v for k, v in summary.items() if k not in _COMBINED}
        found = _first_difference(first, other, "")
        if found:
            raise _disagreement("the profiled step", *found, rank)
    times = [s["times"] for s in summaries]
    layers = [dataclasses.replace(r, forward_s=max(t["forward_s"][i] for t in times),
                                  backward_s=max(t["backward_s"][i] for t in times))
              for i, r in enumerate(local.layers)]
    by_type = {key: dataclasses.replace(t, record=layers[t.layers[0]]) for key, t in local.types.items()}
    timelines = [s["timeline"] for s in summaries]
    segments = [dataclasses.replace(seg, start=max(t[i][0] for t in timelines), peak=max(t[i][1] for t in timelines))
                for i, seg in enumerate(local.segments)]
    spread = max(max(t[i][k] for t in timelines) - min(t[i][k] for t in timelines)
                 for i in range(len(segments)) for k in (0, 1))
    steps = [t["step_s"] for t in times]
    slowest = max(range(len(steps)), key=lambda r: steps[r])
    memory = ("the same bytes on each" if not spread else
              f"the same step on each, its segments counted at their largest (they differed by up to {spread} bytes)")
    notes = list(local.notes) + [
        f"profiled on {len(steps)} data-parallel ranks, {memory}; times are the slowest rank's "
        f"(step: {steps[slowest] * 1e3:.2f} ms on rank {slowest}, {min(steps) * 1e3:.2f} ms on the fastest)"]
    return dataclasses.replace(local, segments=segments, layers=layers, types=by_type, step_s=max(steps),
                               peak_bytes=max(seg.peak for seg in segments),
                               copy_bytes_per_s=min(s["copy bytes/s"] for s in summaries), notes=notes)


def combine_effects(effects: Sequence[Effect], what: str) -> Effect:
    """One probe's :class:`Effect` on every rank: the bytes must be equal, the seconds are the
    maximum."""
    for rank, effect in enumerate(effects[1:], start=1):
        found = _first_difference(effects[0].bytes, effect.bytes, "bytes changed")
        if found:
            raise _disagreement(what, *found, rank)
    return Effect(dict(effects[0].bytes), max(e.seconds for e in effects), measured=all(e.measured for e in effects),
                  noise=max(e.noise for e in effects))


def combine_op_seconds(times: Sequence[Dict[OpKey, float]], what: str) -> Dict[OpKey, float]:
    """Per-op forward seconds on every rank: the same ops, each at its maximum."""
    for rank, t in enumerate(times[1:], start=1):
        if sorted(t) != sorted(times[0]):
            raise _disagreement(what, "the op kinds", sorted(map(str, times[0])), sorted(map(str, t)), rank)
    return {k: max(t[k] for t in times) for k in times[0]}


class _Failed(RuntimeError):
    """Another rank failed where this one did not; raised to every rank but the failing one."""


class AgreeingProber:
    """A prober whose profiles, probes and op timings are those of every rank of a group,
    combined (see the module docstring); what the planner uses of a prober (``profile_step``,
    ``probe``, ``op_seconds``, ``name``) and :meth:`agree`, which makes the one plan.

    Every rank calls ``profile_step`` and then :meth:`agree`: the first rank runs the planner
    there, the others serve its requests until its plan arrives.
    """

    #: (a probe that runs out of memory on one rank fails planning on every rank: the ranks'
    #: options must stay alike)
    out_of_memory: Tuple[type, ...] = ()

    def __init__(self, prober: Any, collectives: Collectives) -> None:
        self.inner = prober
        self.name = prober.name
        self.group = collectives
        self._profile: Optional[StepProfile] = None
        self._references: Dict[str, Any] = {}  # type key -> this rank's reference runs
        self._broken = False  # a collective reported a failure: every rank knows, and leaves

    @property
    def solving(self) -> bool:
        """Whether this rank is the one that solves (the group's first)."""
        return self.group.rank == 0

    # ------------------------------------------------------------------ what the planner calls
    def profile_step(self, layers: Sequence[Any], step_fn: Callable[[], Any]) -> StepProfile:
        """This rank's profile with the group's times, after checking the group's bytes agree."""
        summaries, local = self._gather("profiling the step", lambda: self.inner.profile_step(layers, step_fn),
                                         summarize)
        self._profile = combine_profiles(local, summaries)
        return self._profile

    def op_seconds(self, ltype: LayerType) -> Dict[OpKey, float]:
        """The op times of ``ltype`` on every rank (rank 0 asks the others), combined: the slowest."""
        self._ask(("op_seconds", ltype.key))
        return self._op_seconds(ltype.key)

    def probe(self, ltype: LayerType, option: LayerOption, seen: Sequence[OpKey],
              reference: Optional[Any] = None) -> Tuple[Effect, Any]:
        """The probe of ``option`` on every rank (rank 0 asks the others), combined: bytes equal, seconds the slowest."""
        self._ask(("probe", ltype.key, option, tuple(seen)))
        return self._probe(ltype.key, option, seen, reference), self._references[ltype.key]

    # ------------------------------------------------------------------ the one plan
    def agree(self, solve: Callable[[], Any], load: Callable[[str], Any]) -> Any:
        """``load(json)`` of the plan the first rank's ``solve()`` makes (its ``to_json()``),
        on every rank: the first solves (its probes run everywhere), the others serve it."""
        if self.solving:
            try:
                text = solve().to_json()
            except Exception as exc:
                if not self._broken:  # (a failure of rank 0 alone: the others still wait for its answer)
                    self.group.broadcast(("error", type(exc).__name__, str(exc)))
                raise
            self.group.broadcast(("plan", text))
            return load(text)
        while True:
            request = self.group.broadcast(None)
            kind = request[0]
            if kind == "plan":
                return load(request[1])
            if kind == "error":
                raise {"ValueError": ValueError, "TypeError": TypeError}.get(request[1], RuntimeError)(
                    f"{request[2]} (raised on the planning rank 0)")
            if kind == "op_seconds":
                self._op_seconds(request[1])
            elif kind == "probe":
                self._probe(request[1], request[2], request[3], self._references.get(request[1]))
            else:
                raise RuntimeError(f"plan_memory: unknown request {kind!r} from rank 0")

    # ------------------------------------------------------------------ helpers
    def _ask(self, request: Tuple[Any, ...]) -> None:
        """Rank 0: tell the other ranks what to run next (they wait in :meth:`agree`)."""
        if not self.solving:
            raise RuntimeError("AgreeingProber: only the group's first rank solves; the others serve it in agree()")
        self.group.broadcast(request)

    def _type(self, key: str) -> LayerType:
        assert self._profile is not None, "profile_step first"
        return self._profile.types[key]

    def _op_seconds(self, key: str) -> Dict[OpKey, float]:
        what = f"the op times of {key}"
        times, _ = self._gather(what, lambda: self.inner.op_seconds(self._type(key)))
        return self._agreed(combine_op_seconds, times, what)

    def _probe(self, key: str, option: LayerOption, seen: Sequence[OpKey], reference: Any) -> Effect:
        what = f"the probe of {option.name()} on {key}"

        def run() -> Effect:
            effect, self._references[key] = self.inner.probe(self._type(key), option, seen, reference)
            return effect

        effects, _ = self._gather(what, run)
        return self._agreed(combine_effects, effects, what)

    def _agreed(self, combine: Callable[..., Any], *args: Any) -> Any:
        """``combine(*args)`` of gathered values: it raises alike on every rank (the same data),
        so every rank knows, and rank 0 sends no error for the others to hear (they left)."""
        try:
            return combine(*args)
        except Exception:
            self._broken = True
            raise

    def _gather(self, what: str, compute: Callable[[], Any],
                share: Callable[[Any], Any] = lambda value: value) -> Tuple[List[Any], Any]:
        """``share(compute())`` of every rank, and this rank's ``compute()``. Every rank takes
        part even if its ``compute`` raised: then every rank raises (the failing one its own
        exception, the others a ``RuntimeError`` naming it), and no rank is left waiting."""
        error: Optional[BaseException] = None
        value: Any = None
        try:
            value = compute()
            mine: Tuple[str, Any] = ("ok", share(value))
        except Exception as exc:  # noqa: BLE001  (re-raised below, after every rank has heard of it)
            error, mine = exc, ("error", f"{type(exc).__name__}: {exc}")
        everyone = self.group.all_gather((what, mine))
        for rank, (their_what, _) in enumerate(everyone):
            if their_what != what:
                self._broken = True  # (every rank sees the same list: every rank raises)
                raise RuntimeError(f"plan_memory: the data-parallel ranks went apart: rank {rank} is at "
                                   f"{their_what!r}, rank {self.group.rank} at {what!r}")
        failed = [(rank, msg) for rank, (_, (status, msg)) in enumerate(everyone) if status == "error"]
        self._broken = bool(failed)
        if error is not None:
            raise error
        if failed:
            rank, msg = failed[0]
            raise _Failed(f"plan_memory: {what} failed on rank {rank}: {msg}")
        return [v for _, (_, v) in everyone], value
