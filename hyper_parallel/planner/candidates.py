"""The options the planner weighs for one kind of layer, and their modelled effects.

The options come from the layer's op profile, in the order the issue's rules put them:

- forced decisions: ops that write to an argument are always recomputed (the engine re-runs
  them anyway), parameters and buffers are never candidates (the engine never moves them),
  and saved tensors smaller than :data:`MIN_SWAP_BYTES` are never swapped (the copy's fixed cost
  exceeds what it frees);
- swap where the copy fits: ``swap_wrapper`` with every saved tensor above a size (one option per
  size class, largest first), and in a checkpointed layer an op output is swapped rather than
  recomputed when its copy costs less than re-running the op (on an accelerator: when the copies
  fit the window of the next layer's compute);
- then recompute by time saved per byte: of the op outputs autograd saves, a checkpointed layer
  keeps (saves) the ones that cost the most to drop per byte they hold, one more per option, and
  drops the rest (recomputes or swaps them, whichever is cheaper);
- the fixed recipes users already run (whole-layer recompute with and without swapped inputs,
  PyTorch's selective recipe that saves the matmuls, swap everything, swap the matmuls and the
  inputs and recompute the rest), so that a plan is never slower than the best of them that fits.

Until the probe measures it, an option's :class:`~hyper_parallel.planner.profile.Effect` is
modelled from the measured effects of its type's whole-layer recompute and swap-everything
options, the bytes and times of the ops it keeps or swaps, and the copy bandwidth; the planner
probes every option a solution uses before it returns it, so no plan relies on a model alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .options import NONE, RECOMPUTE, LayerOption, OpKey
from .profile import RELATIONS, Effect, LayerRecord, LayerType

__all__ = ["MIN_SWAP_BYTES", "Unit", "units_of", "swapped_sizes", "kept_units", "candidate_options", "Calibration", "model_effect", "fit", "ZERO",
           "RECOMPUTE", "RECOMPUTE_SWAP_INPUTS", "SWAP_ALL"]

#: Saved tensors below this many bytes are never swapped: moving them costs a copy launch, a
#: host buffer and the engine's bookkeeping, for memory that does not matter.
MIN_SWAP_BYTES = 64 << 10
_SIZE_CLASSES = 6  # swap_wrapper thresholds weighed per layer type
#: relations where what a layer keeps for its backward is on the device
_RETAINED = ("own_gap", "next_fwd", "later", "input_kept", "next_bwd", "last_head")

ZERO = Effect({r: 0 for r in RELATIONS}, 0.0, measured=True)
#: the options every model is calibrated on (measured first)
RECOMPUTE_SWAP_INPUTS = LayerOption("recompute", swap_inputs=True, label="recompute, swap inputs")
SWAP_ALL = LayerOption("swap", MIN_SWAP_BYTES, label="swap")


@dataclass
class Unit:
    """The calls of one op kind in a layer's forward whose outputs autograd saves."""

    key: OpKey
    bytes: int
    seconds: float
    calls: int
    expensive: bool


def units_of(ltype: LayerType) -> List[Unit]:
    """The op kinds of ``ltype`` whose outputs are worth keeping (made new storage that autograd
    saved; not in-place ops), with their bytes and forward seconds summed over calls."""
    out: Dict[OpKey, Unit] = {}
    for op in ltype.record.ops:
        if op.mutating or op.new_bytes <= 0 or not op.saved:
            continue
        unit = out.get(op.key)
        if unit is None:
            unit = out[op.key] = Unit(op.key, 0, 0.0, 0, op.expensive)
        unit.bytes += op.new_bytes
        unit.seconds += op.seconds
        unit.calls += 1
    return list(out.values())


def swapped_sizes(option: LayerOption, record: LayerRecord) -> List[int]:
    """The sizes of the saved tensors that the whole-layer swap ``option`` moves (the rest stay)."""
    return [s for s in record.saved_sizes if s >= max(option.swap_min_bytes, MIN_SWAP_BYTES)]


def kept_units(option: LayerOption, ltype: LayerType) -> Tuple[List[Unit], List[Unit]]:
    """The units whose outputs the selective ``option`` saves, and those it swaps."""
    units = {u.key: u for u in units_of(ltype)}
    saved = [units[k] for k, a in option.keep if a == "save" and k in units]
    swapped = [units[k] for k, a in option.keep if a == "swap" and k in units]
    return saved, swapped


def _expensive_keys(ltype: LayerType) -> List[OpKey]:
    return sorted({op.key for op in ltype.record.ops if op.expensive})


@dataclass
class Calibration:
    """What the models of one layer type rest on: the measured effects of whole-layer recompute
    (with and without swapped inputs) and of swap-everything, the copy bandwidth, whether copies
    overlap compute, and the engine's cost per op call of a selective region (learnt from the
    first selective option measured)."""

    recompute: Effect
    recompute_swap_inputs: Effect
    swap_all: Optional[Effect]
    bytes_per_s: float
    overlaps: bool
    forward_s: float
    backward_s: float
    op_calls: int
    per_call_s: float = 0.0
    per_tensor_s: float = 0.0
    fitted: List[str] = field(default_factory=list)

    def copy_s(self, nbytes: float) -> float:
        """Seconds one direction of copying ``nbytes`` costs the step (the part not hidden)."""
        return nbytes / self.bytes_per_s


def _swap_cost(cal: Calibration, nbytes: int, tensors: int) -> float:
    """Seconds a layer pays to swap ``nbytes`` in ``tensors`` storages (out and back)."""
    copy = cal.copy_s(nbytes)
    if cal.overlaps:  # the offload hides under the next layer's forward, the load under a backward
        exposed = max(0.0, copy - cal.forward_s) + max(0.0, copy - cal.backward_s)
    else:
        exposed = 2 * copy
    return exposed + tensors * cal.per_tensor_s


def candidate_options(ltype: LayerType, overlaps: bool, bytes_per_s: float) -> List[LayerOption]:
    """Every option weighed for ``ltype`` (see the module docstring), without duplicates."""
    units = units_of(ltype)
    out: List[LayerOption] = [NONE, RECOMPUTE, RECOMPUTE_SWAP_INPUTS]
    sizes = sorted({s for s in ltype.record.saved_sizes if s >= MIN_SWAP_BYTES}, reverse=True)
    if sizes:
        out.append(SWAP_ALL)
        for size in sizes[:_SIZE_CLASSES]:
            out.append(LayerOption("swap", size, label=f"swap >= {size} B"))
    expensive = _expensive_keys(ltype)
    if expensive:
        out.append(LayerOption("recompute", keep=tuple((k, "save") for k in expensive), label="save matmuls"))
        out.append(LayerOption("recompute", keep=tuple((k, "swap") for k in expensive), swap_inputs=True,
                               label="swap matmuls + inputs"))

    def drop(u: Unit) -> Tuple[str, float]:
        swap = (2 * u.bytes / bytes_per_s) if not overlaps else 0.0
        if u.bytes >= MIN_SWAP_BYTES * u.calls and swap < u.seconds:
            return "swap", swap
        return "recompute", u.seconds

    ranked = sorted(units, key=lambda u: drop(u)[1] / max(u.bytes, 1), reverse=True)
    for inputs in (False, True):
        for k in range(len(ranked) + 1):
            keep = [(u.key, "save") for u in ranked[:k]]
            keep += [(u.key, "swap") for u in ranked[k:] if drop(u)[0] == "swap"]
            if not keep:
                continue  # whole-layer recompute, above
            label = f"keep {k} of {len(ranked)}" + (", swap inputs" if inputs else "")
            out.append(LayerOption("recompute", keep=tuple(sorted(keep)), swap_inputs=inputs, label=label))
    unique: Dict[LayerOption, LayerOption] = {}
    for option in out:
        unique.setdefault(option, option)
    return list(unique.values())


def model_effect(option: LayerOption, ltype: LayerType, cal: Calibration) -> Effect:
    """The modelled :class:`Effect` of ``option`` (see the module docstring)."""
    if option.kind == "none":
        return ZERO
    record = ltype.record
    if option.kind == "swap":
        if cal.swap_all is None:
            return ZERO
        kept = sum(s for s in record.saved_sizes if MIN_SWAP_BYTES <= s < option.swap_min_bytes)
        moved = swapped_sizes(option, record)
        all_moved = [s for s in record.saved_sizes if s >= MIN_SWAP_BYTES]
        effect = dict(cal.swap_all.bytes)
        for r in _RETAINED + ("own_fwd", "last_fwd", "own_bwd", "last_bwd"):
            effect[r] += kept
        share = (sum(moved) / sum(all_moved)) if all_moved else 0.0
        return Effect(effect, cal.swap_all.seconds * share)
    # recompute
    base = cal.recompute_swap_inputs if option.swap_inputs else cal.recompute
    if option.whole_recompute:
        return base
    kept_ops = dict(option.keep)
    saved, swapped = kept_units(option, ltype)
    saved_bytes = sum(u.bytes for u in saved)
    swapped_bytes = sum(u.bytes for u in swapped)
    avoided = sum(u.seconds for u in units_of(ltype) if u.key in kept_ops)
    effect = dict(base.bytes)
    for r in _RETAINED:
        effect[r] += saved_bytes
    if cal.overlaps:
        effect["next_fwd"] += swapped_bytes  # still in flight while the next layer runs
        effect["last_head"] += swapped_bytes  # the last layer's swapped outputs stay (nothing follows)
        effect["input_kept"] = max(effect["input_kept"], effect["next_fwd"])
    effect["own_fwd"] += saved_bytes + swapped_bytes
    effect["last_fwd"] += saved_bytes + swapped_bytes
    seconds = (base.seconds - avoided + _swap_cost(cal, swapped_bytes, sum(u.calls for u in swapped))
               + 2 * cal.per_call_s * cal.op_calls)
    return Effect(effect, seconds)


def fit(cal: Calibration, option: LayerOption, ltype: LayerType, measured: Effect) -> None:
    """Learn from a measured option what the models do not know: the engine's seconds per op call
    of a selective region (from the first selective checkpoint measured) and per swapped tensor
    (from swap-everything)."""
    if option.kind == "recompute" and option.keep and "per_call" not in cal.fitted:
        cal.per_call_s = 0.0
        plain = model_effect(option, ltype, cal).seconds
        cal.per_call_s = max(0.0, (measured.seconds - plain) / max(1, 2 * cal.op_calls))
        cal.fitted.append("per_call")
