"""Activation recompute and swap, managed in one place: the public API.

This module is the one place that binds a framework backend to the engine
(``HYPER_PARALLEL_PLATFORM=torch`` or ``mindspore``; unset: PyTorch if it is installed, else
MindSpore). Everything else under :mod:`hyper_parallel.core` is framework-neutral.

Example (the RFC's recompute + swap recipe)::

    >>> import torch
    >>> from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, wrap_layers
    >>> heavy = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    >>> def policy_fn(ctx, op, *args, **kwargs):
    ...     return CheckpointPolicy.MUST_SWAP if op in heavy else CheckpointPolicy.MUST_RECOMPUTE
    >>> layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    ...                              for _ in range(3))
    >>> _ = wrap_layers(layers, policy_fn=policy_fn, swap_inputs=True)   # wrap + chain for swap
"""

import importlib.util
import os

from hyper_parallel.core.backend import set_backend

SUPPORTED_PLATFORMS = ("torch", "mindspore")


def selected_platform() -> str:
    """The framework this process uses: ``HYPER_PARALLEL_PLATFORM``, else torch when it is
    installed, else mindspore."""
    name = os.environ.get("HYPER_PARALLEL_PLATFORM", "").strip().lower()
    if not name:
        no_torch = importlib.util.find_spec("torch") is None
        name = "mindspore" if no_torch and importlib.util.find_spec("mindspore") is not None else "torch"
    if name not in SUPPORTED_PLATFORMS:
        raise ValueError(f"HYPER_PARALLEL_PLATFORM={name!r} is not a known platform; choose one of "
                         f"{SUPPORTED_PLATFORMS}.")
    return name


if selected_platform() == "mindspore":
    from hyper_parallel.backends.mindspore.backend import MindSporeBackend as _SelectedBackend
    from hyper_parallel.backends.mindspore.backend import pipeline_recompute, pipeline_swap
else:
    from hyper_parallel.backends.torch.backend import TorchBackend as _SelectedBackend
    from hyper_parallel.backends.torch.pipeline import pipeline_recompute, pipeline_swap

set_backend(_SelectedBackend())

from hyper_parallel.core.keep_reason import KeepReason  # noqa: E402
from hyper_parallel.core.policy import CheckpointPolicy, SelectiveCheckpointContext, keep_collectives  # noqa: E402
from hyper_parallel.core.recompute_session import RecomputeSession  # noqa: E402
from hyper_parallel.core.region import checkpoint, create_selective_checkpoint_contexts  # noqa: E402
from hyper_parallel.core.swap_manager import SwapManager  # noqa: E402
from hyper_parallel.core.wrapping import (checkpoint_exclude_wrapper, checkpoint_wrapper,  # noqa: E402
                                          swap_wrapper, wrap_layers)
from hyper_parallel.planner import (MemoryPlan, PipelinePlan, pipeline_in_flight, plan_memory,  # noqa: E402
                                    plan_pipeline)

__all__ = [
    "CheckpointPolicy",
    "SelectiveCheckpointContext",
    "create_selective_checkpoint_contexts",
    "checkpoint",
    "checkpoint_wrapper",
    "checkpoint_exclude_wrapper",
    "swap_wrapper",
    "wrap_layers",
    "SwapManager",
    "KeepReason",
    "pipeline_swap",
    "pipeline_recompute",
    "RecomputeSession",
    "keep_collectives",
    "selected_platform",
    "plan_memory",
    "MemoryPlan",
    "plan_pipeline",
    "PipelinePlan",
    "pipeline_in_flight",
]
