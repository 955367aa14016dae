"""The cost model: a plan's predicted peak and step time from a profile and its options' effects.

Peak. The profile's timeline (:class:`~hyper_parallel.planner.profile.Segment` s of the step with
every layer left as it is) is the reference. Wrapping layer ``i`` with an option changes the bytes
live during every segment by its :class:`~hyper_parallel.planner.profile.Effect` for the relation
between layer ``i`` and that segment (:func:`relation`): its own forward, the next layer's forward
(on an accelerator its offload is still in flight then; on a CPU its input is still held), a later
forward or the loss head, the backward of the layer after it (its prefetch), its own backward, or
a segment after its backward. Effects add up over layers, so a segment's bytes under a plan are
its reference peak plus the effects of every layer, and the plan's peak is the largest of them.
Parameters, gradients, inputs and the loss head are in the reference: every plan pays them.

Time. The reference step time plus each layer's effect in seconds (its recompute, the part of its
copies that does not overlap compute, the engine's bookkeeping), as the probes measured it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, List, Optional, Sequence, Tuple

from .profile import Effect, Segment, StepProfile

__all__ = ["unretried", "relation", "contributions", "Prediction", "predict", "segment_bytes"]


def unretried(i: int, layers: int, held: Container[int] = ()) -> bool:
    """Whether the layer chain never offloads layer ``i``'s input (of ``layers``): the second to
    last layer (nothing ends after the last), and a layer whose input the model holds (``held``).
    Such a layer keeps ``next_fwd`` (then ``input_kept``) where the others keep ``later``."""
    return i == layers - 2 or i in held


def relation(i: int, segment: Segment, layers: int, held: Container[int] = ()
             ) -> Optional[Tuple[Tuple[str, int], ...]]:
    """How layer ``i`` (of ``layers``) stands to ``segment``: the relations whose effects add up
    there, with their signs (``None``: the segment is before the layer ran).

    The layer chain offloads a layer's input (skipped while the caller still held it) when the
    layer after next ends. Where that never frees it, the layer keeps the state of the next
    layer's forward (``next_fwd``) through the forward: the second to last layer (nothing ends
    after the last), and a layer whose input the model itself holds on to (``held``: the first
    layer of a Hugging Face model, whose embeddings its forward keeps). From the loss head on,
    where the step's own objects die (a cache in the model's outputs), it keeps the larger of that
    state and the one of a layer whose input was offloaded (``input_kept``); its backward, and the
    one of the layer after it, hold the input on top of theirs (``input_kept - later`` more)."""
    kind, j = segment.kind, segment.layer
    last = i == layers - 1
    kept_input = unretried(i, layers, held)
    if kind == "pre":
        return None
    if kind in ("fwd", "gap") and j < i:
        return None
    if kind == "fwd" and j == i:
        return (("last_fwd" if last else "own_fwd", 1),)
    if kind == "gap" and j == i:
        return (("last_head" if last else "own_gap", 1),)
    if kind == "fwd" and j == i + 1:
        return (("next_fwd", 1),)
    if kind in ("fwd", "gap"):
        if not kept_input:
            return (("later", 1),)
        return (("input_kept" if kind == "gap" and j == layers - 1 else "next_fwd", 1),)
    # kind == "bwd"
    if j < i:
        return (("after_bwd", 1),)
    if j == i and last:
        return (("last_bwd", 1),)
    if j > i + 1:
        return (("input_kept" if kept_input else "later", 1),)
    name = "own_bwd" if j == i else "next_bwd"
    return ((name, 1), ("input_kept", 1), ("later", -1)) if kept_input else ((name, 1),)


def contributions(i: int, segment: Segment, layers: int, held: Container[int] = ()
                  ) -> Tuple[Tuple[str, int], ...]:
    """Every effect of layer ``i`` on ``segment``, with its multiplicity: its :func:`relation` in
    the segment's micro-step, and ``after_bwd`` once per earlier micro-step (gradient accumulation:
    each micro-batch's forward + backward through the layer is over by then)."""
    rel = relation(i, segment, layers, held) or ()
    return rel + (("after_bwd", segment.micro_step),) if segment.micro_step else rel


def segment_bytes(segment: Segment, effects: Sequence[Effect], held: Container[int] = ()) -> int:
    """The predicted peak of ``segment`` when layer ``i`` has ``effects[i]`` (``held``: see
    :func:`relation`)."""
    total = segment.peak
    n = len(effects)
    for i, effect in enumerate(effects):
        total += sum(sign * effect.bytes[name] for name, sign in contributions(i, segment, n, held))
    return total


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted ``peak_bytes`` (at segment ``where``) and ``step_s``."""

    peak_bytes: int
    where: str
    step_s: float


def predict(profile: StepProfile, effects: Sequence[Effect], in_flight: int = 1) -> Prediction:
    """The predicted peak and time of the plan giving layer ``i`` the option with ``effects[i]``.

    ``in_flight``: micro-batches whose forward has run and whose backward has not (a pipeline
    stage holds several, the current one included): each other one keeps what a forward leaves
    for its backward (:func:`retained_bytes`) on top of the step's own timeline."""
    if len(effects) != len(profile.layers):
        raise ValueError(f"predict: {len(effects)} effects for {len(profile.layers)} layers")
    peak, where = -1, ""
    held = profile.held_inputs()
    extra = (in_flight - 1) * retained_bytes(profile, effects)
    for segment in profile.segments:
        value = segment_bytes(segment, effects, held) + extra
        if value > peak:
            peak, where = value, segment.name
    return Prediction(int(peak), where, profile.step_s + profile.micro_steps * sum(e.seconds for e in effects))


def _head(profile: StepProfile) -> Segment:
    """The loss head's segment (of the first micro-step)."""
    return next(s for s in profile.segments if s.kind == "gap" and s.layer == len(profile.layers) - 1)


def reference_retained(profile: StepProfile) -> int:
    """Bytes one micro-batch's forward leaves for its backward with every layer as it is: the
    growth from the start of the step to the end of the forward (the loss head's gap)."""
    return max(0, _head(profile).start - profile.segments[0].start)


def retained_bytes(profile: StepProfile, effects: Sequence[Effect]) -> int:
    """Bytes one micro-batch's forward leaves for its backward under the plan: the reference's
    plus what every layer's effect is once the whole forward has run."""
    head = _head(profile)
    return reference_retained(profile) + segment_bytes(head, effects, profile.held_inputs()) - head.peak


def breakdown(profile: StepProfile, effects: Sequence[Effect], where: str) -> List[Tuple[str, int]]:
    """What the bytes of segment ``where`` are made of, for messages (the parts add up to them):
    live at the step's start (the parameters the step uses, and the rest: optimizer state,
    inputs, gradients kept from before), what the backward made of gradients by then (at most its
    gradients), and the rest (activations kept for backward and the running layer's work)."""
    segment = next(s for s in profile.segments if s.name == where)
    total = segment_bytes(segment, effects, profile.held_inputs())
    start = min(profile.baseline_bytes, total)
    params = min(profile.param_bytes, start)
    grads = min(profile.grad_bytes, total - start) if segment.kind == "bwd" else 0
    return [("parameters", params),
            ("other memory live at the start of the step (optimizer state, inputs, ...)", start - params),
            ("gradients made by the backward", grads),
            ("activations kept for backward and the running layer's working set", total - start - grads)]
