"""``MemoryPlan``: what the planner chose for every layer, what it predicts, and how to apply it."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from hyper_parallel.core.backend import active_backend
from hyper_parallel.core.swap_manager import SwapManager
from hyper_parallel.core.wrapping import wrapper_of

from .budget import format_bytes
from .options import LayerOption, OpKey

__all__ = ["MemoryPlan", "LayerChoice", "PLAN_FORMAT"]

PLAN_FORMAT = "hyper_parallel.memory_plan/1"


@dataclass
class LayerChoice:
    """One layer's part of a plan: its option and what the profile says it keeps, swaps and
    recomputes (bytes of what autograd saved in its forward)."""

    index: int
    type_key: str
    option: LayerOption
    kept_bytes: int
    swapped_bytes: int
    recomputed_bytes: int
    seconds: float  # predicted cost against leaving the layer as it is

    def to_json(self) -> Dict[str, Any]:
        return {"index": self.index, "type": self.type_key, "option": self.option.to_json(),
                "kept_bytes": self.kept_bytes, "swapped_bytes": self.swapped_bytes,
                "recomputed_bytes": self.recomputed_bytes, "seconds": self.seconds}

    @staticmethod
    def from_json(value: Dict[str, Any]) -> "LayerChoice":
        return LayerChoice(int(value["index"]), str(value["type"]), LayerOption.from_json(value["option"]),
                           int(value["kept_bytes"]), int(value["swapped_bytes"]), int(value["recomputed_bytes"]),
                           float(value["seconds"]))


class MemoryPlan:
    """The planner's answer for one layer stack and budget (made by ``plan_memory``).

    Attributes:
        budget_bytes: the budget it was made for.
        predicted_peak_bytes / predicted_step_s: the step's peak and time under the plan: the
            peak measured by running the plan once while planning (``peak_measured``), else the
            cost model's (``modelled_peak_bytes``: the model's, always; ``peak_at``: the part of
            the step where the modelled peak falls); the time is the cost model's.
        lower_bound_step_s: no mix of the weighed options can be faster within the budget.
        min_budget_bytes: the smallest peak any plan of these options reaches.
        reference_peak_bytes / reference_step_s: the step with every layer left as it is
            (``reference_forward_s``: the forward's part of that time).
        microbatches_in_flight: the micro-batches a pipeline stage holds at once, the planned
            one included (1 outside pipelines).
        reserved_bytes: what the budget holds besides the profiled step (a pipeline schedule's
            own buffers, measured by ``plan_pipeline``; 0 otherwise), included in the peaks.
        choices: one :class:`LayerChoice` per layer.

    ``apply()`` wraps the layers in place through the public API (``checkpoint_wrapper`` with a
    generated ``OpTablePolicy``, ``swap_wrapper`` with ``SwapAtLeast``, ``swap_inputs``) and
    chains them (``SwapManager().set_forward_prefetch_layer``) when any layer swaps; ``report()``
    says what it does and predicts; ``to_json()`` / :meth:`from_json` store and reload it.
    """

    def __init__(self, layers: Sequence[Any], choices: List[LayerChoice], seen: Dict[str, List[OpKey]],
                 prober: Any, *, budget_bytes: int, predicted_peak_bytes: int, peak_at: str,
                 predicted_step_s: float, lower_bound_step_s: float, min_budget_bytes: int,
                 reference_peak_bytes: int, reference_step_s: float, device: str, notes: Sequence[str] = (),
                 probes: int = 0, reserved_bytes: int = 0, microbatches_in_flight: int = 1,
                 reference_forward_s: float = 0.0, modelled_peak_bytes: Optional[int] = None,
                 peak_measured: bool = False, input_shape: Sequence[int] = (), baseline_bytes: int = 0) -> None:
        if len(choices) != len(layers):
            raise ValueError(f"MemoryPlan: {len(choices)} layer choices for a stack of {len(layers)} layers")
        self.layers = layers
        self.choices = choices
        self.seen = seen
        self._prober = prober
        self.budget_bytes = budget_bytes
        self.predicted_peak_bytes = predicted_peak_bytes
        self.peak_at = peak_at
        self.predicted_step_s = predicted_step_s
        self.lower_bound_step_s = lower_bound_step_s
        self.min_budget_bytes = min_budget_bytes
        self.reference_peak_bytes = reference_peak_bytes
        self.reference_step_s = reference_step_s
        self.device = device
        self.notes = list(notes)
        self.probes = probes
        self.reserved_bytes = reserved_bytes
        self.microbatches_in_flight = microbatches_in_flight
        self.reference_forward_s = reference_forward_s
        self.modelled_peak_bytes = predicted_peak_bytes if modelled_peak_bytes is None else modelled_peak_bytes
        self.peak_measured = peak_measured
        self.input_shape = tuple(input_shape)
        self.baseline_bytes = baseline_bytes
        self.applied = False
        self._guard: Optional[_ShapeGuard] = None
        self.policies: List[Any] = []
        #: the model the stack was found in (``plan_memory(model, ...)``) and its attribute path
        self.model: Any = None
        self.stack_path: Optional[str] = None

    # ------------------------------------------------------------------ applying
    @property
    def swaps(self) -> bool:
        return any(c.option.swaps for c in self.choices)

    def apply(self, on_new_shape: str = "warn") -> "MemoryPlan":
        """Wrap every layer as planned (in place) and, when a layer swaps, chain the stack for
        the layer-by-layer offload and prefetch. Returns the plan. Applying twice, or to layers
        that are already wrapped, is an error.

        The plan holds for the activation it was made for (:attr:`input_shape`, the first layer's
        input) and any no larger in every dimension. A bigger one (a longer sequence, a bigger
        batch) may peak over the budget: ``on_new_shape`` says what then happens, once per new
        shape: ``"warn"`` (a ``UserWarning`` naming the planned and the seen shapes and the peak
        to expect), ``"raise"`` (a ``RuntimeError`` before the first layer runs) or ``"ignore"``.
        Plan for the largest batch (``plan_memory(..., batches=...)``) to cover a data loader."""
        if on_new_shape not in _ON_NEW_SHAPE:
            raise ValueError(f"MemoryPlan.apply(on_new_shape=...) must be one of {_ON_NEW_SHAPE}, got {on_new_shape!r}")
        if self.applied:
            raise RuntimeError("MemoryPlan.apply(): this plan was applied already; a layer is wrapped once. Make "
                               "a new plan (or MemoryPlan.from_json) for another copy of the model.")
        for choice, layer in zip(self.choices, self.layers):
            kind = wrapper_of(layer)
            if kind is not None:
                raise ValueError(f"MemoryPlan.apply(): layer {choice.index} ({type(layer).__name__}) is already wrapped "
                                 f"({kind}); the plan wraps the layers itself. Plan (and apply) on the unwrapped model.")
        self.applied = True
        for choice, layer in zip(self.choices, self.layers):
            policy = self._prober.wrap(layer, choice.option, self.seen.get(choice.type_key, ()))
            if policy is not None:
                self.policies.append(policy)
        if self.swaps:
            manager = SwapManager()
            for first, second in zip(self.layers, list(self.layers)[1:]):
                manager.set_forward_prefetch_layer(first, second)
        if on_new_shape != "ignore" and self.input_shape:
            self._guard = _ShapeGuard(self, on_new_shape == "raise")
            self.layers[0].register_forward_pre_hook(self._guard)
        return self

    def covers(self, shape: Sequence[int]) -> bool:
        """Whether an input activation of ``shape`` is one the plan holds for: no larger than the
        planned one in any dimension."""
        shape = tuple(shape)
        return len(shape) == len(self.input_shape) and all(s <= p for s, p in zip(shape, self.input_shape))

    def expected_peak(self, shape: Sequence[int]) -> int:
        """About the peak of a step whose first layer gets an activation of ``shape``: what the
        step adds to the memory it starts with, scaled by the activation's size (an estimate;
        memory quadratic in the sequence, eager attention's, grows faster)."""
        planned = _numel(self.input_shape)
        scale = _numel(shape) / planned if planned else 1.0
        grown = self.predicted_peak_bytes - self.baseline_bytes
        return int(self.baseline_bytes + grown * scale)

    # ------------------------------------------------------------------ reading
    def report(self) -> str:
        """What the plan does per layer and what it predicts, as text."""
        how = (f"measured: the plan ran once while planning; modelled {format_bytes(self.modelled_peak_bytes)}"
               if self.peak_measured else "modelled")
        lines = [f"memory plan for {len(self.choices)} layers on {self.device}: budget {format_bytes(self.budget_bytes)}",
                 f"  predicted peak {format_bytes(self.predicted_peak_bytes)} ({how}, at {self.peak_at}), "
                 f"step {self.predicted_step_s * 1e3:.1f} ms (modelled); lower bound {self.lower_bound_step_s * 1e3:.1f} ms",
                 f"  every layer left as it is: peak {format_bytes(self.reference_peak_bytes)}, "
                 f"step {self.reference_step_s * 1e3:.1f} ms; the smallest reachable peak "
                 f"{format_bytes(self.min_budget_bytes)}"]
        if self.input_shape:
            lines.append(f"  holds for a first-layer input of {self.input_shape} and any no larger in every dimension")
        if self.microbatches_in_flight > 1 or self.reserved_bytes:
            lines.append(f"  pipeline stage: {self.microbatches_in_flight} micro-batch(es) in flight, the planned one "
                         f"included; {format_bytes(self.reserved_bytes)} held by the schedule itself (in the peaks)")
        rows = [("layer", "option", "kept", "swapped", "recomputed", "cost ms")]
        for c in self.choices:
            rows.append((str(c.index), c.option.name(), format_bytes(c.kept_bytes), format_bytes(c.swapped_bytes),
                         format_bytes(c.recomputed_bytes), f"{c.seconds * 1e3:+.2f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  " + "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
        used = sorted({c.option.name(): c.option for c in self.choices}.items())
        lines.append("  options:")
        for name, option in used:
            lines.append(f"    {name}: {self._how(option)}")
        if self.swaps:
            lines.append("  the layers are chained (SwapManager().set_forward_prefetch_layer) so that swaps overlap")
        unseen = sum(getattr(p, "unseen", 0) for p in self.policies)
        if self.applied and unseen:
            lines.append(f"  op calls the profile did not see (recomputed, the plan's default): {unseen}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    @staticmethod
    def _how(option: LayerOption) -> str:
        if option.kind == "none":
            return "no wrapper"
        if option.kind == "swap":
            return (f"swap_wrapper(layer, policy_fn=SwapAtLeast({option.swap_min_bytes})): saved tensors of at least "
                    f"{format_bytes(option.swap_min_bytes)} go to host memory")
        if not option.keep:
            return f"checkpoint_wrapper(layer{', swap_inputs=True' if option.swap_inputs else ''}): whole-layer recompute"
        kept = ", ".join(f"{a} {k}" for k, a in option.keep)
        return (f"checkpoint_wrapper(layer, policy_fn=OpTablePolicy(...){', swap_inputs=True' if option.swap_inputs else ''}): "
                f"{kept}; every other op recomputed")

    def __repr__(self) -> str:
        kinds: Dict[str, int] = {}
        for c in self.choices:
            kinds[c.option.name()] = kinds.get(c.option.name(), 0) + 1
        return (f"MemoryPlan(budget={format_bytes(self.budget_bytes)}, peak={format_bytes(self.predicted_peak_bytes)}, "
                f"step={self.predicted_step_s * 1e3:.1f} ms, {kinds})")

    # ------------------------------------------------------------------ storing
    def to_json(self) -> str:
        """The plan as JSON text (load it with :meth:`from_json`)."""
        doc = {"format": PLAN_FORMAT, "framework": self._prober.name, "device": self.device,
               "budget_bytes": self.budget_bytes, "predicted_peak_bytes": self.predicted_peak_bytes,
               "peak_at": self.peak_at, "predicted_step_s": self.predicted_step_s,
               "lower_bound_step_s": self.lower_bound_step_s, "min_budget_bytes": self.min_budget_bytes,
               "reference_peak_bytes": self.reference_peak_bytes, "reference_step_s": self.reference_step_s,
               "notes": self.notes, "probes": self.probes, "stack_path": self.stack_path,
               "reserved_bytes": self.reserved_bytes, "microbatches_in_flight": self.microbatches_in_flight,
               "reference_forward_s": self.reference_forward_s, "modelled_peak_bytes": self.modelled_peak_bytes,
               "peak_measured": self.peak_measured, "input_shape": list(self.input_shape),
               "baseline_bytes": self.baseline_bytes,
               "layers": [c.to_json() for c in self.choices],
               "seen": {k: [key.to_json() for key in keys] for k, keys in sorted(self.seen.items())}}
        return json.dumps(doc, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, layers: Any, prober: Optional[Any] = None) -> "MemoryPlan":
        """The plan stored by :meth:`to_json`, for ``layers`` (the same stack, or another copy of
        it; or the model holding it). ``prober``: the framework's planner part (default: the
        active backend's)."""
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            raise ValueError(f"MemoryPlan.from_json: not a memory plan (expected format {PLAN_FORMAT!r})")
        prober = prober if prober is not None else active_backend().prober()
        if doc["framework"] != prober.name:
            raise ValueError(f"MemoryPlan.from_json: the plan was made on {doc['framework']}, this process runs "
                             f"{prober.name}")
        model = None
        if prober.is_layer(layers) and not prober.is_stack(layers):
            model = layers
            path, layers = prober.find_layers(model)
            if doc.get("stack_path") not in (None, path):
                raise ValueError(f"MemoryPlan.from_json: the plan is for the stack {doc['stack_path']!r}, the model's "
                                 f"is {path!r}")
        layers = list(layers.values()) if hasattr(layers, "values") and hasattr(layers, "keys") else list(layers)
        choices = [LayerChoice.from_json(c) for c in doc["layers"]]
        if len(choices) != len(layers):
            raise ValueError(f"MemoryPlan.from_json: the plan is for {len(choices)} layers, the stack has {len(layers)}")
        seen = {k: [OpKey.from_json(v) for v in keys] for k, keys in doc["seen"].items()}
        return cls(layers, choices, seen, prober, budget_bytes=doc["budget_bytes"],
                   predicted_peak_bytes=doc["predicted_peak_bytes"], peak_at=doc["peak_at"],
                   predicted_step_s=doc["predicted_step_s"], lower_bound_step_s=doc["lower_bound_step_s"],
                   min_budget_bytes=doc["min_budget_bytes"], reference_peak_bytes=doc["reference_peak_bytes"],
                   reference_step_s=doc["reference_step_s"], device=doc["device"], notes=doc.get("notes", ()),
                   probes=doc.get("probes", 0), reserved_bytes=doc.get("reserved_bytes", 0),
                   microbatches_in_flight=doc.get("microbatches_in_flight", 1),
                   reference_forward_s=doc.get("reference_forward_s", 0.0),
                   modelled_peak_bytes=doc.get("modelled_peak_bytes"),
                   peak_measured=bool(doc.get("peak_measured", False)), input_shape=doc.get("input_shape", ()),
                   baseline_bytes=doc.get("baseline_bytes", 0))._found_in(model, doc.get("stack_path"))

    def _found_in(self, model: Any, path: Optional[str]) -> "MemoryPlan":
        self.model, self.stack_path = model, path
        return self


_ON_NEW_SHAPE = ("warn", "raise", "ignore")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class _ShapeGuard:
    """The first layer's forward pre-hook of an applied plan: an activation bigger than the plan
    was made for is a warning (once per shape) or an error (see :meth:`MemoryPlan.apply`)."""

    def __init__(self, plan: MemoryPlan, strict: bool) -> None:
        self.plan = plan
        self.strict = strict
        self.seen: set = set()

    def __call__(self, module: Any, args: tuple) -> None:
        x = args[0] if args else None
        shape = tuple(getattr(x, "shape", ()))
        if not shape or self.plan.covers(shape) or shape in self.seen:
            return
        plan = self.plan
        message = (f"hyper_parallel memory plan: the layer stack's input is {shape}, the plan was made for "
                   f"{plan.input_shape} (and anything no larger): this step may peak at about "
                   f"{format_bytes(plan.expected_peak(shape))}, over the budget of {format_bytes(plan.budget_bytes)}. "
                   "Plan for the largest batch (plan_memory(..., batches=[...]) with a sample of the loader's batches), "
                   "or apply(on_new_shape='raise') to stop such a step.")
        if self.strict:
            raise RuntimeError(message)
        self.seen.add(shape)
        warnings.warn(message, UserWarning, stacklevel=2)

