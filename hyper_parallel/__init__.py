"""hyper-parallel: activation recompute and activation swap, managed in one place.

The public API lives in :mod:`hyper_parallel.core.activation_checkpoint`::

    from hyper_parallel.core.activation_checkpoint import (
        CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts,
        checkpoint, checkpoint_wrapper, swap_wrapper, SwapManager)

and the memory meter in :mod:`hyper_parallel.tools.memory`.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
