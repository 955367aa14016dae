"""The contract of the target planner the command line calls (implemented in
``plan/target_planner.py``; this module keeps the contract and the name the command line imports).

``plan_for_target`` plans one training step of a Hugging Face model (or of a model factory's,
``backends/torch/phase_trace.ModelFactory``) for a described accelerator and returns a dict with
the keys of :data:`RESULT_KEYS`:

- ``fits`` (bool): the step's peak, as the target's allocator reserves it, is within the target's
  memory (and within ``budget`` for the ``plan`` recipe);
- ``peak_allocated_bytes``, ``peak_reserved_bytes`` (int): the step's peak as the allocator counts
  it (allocated, and reserved as modelled);
- ``minimum_bytes`` (int) and ``minimum_parts`` (list of ``(name, bytes)``): the smallest peak any
  plan reaches, and what it is made of (parameters, gradients, optimizer state, activations, ...);
- ``plan`` (list of str): each layer's option, in order (a fixed recipe: its option on every layer);
- ``step_s`` (float): the step's predicted time; ``bound``: ``"compute"``, ``"hbm"`` or
  ``"host link"``, what binds it;
- ``notes`` (list of str): anything the reader should know (ops counted by bytes only, ...);
- ``measured_or_modelled`` (dict): for the numbers above (by key, and by ``minimum_parts`` name),
  ``"measured"`` or ``"modelled"``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from hyper_parallel.planner.targets import Target

__all__ = ["plan_for_target", "RESULT_KEYS"]

RESULT_KEYS = ("fits", "peak_allocated_bytes", "peak_reserved_bytes", "minimum_bytes", "minimum_parts", "plan",
               "step_s", "bound", "notes", "measured_or_modelled")


def plan_for_target(config: Any, *, seq: int, batch: int, grad_accum: int, precision: str,
                    optimizer: str, dp: int, fsdp: int, reshard_after_forward: bool, pp: int, recipe: str,
                    budget: Optional[int], target: Target) -> Dict[str, Any]:
    """Plan one training step of the model ``config`` (a Hugging Face ``config.json`` as a dict,
    or a ``ModelFactory``) for ``target`` (see the module docstring for what it returns; the
    answer may carry more keys, e.g. ``peak_parts``: what the peak itself is made of)."""
    from hyper_parallel.plan.target_planner import plan_for_target as plan  # (torch and transformers load here)

    return plan(config, seq=seq, batch=batch, grad_accum=grad_accum, precision=precision, optimizer=optimizer,
                dp=dp, fsdp=fsdp, reshard_after_forward=reshard_after_forward, pp=pp, recipe=recipe, budget=budget,
                target=target)
