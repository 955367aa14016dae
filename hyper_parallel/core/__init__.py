"""The framework-neutral engine of hyper-parallel: policies, selective regions, the saved-tensor
packer, the swap state machine, schedules and in-place wrapping.

Nothing under this package imports a framework; it reaches one only through the
:class:`hyper_parallel.core.backend.Backend` that the public API module
(:mod:`hyper_parallel.core.activation_checkpoint`) binds. See ``docs/architecture.md``.
"""
