"""The declarative API: ``checkpoint``, ``checkpoint_wrapper``, ``swap_wrapper``,
``create_selective_checkpoint_contexts``. Each call is forwarded to the active platform."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

from ...platform import get_platform

__all__ = ["checkpoint", "checkpoint_wrapper", "swap_wrapper", "create_selective_checkpoint_contexts",
           "pipeline_swap", "wrap_layers"]


def checkpoint(function: Callable[..., Any], *args: Any, policy_fn: Any = None,
               swap_inputs: bool = False, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` under (non-reentrant) activation checkpointing.

    - ``policy_fn=None``: whole-region recompute. Only the inputs are kept; backward re-runs the
      region.
    - ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy``: selective. SAVE keeps the op's
      output, RECOMPUTE re-runs the op in backward, MUST_SWAP keeps the output in the current swap
      group of :class:`SwapManager` (offloaded when the group is). A ``bool`` or a
      ``torch.utils.checkpoint.CheckpointPolicy`` answer is accepted too. ``policy_fn`` may also be
      a list of ``OpOverload`` s (MUST_SAVE for those, PREFER_RECOMPUTE for the rest).
      Ops that mutate an argument or draw random numbers always re-run, without asking the policy.
    - ``swap_inputs=True``: the inputs that checkpoint keeps are swap candidates too.

    The keyword arguments ``preserve_rng_state``, ``determinism_check``, ``debug`` and
    ``early_stop`` go to ``torch.utils.checkpoint.checkpoint``; all others go to ``function``.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint
        >>> lin = torch.nn.Linear(16, 16)
        >>> def policy_fn(ctx, op, *args, **kwargs):
        ...     return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.addmm.default \\
        ...         else CheckpointPolicy.PREFER_RECOMPUTE
        >>> y = checkpoint(lambda x: torch.nn.functional.gelu(lin(x)), torch.randn(4, 16),
        ...                policy_fn=policy_fn)
        >>> y.sum().backward()
    """
    return get_platform().checkpoint(function, *args, policy_fn=policy_fn, swap_inputs=swap_inputs,
                                     **kwargs)


def checkpoint_wrapper(module_or_function: Any, policy_fn: Any = None, swap_inputs: bool = False,
                       **checkpoint_options: Any) -> Any:
    """Give a module (or a function) activation checkpointing; see :func:`checkpoint`.

    A module is wrapped in place and returned: its class becomes a subclass whose ``forward`` runs
    under :func:`checkpoint`, so ``state_dict()`` keys, parameter names, attributes and indexing
    stay those of the original (no ``_checkpoint_wrapped_module.`` level). A function gives back a
    callable. ``checkpoint_options`` (``preserve_rng_state``, ``determinism_check``, ``debug``,
    ``early_stop``) go to PyTorch's checkpoint.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        >>> for i, layer in enumerate(layers):
        ...     layers[i] = checkpoint_wrapper(layer)
        >>> sorted(layers.state_dict())
        ['0.bias', '0.weight', '1.bias', '1.weight']
    """
    return get_platform().checkpoint_wrapper(module_or_function, policy_fn=policy_fn,
                                             swap_inputs=swap_inputs, **checkpoint_options)


def swap_wrapper(module_or_function: Any, policy_fn: Optional[Callable[[Any], Any]] = None) -> Any:
    """Swap what autograd saves inside a module (or function): no recompute.

    Every tensor autograd saves in the region is a candidate; ``policy_fn(tensor)`` may return
    ``CheckpointPolicy.MUST_SWAP`` (default) or ``MUST_SAVE`` / ``PREFER_SAVE`` to keep it on the
    device. Parameters, buffers and their views are never swapped. The tensors go to the current
    group of :class:`SwapManager` and move when that group is offloaded and loaded (for example by
    ``set_forward_prefetch_layer``); if nothing offloads them they simply stay on the device.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, swap_wrapper
        >>> big_only = lambda t: (CheckpointPolicy.MUST_SWAP if t.numel() >= 1 << 16
        ...                       else CheckpointPolicy.MUST_SAVE)
        >>> mlp = swap_wrapper(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), big_only)
    """
    return get_platform().swap_wrapper(module_or_function, policy_fn=policy_fn)


def create_selective_checkpoint_contexts(policy_fn_or_list: Union[Callable[..., Any], List[Any]],
                                         allow_cache_entry_mutation: bool = False) -> Tuple[Any, Any]:
    """The ``(forward, recompute)`` context pair implementing a selective policy, for use as the
    ``context_fn`` of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    Example::

        >>> import functools, torch
        >>> from hyper_parallel.core.activation_checkpoint import create_selective_checkpoint_contexts
        >>> ctx_fn = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    """
    return get_platform().create_selective_checkpoint_contexts(
        policy_fn_or_list, allow_cache_entry_mutation=allow_cache_entry_mutation)


def pipeline_swap(schedule: Any, prefetch: int = 1, prefix: str = "pp", measure: bool = False) -> Any:
    """Swap activations per microbatch in a pipeline schedule (``torch.distributed.pipelining``):
    each microbatch's swapped activations are offloaded after its forward and prefetched
    ``prefetch`` microbatches ahead of its backward, one swap group per (stage, microbatch); at
    most ``prefetch + 1`` microbatches' swapped bytes are on a stage's device at once.
    ``measure=True`` records each stage's peak swapped bytes on the device. Returns
    ``schedule``; see ``docs/parallel.md``.

    Example::

        >>> from torch.distributed.pipelining import ScheduleGPipe  # doctest: +SKIP
        >>> schedule = pipeline_swap(ScheduleGPipe(stage, 4, loss_fn=loss_fn), prefetch=1)  # doctest: +SKIP
        >>> schedule.step(x, target=y)  # doctest: +SKIP
    """
    return get_platform().pipeline_swap(schedule, prefetch=prefetch, prefix=prefix, measure=measure)


def wrap_layers(layers: Any, *, policy_fn: Any = None, swap: bool = False, swap_inputs: bool = False,
                chain: bool = True) -> Any:
    """Wrap every layer of a stack and chain consecutive layers for swap, in one call.

    - ``swap=False`` (default): each layer gets ``checkpoint_wrapper(layer, policy_fn, swap_inputs)``
      (no ``policy_fn``: whole-layer recompute);
    - ``swap=True``: each layer gets ``swap_wrapper(layer, policy_fn)`` (``policy_fn(tensor)``, see
      :func:`swap_wrapper`); ``swap_inputs`` does not apply there.
    - ``chain=True``: ``SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])`` for
      every consecutive pair, so each layer's swapped tensors are offloaded while the next layer
      computes and prefetched while the next layer runs its backward.

    ``layers`` is any sequence of modules (``nn.ModuleList``, ``nn.Sequential``, a list): the
    layers are wrapped in place, and ``layers`` is returned. Hugging Face decoders keep theirs in
    ``model.model.layers``, GPT-2 in ``model.transformer.h``, torchtitan in ``model.layers``.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import wrap_layers
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        >>> _ = wrap_layers(layers, swap=True)
        >>> torch.nn.Sequential(*layers)(torch.randn(2, 8)).sum().backward()
    """
    if not isinstance(swap, bool) or not isinstance(chain, bool):
        raise TypeError(f"wrap_layers: swap and chain must be bools, got swap={swap!r}, chain={chain!r}")
    if swap and swap_inputs:
        raise ValueError("wrap_layers: swap_inputs applies to checkpoint_wrapper (swap=False); with "
                         "swap=True every saved tensor, the layer's inputs included, is already a candidate.")
    try:
        items = list(layers)
    except TypeError:
        raise TypeError(f"wrap_layers expects a sequence of layers (nn.ModuleList, nn.Sequential, list), "
                        f"got {type(layers).__name__}") from None
    if not items:
        raise ValueError("wrap_layers: the layer stack is empty.")
    for layer in items:
        if swap:
            swap_wrapper(layer, policy_fn=policy_fn)
        else:
            checkpoint_wrapper(layer, policy_fn=policy_fn, swap_inputs=swap_inputs)
    if chain:
        from .swap_manager import SwapManager
        manager = SwapManager()
        for first, second in zip(items, items[1:]):
            manager.set_forward_prefetch_layer(first, second)
    return layers
