"""Wrapping in place: ``checkpoint_wrapper``, ``swap_wrapper``, ``checkpoint_exclude_wrapper`` and
``wrap_layers``.

Wrapping a module changes its class in place (as FSDP2's ``fully_shard`` does) to a subclass whose
call method (``forward`` / ``construct``) runs the original one inside a checkpoint or swap region.
Nothing else changes: the module keeps its parameters, buffers, submodules, hooks and attributes,
so ``state_dict()`` keys, parameter names, indexing and attribute access are exactly those of the
original, and checkpoints load either way. A function is wrapped into a new callable.

A module takes one wrapper: wrapping it again, with the same or another wrapper, is a
``ValueError`` that says which one to keep. Modules of a family that decides itself when to
checkpoint its forward (Hugging Face's ``GradientCheckpointingLayer``, whose
:class:`SelfCheckpointing` the backend answers, ``Backend.self_checkpointing_family``) are not given a
new call method by ``checkpoint_wrapper``: they are handed this library's checkpoint as the
function they call, so their own rules (no KV cache in a checkpointed layer in training) apply.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

from .backend import Backend, active_backend
from .exclusion import excluded_call
from .region import check_policy_fn, checkpoint, swap_region
from .swap_manager import SwapManager

__all__ = ["checkpoint_wrapper", "swap_wrapper", "checkpoint_exclude_wrapper", "wrap_layers", "SelfCheckpointing",
           "register_self_checkpointing", "wrapper_of"]

_CHECKPOINT = "checkpoint"
_SWAP = "swap"
_EXCLUDE = "checkpoint_exclude"
_PREFIX = {_CHECKPOINT: "Checkpointed", _SWAP: "Swapped", _EXCLUDE: "Excluded"}


_NAMES = {_CHECKPOINT: "checkpoint_wrapper", _SWAP: "swap_wrapper", _EXCLUDE: "checkpoint_exclude_wrapper"}


class SelfCheckpointing:
    """A family of modules (every subclass of ``base``) that decide themselves when to checkpoint
    their forward and call a checkpoint function they are handed (Hugging Face's
    ``GradientCheckpointingLayer`` with its ``gradient_checkpointing`` flag and
    ``_gradient_checkpointing_func``). Registered with :func:`register_self_checkpointing`
    by the integration that knows the family; the engine knows none.

    - ``members(kind, run)``: the class attributes a wrapped class of this family gets for a
      wrapper ``kind`` (``"checkpoint"``, ``"swap"``, ``"checkpoint_exclude"``). ``run(module,
      function, *args, **kwargs)`` runs ``function(*args, **kwargs)`` in ``module``'s checkpoint
      region (its policy, ``swap_inputs`` and options). For ``"checkpoint"`` the wrapped class
      keeps the family's call method, so ``members`` must make the module call ``run`` where it
      checkpoints; for the other kinds the wrapper's call method is installed as usual.
    - ``check(module, kind)``: raise a clear error if ``module`` cannot take the wrapper now (for
      example: the family's own checkpointing is already switched on).
    - ``anchor``: a picklable object of the registering module (a module-level function), pickled
      with a wrapped module so that unpickling imports that module, which registers the family,
      before the wrapped class is rebuilt.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.wrapping import SelfCheckpointing
        >>> class Block(torch.nn.Linear):
        ...     checkpoints = False
        >>> family = SelfCheckpointing(Block, members=lambda kind, run: {}, check=lambda module, kind: None,
        ...                            anchor=None)
        >>> family.base.__name__
        'Block'
    """

    __slots__ = ("base", "members", "check", "anchor")

    def __init__(self, base: type, *, members: Callable[[str, Callable[..., Any]], Dict[str, Any]],
                 check: Callable[[Any, str], None], anchor: Any) -> None:
        if not isinstance(base, type):
            raise TypeError(f"SelfCheckpointing: base must be a class, got {base!r}")
        self.base = base
        self.members = members
        self.check = check
        self.anchor = anchor


_FAMILIES: List[SelfCheckpointing] = []


def register_self_checkpointing(family: SelfCheckpointing) -> None:
    """Make :func:`checkpoint_wrapper` (and the other wrappers) treat every subclass of
    ``family.base`` as ``family`` says. Registering a family for the same base again replaces it.
    Classes already made by wrapping keep what they were made with."""
    if not isinstance(family, SelfCheckpointing):
        raise TypeError(f"register_self_checkpointing expects a SelfCheckpointing, got {type(family).__name__}")
    _FAMILIES[:] = [f for f in _FAMILIES if f.base is not family.base] + [family]


def _family_of(cls: type) -> Optional[SelfCheckpointing]:
    """The family ``cls`` belongs to: one registered here, else one the framework's model
    libraries define (Hugging Face's layers, found by the backend where they are met)."""
    for family in _FAMILIES:
        if issubclass(cls, family.base):
            return family
    return active_backend().self_checkpointing_family(cls)


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
        family = _family_of(cls)
        return (_rebuild, (cls, tuple(reversed(kinds)), active_backend().module_method,
                           None if family is None else family.anchor), self.__getstate__())


def _rebuild(original: type, kinds: Tuple[str, ...], method: str, anchor: Any = None) -> Any:
    """The module object of a pickled wrapped module (``anchor``, already unpickled, imported the
    module that registers the class's :class:`SelfCheckpointing` family)."""
    cls = original
    for kind in kinds:
        cls = _wrapped_class(kind, cls, method)
    return cls.__new__(cls)


_CLASS_CACHE: Dict[Tuple[str, type, Optional[SelfCheckpointing]], type] = {}


def _run_in_region(module: Any, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function`` in the checkpoint region of a wrapped module of a
    :class:`SelfCheckpointing` family (the function such a module is handed)."""
    call = functools.partial(function)  # a fresh partial (a partial given is flattened into it) ...
    call.__self__ = module  # ... that names the region's owner: its parameters and buffers are the module's
    return checkpoint(call, *args, policy_fn=module._hp_policy_fn, swap_inputs=module._hp_swap_inputs,
                      **module._hp_checkpoint_options, **kwargs)


def _wrapped_class(kind: str, cls: type, method: str) -> type:
    """The subclass of ``cls`` whose ``method`` runs the original in a region of ``kind``."""
    family = _family_of(cls)
    key = (kind, cls, family)
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
    namespace: Dict[str, Any] = {"__module__": cls.__module__, "_hp_kind": kind, "_hp_wraps": cls}
    if family is None or kind != _CHECKPOINT:
        namespace[method] = call
    if family is not None:
        namespace.update(family.members(kind, _run_in_region))
    wrapped = type(f"{_PREFIX[kind]}{cls.__name__}", (_Wrapped, cls), namespace)
    _CLASS_CACHE[key] = wrapped
    return wrapped


def wrapper_of(module: Any) -> Optional[str]:
    """The name of the wrapper ``module`` is wrapped by (``"checkpoint_wrapper"``,
    ``"swap_wrapper"``, ``"checkpoint_exclude_wrapper"``), or ``None``.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import swap_wrapper
        >>> from hyper_parallel.core.wrapping import wrapper_of
        >>> wrapper_of(swap_wrapper(torch.nn.Linear(2, 2))), wrapper_of(torch.nn.Linear(2, 2))
        ('swap_wrapper', None)
    """
    for cls in type(module).__mro__:
        kind = cls.__dict__.get("_hp_kind")
        if kind is not None:
            return _NAMES[kind]
    return None


def _original_class(module: Any) -> type:
    cls: type = type(module)
    while "_hp_wraps" in cls.__dict__:
        cls = cls.__dict__["_hp_wraps"]
    return cls


def _refuse_second_wrapper(module: Any, kind: str) -> None:
    """A clear ``ValueError`` if ``module`` already has a wrapper (or cannot take ``kind`` now)."""
    family = _family_of(type(module))
    present = wrapper_of(module)
    if present is None:
        if family is not None:
            family.check(module, kind)
        return
    wanted = _NAMES[kind]
    name = _original_class(module).__name__
    if present == wanted:
        raise ValueError(f"{wanted}: this {name} is already wrapped by {present}: wrap each module once (to change "
                         f"its policy, wrap a fresh {name}, e.g. rebuild the model).")
    if _EXCLUDE in (kind, _KIND_OF[present]):
        raise ValueError(
            f"{wanted}: this {name} is already wrapped by {present}. checkpoint_exclude_wrapper marks a sub-module "
            "inside a checkpointed layer; it cannot share a module with checkpoint_wrapper or swap_wrapper: keep "
            "checkpoint_exclude_wrapper on the sub-module and put checkpoint_wrapper on the layer that contains it, "
            "or keep the other wrapper alone.")
    raise ValueError(
        f"{wanted}: this {name} is already wrapped by {present}; a module takes one wrapper. Keep checkpoint_wrapper "
        "(recompute; it swaps too with a policy answering CheckpointPolicy.MUST_SWAP or with swap_inputs=True) or "
        "swap_wrapper (no recompute: every tensor autograd saves is swapped), not both.")


_KIND_OF = {name: kind for kind, name in _NAMES.items()}


def _wrap_module(b: Backend, module: Any, kind: str, attrs: Dict[str, Any]) -> Any:
    _refuse_second_wrapper(module, kind)
    module.__class__ = _wrapped_class(kind, type(module), b.module_method)
    for name, value in attrs.items():
        object.__setattr__(module, name, value)  # plain attributes, not parameters or sub-modules
    return module


def _positional_shape(fn: Any) -> Optional[Tuple[int, int, bool, bool, List[str]]]:
    """``(positional parameters, required positional, *args, **kwargs, required keyword-only)``
    of a callable, or ``None`` where its signature cannot be read (a builtin)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    var_args = any(p.kind is p.VAR_POSITIONAL for p in params)
    var_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    return len(positional), len(required), var_args, var_kwargs, keyword_only


def _label(fn: Any) -> str:
    try:
        return f"{getattr(fn, '__qualname__', type(fn).__name__)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def check_op_policy_signature(policy_fn: Any, where: str) -> None:
    """A ``TypeError`` now, at wrap time, if a callable ``policy_fn`` cannot be called as a
    selective policy is, ``policy_fn(ctx, op, *args, **kwargs)`` for every op (``where`` names
    the caller for the message). Lists of ops and callables whose signature cannot be read pass."""
    if policy_fn is None or not callable(policy_fn) or isinstance(policy_fn, (list, tuple, set, frozenset)):
        return
    shape = _positional_shape(policy_fn)
    if shape is None:
        return
    positional, required, var_args, var_kwargs, keyword_only = shape
    if required <= 2 and var_args and var_kwargs and not keyword_only:
        return
    if positional == 1 and not var_args:
        hint = ("it takes one argument: that is the form of a swap_wrapper policy, policy_fn(tensor); give it to "
                "swap_wrapper, or to wrap_layers(..., swap=True, swap_policy_fn=...)")
    else:
        hint = "write it as def policy_fn(ctx, op, *args, **kwargs)"
    raise TypeError(f"{where}: policy_fn is called as policy_fn(ctx, op, *args, **kwargs) for every op of the region, "
                    f"and {_label(policy_fn)} cannot take that; {hint}.")


def check_tensor_policy_signature(policy_fn: Any, where: str) -> None:
    """A ``TypeError`` now, at wrap time, if a callable ``policy_fn`` cannot be called as a swap
    policy is, ``policy_fn(tensor)`` for every saved tensor."""
    if policy_fn is None or not callable(policy_fn):
        return
    shape = _positional_shape(policy_fn)
    if shape is None:
        return
    positional, required, var_args, _, keyword_only = shape
    if (positional >= 1 or var_args) and required <= 1 and not keyword_only:
        return
    if required >= 2:
        hint = ("it takes (ctx, op, ...): that is a selective checkpoint policy; give it to checkpoint_wrapper, or "
                "to wrap_layers(..., policy_fn=...) without swap=True")
    else:
        hint = "write it as def policy_fn(tensor)"
    raise TypeError(f"{where}: policy_fn is called as policy_fn(tensor) for every tensor autograd saves, and "
                    f"{_label(policy_fn)} cannot take that; {hint}.")


def checkpoint_wrapper(module_or_function: Any, policy_fn: Any = None, swap_inputs: bool = False,
                       **checkpoint_options: Any) -> Any:
    """Give a module (or a function) activation checkpointing; see :func:`checkpoint`.

    A module is wrapped in place and returned: its class becomes a subclass whose ``forward`` runs
    under :func:`checkpoint`, so ``state_dict()`` keys, parameter names, attributes and indexing
    stay those of the original (no ``_checkpoint_wrapped_module.`` level). A function gives back a
    callable. ``checkpoint_options`` (``preserve_rng_state``, ``determinism_check``, ``debug``,
    ``early_stop``) go to PyTorch's checkpoint; ``use_reentrant=False`` is accepted and
    ``use_reentrant=True`` is a ``ValueError``, as for :func:`checkpoint`. A callable ``policy_fn``
    must take ``(ctx, op, *args, **kwargs)`` (checked now: a ``swap_wrapper`` policy,
    ``policy_fn(tensor)``, is a ``TypeError`` that says so). A module already wrapped (by this or
    another wrapper) is a ``ValueError`` that says which wrapper to keep.

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
    if checkpoint_options.pop("use_reentrant", None):
        raise ValueError("checkpoint_wrapper: hyper_parallel checkpoint is always non-reentrant (use_reentrant=False); "
                         "reentrant checkpoint cannot host selective policies or swap. Drop use_reentrant=True.")
    unknown = set(checkpoint_options) - set(b.checkpoint_options)
    if unknown:
        raise TypeError(f"checkpoint_wrapper: unknown option(s) {sorted(unknown)}; accepted: "
                        f"{list(b.checkpoint_options) + ['use_reentrant (False only)']}")
    check_policy_fn(b, policy_fn)  # validate now (e.g. an OpOverloadPacket in a list)
    check_op_policy_signature(policy_fn, "checkpoint_wrapper")
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
    device (a selective policy, ``policy_fn(ctx, op, ...)``, is a ``TypeError`` now, at wrap
    time). Parameters, buffers and their views are never swapped. The tensors go to the current
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
    check_tensor_policy_signature(policy_fn, "swap_wrapper")
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


def _stack_items(b: Backend, layers: Any) -> List[Any]:
    """The layers of a stack, in order: the values of an ``nn.ModuleDict``-like module, the items
    of a sequence; a clear ``TypeError`` for what is not a layer stack."""
    kind = type(layers).__name__
    if isinstance(layers, dict):
        raise TypeError(f"wrap_layers: got a plain {kind}; give the layer stack the model owns (an nn.ModuleList, "
                        "nn.ModuleDict or nn.Sequential) or a list of its layers in order: nn.ModuleDict(d), or "
                        "list(d.values()).")
    if isinstance(layers, (set, frozenset)):
        raise TypeError(f"wrap_layers: got a {kind}, which has no order; the layer chain needs the layers in "
                        "execution order: give the model's nn.ModuleList / nn.ModuleDict, or a list.")
    if b.is_module(layers) and callable(getattr(layers, "values", None)) and callable(getattr(layers, "keys", None)):
        return list(layers.values())  # nn.ModuleDict (torchtitan's layer stack): its modules, in order
    try:
        iterator = iter(layers)
    except TypeError:
        raise TypeError(f"wrap_layers expects a layer stack (nn.ModuleList, nn.ModuleDict, nn.Sequential, a list), "
                        f"got {kind}") from None
    if iterator is layers:
        raise TypeError(f"wrap_layers: got a {kind} (a one-shot iterator): wrapping would use it up and the stack "
                        "returned would be empty; give the nn.ModuleList / nn.ModuleDict itself, or list(...) of "
                        "the layers.")
    return list(iterator)


def wrap_layers(layers: Any, *, policy_fn: Any = None, swap: bool = False, swap_policy_fn: Any = None,
                swap_inputs: bool = False, chain: bool = True) -> Any:
    """Wrap every layer of a stack and chain consecutive layers for swap, in one call.

    - ``swap=False`` (default): each layer gets ``checkpoint_wrapper(layer, policy_fn, swap_inputs)``
      (no ``policy_fn``: whole-layer recompute; ``policy_fn(ctx, op, *args, **kwargs)``: selective);
    - ``swap=True``: each layer gets ``swap_wrapper(layer, swap_policy_fn)`` (a tensor policy,
      ``swap_policy_fn(tensor)``, see :func:`swap_wrapper`; the old spelling
      ``policy_fn=<tensor policy>`` with ``swap=True`` still works); ``swap_inputs`` does not
      apply there.
    - ``chain=True``: ``SwapManager().set_forward_prefetch_layer(layers[i], layers[i + 1])`` for
      every consecutive pair, so each layer's swapped tensors are offloaded while the next layer
      computes and prefetched while the next layer runs its backward.

    ``layers`` is the model's layer stack: an ``nn.ModuleList`` or ``nn.Sequential`` (its layers),
    an ``nn.ModuleDict`` (its values, in order: torchtitan's ``model.layers``), or a list or
    tuple of modules; a plain dict, a set or a generator is a ``TypeError`` that says what to pass.
    The layers are wrapped in place, and ``layers`` is returned. Hugging Face decoders keep theirs
    in ``model.model.layers``, GPT-2 in ``model.transformer.h``, torchtitan in ``model.layers``
    (``hyper_parallel.integrations.find_layer_stack`` finds it; for a Hugging Face model
    ``hyper_parallel.integrations.transformers.wrap_model`` does all of it). Everything is checked
    before the first layer is wrapped: a policy of the wrong kind for ``swap`` and a layer that is
    already wrapped are errors that leave the stack untouched.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, wrap_layers
        >>> layers = torch.nn.ModuleDict({f"{i}": torch.nn.Linear(8, 8) for i in range(3)})
        >>> big = lambda t: CheckpointPolicy.MUST_SWAP if t.numel() >= 16 else CheckpointPolicy.MUST_SAVE
        >>> _ = wrap_layers(layers, swap=True, swap_policy_fn=big)
        >>> torch.nn.Sequential(*layers.values())(torch.randn(2, 8)).sum().backward()
    """
    if not isinstance(swap, bool) or not isinstance(chain, bool):
        raise TypeError(f"wrap_layers: swap and chain must be bools, got swap={swap!r}, chain={chain!r}")
    if swap and swap_inputs:
        raise ValueError("wrap_layers: swap_inputs applies to checkpoint_wrapper (swap=False); with "
                         "swap=True every saved tensor, the layer's inputs included, is already a candidate.")
    if swap_policy_fn is not None and not swap:
        raise ValueError("wrap_layers: swap_policy_fn is the tensor policy of swap=True (swap_wrapper); pass "
                         "swap=True with it, or give a selective policy (ctx, op, *args, **kwargs) as policy_fn "
                         "for checkpoint_wrapper.")
    if swap and policy_fn is not None and swap_policy_fn is not None:
        raise ValueError("wrap_layers: with swap=True give the tensor policy once, as swap_policy_fn "
                         "(policy_fn is its old spelling).")
    b = active_backend()
    items = _stack_items(b, layers)
    if not items:
        raise ValueError("wrap_layers: the layer stack is empty.")
    for layer in items:
        if not b.is_module(layer):
            raise TypeError(f"wrap_layers: every layer must be an {b.module_type}, got {type(layer).__name__}")
    tensor_policy = swap_policy_fn if swap_policy_fn is not None else policy_fn
    if swap:
        if tensor_policy is not None and not callable(tensor_policy):
            raise TypeError(f"wrap_layers: swap_policy_fn must be callable swap_policy_fn(tensor), got "
                            f"{tensor_policy!r}")
        check_tensor_policy_signature(tensor_policy, "wrap_layers(swap=True)")
    else:
        check_policy_fn(b, policy_fn)
        check_op_policy_signature(policy_fn, "wrap_layers")
    kind = _SWAP if swap else _CHECKPOINT
    for layer in items:  # before wrapping any: a refused layer leaves the whole stack as it was
        _refuse_second_wrapper(layer, kind)
    for layer in items:
        if swap:
            swap_wrapper(layer, policy_fn=tensor_policy)
        else:
            checkpoint_wrapper(layer, policy_fn=policy_fn, swap_inputs=swap_inputs)
    if chain:
        manager = SwapManager()
        for first, second in zip(items, items[1:]):
            manager.set_forward_prefetch_layer(first, second)
    return layers
