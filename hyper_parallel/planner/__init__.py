"""The memory planner: give a budget, get the fastest SAVE / RECOMPUTE / SWAP plan for a layer stack.

A layer above the engine: it profiles the user's training step, probes each kind of layer's
options in isolation, predicts every plan's peak and step time with a cost model, chooses with a
dynamic programme (a MILP checks it when scipy is installed), and applies the result through the
public API (``checkpoint_wrapper``, ``swap_wrapper``, the layer chain). The engine never imports
it; ``hyper_parallel.core.activation_checkpoint`` re-exports :func:`plan_memory` and
:class:`MemoryPlan`. How it decides: ``docs/planner.md``.
"""

from .budget import format_bytes, parse_budget
from .options import LayerOption, OpKey, OpTablePolicy, SwapAtLeast
from .plan import LayerChoice, MemoryPlan, active_prober, set_prober
from .planning import Planner, plan_memory

__all__ = ["plan_memory", "MemoryPlan", "LayerChoice", "LayerOption", "OpKey", "OpTablePolicy", "SwapAtLeast",
           "Planner", "parse_budget", "format_bytes", "set_prober", "active_prober"]
