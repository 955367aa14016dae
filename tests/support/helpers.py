"""Shared helpers for the activation-checkpoint tests: an op counter, recording policies,
small regions with known op counts, and the tiny GPT-like model configurations."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.core.activation_checkpoint import CheckpointPolicy

aten = torch.ops.aten

#: the matmul overloads a "save matmuls" policy keeps
MATMUL_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default})

#: a GPT small enough that a 3-step training run takes well under a second on 2 cores
TINY_GPT = dict(vocab=64, dim=32, heads=2, layers=2, seq=16, dropout=0.1)


# --------------------------------------------------------------------------------------
# op counting
# --------------------------------------------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts every ATen op that actually runs below it (``counts[op] -> calls``).

    Enter it *outside* any checkpoint: an op that a selective checkpoint replays from its
    cache is never run, so it never reaches this mode; an op that is recomputed does.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    def __getitem__(self, op: Any) -> int:
        return self.counts[op]


def count_ops(fn: Callable[[], Any]) -> Counter:
    """Run ``fn()`` under an :class:`OpCounter` and return its counts."""
    with OpCounter() as counter:
        fn()
    return counter.counts


def forward_backward_counts(fwd: Callable[[], torch.Tensor]) -> Tuple[Counter, Counter]:
    """``(forward counts, backward counts)`` of ``fwd().sum().backward()``; recomputation, if
    any, happens inside backward and is counted there."""
    holder: Dict[str, torch.Tensor] = {}

    def run_forward() -> None:
        holder["loss"] = fwd().sum()

    f = count_ops(run_forward)
    loss = holder.pop("loss")
    b = count_ops(loss.backward)
    return f, b


def rerun_counts(plain_backward: Counter, backward: Counter, ops: Iterable[Any]) -> Dict[Any, int]:
    """How many more times each op ran in a checkpointed backward than in a plain one: the
    number of times backward *recomputed* it."""
    return {op: backward[op] - plain_backward[op] for op in ops}


# --------------------------------------------------------------------------------------
# policies
# --------------------------------------------------------------------------------------


class RecordingPolicy:
    """``policy_fn`` that records ``(ctx.is_recompute, op)`` for every call and answers
    ``decide(op)`` (default: MUST_SAVE for matmuls, PREFER_RECOMPUTE otherwise)."""

    def __init__(self, decide: Optional[Callable[[Any], Any]] = None) -> None:
        self.decide = decide or (lambda op: CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS
                                 else CheckpointPolicy.PREFER_RECOMPUTE)
        self.calls: List[Tuple[bool, Any]] = []

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((ctx.is_recompute, op))
        return self.decide(op)

    def ops(self, is_recompute: bool) -> List[Any]:
        return [op for flag, op in self.calls if flag is is_recompute]


def policy_for_matmuls(value: Any, other: Any = CheckpointPolicy.PREFER_RECOMPUTE) -> Callable[..., Any]:
    """``policy_fn`` answering ``value`` for matmuls and ``other`` for everything else."""

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return value if op in MATMUL_OPS else other

    return policy_fn


def save_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


def recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


# --------------------------------------------------------------------------------------
# a small region with known ops
# --------------------------------------------------------------------------------------


def make_params(seed: int = 0, n: int = 6, d: int = 5) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, w1, w2)``, all requiring grad, from a private generator."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen).requires_grad_()
    w1 = torch.randn(d, d, generator=gen).requires_grad_()
    w2 = torch.randn(d, d, generator=gen).requires_grad_()
    return x, w1, w2


def region(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Forward ops: ``mm`` x2, ``sin``, ``cos``, ``mul`` (by a tensor), ``add`` (scalar).

    ``sin`` and ``cos`` save their inputs (matmul outputs), so those are what backward needs;
    the final ``add`` saves nothing and runs after the last saved tensor (early stop skips it).
    """
    h = torch.mm(x, w1)
    h = h.sin()
    h = torch.mm(h, w2)
    h = h.cos() * x
    return h + 1.0


REGION_FORWARD_OPS = {aten.mm.default: 2, aten.sin.default: 1, aten.cos.default: 1}


def assert_all_equal(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> None:
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"tensor {i} differs: max abs diff {(u - v).abs().max().item()}"


# --------------------------------------------------------------------------------------
# the GPT-like model
# --------------------------------------------------------------------------------------


def tiny_gpt_config(**overrides: Any) -> Any:
    from hyper_parallel.bench.model import GPTConfig
    return GPTConfig(**{**TINY_GPT, **overrides})


def gpt_in_mode(mode: str, seed: int = 0, **cfg_overrides: Any) -> Any:
    """A tiny GPT with ``hyper_parallel.bench.modes.apply_mode(model, mode)`` applied."""
    from hyper_parallel.bench.model import GPT
    from hyper_parallel.bench.modes import apply_mode
    return apply_mode(GPT(tiny_gpt_config(**cfg_overrides), seed=seed), mode)


def train_snapshot(model: torch.nn.Module, steps: int = 3, batch: int = 4, lr: float = 1e-3,
                   seed: int = 0) -> Tuple[List[float], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Train with ``train_steps`` and return ``(losses, parameters, gradients)`` (by name)."""
    from hyper_parallel.bench.model import train_steps
    losses = train_steps(model, steps=steps, batch=batch, lr=lr, seed=seed, device="cpu")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, params, grads


def assert_state_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad}"
