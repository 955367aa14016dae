"""The only place that touches private MindSpore internals. Each helper says why it is needed.

All of them are used by MindSpore's own ``mindspore.recompute`` / ``saved_tensors_hooks`` code in
2.10, which is where they were found.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import mindspore as ms
from mindspore.graph.api import _pynative_executor

try:  # the Ascend profiler's mstx ranges: optional, absent on CPU-only builds
    from mindspore.profiler import mstx as _mstx
except Exception:  # pragma: no cover - profiler not importable
    _mstx = None

try:  # MindSpore 2.10: a guard that hides ops from every active MsDispatchMode
    from mindspore._c_expression import _DisableMsDispatchMode
except ImportError:  # pragma: no cover - older MindSpore
    _DisableMsDispatchMode = None  # type: ignore[assignment]

__all__ = ["in_backward", "recording_grad", "no_grad", "hidden_from_dispatch", "internal", "disable_pipeline",
           "restore_pipeline", "mstx_range_start", "mstx_range_end", "sync_pynative"]


def in_backward() -> bool:
    """True while an autodiff engine runs a backward on this thread (a Cell forward hook that fires
    then belongs to a recomputation and must not drive the swap schedule). MindSpore's own
    recompute keys its sessions by the same id."""
    return _pynative_executor.get_current_autodiff_engine_id() != -1


def recording_grad() -> bool:
    """True while a forward is being recorded for a backward (inside ``value_and_grad`` /
    ``grad`` / ``vjp``, grad not disabled): only then does autograd save tensors."""
    return bool(_pynative_executor.requires_grad())


def no_grad() -> Any:
    """``mindspore._no_grad()``: ops run here are not recorded by autograd (used to make the
    aliases the swap system keeps, which must not hold the autograd graph)."""
    return ms._no_grad()  # pylint: disable=protected-access


def hidden_from_dispatch() -> Any:
    """Hide the library's own bookkeeping ops (aliases, byte views, copies) from any
    ``MsDispatchMode`` a user has active, so op counts and policies only see the model's ops."""
    if _DisableMsDispatchMode is None:  # pragma: no cover
        return contextlib.nullcontext()
    return _DisableMsDispatchMode()


@contextlib.contextmanager
def internal() -> Iterator[None]:
    """Both: no autograd recording and no dispatch-mode interception."""
    with hidden_from_dispatch(), no_grad():
        yield


def disable_pipeline() -> bool:
    """Turn off PyNative's asynchronous front-end pipeline; returns whether it was already off.

    Why: in MindSpore 2.10 an ``MsDispatchMode`` does not see ops whose inputs were produced by
    earlier ops while that pipeline is on (they take a fast path that never checks the dispatch
    stack). ``saved_tensors_hooks`` turns it off for the same reason, so inside
    ``mindspore.recompute`` it is already off; the dispatch modes here make sure of it anyway.
    """
    return bool(_pynative_executor.disable_frontend_and_bprop_pipeline())


def restore_pipeline(was_disabled: bool) -> None:
    if not was_disabled:
        _pynative_executor.enable_frontend_and_bprop_pipeline()


def mstx_range_start(name: str) -> Any:
    """Open a named range in Ascend profiler (mstx) traces; ``None`` when there is no profiler."""
    return _mstx.range_start(name) if _mstx is not None else None


def mstx_range_end(range_id: Any) -> None:
    if _mstx is not None:
        _mstx.range_end(range_id)


def sync_pynative() -> None:
    """Wait for every kernel PyNative has queued. On a CPU the public
    ``mindspore.runtime.synchronize()`` declines (it logs "CPU device is not supported" and returns);
    the memory planner times steps with this there."""
    _pynative_executor.sync()
