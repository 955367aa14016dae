"""``checkpoint`` / ``swap_region``: the two region kinds, built on MindSpore's public machinery
(``mindspore.recompute(..., use_reentrant=False, context_fn=...)`` and ``saved_tensors_hooks``)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import mindspore as ms
from mindspore import nn

from . import _shim
from .sac import SelectiveRegion, as_policy_fn, contexts_for_region
from .saved import region_flags
from .swap_hooks import SwapPacker, parameter_storages

__all__ = ["checkpoint", "swap_region", "MS_CHECKPOINT_OPTIONS", "check_pynative"]

#: Keyword arguments that configure ``mindspore.recompute`` rather than go to the function.
#: ``early_stop`` defaults to False here: MindSpore 2.10's early stop raises its stop signal from
#: inside the saved-tensor hook, and when that happens inside a legacy primitive (e.g. the CPU
#: ``Dropout``) the recompute's graph bookkeeping breaks ("Stack input_args_info_stack_ is empty").
#: ``preserve_rng_state`` maps to MindSpore's ``save_rng_state``.
MS_CHECKPOINT_OPTIONS = ("early_stop", "preserve_rng_state")


def _manager() -> Any:
    from hyper_parallel.core.activation_checkpoint.swap_manager import SwapManager
    return SwapManager()


def _owner(function: Callable[..., Any]) -> Any:
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Cell) else function


def _platform_ops() -> Any:
    from hyper_parallel.platform import get_platform
    return get_platform().tensor_ops


def check_pynative(what: str) -> None:
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise RuntimeError(f"hyper_parallel {what} on MindSpore runs in PyNative mode only "
                           "(mindspore.set_context(mode=mindspore.PYNATIVE_MODE)); in graph mode use "
                           "Cell.recompute().")


def checkpoint(function: Callable[..., Any], *args: Any, policy_fn: Any = None, swap_inputs: bool = False,
               use_reentrant: Optional[bool] = None, **kwargs: Any) -> Any:
    if use_reentrant:
        raise ValueError("hyper_parallel checkpoint is always non-reentrant (use_reentrant=False); "
                         "reentrant recompute cannot host selective policies or swap.")
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {function!r}")
    if not isinstance(swap_inputs, bool):
        raise TypeError(f"swap_inputs must be a bool, got {swap_inputs!r}")
    if "context_fn" in kwargs:
        raise TypeError("checkpoint: pass policy_fn instead of context_fn (hyper_parallel builds the "
                        "context pair itself; use create_selective_checkpoint_contexts with "
                        "mindspore.recompute directly if you need a custom context_fn).")
    policy = as_policy_fn(policy_fn) if policy_fn is not None else None
    early_stop = bool(kwargs.pop("early_stop", False))
    if "preserve_rng_state" in kwargs:
        kwargs["save_rng_state"] = bool(kwargs.pop("preserve_rng_state"))
    check_pynative("checkpoint")
    if not _shim.recording_grad():
        kwargs.pop("save_rng_state", None)
        return function(*args, **kwargs)  # nothing is saved: nothing to checkpoint or swap

    storage = None

    def storage_factory() -> Any:
        nonlocal storage
        if storage is None:
            storage = _manager().new_storage()
        return storage

    # Whole-region recompute (policy None) goes through the same dispatch modes: they re-run
    # every op except random ones, whose outputs are kept so that dropout masks match forward.
    region = SelectiveRegion(policy, storage_factory=storage_factory)

    def context_fn() -> Any:
        return contexts_for_region(region)

    hooks: Any = contextlib.nullcontext()
    if swap_inputs:
        # With a saved-tensor hook active, mindspore.recompute saves the block's inputs through
        # autograd (``_InputSaver``) *before* it installs its placeholder hook, so hooks installed
        # around the call see exactly the inputs (the RFC's "inputs" window).
        packer = SwapPacker(storage_factory(), _platform_ops(), None, parameter_storages(_owner(function)))
        hooks = packer.hooks()
    with hooks:
        return ms.recompute(function, *args, use_reentrant=False, early_stop=early_stop,
                            context_fn=context_fn, **kwargs)


def swap_region(function: Callable[..., Any], policy_fn: Optional[Callable[[Any], Any]],
                *args: Any, **kwargs: Any) -> Any:
    """Run ``function`` so that every tensor autograd saves in it is a swap candidate."""
    if not _shim.recording_grad() or region_flags.checkpoint_depth > 0 or _shim.in_backward():
        # Nothing is saved, or a checkpoint region owns what is saved here (its own hooks must see
        # the tensors so that recomputation works): swap does not apply.
        return function(*args, **kwargs)
    check_pynative("swap_wrapper")
    storage = _manager().new_storage()
    packer = SwapPacker(storage, _platform_ops(), policy_fn, parameter_storages(_owner(function)))
    with packer.hooks():
        return function(*args, **kwargs)
