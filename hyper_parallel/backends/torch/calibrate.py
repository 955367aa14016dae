"""The PyTorch primitives of the "this machine" micro-benchmark (``planner/calibrate.py``).

Times are taken with the planner's clock (``hyper_parallel.tools.clock.step_clock``: the process's
CPU time on a CPU running one intra-op thread, the wall clock elsewhere) under ``no_gc``, the
device synchronised before the clock starts and before it stops, so that calibrated rates and the
planner's measured step times are read on the same clock.

Example::

    >>> t = calibrate_this_machine("cpu")
    >>> t.calibrated, t.allocator, t.peak_flops["float32"] > 0
    (True, 'exact', True)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hyper_parallel.tools.clock import no_gc, step_clock

from hyper_parallel.planner.calibrate import MicroBench, Sizes, calibrate, host_memory_bytes
from hyper_parallel.planner.targets import Target

__all__ = ["TorchMicroBench", "calibrate_this_machine", "default_device"]

_DTYPES = {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> torch.device:
    """The current accelerator if there is one, else the CPU."""
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


class TorchMicroBench(MicroBench):
    """:class:`MicroBench` on a PyTorch device (default: :func:`default_device`)."""

    def __init__(self, device: Any = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type != "cpu" and self.device.index is None:
            self.device = torch.device(self.device.type, 0)
        self._module = None if self.device.type == "cpu" else torch.get_device_module(self.device.type)
        self._clock = step_clock(self.device)
        self._inputs: Dict[Tuple[int, str], Any] = {}   # (n, dtype) -> (a, b, out), or None: no kernel
        self._copies: Dict[Tuple[int, bool], Any] = {}  # (nbytes, from host) -> (source, destination)

    # ------------------------------------------------------------------ what the device is
    def device_kind(self) -> str:
        return self.device.type

    def device_name(self) -> str:
        if self._module is None:
            return "cpu"
        try:
            return f"{self.device}, {self._module.get_device_name(self.device)}"
        except (AttributeError, RuntimeError):
            return str(self.device)

    def memory_bytes(self) -> int:
        if self._module is None:
            return host_memory_bytes()
        return int(self._module.get_device_properties(self.device).total_memory)

    def matmul_dtypes(self) -> Sequence[str]:
        if self.device.type == "cpu":
            return ("float32", "bfloat16")  # (float16 matmuls on a CPU are emulated: priced as bf16)
        dtypes: List[str] = ["float32", "bfloat16", "float16"]
        if self.device.type == "cuda":
            dtypes.insert(1, "tf32")
        return dtypes

    # ------------------------------------------------------------------ timings
    def _sync(self) -> None:
        if self._module is not None:
            self._module.synchronize(self.device)

    def _timed(self, work: Callable[[], Any], iterations: int) -> float:
        with no_gc():
            self._sync()
            start = self._clock()
            for _ in range(iterations):
                work()
            self._sync()
            return self._clock() - start

    def matmul_seconds(self, n: int, dtype: str, iterations: int) -> Optional[float]:
        key = (n, dtype)
        if key not in self._inputs:  # (made and tried once: the warm-up call then only times)
            torch_dtype = _DTYPES[dtype]
            try:
                a = torch.randn(n, n, device=self.device).to(torch_dtype)
                b = torch.randn(n, n, device=self.device).to(torch_dtype)
                out = torch.mm(a, b)
            except (RuntimeError, TypeError, NotImplementedError):  # (the device has no kernel for the dtype)
                self._inputs[key] = None
            else:
                self._inputs[key] = (a, b, out)
        tensors = self._inputs[key]
        if tensors is None:
            return None
        a, b, out = tensors
        tf32 = self.device.type == "cuda"
        previous = torch.backends.cuda.matmul.allow_tf32 if tf32 else None
        try:
            if tf32:
                torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
            return self._timed(lambda: torch.mm(a, b, out=out), iterations)
        finally:
            if tf32:
                torch.backends.cuda.matmul.allow_tf32 = previous

    def _buffers(self, nbytes: int, host: bool) -> Any:
        key = (nbytes, host)
        if key not in self._copies:
            src = torch.empty(nbytes, dtype=torch.uint8)
            if not host:
                src = src.to(self.device)
            elif self._module is not None:
                try:
                    src = src.pin_memory()
                except (RuntimeError, TypeError):  # (no pinned memory on this build: pageable copies)
                    pass
            src.fill_(1)
            self._copies[key] = (src, torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        return self._copies[key]

    def copy_seconds(self, nbytes: int, iterations: int) -> float:
        src, dst = self._buffers(nbytes, host=False)
        return self._timed(lambda: dst.copy_(src), iterations)

    def host_copy_seconds(self, nbytes: int, iterations: int) -> float:
        src, dst = self._buffers(nbytes, host=True)
        return self._timed(lambda: dst.copy_(src, non_blocking=True), iterations)

    def random_seconds(self, nbytes: int, iterations: int) -> float:
        _, dst = self._buffers(nbytes, host=False)
        mask = dst[: nbytes - nbytes % 4].view(torch.float32)  # (dropout's masks: float draws)
        return self._timed(lambda: mask.bernoulli_(0.9), iterations)


def calibrate_this_machine(device: Any = None, sizes: Optional[Sizes] = None) -> Target:
    """"This machine" (or ``device``) as a calibrated :class:`Target` (``planner/calibrate.py``)."""
    return calibrate(TorchMicroBench(device), sizes)
