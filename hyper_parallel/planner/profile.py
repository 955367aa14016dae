"""What profiling learns about a training step (framework-neutral records).

One instrumented call of the user's ``step_fn`` gives the step's memory timeline cut into
segments at layer boundaries (:class:`Segment`: the bytes live when it starts and its peak) and,
per layer, the op calls of its forward (:class:`OpRecord`) and the storages autograd saved; a
second, uninstrumented call gives the step time. Layers whose records agree are one
:class:`LayerType` and are probed once.

A probe runs copies of one layer of a type in isolation, chained as the model chains them, once
with every copy left as it is and once with one copy wrapped by a :class:`LayerOption`, and
measures the difference at every segment: an option's :class:`Effect`, in bytes per relation
between the layer and the segment (its own forward, the next layer's forward, a later one, ...),
plus its time per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .options import OpKey

__all__ = ["Segment", "OpRecord", "LayerRecord", "LayerType", "StepProfile", "Effect", "RELATIONS"]


@dataclass
class Segment:
    """A stretch of the step between two layer boundaries.

    ``kind``: ``"pre"`` (before the first layer), ``"fwd"`` (layer ``layer``'s forward), ``"gap"``
    (after layer ``layer``'s forward until the next one starts; after the last layer this is the
    loss head and everything up to the first layer backward), ``"bwd"`` (layer ``layer``'s
    backward, up to the next layer's backward or the end of the step, or the next micro-step).
    ``micro_step``: which forward + backward of the step it is part of (a step accumulating
    gradients over ``k`` micro-batches runs ``k``)."""

    kind: str
    layer: int
    start: int
    peak: int
    micro_step: int = 0

    @property
    def name(self) -> str:
        name = self.kind if self.layer < 0 else f"{self.kind} {self.layer}"
        return f"{name} (micro-step {self.micro_step})" if self.micro_step else name


@dataclass
class OpRecord:
    """One op call of a layer's forward."""

    key: OpKey
    new_bytes: int           # bytes of the storages it created
    saved: bool              # autograd saved (one of) the storages it created
    mutating: bool = False   # it writes to an argument (always recomputed)
    expensive: bool = False  # a matmul-like op (what the fixed recipes save or swap)
    seconds: float = 0.0     # its time, measured by a probe (0 until then)


@dataclass
class LayerRecord:
    """One layer of the stack, as the instrumented step saw it."""

    index: int
    type_key: str
    ops: List[OpRecord]
    saved_sizes: List[int]   # bytes of every storage autograd saved in its forward (each once)
    input_bytes: int         # bytes of its input activation
    forward_s: float = 0.0
    backward_s: float = 0.0
    #: the model still held its input when the next layer ended (the first layer of a Hugging
    #: Face model: its forward keeps the embeddings), so the layer chain cannot offload it
    input_held: bool = False
    #: the step runs the layer's backward (not so for a frozen prefix: no gradient reaches it,
    #: autograd saves nothing there, and leaving it as it is is its only option)
    backward: bool = True
    #: the shape of its input activation
    input_shape: Tuple[int, ...] = ()


@dataclass
class LayerType:
    """Layers that profiled the same (class, parameters, inputs, ops, saved storages)."""

    key: str
    layers: List[int]
    record: LayerRecord      # the first layer's
    probe_inputs: Any = None  # what a prober needs to run the layer alone (framework objects)


#: How a layer stands to a segment of the step; an :class:`Effect` gives its bytes for each.
RELATIONS = (
    "own_fwd",       # the segment is the layer's own forward
    "own_gap",       # right after it (before the next layer starts)
    "next_fwd",      # the next layer's forward
    "later",         # a later forward, the head, or a backward two or more layers after it
    "input_kept",    # the same (from the head on) for a layer whose input is never offloaded: the
                     # larger of "next_fwd" and "later" (see cost.relation)
    "next_bwd",      # the backward of the layer after it (prefetching it on an accelerator)
    "own_bwd",       # its own backward
    "after_bwd",     # a segment after its backward
    "last_fwd",      # as the last layer: its own forward
    "last_head",     # as the last layer: the loss head after it
    "last_bwd",      # as the last layer: its own backward
)


@dataclass
class Effect:
    """What one :class:`LayerOption` changes against leaving the layer as it is: bytes per relation
    (``RELATIONS``; negative frees memory) and seconds per step. ``measured``: by a probe (else
    modelled from the probes of its type's other options); ``noise``: how far two timings of it
    differed (seconds)."""

    bytes: Dict[str, int]
    seconds: float
    measured: bool = False
    noise: float = 0.0

    def __getitem__(self, relation: str) -> int:
        return self.bytes[relation]


@dataclass
class StepProfile:
    """Everything the planner knows about the step (see the module docstring)."""

    device: str
    segments: List[Segment]
    layers: List[LayerRecord]
    types: Dict[str, LayerType]
    baseline_bytes: int      # live at the start of the step
    peak_bytes: int          # the step's peak, as profiled
    step_s: float            # the step's time, uninstrumented
    param_bytes: int         # the parameters the step reached
    grad_bytes: int          # the gradients its backward makes (of the leaves its forward used)
    copy_bytes_per_s: float  # host <-> device copy bandwidth (one direction)
    overlaps: bool           # copies run on a copy stream beside compute (an accelerator)
    notes: List[str] = field(default_factory=list)
    #: forward + backward passes through the stack per step (gradient accumulation: one per
    #: micro-batch); each runs every layer's option once
    micro_steps: int = 1

    def type_of(self, layer: int) -> LayerType:
        return self.types[self.layers[layer].type_key]

    def held_inputs(self) -> frozenset:
        """The layers whose input the model holds on to (``LayerRecord.input_held``)."""
        return frozenset(r.index for r in self.layers if r.input_held)
