"""Selective checkpointing on MindSpore: a pair of ``MsDispatchMode`` s used as the ``context_fn``
of ``mindspore.recompute(block, *args, use_reentrant=False, context_fn=...)``.

``mindspore.recompute`` replaces every tensor autograd saves inside the block by a placeholder
(``_CreatePlaceholderHook``) and re-runs the block when backward unpacks one. Inside that:

- forward, ``_CachingMindSporeDispatchMode``: each op runs, the policy is asked, and the outputs
  of SAVE ops (kept on the device) and SWAP ops (kept in a swap ``Storage``) are cached;
- recomputation, ``_CachedMindSporeDispatchMode``: the policy is asked again
  (``ctx.is_recompute=True``); RECOMPUTE ops run, SAVE/SWAP ops return the cached outputs
  without running.

The policy receives MindSpore's op object (``mindspore._c_expression.OpFunc``); name ops by
``op.name`` (the primitive name, e.g. ``"MatMul"``, ``"MatMulExt"``, ``"BatchMatMulExt"``,
``"Softmax"``). A list policy names ops by those strings.

Ops that are never left to the policy:

- ops that mutate an argument (``Inplace*``, ``Assign*``...) always run again: replaying their
  output cannot replay the mutation;
- ops that draw random numbers (dropout, ``Uniform*``, ``Bernoulli``...) are always kept (SAVE):
  MindSpore's CPU kernels keep their own RNG state, which ``recompute`` cannot restore, so running
  them again would draw a different dropout mask;
- ``StopGradient``, which ``mindspore.recompute`` itself issues only while recomputing.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple, Union

from mindspore import Tensor
from mindspore.utils import MsDispatchMode

from hyper_parallel.core.activation_checkpoint.policy import (
    CheckpointPolicy, Decision, SelectiveCheckpointContext, normalize_policy)
from hyper_parallel.core.activation_checkpoint.policy import as_policy_fn as _as_policy_fn
from hyper_parallel.core.activation_checkpoint.selective import RECOMPUTE, OpLog
from hyper_parallel.core.activation_checkpoint.swap_tensor import SwapView

from . import _shim
from .saved import RegionMarker, Saved

__all__ = ["create_selective_checkpoint_contexts", "policy_from_op_list", "op_name", "is_random_op",
           "is_mutating_op", "RANDOM_OP_NAMES", "SelectiveRegion"]


# ------------------------------------------------------------------------------------- op naming
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


def policy_from_op_list(ops: Any) -> Callable[..., CheckpointPolicy]:
    """A list of op names as a policy: MUST_SAVE for those ops, PREFER_RECOMPUTE for the rest.

    Entries are primitive names (``"MatMul"``, ``"BatchMatMulExt"``), ``Primitive`` instances
    (``ops.MatMul()``) or classes (``ops.MatMul``)."""
    chosen = set()
    for op in ops:
        if isinstance(op, str):
            if not op:
                raise ValueError("policy list entries must be non-empty op names such as 'MatMul'.")
            chosen.add(op)
            continue
        try:
            from mindspore.ops import Primitive
        except ImportError:  # pragma: no cover
            Primitive = ()  # type: ignore[assignment]
        if (isinstance(op, type) and issubclass(op, Primitive)) or isinstance(op, Primitive):
            chosen.add(op_name(op))
            continue
        raise TypeError(f"policy list entries must be op names such as 'MatMul' (or mindspore.ops "
                        f"Primitives), got {op!r} ({type(op).__name__}).")
    frozen: FrozenSet[str] = frozenset(chosen)

    def policy_fn(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op.name in frozen else CheckpointPolicy.PREFER_RECOMPUTE

    policy_fn.ops = frozen  # type: ignore[attr-defined]
    return policy_fn


def as_policy_fn(policy_fn_or_list: Any) -> Callable[..., Any]:
    return _as_policy_fn(policy_fn_or_list, policy_from_op_list, "op names")


# ------------------------------------------------------------------------------------- op classes
#: Ops issued by ``mindspore.recompute`` itself while recomputing (never in forward).
_MACHINERY_OPS = frozenset({"StopGradient"})

_MUTATING_NAMES = frozenset({"Assign", "AssignAdd", "AssignSub", "ScatterUpdate", "ScatterAdd", "ScatterSub",
                             "ScatterMul", "ScatterDiv", "ScatterMax", "ScatterMin", "ScatterNdUpdate",
                             "ScatterNdAdd", "ScatterNdSub", "TensorScatterUpdate", "Load", "UpdateState"})

#: Names (lower case) of ops that draw random numbers; extend it for custom random ops.
RANDOM_OP_NAMES = {"gamma", "randomgamma", "standardnormal", "standardlaplace", "truncatednormal",
                   "lognormalreverse", "parameterizedtruncatednormal", "randomstandardnormal",
                   "randomcategorical", "randomchoicewithmask", "randomshuffle", "randperm", "randpermv2",
                   "randpermext"}
_RANDOM_WORDS = ("dropout", "rand", "uniform", "bernoulli", "multinomial", "poisson")

_CLASS_CACHE: Dict[str, Tuple[bool, bool]] = {}


def is_mutating_op(name: str) -> bool:
    return name.startswith("Inplace") or name in _MUTATING_NAMES


def is_random_op(name: str) -> bool:
    low = name.lower()
    return low in RANDOM_OP_NAMES or any(w in low for w in _RANDOM_WORDS) or \
        (low.startswith("normal") and not low.startswith("normalize"))


def _classify(name: str) -> Tuple[bool, bool]:
    """``(always_run_uncached, always_keep)``."""
    known = _CLASS_CACHE.get(name)
    if known is None:
        rerun = name in _MACHINERY_OPS or is_mutating_op(name)
        keep = not rerun and is_random_op(name)
        known = _CLASS_CACHE[name] = (rerun, keep)
    return known


def _run(func: Any, args: Tuple, kwargs: Optional[Dict]) -> Any:
    return func(*args, **kwargs) if kwargs else func(*args)


def _tree_map(fn: Callable[[Any], Any], x: Any) -> Any:
    if isinstance(x, tuple):
        return tuple(_tree_map(fn, v) for v in x)
    if isinstance(x, list):
        return [_tree_map(fn, v) for v in x]
    return fn(x)




def _ops() -> Any:
    from hyper_parallel.platform import get_platform
    return get_platform().tensor_ops


class SelectiveRegion:
    """What one selective checkpoint call kept, op by op (``name -> [entry per call]``).

    ``policy_fn=None`` is whole-region recompute: every op is re-run except those that must be
    kept (random ops), and no policy is asked."""

    def __init__(self, policy_fn: Optional[Callable[..., Any]], allow_cache_entry_mutation: bool = False,
                 storage_factory: Optional[Callable[[], Any]] = None) -> None:
        self.policy_fn = policy_fn
        self.allow_mutation = allow_cache_entry_mutation
        self.log = OpLog()
        self._storage_factory = storage_factory
        self._storage: Any = None

    @property
    def storage(self) -> Any:
        if self._storage is None:
            if self._storage_factory is None:
                from hyper_parallel.core.activation_checkpoint.swap_manager import SwapManager
                self._storage = SwapManager().new_storage()
            else:
                self._storage = self._storage_factory()
        return self._storage

    def ask(self, is_recompute: bool, func: Any, args: Tuple, kwargs: Optional[Dict], out: Any = None) -> Decision:
        if self.policy_fn is None:
            return Decision.RECOMPUTE
        ctx = SelectiveCheckpointContext(is_recompute=is_recompute, op_output=out)
        answer = self.policy_fn(ctx, func, *args, **(kwargs or {}))
        return normalize_policy(answer, func.name).decision

    def keep(self, name: str, decision: Decision, out: Any, forced: bool = False) -> None:
        """Record one forward call; ``forced``: kept without asking the policy (random ops)."""
        if decision is Decision.RECOMPUTE:
            kept = None
        else:
            kept = _tree_map(self._save if decision is Decision.SAVE else self._swap, out)
        self.log.record(name, decision, kept, asked=not forced)

    def _save(self, x: Any) -> Any:
        if isinstance(x, Tensor):
            return Saved(_ops().alias(x), check=not self.allow_mutation)
        return x

    def _swap(self, x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        ops = _ops()
        alias = ops.alias(x)
        reason = ops.unswappable_reason(alias)
        if reason is not None:
            self.storage.add_save(ops.storage_nbytes(alias) if reason != "unsupported_tensor" else 0, reason)
            return Saved(alias, check=not self.allow_mutation)
        return self.storage.add_swap(alias)


def _take(x: Any) -> Any:
    if isinstance(x, (Saved, SwapView)):
        # A fresh alias: autograd attaches the recomputed node to the returned tensor object, so
        # it must not be the one the cache (or the swap system) keeps.
        return _ops().alias(x.get_val())
    return x


class _ModeBase(MsDispatchMode):
    def __init__(self, region: SelectiveRegion, recompute: bool) -> None:
        super().__init__()
        self.region = region
        self._marker = RegionMarker(recompute=recompute)
        self._pipeline_prev: List[bool] = []

    def __enter__(self) -> "_ModeBase":
        self._pipeline_prev.append(_shim.disable_pipeline())
        self._marker.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._marker.__exit__(None, None, None)
            _shim.restore_pipeline(self._pipeline_prev.pop())
            raise

    def __exit__(self, *exc: Any) -> bool:
        try:
            super().__exit__(*exc)
        finally:
            self._marker.__exit__(*exc)
            _shim.restore_pipeline(self._pipeline_prev.pop())
        return False


class _CachingMindSporeDispatchMode(_ModeBase):
    """Forward of a selective region: run each op, ask the policy, keep what it says to keep."""

    def __init__(self, region: SelectiveRegion) -> None:
        super().__init__(region, recompute=False)

    def __ms_dispatch__(self, func: Any, args: Tuple, kwargs: Optional[Dict] = None) -> Any:
        out = _run(func, args, kwargs)
        name = func.name
        rerun, keep = _classify(name)
        if rerun:
            return out
        if keep:
            self.region.keep(name, Decision.SAVE, out, forced=True)
        else:
            self.region.keep(name, self.region.ask(False, func, args, kwargs, out), out)
        return out


class _CachedMindSporeDispatchMode(_ModeBase):
    """Recomputation of a selective region: re-run RECOMPUTE ops, hand back kept outputs."""

    def __init__(self, region: SelectiveRegion) -> None:
        super().__init__(region, recompute=True)

    def __enter__(self) -> "_CachedMindSporeDispatchMode":
        self.region.log.start_replay()  # each recomputation replays the region from its first op
        super().__enter__()
        return self

    def __ms_dispatch__(self, func: Any, args: Tuple, kwargs: Optional[Dict] = None) -> Any:
        name = func.name
        rerun, _ = _classify(name)
        if rerun:
            return _run(func, args, kwargs)
        region = self.region
        index, kept, ask = region.log.next_call(name, name)
        if ask:
            region.log.check(name, index, region.ask(True, func, args, kwargs), name)
        if kept is RECOMPUTE:
            return _run(func, args, kwargs)
        value = _tree_map(_take, kept)  # may raise (e.g. not loaded): the record then stays usable
        region.log.consume(name, index)  # release device memory as soon as backward has used it
        return value


def create_selective_checkpoint_contexts(policy_fn_or_list: Union[Callable[..., Any], List[Any]],
                                         allow_cache_entry_mutation: bool = False,
                                         ) -> Tuple[MsDispatchMode, MsDispatchMode]:
    """Return the ``(forward, recompute)`` context pair for ``mindspore.recompute``.

    Example::

        >>> import functools, mindspore as ms
        >>> from hyper_parallel.core.activation_checkpoint import create_selective_checkpoint_contexts
        >>> ctx_fn = functools.partial(create_selective_checkpoint_contexts, ["MatMul", "BatchMatMulExt"])
        >>> # y = ms.recompute(block, x, use_reentrant=False, early_stop=False, context_fn=ctx_fn)
    """
    region = SelectiveRegion(as_policy_fn(policy_fn_or_list), allow_cache_entry_mutation)
    return _CachingMindSporeDispatchMode(region), _CachedMindSporeDispatchMode(region)


def contexts_for_region(region: SelectiveRegion) -> Tuple[MsDispatchMode, MsDispatchMode]:
    return _CachingMindSporeDispatchMode(region), _CachedMindSporeDispatchMode(region)
