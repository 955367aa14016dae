"""State a recomputed region changes through its arguments (framework-neutral).

A checkpointed region runs its forward twice: once in forward and again, from its saved inputs,
in backward. Whatever the forward changes *outside its tensors* through an argument (a KV cache
object that grows, a list appended to, a counter in an object) is changed a second time by the
recomputation, which then runs on state forward never saw: at best a size mismatch deep in
backward, at worst silently wrong state (a KV cache of twice the length).

:func:`watch_arguments` takes a snapshot of the Python-level state reachable from a region's
non-tensor arguments before its forward; :meth:`ArgumentWatch.finish` compares after the forward
and raises a ``RuntimeError`` that names the argument, what changed, and what to do.

What is compared: the items of lists, dicts and sets (their number and identity), the attributes
of plain objects (their names, and for each the identity of the object it holds, or the value of
a number, string, bool or ``None``), recursively, up to :data:`MAX_DEPTH` levels and
:data:`MAX_ENTRIES` entries per call (beyond that, nothing more is compared). Tensors count by
identity only: a tensor replaced by another (``cache.keys = cat(cache.keys, k)``) is a change,
an in-place write into one is not (autograd's version counters watch tensor data). Tensors,
modules, callables and scalars given directly as arguments hold no such state and cost nothing
(the common layer call ``layer(hidden, mask=..., position_embeddings=(cos, sin))`` is not
snapshotted at all). A ``functools.partial`` given as the region's function or as an argument
contributes the arguments it holds.

A region whose forward ran a sub-module excluded from its recomputation
(``checkpoint_exclude_wrapper``) is not checked: the change may be the excluded sub-module's,
which runs once.

Example::

    >>> from hyper_parallel.core.activation_checkpoint import checkpoint
    >>> import torch
    >>> seen = []
    >>> def region(x, log):
    ...     log.append(x.shape[0])        # changes state outside the region's tensors
    ...     return x.sin()
    >>> try:
    ...     checkpoint(region, torch.ones(2, requires_grad=True), seen)
    ... except RuntimeError as err:
    ...     print(str(err).split(": ")[1])
    the region's forward changed its argument `log` (a list)
"""

from __future__ import annotations

import enum
import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

from .backend import Backend

__all__ = ["ArgumentWatch", "watch_arguments", "MAX_DEPTH", "MAX_ENTRIES"]

#: How deep below an argument the snapshot looks (``cache.layers[0].keys`` is depth 3).
MAX_DEPTH = 4
#: How many entries one region call's snapshot holds at most.
MAX_ENTRIES = 512

_SCALARS = (bool, int, float, complex, str, bytes, enum.Enum)
_CONTAINERS = (list, dict, set, tuple)
_LEAF = "leaf"      # (kind, the object itself): compared by identity (or value for scalars)
_SIZED = "sized"    # (kind, type name, items): a list / dict / set and its size
_OBJECT = "object"  # (kind, type name, attribute names)


def _is_opaque(b: Backend, x: Any) -> bool:
    """Whether ``x``, as an argument, holds no Python-level state the region could change."""
    return (x is None or isinstance(x, _SCALARS) or b.is_tensor(x) or b.is_module(x) or isinstance(x, type)
            or (callable(x) and not isinstance(x, functools.partial)))


def _holds_state(b: Backend, x: Any) -> bool:
    """Whether an argument is worth a snapshot: a container or object that is not opaque (a tuple
    or a ``functools.partial`` only when something inside it is)."""
    if isinstance(x, functools.partial):
        return any(_holds_state(b, a) for a in x.args) or any(_holds_state(b, v) for v in x.keywords.values())
    if _is_opaque(b, x):
        return False
    if isinstance(x, tuple):
        return any(_holds_state(b, item) for item in x)
    return True


class _Snapshot:
    """The state reachable from some roots: ``path -> (root, entry)`` in walk order."""

    __slots__ = ("_b", "entries", "_seen", "_root")

    def __init__(self, b: Backend, roots: List[Tuple[str, Any]]) -> None:
        self._b = b
        self.entries: Dict[str, Tuple[str, Tuple[Any, ...]]] = {}
        self._seen: set = set()
        for path, value in roots:
            self._root = path
            self._walk(value, path, 0)

    def _add(self, path: str, entry: Tuple[Any, ...]) -> bool:
        if len(self.entries) >= MAX_ENTRIES:
            return False
        self.entries[path] = (self._root, entry)
        return True

    def _walk(self, x: Any, path: str, depth: int) -> None:
        b = self._b
        if (x is None or isinstance(x, _SCALARS) or b.is_tensor(x) or b.is_module(x) or isinstance(x, type)
                or depth > MAX_DEPTH):
            self._add(path, (_LEAF, x))
            return
        if isinstance(x, functools.partial):
            self._add(path, (_LEAF, x))
            for i, item in enumerate(x.args):
                self._walk(item, f"{path}.args[{i}]", depth + 1)
            for name, item in x.keywords.items():
                self._walk(item, f"{path}.keywords[{name!r}]", depth + 1)
            return
        if id(x) in self._seen:  # a cycle, or the same object reached twice: its identity is enough
            self._add(path, (_LEAF, x))
            return
        self._seen.add(id(x))
        if isinstance(x, _CONTAINERS):
            if not isinstance(x, tuple) and not self._add(path, (_SIZED, type(x).__name__, len(x), x)):
                return
            if isinstance(x, dict):
                for key, item in list(x.items()):
                    self._walk(item, f"{path}[{key!r}]", depth + 1)
            elif not isinstance(x, set):
                for i, item in enumerate(x):
                    self._walk(item, f"{path}[{i}]", depth + 1)
            return
        state = getattr(x, "__dict__", None)
        if callable(x) or not isinstance(state, dict):
            self._add(path, (_LEAF, x))  # a C object, a function...: its identity only
            return
        if not self._add(path, (_OBJECT, type(x).__name__, tuple(state), x)):
            return
        for name, item in list(state.items()):
            self._walk(item, f"{path}.{name}", depth + 1)


def _same(before: Tuple[Any, ...], after: Tuple[Any, ...]) -> bool:
    if before[0] != after[0]:
        return False
    if before[0] == _LEAF:
        a, b = before[1], after[1]
        # Scalars compare by value (a counter that moved is a change; an equal int is not).
        return a is b or (isinstance(a, _SCALARS) and type(a) is type(b) and a == b)
    return before[1:-1] == after[1:-1] and before[-1] is after[-1]


def _describe(entry: Tuple[Any, ...]) -> str:
    if entry[0] == _LEAF:
        x = entry[1]
        return repr(x) if x is None or isinstance(x, _SCALARS) else f"a {type(x).__name__}"
    if entry[0] == _SIZED:
        return f"a {entry[1]} of {entry[2]} item{'s' if entry[2] != 1 else ''}"
    return f"a {entry[1]} with attributes {list(entry[2])}"


def _change(before: Optional[Tuple[Any, ...]], after: Optional[Tuple[Any, ...]]) -> str:
    """What happened at one path, in words."""
    if before is None:
        return f"appeared ({_describe(after)})" if after is not None else "changed"
    if after is None:
        return f"disappeared (it was {_describe(before)})"
    if before[0] == after[0] == _LEAF and not isinstance(before[1], _SCALARS) and before[1] is not None \
            and type(before[1]) is type(after[1]):
        return f"was replaced by another {type(after[1]).__name__}"
    if before[0] == after[0] != _LEAF and before[-1] is after[-1]:
        return f"was {_describe(before)}, is now {_describe(after)}"
    was, now = _describe(before), _describe(after)
    return f"was {was}, is now {now}" if was != now else f"was replaced by another {now[2:]}"


def _argument_names(function: Callable[..., Any], count: int) -> List[str]:
    """Names for the first ``count`` positional arguments: the function's parameter names where
    it can be inspected, else ``args[i]``."""
    names = [f"args[{i}]" for i in range(count)]
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return names
    for i, param in enumerate(params[:count]):
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            break
        names[i] = param.name
    return names


class ArgumentWatch:
    """A snapshot of the state reachable from a region's arguments, taken before its forward.

    Made by :func:`watch_arguments`; :meth:`finish` is called with the forward's output."""

    __slots__ = ("_b", "_roots", "_before")

    def __init__(self, b: Backend, roots: List[Tuple[str, Any]]) -> None:
        self._b = b
        self._roots = roots
        self._before = _Snapshot(b, roots).entries

    def changed(self) -> Optional[Tuple[str, str, str]]:
        """``(argument, path, what happened)`` of a difference since the snapshot, or ``None``:
        the first value that changed where one was (``cache.layers[0].keys`` replaced), else the
        first container or object that changed shape (``log`` of 0 items, now 1), else the first
        path that appeared."""
        after = _Snapshot(self._b, self._roots).entries
        structural = None
        for path, (root, entry) in self._before.items():
            now = after.get(path)
            if now is not None and _same(entry, now[1]):
                continue
            found = root, path, _change(entry, None if now is None else now[1])
            if now is not None and entry[0] == now[1][0] == _LEAF:
                return found
            structural = structural or found
        if structural is not None:
            return structural
        if len(self._before) < MAX_ENTRIES:
            for path, (root, entry) in after.items():
                if path not in self._before:
                    return root, path, _change(None, entry)
        return None

    def finish(self, output: Any, frame: Any = None) -> Any:
        """``output``, once checked that the forward changed nothing reachable from the
        arguments (not checked when ``frame``, the region's ``RegionFrame``, ran excluded
        sub-modules)."""
        if frame is not None and frame.excluded is not None:
            return output
        change = self.changed()
        if change is None:
            return output
        root, path, what = change
        kind = type(dict(self._roots)[root]).__name__
        where = f"`{path}` {what}" if path != root else f"it {what}"
        raise RuntimeError(
            f"checkpoint: the region's forward changed its argument `{root}` (a {kind}): {where}. A recomputed "
            "region runs its forward again in backward, which would change it a second time (a KV cache "
            "appended to twice, a list appended to twice) and break backward or leave wrong state. Keep state "
            "that the region updates out of recomputed regions: for a KV cache, pass use_cache=False in "
            "training (a Hugging Face model: wrap it with hyper_parallel.integrations.transformers.wrap_model, "
            "which lets the model turn its cache off in checkpointed layers, as its own gradient checkpointing "
            "does); move the update outside the region; or use swap_wrapper (no recompute) for this layer.")


class _NoWatch:
    """Nothing to watch: :meth:`finish` hands the output back."""

    __slots__ = ()

    @staticmethod
    def finish(output: Any, frame: Any = None) -> Any:
        return output


_NO_WATCH = _NoWatch()


def watch_arguments(b: Backend, function: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
                    ) -> Any:
    """A watch over the state reachable from the arguments of ``function(*args, **kwargs)`` (an
    :class:`ArgumentWatch`), or a no-op watch when no argument holds such state (no snapshot, a
    few calls); call ``.finish(output, frame)`` after the forward."""
    holders = [i for i, a in enumerate(args) if _holds_state(b, a)]
    keyed = [k for k, v in kwargs.items() if _holds_state(b, v)]
    inner = isinstance(function, functools.partial)
    if inner:
        inner_holders = [i for i, a in enumerate(function.args) if _holds_state(b, a)]
        inner_keyed = [k for k, v in function.keywords.items() if _holds_state(b, v)]
        inner = bool(inner_holders or inner_keyed)
    if not holders and not keyed and not inner:
        return _NO_WATCH
    roots: List[Tuple[str, Any]] = []
    if holders:
        names = _argument_names(function, len(args))
        roots += [(names[i], args[i]) for i in holders]
    roots += [(k, kwargs[k]) for k in keyed]
    if inner:
        names = _argument_names(function.func, len(function.args))
        roots += [(names[i], function.args[i]) for i in inner_holders]
        roots += [(k, function.keywords[k]) for k in inner_keyed]
    return ArgumentWatch(b, roots)
