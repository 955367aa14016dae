"""Sub-modules excluded from the recomputation of the region they run in (framework-neutral).

``checkpoint_exclude_wrapper(module)`` marks a sub-module whose work must not be redone when the
enclosing checkpoint region is recomputed (keep attention, recompute the MLP, without naming
aten ops). Inside a region's forward, an excluded call:

- runs with its own saved-tensor hooks, innermost, so that what its ops save for backward is
  kept for its own backward (``swap=False``: on the device, as without checkpointing;
  ``swap=True``: as swap candidates of the current swap group, as ``swap_wrapper`` does) and
  the region's checkpoint never sees it;
- suspends the region's selective policy (its ops are neither asked about nor logged);
- records its outputs (SAVE, or SWAP candidates with ``swap=True``), which requires grad, and
  the random-number state after it if it drew random numbers.

When the region is recomputed the call is skipped: the recorded outputs are handed back (as
fresh leaves that require grad where the originals did, so the ops after it save what they saved
in forward) and the random-number state is moved past it. The recorded outputs are released
as soon as a recomputation used them; a second recomputation (a second backward without a
:class:`~hyper_parallel.core.recompute_session.RecomputeSession`) is an error, as for selective
regions.

Outside any region (or while gradients are not recorded) an excluded module runs as usual. An
excluded module inside another excluded module's forward is part of it (nothing more to do);
inside a checkpoint region nested in an excluded module, it is excluded from that inner region.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .backend import Backend
from .packer import SwapPacker, parameter_storages
from .region_state import RegionFrame, region_flags
from .replay_log import ReplayLog
from .saved import Saved
from .storage import Storage
from .swap_manager import SwapManager

__all__ = ["ExcludedCalls", "KeepPacker", "excluded_call"]


class KeepPacker(SwapPacker):
    """Saved-tensor hooks that keep every saved tensor on the device, as autograd would without
    any hooks, but through a no-grad alias (a pack result holding the tensor itself would make a
    reference cycle through the graph) with autograd's in-place check."""

    __slots__ = ()

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend, None)

    def pack(self, t: Any) -> Saved:
        return Saved(self._b.alias(t), self._b.version)


_NOT_IN_FORWARD = ("checkpoint_exclude_wrapper: {label} (excluded call #{index}) ran while recomputing a region "
                   "but not in its forward. The region must make the same calls in forward and recompute.")
_RELEASED = ("checkpoint_exclude_wrapper: backward ran a second time through a region whose excluded sub-module "
             "outputs ({label}) were released by the first backward. Backward through it only once per forward, "
             "or run the halves of a split backward in one RecomputeSession.")


class ExcludedCalls(ReplayLog):
    """The excluded calls of one region's forward, in order: kept outputs (with whether each
    required grad) and the random-number state after the call (``None`` if it drew nothing)."""

    __slots__ = ()

    def record(self, kept: Any, rng_after: Any) -> None:
        self.kept.append((kept, rng_after))

    def take(self, label: str) -> Tuple[Any, Any]:
        """The record of the next excluded call of this recomputation; released here."""
        index = self.next(label, _NOT_IN_FORWARD, _RELEASED)
        record = self.kept[index]
        self.consume(index)
        return record


@contextlib.contextmanager
def _beside_the_region(frame: RegionFrame, excluding: bool) -> Iterator[None]:
    """The region's selective policy stands aside inside (its ops are neither asked about nor
    logged: ``suspended``); ``excluding``: an excluded sub-module's forward is what runs."""
    selective = frame.selective
    frame.excluding += excluding
    if selective is not None:
        selective.suspended += 1
    try:
        yield
    finally:
        frame.excluding -= excluding
        if selective is not None:
            selective.suspended -= 1


def _tensor_versions(b: Backend, tree: Any) -> List[Tuple[Any, int]]:
    return [(t, b.version(t)) for t in b.tree_leaves(tree) if b.is_tensor(t)]


def excluded_call(function: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any], *,
                  backend: Backend, swap: bool, owner: Any = None, label: str = "excluded module") -> Any:
    """Run ``function(*args, **kwargs)`` excluded from the recomputation of the innermost region
    (see the module docstring). ``owner``: the module whose parameters are never swap candidates."""
    b = backend
    frame, recompute = region_flags.innermost()
    if frame is None or frame.excluding or not b.grad_recording():
        return function(*args, **kwargs)
    if recompute:
        return _replay(b, frame, label)
    return _record(b, frame, function, args, kwargs, swap, owner, label)


def _record(b: Backend, frame: RegionFrame, function: Callable[..., Any], args: Tuple[Any, ...],
            kwargs: Dict[str, Any], swap: bool, owner: Any, label: str) -> Any:
    inputs = _tensor_versions(b, (args, kwargs))
    rng_before = b.rng_state(args) if b.rng_replayable else None
    storage: Optional[Storage] = SwapManager().new_storage() if swap else None
    param_ids = parameter_storages(b, owner) if storage is not None else set()
    packer: Any = SwapPacker(b, storage, None, param_ids) if storage is not None else KeepPacker(b)
    with _beside_the_region(frame, excluding=True), packer.hooks():
        out = function(*args, **kwargs)
    for t, version in inputs:
        if b.version(t) != version:
            raise RuntimeError(
                f"checkpoint_exclude_wrapper: {label} modified one of its inputs in place. Recomputation "
                "skips an excluded module, so it cannot replay that write; use the out-of-place form "
                "(e.g. inplace=False) or do not exclude this module.")
    rng_after = None
    if rng_before is not None:
        after = b.rng_state(args)
        if not b.rng_equal(rng_before, after):
            rng_after = after

    def keep(x: Any) -> Any:
        if not b.is_tensor(x):
            return x
        handle = Saved(b.alias(x), b.version) if storage is None else storage.add(b.saved_facts(x, param_ids))
        return _Leaf(handle, b.requires_grad(x))

    if frame.excluded is None:
        frame.excluded = ExcludedCalls()
    frame.excluded.record(b.tree_map(keep, out), rng_after)
    return out


class _Leaf:
    """One kept output tensor: its handle (``Saved`` / ``SwapView``) and whether it required grad."""

    __slots__ = ("handle", "requires_grad")

    def __init__(self, handle: Any, requires_grad: bool) -> None:
        self.handle = handle
        self.requires_grad = requires_grad


def _replay(b: Backend, frame: RegionFrame, label: str) -> Any:
    if frame.excluded is None:
        frame.excluded = ExcludedCalls()
    kept, rng_after = frame.excluded.take(label)

    def give(x: Any) -> Any:
        if isinstance(x, _Leaf):
            return b.recomputed_leaf(b.hand_back(x.handle.get_val()), x.requires_grad)
        return x

    with _beside_the_region(frame, excluding=False):  # rebuilding a reloaded view runs ops: not the region's
        value = b.tree_map(give, kept)
    if rng_after is not None:
        b.set_rng_state(rng_after)
    return value
