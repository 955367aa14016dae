"""Tools to check a swap schedule without an accelerator.

:class:`SimDevice` is a simulated asynchronous device: a ``TorchBackend`` that changes only its
streams, events, allocation, copies and where a storage lives (every other question is answered by
the code an accelerator runs), whose streams are queues. Copies issued on a copy stream run
as late as possible (when a wait on their event forces them, or at :meth:`SimDevice.synchronize`),
fresh device allocations are filled with ``0xFF`` (NaN in every float dtype), and a device storage
freed while a queued copy still reads it is poisoned, so a missing wait shows up as NaN or wrong
bits, deterministically. A happens-before checker on the same streams (vector clocks; events carry
clocks, waits merge them) raises :class:`StreamHazard` on an access not ordered after another
stream's conflicting access, on a free that another stream's access is not ordered before (and
that ``record_stream`` does not cover), and on an allocation made while a copy stream is current.

``python -m hyper_parallel.testing.mutations`` (run by hand) mutates every ordering call site of the
engine and the backends in a scratch copy and reports the mutants that the ordering tests miss.

Example::

    >>> import torch
    >>> from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper
    >>> from hyper_parallel.testing import simulated_device
    >>> block = swap_wrapper(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()))
    >>> with simulated_device() as sim:
    ...     mgr = SwapManager()
    ...     mgr.set_current_group_name("mb0")
    ...     loss = block(torch.randn(4, 8)).sum()
    ...     mgr.set_current_group_name(None)
    ...     mgr.launch_offload("mb0"); mgr.wait_offload("mb0")
    ...     mgr.launch_load("mb0"); mgr.wait_load("mb0")
    ...     loss.backward()
"""

from .sim_device import (POISON_BYTE, SimDevice, SimEvent, SimStream, StreamHazard, per_layer_streams,
                         simulated_device)

__all__ = ["SimDevice", "SimStream", "SimEvent", "StreamHazard", "POISON_BYTE", "simulated_device",
           "per_layer_streams"]
