"""Activation recompute and swap, managed in one place.

Example (the RFC's recompute + swap recipe)::

    >>> import torch
    >>> from hyper_parallel.core.activation_checkpoint import (
    ...     CheckpointPolicy, SwapManager, checkpoint_wrapper)
    >>> heavy = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    >>> def policy_fn(ctx, op, *args, **kwargs):
    ...     return CheckpointPolicy.MUST_SWAP if op in heavy else CheckpointPolicy.MUST_RECOMPUTE
    >>> layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    ...                              for _ in range(3))
    >>> for i, layer in enumerate(layers):
    ...     layers[i] = checkpoint_wrapper(layer, policy_fn=policy_fn, swap_inputs=True)
    >>> for i in range(len(layers) - 1):
    ...     SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])
"""

from .activation_checkpoint import (checkpoint, checkpoint_wrapper, create_selective_checkpoint_contexts,
                                    swap_wrapper)
from .activation_checkpoint import pipeline_swap, wrap_layers
from .policy import CheckpointPolicy, SelectiveCheckpointContext
from .swap_manager import SwapManager

__all__ = [
    "CheckpointPolicy",
    "SelectiveCheckpointContext",
    "create_selective_checkpoint_contexts",
    "checkpoint",
    "checkpoint_wrapper",
    "swap_wrapper",
    "SwapManager",
    "pipeline_swap",
    "wrap_layers",
]
