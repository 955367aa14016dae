"""What the planner can do to one layer, and the policy functions it generates to do it.

A :class:`LayerOption` is one way of wrapping a layer through the public API:

- ``none``: the layer is left as it is (everything autograd saves stays on the device);
- ``swap``: ``swap_wrapper(layer, policy_fn=SwapAtLeast(n))``: every saved tensor of at least
  ``n`` bytes is swapped, smaller ones stay;
- ``recompute``: ``checkpoint_wrapper(layer, policy_fn=OpTablePolicy(...), swap_inputs=...)``:
  the ops named in ``keep`` keep their outputs (SAVE) or swap them (SWAP), every other op is
  recomputed; without ``keep`` the layer is recomputed whole (no policy, no dispatch mode).

Ops are named by :class:`OpKey`: the op's name and the shapes of its tensor arguments, so that
the three projections of an attention block that share a shape share one decision, and an op call
the profile never saw (another sequence length, an expert that was not routed to) is recognised
as unseen: it gets the plan's declared default (recompute) and is counted
(:attr:`OpTablePolicy.unseen`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from hyper_parallel.core.policy import CheckpointPolicy

__all__ = ["OpKey", "LayerOption", "OpTablePolicy", "SwapAtLeast", "NONE", "RECOMPUTE"]

Shapes = Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True, order=True)
class OpKey:
    """An op call as a plan names it: ``label`` (e.g. ``"aten.addmm.default"``) and the shapes
    of its tensor arguments, in order."""

    label: str
    shapes: Shapes = ()

    def to_json(self) -> List[Any]:
        return [self.label, [list(s) for s in self.shapes]]

    @staticmethod
    def from_json(value: Sequence[Any]) -> "OpKey":
        label, shapes = value
        return OpKey(str(label), tuple(tuple(int(d) for d in s) for s in shapes))

    def __str__(self) -> str:
        args = ", ".join("x".join(map(str, s)) or "scalar" for s in self.shapes)
        return f"{self.label}({args})"


_KINDS = ("none", "swap", "recompute")
_ACTIONS = ("save", "swap")
#: kinds that plans written earlier use, and what they are now
_LEGACY_KINDS = {"checkpoint": "recompute"}


@dataclass(frozen=True)
class LayerOption:
    """One way to wrap a layer (see the module docstring). Hashable: the planner keys its
    measurements by it."""

    kind: str
    #: swap: the smallest saved tensor (bytes) that is swapped
    swap_min_bytes: int = 0
    #: recompute: ``(op, "save" | "swap")`` for the ops whose outputs are kept; the rest recompute
    keep: Tuple[Tuple[OpKey, str], ...] = ()
    #: recompute: the region's saved inputs are swapped too
    swap_inputs: bool = False
    #: a short name for reports (not part of the option's identity)
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"LayerOption.kind must be one of {_KINDS}, got {self.kind!r}")
        if any(action not in _ACTIONS for _, action in self.keep):
            raise ValueError(f"LayerOption.keep actions must be one of {_ACTIONS}")
        if self.kind != "recompute" and (self.keep or self.swap_inputs):
            raise ValueError("LayerOption: keep and swap_inputs apply to kind='recompute' only")

    @property
    def swaps(self) -> bool:
        """Whether the option moves anything to the host (the layers then need the layer chain)."""
        return self.kind == "swap" or self.swap_inputs or any(a == "swap" for _, a in self.keep)

    @property
    def whole_recompute(self) -> bool:
        return self.kind == "recompute" and not self.keep

    def name(self) -> str:
        return self.label or self.describe()

    def describe(self) -> str:
        """What the option does, in words (for reports)."""
        if self.kind == "none":
            return "keep everything (no wrapper)"
        if self.kind == "swap":
            return "swap every saved tensor" + (f" of >= {self.swap_min_bytes} bytes" if self.swap_min_bytes else "")
        saved = sum(1 for _, a in self.keep if a == "save")
        swapped = len(self.keep) - saved
        parts = ["recompute" + (" the rest" if self.keep else " the whole layer")]
        if saved:
            parts.insert(0, f"save {saved} op kind{'s' if saved > 1 else ''}")
        if swapped:
            parts.insert(0, f"swap {swapped} op kind{'s' if swapped > 1 else ''}")
        if self.swap_inputs:
            parts.append("swap the inputs")
        return ", ".join(parts)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"kind": self.kind}
        if self.kind == "swap":
            out["swap_min_bytes"] = self.swap_min_bytes
        if self.kind == "recompute":
            out["keep"] = [[key.to_json(), action] for key, action in self.keep]
            out["swap_inputs"] = self.swap_inputs
        if self.label:
            out["label"] = self.label
        return out

    @staticmethod
    def from_json(value: Dict[str, Any]) -> "LayerOption":
        keep = tuple((OpKey.from_json(k), str(a)) for k, a in value.get("keep", ()))
        kind = str(value["kind"])
        return LayerOption(_LEGACY_KINDS.get(kind, kind), int(value.get("swap_min_bytes", 0)), keep,
                           bool(value.get("swap_inputs", False)), str(value.get("label", "")))


NONE = LayerOption("none", label="none")
RECOMPUTE = LayerOption("recompute", label="recompute")

_POLICY = {"save": CheckpointPolicy.MUST_SAVE, "swap": CheckpointPolicy.MUST_SWAP}


class OpTablePolicy:
    """``policy_fn(ctx, op, *args, **kwargs)`` of a planned checkpoint region: the decision of
    every op the profile saw, by :class:`OpKey`; ``default`` for the others.

    ``key_of(op, args)`` gives an op call's :class:`OpKey` (the framework's part: the planner's
    prober supplies it). ``unseen`` counts the forward op calls that were not in the table, and
    ``unseen_keys`` names them (up to 16), for the report.

    Example::

        >>> from hyper_parallel.planner.options import OpKey, OpTablePolicy
        >>> key_of = lambda op, args: OpKey(op, ())
        >>> policy = OpTablePolicy({OpKey("mm", ()): CheckpointPolicy.MUST_SAVE}, key_of)
        >>> class Ctx: is_recompute = False
        >>> policy(Ctx(), "mm"), policy(Ctx(), "gelu"), policy.unseen
        (<CheckpointPolicy.MUST_SAVE: 0>, <CheckpointPolicy.PREFER_RECOMPUTE: 3>, 1)
    """

    def __init__(self, table: Dict[OpKey, CheckpointPolicy], key_of: Callable[[Any, Tuple[Any, ...]], OpKey],
                 default: CheckpointPolicy = CheckpointPolicy.PREFER_RECOMPUTE) -> None:
        self.table = dict(table)
        self.default = default
        self._key_of = key_of
        self.unseen = 0
        self.unseen_keys: List[OpKey] = []

    @staticmethod
    def for_option(option: LayerOption, seen: Iterable[OpKey],
                   key_of: Callable[[Any, Tuple[Any, ...]], OpKey]) -> "OpTablePolicy":
        """The policy of a ``recompute`` option: its kept ops as asked, every other op the
        profile saw (``seen``) recomputed; ops it did not see get the default (recompute)."""
        table = {key: CheckpointPolicy.PREFER_RECOMPUTE for key in seen}
        table.update((key, _POLICY[action]) for key, action in option.keep)
        return OpTablePolicy(table, key_of)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = self._key_of(op, args)
        decision = self.table.get(key)
        if decision is None:
            if not ctx.is_recompute:
                self.unseen += 1
                if len(self.unseen_keys) < 16 and key not in self.unseen_keys:
                    self.unseen_keys.append(key)
            return self.default
        return decision

    def __repr__(self) -> str:
        kept = sum(1 for d in self.table.values() if d is not CheckpointPolicy.PREFER_RECOMPUTE)
        return f"OpTablePolicy({kept} kept of {len(self.table)} ops, default={self.default.name})"


class SwapAtLeast:
    """``policy_fn(tensor)`` of a planned ``swap_wrapper``: swap a saved tensor whose storage holds
    at least ``min_bytes`` bytes, keep smaller ones on the device (moving them costs more than it
    frees). ``nbytes(tensor)`` is the framework's storage size (the prober supplies it).

    Example::

        >>> policy = SwapAtLeast(1024, nbytes=len)
        >>> policy(b"x" * 4096), policy(b"x")
        (<CheckpointPolicy.MUST_SWAP: 4>, <CheckpointPolicy.MUST_SAVE: 0>)
    """

    def __init__(self, min_bytes: int, nbytes: Callable[[Any], int]) -> None:
        self.min_bytes = int(min_bytes)
        self._nbytes = nbytes

    def __call__(self, tensor: Any) -> CheckpointPolicy:
        if self._nbytes(tensor) >= self.min_bytes:
            return CheckpointPolicy.MUST_SWAP
        return CheckpointPolicy.MUST_SAVE

    def __repr__(self) -> str:
        return f"SwapAtLeast({self.min_bytes})"


def option_policy(option: LayerOption, seen: Iterable[OpKey], key_of: Callable[[Any, Tuple[Any, ...]], OpKey],
                  nbytes: Callable[[Any], int]) -> Optional[Callable[..., Any]]:
    """The policy function ``option`` wraps its layer with (``None``: no policy)."""
    if option.kind == "swap":
        return SwapAtLeast(option.swap_min_bytes, nbytes) if option.swap_min_bytes > 0 else None
    if option.kind == "recompute" and option.keep:
        return OpTablePolicy.for_option(option, seen, key_of)
    return None
