"""Tools around the engine: :mod:`hyper_parallel.tools.memory` (the memory meter)."""
