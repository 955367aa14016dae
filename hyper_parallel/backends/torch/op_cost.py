"""What one PyTorch op call costs, for the roofline (``planner/roofline.py``): its op class, its
FLOPs, the bytes it moves, and the dtype its arithmetic runs in (the planner's PyTorch part).

- **FLOPs** come from PyTorch's own formulas (``torch.utils.flop_counter.flop_registry``: matmuls,
  convolutions and their backward, scaled-dot-product / flash / efficient / cuDNN attention
  forward and backward), plus the same attention formulas for the fused attention ops the
  registry lacks (the CPU flash kernel ``_scaled_dot_product_flash_attention_for_cpu`` and its
  backward, and ``_scaled_dot_product_fused_attention_overrideable``, which out-of-tree devices
  implement). An attention kernel called with ``is_causal=True`` skips the masked blocks: its
  count is scaled by the unmasked share of the score matrix (``causal_skip=False`` keeps the full
  count, which is what ``FlopCounterMode`` reports). Every other op counts 0 FLOPs.
- **Bytes moved**: the bytes of the tensor inputs it reads (a broadcast input counts the
  elements it holds, not the broadcast shape) plus the outputs it writes (an in-place op that
  returns nothing, such as an optimizer's ``_foreach_add_``: the arguments it writes). Views and
  metadata-only ops (``view``, ``expand``, ``transpose``, ``detach``, ``_unsafe_view``, ...) and
  allocations that write nothing (``empty``) move 0.
- **Op class**: ``"attention"`` for the attention kernels, ``"matmul"`` for the other ops with a
  formula (matmuls, convolutions), ``"random"`` for random number generation (:data:`RANDOM_OPS`:
  dropout's ``bernoulli_``, ...), ``"memory"`` for the rest (the last two priced by their bytes).
- **dtype**: the dtype of the first floating-point input (``"bfloat16"``, ...); float32 matmuls
  count as ``"tf32"`` when ``torch.get_float32_matmul_precision()`` is not ``"highest"``, and
  float32 convolutions when ``torch.backends.cudnn.allow_tf32`` is on (their defaults on CUDA).

Ops that have no FLOP formula and are not pure data movement or random numbers (elementwise
arithmetic, norms, softmax, ...) are priced by their bytes only; :class:`OpCostLog` counts them so
that a report can say so (:meth:`OpCostLog.bytes_only_note`). Everything works on meta tensors.

Example (a bf16 matmul on the meta device)::

    >>> import torch
    >>> a = torch.empty(64, 128, device="meta", dtype=torch.bfloat16)
    >>> b = torch.empty(128, 32, device="meta", dtype=torch.bfloat16)
    >>> op_cost(torch.ops.aten.mm.default, (a, b), {}, torch.mm(a, b))
    OpCost(op_class='matmul', flops=524288, bytes_moved=28672, dtype='bfloat16')
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, Iterator, List, MutableMapping, NamedTuple, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["OpCost", "op_cost", "OpCostLog", "OpCostMode", "METADATA_OPS", "DATA_MOVEMENT_OPS", "RANDOM_OPS",
           "op_name", "dtype_name"]


class OpCost(NamedTuple):
    """One op call's cost for the roofline (module docstring)."""

    op_class: str      # "matmul" | "attention" | "memory" | "random"
    flops: int
    bytes_moved: int
    dtype: str         # "bfloat16", "float16", "float32", "tf32", "float8", "float64" or "integer"


#: Ops that only make a new view or change metadata, and allocations that write nothing: 0 bytes
#: (besides every op whose schema says it returns a view: ``OpOverload.is_view``).
METADATA_OPS = frozenset({
    "aten._unsafe_view", "aten.detach", "aten.alias", "aten.lift_fresh", "aten._reshape_alias", "aten.set_",
    "aten.resize_", "aten.as_strided_", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
    "aten.new_empty_strided", "aten.empty_permuted", "aten.record_stream",
})

#: Ops that copy, gather or fill and do no arithmetic: priced by their bytes, as they should be
#: (not listed among the ops counted "by bytes only").
DATA_MOVEMENT_OPS = frozenset({
    "aten._to_copy", "aten.copy_", "aten.copy", "aten.clone", "aten.contiguous", "aten.cat", "aten.stack",
    "aten.index_select", "aten.gather", "aten.index", "aten.embedding", "aten.constant_pad_nd", "aten.repeat",
    "aten.slice_scatter", "aten.select_scatter", "aten.as_strided_scatter", "aten.fill_", "aten.fill",
    "aten.zero_", "aten.zeros", "aten.zeros_like", "aten.ones", "aten.ones_like", "aten.full", "aten.full_like",
    "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.scalar_tensor", "aten.lift_fresh_copy",
    "aten.arange", "aten._local_scalar_dense", "aten.expand_copy", "aten.permute_copy", "aten.t_copy",
    "aten.transpose_copy", "aten.view_copy", "aten.split_with_sizes_copy", "aten.unbind_copy",
    "aten.split_with_sizes", "aten.split", "aten.unbind", "aten.slice_backward", "aten.select_backward",
})

#: Ops that generate random numbers: priced by their bytes at the target's ``random`` rate
#: (``planner/roofline.py``), not listed among the ops counted "by bytes only".
RANDOM_OPS = frozenset({
    "aten.bernoulli", "aten.bernoulli_", "aten.native_dropout", "aten.uniform_", "aten.normal", "aten.normal_",
    "aten.random_", "aten.exponential_", "aten.geometric_", "aten.cauchy_", "aten.log_normal_", "aten.rand",
    "aten.rand_like", "aten.randn", "aten.randn_like", "aten.randint", "aten.randint_like", "aten.randperm",
    "aten.multinomial",
})

_aten = torch.ops.aten


def _shapes(*tensors: Any) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in tensors)


def _fwd_formula(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(*_shapes(query, key, value))


def _bwd_formula(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None,
                 **kwargs: Any) -> int:
    return sdpa_backward_flop_count(*_shapes(grad_out, query, key, value))


def _extra_formulas() -> Dict[Any, Callable[..., int]]:
    # The registry's attention formulas for fused attention ops it does not list (some builds lack
    # some of these ops: only those present are added).
    names = {
        "_scaled_dot_product_flash_attention_for_cpu": _fwd_formula,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _bwd_formula,
        "_scaled_dot_product_fused_attention_overrideable": _fwd_formula,
        "_scaled_dot_product_fused_attention_overrideable_backward": _bwd_formula,
    }
    return {getattr(_aten, n): f for n, f in names.items() if hasattr(_aten, n)}


_FORMULAS: Dict[Any, Callable[..., int]] = {**_extra_formulas(), **flop_registry}


def op_name(func: Any) -> str:
    """The name an op is reported under: its overload packet (``"aten.mm"``)."""
    packet = getattr(func, "overloadpacket", func)
    return str(packet)


def _is_attention(name: str) -> bool:
    return "attention" in name


def _argument(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    schema = getattr(func, "_schema", None)
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.name == name:
                return args[i] if i < len(args) else default
    return default


def _mutated(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Any]:
    """The arguments the op's schema says it writes to."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(kwargs[arg.name] if arg.name in kwargs else args[i] if i < len(args) else None)
    return out


def _causal_share(query: Any, key: Any) -> float:
    """The share of the (L x S) score matrix a top-left causal mask keeps (PyTorch's ``is_causal``:
    row i sees keys 0..i)."""
    length, source = int(query.shape[-2]), int(key.shape[-2])
    if length <= 0 or source <= 0:
        return 1.0
    # rows 0..min(L, S)-1 see i+1 keys, the others all S
    full = min(length, source)
    kept = full * (full + 1) // 2 + (length - full) * source
    return kept / (length * source)


def _elements(t: torch.Tensor) -> int:
    """The elements a tensor holds: a stride-0 (broadcast) dimension holds one."""
    try:
        if t.layout != torch.strided:
            return t.numel()
        n = 1
        for size, stride in zip(t.shape, t.stride()):
            n *= 1 if stride == 0 else int(size)
        return n if t.numel() else 0
    except (RuntimeError, NotImplementedError):  # (nested or sparse layouts without strides)
        return t.numel()


def _nbytes(t: torch.Tensor) -> int:
    return _elements(t) * t.element_size()


def _tensors(tree: Any) -> List[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; float8 variants -> ``"float8"``; complex -> the
    float of its parts; integers and bool -> ``"integer"``."""
    if dtype.is_complex:
        return "float64" if dtype == torch.complex128 else "float32"
    if not dtype.is_floating_point:
        return "integer"
    name = str(dtype).replace("torch.", "")
    return "float8" if name.startswith("float8") else name


_MATMULS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"})
#: In-place ops that overwrite their first argument without reading it.
_OVERWRITES_FIRST = frozenset({"aten.copy_", "aten.fill_", "aten.zero_", "aten.normal_", "aten.uniform_",
                               "aten.bernoulli_", "aten.random_", "aten.exponential_"})


def op_cost(func: Any, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None, out: Any = None, *,
            bytes_only: Optional[MutableMapping[str, int]] = None, causal_skip: bool = True) -> OpCost:
    """The cost of one op call ``func(*args, **kwargs) -> out`` (module docstring). An op counted
    by its bytes only (no FLOP formula, not pure data movement) is counted in ``bytes_only``
    (``{name: calls}``) when given.

    A view moves nothing:

    >>> x = torch.empty(8, 16, device="meta")
    >>> op_cost(torch.ops.aten.view.default, (x, [16, 8]), {}, x.view(16, 8))
    OpCost(op_class='memory', flops=0, bytes_moved=0, dtype='float32')
    """
    kwargs = kwargs or {}
    name = op_name(func)
    packet = getattr(func, "overloadpacket", None)
    inputs = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
    outputs = _tensors(out)
    first_float = next((t for t in inputs + outputs if t.dtype.is_floating_point or t.dtype.is_complex), None)
    dtype = dtype_name(first_float.dtype) if first_float is not None else (
        dtype_name(inputs[0].dtype) if inputs else "float32")
    if getattr(func, "is_view", False) or name in METADATA_OPS or name.startswith("profiler."):
        # (profiler.* : the record_function markers optimizers and modules emit, no work)
        return OpCost("memory", 0, 0, dtype)
    seen: Dict[int, torch.Tensor] = {}
    for i, t in enumerate(inputs):
        if i == 0 and name in _OVERWRITES_FIRST:  # (written, not read: counted once, as an output)
            continue
        seen.setdefault(id(t), t)
    # (an in-place op that returns nothing, _foreach_add_ or _fused_adamw_, writes its mutable arguments)
    written = outputs if outputs else _tensors(_mutated(func, args, kwargs))
    moved = sum(_nbytes(t) for t in seen.values()) + sum(t.numel() * t.element_size() for t in written)
    formula = _FORMULAS.get(packet)
    if name in RANDOM_OPS:
        return OpCost("random", 0, moved, dtype)
    if formula is None:
        if bytes_only is not None and name not in DATA_MOVEMENT_OPS:
            bytes_only[name] = bytes_only.get(name, 0) + 1
        return OpCost("memory", 0, moved, dtype)
    flops = int(formula(*args, **kwargs, out_val=out))
    op_class = "attention" if _is_attention(name) else "matmul"
    if op_class == "attention" and causal_skip and name.startswith("aten._scaled_dot_product") \
            and _argument(func, args, kwargs, "is_causal", False):
        query, key = _argument(func, args, kwargs, "query"), _argument(func, args, kwargs, "key")
        if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() >= 2:
            flops = int(flops * _causal_share(query, key))
    if dtype == "float32":
        if name in _MATMULS and torch.get_float32_matmul_precision() != "highest":
            dtype = "tf32"
        elif "conv" in name and torch.backends.cudnn.allow_tf32:
            dtype = "tf32"
    return OpCost(op_class, flops, moved, dtype)


class OpCostLog:
    """The costs of many op calls: totals per op class and the ops counted by bytes only.

    >>> log = OpCostLog()
    >>> x = torch.empty(4, 4, device="meta")
    >>> _ = log.add(torch.ops.aten.add.Tensor, (x, x), {}, x + x)
    >>> _ = log.add(torch.ops.aten.mm.default, (x, x), {}, x @ x)
    >>> log.flops["matmul"], log.bytes_only_note()
    (128, 'counted by bytes only (no FLOP formula): aten.add x1')
    """

    def __init__(self, causal_skip: bool = True) -> None:
        self.causal_skip = causal_skip
        self.calls = 0
        self.flops: collections.Counter = collections.Counter()        # op class -> FLOPs
        self.bytes_moved: collections.Counter = collections.Counter()  # op class -> bytes
        self.bytes_only: Dict[str, int] = {}                           # op name -> calls

    def add(self, func: Any, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]], out: Any) -> OpCost:
        cost = op_cost(func, args, kwargs, out, bytes_only=self.bytes_only, causal_skip=self.causal_skip)
        self.calls += 1
        self.flops[cost.op_class] += cost.flops
        self.bytes_moved[cost.op_class] += cost.bytes_moved
        return cost

    def bytes_only_note(self, limit: int = 12) -> Optional[str]:
        """``"counted by bytes only (no FLOP formula): aten.add x64, ..."`` (most calls first), or
        ``None`` when every op had a formula or only moved data."""
        if not self.bytes_only:
            return None
        ranked = sorted(self.bytes_only.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = ", ".join(f"{name} x{calls}" for name, calls in ranked[:limit])
        more = f", and {len(ranked) - limit} more" if len(ranked) > limit else ""
        return f"counted by bytes only (no FLOP formula): {shown}{more}"


class OpCostMode(TorchDispatchMode):
    """A dispatch mode that prices every op call it sees (``costs``: ``(name, OpCost)`` in order;
    ``log``: the :class:`OpCostLog`).

    >>> with torch.device("meta"):
    ...     w = torch.empty(32, 16, requires_grad=True)
    ...     x = torch.empty(8, 16)
    ...     with OpCostMode() as mode:
    ...         torch.nn.functional.linear(x, w).sum().backward()
    >>> mode.log.flops["matmul"] == 2 * (8 * 32 * 16) * 2      # forward x @ w.T, backward x.T @ grad
    True
    """

    def __init__(self, causal_skip: bool = True) -> None:
        super().__init__()
        self.log = OpCostLog(causal_skip)
        self.costs: List[Tuple[str, OpCost]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.costs.append((op_name(func), self.log.add(func, args, kwargs, out)))
        return out

    def __iter__(self) -> Iterator[Tuple[str, OpCost]]:
        return iter(self.costs)
