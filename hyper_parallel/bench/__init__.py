"""Bench and test models for hyper-parallel, and the one benchmark harness every benchmark uses.

* :mod:`hyper_parallel.bench.model`: a small GPT (``GPTConfig``, ``GPT``, ``make_batch``,
  ``train_steps``) whose matmuls, shared causal mask and tied head exercise activation recompute
  and swap, and ``SmallOpsNet``, many tiny blocks, where the cost per saved tensor dominates;
  :mod:`hyper_parallel.bench.postln`: a post-LN ``nn.MultiheadAttention`` transformer with the
  GPT's interface;
* :mod:`hyper_parallel.bench.modes`: the registry of every way to train a model (our modes,
  PyTorch's and torchtune's) as recipes (``RECIPES``, ``apply_mode``, ``apply_variant``, policies);
* :mod:`hyper_parallel.bench.harness`: build a variant, train it a step, meter it, time it; run
  variants side by side (every script of ``benchmarks/``);
* :mod:`hyper_parallel.bench.report`: tables, legends, loss comparison, JSON, charts, the scripts'
  shared options; :mod:`hyper_parallel.bench.trace`: Chrome traces and copy-engine figures;
* ``python -m hyper_parallel.bench`` (or ``hyper-parallel-bench``): compares the modes, each in
  its own subprocess, on peak memory, step time and losses.
"""

from hyper_parallel.bench.model import GPT, MLP, Attention, Block, GPTConfig, make_batch, train_steps
from hyper_parallel.bench.modes import (DEFAULT_SWAP_THRESHOLD_BYTES, MODES, RECIPES, SWAP_WRAPPER_MODES, apply_mode,
                                        apply_swap_wrapper_mode, apply_variant, save_matmuls, swap_if_at_least,
                                        swap_matmuls)

__all__ = [
    "GPT", "GPTConfig", "Block", "Attention", "MLP", "make_batch", "train_steps",
    "MODES", "SWAP_WRAPPER_MODES", "RECIPES", "DEFAULT_SWAP_THRESHOLD_BYTES",
    "apply_mode", "apply_swap_wrapper_mode", "apply_variant", "save_matmuls", "swap_matmuls", "swap_if_at_least",
]
