"""Bench and test models for hyper-parallel, and the one benchmark harness every benchmark uses.

* :mod:`~hyper_parallel.bench.model`: a small GPT (``GPT``, ``make_batch``, ``train_steps``) whose matmuls, shared causal
  mask and tied head exercise recompute and swap, and ``SmallOpsNet``, many tiny blocks; :mod:`~.postln`: a post-LN
  ``nn.MultiheadAttention`` transformer with the GPT's interface;
* :mod:`~hyper_parallel.bench.modes`: every way to train a model (our modes, PyTorch's, torchtune's) as recipes;
* :mod:`~hyper_parallel.bench.harness`: build a variant, train it a step, meter it, time it; variants side by side;
* :mod:`~hyper_parallel.bench.report`: tables, legends, JSON, charts, the scripts' shared options;
  :mod:`~hyper_parallel.bench.trace`: Chrome traces and copy-engine figures;
* ``python -m hyper_parallel.bench`` (or ``hyper-parallel-bench``): the modes compared, each in its own subprocess.
"""
