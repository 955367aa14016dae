"""Accelerators the planner can plan for without running on them: their memory, peak FLOP/s per
dtype, memory and host-link bandwidth, and how close to those peaks real kernels come.

A :class:`Target` is a plain description (no framework): the planner traces the step on the meta
device for its bytes and prices every op with :mod:`hyper_parallel.planner.roofline` for its time.
Built-in targets (:data:`TARGETS`, :func:`target`) carry the vendors' published figures and name the
document each one comes from (``Target.sources``); a calibration on a real device
(:mod:`hyper_parallel.planner.calibrate`) gives a ``Target`` whose rates were measured instead.
A user describes another accelerator in JSON (:meth:`Target.from_json`)::

    >>> t = Target.from_json({"name": "my card", "memory_bytes": 48 << 30,
    ...                       "peak_flops": {"bfloat16": 362e12, "float32": 90e12},
    ...                       "hbm_bytes_per_s": 0.96e12, "host_link_bytes_per_s": 32e9})
    >>> t.efficiency["matmul"], t.allocator, t.calibrated
    (0.7, 'cuda_caching', False)
    >>> Target.from_json(t.to_json()) == t
    True

Conventions: every peak is *dense* (no 2:4 structured sparsity, which datasheets often quote and
which doubles the figure); bandwidths are bytes per second, the host link in one direction (what a
swap's copy gets); capacities written "80 GB" by the vendors are read as binary GiB (HBM stacks come
in binary sizes: 80 GB = five 16 GiB stacks), of which the driver reports slightly less.
"""

from __future__ import annotations

import dataclasses
import json
import types
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

__all__ = ["Target", "TARGETS", "ALIASES", "target", "load_target_file", "DTYPES", "OP_CLASSES",
           "DEFAULT_EFFICIENCY", "ALLOCATORS", "table_rows"]

#: The dtype names a target's ``peak_flops`` may give (``tf32``: float32 matmuls on tensor cores).
DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8")
#: The op classes a target's ``efficiency`` covers: ``matmul`` (matmul-like ops and convolutions),
#: ``attention`` (fused attention kernels), ``memory`` (bandwidth-bound ops), ``random`` (random
#: number generation, dropout's masks: priced by its bytes, at its own share of the bandwidth),
#: ``copy`` (host link).
OP_CLASSES = ("matmul", "attention", "memory", "random", "copy")
#: ``cuda_caching``: PyTorch's CUDA caching allocator (also ROCm's, the same code); ``npu_caching``:
#: torch_npu's; ``exact``: storages counted as they are (a CPU meter), see ``planner/allocator.py``.
ALLOCATORS = ("cuda_caching", "npu_caching", "exact")

#: Fractions of the published peaks that kernels reach in practice. Defaults only: a calibration
#: on the device replaces them (``planner/calibrate.py``), a JSON target may give its own.
DEFAULT_EFFICIENCY: Mapping[str, float] = types.MappingProxyType({
    "matmul": 0.7,     # default: large bf16 GEMMs reach 60-80% of the dense tensor-core peak
    "attention": 0.5,  # default: fused (flash) attention forward + backward reach 40-60% of the peak
    "memory": 0.8,     # default: streaming elementwise kernels reach 75-90% of the HBM bandwidth
    "random": 0.8,     # default: a GPU's counter-based generators (Philox) write at about the memory rate
    "copy": 0.8,       # default: pinned host <-> device copies reach ~80% of the PCIe link's rate
})

_GIB = 1 << 30


def _frozen(mapping: Mapping[str, float]) -> Mapping[str, float]:
    return types.MappingProxyType(dict(mapping))


@dataclasses.dataclass(frozen=True)
class Target:
    """One accelerator as the planner sees it (see the module docstring for the conventions).

    ``peak_flops``: dense FLOP/s per dtype name (:data:`DTYPES`); ``efficiency``: fraction of the
    peak per op class (:data:`OP_CLASSES`; classes not given keep :data:`DEFAULT_EFFICIENCY`);
    ``allocator``: how the device's allocator rounds requests (:data:`ALLOCATORS`); ``sources``:
    the documents the numbers come from; ``calibrated``: the rates were measured on the device.
    """

    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float
    efficiency: Mapping[str, float] = dataclasses.field(default_factory=lambda: DEFAULT_EFFICIENCY)
    allocator: str = "cuda_caching"
    sources: Tuple[str, ...] = ()
    calibrated: bool = False

    def __post_init__(self) -> None:
        where = f"target {self.name!r}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"a target needs a name (a non-empty string), got {self.name!r}")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise ValueError(f"{where}: memory_bytes must be a positive int (bytes), got {self.memory_bytes!r}")
        peaks = dict(self.peak_flops)
        if not peaks:
            raise ValueError(f"{where}: peak_flops is empty; give at least one of {', '.join(DTYPES)} "
                             "(dense FLOP/s)")
        for dtype, value in peaks.items():
            if dtype not in DTYPES:
                raise ValueError(f"{where}: unknown dtype {dtype!r} in peak_flops; use one of {', '.join(DTYPES)}")
            _positive(value, f"{where}: peak_flops[{dtype!r}]")
        _positive(self.hbm_bytes_per_s, f"{where}: hbm_bytes_per_s")
        _positive(self.host_link_bytes_per_s, f"{where}: host_link_bytes_per_s")
        eff = dict(DEFAULT_EFFICIENCY)
        for cls, value in dict(self.efficiency).items():
            if cls not in OP_CLASSES:
                raise ValueError(f"{where}: unknown op class {cls!r} in efficiency; use one of {', '.join(OP_CLASSES)}")
            _positive(value, f"{where}: efficiency[{cls!r}]")
            if value > 1:
                raise ValueError(f"{where}: efficiency[{cls!r}] = {value!r} is above 1 (a fraction of the peak)")
            eff[cls] = float(value)
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"{where}: unknown allocator {self.allocator!r}; use one of {', '.join(ALLOCATORS)}")
        sources = (self.sources,) if isinstance(self.sources, str) else tuple(self.sources)
        if not all(isinstance(s, str) for s in sources):
            raise ValueError(f"{where}: sources must be strings (the documents the numbers come from)")
        # (frozen: the mappings are read-only views, so a shared built-in cannot be changed in place)
        object.__setattr__(self, "peak_flops", _frozen({k: float(v) for k, v in peaks.items()}))
        object.__setattr__(self, "efficiency", _frozen(eff))
        object.__setattr__(self, "hbm_bytes_per_s", float(self.hbm_bytes_per_s))
        object.__setattr__(self, "host_link_bytes_per_s", float(self.host_link_bytes_per_s))
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "calibrated", bool(self.calibrated))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Target) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_json(), sort_keys=True))

    def to_json(self) -> Dict[str, Any]:
        """A JSON-ready dict (:meth:`from_json` reads it back)."""
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "peak_flops": dict(self.peak_flops),
            "hbm_bytes_per_s": self.hbm_bytes_per_s,
            "host_link_bytes_per_s": self.host_link_bytes_per_s,
            "efficiency": dict(self.efficiency),
            "allocator": self.allocator,
            "sources": list(self.sources),
            "calibrated": self.calibrated,
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "Target":
        """A target from a dict as :meth:`to_json` writes it (``efficiency``, ``allocator``,
        ``sources`` and ``calibrated`` may be left out: defaults). Unknown keys are an error, so
        that a misspelt field is not silently ignored."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a target is a JSON object (a dict), got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(Target)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown target field(s) {', '.join(map(repr, unknown))}; the fields are "
                             f"{', '.join(f.name for f in dataclasses.fields(Target))}")
        missing = [f for f in ("name", "memory_bytes", "peak_flops", "hbm_bytes_per_s", "host_link_bytes_per_s")
                   if f not in data]
        if missing:
            raise ValueError(f"the target {data.get('name', '(unnamed)')!r} lacks {', '.join(missing)}")
        kwargs = dict(data)
        memory = kwargs["memory_bytes"]
        if isinstance(memory, float) and memory.is_integer():  # (JSON writers may print 8.6e10)
            kwargs["memory_bytes"] = int(memory)
        if not isinstance(kwargs.get("peak_flops"), Mapping):
            raise ValueError("peak_flops must be an object mapping dtype names to dense FLOP/s")
        if "efficiency" in kwargs and not isinstance(kwargs["efficiency"], Mapping):
            raise ValueError("efficiency must be an object mapping op classes to fractions of the peak")
        kwargs["sources"] = tuple(kwargs.get("sources", ()))
        return Target(**kwargs)

    def replace(self, **changes: Any) -> "Target":
        """A copy with some fields changed (e.g. ``efficiency={"matmul": 0.62}``: the other classes
        keep their values)."""
        if "efficiency" in changes:
            changes["efficiency"] = {**self.efficiency, **dict(changes["efficiency"])}
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        """One line: memory, bf16 (or the best 16-bit) peak, HBM and host link.

        >>> print(target("a100").summary())
        A100 SXM 80GB: 80.0 GiB, bf16 312 TFLOP/s, HBM 2.04 TB/s, host link 32 GB/s (published)
        """
        dtype = next((d for d in ("bfloat16", "float16", "float32") if d in self.peak_flops), next(iter(self.peak_flops)))
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
        kind = "calibrated" if self.calibrated else "published"
        return (f"{self.name}: {self.memory_bytes / _GIB:.1f} GiB, {short} {self.peak_flops[dtype] / 1e12:.0f} TFLOP/s, "
                f"HBM {self.hbm_bytes_per_s / 1e12:.2f} TB/s, host link {self.host_link_bytes_per_s / 1e9:.0f} GB/s "
                f"({kind})")


def _positive(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")


# --------------------------------------------------------------------------------------- built-ins
# PCIe x16 links: the vendors quote both directions together ("PCIe Gen5: 128 GB/s"); a swap's
# copy uses one direction, half of it. (Raw rates after 128b/130b encoding: Gen4 31.5, Gen5 63.0 GB/s.)
_PCIE4 = 32e9
_PCIE5 = 64e9
_PCIE4_NOTE = "PCIe Gen4 x16: 64 GB/s both directions as the datasheet quotes it -> 32 GB/s one direction"
_PCIE5_NOTE = "PCIe Gen5 x16: 128 GB/s both directions as the datasheet quotes it -> 64 GB/s one direction"
_GIB_NOTE = ("capacity: the marketed GB read as GiB (HBM stacks are binary sizes); the driver reports a little "
             "less and the runtime's context takes some outside PyTorch's allocator")

_H100_SXM = Target(
    name="H100 SXM 80GB",
    memory_bytes=80 * _GIB,
    peak_flops={"bfloat16": 989.4e12, "float16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12,
                "float8": 1978.9e12},
    hbm_bytes_per_s=3.35e12,
    host_link_bytes_per_s=_PCIE5,
    sources=(
        "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: BF16/FP16 Tensor Core 1,979 TFLOPS and FP8 3,958 "
        "TFLOPS and TF32 989 TFLOPS, each quoted with sparsity, half of it dense; FP32 67 TFLOPS; GPU memory 80 GB, "
        "3.35 TB/s; PCIe Gen5 128 GB/s",
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), H100 SXM5 column: dense BF16/FP16 989.4, "
        "TF32 494.7, FP32 66.9, FP8 1,978.9 TFLOPS (the datasheet's figures, unrounded)",
        _PCIE5_NOTE, _GIB_NOTE,
    ),
)

_H100_PCIE = Target(
    name="H100 PCIe 80GB",
    memory_bytes=80 * _GIB,
    peak_flops={"bfloat16": 756e12, "float16": 756e12, "tf32": 378e12, "float32": 51e12, "float8": 1513e12},
    hbm_bytes_per_s=2.0e12,
    host_link_bytes_per_s=_PCIE5,
    sources=(
        "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 PCIe: BF16/FP16 Tensor Core 1,513 TFLOPS, FP8 3,026 "
        "TFLOPS, TF32 756 TFLOPS, each quoted with sparsity, half of it dense; FP32 51 TFLOPS; GPU memory 80 GB "
        "HBM2e, 2 TB/s; PCIe Gen5 128 GB/s",
        "NVIDIA H100 PCIe product brief PB-11133-001 (2022): memory bandwidth 'greater than 2,000 GB/s'; the "
        "later H100 NVL (94 GB, 3.9 TB/s) is another card, not this one",
        _PCIE5_NOTE, _GIB_NOTE,
    ),
)

_H200 = Target(
    name="H200 SXM 141GB",
    memory_bytes=141 * _GIB,
    peak_flops=dict(_H100_SXM.peak_flops),
    hbm_bytes_per_s=4.8e12,
    host_link_bytes_per_s=_PCIE5,
    sources=(
        "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM: BF16/FP16 Tensor Core 1,979 TFLOPS and FP8 "
        "3,958 TFLOPS (with sparsity; dense is half), the H100 SXM's compute (same GH100 die); GPU memory 141 GB "
        "HBM3e, 4.8 TB/s; PCIe Gen5 128 GB/s",
        "dense figures as for the H100 SXM5 in the H100 architecture whitepaper (989.4 / 494.7 / 66.9 / 1,978.9)",
        _PCIE5_NOTE,
        "capacity: 141 GB is what is enabled of six 24 GB HBM3e stacks; read as GiB like the other NVIDIA parts "
        "(the driver reports a little less)",
    ),
)

_B200 = Target(
    name="B200 192GB",
    memory_bytes=192 * _GIB,
    peak_flops={"bfloat16": 2250e12, "float16": 2250e12, "tf32": 1100e12, "float32": 75e12, "float8": 4500e12},
    hbm_bytes_per_s=8.0e12,
    host_link_bytes_per_s=_PCIE5,
    sources=(
        "NVIDIA HGX B200 specifications (2024), per GPU of the 8-GPU board: FP8 Tensor Core 9 PFLOPS, FP16/BF16 "
        "4.5 PFLOPS, TF32 2.2 PFLOPS, each quoted with sparsity, half of it dense; FP32 75 TFLOPS; HBM3e 8 TB/s",
        "NVIDIA Blackwell announcement (GTC 2024): B200 with 192 GB HBM3e (eight 24 GB stacks). UNCERTAIN: the "
        "DGX B200 datasheet lists 1,440 GB for 8 GPUs (180 GB each) and shipping boards report about 179 GiB; "
        "for those, describe the card in JSON with memory_bytes 180 GiB",
        "host link UNCERTAIN: the B200 has a PCIe Gen6 x16 interface (128 GB/s one direction) but DGX B200's host "
        "CPUs (Intel Xeon Platinum 8570) are PCIe Gen5, so a swap gets Gen5: 64 GB/s one direction",
        _GIB_NOTE,
    ),
)

_A100 = Target(
    name="A100 SXM 80GB",
    memory_bytes=80 * _GIB,
    peak_flops={"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12},
    hbm_bytes_per_s=2.039e12,
    host_link_bytes_per_s=_PCIE4,
    sources=(
        "NVIDIA A100 Tensor Core GPU datasheet (2021), A100 80GB SXM: BF16/FP16 Tensor Core 312 TFLOPS (624 with "
        "sparsity), TF32 156 TFLOPS (312 with sparsity), FP32 19.5 TFLOPS; GPU memory 80 GB HBM2e, 2,039 GB/s; "
        "PCIe Gen4 64 GB/s",
        "no FP8 on Ampere: float8 work is priced at the 16-bit rate (planner/roofline.py's fallback rule)",
        _PCIE4_NOTE, _GIB_NOTE,
    ),
)

_MI300X = Target(
    name="MI300X 192GB",
    memory_bytes=192 * _GIB,
    peak_flops={"bfloat16": 1307.4e12, "float16": 1307.4e12, "tf32": 653.7e12, "float32": 163.4e12,
                "float8": 2614.9e12},
    hbm_bytes_per_s=5.3e12,
    host_link_bytes_per_s=_PCIE5,
    sources=(
        "AMD Instinct MI300X accelerator data sheet (2023): peak FP16/BF16 1,307.4 TFLOPS dense (2,614.9 with "
        "sparsity), FP8 2,614.9 dense (5,229.8 with sparsity), TF32 653.7 dense, FP32 matrix 163.4 TFLOPS; 192 GB "
        "HBM3, 5.3 TB/s peak; PCIe Gen5 x16 128 GB/s",
        "allocator: PyTorch on ROCm runs the same caching allocator as on CUDA (hipified CUDACachingAllocator)",
        _PCIE5_NOTE, _GIB_NOTE,
    ),
)

_ASCEND_910B = Target(
    name="Ascend 910B 64GB",
    memory_bytes=64 * _GIB,
    peak_flops={"bfloat16": 320e12, "float16": 320e12, "float32": 160e12},
    hbm_bytes_per_s=1.6e12,
    host_link_bytes_per_s=_PCIE4,
    allocator="npu_caching",
    sources=(
        "UNCERTAIN, varies by SKU: Huawei publishes no per-chip datasheet for the 910B that we found; third-party "
        "reports give FP16/BF16 about 320 TFLOPS dense, with SKUs from 280 (910B3/B4) to 376 (910B2) TFLOPS; the "
        "original Ascend 910 (Hot Chips 2019) was 256 TFLOPS FP16",
        "memory: 64 GB HBM2e in four stacks (reports; 910B4 boards carry 32 GB), about 1.6 TB/s (four HBM2e stacks "
        "at ~400 GB/s; some reports give 1.2 TB/s) - UNCERTAIN",
        "float32: an ESTIMATE, half the FP16 rate (FP32 matmuls on the cube unit), not a published figure",
        "host link: Ascend 910 (Hot Chips 2019) has PCIe 4.0 x16 -> 32 GB/s one direction; assumed the same for 910B",
        "allocator: torch_npu's NPUCachingAllocator (its round_size adds 32 bytes before rounding to 512)",
        _GIB_NOTE,
    ),
)

#: The built-in targets by short name (``python -m hyper_parallel.plan --list-targets``).
TARGETS: Mapping[str, Target] = types.MappingProxyType({
    "h100-sxm": _H100_SXM,
    "h100-pcie": _H100_PCIE,
    "h200": _H200,
    "b200": _B200,
    "a100": _A100,
    "mi300x": _MI300X,
    "ascend-910b": _ASCEND_910B,
})

#: Other spellings :func:`target` accepts.
ALIASES: Mapping[str, str] = types.MappingProxyType({
    "h100": "h100-sxm", "h100-80gb": "h100-sxm", "h200-sxm": "h200", "a100-sxm": "a100", "a100-80gb": "a100",
    "910b": "ascend-910b", "ascend910b": "ascend-910b", "b200-192gb": "b200", "mi300x-192gb": "mi300x",
})


def target(name: str) -> Target:
    """The built-in target ``name`` (case and ``_``/``-``/spaces do not matter; see :data:`ALIASES`).

    >>> target("H100_SXM").name, target("910b").allocator
    ('H100 SXM 80GB', 'npu_caching')
    >>> target("v100")
    Traceback (most recent call last):
    ...
    ValueError: unknown target 'v100'; the built-in targets are h100-sxm, h100-pcie, h200, b200, a100, mi300x, ascend-910b (describe another accelerator in a JSON file: see docs/targets.md)
    """
    if not isinstance(name, str):
        raise TypeError(f"a target name is a string, got {type(name).__name__}")
    key = "-".join(name.strip().lower().replace("_", "-").split())
    key = ALIASES.get(key, key)
    if key not in TARGETS:
        raise ValueError(f"unknown target {name!r}; the built-in targets are {', '.join(TARGETS)} "
                         "(describe another accelerator in a JSON file: see docs/targets.md)")
    return TARGETS[key]


def load_target_file(path: str) -> Target:
    """A target from a JSON file (one object, as :meth:`Target.to_json` writes it); errors name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the target file {path!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the target file {path!r} is not valid JSON: {e}") from None
    try:
        return Target.from_json(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the target file {path!r}: {e}") from None


def table_rows(targets: Optional[Iterable[Tuple[str, Target]]] = None) -> List[Tuple[str, ...]]:
    """Rows (short name, name, memory GiB, bf16 TFLOP/s, HBM TB/s, host link GB/s) for a listing."""
    rows = []
    for key, t in (targets if targets is not None else TARGETS.items()):
        bf16 = t.peak_flops.get("bfloat16", t.peak_flops.get("float16"))
        rows.append((key, t.name, f"{t.memory_bytes / _GIB:.0f}", f"{bf16 / 1e12:.1f}" if bf16 else "-",
                     f"{t.hbm_bytes_per_s / 1e12:.2f}", f"{t.host_link_bytes_per_s / 1e9:.0f}"))
    return rows
