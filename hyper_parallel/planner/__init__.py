"""The memory planner: give a budget, get the fastest SAVE / RECOMPUTE / SWAP plan for a layer stack.

A layer above the engine: it profiles the user's training step, probes each kind of layer's
options in isolation, predicts every plan's peak and step time with a cost model, chooses with a
dynamic programme (a MILP checks it when scipy is installed), and applies the result through the
public API (``checkpoint_wrapper``, ``swap_wrapper``, the layer chain). The engine never imports
it; ``hyper_parallel.core.activation_checkpoint`` re-exports :func:`plan_memory`,
:class:`MemoryPlan`, :func:`plan_pipeline`, :class:`PipelinePlan` and :func:`pipeline_in_flight`.
How it decides: ``docs/planner.md``; data-parallel ranks, FSDP2 and pipeline stages:
``docs/parallel.md``.
"""

from .budget import format_bytes, parse_budget
from .distributed import AgreeingProber, Collectives
from .options import LayerOption, OpKey, OpTablePolicy, SwapAtLeast
from .pipeline import (PipelinePlan, gpipe_actions, in_flight_counts, one_f_one_b_actions, pipeline_in_flight,
                       pipeline_step_seconds, plan_pipeline)
from .memory_plan import LayerChoice, MemoryPlan
from .planner import Planner, plan_memory

__all__ = ["plan_memory", "MemoryPlan", "LayerChoice", "LayerOption", "OpKey", "OpTablePolicy", "SwapAtLeast",
           "Planner", "parse_budget", "format_bytes",
           "plan_pipeline", "PipelinePlan", "pipeline_in_flight", "in_flight_counts", "pipeline_step_seconds",
           "gpipe_actions", "one_f_one_b_actions",
           "AgreeingProber", "Collectives"]
