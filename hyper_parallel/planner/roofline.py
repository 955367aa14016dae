"""The time of one op on a :class:`~hyper_parallel.planner.targets.Target`: a roofline.

An op that does ``flops`` floating-point operations in ``dtype`` and moves ``bytes_moved`` bytes
of device memory (its tensor inputs read plus its outputs written) takes as long as the slower of
its compute and its memory traffic::

    seconds = max(flops / (peak_flops[dtype] * efficiency[op_class]),
                  bytes_moved / (hbm_bytes_per_s * efficiency["memory"]))

``op_class`` is ``"matmul"``, ``"attention"``, ``"memory"`` or ``"random"`` (what
``backends/torch/op_cost.py`` returns; a random op's bytes are priced at ``efficiency["random"]``
instead of ``efficiency["memory"]``: generating random numbers is slower than streaming memory on
a CPU); the efficiencies are the target's (published-benchmark defaults, or 1.0 on a calibrated
target whose rates were measured). Host <-> device copies (swaps) go over the host link instead:
:func:`copy_seconds`. Pure functions, no framework.

A dtype the target gives no peak for takes the peak of the closest format it does give, in the
order of :data:`FALLBACK` (``resolve_dtype`` says which): ``float8`` runs at the 16-bit rate on a
part without FP8 units (A100); ``float16`` and ``bfloat16`` stand for each other; ``tf32`` falls
back to ``float32`` and ``float32`` to ``tf32``; ``float64`` takes the ``float32`` rate (optimistic:
double precision is at best half as fast; no built-in target plans in it); integer and boolean
ops that have a FLOP count are priced at the ``float32`` rate. Dtype names may be written as
PyTorch prints them (``"torch.bfloat16"``) or short (``"bf16"``, ``"fp32"``, ``"half"``).
"""

from __future__ import annotations

from typing import Dict, Tuple

from .targets import DTYPES, Target

__all__ = ["op_seconds", "bound", "copy_seconds", "resolve_dtype", "normalize_dtype", "FALLBACK", "COMPUTE_CLASSES"]

#: The op classes :func:`op_seconds` prices (host copies: :func:`copy_seconds`).
COMPUTE_CLASSES = ("matmul", "attention", "memory", "random")

#: For each dtype, the peaks tried in order when the target lacks its own (module docstring).
FALLBACK: Dict[str, Tuple[str, ...]] = {
    "float8": ("float8", "bfloat16", "float16"),
    "bfloat16": ("bfloat16", "float16"),
    "float16": ("float16", "bfloat16"),
    "tf32": ("tf32", "float32"),
    "float32": ("float32", "tf32"),
    "float64": ("float64", "float32", "tf32"),
}

_SPELLINGS = {
    "bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
    "double": "float64", "fp64": "float64", "fp8": "float8", "hf32": "tf32",
}


def normalize_dtype(dtype: str) -> str:
    """The canonical name of a dtype (:data:`~hyper_parallel.planner.targets.DTYPES`), or
    ``"integer"`` for integer and boolean dtypes.

    >>> normalize_dtype("torch.bfloat16"), normalize_dtype("fp16"), normalize_dtype("float8_e4m3fn")
    ('bfloat16', 'float16', 'float8')
    >>> normalize_dtype("torch.int64"), normalize_dtype("bool")
    ('integer', 'integer')
    """
    name = str(dtype).strip().lower()
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = _SPELLINGS.get(name, name)
    if name.startswith("float8"):  # (float8_e4m3fn, float8_e5m2, ...: one FP8 peak)
        return "float8"
    if name in DTYPES:
        return name
    if name.startswith(("int", "uint", "bool")):
        return "integer"
    raise ValueError(f"unknown dtype {dtype!r}; give one of {', '.join(DTYPES)} (or a PyTorch dtype name)")


def resolve_dtype(target: Target, dtype: str) -> str:
    """The dtype whose peak prices ``dtype``'s FLOPs on ``target`` (the rule of :data:`FALLBACK`).

    >>> from hyper_parallel.planner.targets import target
    >>> resolve_dtype(target("a100"), "float8"), resolve_dtype(target("h100-sxm"), "torch.float8_e5m2")
    ('bfloat16', 'float8')
    >>> resolve_dtype(target("ascend-910b"), "tf32"), resolve_dtype(target("a100"), "int8")
    ('float32', 'float32')
    """
    name = normalize_dtype(dtype)
    chain = FALLBACK["float32"] if name == "integer" else FALLBACK[name]
    for candidate in chain:
        if candidate in target.peak_flops:
            return candidate
    raise ValueError(f"target {target.name!r} gives no peak for {name} or its stand-ins ({', '.join(chain)}); "
                     f"it gives {', '.join(target.peak_flops)}: add one to its peak_flops")


def _times(target: Target, op_class: str, flops: float, bytes_moved: float, dtype: str) -> Tuple[float, float]:
    if op_class not in COMPUTE_CLASSES:
        hint = " (host <-> device copies: copy_seconds)" if op_class == "copy" else ""
        raise ValueError(f"unknown op class {op_class!r}; use one of {', '.join(COMPUTE_CLASSES)}{hint}")
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes_moved cannot be negative, got {flops!r} and {bytes_moved!r}")
    compute = 0.0
    if flops:
        peak = target.peak_flops[resolve_dtype(target, dtype)]
        compute = flops / (peak * target.efficiency[op_class])
    rate = target.efficiency["random" if op_class == "random" else "memory"]
    memory = bytes_moved / (target.hbm_bytes_per_s * rate)
    return compute, memory


def op_seconds(target: Target, op_class: str, flops: float, bytes_moved: float, dtype: str) -> float:
    """The roofline time of one op on ``target`` (module docstring). With no FLOPs the dtype is
    not read (a copy of int64 indices is only bytes).

    A 4096 x 4096 x 4096 bf16 matmul on an H100 SXM (2 * 4096**3 FLOPs, three 32 MiB matrices)
    is compute-bound: 137.4 GFLOP / (989.4 TFLOP/s * 0.7) = 198 us:

    >>> from hyper_parallel.planner.targets import target
    >>> h100 = target("h100-sxm")
    >>> round(op_seconds(h100, "matmul", 2 * 4096 ** 3, 3 * 4096 * 4096 * 2, "bfloat16") * 1e6, 1)
    198.4

    Adding two 1 GiB bf16 tensors reads 2 GiB and writes 1 GiB: 3 GiB / (3.35 TB/s * 0.8) = 1.2 ms:

    >>> round(op_seconds(h100, "memory", 0, 3 << 30, "bfloat16") * 1e3, 3)
    1.202
    """
    return max(_times(target, op_class, flops, bytes_moved, dtype))


def bound(target: Target, op_class: str, flops: float, bytes_moved: float, dtype: str) -> str:
    """Which resource binds the op's time: ``"compute"`` or ``"hbm"`` (ties: ``"compute"``).

    >>> from hyper_parallel.planner.targets import target
    >>> h100 = target("h100-sxm")
    >>> bound(h100, "matmul", 2 * 4096 ** 3, 3 * 4096 * 4096 * 2, "bf16")
    'compute'
    >>> bound(h100, "matmul", 2 * 1 * 4096 * 4096, (4096 + 4096 * 4096 + 4096) * 2, "bf16")   # a matrix-vector product
    'hbm'
    """
    compute, memory = _times(target, op_class, flops, bytes_moved, dtype)
    return "compute" if compute >= memory else "hbm"


def copy_seconds(target: Target, nbytes: float) -> float:
    """The time to copy ``nbytes`` between host and device memory (one direction) over the
    target's host link at its ``copy`` efficiency.

    1 GiB over an H100's PCIe Gen5 link (64 GB/s one direction, 80% of it):

    >>> from hyper_parallel.planner.targets import target
    >>> round(copy_seconds(target("h100-sxm"), 1 << 30) * 1e3, 2)
    20.97
    """
    if nbytes < 0:
        raise ValueError(f"nbytes cannot be negative, got {nbytes!r}")
    return nbytes / (target.host_link_bytes_per_s * target.efficiency["copy"])
