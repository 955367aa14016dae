"""Module and function wrappers that leave the enclosing model's view unchanged.

Wrapping a module changes its class in place (as FSDP2's ``fully_shard`` does) to a subclass whose
``forward`` runs the original one inside a checkpoint or swap region. Nothing else changes: the
module keeps its parameters, buffers, submodules, hooks and attributes, so ``state_dict()`` keys,
``named_parameters()`` names, indexing and attribute access are exactly those of the original,
and checkpoints load either way.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .checkpoint import TORCH_CHECKPOINT_OPTIONS, checkpoint, swap_region

__all__ = ["checkpoint_wrapper", "swap_wrapper", "is_wrapped"]


class _Picklable:
    """Pickling (``torch.save(model)``, ``copy.deepcopy``) of a module whose class was made at run
    time: record the original class and the wrappers applied, and rebuild the class on load."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        kinds = []
        cls: type = type(self)
        while cls in _RECIPES:
            kind, cls = _RECIPES[cls]
            kinds.append(kind)
        if not kinds:  # e.g. FSDP changed the class again on top of ours: default behaviour
            return super().__reduce_ex__(protocol)
        return (_rebuild, (cls, tuple(reversed(kinds))), self.__getstate__())


def _rebuild(original: type, kinds: Tuple[str, ...]) -> Any:
    cls = original
    for kind in kinds:
        cls = _wrap_class(_MIXINS[kind], cls)
    return cls.__new__(cls)


class _CheckpointedModule(_Picklable):
    """Mixin: ``forward`` runs under :func:`checkpoint` with the module's settings."""

    _hp_policy_fn: Any
    _hp_swap_inputs: bool
    _hp_checkpoint_options: Dict[str, Any]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super().forward, *args, policy_fn=self._hp_policy_fn,  # type: ignore[misc]
                          swap_inputs=self._hp_swap_inputs, **self._hp_checkpoint_options, **kwargs)


class _SwappedModule(_Picklable):
    """Mixin: ``forward`` runs in a swap region (every saved tensor is a swap candidate)."""

    _hp_swap_policy_fn: Any

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return swap_region(super().forward, self._hp_swap_policy_fn, *args, **kwargs)  # type: ignore[misc]


_CLASS_CACHE: Dict[Tuple[type, type], type] = {}
_RECIPES: Dict[type, Tuple[str, type]] = {}  # wrapped class -> (kind, class it wraps)
_MIXINS = {"checkpoint": _CheckpointedModule, "swap": _SwappedModule}
_PREFIX = {_CheckpointedModule: "Checkpointed", _SwappedModule: "Swapped"}


def _wrap_class(mixin: type, cls: type) -> type:
    key = (mixin, cls)
    if key not in _CLASS_CACHE:
        wrapped = type(f"{_PREFIX[mixin]}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
        _CLASS_CACHE[key] = wrapped
        _RECIPES[wrapped] = ("checkpoint" if mixin is _CheckpointedModule else "swap", cls)
    return _CLASS_CACHE[key]


def is_wrapped(module: torch.nn.Module, kind: str) -> bool:
    return isinstance(module, _MIXINS[kind])


def _check_options(options: Dict[str, Any]) -> None:
    unknown = set(options) - set(TORCH_CHECKPOINT_OPTIONS)
    if unknown:
        raise TypeError(f"checkpoint_wrapper: unknown option(s) {sorted(unknown)}; accepted: "
                        f"{list(TORCH_CHECKPOINT_OPTIONS)}")


def checkpoint_wrapper(module_or_function: Any, policy_fn: Any = None, swap_inputs: bool = False,
                       **checkpoint_options: Any) -> Any:
    _check_options(checkpoint_options)
    if policy_fn is not None:
        from .sac import as_policy_fn
        as_policy_fn(policy_fn)  # validate now (an OpOverloadPacket in a list is a ValueError)
    if not isinstance(swap_inputs, bool):
        raise TypeError(f"swap_inputs must be a bool, got {swap_inputs!r}")
    target = module_or_function
    if isinstance(target, torch.nn.Module):
        if isinstance(target, _CheckpointedModule):
            raise ValueError(f"{type(target).__name__} is already wrapped by checkpoint_wrapper.")
        target.__class__ = _wrap_class(_CheckpointedModule, type(target))
        target._hp_policy_fn = policy_fn
        target._hp_swap_inputs = swap_inputs
        target._hp_checkpoint_options = dict(checkpoint_options)
        return target
    if not callable(target):
        raise TypeError(f"checkpoint_wrapper expects an nn.Module or a callable, got {target!r}")

    @functools.wraps(target)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(target, *args, policy_fn=policy_fn, swap_inputs=swap_inputs,
                          **checkpoint_options, **kwargs)

    return checkpointed


def swap_wrapper(module_or_function: Any, policy_fn: Optional[Callable[[torch.Tensor], Any]] = None) -> Any:
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(f"swap_wrapper policy_fn must be callable policy_fn(tensor), got {policy_fn!r}")
    target = module_or_function
    if isinstance(target, torch.nn.Module):
        if isinstance(target, _SwappedModule):
            raise ValueError(f"{type(target).__name__} is already wrapped by swap_wrapper.")
        target.__class__ = _wrap_class(_SwappedModule, type(target))
        target._hp_swap_policy_fn = policy_fn
        return target
    if not callable(target):
        raise TypeError(f"swap_wrapper expects an nn.Module or a callable, got {target!r}")

    @functools.wraps(target)
    def swapped(*args: Any, **kwargs: Any) -> Any:
        return swap_region(target, policy_fn, *args, **kwargs)

    return swapped
