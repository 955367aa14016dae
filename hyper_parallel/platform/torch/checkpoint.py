"""``checkpoint`` / ``swap_region``: the two region kinds, built on PyTorch's public machinery."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint as torch_ckpt

from . import _shim
from .sac import SelectiveRegion, as_policy_fn, contexts_for_region
from .saved import RegionMarker, region_flags
from .swap_hooks import SwapPacker, parameter_storages

__all__ = ["checkpoint", "swap_region", "TORCH_CHECKPOINT_OPTIONS"]

# Keyword arguments of torch.utils.checkpoint.checkpoint that pass through; every other keyword
# argument goes to the checkpointed function (as in PyTorch).
TORCH_CHECKPOINT_OPTIONS = ("preserve_rng_state", "determinism_check", "debug", "early_stop")


def _manager() -> Any:
    from hyper_parallel.core.activation_checkpoint.swap_manager import SwapManager
    return SwapManager()


def _owner(function: Callable[..., Any]) -> Any:
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else function


def _marker_contexts() -> Any:
    return RegionMarker(recompute=False), RegionMarker(recompute=True)


def checkpoint(function: Callable[..., Any], *args: Any, policy_fn: Any = None, swap_inputs: bool = False,
               use_reentrant: Optional[bool] = None, **kwargs: Any) -> Any:
    if use_reentrant:
        raise ValueError("hyper_parallel checkpoint is always non-reentrant (use_reentrant=False); "
                         "reentrant checkpoint cannot host selective policies or swap.")
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {function!r}")
    if not isinstance(swap_inputs, bool):
        raise TypeError(f"swap_inputs must be a bool, got {swap_inputs!r}")
    options = {k: kwargs.pop(k) for k in TORCH_CHECKPOINT_OPTIONS if k in kwargs}
    if "context_fn" in kwargs:
        raise TypeError("checkpoint: pass policy_fn instead of context_fn (hyper_parallel builds the "
                        "context pair itself; use create_selective_checkpoint_contexts with "
                        "torch.utils.checkpoint directly if you need a custom context_fn).")
    policy = as_policy_fn(policy_fn) if policy_fn is not None else None  # validate even in eval
    if options.get("debug") and policy is not None:
        raise ValueError("checkpoint: debug=True cannot be combined with policy_fn (PyTorch's debug mode "
                         "only works with its default context_fn); drop one of them.")
    if policy is not None:
        _refuse_sharded_units_inside(_owner(function))
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)  # nothing is saved: nothing to checkpoint or swap

    storage = None
    if swap_inputs or policy_fn is not None:
        def storage_factory() -> Any:
            nonlocal storage
            if storage is None:
                storage = _manager().new_storage()
            return storage

    region = None
    if policy is not None:
        region = SelectiveRegion(policy, storage_factory=storage_factory)
        context_fn = lambda: contexts_for_region(region)  # noqa: E731
    elif options.get("debug"):
        context_fn = torch_ckpt.noop_context_fn  # debug mode insists on the default contexts
    else:
        context_fn = _marker_contexts

    hooks: Any = contextlib.nullcontext()
    if swap_inputs and not _nested():
        # Checkpoint saves the region's inputs with an autograd SavedVariable *before* it installs
        # its own saved-tensor hooks, so hooks installed around the call see exactly the inputs.
        packer = SwapPacker(storage_factory(), _platform_ops(), None, parameter_storages(_owner(function)))
        hooks = packer.hooks()
    try:
        with hooks:
            return torch_ckpt.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn,
                                         **options, **kwargs)
    except TypeError as err:
        if region is not None and region.policy_error is not None and region.policy_error is not err:
            raise region.policy_error from None  # an operator (a @ b) replaced it by its own message
        raise


def _fsdp_module_class() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return None
    return FSDPModule


def _refuse_sharded_units_inside(owner: Any) -> None:
    """FSDP2 units inside a selective region run their all-gather/reshard hooks differently in
    forward and in recompute, which a selective policy cannot replay: say so plainly."""
    fsdp = _fsdp_module_class()
    if fsdp is None or not isinstance(owner, torch.nn.Module):
        return
    for name, sub in owner.named_modules():
        if name and isinstance(sub, fsdp):
            raise ValueError(
                f"checkpoint_wrapper with a policy_fn around a module that contains fully_shard units "
                f"({name!r}) is not supported: wrap each layer with checkpoint_wrapper/swap_wrapper "
                "first, then apply fully_shard to the layers and the root.")


def _nested() -> bool:
    """Inside a checkpoint region (its forward or its recomputation), the region's own hooks must
    see every saved tensor, or recomputation breaks: swap hooks are not installed there."""
    return region_flags.checkpoint_depth > 0 or _shim.in_backward()


def _platform_ops() -> Any:
    from hyper_parallel.platform import get_platform
    return get_platform().tensor_ops


def swap_region(function: Callable[..., Any], policy_fn: Optional[Callable[[torch.Tensor], Any]],
                *args: Any, **kwargs: Any) -> Any:
    """Run ``function`` so that every tensor autograd saves in it is a swap candidate."""
    if not torch.is_grad_enabled() or _nested():
        # Nothing is saved, or a checkpoint region owns what is saved here (its own hooks must see
        # the tensors so that recomputation works): swap does not apply.
        return function(*args, **kwargs)
    storage = _manager().new_storage()
    packer = SwapPacker(storage, _platform_ops(), policy_fn, parameter_storages(_owner(function)))
    with packer.hooks():
        return function(*args, **kwargs)
