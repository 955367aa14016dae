"""Cell and function wrappers that leave the enclosing model's view unchanged.

Wrapping a Cell changes its class in place to a subclass whose ``construct`` runs the original
one inside a checkpoint or swap region. Nothing else changes: the Cell keeps its parameters,
sub-cells, hooks and attributes, so parameter names, ``parameters_dict()`` keys, indexing and
attribute access are exactly those of the original, and checkpoints load either way.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Tuple

from mindspore import nn

from .checkpoint import MS_CHECKPOINT_OPTIONS, checkpoint, swap_region

__all__ = ["checkpoint_wrapper", "swap_wrapper", "is_wrapped"]


class _CheckpointedCell:
    """Mixin: ``construct`` runs under :func:`checkpoint` with the Cell's settings."""

    _hp_policy_fn: Any
    _hp_swap_inputs: bool
    _hp_checkpoint_options: Dict[str, Any]

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super().construct, *args, policy_fn=self._hp_policy_fn,  # type: ignore[misc]
                          swap_inputs=self._hp_swap_inputs, **self._hp_checkpoint_options, **kwargs)


class _SwappedCell:
    """Mixin: ``construct`` runs in a swap region (every saved tensor is a swap candidate)."""

    _hp_swap_policy_fn: Any

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        return swap_region(super().construct, self._hp_swap_policy_fn, *args, **kwargs)  # type: ignore[misc]


_CLASS_CACHE: Dict[Tuple[type, type], type] = {}
_PREFIX = {_CheckpointedCell: "Checkpointed", _SwappedCell: "Swapped"}


def _wrap_class(mixin: type, cls: type) -> type:
    key = (mixin, cls)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(f"{_PREFIX[mixin]}{cls.__name__}", (mixin, cls),
                                 {"__module__": cls.__module__, "_hp_original_class": cls})
    return _CLASS_CACHE[key]


def is_wrapped(cell: nn.Cell, kind: str) -> bool:
    mixin = {"checkpoint": _CheckpointedCell, "swap": _SwappedCell}[kind]
    return isinstance(cell, mixin)


def _check_options(options: Dict[str, Any]) -> None:
    unknown = set(options) - set(MS_CHECKPOINT_OPTIONS)
    if unknown:
        raise TypeError(f"checkpoint_wrapper: unknown option(s) {sorted(unknown)}; accepted: "
                        f"{list(MS_CHECKPOINT_OPTIONS)}")


def checkpoint_wrapper(cell_or_function: Any, policy_fn: Any = None, swap_inputs: bool = False,
                       **checkpoint_options: Any) -> Any:
    _check_options(checkpoint_options)
    if policy_fn is not None:
        from .sac import as_policy_fn
        as_policy_fn(policy_fn)  # validate now (a bad list entry is an error at wrap time)
    if not isinstance(swap_inputs, bool):
        raise TypeError(f"swap_inputs must be a bool, got {swap_inputs!r}")
    target = cell_or_function
    if isinstance(target, nn.Cell):
        if isinstance(target, _CheckpointedCell):
            raise ValueError(f"{type(target).__name__} is already wrapped by checkpoint_wrapper.")
        target.__class__ = _wrap_class(_CheckpointedCell, type(target))
        object.__setattr__(target, "_hp_policy_fn", policy_fn)
        object.__setattr__(target, "_hp_swap_inputs", swap_inputs)
        object.__setattr__(target, "_hp_checkpoint_options", dict(checkpoint_options))
        return target
    if not callable(target):
        raise TypeError(f"checkpoint_wrapper expects an nn.Cell or a callable, got {target!r}")

    @functools.wraps(target)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(target, *args, policy_fn=policy_fn, swap_inputs=swap_inputs,
                          **checkpoint_options, **kwargs)

    return checkpointed


def swap_wrapper(cell_or_function: Any, policy_fn: Optional[Callable[[Any], Any]] = None) -> Any:
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(f"swap_wrapper policy_fn must be callable policy_fn(tensor), got {policy_fn!r}")
    target = cell_or_function
    if isinstance(target, nn.Cell):
        if isinstance(target, _SwappedCell):
            raise ValueError(f"{type(target).__name__} is already wrapped by swap_wrapper.")
        target.__class__ = _wrap_class(_SwappedCell, type(target))
        object.__setattr__(target, "_hp_swap_policy_fn", policy_fn)
        return target
    if not callable(target):
        raise TypeError(f"swap_wrapper expects an nn.Cell or a callable, got {target!r}")

    @functools.wraps(target)
    def swapped(*args: Any, **kwargs: Any) -> Any:
        return swap_region(target, policy_fn, *args, **kwargs)

    return swapped
