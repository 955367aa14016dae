"""Hugging Face ``transformers`` models: their layers take this library's checkpoint through the
models' own gradient-checkpointing hook, and :func:`wrap_model` wraps a whole model in one call.

Hugging Face's ``GradientCheckpointingLayer`` (the class of every decoder layer of recent
``transformers``: Llama, Qwen3, Qwen3-MoE, GPT-2's block, ...) is a
:class:`~hyper_parallel.core.wrapping.SelfCheckpointing` family (:func:`family_of`), which the
PyTorch backend hands the wrappers when they meet such a layer: no import the user must know
about, and none of ``transformers`` here (classes are recognised by name). ``checkpoint_wrapper(layer)`` (and so ``wrap_layers``) does not give such a
layer a new ``forward``: the layer keeps Hugging Face's, with its ``gradient_checkpointing`` flag
on and this library's checkpoint (the layer's policy, ``swap_inputs``, options) as its
``_gradient_checkpointing_func``. So what Hugging Face does for a checkpointed layer stays
Hugging Face's:

- in training (``model.train()``, gradients recorded) the layer is checkpointed, and its KV
  cache is off: ``use_cache=False``, ``cache=None`` / ``layer_past=None`` for layers that write
  the cache, with Hugging Face's one-time warning ("Caching is incompatible with gradient
  checkpointing ..."), and a cache passed positionally (GPT-2's blocks) is dropped too; a
  recomputation cannot append to the cache a second time. The rule is per layer: the layers
  left unwrapped keep writing the cache as the model's defaults say;
- without gradients (generation) or in ``model.eval()`` the layer runs as is, cache included (as
  with Hugging Face's own gradient checkpointing, nothing is checkpointed or swapped there);
- ``forward`` is what is checkpointed, not ``__call__``: module hooks (FSDP2's) stay outside
  the region.

``swap_wrapper`` layers recompute nothing, so their cache works as usual; they get the same
guard. Hugging Face's own gradient checkpointing and a wrapper of this library do not mix on one
layer: wrapping a layer whose Hugging Face checkpointing is on, or switching it on or off on a
wrapped layer (``model.gradient_checkpointing_enable()``, ``TrainingArguments(
gradient_checkpointing=True)``), is a ``ValueError`` that says which to keep.

:func:`wrap_model` also sets the flag on the model-level modules above the stack (``LlamaModel``,
``GPT2Model``) when it wraps the whole stack for recompute, so that their own cache rules apply
too: no cache is made in training at all.

Example::

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hyper_parallel.integrations.transformers import wrap_model
    >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                      num_attention_heads=4, num_key_value_heads=2)
    >>> model = wrap_model(LlamaForCausalLM(config))      # use_cache stays on, as configured
    >>> type(model.model.layers[0]).__name__
    'CheckpointedLlamaDecoderLayer'
    >>> ids = torch.randint(0, 64, (2, 16))
    >>> model(input_ids=ids, labels=ids).loss.backward()  # whole-layer recompute, no cache in training
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional

from torch import nn
from hyper_parallel.core.wrapping import SelfCheckpointing, wrap_layers
from hyper_parallel.integrations.layer_stack import find_layer_stack

__all__ = ["checkpoint_above", "wrap_model", "family_of"]


def _wrapper_name(kind: str) -> str:
    return f"{kind}_wrapper"  # checkpoint_wrapper, swap_wrapper, checkpoint_exclude_wrapper


def _mixed(layer_class: str, wrapper: str) -> str:
    return (f"this {layer_class} is wrapped by hyper_parallel's {wrapper}; Hugging Face's gradient checkpointing "
            "cannot be switched on or off on it as well (model.gradient_checkpointing_enable() / "
            "activation_checkpointing_enable() / ..._disable(), TrainingArguments(gradient_checkpointing=True)). "
            f"Keep one: leave Hugging Face's off ({wrapper} recomputes and swaps as its policy says; with the "
            "Trainer: gradient_checkpointing=False), or do not wrap the model.")


class _Flag:
    """``gradient_checkpointing`` of a wrapped layer: fixed (on for ``checkpoint_wrapper``, off for
    the other wrappers); assigning it is the mixed-wrapping error."""

    def __init__(self, on: bool, wrapper: str) -> None:
        self.on = on
        self.wrapper = wrapper

    def __get__(self, obj: Any, owner: Optional[type] = None) -> bool:
        return self.on

    def __set__(self, obj: Any, value: Any) -> None:
        raise ValueError(_mixed(type(obj).__name__, self.wrapper))


class _Handed:
    """``_gradient_checkpointing_func`` of a wrapped layer: this library's checkpoint, run in the
    layer's region; assigning it is the mixed-wrapping error."""

    def __init__(self, run: Optional[Callable[..., Any]], wrapper: str) -> None:
        self.run = run
        self.wrapper = wrapper

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        if obj is None:
            return self
        if self.run is None:  # not a checkpointed layer: its flag is off, Hugging Face never calls this
            return functools.partial(_not_checkpointed, self.wrapper)
        return functools.partial(_without_positional_cache, self.run, obj)

    def __set__(self, obj: Any, value: Any) -> None:
        raise ValueError(_mixed(type(obj).__name__, self.wrapper))


def _without_positional_cache(run: Callable[..., Any], layer: Any, function: Callable[..., Any], *args: Any) -> Any:
    """Checkpoint ``function(*args)`` in ``layer``'s region without a KV cache passed positionally.
    Hugging Face drops a cache passed by keyword to a checkpointed layer that writes it; GPT-2's
    model hands its blocks the cache positionally (and only its own model-level flag would make it
    hand them none). Dropping it here keeps the rule per layer: a checkpointed layer never writes
    the cache, whatever the flag of the model above, and the other layers keep theirs."""
    if not getattr(layer, "_can_checkpoint_with_cache", False):
        args = tuple(None if _is_a(type(a), "Cache", "transformers.cache_utils") else a for a in args)
    return run(layer, function, *args)


def _not_checkpointed(wrapper: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(f"a layer wrapped by {wrapper} is not checkpointed; its _gradient_checkpointing_func "
                       "was called although its gradient_checkpointing flag is off.")


def _members(kind: str, run: Callable[..., Any]) -> dict:
    wrapper = _wrapper_name(kind)
    checkpointed = kind == "checkpoint"
    return {"gradient_checkpointing": _Flag(checkpointed, wrapper),
            "_gradient_checkpointing_func": _Handed(run if checkpointed else None, wrapper)}


def _check(module: Any, kind: str) -> None:
    if module.__dict__.get("gradient_checkpointing") is True:
        raise ValueError(
            f"{_wrapper_name(kind)}: this {type(module).__name__} has Hugging Face's gradient checkpointing on "
            "(model.gradient_checkpointing_enable() / activation_checkpointing_enable(), or "
            f"TrainingArguments(gradient_checkpointing=True)). Keep one: call model.activation_checkpointing_disable() "
            f"before wrapping ({_wrapper_name(kind)} then recomputes and swaps as its policy says), or do not wrap.")


def _anchor() -> None:
    """Pickled with a wrapped Hugging Face layer: unpickling imports this module (the backend then
    finds the layer's family again through :func:`family_of`)."""


def _is_a(cls: type, name: str, module: str) -> bool:
    """Whether ``cls`` derives from the class ``module.name``, by name: this module never imports
    ``transformers`` (a program that uses Hugging Face has, one that does not pays nothing)."""
    return any(c.__name__ == name and c.__module__ == module for c in cls.__mro__)


_FAMILY: List[SelfCheckpointing] = []


def family_of(cls: type) -> Optional[SelfCheckpointing]:
    """The family of Hugging Face's ``GradientCheckpointingLayer`` if ``cls`` is one of its layers,
    else ``None`` (what the PyTorch backend answers the wrappers; see the module docstring)."""
    if not _is_a(cls, "GradientCheckpointingLayer", "transformers.modeling_layers"):
        return None
    if not _FAMILY:
        base = next(c for c in cls.__mro__ if c.__name__ == "GradientCheckpointingLayer")
        _FAMILY.append(SelfCheckpointing(base, members=_members, check=_check, anchor=_anchor))
    return _FAMILY[0]


def _checkpointed_by_the_layers(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The ``_gradient_checkpointing_func`` of a model-level module above a wrapped stack: its
    layers checkpoint themselves, so a model that checkpoints its layers from its own loop (older
    ``transformers``) just calls them."""
    return function(*args, **kwargs)


def _modules_above(model: nn.Module, layer: nn.Module) -> List[nn.Module]:
    """The modules on the path from ``model`` down to ``layer`` (``model`` first, ``layer``
    excluded)."""
    for name, module in model.named_modules():
        if module is layer:
            parts = name.split(".") if name else []
            return [model.get_submodule(".".join(parts[:i])) for i in range(len(parts))]
    raise ValueError(f"wrap_model: the layers given are not part of {type(model).__name__} (layer "
                     f"{type(layer).__name__} is not among its modules).")


def wrap_model(model: nn.Module, *, policy_fn: Any = None, swap: bool = False, swap_policy_fn: Any = None,
               swap_inputs: bool = False, chain: bool = True, layers: Any = None) -> nn.Module:
    """Wrap a Hugging Face model's layer stack in one call, and return the model (wrapped in place).

    ``layers`` defaults to the stack :func:`~hyper_parallel.integrations.find_layer_stack` finds
    (``model.model.layers``, ``model.transformer.h``, ...); the other arguments are those of
    :func:`~hyper_parallel.core.activation_checkpoint.wrap_layers`: whole-layer recompute by
    default, a selective ``policy_fn(ctx, op, *args, **kwargs)`` (SAVE / RECOMPUTE / SWAP per op),
    ``swap_inputs=True`` to swap the layers' inputs too, ``swap=True`` (with an optional
    ``swap_policy_fn(tensor)``) for ``swap_wrapper`` instead of recompute, ``chain=True`` to offload
    each layer while the next one computes. For recompute the model-level modules above the stack
    get Hugging Face's ``gradient_checkpointing`` flag as well (see the module's docstring), so the
    model's defaults (``use_cache=True``) train as they do under Hugging Face's own gradient
    checkpointing, and generation (no gradients) uses the cache as usual.

    A model whose Hugging Face gradient checkpointing is on is a ``ValueError`` (keep one).

    Example::

        >>> import torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, SwapManager
        >>> from hyper_parallel.integrations.transformers import wrap_model
        >>> mm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
        >>> def swap_matmuls(ctx, op, *args, **kwargs):
        ...     return CheckpointPolicy.MUST_SWAP if op in mm else CheckpointPolicy.PREFER_RECOMPUTE
        >>> model = wrap_model(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4)),
        ...                    policy_fn=swap_matmuls, swap_inputs=True)
        >>> ids = torch.randint(0, 64, (2, 16))
        >>> model(input_ids=ids, labels=ids).loss.backward()
        >>> SwapManager().stats()["offloaded_bytes"] > 0
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model expects an nn.Module (a transformers model), got {type(model).__name__}")
    if layers is None:
        layers = find_layer_stack(model).layers
    if isinstance(layers, nn.ModuleDict):
        items = list(layers.values())
    elif isinstance(layers, (nn.ModuleList, nn.Sequential, list, tuple)):
        items = list(layers)
    else:
        items = []
    if not items:
        wrap_layers(layers, policy_fn=policy_fn, swap=swap, swap_policy_fn=swap_policy_fn, swap_inputs=swap_inputs,
                    chain=chain)  # its own clear error for what is not a stack, or an empty one
        return model
    above = _modules_above(model, items[0])
    switched_on = [name or type(model).__name__ for name, m in model.named_modules()
                   if m.__dict__.get("gradient_checkpointing") is True]
    if switched_on:
        raise ValueError(
            f"wrap_model: Hugging Face's gradient checkpointing is on in {type(model).__name__} "
            f"({', '.join(switched_on)}; model.gradient_checkpointing_enable() / activation_checkpointing_enable(), or TrainingArguments("
            "gradient_checkpointing=True)). Keep one: call model.activation_checkpointing_disable() before wrap_model "
            "(hyper_parallel then recomputes and swaps as its policy says), or do not wrap the model.")
    wrap_layers(layers, policy_fn=policy_fn, swap=swap, swap_policy_fn=swap_policy_fn, swap_inputs=swap_inputs,
                chain=chain)
    if not swap:
        checkpoint_above(model, items)
    return model


def checkpoint_above(model: nn.Module, layers: Any) -> None:
    """Give the model-level modules above ``layers`` (a stack of ``model`` some of whose layers are
    checkpointed) Hugging Face's ``gradient_checkpointing`` flag, so that the model trains with the
    cache rules of Hugging Face's own gradient checkpointing (what :func:`wrap_model` does for
    recompute; the memory planner does it for a plan that recomputes some layers)."""
    items = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    for module in _modules_above(model, items[0]):
        if hasattr(module, "gradient_checkpointing") and family_of(type(module)) is None:
            module.gradient_checkpointing = True
            module._gradient_checkpointing_func = _checkpointed_by_the_layers
