""""This machine" as a :class:`~hyper_parallel.planner.targets.Target`: a short micro-benchmark
measures the rates the roofline needs instead of reading them from a datasheet.

The algorithm is written once (:func:`calibrate`); a framework provides the primitives
(:class:`MicroBench`: time ``n x n`` matmuls in a dtype, a device-to-device copy, a host-to-device
copy, and say the device's name and memory): ``backends/torch/calibrate.py`` for PyTorch. Each
measurement is warmed up once, then timed ``repeats`` times, each time over ``iterations`` calls
ended by one device synchronisation, and the fastest time is kept (what slows a shared machine
only ever adds time). From it:

- ``peak_flops[dtype]`` = ``2 n**3 * iterations / seconds`` for every dtype the device runs
  (float32, bfloat16 where supported; float16 and tf32 on accelerators);
- ``hbm_bytes_per_s`` = ``2 * nbytes * iterations / seconds`` of a device copy (it reads and
  writes ``nbytes``: the roofline's bytes moved count both);
- ``host_link_bytes_per_s`` = ``nbytes * iterations / seconds`` of a host-to-device copy (pinned
  host memory where the framework has it); on a CPU, where a swap is a memory copy, the same copy;
- ``efficiency["random"]``: the rate of filling ``nbytes`` with random draws in place (dropout's
  ``bernoulli_``: it writes them, ``nbytes`` moved as the op cost counts it) over the copy's, at
  most 1 (a CPU generates random numbers several times slower than it copies);
- every other efficiency 1.0: the measured rates already include them (attention is priced at the
  measured matmul rate);
- ``memory_bytes``: the device's memory (a CPU: the machine's RAM, ``os.sysconf``);
- ``allocator``: ``exact`` on a CPU (the planner's CPU meter counts storages as they are),
  ``npu_caching`` on an Ascend NPU, ``cuda_caching`` elsewhere.

On a CPU it takes a few hundred milliseconds (:data:`CPU_SIZES`), on an accelerator about a second
(:data:`ACCELERATOR_SIZES`).
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Callable, Dict, Optional, Sequence

from .targets import DTYPES, Target

__all__ = ["MicroBench", "Sizes", "CPU_SIZES", "ACCELERATOR_SIZES", "calibrate", "host_memory_bytes", "best_seconds",
           "efficiencies_against"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big and how many: ``matmul_n`` (square matmuls), ``copy_bytes`` (each copy),
    ``iterations`` per timing, ``repeats`` timings (the fastest is kept)."""

    matmul_n: int
    copy_bytes: int
    iterations: int
    repeats: int


#: A CPU: 14 MFLOP matmuls and 32 MiB copies (source and destination outgrow a server CPU's
#: last-level cache); a few hundred ms in all, most of it bfloat16 matmuls on CPUs without bf16 units.
CPU_SIZES = Sizes(matmul_n=192, copy_bytes=32 << 20, iterations=3, repeats=3)
#: An accelerator: 137 GFLOP per matmul and 256 MiB copies, enough to reach the device's rates.
ACCELERATOR_SIZES = Sizes(matmul_n=4096, copy_bytes=256 << 20, iterations=10, repeats=3)


class MicroBench(abc.ABC):
    """The primitives :func:`calibrate` needs from a framework. Every ``*_seconds`` method runs
    its work ``iterations`` times and returns the seconds of all of them, the device synchronised
    before the clock stops (and before it starts)."""

    @abc.abstractmethod
    def device_name(self) -> str:
        """What the device is, for the target's name (``"cpu"``, ``"cuda:0, NVIDIA H100 80GB HBM3"``)."""

    @abc.abstractmethod
    def device_kind(self) -> str:
        """``"cpu"``, ``"cuda"``, ``"npu"``, ... (picks the allocator and the sizes)."""

    @abc.abstractmethod
    def memory_bytes(self) -> int:
        """The device's memory capacity in bytes."""

    @abc.abstractmethod
    def matmul_dtypes(self) -> Sequence[str]:
        """The dtypes (:data:`~hyper_parallel.planner.targets.DTYPES` names) to time matmuls in."""

    @abc.abstractmethod
    def matmul_seconds(self, n: int, dtype: str, iterations: int) -> Optional[float]:
        """``iterations`` ``n x n @ n x n`` matmuls in ``dtype``; ``None`` if the device cannot."""

    @abc.abstractmethod
    def copy_seconds(self, nbytes: int, iterations: int) -> float:
        """``iterations`` copies of ``nbytes`` from device memory to device memory."""

    @abc.abstractmethod
    def host_copy_seconds(self, nbytes: int, iterations: int) -> float:
        """``iterations`` copies of ``nbytes`` from host memory to the device (on a CPU: a memory copy)."""

    @abc.abstractmethod
    def random_seconds(self, nbytes: int, iterations: int) -> float:
        """``iterations`` in-place fills of ``nbytes`` of device memory (float32) with Bernoulli
        draws, as dropout makes its masks."""


def best_seconds(measure: Callable[[], Optional[float]], repeats: int) -> Optional[float]:
    """Warm up once, then the fastest of ``repeats`` measurements (``None`` if the first is)."""
    if measure() is None:
        return None
    times = [measure() for _ in range(repeats)]
    return min(t for t in times if t is not None)


def host_memory_bytes() -> int:
    """The machine's RAM (``os.sysconf``: page size x physical pages)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # (a system without these names)
        raise RuntimeError("cannot read this machine's memory size (os.sysconf SC_PAGE_SIZE / SC_PHYS_PAGES); "
                           "describe the machine in a JSON target instead (docs/targets.md)") from None


_TINY = 1e-9  # (a clock that did not move: count one nanosecond rather than divide by zero)


def calibrate(bench: MicroBench, sizes: Optional[Sizes] = None) -> Target:
    """Measure ``bench``'s device and describe it as a calibrated :class:`Target` (module docstring)."""
    kind = bench.device_kind()
    sizes = sizes or (CPU_SIZES if kind == "cpu" else ACCELERATOR_SIZES)
    n, it = sizes.matmul_n, sizes.iterations
    peaks: Dict[str, float] = {}
    for dtype in bench.matmul_dtypes():
        if dtype not in DTYPES:
            raise ValueError(f"the micro-benchmark offers dtype {dtype!r}, not one of {', '.join(DTYPES)}")
        seconds = best_seconds(lambda: bench.matmul_seconds(n, dtype, it), sizes.repeats)
        if seconds is not None:
            peaks[dtype] = 2.0 * n ** 3 * it / max(seconds, _TINY)
    if not peaks:
        raise RuntimeError(f"no matmul ran on {bench.device_name()} in any of {list(bench.matmul_dtypes())}")
    copy = best_seconds(lambda: bench.copy_seconds(sizes.copy_bytes, it), sizes.repeats)
    host = best_seconds(lambda: bench.host_copy_seconds(sizes.copy_bytes, it), sizes.repeats)
    draws = best_seconds(lambda: bench.random_seconds(sizes.copy_bytes, it), sizes.repeats)
    assert copy is not None and host is not None and draws is not None
    hbm = 2.0 * sizes.copy_bytes * it / max(copy, _TINY)
    random_rate = 1.0 * sizes.copy_bytes * it / max(draws, _TINY)
    allocator = {"cpu": "exact", "npu": "npu_caching"}.get(kind, "cuda_caching")
    name = bench.device_name()
    return Target(
        name=f"this machine ({name})",
        memory_bytes=bench.memory_bytes(),
        peak_flops=peaks,
        hbm_bytes_per_s=hbm,
        host_link_bytes_per_s=1.0 * sizes.copy_bytes * it / max(host, _TINY),
        efficiency={"matmul": 1.0, "attention": 1.0, "memory": 1.0, "copy": 1.0,
                    "random": min(1.0, random_rate / hbm)},
        allocator=allocator,
        sources=(
            f"measured on {name} by hyper_parallel.planner.calibrate: {n}x{n} matmuls in "
            f"{', '.join(peaks)}; {sizes.copy_bytes >> 20} MiB device copies and host-to-device copies; "
            f"{it} calls per timing, the fastest of {sizes.repeats} timings",
            "random: in-place Bernoulli fills of the same size, their rate over the copies'",
            "other efficiencies 1.0: the measured rates include them (attention is priced at the matmul rate)",
        ),
        calibrated=True,
    )


def efficiencies_against(measured: Target, published: Target, dtype: str = "bfloat16") -> Dict[str, float]:
    """The efficiencies a calibration on a real device gives a published target: the measured
    matmul rate in ``dtype`` over the published peak, the measured copy bandwidth over the
    published HBM bandwidth, the measured host copies over the published link (each capped at 1).
    ``attention`` is not measured and is left out. Use it as
    ``published.replace(efficiency=efficiencies_against(calibrated, published))``.

    >>> from hyper_parallel.planner.targets import target
    >>> h100 = target("h100-sxm")
    >>> run = h100.replace(name="measured", peak_flops={"bfloat16": 692.6e12}, hbm_bytes_per_s=2.68e12,
    ...                    host_link_bytes_per_s=51.2e9)
    >>> {k: round(v, 3) for k, v in efficiencies_against(run, h100).items()}
    {'matmul': 0.7, 'memory': 0.8, 'copy': 0.8}
    """
    if dtype not in measured.peak_flops or dtype not in published.peak_flops:
        raise ValueError(f"both targets need a {dtype} peak to compare their matmul rates")
    return {
        "matmul": min(1.0, measured.peak_flops[dtype] / published.peak_flops[dtype]),
        "memory": min(1.0, measured.hbm_bytes_per_s / published.hbm_bytes_per_s),
        "copy": min(1.0, measured.host_link_bytes_per_s / published.host_link_bytes_per_s),
    }
