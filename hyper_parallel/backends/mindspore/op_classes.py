"""MindSpore's op classes as the backend and the planner's prober see them: an op's name, and
whether it writes an argument, draws random numbers or comes through a legacy primitive call."""

from __future__ import annotations

from typing import Any, Tuple

from mindspore.ops import Primitive

__all__ = ["op_name", "is_random_op", "is_mutating_op", "is_legacy_primitive_call", "RANDOM_OP_NAMES",
           "MACHINERY_OPS"]


def op_name(op: Any) -> str:
    """The name of an op as the policy sees it: ``OpFunc.name`` / ``Primitive.name`` / a string /
    a ``Primitive`` subclass (its class name)."""
    if isinstance(op, str):
        return op
    if isinstance(op, type):
        return op.__name__
    name = getattr(op, "name", None)
    if isinstance(name, str):
        return name
    raise TypeError(f"cannot name op {op!r} ({type(op).__name__}); use its primitive name, e.g. 'MatMul'.")


MACHINERY_OPS = frozenset({"StopGradient"})
_MUTATING_NAMES = frozenset({"Assign", "AssignAdd", "AssignSub", "ScatterUpdate", "ScatterAdd", "ScatterSub",
                             "ScatterMul", "ScatterDiv", "ScatterMax", "ScatterMin", "ScatterNdUpdate",
                             "ScatterNdAdd", "ScatterNdSub", "TensorScatterUpdate", "Load", "UpdateState"})
#: Names (lower case) of ops that draw random numbers; extend it for custom random ops.
RANDOM_OP_NAMES = {"gamma", "randomgamma", "standardnormal", "standardlaplace", "truncatednormal",
                   "lognormalreverse", "parameterizedtruncatednormal", "randomstandardnormal",
                   "randomcategorical", "randomchoicewithmask", "randomshuffle", "randperm", "randpermv2",
                   "randpermext"}
_RANDOM_WORDS = ("dropout", "rand", "uniform", "bernoulli", "multinomial", "poisson")


def is_mutating_op(name: str) -> bool:
    return name.startswith("Inplace") or name in _MUTATING_NAMES


def is_legacy_primitive_call(args: Tuple[Any, ...]) -> bool:
    """Whether a dispatch mode received a legacy-primitive call (``Primitive.__call__`` ->
    ``run_op_async``): its arguments are ``(primitive, name, inputs)``."""
    return len(args) == 3 and isinstance(args[0], Primitive) and isinstance(args[1], str) \
        and isinstance(args[2], tuple)


def is_random_op(name: str) -> bool:
    low = name.lower()
    return low in RANDOM_OP_NAMES or any(w in low for w in _RANDOM_WORDS) or \
        (low.startswith("normal") and not low.startswith("normalize"))
