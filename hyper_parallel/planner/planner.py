"""``plan_memory``: profile the step, weigh every layer's options, choose, and say why."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from hyper_parallel.core.backend import active_backend
from hyper_parallel.core.swap_manager import SwapManager
from hyper_parallel.core.wrapping import wrapper_of

from . import candidates as cand
from . import solver
from .budget import format_bytes, parse_budget
from .chain_prober import OUT_OF_MEMORY, free_after_out_of_memory
from .cost import breakdown, predict, reference_retained
from .distributed import AgreeingProber
from .options import LayerOption, OpKey
from .memory_plan import LayerChoice, MemoryPlan
from .profile import Effect, LayerType, StepProfile

__all__ = ["plan_memory", "Planner", "make_plan"]

#: Where planning says what it is doing (INFO: profile, each probe, solving, each check run;
#: ``logging.getLogger("hyper_parallel.planner").setLevel(logging.WARNING)`` silences it).
log = logging.getLogger("hyper_parallel.planner")

#: At most this many options are probed per layer type while the solution still uses modelled ones.
_MAX_PROBES = 24
#: Options whose times differ by less than this share of the layer's own time (or than twice
#: the timing noise) count as equally fast (``Planner.seconds``).
TIME_TOLERANCE = 0.05
#: A plan is checked by running it at most this many times (each over-budget run tightens the next).
_CHECKS = 4


class Planner:
    """The planner's state for one profiled step: its options per layer type, their effects
    (measured by probes, else modelled), and the solver around them. ``plan_memory`` makes one;
    it can answer several budgets from one profile (the benchmark does)."""

    def __init__(self, layers: Sequence[Any], profile: StepProfile, prober: Any, resolution: int = 2048,
                 microbatches_in_flight: int = 1) -> None:
        if isinstance(microbatches_in_flight, bool) or not isinstance(microbatches_in_flight, int) \
                or microbatches_in_flight < 1:
            raise ValueError(f"microbatches_in_flight must be an int >= 1 (the micro-batches whose forward has run and "
                             f"whose backward has not, the current one included), got {microbatches_in_flight!r}")
        if microbatches_in_flight > 1 and profile.micro_steps > 1:
            raise ValueError("plan_memory: a pipeline stage's step (microbatches_in_flight > 1) runs one micro-batch "
                             f"through the stage; this step_fn runs {profile.micro_steps} (gradient accumulation)")
        self.in_flight = microbatches_in_flight
        self.layers = list(layers)
        self.profile = profile
        self.prober = prober
        self.resolution = resolution
        self.options: Dict[str, List[LayerOption]] = {}
        self.effects: Dict[Tuple[str, LayerOption], Effect] = {}
        self.calibration: Dict[str, cand.Calibration] = {}
        self._references: Dict[str, Any] = {}
        self._derived: Dict[Tuple[Any, ...], Any] = {}  # modelled effects and grouped times, until the next probe
        self.probes = 0
        self.left_out: List[str] = []  # (options whose probe ran out of device memory, said in the plan's notes)
        self.seen: Dict[str, List[OpKey]] = {}
        for key, ltype in profile.types.items():
            self.seen[key] = sorted({op.key for op in ltype.record.ops})
            if not ltype.record.backward:  # (no gradient reaches it: autograd saves nothing there)
                self.options[key] = [cand.NONE]
                continue
            times = prober.op_seconds(ltype)
            for op in ltype.record.ops:
                op.seconds = times.get(op.key, 0.0) / max(1, sum(1 for o in ltype.record.ops if o.key == op.key))
            self.options[key] = cand.candidate_options(ltype, profile.overlaps, profile.copy_bytes_per_s)
            self._calibrate(key, ltype)

    # ------------------------------------------------------------------ effects
    def _measure(self, key: str, option: LayerOption) -> Optional[Effect]:
        """``option``'s probed effect on layers of type ``key`` (``None``: its probe ran out of
        device memory, and the option is left out: :meth:`_leave_out`)."""
        found = self.effects.get((key, option))
        if found is not None and found.measured:
            return found
        if option.kind == "none":
            effect = cand.ZERO
        else:
            ltype = self.profile.types[key]
            log.info("probe %d: %s of %s (layers %s)", self.probes + 1, option.name(), key, ltype.layers)
            ran_out = False
            try:
                effect, self._references[key] = self.prober.probe(ltype, option, self.seen[key],
                                                                  self._references.get(key))
            except self.prober.out_of_memory as exc:
                if option in (cand.RECOMPUTE, cand.RECOMPUTE_SWAP_INPUTS):  # (every other option is modelled from them)
                    raise type(exc)(
                        f"plan_memory: probing {option.name()} on copies of a layer of type {key} ran out of device "
                        "memory, with what autograd saves moved to the host (the step does not fit as it is): the "
                        "device cannot hold the model's state beside a few layers' working set. Plan where more "
                        f"memory is free, or without running on the device: python -m hyper_parallel.plan. ({exc})"
                    ) from exc
                ran_out = True
            if ran_out:  # (outside the except clause: the probe's traceback is gone)
                free_after_out_of_memory()
                return self._leave_out(key, option)
            self.probes += 1
            if key in self.calibration:
                cand.fit(self.calibration[key], option, ltype, effect)
        self.effects[(key, option)] = effect
        self._derived.clear()  # (a measurement can change the calibration, the models and the grouping)
        return effect

    def _leave_out(self, key: str, option: LayerOption) -> None:
        """Planning a step that does not fit as it is: ``option``'s probe (a chain of copies with
        the model's state alive, its neighbours as frugal as they come) ran out of device memory,
        so a plan using it is taken not to fit either; it is no longer weighed for layers of type ``key`` (swap everything: no
        swap option is, their models rest on it)."""
        dropped = [o for o in self.options[key] if o == option or option == cand.SWAP_ALL and o.kind == "swap"]
        self.options[key] = [o for o in self.options[key] if o not in dropped]
        self._derived.clear()
        self.left_out.append(f"layers of type {key}: {', '.join(o.name() for o in dropped)} left out: probing "
                             f"{option.name()} ran out of device memory (planning a step that does not fit as it is)")

    def _calibrate(self, key: str, ltype: LayerType) -> None:
        options = self.options[key]
        rec = self._measure(key, cand.RECOMPUTE)
        rec_in = self._measure(key, cand.RECOMPUTE_SWAP_INPUTS)
        swap_all = next((o for o in options if o == cand.SWAP_ALL), None)
        swap_effect = self._measure(key, swap_all) if swap_all is not None else None  # (None: left out)
        record = ltype.record
        cal = cand.Calibration(rec, rec_in, swap_effect, self.profile.copy_bytes_per_s, self.profile.overlaps,
                               record.forward_s, record.backward_s, len(record.ops))
        if swap_effect is not None and not self.profile.overlaps:
            moved = [s for s in record.saved_sizes if s >= cand.MIN_SWAP_BYTES]
            cal.per_tensor_s = max(0.0, (swap_effect.seconds - 2 * cal.copy_s(sum(moved))) / max(1, len(moved)))
        self.calibration[key] = cal

    def effect(self, key: str, option: LayerOption) -> Effect:
        """The measured effect of ``option`` on layers of type ``key``, else the modelled one."""
        found = self.effects.get((key, option))
        if found is not None:
            return found
        if option.kind == "none":
            return cand.ZERO
        modelled = self._derived.get(("model", key, option))
        if modelled is None:
            modelled = self._derived[("model", key, option)] = cand.model_effect(option, self.profile.types[key],
                                                                                self.calibration[key])
        return modelled

    def tolerance(self, key: str) -> float:
        """The seconds within which two options of type ``key`` count as equally fast: twice the
        noise its probes' timings showed (runs timed in turns, see ``ChainProber.probe``), and at
        least :data:`TIME_TOLERANCE` of the layer's own forward + backward."""
        reference = self._references.get(key)
        layer_s = reference["time"] / 3 if reference and "time" in reference else 0.0
        noise = max((self.effects[(key, o)].noise for o in self.options[key] if (key, o) in self.effects), default=0.0)
        return max(TIME_TOLERANCE * layer_s, 2 * noise)

    def seconds(self, key: str, option: LayerOption) -> float:
        """What ``option`` costs a layer of type ``key`` as choices see it: walking the options in
        the order listed (no wrapper first), each costs the time of the first listed option whose
        time is within :meth:`tolerance` of its own, itself if none is. Options within noise of
        an earlier one then tie with it, and ties go to the option listed first: one step planned
        twice gives one plan, whatever the noise. (Anchored on listed options, not on the fastest
        of a sorted run: two options within noise of each other, ``recompute`` and ``recompute,
        swap inputs``, never land in different groups because a third one moved; and an option's
        cost is never more than the tolerance away from its own time.) An option that is another
        listed one plus swapping the region's inputs does that one's work and more: measured
        faster, it costs that one's time (the noise of two probes, which would otherwise pick
        either of the two, planning the same step twice)."""
        grouped = self._derived.get(("grouped", key))
        if grouped is None:
            tol = self.tolerance(key)
            grouped, anchors = {}, []
            for o in self.options[key]:
                t = self.effect(key, o).seconds
                less = dataclasses.replace(o, swap_inputs=False) if o.swap_inputs else None
                if less in self.options[key]:
                    t = max(t, self.effect(key, less).seconds)
                anchor = next((a for a in anchors if abs(t - a) <= tol), None)
                if anchor is None:  # (no earlier option within noise: this one starts a group)
                    anchors.append(t)
                grouped[o] = t if anchor is None else anchor
            self._derived[("grouped", key)] = grouped
        return grouped[option]

    def _problem(self, measured_only: bool = False) -> Tuple[solver.Problem, List[List[LayerOption]]]:
        per_layer: List[List[LayerOption]] = []
        effects: List[List[Effect]] = []
        for record in self.profile.layers:
            key = record.type_key
            opts = self.options[key]
            if measured_only:
                opts = self._measured(key)
            per_layer.append(opts)
            effects.append([dataclasses.replace(self.effect(key, o), seconds=self.seconds(key, o)) for o in opts])
        return solver.Problem(self.profile.segments, effects, self.profile.held_inputs(), self.in_flight,
                              float(reference_retained(self.profile))), per_layer

    def _solve(self, chooser: Callable[[solver.Problem], Optional[List[int]]]) -> Optional[List[LayerOption]]:
        """Solve, probe the options the solution uses that are still modelled, and solve again
        until the solution rests on measurements only (at most ``_MAX_PROBES`` probes per layer
        type; then the measured options alone)."""
        for _ in range(_MAX_PROBES):
            problem, per_layer = self._problem()
            picked = chooser(problem)
            if picked is None:
                break
            chosen = [per_layer[i][k] for i, k in enumerate(picked)]
            pending = {(r.type_key, o) for r, o in zip(self.profile.layers, chosen)
                       if not self.effect(r.type_key, o).measured}
            if not pending:
                return chosen
            for key, option in sorted(pending, key=lambda p: (p[0], p[1].name())):
                self._measure(key, option)
        problem, per_layer = self._problem(measured_only=True)
        picked = chooser(problem)
        return None if picked is None else [per_layer[i][k] for i, k in enumerate(picked)]

    def _polish(self, chosen: List[LayerOption], budget: int) -> List[LayerOption]:
        """Give back what the programme's rounding took: layer by layer, the fastest measured
        option that keeps the exact prediction within ``budget`` (at a budget the plain step fits,
        every layer goes back to ``none``)."""
        chosen = list(chosen)
        for i, record in enumerate(self.profile.layers):  # (one pass, three tries a layer: cheap)
            here = self.seconds(record.type_key, chosen[i])
            # (at equal time, leaving the layer alone first: a probe's noise can make an option "free")
            seconds = {o: self.seconds(record.type_key, o) for o in self._measured(record.type_key)}
            faster = sorted((o for o, t in seconds.items() if o != chosen[i] and (t < here or t == here and o.kind
                             == "none")), key=lambda o: (seconds[o], o.kind != "none"))
            for option in faster[:3]:
                trial = chosen[:i] + [option] + chosen[i + 1:]
                if predict(self.profile, self.assignment_effects(trial), self.in_flight).peak_bytes <= budget:
                    chosen = trial
                    break
        return chosen

    def _measured(self, key: str) -> List[LayerOption]:
        """The options of type ``key`` whose effect is known, not modelled (``none``'s always is)."""
        return [o for o in self.options[key] if self.effect(key, o).measured]

    def assignment_effects(self, chosen: Sequence[LayerOption]) -> List[Effect]:
        return [self.effect(r.type_key, o) for r, o in zip(self.profile.layers, chosen)]

    # ------------------------------------------------------------------ answers
    def min_budget(self) -> Tuple[int, List[LayerOption], str]:
        """The smallest predicted peak of any plan, the plan reaching it, and where it falls."""
        chosen = self._solve(lambda p: solver.min_peak(p, self.resolution)[1])
        assert chosen is not None
        prediction = predict(self.profile, self.assignment_effects(chosen), self.in_flight)
        return prediction.peak_bytes, chosen, prediction.where

    def plan(self, budget: Union[int, str], reserved_bytes: int = 0,
             measure: Optional[Callable[[List[LayerOption]], Optional[int]]] = None) -> MemoryPlan:
        """The fastest plan whose predicted peak fits ``budget`` (see :func:`plan_memory`).
        ``reserved_bytes``: memory the budget must also hold that the profiled step does not show
        (a pipeline schedule's own buffers, measured by ``plan_pipeline``): the step under the
        plan must fit ``budget - reserved_bytes``, and the plan's predicted, minimum and
        reference peaks include it.

        ``measure(options)``: the step's peak with the layers wrapped so, measured by running it
        (``None``: it could not be run). The plan is then checked: where the measured peak is over
        the budget, what the model missed is taken off the room and the plan made again (a few
        times at most); a plan measured over budget is never returned, and the plan's predicted
        peak is the measured one."""
        budget_bytes = parse_budget(budget)
        reserved = int(reserved_bytes)
        room = budget_bytes - reserved
        target, measured, chosen = room, None, None
        smallest = self.min_budget()[1]
        for check in range(_CHECKS):
            log.info("solving for %s of room", format_bytes(target))
            chosen = self._choose(target)
            if chosen is None and measure is not None and target < room or check == _CHECKS - 1 and measure:
                chosen = smallest  # (tightened past every plan's prediction, or out of tries: the smallest, if it fits)
            if chosen is None or measure is None:
                break
            log.info("checking the plan by running it (%d of at most %d)", check + 1, _CHECKS)
            measured = measure(chosen)
            if measured is None or measured <= room:
                break
            if chosen == smallest:
                chosen = None  # (nothing measures smaller)
                break
            # (the model missed ``measured - predicted``: ask the next plan for that much less; a plan
            # that ran out of device memory says no more than that it is over: half the way down to
            # the smallest plan's peak)
            target -= measured - room if measured != OUT_OF_MEMORY else max(1, (target - self.min_budget()[0]) // 2)
            measured, chosen = None, None
        if chosen is None:
            raise self._no_plan(budget_bytes, reserved, measure)
        effects = self.assignment_effects(chosen)
        prediction = predict(self.profile, effects, self.in_flight)
        minimum, min_plan, _ = self.min_budget()
        if measure is not None:  # (the minimum reported is one a budget can ask for: measured too)
            min_measured = measured if min_plan == chosen else measure(min_plan)
            if min_measured != OUT_OF_MEMORY:  # (else the device could not run it: the model's figure)
                minimum = max(minimum, min_measured or 0)
        problem, _ = self._problem(measured_only=True)
        bound = solver.lower_bound(problem, room, self.resolution)
        if solver.have_scipy():
            bound = max(bound, solver.lp_bound(problem, room))
        step0 = self.profile.step_s
        bound *= self.profile.micro_steps  # (each micro-step runs every layer's option)
        choices = [self._choice(i, o, e) for i, (o, e) in enumerate(zip(chosen, effects))]
        notes = list(self.profile.notes) + self.left_out
        if measure is not None and measured is None:
            notes.append("the plan was not checked by running it: pass the model, or its ModuleList / ModuleDict / "
                         "Sequential, as the stack (a plain list cannot be given copies of the layers), and call the "
                         "layers through it in step_fn")
        peak = prediction.peak_bytes if measured is None else measured
        return MemoryPlan(self.layers, choices, self.seen, self.prober, budget_bytes=budget_bytes,
                          predicted_peak_bytes=peak + reserved, peak_at=prediction.where,
                          predicted_step_s=prediction.step_s, lower_bound_step_s=min(prediction.step_s, step0 + bound),
                          min_budget_bytes=minimum + reserved, reference_peak_bytes=self.reference_peak() + reserved,
                          reference_step_s=step0, device=self.profile.device, notes=notes,
                          probes=self.probes, reserved_bytes=reserved, microbatches_in_flight=self.in_flight,
                          reference_forward_s=self.forward_seconds(), modelled_peak_bytes=prediction.peak_bytes + reserved,
                          peak_measured=measured is not None, input_shape=self.profile.layers[0].input_shape,
                          baseline_bytes=self.profile.baseline_bytes)

    def _choose(self, room: int) -> Optional[List[LayerOption]]:
        """The fastest options whose predicted peak fits ``room`` (``None``: none does)."""
        chosen = self._solve(lambda p: solver.solve(p, room, self.resolution)) if room > 0 else None
        minimum, min_plan, _ = self.min_budget()
        if chosen is None and 0 < minimum <= room:
            chosen = min_plan  # (the programme rounds bytes up: at the very edge only the minimum fits)
        if chosen is not None:
            chosen = self._polish(chosen, room)
        return self._fitting(chosen, room, min_plan, minimum)

    def _no_plan(self, budget_bytes: int, reserved: int,
                 measure: Optional[Callable[[List[LayerOption]], Optional[int]]]) -> ValueError:
        """The error for a budget no plan fits: the smallest peak (measured when it can be, so that
        a budget of that much plans), what it is made of and what to do."""
        minimum, min_plan, where = self.min_budget()
        measured = measure(min_plan) if measure is not None else None
        ran_out = measured == OUT_OF_MEMORY
        measured = None if ran_out else measured
        parts = breakdown(self.profile, self.assignment_effects(min_plan), where)
        if reserved:
            parts.append(("what the pipeline schedule holds besides (measured)", reserved))
        detail = "; ".join(f"{name} {format_bytes(n)}" for name, n in parts if n)
        least = max(minimum, measured or 0) + reserved
        how = (" (measured: that plan ran once)" if measured is not None else
               " (modelled: that plan ran out of device memory when run)" if ran_out else "")
        return ValueError(
            f"plan_memory: no plan fits a budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes): the "
            f"smallest peak any plan reaches is {format_bytes(least)} ({least} bytes){how}, during {where}: "
            f"{detail}. Raise the budget to at least that, or shrink what every plan pays (batch size, "
            "sequence length, parameters and their gradients, the loss head).")

    def _fitting(self, chosen: Optional[List[LayerOption]], room: int, min_plan: List[LayerOption],
                 minimum: int) -> Optional[List[LayerOption]]:
        """``chosen`` if its exact prediction fits ``room``; else the minimum-peak plan
        ``min_plan`` (peak ``minimum``) if that fits; else ``None``. The solver bounds some terms
        (what later layers leave after their backward) and rounds bytes: the exact prediction,
        the one a plan reports, decides."""
        if chosen is not None:
            if predict(self.profile, self.assignment_effects(chosen), self.in_flight).peak_bytes <= room:
                return chosen
        return min_plan if 0 < minimum <= room else None

    def reference_peak(self) -> int:
        """The step's predicted peak with every layer left as it is (each other micro-batch in
        flight keeping what its forward left)."""
        return predict(self.profile, [cand.ZERO] * len(self.profile.layers), self.in_flight).peak_bytes

    def forward_seconds(self) -> float:
        """The forward's part of the profiled step's time: the step time in the ratio of the
        layers' forward and backward times."""
        fwd = sum(r.forward_s for r in self.profile.layers)
        bwd = sum(r.backward_s for r in self.profile.layers)
        return self.profile.step_s * fwd / (fwd + bwd) if fwd + bwd > 0 else self.profile.step_s / 3

    def _choice(self, index: int, option: LayerOption, effect: Effect) -> LayerChoice:
        record = self.profile.layers[index]
        ltype = self.profile.types[record.type_key]
        saved = sum(record.saved_sizes)
        if option.kind == "none":
            kept, swapped = saved, 0
        elif option.kind == "swap":
            swapped = sum(cand.swapped_sizes(option, record))
            kept = saved - swapped
        else:
            kept_units, swapped_units = cand.kept_units(option, ltype)
            kept = sum(u.bytes for u in kept_units)
            swapped = sum(u.bytes for u in swapped_units)
            if option.swap_inputs:
                swapped += record.input_bytes
            else:
                kept += record.input_bytes
        recomputed = max(0, saved - kept - swapped)
        return LayerChoice(index, record.type_key, option, kept, swapped, recomputed, effect.seconds)


def plan_memory(layers: Any, step_fn: Callable[..., Any], budget: Union[int, str, Sequence[Union[int, str]]], *,
                batches: Optional[Sequence[Any]] = None, microbatches_in_flight: int = 1, group: Any = None,
                prober: Optional[Any] = None, resolution: int = 2048) -> Any:
    """Choose SAVE / RECOMPUTE / SWAP for every layer of ``layers`` so that one ``step_fn()`` peaks
    at most at ``budget`` bytes of device memory, as fast as the options allow.

    - ``layers``: the model's layer stack (``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential``
      or a list), not wrapped yet: ``model.model.layers`` in Hugging Face decoders,
      ``model.transformer.h`` in GPT-2; or the model itself, whose stack is found as
      ``find_layer_stack`` finds it (the longest ``ModuleList`` / ``ModuleDict`` of blocks of one
      class; the report names it; none, or two of the same length, is a ``ValueError``). Hugging
      Face models work as they are (no import to add).
    - ``step_fn()``: one training step as the loop runs it, on the same batch every call: the
      forward and backward through the stack, and what goes with them: ``zero_grad``, an
      optimizer step (any ``torch.optim`` optimizer, its state made lazily or not), a scheduler
      step, a ``GradScaler``, ``torch.autocast``, gradient accumulation over several micro-batches
      (each runs every layer's forward, in order, then the backward through the layers a gradient
      reaches: a frozen prefix runs none), frozen layers. The rules: every layer runs its forward
      once per micro-batch, the same layers each time, and each layer gives back an activation
      shaped like its input; anything else is an error saying which rule the step broke. The
      planner calls it several times: once first, so that what a step creates for good (an
      optimizer's state) is there as in training, then twice to profile it, then once per check
      of a plan; afterwards everything it changed is put back as it was (parameters, gradients,
      optimizer, scheduler and scaler state, buffers such as BatchNorm statistics, the random
      number generators): training after planning is bitwise training without it.
    - ``batches``: a sample of the data loader's batches; ``step_fn(batch)`` then takes one, and
      the plan is made for the largest (by the bytes of its tensors). An applied plan warns (or
      raises: ``apply(on_new_shape="raise")``) when a bigger activation comes.
    - ``budget``: bytes (``int``) or a string (``"512MiB"``, ``"6GB"``), or a list of them (one
      profile, one set of probes: a list of plans comes back): the absolute peak device
      memory of one ``step_fn()`` call (``torch.cuda.max_memory_allocated()`` after
      ``reset_peak_memory_stats()`` just before it; on a CPU the live storages, the library's host
      buffers excluded), parameters, gradients, inputs and activations included. On MindSpore:
      ``mindspore.runtime.max_memory_allocated()`` on Ascend / GPU; on its CPU build, which keeps
      no memory statistics, the planner's own count of live tensors, an estimate (see
      ``docs/mindspore.md``).

    - ``microbatches_in_flight``: in a pipeline stage, how many micro-batches have run their
      forward and not yet their backward at the stage's worst moment, the current one included
      (1F1B with ``P`` stages: stage ``s`` holds up to ``P - s``; GPipe: all of them; see
      ``plan_pipeline``): each other one keeps what the plan leaves for its backward, on top of
      the profiled step (``step_fn``: one micro-batch's forward + backward through the stage).
    - ``group``: the data-parallel ranks that must apply the same plan. ``None`` (the default):
      every rank of the default group when ``torch.distributed`` is initialized with more than
      one rank, else this process alone; a process group: its ranks; ``False``: this process
      alone. With more than one rank, every rank of the group calls ``plan_memory`` at the same
      time, with the same budget: each profiles its own step, what the steps are made of in
      bytes must agree exactly (else a ``RuntimeError`` says what differed, on which rank), the
      memory timeline and the times count at the largest rank's, the group's first rank solves
      (every probe runs on every rank; its bytes must agree, its time is the slowest) and every
      rank gets the plan made from its JSON: byte-identical
      plans, so collectives inside recomputed regions run alike everywhere. FSDP2 works as is:
      the profile counts the layer's gathered parameters and the prefetched ones, and probes run
      copies of a sharded layer as a plain module on its unsharded parameters
      (``docs/parallel.md``). MindSpore plans each process alone.

    A budget below what any plan reaches is a ``ValueError`` stating the minimum and what makes it
    up; a budget above the step's peak with every layer left as it is gives a plan that wraps
    nothing. The returned plan is not applied: call ``plan.apply()``. Planning probes copies of
    each kind of layer alone (a few seconds on small models) and resets ``SwapManager``'s
    statistics (``reset_stats``) when done.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import plan_memory
        >>> layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
        ...                                                  torch.nn.Linear(256, 64)) for _ in range(4))
        >>> x = torch.randn(32, 64, requires_grad=True)
        >>> def step():
        ...     h = x
        ...     for layer in layers:
        ...         h = layer(h)
        ...     h.square().mean().backward()
        >>> plan = plan_memory(layers, step, budget=10 << 30)   # plenty: nothing to wrap
        >>> [c.option.kind for c in plan.choices]
        ['none', 'none', 'none', 'none']
    """
    prober = prober if prober is not None else active_backend().prober()
    several = isinstance(budget, (list, tuple))
    budgets = [parse_budget(b) for b in (budget if several else [budget])]
    if not budgets:
        raise ValueError("plan_memory: the list of budgets is empty")
    step, note = _step_of(step_fn, batches)

    def answer(planner: Planner, measure: Optional[Measure]) -> Any:
        plans = [planner.plan(b, measure=measure) for b in budgets]
        for plan in plans:
            if note:
                plan.notes.append(note)
        return plans if several else plans[0]

    return make_plan(layers, step, answer, prober=prober, group=group, microbatches_in_flight=microbatches_in_flight,
                     resolution=resolution, budget=budgets if several else budgets[0])


def _step_of(step_fn: Callable[..., Any], batches: Optional[Sequence[Any]]) -> Tuple[Callable[[], Any], str]:
    """The zero-argument step planning calls: ``step_fn`` itself, or ``step_fn(batch)`` with the
    largest of ``batches`` (by the bytes of its tensors); and what the report says of it."""
    if not callable(step_fn):
        raise TypeError(f"plan_memory: step_fn must be a callable running one training step (forward + backward), "
                        f"got {step_fn!r}")
    try:
        signature = inspect.signature(step_fn)
    except (TypeError, ValueError):  # (a builtin or extension callable: taken as it is)
        signature = None
    if batches is None:
        if signature is not None and not _binds(signature):
            raise TypeError(f"plan_memory: step_fn{signature} takes arguments; planning calls it with none. Pass a "
                            "zero-argument step (a closure over its batch), or batches=[...] (a sample of the data "
                            "loader's batches: step_fn(batch) is planned for the largest)")
        return step_fn, ""
    sample = list(batches)
    if not sample:
        raise ValueError("plan_memory: batches is empty; pass a sample of the data loader's batches")
    if signature is not None and not _binds(signature, sample[0]):
        raise TypeError(f"plan_memory: step_fn{signature} must take one batch: with batches=[...], planning calls "
                        "step_fn(batch) with the largest of them")
    sizes = [_tensor_bytes(b) for b in sample]
    largest = sample[max(range(len(sample)), key=lambda i: sizes[i])]
    note = (f"planned for the largest of {len(sample)} batches ({format_bytes(max(sizes))} of tensors): it holds for "
            "any batch whose layer input is no larger in every dimension")
    return (lambda: step_fn(largest)), note


def _binds(signature: inspect.Signature, *args: Any) -> bool:
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in a batch (nested in dicts, lists and tuples; any framework's
    tensors, by their ``nbytes``)."""
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    nbytes = getattr(value, "nbytes", None)
    return int(nbytes) if hasattr(value, "shape") and isinstance(nbytes, int) else 0


#: ``measure(options)``: the step's peak with the stack wrapped so, measured (``Planner.plan``)
Measure = Callable[[List[LayerOption]], Optional[int]]


def make_plan(layers: Any, step_fn: Callable[[], Any], answer: Callable[[Planner, Optional[Measure]], Any], *,
              prober: Any, group: Any = None, microbatches_in_flight: int = 1, resolution: int = 2048,
              budget: Any = None) -> Any:
    """Profile ``step_fn`` and return ``answer(planner, measure)``, the plan a :class:`Planner` of
    the profile gives (``layers``: a stack or a model, as :func:`plan_memory` takes them): on this
    process, or (``group``: see :func:`plan_memory`) on the group's first rank with the profiles
    and probes of every rank, the plan every rank gets made from its JSON. ``measure`` runs the
    step with the stack wrapped as a plan says (``Planner.plan`` checks its plan with it): this
    process planning alone, one micro-batch in flight; else ``None``. ``budget``: this rank's,
    which every rank of a group must share (checked first, an error on every rank)."""
    model, path, container = None, None, layers
    if prober.is_layer(layers) and not prober.is_stack(layers):
        model = layers
        path, layers = prober.find_layers(model)
        container = prober.submodule(model, path)
    stack = _layer_list(layers, prober)
    settable = container if prober.is_container(container) else None

    measured: Dict[Tuple[LayerOption, ...], Optional[int]] = {}  # (a plan is run once)

    def measure(options: List[LayerOption]) -> Optional[int]:
        key = tuple(options)
        if key not in measured:
            measured[key] = prober.measure_plan(settable, stack, options, [planner_seen[r] for r in type_keys], step_fn)
        return measured[key]

    planner_seen: Dict[str, List[OpKey]] = {}
    type_keys: List[str] = []

    def found(planner: Planner) -> Any:
        planner_seen.update(planner.seen)
        type_keys[:] = [r.type_key for r in planner.profile.layers]
        answered = answer(planner, measure if collectives is None and microbatches_in_flight == 1 else None)
        for plan in answered if isinstance(answered, list) else [answered]:
            if model is not None:
                plan.model, plan.stack_path = model, path
                plan.notes.insert(0, f"layer stack: {type(model).__name__}.{path} ({len(stack)} x "
                                     f"{type(stack[0]).__name__})")
        return answered

    collectives = prober.collectives(group)
    log.info("planning %d layers: one step as training runs it, then the profile (2 calls of step_fn)", len(stack))
    if collectives is None:
        with prober.in_training(step_fn):
            profile = prober.profile_step(stack, step_fn)
            plan = found(Planner(stack, profile, prober, resolution, microbatches_in_flight))
    else:
        if isinstance(budget, list):
            raise ValueError("plan_memory: several budgets are planned by one process: pass group=False (a group "
                             "of ranks agrees on one plan for one budget)")
        budgets = collectives.all_gather(budget)
        if len(set(budgets)) > 1:  # (before any work: every rank raises, none is left waiting)
            raise ValueError(f"plan_memory: the ranks of the group passed different budgets ({budgets} bytes, by "
                             "rank): every rank must pass the same one (for example the smallest of theirs)")
        agreeing = AgreeingProber(prober, collectives)
        with prober.in_training(step_fn):
            profile = agreeing.profile_step(stack, step_fn)
            plan = agreeing.agree(lambda: found(Planner(stack, profile, agreeing, resolution, microbatches_in_flight)),
                                  lambda text: MemoryPlan.from_json(text, stack if model is None else model, prober))
    SwapManager().reset_stats()  # (the probes' traffic is not the user's)
    return plan


def _layer_list(layers: Any, prober: Any) -> List[Any]:
    if isinstance(layers, dict) or hasattr(layers, "items") and not hasattr(layers, "__getitem__"):
        raise TypeError("plan_memory: layers must be a sequence of layers (nn.ModuleList, nn.Sequential, list)")
    try:
        stack = list(layers.values()) if hasattr(layers, "values") and hasattr(layers, "keys") else list(layers)
    except TypeError:
        raise TypeError(f"plan_memory: layers must be a layer stack (nn.ModuleList, nn.Sequential, a list), got "
                        f"{type(layers).__name__}") from None
    if not stack:
        raise ValueError("plan_memory: the layer stack is empty")
    for i, layer in enumerate(stack):
        if not prober.is_layer(layer):
            raise TypeError(f"plan_memory: layer {i} is a {type(layer).__name__}, not a module")
        kind = wrapper_of(layer)
        if kind is not None:
            raise ValueError(f"plan_memory: layer {i} ({type(layer).__name__}) is already wrapped by {kind}; plan on "
                             "the unwrapped layers (the plan wraps them itself when applied)")
    if len({id(layer) for layer in stack}) != len(stack):
        raise ValueError("plan_memory: the same layer object appears twice in the stack")
    return stack
