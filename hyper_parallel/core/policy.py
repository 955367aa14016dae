"""What a policy function may answer, and the one place that interprets the answer."""

from __future__ import annotations

import enum
from typing import Any, Callable, Hashable, Iterable, Optional

from .backend import OpKind, active_backend

__all__ = ["CheckpointPolicy", "SelectiveCheckpointContext", "Decision", "normalize_policy",
           "normalize_swap_policy", "as_policy_fn", "policy_from_op_list", "collective_decision",
           "keep_collectives"]


class CheckpointPolicy(enum.Enum):
    """Per-op decision of a selective checkpoint policy.

    - ``MUST_SAVE`` / ``PREFER_SAVE``: keep the op's output from forward; the op is not re-run.
    - ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE``: drop the output; re-run the op in backward.
    - ``MUST_SWAP``: keep the output in the :class:`SwapManager`, which offloads it to host memory
      after the layer's forward and prefetches it before the layer's backward; the op is not re-run.
      Without any offload scheduled it behaves exactly like ``MUST_SAVE``.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import CheckpointPolicy
        >>> def policy_fn(ctx, op, *args, **kwargs):
        ...     if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        ...         return CheckpointPolicy.MUST_SWAP
        ...     return CheckpointPolicy.PREFER_RECOMPUTE
    """

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_SWAP = 4

    _decision: "Decision"  # (set below, once Decision exists)

    @property
    def decision(self) -> "Decision":
        """The action this member asks for, without the MUST/PREFER strength."""
        return self._decision


class Decision(enum.Enum):
    """What happens to an op output: the three actions the library implements."""

    SAVE = "save"
    RECOMPUTE = "recompute"
    SWAP = "swap"


_DECISION = {
    CheckpointPolicy.MUST_SAVE: Decision.SAVE,
    CheckpointPolicy.PREFER_SAVE: Decision.SAVE,
    CheckpointPolicy.MUST_RECOMPUTE: Decision.RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE: Decision.RECOMPUTE,
    CheckpointPolicy.MUST_SWAP: Decision.SWAP,
}
# Each member carries its decision: a selective region reads it per op, and an attribute is cheaper
# than a dict lookup keyed by an enum member (whose hash is a Python function).
assert set(_DECISION) == set(CheckpointPolicy), "every CheckpointPolicy member needs its Decision"
for _member, _action in _DECISION.items():
    _member._decision = _action
del _member, _action


class SelectiveCheckpointContext:
    """Passed as ``ctx`` to ``policy_fn(ctx, op, *args, **kwargs)``.

    ``is_recompute`` is ``False`` while the region runs its forward and ``True`` while it is
    being recomputed during backward (PyTorch deprecated this flag; here it stays truthful).
    ``op_output`` holds the op's output in forward (``None`` during recompute, where a saved or
    swapped op is not run).

    Example::

        >>> calls = []
        >>> def policy_fn(ctx, op, *args, **kwargs):
        ...     calls.append(ctx.is_recompute)
        ...     return CheckpointPolicy.PREFER_RECOMPUTE
    """

    __slots__ = ("is_recompute", "op_output")

    def __init__(self, *, is_recompute: bool, op_output: Any = None) -> None:
        self.is_recompute = is_recompute
        self.op_output = op_output

    def __repr__(self) -> str:
        return f"SelectiveCheckpointContext(is_recompute={self.is_recompute})"


def normalize_policy(value: Any, op: Any,
                     convert_foreign: Optional[Callable[[Any], Optional[CheckpointPolicy]]] = None
                     ) -> CheckpointPolicy:
    """Turn what a policy function returned into a :class:`CheckpointPolicy`.

    Accepted: our members; ``bool`` (``True`` = ``MUST_SAVE``, ``False`` = ``PREFER_RECOMPUTE``,
    as in PyTorch); whatever ``convert_foreign`` (supplied by the backend, e.g. for
    ``torch.utils.checkpoint.CheckpointPolicy``) recognises. Anything else is a ``TypeError``
    naming the op and the value.
    """
    if isinstance(value, CheckpointPolicy):
        return value
    if isinstance(value, bool):
        return CheckpointPolicy.MUST_SAVE if value else CheckpointPolicy.PREFER_RECOMPUTE
    if convert_foreign is not None:
        converted = convert_foreign(value)
        if converted is not None:
            return converted
    raise TypeError(
        f"policy_fn returned {value!r} (type {type(value).__name__}) for op {op}; expected a "
        "hyper_parallel CheckpointPolicy member, a bool, or the framework's own checkpoint policy "
        "enum (e.g. torch.utils.checkpoint.CheckpointPolicy)."
    )


def normalize_swap_policy(value: Any, what: str) -> Decision:
    """Interpret the answer of a ``swap_wrapper`` policy: ``MUST_SWAP`` swaps, ``MUST_SAVE`` and
    ``PREFER_SAVE`` keep the tensor on the device; anything else is a ``TypeError``."""
    if value is CheckpointPolicy.MUST_SWAP:
        return Decision.SWAP
    if value in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
        return Decision.SAVE
    raise TypeError(
        f"swap_wrapper policy_fn returned {value!r} for {what}; expected CheckpointPolicy.MUST_SWAP, "
        "CheckpointPolicy.MUST_SAVE or CheckpointPolicy.PREFER_SAVE."
    )


def policy_from_op_list(ops: Iterable[Any], entry_key: Callable[[Any], Hashable],
                        op_key: Callable[[Any], Hashable]) -> Callable[..., CheckpointPolicy]:
    """A list of ops as a policy: MUST_SAVE for those ops, PREFER_RECOMPUTE for the rest.

    ``entry_key`` turns a list entry into the key of the op it names (raising a clear error for a
    bad entry); ``op_key`` gives the key of an op the region runs. The backend supplies both."""
    chosen = frozenset(entry_key(entry) for entry in ops)

    def policy_fn(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op_key(op) in chosen else CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


def as_policy_fn(policy_fn_or_list: Any, entry_key: Callable[[Any], Hashable],
                 op_key: Callable[[Any], Hashable], list_entries: str) -> Callable[..., Any]:
    """A policy function from what the user passed: a callable as is, a list/tuple/set turned
    into one by :func:`policy_from_op_list` (``list_entries`` names what such a list holds, for
    the error message); anything else is a ``TypeError``."""
    if isinstance(policy_fn_or_list, (list, tuple, set, frozenset)):
        return policy_from_op_list(policy_fn_or_list, entry_key, op_key)
    if not callable(policy_fn_or_list):
        raise TypeError("policy_fn must be a callable policy_fn(ctx, op, *args, **kwargs) or a list of "
                        f"{list_entries}, got {policy_fn_or_list!r}.")
    return policy_fn_or_list


def collective_decision(policy: CheckpointPolicy) -> Decision:
    """What happens to the output of an op that communicates (a collective or its wait): only
    ``MUST_RECOMPUTE`` re-runs it; ``PREFER_RECOMPUTE`` keeps it (SAVE); SAVE and SWAP as asked.
    Re-running a collective in backward costs communication, and hangs if ranks recompute
    differently."""
    if policy is CheckpointPolicy.PREFER_RECOMPUTE:
        return Decision.SAVE
    return policy.decision


def keep_collectives(policy_fn: Any = None) -> Callable[..., Any]:
    """A policy that answers like ``policy_fn`` except that ops that communicate (functional
    collectives such as ``_c10d_functional.all_reduce`` and their ``wait_tensor``) are kept
    (answered ``True``, i.e. MUST_SAVE) unless ``policy_fn`` answers ``MUST_RECOMPUTE``.

    ``policy_fn`` is a policy function, a list of ops (see :func:`as_policy_fn`), or ``None``:
    recompute everything else (``False``, i.e. PREFER_RECOMPUTE). Selective regions of this
    library already apply the rule to every policy; the helper is for whole-region recompute
    (``checkpoint_wrapper(layer, policy_fn=keep_collectives())`` recomputes everything but the
    collectives) and for the framework's own selective checkpoint, which accepts the ``bool``
    answers it gives for collectives.

    Example::

        >>> import torch
        >>> from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper, keep_collectives
        >>> layer = checkpoint_wrapper(torch.nn.Linear(8, 8), policy_fn=keep_collectives())
    """
    b = active_backend()
    inner = None if policy_fn is None else as_policy_fn(policy_fn, b.op_list_entry, b.op_key, b.op_list_entries)

    def keep_collectives_policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> Any:
        answer = False if inner is None else inner(ctx, op, *args, **kwargs)
        if b.op_kind(op) not in (OpKind.COLLECTIVE, OpKind.WAIT):
            return answer
        if normalize_policy(answer, op, b.convert_policy) is CheckpointPolicy.PREFER_RECOMPUTE:
            return True
        return answer

    return keep_collectives_policy
