"""Framework-neutral parts of hyper-parallel: policies, the swap state machine, scheduling.

Nothing under this package imports a framework directly; tensor and stream operations go
through :func:`hyper_parallel.platform.get_platform`.
"""
