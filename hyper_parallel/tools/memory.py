"""Measure the peak device memory of a code region.

::

    from hyper_parallel.tools.memory import MemoryMeter, mark_host, is_host_storage

* :class:`MemoryMeter` -- context manager reporting ``baseline_bytes``, ``peak_bytes``,
  ``current_bytes`` and ``peak_above_baseline`` of the region it wraps. On an accelerator
  it reads the caching allocator's counters; on CPU it counts live tensor storages through
  a dispatch mode (forward, backward and optimizer step included).
* :func:`mark_host` -- declare a storage a host buffer owned by the library (a swap copy),
  so the CPU meter never counts it as device memory.
* :func:`is_host_storage` -- whether a tensor's storage was marked with :func:`mark_host`.

Example::

    >>> import torch
    >>> from hyper_parallel.tools.memory import MemoryMeter
    >>> model = torch.nn.Linear(256, 256)
    >>> with MemoryMeter("cpu", track=[model]) as meter:
    ...     model(torch.randn(32, 256)).sum().backward()
    >>> meter.peak_bytes >= meter.baseline_bytes + 256 * 256 * 4   # the weight's gradient
    True
"""

from hyper_parallel.platform.torch.memory import MemoryMeter, is_host_storage, mark_host

__all__ = ["MemoryMeter", "mark_host", "is_host_storage"]
