"""Selective checkpointing: a pair of dispatch modes used as the ``context_fn`` of PyTorch's
non-reentrant checkpoint.

In forward, ``_CachingMode`` runs every op, asks the policy, and keeps the outputs of SAVE ops
(on the device) and SWAP ops (in a swap ``Storage``). While the region is recomputed in backward,
``_CachedMode`` asks the policy again (with ``ctx.is_recompute=True``), re-runs RECOMPUTE ops and
returns the kept outputs of SAVE/SWAP ops without running them. PyTorch's own checkpoint replaces
every tensor autograd saves in the region by a placeholder and recomputes it; these modes decide
which ops that recomputation may skip.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, DefaultDict, Dict, List, Optional, Tuple, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from hyper_parallel.core.activation_checkpoint.policy import (
    CheckpointPolicy, Decision, SelectiveCheckpointContext, normalize_policy)
from hyper_parallel.core.activation_checkpoint.policy import as_policy_fn as _as_policy_fn
from hyper_parallel.core.activation_checkpoint.selective import RECOMPUTE, OpLog
from hyper_parallel.core.activation_checkpoint.swap_tensor import SwapView

from . import _shim
from .saved import RegionMarker, Saved, region_flags

__all__ = ["create_selective_checkpoint_contexts", "policy_from_op_list", "convert_torch_policy",
           "SelectiveRegion"]

_TORCH_POLICY = torch.utils.checkpoint.CheckpointPolicy
_FROM_TORCH = {
    _TORCH_POLICY.MUST_SAVE: CheckpointPolicy.MUST_SAVE,
    _TORCH_POLICY.PREFER_SAVE: CheckpointPolicy.PREFER_SAVE,
    _TORCH_POLICY.MUST_RECOMPUTE: CheckpointPolicy.MUST_RECOMPUTE,
    _TORCH_POLICY.PREFER_RECOMPUTE: CheckpointPolicy.PREFER_RECOMPUTE,
    # PyTorch eager treats CPU_OFFLOAD as recompute; here it really offloads.
    _TORCH_POLICY.MUST_CPU_OFFLOAD: CheckpointPolicy.MUST_SWAP,
    _TORCH_POLICY.PREFER_CPU_OFFLOAD: CheckpointPolicy.MUST_SWAP,
}


def convert_torch_policy(value: Any) -> Optional[CheckpointPolicy]:
    """Map a ``torch.utils.checkpoint.CheckpointPolicy`` member to ours (``None`` otherwise)."""
    return _FROM_TORCH.get(value) if isinstance(value, _TORCH_POLICY) else None


def policy_from_op_list(ops: Any) -> Callable[..., CheckpointPolicy]:
    """A list of ``OpOverload`` s as a policy: MUST_SAVE for those ops, PREFER_RECOMPUTE else."""
    chosen = set()
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            raise ValueError(
                f"policy list entry {op} is an OpOverloadPacket; name one overload, e.g. "
                f"torch.ops.aten.mm.default instead of torch.ops.aten.mm.")
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"policy list entries must be torch OpOverloads such as "
                            f"torch.ops.aten.mm.default, got {op!r} ({type(op).__name__}).")
        chosen.add(op)

    def policy_fn(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in chosen else CheckpointPolicy.PREFER_RECOMPUTE

    policy_fn.ops = frozenset(chosen)  # type: ignore[attr-defined]
    return policy_fn


def as_policy_fn(policy_fn_or_list: Any) -> Callable[..., Any]:
    return _as_policy_fn(policy_fn_or_list, policy_from_op_list, "OpOverloads")


# Ops that always run again in recompute, without asking the policy:
# - detach / prim.device: checkpoint itself issues a different number of them in recompute;
# - ops that mutate an argument: replaying their output cannot replay the mutation;
# - ops that draw random numbers: recompute restores the RNG state and must consume it exactly as
#   forward did, or every later random op (dropout) would differ.
_ALWAYS_RERUN: Dict[Any, bool] = {torch.ops.aten.detach.default: True, torch.ops.prim.device.default: True}


def _always_rerun(func: Any) -> bool:
    known = _ALWAYS_RERUN.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = bool(schema is not None and schema.is_mutable) or \
            torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        _ALWAYS_RERUN[func] = known
    return known



# Positions / names of the arguments an op writes to (from its schema), per op.
_WRITTEN_ARGS: Dict[Any, Tuple[Tuple[int, str], ...]] = {}


def _written_tensors(func: Any, args: Tuple, kwargs: Dict) -> List[torch.Tensor]:
    spec = _WRITTEN_ARGS.get(func)
    if spec is None:
        schema = getattr(func, "_schema", None)
        spec = tuple((i, a.name) for i, a in enumerate(schema.arguments if schema is not None else ())
                     if a.alias_info is not None and a.alias_info.is_write)
        _WRITTEN_ARGS[func] = spec
    out = []
    for i, name in spec:
        value = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


class SelectiveRegion:
    """What one selective checkpoint call kept, op by op (``func -> [entry per call]``)."""

    def __init__(self, policy_fn: Callable[..., Any], allow_cache_entry_mutation: bool = False,
                 storage_factory: Optional[Callable[[], Any]] = None) -> None:
        self.policy_fn = policy_fn
        self.allow_mutation = allow_cache_entry_mutation
        self.log = OpLog()
        self._storage_factory = storage_factory
        self._storage: Any = None
        # storage id -> (func, index) of kept outputs viewing it: an in-place op on one of them
        # later in the forward destroys the value that was kept (see ``forget_mutated``).
        self._kept_by_storage: DefaultDict[int, List[Tuple[Any, int]]] = defaultdict(list)
        self.policy_error: Optional[BaseException] = None

    @property
    def storage(self) -> Any:
        if self._storage is None:
            if self._storage_factory is None:
                from hyper_parallel.core.activation_checkpoint.swap_manager import SwapManager
                self._storage = SwapManager().new_storage()
            else:
                self._storage = self._storage_factory()
        return self._storage

    def ask(self, is_recompute: bool, func: Any, args: Tuple, kwargs: Dict, out: Any = None) -> Decision:
        ctx = SelectiveCheckpointContext(is_recompute=is_recompute, op_output=out)
        answer = self.policy_fn(ctx, func, *args, **kwargs)
        try:
            return normalize_policy(answer, func, convert_torch_policy).decision
        except TypeError as err:
            # Operators such as `a @ b` turn a TypeError into NotImplemented; checkpoint() re-raises
            # this one so the user sees which op and value were wrong.
            self.policy_error = err
            raise

    def keep(self, func: Any, decision: Decision, out: Any) -> None:
        if decision is Decision.RECOMPUTE:
            self.log.record(func, decision, None)
            return
        index = self.log.record(func, decision,
                                tree_map(self._save if decision is Decision.SAVE else self._swap, out))
        if not self.allow_mutation:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._kept_by_storage[_shim.storage_key(t)].append((func, index))

    def forget_mutated(self, func: Any, args: Tuple, kwargs: Dict) -> None:
        """An op that writes to its arguments ran in forward. A kept output it overwrote no longer
        holds the value backward needs (e.g. CPU dropout fills an ``empty_like`` output with
        ``bernoulli_``; ``ReLU(inplace=True)`` overwrites a saved ``addmm``): that op is
        recomputed instead, which replays the same writes in the same order."""
        if not self._kept_by_storage:
            return
        for t in _written_tensors(func, args, kwargs):
            for kept_func, index in self._kept_by_storage.pop(_shim.storage_key(t), ()):
                self.log.recompute_instead(kept_func, index)

    def _save(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return Saved(_shim.detach_keeping_version(x), check=not self.allow_mutation)
        return x

    def _swap(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        from hyper_parallel.platform import get_platform
        alias = _shim.detach_keeping_version(x)
        reason = get_platform().tensor_ops.unswappable_reason(alias)
        if reason is not None:
            self.storage.add_save(alias.untyped_storage().nbytes(), reason)
            return Saved(alias, check=not self.allow_mutation)
        return self.storage.add_swap(alias)


def _take(x: Any) -> Any:
    return x.get_val() if isinstance(x, (Saved, SwapView)) else x


class _RegionMode(TorchDispatchMode):
    """A dispatch mode of one selective region that also marks (on this thread) that the
    region's forward, or its recomputation, is running."""

    recompute = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, region: SelectiveRegion) -> None:
        super().__init__()
        self.region = region
        self._marker = RegionMarker(recompute=self.recompute)

    def __enter__(self) -> "_RegionMode":
        self._marker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._marker.__exit__(*exc)


class _CachingMode(_RegionMode):
    """Forward of a selective region: run each op, ask the policy, keep what it says to keep."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _always_rerun(func):
            self.region.forget_mutated(func, args, kwargs)
        else:
            self.region.keep(func, self.region.ask(False, func, args, kwargs, out), out)
        return out


class _CachedMode(_RegionMode):
    """Recomputation of a selective region: re-run RECOMPUTE ops, hand back kept outputs."""

    recompute = True

    def __enter__(self) -> "_CachedMode":
        self.region.log.start_replay()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if _always_rerun(func):
            return func(*args, **kwargs)
        region = self.region
        index, kept, ask = region.log.next_call(func, func)
        if ask:
            region.log.check(func, index, region.ask(True, func, args, kwargs), func)
        if kept is RECOMPUTE:
            return func(*args, **kwargs)
        value = tree_map(_take, kept)  # may raise (e.g. not loaded): the record then stays usable
        region.log.consume(func, index)
        return value


def create_selective_checkpoint_contexts(policy_fn_or_list: Union[Callable[..., Any], List[Any]],
                                         allow_cache_entry_mutation: bool = False,
                                         ) -> Tuple[TorchDispatchMode, TorchDispatchMode]:
    """Return the ``(forward, recompute)`` context pair for PyTorch's non-reentrant checkpoint.

    ``policy_fn_or_list`` is ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (or a bool,
    or a ``torch.utils.checkpoint.CheckpointPolicy``), or a list of ``OpOverload`` s to save.
    ``MUST_SWAP`` outputs go to the current swap group of the :class:`SwapManager`.

    Example::

        >>> import functools, torch
        >>> from torch.utils.checkpoint import checkpoint as torch_checkpoint
        >>> from hyper_parallel.core.activation_checkpoint import create_selective_checkpoint_contexts
        >>> w = torch.randn(8, 8, requires_grad=True)
        >>> ctx_fn = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        >>> y = torch_checkpoint(lambda x: (x @ w).relu(), torch.randn(4, 8), use_reentrant=False,
        ...                      context_fn=ctx_fn)
        >>> y.sum().backward()
    """
    region = SelectiveRegion(as_policy_fn(policy_fn_or_list), allow_cache_entry_mutation)
    return _CachingMode(region), _CachedMode(region)


def contexts_for_region(region: SelectiveRegion) -> Tuple[TorchDispatchMode, TorchDispatchMode]:
    return _CachingMode(region), _CachedMode(region)
