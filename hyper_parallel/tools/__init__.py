"""Developer tools for hyper-parallel (see :mod:`hyper_parallel.tools.memory` for the memory meter)."""
