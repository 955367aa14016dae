"""``pipeline_swap`` / ``pipeline_recompute``: per-microbatch activation swap, and one recomputation
per microbatch for split backwards, for ``torch.distributed.pipelining``.

A schedule (``ScheduleGPipe``, ``Schedule1F1B``, ...) runs each stage's forward and backward per
microbatch. ``pipeline_swap(schedule, prefetch=1)`` gives every stage of the schedule held by
this process a :class:`MicrobatchSwapSchedule` (one swap group per (stage, microbatch), named
``f"pp{stage_index}.mb{i}"``) and drives it from the stage's own calls, so users never write the
``SwapManager`` group calls themselves:

=====================================  =======================================================
what the adapter wraps (in place)       what it does
=====================================  =======================================================
``stage.forward_one_chunk(i, ...)``     ``forward_start(i)`` / ``forward_end(i)`` around it
``stage.backward_one_chunk(i, ...)``    ``backward_start(i)`` / ``backward_end(i)`` around it;
                                        with ``full_backward=False`` (the input half of a
                                        zero-bubble split backward) a ``RecomputeSession`` opens
``stage.backward_weight_one_chunk(i)``  the weight half runs in that session's ``last_half()``
``stage.clear_runtime_states()``        open sessions are closed too
``schedule.step(...)``                  clean start; ``step_end()`` after; on an exception
                                        ``abort()`` and the clean-up a retry needs, re-raised
=====================================  =======================================================

``pipeline_recompute(schedule)`` applies the same adapter without a swap schedule: only the
sessions, so that each checkpoint region is recomputed once per microbatch by zero-bubble schedules.

These are public methods of ``torch.distributed.pipelining``; the wrapping is done like the rest of
the library wraps modules: the object's class becomes a subclass whose methods call the original
ones (``super()``), nothing else changes. What the adapter touches beyond public methods is
isolated in ``_shim.pipeline_stages`` (``schedule._stage`` / ``schedule._stages``: the stages a
schedule runs; there is no public accessor) and ``_shim.drop_pipeline_losses``
(``schedule._internal_losses``:
PyTorch appends each microbatch's loss there and only clears it at the end of a successful step,
so after an aborted step a retry would read the aborted step's losses).

Only what a schedule runs with gradients and a backward is scheduled: ``schedule.eval(...)``,
forward-only schedules and the stage's metadata inference (which calls the module directly) run
untouched.

Example::

    >>> from torch.distributed.pipelining import PipelineStage, ScheduleGPipe  # doctest: +SKIP
    >>> stage = PipelineStage(submod, rank, world, device)                      # doctest: +SKIP
    >>> schedule = pipeline_swap(ScheduleGPipe(stage, 4, loss_fn=loss_fn), prefetch=1)  # doctest: +SKIP
    >>> schedule.step(x, target=y)                                              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch

from hyper_parallel.core.microbatch_schedule import MicrobatchSwapSchedule
from hyper_parallel.core.recompute_session import RecomputeSession
from hyper_parallel.core.swap_manager import SwapManager

from ._shim import drop_pipeline_losses as _drop_stale_losses
from ._shim import pipeline_stages as _stages_of

__all__ = ["pipeline_swap", "pipeline_recompute", "abort_pipeline_step"]


# ---------------------------------------------------------------------------------------------
# In-place subclasses of the stage and of the schedule
# ---------------------------------------------------------------------------------------------
# Built by single inheritance from the object's own class: the pipelining classes derive from
# ``abc.ABC`` (``__slots__ = ()``), and CPython refuses a ``__class__`` assignment to a class that
# puts a mixin in front of such a base ("object layout differs").
def _swapping(stage: Any) -> bool:
    # No backward (eval / forward-only schedules) or no grad: nothing is saved for later.
    return bool(getattr(stage, "has_backward", True)) and torch.is_grad_enabled()


def _clean_up_after(error: BaseException, clean_up: Any, *args: Any) -> None:
    """Run ``clean_up(*args)`` on an exception path without hiding ``error`` (which is re-raised
    by the caller): a failure of the clean-up is attached to it as a note."""
    try:
        clean_up(*args)
    except Exception as exc:  # noqa: BLE001
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"hyper_parallel pipeline_swap: clean-up after this error failed too: {exc!r}")


def _split_backward(stage: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether ``backward_one_chunk(i, loss, full_backward, ...)`` is the input half of a split
    backward whose weight half ``backward_weight_one_chunk(i)`` runs later through the same graph
    (zero-bubble schedules). A ``dw_builder`` stage runs a full backward then its own weight
    function instead: nothing of ours is split."""
    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
    return not full and getattr(stage, "dw_builder", None) is None and _swapping(stage)


def _close_sessions(stage: Any) -> None:
    sessions = getattr(stage, "_hp_sessions", None)
    if sessions:
        for session in sessions.values():
            session.close()
        sessions.clear()


def _make_stage_class(cls: type) -> type:
    class SwapStage(cls):  # type: ignore[valid-type, misc]
        """A pipeline stage whose microbatch forwards/backwards drive its swap schedule (if any),
        and whose split backwards share one recomputation per microbatch."""

        _hp_pipeline = True
        _hp_swap: Optional[MicrobatchSwapSchedule]
        _hp_sessions: Dict[int, RecomputeSession]

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            sched = self._hp_swap
            if sched is None or not _swapping(self):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            sched.forward_start(fwd_chunk_id)
            try:
                output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            except BaseException as error:
                sched.forward_end(fwd_chunk_id, failed=True)
                _clean_up_after(error, sched.abort)
                raise
            sched.forward_end(fwd_chunk_id)
            return output

        def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            session: Any = contextlib.nullcontext()
            if _split_backward(self, args, kwargs):
                # The weight half (backward_weight_one_chunk) closes it; an abort closes it too.
                old = self._hp_sessions.pop(bwd_chunk_id, None)
                if old is not None:
                    old.close()
                session = self._hp_sessions[bwd_chunk_id] = RecomputeSession(
                    f"stage{self.stage_index}.mb{bwd_chunk_id}")
            sched = self._hp_swap
            if sched is None or not _swapping(self) or sched.state(bwd_chunk_id) is None:
                # No swap schedule, or nothing of this microbatch was scheduled (e.g. forwarded
                # without the adapter).
                try:
                    with session:
                        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
                except BaseException:
                    self._hp_drop_session(bwd_chunk_id)
                    raise
            sched.backward_start(bwd_chunk_id)
            try:
                with session:
                    result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            except BaseException as error:
                self._hp_drop_session(bwd_chunk_id)
                _clean_up_after(error, sched.abort)
                raise
            # The weight half of a split backward still reads the microbatch's swapped tensors:
            # a finished microbatch's group stays on the device until the step ends.
            sched.backward_end(bwd_chunk_id)
            return result

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            session = self._hp_sessions.pop(bwd_chunk_id, None)
            if session is None:
                return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
            with session.last_half():  # values released as backward takes them; closed at the end
                return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

        def clear_runtime_states(self) -> None:
            _close_sessions(self)
            super().clear_runtime_states()

        def _hp_drop_session(self, bwd_chunk_id: int) -> None:
            session = self._hp_sessions.pop(bwd_chunk_id, None)
            if session is not None:
                session.close()

    return SwapStage


def _make_schedule_class(cls: type) -> type:
    class SwapSchedule(cls):  # type: ignore[valid-type, misc]
        """A pipeline schedule adapted by ``pipeline_swap`` / ``pipeline_recompute``: step
        boundaries and the exception path."""

        _hp_pipeline = True
        hp_swap_schedules: Dict[int, MicrobatchSwapSchedule]

        def step(self, *args: Any, **kwargs: Any) -> Any:
            scheds = list(self.hp_swap_schedules.values())
            for sched in scheds:  # leftovers of a step that raised outside the stage calls
                if sched.active:
                    sched.abort()
            for stage in _stages_of(self):
                _close_sessions(stage)
            try:
                result = super().step(*args, **kwargs)
            except BaseException as error:
                _clean_up_after(error, abort_pipeline_step, self)
                raise
            for sched in scheds:
                sched.step_end()
            for stage in _stages_of(self):  # a weight half that never ran (not a zero-bubble order)
                _close_sessions(stage)
            return result

    return SwapSchedule


_CLASS_CACHE: Dict[Any, type] = {}


def _subclass(factory: Any, cls: type) -> type:
    key = (factory, cls)
    if key not in _CLASS_CACHE:
        new = factory(cls)
        new.__name__ = new.__qualname__ = f"Swap{cls.__name__}"
        new.__module__ = cls.__module__
        new._hp_original_class = cls
        _CLASS_CACHE[key] = new
    return _CLASS_CACHE[key]


def _is_adapted(obj: Any) -> bool:
    return bool(getattr(type(obj), "_hp_pipeline", False))


def abort_pipeline_step(schedule: Any) -> None:
    """Clean up after a step of ``schedule`` raised: every stage's swap groups are dropped, the
    recompute sessions of split backwards still open are closed, the stages' runtime state (cached
    microbatch graphs) and the schedule's per-microbatch losses are cleared, so the next ``step()``
    (a retry or the next batch) starts clean. The ``step`` of a ``pipeline_swap`` /
    ``pipeline_recompute`` schedule calls it itself when it raises (whatever raised: a stage, the
    loss function, a timed-out transfer); it is public for code that drives the stages without
    ``step`` and works on any schedule."""
    first_error: Optional[BaseException] = None
    for sched in getattr(schedule, "hp_swap_schedules", {}).values():
        try:
            sched.abort()
        except Exception as exc:  # noqa: BLE001  (clean up the rest, re-raise below)
            first_error = first_error or exc
    for stage in _stages_of(schedule):
        _close_sessions(stage)
        stage.clear_runtime_states()
    _drop_stale_losses(schedule)
    if first_error is not None:
        raise first_error


def _adapt(schedule: Any, scheds: Dict[int, MicrobatchSwapSchedule]) -> Any:
    stages = _stages_of(schedule)
    for stage in stages:
        stage.__class__ = _subclass(_make_stage_class, type(stage))
        stage._hp_swap = scheds.get(stage.stage_index)
        stage._hp_sessions = {}
    schedule.__class__ = _subclass(_make_schedule_class, type(schedule))
    schedule.hp_swap_schedules = dict(scheds)
    return schedule


def _check_not_adapted(schedule: Any, what: str) -> List[Any]:
    if _is_adapted(schedule):
        raise ValueError(f"{type(schedule).__name__} already has pipeline_swap or pipeline_recompute applied "
                         f"(pipeline_swap includes what pipeline_recompute does); {what} cannot be added.")
    stages = _stages_of(schedule)
    for stage in stages:
        if _is_adapted(stage):
            raise ValueError(f"pipeline stage {stage.stage_index} already has pipeline_swap or pipeline_recompute "
                             "applied (through another schedule).")
    return stages


def pipeline_recompute(schedule: Any) -> Any:
    """Make the split backward of zero-bubble schedules recompute every checkpoint region once per
    microbatch. Returns ``schedule``.

    ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` (and any schedule that calls
    ``stage.backward_one_chunk(i, full_backward=False)`` then ``stage.backward_weight_one_chunk(i)``)
    run a stage's backward in two halves through the same graph; without the adapter each
    checkpoint region is recomputed again for the weight half (once per parameter group), and a
    selective region cannot be recomputed twice at all. The adapter opens one
    :class:`~hyper_parallel.core.recompute_session.RecomputeSession` per (stage, microbatch) at the
    input half and closes it at the end of the weight half: between the halves the stage holds the
    recomputed activations of that microbatch, freed as the weight half consumes them. Schedules
    with a full backward are unaffected. :func:`pipeline_swap` includes this; use
    ``pipeline_recompute`` when nothing is swapped.
    """
    _check_not_adapted(schedule, "pipeline_recompute")
    return _adapt(schedule, {})


def pipeline_swap(schedule: Any, prefetch: int = 1, prefix: str = "pp", measure: bool = False) -> Any:
    """Offload each microbatch's activations after its forward and prefetch them before its
    backward, on every stage ``schedule`` runs on this process. Returns ``schedule``.

    Wrap the stage's module for swap first (``checkpoint_wrapper`` with ``MUST_SWAP`` ops or
    ``swap_inputs=True``, ``swap_wrapper``); ``pipeline_swap`` only decides *when* the swapped
    activations move: one swap group per (stage, microbatch), named ``f"{prefix}{stage_index}.mb{i}"``.
    ``prefetch``: how many microbatches ahead of the one whose backward starts are loaded; at most
    ``prefetch + 1`` microbatches' swapped bytes are on a stage's device at once (``0``: one, and no
    copy overlaps compute). Do not also chain the stage's layers with
    ``set_forward_prefetch_layer``: their per-layer groups would take the activations.

    After every ``schedule.step(...)`` the groups of the step are gone. If a step raises, the
    swap state, the stages' cached microbatches and the schedule's losses are cleaned up before
    the exception propagates, so the step can be retried (all ranks must abandon the step at a
    point where no point-to-point transfer is in flight; :func:`abort_pipeline_step` does the same
    clean-up for a rank that abandons the step without an exception).

    The per-stage :class:`MicrobatchSwapSchedule` objects (with their peak statistics) are in
    ``schedule.hp_swap_schedules`` (``stage_index -> schedule``).
    ``measure=True`` also records the peak swapped bytes on each stage's device
    (``peak_resident_bytes``; it costs a walk over the step's swap tensors per microbatch).
    """
    if not isinstance(prefix, str) or not prefix:
        raise TypeError(f"prefix must be a non-empty str, got {prefix!r}")
    stages = _check_not_adapted(schedule, "pipeline_swap")
    manager = SwapManager()
    # Validate everything before changing any class.
    scheds = {stage.stage_index: MicrobatchSwapSchedule(manager, f"{prefix}{stage.stage_index}.", prefetch,
                                                        measure_bytes=measure)
              for stage in stages}
    return _adapt(schedule, scheds)
