"""Bench and test models for hyper-parallel, and the one benchmark harness every benchmark uses: ``model`` (the bench
GPT, ``SmallOpsNet``) and ``postln`` (a post-LN transformer); ``modes`` (every way to train a model, as recipes);
``harness`` (build a variant, train it a step, meter it, time it); ``report`` (tables, JSON, charts, the scripts'
options); ``trace`` (Chrome traces, copy-engine figures). ``python -m hyper_parallel.bench`` compares the modes.
"""
