"""Wrapping in place: ``checkpoint_wrapper``, ``swap_wrapper``, ``checkpoint_exclude_wrapper`` and
``wrap_layers``.

Wrapping a module changes its class in place (as FSDP2's ``fully_shard`` does) to a subclass whose
call method (``forward`` / ``construct``) runs the original one inside a checkpoint or swap region.
Nothing else changes: the module keeps its parameters, buffers, submodules, hooks and attributes,
so ``state_dict()`` keys, parameter names, indexing and attribute access are exactly those of the
original, and checkpoints load either way. A function is wrapped into a new callable.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Tuple

from .backend import Backend, active_backend
from .exclusion import excluded_call
from .region import check_policy_fn, checkpoint, swap_region
from .swap_manager import SwapManager

__all__ = ["checkpoint_wrapper", "swap_wrapper", "checkpoint_exclude_wrapper", "wrap_layers"]

_CHECKPOINT = "checkpoint"
_SWAP = "swap"
_EXCLUDE = "checkpoint_exclude"
_PREFIX = {_CHECKPOINT: "Checkpointed", _SWAP: "Swapped", _EXCLUDE: "Excluded"}


class _Wrapped:
    """Base of every class made by wrapping: pickling (``torch.save(model)``, ``copy.deepcopy``)
    of a module whose class was made at run time records the original class and the wrappers
    applied, and rebuilds the class on load."""

    _hp_kind: str
    _hp_wraps: type

    def __reduce_ex__(self, protocol: Any) -> Any:
        kinds = []
        cls: type = type(self)
        while "_hp_wraps" in cls.__dict__:
            kinds.append(cls.__dict__["_hp_kind"])
            cls = cls.__dict__["_hp_wraps"]
        if not kinds:  # a framework changed the class again on top of ours: default behaviour
            return super().__reduce_ex__(protocol)
        return (_rebuild, (cls, tuple(reversed(kinds)), active_backend().module_method), self.__getstate__())


def _rebuild(original: type, kinds: Tuple[str, ...], method: str) -> Any:
    cls = original
    for kind in kinds:
        cls = _wrapped_class(kind, cls, method)
    return cls.__new__(cls)


_CLASS_CACHE: Dict[Tuple[str, type], type] = {}


def _wrapped_class(kind: str, cls: type, method: str) -> type:
    """The subclass of ``cls`` whose ``method`` runs the original in a region of ``kind``."""
    key = (kind, cls)
    wrapped = _CLASS_CACHE.get(key)
    if wrapped is not None:
        return wrapped

    if kind == _CHECKPOINT:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(getattr(super(wrapped, self), method), *args, policy_fn=self._hp_policy_fn,
                              swap_inputs=self._hp_swap_inputs, **self._hp_checkpoint_options, **kwargs)
    elif kind == _SWAP:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return swap_region(getattr(super(wrapped, self), method), self._hp_swap_policy_fn, *args, **kwargs)
    else:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return excluded_call(getattr(super(wrapped, self), method), args, kwargs, backend=active_backend(),
                                 swap=self._hp_exclude_swap, owner=self, label=type(self).__name__)

    call.__name__ = method
    call.__qualname__ = f"{_PREFIX[kind]}{cls.__name__}.{method}"
    wrapped = type(f"{_PREFIX[kind]}{cls.__name__}", (_Wrapped, cls),
                   {"__module__": cls.__module__, method: call, "_hp_kind": kind, "_hp_wraps": cls})
    _CLASS_CACHE[key] = wrapped
    return wrapped


def _is_wrapped(module: Any, kind: str) -> bool:
    return any(c.__dict__.get("_hp_kind") == kind for c in type(module).__mro__)


def _wrap_module(b: Backend, module: Any, kind: str, attrs: Dict[str, Any]) -> Any:
    if _is_wrapped(module, kind):
        raise ValueError(f"{type(module).__name__} is already wrapped by {kind}_wrapper.")
    module.__class__ = _wrapped_class(kind, type(module), b.module_method)
    for name, value in attrs.items():
        object.__setattr__(module, name, value)  # plain attributes, not parameters or sub-modules
    return module


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
    b = active_backend()
    unknown = set(checkpoint_options) - set(b.checkpoint_options)
    if unknown:
        raise TypeError(f"checkpoint_wrapper: unknown option(s) {sorted(unknown)}; accepted: "
                        f"{list(b.checkpoint_options)}")
    check_policy_fn(b, policy_fn)  # validate now (e.g. an OpOverloadPacket in a list)
    if not isinstance(swap_inputs, bool):
        raise TypeError(f"swap_inputs must be a bool, got {swap_inputs!r}")
    target = module_or_function
    if b.is_module(target):
        if policy_fn is not None or swap_inputs:
            b.check_region_owner(target, selective=policy_fn is not None)
        return _wrap_module(b, target, _CHECKPOINT, {"_hp_policy_fn": policy_fn, "_hp_swap_inputs": swap_inputs,
                                                     "_hp_checkpoint_options": dict(checkpoint_options)})
    if not callable(target):
        raise TypeError(f"checkpoint_wrapper expects an {b.module_type} or a callable, got {target!r}")

    @functools.wraps(target)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(target, *args, policy_fn=policy_fn, swap_inputs=swap_inputs,
                          **checkpoint_options, **kwargs)

    return checkpointed


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
    b = active_backend()
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(f"swap_wrapper policy_fn must be callable policy_fn(tensor), got {policy_fn!r}")
    target = module_or_function
    if b.is_module(target):
        b.check_region_owner(target, selective=False)
        return _wrap_module(b, target, _SWAP, {"_hp_swap_policy_fn": policy_fn})
    if not callable(target):
        raise TypeError(f"swap_wrapper expects an {b.module_type} or a callable, got {target!r}")

    @functools.wraps(target)
    def swapped(*args: Any, **kwargs: Any) -> Any:
        return swap_region(target, policy_fn, *args, **kwargs)

    return swapped


def checkpoint_exclude_wrapper(module_or_function: Any, swap: bool = False) -> Any:
    """Exclude a sub-module (or function) from the recomputation of the checkpoint region it runs
    in: it runs once, in forward, and its outputs are reused, not recomputed, when the region is
    recomputed in backward (keep attention, recompute the MLP, without naming ops in a policy).

    - ``swap=False``: its outputs, and what its ops save for its own backward, stay on the device
      (as without checkpointing: SAVE);
    - ``swap=True``: they are swap candidates of the current swap group (SWAP), moved when the
      group is offloaded and loaded (``set_forward_prefetch_layer``, ``pipeline_swap``).

    The region's selective policy is not asked about the sub-module's ops. Outside a checkpoint
    region the sub-module runs as usual, so the wrapper can stay on a module that is not always
    checkpointed. An excluded module inside another excluded module is simply part of it; one
    inside a checkpoint region nested in an excluded module is excluded from that inner region.
    The sub-module must not modify its inputs in place (recomputation cannot replay the write: a
    clear error says so). A module is wrapped in place (its class changes, as with
    :func:`checkpoint_wrapper`); a function gives back a callable. Regions of the framework's own
    ``checkpoint`` (not this library's) do not see the exclusion: the sub-module is recomputed.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import checkpoint_exclude_wrapper, checkpoint_wrapper
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        >>> _ = checkpoint_exclude_wrapper(block[0])   # kept: never re-run in backward
        >>> _ = checkpoint_wrapper(block)               # the rest is recomputed
        >>> block(torch.randn(4, 8, requires_grad=True)).sum().backward()
    """
    b = active_backend()
    if not isinstance(swap, bool):
        raise TypeError(f"checkpoint_exclude_wrapper: swap must be a bool, got {swap!r}")
    if not b.exclusion_supported:
        raise RuntimeError(f"checkpoint_exclude_wrapper is not supported on the {b.name} backend (PyTorch only); "
                           "keep the sub-module's outputs with a selective policy (MUST_SAVE for its ops) instead.")
    target = module_or_function
    if b.is_module(target):
        return _wrap_module(b, target, _EXCLUDE, {"_hp_exclude_swap": swap})
    if not callable(target):
        raise TypeError(f"checkpoint_exclude_wrapper expects an {b.module_type} or a callable, got {target!r}")
    label = getattr(target, "__name__", "excluded function")

    @functools.wraps(target)
    def excluded(*args: Any, **kwargs: Any) -> Any:
        return excluded_call(target, args, kwargs, backend=active_backend(), swap=swap, label=label)

    return excluded


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
    b = active_backend()
    for layer in items:
        if not b.is_module(layer):
            raise TypeError(f"wrap_layers: every layer must be an {b.module_type}, got {type(layer).__name__}")
    for layer in items:
        if swap:
            swap_wrapper(layer, policy_fn=policy_fn)
        else:
            checkpoint_wrapper(layer, policy_fn=policy_fn, swap_inputs=swap_inputs)
    if chain:
        manager = SwapManager()
        for first, second in zip(items, items[1:]):
            manager.set_forward_prefetch_layer(first, second)
    return layers
