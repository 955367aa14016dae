"""The two region kinds and their control flow: ``checkpoint`` (recompute, selective policies,
swapped op outputs and inputs) and ``swap_region`` (swap what autograd saves)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Tuple

from .argument_state import watch_arguments
from .backend import Backend, active_backend
from .packer import SwapPacker, parameter_storages
from .policy import as_policy_fn
from .recompute_session import SessionBoxes
from .region_state import RegionFrame, region_contexts, region_flags
from .selective import SelectiveRegion
from .storage import Storage
from .swap_manager import SwapManager

__all__ = ["checkpoint", "swap_region", "check_policy_fn", "create_selective_checkpoint_contexts"]


def check_policy_fn(backend: Backend, policy_fn: Any) -> Optional[Callable[..., Any]]:
    """The policy function for ``policy_fn`` (a callable or a list of ops), or ``None``; a bad
    value is an error now rather than at the first forward."""
    if policy_fn is None:
        return None
    return as_policy_fn(policy_fn, backend.op_list_entry, backend.op_key, backend.op_list_entries)


class _LazyStorage:
    """The swap ``Storage`` of one region's forward, created (in the current group) on first use,
    so a region that swaps nothing registers nothing."""

    __slots__ = ("_storage",)

    def __init__(self) -> None:
        self._storage: Optional[Storage] = None

    def __call__(self) -> Storage:
        if self._storage is None:
            self._storage = SwapManager().new_storage()
        return self._storage


def _owner(backend: Backend, function: Callable[..., Any]) -> Any:
    """The module whose bound method ``function`` is (its parameters are never swap candidates)."""
    owner = getattr(function, "__self__", None)
    return owner if backend.is_module(owner) else None


def _nested(backend: Backend) -> bool:
    """Inside a checkpoint region (its forward or its recomputation), the region's own hooks must
    see every saved tensor, or recomputation breaks: swap hooks stand aside there."""
    return region_flags.checkpoint_depth > 0 or backend.in_backward()


def checkpoint(function: Callable[..., Any], *args: Any, policy_fn: Any = None, swap_inputs: bool = False,
               use_reentrant: Optional[bool] = None, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` under (non-reentrant) activation checkpointing.

    - ``policy_fn=None``: whole-region recompute. Only the inputs are kept; backward re-runs the
      region.
    - ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy``: selective. SAVE keeps the op's
      output, RECOMPUTE re-runs the op in backward, MUST_SWAP keeps the output in the current swap
      group of :class:`SwapManager` (offloaded when the group is). A ``bool`` or a
      ``torch.utils.checkpoint.CheckpointPolicy`` answer is accepted too. ``policy_fn`` may also be
      a list of ``OpOverload`` s (MUST_SAVE for those, PREFER_RECOMPUTE for the rest).
      Ops that mutate an argument always re-run, without asking the policy; ops that draw random
      numbers (dropout, attention) follow it, and a kept one leaves the generator where forward did.
    - ``swap_inputs=True``: the inputs that checkpoint keeps are swap candidates too.

    The keyword arguments ``preserve_rng_state``, ``determinism_check``, ``debug`` and
    ``early_stop`` go to ``torch.utils.checkpoint.checkpoint``; all others go to ``function``.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint
        >>> lin = torch.nn.Linear(16, 16)
        >>> def policy_fn(ctx, op, *args, **kwargs):
        ...     return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.addmm.default \
        ...         else CheckpointPolicy.PREFER_RECOMPUTE
        >>> y = checkpoint(lambda x: torch.nn.functional.gelu(lin(x)), torch.randn(4, 16),
        ...                policy_fn=policy_fn)
        >>> y.sum().backward()
    """
    b = active_backend()
    if use_reentrant:
        raise ValueError("hyper_parallel checkpoint is always non-reentrant (use_reentrant=False); "
                         "reentrant checkpoint cannot host selective policies or swap.")
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {function!r}")
    if not isinstance(swap_inputs, bool):
        raise TypeError(f"swap_inputs must be a bool, got {swap_inputs!r}")
    if "context_fn" in kwargs:
        raise TypeError("checkpoint: pass policy_fn instead of context_fn (hyper_parallel builds the "
                        "context pair itself; use create_selective_checkpoint_contexts with the "
                        "framework's own checkpoint if you need a custom context_fn).")
    options = {k: kwargs.pop(k) for k in b.checkpoint_options if k in kwargs}
    policy = check_policy_fn(b, policy_fn)  # validated even when nothing is recorded
    b.check_checkpoint_options(options, selective=policy is not None)
    if b.compiling():
        if swap_inputs:
            # Swapped inputs need saved-tensor hooks, which a compiled graph cannot host: the
            # region runs eagerly, with a graph break around it.
            return b.run_eagerly(checkpoint, function, *args, policy_fn=policy_fn, swap_inputs=True,
                                 **options, **kwargs)
        # The framework's compiled (selective) checkpoint, driven by the same policy.
        return b.run_compiled_checkpoint(function, args, kwargs, policy, options)
    b.check_ready("checkpoint")
    owner = _owner(b, function)
    if owner is not None and (policy is not None or swap_inputs):
        b.check_region_owner(owner, selective=policy is not None)
    if not b.grad_recording():
        return function(*args, **kwargs)  # nothing is saved: nothing to checkpoint or swap

    storage_factory = _LazyStorage()

    # Whole-region recompute needs no dispatch mode where the framework replays random ops
    # exactly; elsewhere the region keeps them (see SelectiveRegion).
    region = None
    if policy is not None or not b.rng_replayable:
        region = SelectiveRegion(b, policy, storage_factory)
    elif owner is not None and b.has_buffers(owner):
        # Recomputation must not update buffers (BatchNorm's running statistics) a second time.
        region = SelectiveRegion(b, None, storage_factory, whole=True)
    frame = RegionFrame(region, SessionBoxes() if b.recompute_sessions else None)
    watch = watch_arguments(b, function, args, kwargs)  # state the forward changes through an argument

    hooks: Any = contextlib.nullcontext()
    if swap_inputs and not _nested(b):
        # The framework's checkpoint saves the region's inputs through autograd *before* it
        # installs its own saved-tensor hooks, so hooks installed around the call see exactly them.
        hooks = SwapPacker(b, storage_factory(), None, parameter_storages(b, owner)).hooks()
    try:
        with hooks:
            return watch.finish(b.run_checkpoint(function, args, kwargs, lambda: region_contexts(b, frame, region),
                                                 options), frame)
    except Exception as err:
        if region is not None and region.policy_error is not None and region.policy_error is not err:
            raise region.policy_error from None  # an operator (a @ b) replaced it by its own message
        raise


def swap_region(function: Callable[..., Any], policy_fn: Optional[Callable[[Any], Any]],
                *args: Any, **kwargs: Any) -> Any:
    """Run ``function`` so that every tensor autograd saves in it is a swap candidate."""
    b = active_backend()
    if b.compiling():
        # Saved-tensor hooks cannot live in a compiled graph: the region runs eagerly, with a
        # graph break around it.
        return b.run_eagerly(swap_region, function, policy_fn, *args, **kwargs)
    if not b.grad_recording() or _nested(b):
        # Nothing is saved, or a checkpoint region owns what is saved here (its own hooks must see
        # the tensors so that recomputation works): swap does not apply.
        return function(*args, **kwargs)
    b.check_ready("swap_wrapper")
    owner = _owner(b, function)
    if owner is not None:
        b.check_region_owner(owner, selective=False)
    packer = SwapPacker(b, SwapManager().new_storage(), policy_fn, parameter_storages(b, owner))
    with packer.hooks():
        return function(*args, **kwargs)


def create_selective_checkpoint_contexts(policy_fn_or_list: Any, allow_cache_entry_mutation: bool = False
                                         ) -> Tuple[Any, Any]:
    """The ``(forward, recompute)`` dispatch-mode pair implementing a selective policy, for use as
    the ``context_fn`` of the framework's own non-reentrant checkpoint
    (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``,
    ``mindspore.recompute(..., use_reentrant=False)``).

    ``policy_fn_or_list`` is ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (or a
    bool, or a ``torch.utils.checkpoint.CheckpointPolicy``), or a list of ops to save.
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
    b = active_backend()
    policy = check_policy_fn(b, policy_fn_or_list)
    if policy is None:
        raise TypeError("create_selective_checkpoint_contexts needs a policy function or a list of ops, got None.")
    return region_contexts(b, None, SelectiveRegion(b, policy, _LazyStorage(), allow_cache_entry_mutation))
