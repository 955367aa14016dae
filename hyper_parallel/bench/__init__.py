"""Bench and test model for hyper-parallel, and the one benchmark system every benchmark uses.

* :mod:`hyper_parallel.bench.model`: a small GPT (``GPTConfig``, ``GPT``,
  ``make_batch``, ``train_steps``) written so that its matmuls, its shared
  causal mask and its tied head exercise activation recompute and swap, and
  ``SmallOpsNet``, many tiny blocks, where the cost per saved tensor dominates;
* :mod:`hyper_parallel.bench.modes`: the registry of every way to train it (our
  modes, PyTorch's and torchtune's) as recipes (``RECIPES``, ``apply_mode``,
  ``apply_variant`` and the policy functions);
* :mod:`hyper_parallel.bench.timing`: ``synchronize(device)``, the interleaved-median timer and
  ``counting_calls``;
* :mod:`hyper_parallel.bench.report`: tables, legends, loss comparison, JSON, charts;
* :mod:`hyper_parallel.bench.runner`: variants side by side in one process, with memory per
  phase, bytes moved, times and calls (every script of ``benchmarks/``);
* :mod:`hyper_parallel.bench.trace`: Chrome traces and copy-engine figures;
* :mod:`hyper_parallel.bench.postln`: a post-LN ``nn.MultiheadAttention`` transformer with the GPT's
  interface (every recipe applies to it);
* ``python -m hyper_parallel.bench`` (or ``hyper-parallel-bench``): compares the
  modes, each in its own subprocess, on peak memory, step time and losses.
"""

from hyper_parallel.bench.model import GPT, MLP, Attention, Block, GPTConfig, make_batch, train_steps
from hyper_parallel.bench.modes import (
    DEFAULT_SWAP_THRESHOLD_BYTES,
    MODES,
    RECIPES,
    SWAP_WRAPPER_MODES,
    apply_mode,
    apply_swap_wrapper_mode,
    apply_variant,
    save_matmuls,
    swap_if_at_least,
    swap_matmuls,
)

__all__ = [
    "GPT", "GPTConfig", "Block", "Attention", "MLP", "make_batch", "train_steps",
    "MODES", "SWAP_WRAPPER_MODES", "RECIPES", "DEFAULT_SWAP_THRESHOLD_BYTES",
    "apply_mode", "apply_swap_wrapper_mode", "apply_variant", "save_matmuls", "swap_matmuls", "swap_if_at_least",
]
