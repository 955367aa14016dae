"""The only place that touches private PyTorch internals. Each helper says why it is needed."""

from __future__ import annotations

import contextlib
import copy
import sys

import torch

from typing import Any, List, Sequence, Set, Tuple

__all__ = ["storage_key", "storage_keys", "untyped_storage_key", "version", "storage_use_count", "in_backward", "detach_keeping_version",
           "pipeline_stages", "pipeline_microbatches", "pipeline_loss_fn", "pipeline_actions", "drop_pipeline_losses", "trace_range", "fsdp_module_class", "is_sharded", "unsharded_copy",
           "innermost_saved_tensors_hooks", "functional_collective", "is_compiled_module", "pinned_alloc_size",
           "empty_host_cache", "saved_identity"]

# Namespaces of PyTorch's functional collectives (and their waits): ops that communicate.
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
# Ops of those namespaces that do not communicate.
_NOT_COMMUNICATING = frozenset({"_wrap_tensor_autograd"})


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage ``t`` views (its ``StorageImpl``), stable while the storage lives;
    ``data_ptr`` would confuse two storages that reuse one address, and views with offsets."""
    return t.untyped_storage()._cdata


def untyped_storage_key(storage: "torch.UntypedStorage") -> int:
    """``storage_key`` of a storage object itself (FSDP2 holds some of its buffers as storages)."""
    return storage._cdata


def storage_keys(tensors: Sequence[torch.Tensor]) -> Set[int]:
    """``{storage_key(t) for t in tensors}`` in one call (a module's parameters, on every region call)."""
    return {t.untyped_storage()._cdata for t in tensors}


def version(t: torch.Tensor) -> int:
    """The version counter autograd uses to detect in-place changes of saved tensors."""
    return t._version


def storage_use_count(storage: "torch.UntypedStorage") -> int:
    """References to the storage's ``StorageImpl`` (one per tensor viewing it, plus one for the
    live Python storage object passed in). Public torch has no way to ask whether another tensor
    still shares a storage; we need it to skip offloading storages somebody else holds."""
    return torch._C._storage_Use_Count(storage._cdata)


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread. Forward hooks that fire
    then belong to a checkpoint recomputation and must not drive the swap schedule."""
    return torch._C._current_graph_task_id() != -1


_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView


def detach_keeping_version(x: torch.Tensor) -> torch.Tensor:
    """``x.detach()`` sharing ``x``'s version counter, also from inside a ``TorchDispatchMode``
    (below autograd), where the ADInplaceOrView key is excluded and must be re-enabled for the
    alias to share the counter: that is how an in-place change of a cached op output is detected
    later. Above autograd (a saved-tensor hook) a plain detach shares it already, and is cheaper."""
    if not torch._C._dispatch_tls_is_dispatch_key_excluded(_AD_INPLACE_OR_VIEW):
        return x.detach()
    with torch._C._SetExcludeDispatchKeyGuard(_AD_INPLACE_OR_VIEW, False):
        return x.detach()


def saved_identity(x: torch.Tensor) -> Tuple[torch.Tensor, int, int, int]:
    """``(detach_keeping_version(x), that alias's version now, storage_key(x), x's storage
    bytes)``: the private reads the swap path makes for every saved tensor, in one call."""
    alias = detach_keeping_version(x)
    storage = x.untyped_storage()
    return alias, alias._version, storage._cdata, storage.nbytes()


def pipeline_stages(schedule: Any) -> List[Any]:
    """The stages a ``torch.distributed.pipelining`` schedule runs on this process: single-stage
    schedules keep one in ``_stage``, multi-stage ones a list in ``_stages`` (no public accessor)."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [stage] if stage is not None else None
    if not stages:
        raise TypeError(
            f"pipeline_swap and pipeline_recompute expect a torch.distributed.pipelining schedule (ScheduleGPipe, "
            f"Schedule1F1B, ...) built on its PipelineStage(s), got {type(schedule).__name__}.")
    return list(stages)


def pipeline_microbatches(schedule: Any) -> int:
    """How many micro-batches a pipelining schedule splits a step into (``_n_microbatches``: the
    constructor's ``n_microbatches``, kept without a public accessor)."""
    return int(schedule._n_microbatches)


def pipeline_loss_fn(schedule: Any) -> Any:
    """The loss function a pipelining schedule's last stage applies (``_loss_fn``, the
    constructor's ``loss_fn``; no public accessor), or ``None``."""
    return getattr(schedule, "_loss_fn", None)


#: The compute actions of a schedule's action order (``_ComputationType`` values): forward, full
#: backward, and the input and weight halves of a split backward.
_COMPUTE_ACTIONS = frozenset({"F", "B", "I", "W"})


def pipeline_actions(schedule: Any) -> Any:
    """A pipelining schedule's compute actions per rank, in order, as ``(stage_index, kind,
    micro-batch)`` with ``kind`` one of ``"F"``, ``"B"``, ``"I"``, ``"W"``; ``None`` if the schedule
    has no action order. PyTorch builds it for its schedules (``pipeline_order``: rank -> a list
    of private ``_Action`` tuples, ``None`` for an idle step; a fused action lists its parts in
    ``sub_actions``); communication, resharding and gradient-reduction actions are left out."""
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        return None

    def compute(action: Any) -> List[Tuple[int, str, Any]]:
        if action is None:
            return []
        if getattr(action, "sub_actions", None):
            return [a for sub in action.sub_actions for a in compute(sub)]
        kind = getattr(action.computation_type, "value", str(action.computation_type))
        return [(int(action.stage_index), kind, action.microbatch_index)] if kind in _COMPUTE_ACTIONS else []

    return {int(rank): [a for action in actions for a in compute(action)] for rank, actions in order.items()}


def drop_pipeline_losses(schedule: Any) -> None:
    """Forget the per-microbatch losses an aborted step left in a pipelining schedule: PyTorch
    appends them to ``_internal_losses`` and clears it only after a successful step."""
    losses = getattr(schedule, "_internal_losses", None)
    if isinstance(losses, list):
        losses.clear()


_NO_RANGE = contextlib.nullcontext()  # reusable: nullcontext keeps no state


def trace_range(name: str) -> Any:
    """A ``record_function`` range named ``name`` while a ``torch.profiler`` / autograd profiler
    records on this thread, else a no-op context: opening a range costs microseconds even when
    nobody records, and the swap engine opens them several times per layer. Whether one records is
    a private flag (no public accessor)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NO_RANGE


def fsdp_module_class() -> Any:
    """``FSDPModule`` (the class ``fully_shard`` mixes into a module), or ``None`` while nothing
    imported ``torch.distributed.fsdp``: no module can be sharded before that, and importing it
    here would cost every process seconds (it pulls in DTensor and sympy)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None) if fsdp is not None else None


#: FSDP2 keeps a sharded module's state (its ``FSDPState``, the composable-API registry) in
#: ``module.__dict__`` under keys of this prefix (``torch.distributed._composable.contract``).
_COMPOSABLE_STATE_PREFIX = "__composable_api_state_key"


def is_sharded(module: Any) -> bool:
    """Whether ``module`` or a module inside it is FSDP2-sharded (``fully_shard``)."""
    fsdp = fsdp_module_class()
    return fsdp is not None and any(isinstance(m, fsdp) for m in module.modules())


def unsharded_copy(module: Any, without_hooks: Sequence[int] = ()) -> Any:
    """A deep copy of ``module`` as a plain module: ``copy.deepcopy`` where nothing in it is
    FSDP2-sharded; else (FSDP refuses deepcopy) every ``fully_shard`` module in it copied as its
    original class, without FSDP's state or its forward hooks, holding copies of the parameters
    it holds now. Call it while they are unsharded (inside the module's forward, after FSDP's
    pre-forward hook): the copy then runs alone, with no collective, on the full parameters, as
    the sharded module computes between its all-gather and its reshard. ``without_hooks``: ids of
    hook handles (``RemovableHandle.id``) the copy leaves out as well, the caller's own, which
    their handles cannot remove from a copy. Which attributes and hooks are FSDP's is FSDP2's
    private layout (the composable-API state keys, hooks bound to its state objects), hence here."""
    fsdp = fsdp_module_class()
    if not is_sharded(module):
        return copy.deepcopy(module)
    memo: dict = {}
    for sub in reversed(list(module.modules())):  # (inner sharded modules first: the outer copies find them in memo)
        if isinstance(sub, fsdp):
            memo[id(sub)] = _plain_copy(sub, fsdp, memo, set(without_hooks))
    return memo[id(module)] if id(module) in memo else copy.deepcopy(module, memo)


def _plain_copy(module: Any, fsdp: type, memo: dict, dropped: Set[int]) -> Any:
    states = [v for k, v in module.__dict__.items() if k.startswith(_COMPOSABLE_STATE_PREFIX)]
    owners = {id(s) for d in states if isinstance(d, dict) for s in d.values()}
    # FSDP's hooks are methods of its state objects; the "with kwargs" / "always called" dicts
    # name hooks by the same ids as the hook dicts
    dropped = dropped | {k for name in ("_forward_pre_hooks", "_forward_hooks")
                         for k, hook in module.__dict__.get(name, {}).items()
                         if id(getattr(hook, "__self__", None)) in owners}
    plain = object.__new__(next(c for c in type(module).__mro__ if not issubclass(c, fsdp)))
    memo[id(module)] = plain
    for key, value in module.__dict__.items():
        if key.startswith(_COMPOSABLE_STATE_PREFIX):
            continue
        if key.startswith("_forward") and isinstance(value, dict):
            value = type(value)((k, v) for k, v in value.items() if k not in dropped)
        plain.__dict__[key] = copy.deepcopy(value, memo)
    return plain


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (``OptimizedModule``, whose
    class PyTorch does not export publicly). Importing dynamo costs seconds: if nothing imported
    it yet, nothing was compiled."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def innermost_saved_tensors_hooks() -> Any:
    """The ``(pack, unpack)`` pair of the innermost saved-tensor hooks active now, or ``None``.
    Inside a non-reentrant checkpoint's forward these are the checkpoint's own hooks (its frame
    is private); a recompute session wraps them so that one recomputation can serve the halves of
    a split backward. PyTorch has no public accessor for the hooks stack."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(True) if top is not None else None


def functional_collective(op: Any) -> Any:
    """``"wait"`` if ``op`` (an ``OpOverload``) waits for a functional collective
    (``wait_tensor``), ``"collective"`` if it is one, else ``None``: its namespace is one of
    PyTorch's functional-collective libraries. ``OpOverload.namespace`` is public; the namespace
    and op names themselves are PyTorch internals."""
    if getattr(op, "namespace", None) not in _COLLECTIVE_NAMESPACES:
        return None
    name = getattr(op, "_opname", None) or str(op).split(".")[1]
    if name in _NOT_COMMUNICATING:
        return None
    return "wait" if name == "wait_tensor" else "collective"


def pinned_alloc_size(nbytes: int) -> int:
    """Bytes PyTorch's caching host allocator reserves for a pinned request of ``nbytes``: it rounds
    every request up to the next power of two (``c10::llvm::PowerOf2Ceil`` in
    ``CachingHostAllocator.h``; no public API says so)."""
    return 1 if nbytes <= 1 else 1 << (nbytes - 1).bit_length()


def empty_host_cache() -> None:
    """Return the pinned blocks the caching host allocator keeps to the OS
    (``torch.accelerator.empty_host_cache``, public from PyTorch 2.9; older builds only have the
    private binding, and some none)."""
    fn = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if fn is None:
        fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()
