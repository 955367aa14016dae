"""``python -m hyper_parallel.plan``: will this model, at this sequence length and batch, fit on that
accelerator, with which recompute / swap plan, and how fast? Planned without the accelerator:
bytes from a trace on the meta device, time from a roofline of the target's published figures
(``docs/targets.md``). The command line is ``hyper_parallel/plan/__main__.py``.
"""
