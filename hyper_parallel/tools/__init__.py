"""Tools around the engine: :mod:`hyper_parallel.tools.memory` (the memory meter), :mod:`hyper_parallel.tools.clock`
(the clock steps are timed with) and :mod:`hyper_parallel.tools.gc_pause` (the collector paused while timing)."""
