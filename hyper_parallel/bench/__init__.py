"""Bench and test model for hyper-parallel.

* :mod:`hyper_parallel.bench.model`: a small GPT (``GPTConfig``, ``GPT``,
  ``make_batch``, ``train_steps``) written so that its matmuls, its shared
  causal mask and its tied head exercise activation recompute and swap;
* :mod:`hyper_parallel.bench.modes`: the modes of SPEC section 5 as recipes
  (``apply_mode``, ``apply_swap_wrapper_mode`` and the policy functions);
* ``python -m hyper_parallel.bench`` (or ``hyper-parallel-bench``): compares the
  modes, each in its own subprocess, on peak memory, step time and losses.
"""

from hyper_parallel.bench.model import GPT, MLP, Attention, Block, GPTConfig, make_batch, train_steps
from hyper_parallel.bench.modes import (
    DEFAULT_SWAP_THRESHOLD_BYTES,
    MODES,
    SWAP_WRAPPER_MODES,
    apply_mode,
    apply_swap_wrapper_mode,
    save_matmuls,
    swap_if_at_least,
    swap_matmuls,
)

__all__ = [
    "GPT", "GPTConfig", "Block", "Attention", "MLP", "make_batch", "train_steps",
    "MODES", "SWAP_WRAPPER_MODES", "DEFAULT_SWAP_THRESHOLD_BYTES",
    "apply_mode", "apply_swap_wrapper_mode", "save_matmuls", "swap_matmuls", "swap_if_at_least",
]
