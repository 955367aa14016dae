"""``plan_for_target``: one training step of a Hugging Face model (or of a model factory's),
planned for a described accelerator without running on it (the contract: ``plan/_stub.py``; the
command line: ``plan/__main__.py``).

The pieces, one concept each: ``backends/torch/phase_trace.py`` traces the step of the model cut
down to a few layers on the meta device, once per activation option (``hf_trace.py`` builds a
Hugging Face model from its configuration for it); ``planner/step_model.py`` composes the
whole step from the traces (its bytes, what they are made of, its time on the target) and
searches the plans; this module picks the traces a recipe needs and writes the answer, every
number marked: on a target you do not have nothing is measured, so every number is ``modelled``
(the activation bytes are exact as traced, the time a roofline; the notes say which rule made
which part).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Dict, List, Optional, Union

import torch

from hyper_parallel.planner.budget import format_bytes
from hyper_parallel.backends.torch.hf_trace import trace_step
from hyper_parallel.backends.torch.phase_trace import ModelFactory, trace_factory, trace_optimizer
from hyper_parallel.planner.step_model import PARTS, Run, StepModel, bound_of
from hyper_parallel.planner.targets import Target

__all__ = ["plan_for_target", "RECIPE_TRACES"]

#: The traces each recipe needs: the three a plan chooses from always (the smallest reachable peak
#: is searched among them; swap is modelled from ``none``), Hugging Face's own for ``hf-gc``.
RECIPE_TRACES = {"none": ("none", "full", "selective"), "full": ("none", "full", "selective"),
                 "selective": ("none", "full", "selective"), "hf-gc": ("none", "full", "selective", "hf-gc"),
                 "plan": ("none", "full", "selective")}
_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "fp16-amp": torch.float16, "fp32": torch.float32}
_OPTIMIZERS = ("adamw", "adamw-fused", "sgd")


@functools.lru_cache(maxsize=32)
def _trace(config_json: str, seq: int, batch: int, dtype: torch.dtype, option: str, allocator: str, attention: str,
           accumulate: bool) -> Any:
    """``trace_step``, remembered: a traced step depends only on these arguments (the recipes of
    one run, or plans of one model for several targets of one allocator, share their traces).
    The traces are read, never changed, by the step model. (A model factory's are not remembered:
    the cache would keep the factory, and a live model it copies, alive.)"""
    return trace_step(json.loads(config_json), seq=seq, batch=batch, dtype=dtype, option=option,
                      allocator=allocator, attention=attention, accumulate=accumulate)


def _layer_count(model: Union[Dict[str, Any], ModelFactory]) -> int:
    if isinstance(model, ModelFactory):
        return model.layers
    layers = model.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ValueError("the config names no num_hidden_layers (a Hugging Face decoder config has it)")
    return layers


def _check(run: Run, recipe: str, budget: Optional[int], config: Union[Dict[str, Any], ModelFactory]) -> None:
    if recipe not in RECIPE_TRACES:
        raise ValueError(f"unknown recipe {recipe!r}; use one of {', '.join(RECIPE_TRACES)}")
    if run.precision not in _DTYPES:
        raise ValueError(f"unknown precision {run.precision!r}; use one of {', '.join(_DTYPES)}")
    if run.optimizer not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {run.optimizer!r}; use one of {', '.join(_OPTIMIZERS)}")
    if recipe == "plan" and budget is None:
        raise ValueError("the plan recipe needs a budget (bytes)")
    for name in ("seq", "batch", "grad_accum", "dp", "fsdp", "pp"):
        if getattr(run, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(run, name)}")
    layers = _layer_count(config)
    if run.pp > layers:
        raise ValueError(f"pp {run.pp} is more pipeline stages than the model's {layers} layers")


def plan_for_target(config: Union[Dict[str, Any], ModelFactory], *, seq: int, batch: int, grad_accum: int,
                    precision: str, optimizer: str, dp: int, fsdp: int, reshard_after_forward: bool, pp: int,
                    recipe: str, budget: Optional[int], target: Target) -> Dict[str, Any]:
    """Plan one training step of the model ``config`` (a Hugging Face ``config.json`` as a dict, or
    a :class:`~hyper_parallel.backends.torch.phase_trace.ModelFactory`) for ``target``; returns
    the dict of ``plan/_stub.py``'s ``RESULT_KEYS``. A ``plan`` budget below the smallest
    reachable peak is a ``ValueError`` that names both."""
    run = Run(seq, batch, grad_accum, precision, optimizer, dp, fsdp, reshard_after_forward, pp)
    _check(run, recipe, budget, config)
    dtype = _DTYPES[precision]
    attention = "cpu" if target.allocator == "exact" else "cuda"
    if isinstance(config, ModelFactory):
        traces = {option: trace_factory(config, seq=seq, batch=batch, dtype=dtype, option=option,
                                        allocator=target.allocator, attention=attention, accumulate=grad_accum > 1)
                  for option in RECIPE_TRACES[recipe]}
    else:
        key = json.dumps(config, sort_keys=True, default=str)
        traces = {option: _trace(key, seq, batch, dtype, option, target.allocator, attention, grad_accum > 1)
                  for option in RECIPE_TRACES[recipe]}
    none = traces["none"]
    master = torch.float32 if run.master_bytes == 4 else torch.bfloat16
    shard = [-(-n // fsdp) for n in none.layer_params[0]]
    transient, opt_costs, opt_notes = trace_optimizer(shard, master, optimizer, target.allocator)
    opt_bytes = sum(shard) * run.master_bytes
    model = StepModel(traces, run, target, (transient / max(1, opt_bytes), opt_costs, opt_bytes))
    layers = model.layers

    min_plan, min_walk, min_reserved = model.minimum()
    if recipe == "plan":
        assert budget is not None
        found = model.plan(budget, (min_plan, min_walk, min_reserved))
        if found is None:
            raise ValueError(f"the budget {format_bytes(budget)} is below the smallest reachable peak "
                             f"{format_bytes(min_reserved)} (reserved, as the allocator would hold it; "
                             f"{format_bytes(min_walk.peak)} allocated) of this step on {target.name}")
        plan, walk, reserved = found
        if reserved < min_reserved:  # (the search found a plan below the frugal layouts' minimum)
            min_plan, min_walk, min_reserved = plan, walk, reserved
    else:
        option = {"none": "none", "full": "recompute", "selective": "selective", "hf-gc": "hf-gc"}[recipe]
        plan = [option] * layers
        walk, reserved = model.evaluate(plan)
    limit = min(target.memory_bytes, budget) if budget is not None else target.memory_bytes
    notes = _notes(traces, run, target, recipe, walk, opt_notes, swapped="swap" in plan or "swap" in min_plan)
    marks: Dict[str, str] = {k: "modelled" for k in ("fits", "peak_allocated_bytes", "peak_reserved_bytes",
                                                      "minimum_bytes", "step_s", "bound")}
    marks.update({name: "modelled" for name in PARTS})
    return {
        "fits": reserved <= limit,
        "peak_allocated_bytes": int(walk.peak),
        "peak_reserved_bytes": int(reserved),
        "minimum_bytes": int(min_walk.peak),
        "minimum_parts": [(name, int(b)) for name, b in min_walk.parts.items() if b],
        "plan": list(plan),
        "step_s": float(walk.step_s),
        "bound": bound_of(walk),
        "notes": notes,
        "measured_or_modelled": marks,
        "peak_parts": [(name, int(b)) for name, b in walk.parts.items() if b],
    }


def _notes(traces: Dict[str, Any], run: Run, target: Target, recipe: str, walk: Any, opt_notes: List[str],
           swapped: bool) -> List[str]:
    none = traces["none"]
    notes: List[str] = []
    if walk.stage:
        notes.append(f"the peak is the {walk.stage}'s (pipeline stages: 1F1B, the first stage holding "
                     f"min(pp, grad-accum) micro-batches' activations, the last one the loss head: modelled)")
    notes.append(f"activations, loss head and optimizer temporaries: traced on the meta device ({none.traced} of "
                 f"{len(none.kinds)} layers; layers of one kind traced once), each request rounded as the "
                 f"{target.allocator} allocator rounds it; parameters, buffers, gradients, optimizer state, gathered "
                 "parameters and communication buffers: arithmetic on the traced parameter shapes "
                 "(planner/step_model.py states each rule)")
    if run.mixed:
        notes.append(f"{run.precision}: traced in {str(none.dtype).replace('torch.', '')} throughout, as FSDP2's "
                     "MixedPrecisionPolicy runs it (fp32 master weights and gradients, optimizer state fp32); "
                     "torch.autocast without FSDP keeps the residual stream and norms in fp32 and caches weight "
                     "copies until the forward ends: not traced")
    if any(c.op_class == "attention" for p in none.phases.values() for c in p.costs):
        kernel = "the CPU flash kernel" if target.allocator == "exact" else \
            "FlashAttention (no mask; the memory-efficient kernel with one)"
        notes.append(f"attention traced as {kernel}, what PyTorch's SDPA runs on the target")
    for trace in traces.values():
        notes.extend(n for n in trace.notes if n not in notes)
    if none.bytes_only:
        ranked = sorted(none.bytes_only.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = ", ".join(f"{name} x{calls}" for name, calls in ranked[:10])
        more = f", and {len(ranked) - 10} more" if len(ranked) > 10 else ""
        notes.append(f"ops with no FLOP formula, timed by the bytes they read and write (per traced step of "
                     f"{none.traced} layers): {shown}{more}")
    if recipe == "selective":
        notes.append("selective: torchtitan's per-op policy (save attention outputs and every other mm) run by "
                     "torch.utils.checkpoint's selective checkpointing on the meta device")
    if swapped or recipe == "plan":
        notes.append("swap: modelled from the none trace (the layer's saved bytes leave the device after its "
                     "forward, the previous layer's stay while in flight; copies over the host link hide behind "
                     "the next layer's compute)")
    if run.fsdp > 1 or run.dp > 1:
        notes.append("communication time (all-gather, reduce-scatter, all-reduce) is not priced: a target has no "
                     "interconnect figure; NCCL's own buffers are outside PyTorch's allocator")
    if run.optimizer == "sgd":
        notes.append("sgd: plain SGD without momentum (no state)")
    notes.extend(opt_notes)
    notes.append("reserved: allocator.reserved_estimate of the storages live at the peak, packed as fresh "
                 "segments pack (an estimate: fragmentation and cached blocks from earlier phases are not modelled)")
    return notes

