"""A step's timeline cut at layer boundaries, for every framework's prober.

Hooks on the layers mark each layer's forward (a forward pre-hook), the stretch after it (a
forward hook) and its backward, which starts when the gradient of the layer's output is ready (a
gradient hook on that output). :class:`Segments` turns the marks into
:class:`~hyper_parallel.planner.profile.Segment` s of a memory meter's timeline,
:class:`BackwardTimer` times each layer's backward from the same marks, and
:func:`check_layer_events` refuses a step whose marks are not one forward per layer, in order,
then the backward through all of them.

What differs between frameworks is handed to :func:`layer_marks` as two functions: whether
autograd runs a backward now (a recomputation's forward is not a new forward) and which of a
layer's output tensors require a gradient. The hook calls themselves
(``register_forward_pre_hook(hook, with_kwargs=True)``, ``register_forward_hook``,
``Tensor.register_hook``) are named alike in PyTorch and MindSpore. This module imports neither.

Example (with stand-ins for a meter and layers)::

    >>> class Meter:
    ...     current_bytes = 0
    ...     def reset_peak(self): return self.current_bytes
    >>> meter = Meter(); segments = Segments(meter)
    >>> segments.mark("pre", -1); meter.current_bytes = 10; segments.mark("fwd", 0); segments.close()
    >>> [(s.name, s.start, s.peak) for s in segments.segments]
    [('pre', 0, 10), ('fwd 0', 10, 10)]
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

from .profile import Segment

__all__ = ["Meter", "PreHook", "PostHook", "Segments", "BackwardTimer", "layer_marks", "check_layer_events"]

#: ``on_pre(layer index, args, kwargs)``: called at a layer's forward start, after its mark.
PreHook = Callable[[int, tuple, dict], None]
#: ``on_post(layer index, output)``: called at a layer's forward end, before its mark.
PostHook = Callable[[int, Any], None]


class Meter(Protocol):
    """What :class:`Segments` reads of a memory meter (each framework's meters have it)."""

    current_bytes: int

    def reset_peak(self) -> int:
        """The peak since the last call; a new window starts at the bytes live now."""
        ...


class Segments:
    """Cuts a region measured by ``meter`` into :class:`Segment` s, at marks: each segment starts
    at the bytes live at its mark and peaks at the worst moment before the next mark."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.segments: List[Segment] = []
        self.end_bytes = 0
        self._micro_step = 0

    def mark(self, kind: str, layer: int) -> None:
        peak = self.meter.reset_peak()
        if self.segments:
            self.segments[-1].peak = max(self.segments[-1].start, peak)
            if kind == "fwd" and self.segments[-1].kind == "bwd":  # (the next micro-batch's forward)
                self._micro_step += 1
        start = self.meter.current_bytes
        self.segments.append(Segment(kind, layer, start, start, self._micro_step))

    def close(self) -> None:
        """End the last segment (at the end of the measured region); ``end_bytes`` is what is
        live then."""
        self.mark("end", -1)
        self.end_bytes = self.segments.pop().start


class BackwardTimer:
    """:func:`layer_marks`'s target in the timing call of the step: the seconds of each layer's
    backward, from its mark to the next one of the same micro-step (the last layer to run its
    backward has no next mark and is not timed). ``synchronize`` waits for the device's queued
    work before each reading, so that an accelerator's time is the kernels', not their launches'."""

    def __init__(self, now: Callable[[], float], synchronize: Callable[[], None]) -> None:
        self.marks: List[Tuple[int, float]] = []  # (layer, time); layer -1: a forward started
        self._now = now
        self._synchronize = synchronize

    def mark(self, kind: str, layer: int) -> None:
        if kind == "bwd":
            self._synchronize()
            self.marks.append((layer, self._now()))
        elif kind == "fwd" and self.marks and self.marks[-1][0] >= 0:
            self.marks.append((-1, 0.0))

    def backward_times(self) -> Dict[int, float]:
        return {j: t_next - t for (j, t), (k, t_next) in zip(self.marks, self.marks[1:]) if j >= 0 and k >= 0}


def layer_marks(layers: Sequence[Any], target: Any, in_backward: Callable[[], bool],
                grad_outputs: Callable[[Any], Iterable[Any]], on_pre: Optional[PreHook] = None,
                on_post: Optional[PostHook] = None) -> List[Any]:
    """Hooks on ``layers`` calling ``target.mark(kind, index)`` at each layer's forward
    (``"fwd"``), the stretch after it (``"gap"``) and its backward (``"bwd"``: when the gradient of
    one of its outputs that ``grad_outputs`` names is ready; once). Returns the removable handles."""
    handles = []
    for j, layer in enumerate(layers):
        def pre(module: Any, args: tuple, kwargs: dict, j: int = j) -> None:
            if in_backward():  # (a recomputation: not a new forward)
                return
            target.mark("fwd", j)
            if on_pre is not None:
                on_pre(j, args, kwargs)

        def post(module: Any, args: tuple, kwargs: dict, out: Any, j: int = j) -> None:
            if in_backward():
                return
            if on_post is not None:
                on_post(j, out)
            target.mark("gap", j)
            fired = [False]

            def on_grad(grad: Any) -> None:
                if not fired[0]:
                    fired[0] = True
                    target.mark("bwd", j)

            for t in grad_outputs(out):
                t.register_hook(on_grad)

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    return handles


def check_layer_events(segments: Sequence[Segment], n: int, hint: str = "") -> Tuple[int, int]:
    """The step's micro-steps and the first layer whose backward runs, from its segments: ``pre``,
    then per micro-step (one, or one per micro-batch of gradient accumulation) each layer's ``fwd``
    and ``gap`` in order and the ``bwd`` of the layers from the last down to the first one a
    gradient reaches (a frozen prefix runs none), the same layers in every micro-step. Anything
    else is a ``RuntimeError`` naming what the step did (``hint``: how to write the step in the
    framework at hand, appended)."""
    kinds = [(s.kind, s.layer) for s in segments]
    forward = [(k, j) for j in range(n) for k in ("fwd", "gap")]
    micro_steps, first, at = 0, None, 1
    ok = kinds[:1] == [("pre", -1)]
    while ok and at < len(kinds):
        ok = kinds[at:at + len(forward)] == forward
        at += len(forward)
        j = n - 1
        while ok and at < len(kinds) and kinds[at] == ("bwd", j):
            at, j = at + 1, j - 1
        ok = ok and j < n - 1 and (first is None or first == j + 1)
        first = j + 1
        micro_steps += 1
    if not ok or not micro_steps:
        raise RuntimeError(
            "plan_memory: step_fn must run, once per micro-batch (several for gradient accumulation), every layer's "
            "forward once, in order, then the backward through the layers from the last down to the first one a "
            "gradient reaches (a frozen prefix runs none), the same layers each time "
            f"(got the layer events {[f'{k} {j}' for k, j in kinds[:16]]}{'...' if len(kinds) > 16 else ''}). Pass "
            f"the model's layer stack in the order its forward calls it, and a step_fn doing forward + backward{hint}.")
    return micro_steps, first
