"""Helpers for the MindSpore tests: an op counter, recording policies, a small region with known
ops, and gradient helpers."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable, List, Optional, Tuple

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, mint
from mindspore.utils import MsDispatchMode

from hyper_parallel.core.activation_checkpoint import CheckpointPolicy
from hyper_parallel.backends.mindspore import _shim

MATMULS = frozenset({"MatMul", "MatMulExt", "BatchMatMul", "BatchMatMulExt"})


class OpCounter(MsDispatchMode):
    """Counts every op that actually runs below it (``counts[name] -> calls``).

    MindSpore chains dispatch modes: an op a selective checkpoint returns from its cache never
    reaches this (outer) mode; an op that runs does, in forward and in backward (recomputation
    included). The PyNative front-end pipeline is turned off while it is active (with it on,
    MindSpore 2.10 dispatch modes miss ops; see ``backends/mindspore/_shim.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self._prev: List[bool] = []

    def __enter__(self) -> "OpCounter":
        self._prev.append(_shim.disable_pipeline())
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        super().__exit__(*exc)
        _shim.restore_pipeline(self._prev.pop())
        return False

    def __ms_dispatch__(self, func: Any, args: Any, kwargs: Any = None) -> Any:
        self.counts[func.name] += 1
        return func(*args, **kwargs) if kwargs else func(*args)


class RecordingPolicy:
    """``policy_fn`` that records ``(ctx.is_recompute, op.name)`` and answers ``decide(name)``
    (default: MUST_SAVE for matmuls, PREFER_RECOMPUTE otherwise)."""

    def __init__(self, decide: Optional[Callable[[str], Any]] = None) -> None:
        self.decide = decide or (lambda name: CheckpointPolicy.MUST_SAVE if name in MATMULS
                                 else CheckpointPolicy.PREFER_RECOMPUTE)
        self.calls: List[Tuple[bool, str]] = []
        self.op_types: set = set()

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((ctx.is_recompute, op.name))
        self.op_types.add(type(op).__name__)
        return self.decide(op.name)

    def names(self, is_recompute: bool) -> List[str]:
        return [n for flag, n in self.calls if flag is is_recompute]


def make_params(seed: int = 0, n: int = 6, d: int = 5) -> Tuple[Tensor, Parameter, Parameter]:
    rng = np.random.RandomState(seed)
    x = Tensor(rng.randn(n, d).astype(np.float32))
    w1 = Parameter(Tensor(rng.randn(d, d).astype(np.float32)), name="w1")
    w2 = Parameter(Tensor(rng.randn(d, d).astype(np.float32)), name="w2")
    return x, w1, w2


def region(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """Ops: ``MatMulExt`` x2, ``Sin``, ``Cos``, ``Mul`` (by a tensor), ``AddExt`` (scalar)."""
    h = mint.matmul(x, w1)
    h = mint.sin(h)
    h = mint.matmul(h, w2)
    h = mint.cos(h) * x
    return h + 1.0


def grads(fn: Callable[..., Tensor], params: List[Parameter], *inputs: Any) -> Tuple[np.ndarray, List[np.ndarray]]:
    """``(loss, [grad per param])`` of ``fn(*inputs)`` as numpy arrays."""
    loss, g = ms.value_and_grad(fn, None, params)(*inputs)
    return loss.asnumpy(), [a.asnumpy() for a in g]


def assert_all_equal(a: Iterable[np.ndarray], b: Iterable[np.ndarray]) -> None:
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert np.array_equal(u, v), f"array {i} differs: max abs diff {np.abs(u - v).max()}"


def counts_of(fn: Callable[[], Any]) -> Counter:
    with OpCounter() as counter:
        fn()
    return counter.counts
