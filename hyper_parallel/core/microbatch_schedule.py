"""Per-microbatch swap scheduling for pipeline parallelism (framework-neutral: no torch here).

A pipeline stage runs the forward and the backward of several microbatches in an order that the
pipeline schedule decides (GPipe: all forwards, then all backwards; 1F1B: interleaved). The
activations a microbatch saves only matter again at its backward, so they can live in host memory
in between. :class:`MicrobatchSwapSchedule` drives :class:`SwapManager`'s atomic API with one swap
group per microbatch (``f"{prefix}mb{i}"``) from four events that any schedule produces::

    forward_start(i)   forward_end(i)   backward_start(i)   backward_end(i)

plus the step boundaries ``step_end()`` (normal end) and ``abort()`` (exception path).

The rules, with ``prefetch = p``:

- **Forward.** Regions that run between ``forward_start(i)`` and ``forward_end(i)`` save into group
  ``mb{i}``. Its offload is launched when the next forward starts, so that the copy overlaps that
  forward's compute, and waited when that forward ends (``p == 0``: waited at once, no overlap).
  If the next operation is a backward instead, see below.
- **Backward.** ``backward_start(i)`` decides the fate of the microbatch forwarded just before
  (if its offload is still deferred): kept on the device if it is ``i`` or one of the next ``p``
  microbatches to run backward, offloaded otherwise. It then launches the load of ``mb{i}`` if it
  is not on the device, waits the offloads still in flight of microbatches that are not needed
  soon (freeing them), launches the loads of the next ``p`` forwarded-but-not-backwarded
  microbatches in ascending id (the backward order of GPipe and 1F1B; a load of a group whose
  offload is still in flight just cancels it: no copy) and waits for ``mb{i}``'s own load.
- **Bound.** At most ``p + 1`` microbatches' swapped bytes are on the device at once: in forward,
  the one being computed and (``p >= 1``) the one whose offload overlaps it; in backward, the one
  being computed and ``p`` loaded ahead. Tensors the manager keeps on the device for good (parameters,
  tensors shared with others, ...) are not swapped bytes and are not counted. At the turn from
  forward to backward (GPipe) the offload of the last forwarded microbatch is waited before the
  prefetches start, so it does not overlap compute: the price of the bound.
- **Step end / abort.** Every group of the schedule is dropped and the state is reset, so a
  finished (or aborted) step leaves no group, no pending copy and no current group behind.

The pipeline adapter of a framework (``hyper_parallel.backends.torch.pipeline``) turns a stage's
methods into these calls; the class can equally be driven by hand.

Example (two microbatches, GPipe order)::

    >>> from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper
    >>> from hyper_parallel.core.microbatch_schedule import (
    ...     MicrobatchSwapSchedule)
    >>> import torch
    >>> block = swap_wrapper(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()))
    >>> sched = MicrobatchSwapSchedule(SwapManager(), prefix="doc.", prefetch=1)
    >>> losses = []
    >>> for i in range(2):
    ...     sched.forward_start(i)
    ...     losses.append(block(torch.randn(4, 8)).sum())
    ...     sched.forward_end(i)
    >>> for i in range(2):
    ...     sched.backward_start(i)
    ...     losses[i].backward()
    ...     sched.backward_end(i)
    >>> sched.step_end()
    >>> [n for n in SwapManager().group_names() if n.startswith("doc.")]
    []
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List, Optional

__all__ = ["MicrobatchSwapSchedule", "resident_swap_bytes"]

# Where a microbatch's swapped activations are, as far as this schedule moved them.
_DEVICE = "device"        # produced (or reloaded) and on the device
_OFFLOADING = "offloading"  # offload launched, not waited (source still on the device)
_HOST = "host"            # offload waited: device memory released
_LOADING = "loading"      # load launched, not waited
_DONE = "done"            # backward finished


def resident_swap_bytes(manager: Any, prefix: Optional[str] = None, pattern: Any = None) -> int:
    """Bytes of swap candidates that currently occupy device memory, summed over the manager's
    groups (only those whose name starts with ``prefix`` and, if given, matches the compiled
    regular expression ``pattern``).

    A swap candidate occupies the device while it is produced, while its offload is in flight
    (the source is still held), while its load is in flight and after it is loaded; it does not
    once its offload was waited. Tensors the manager keeps on the device (parameters, tensors
    shared with others, ...) are not swapped bytes and are not counted: neither those an offload
    already kept nor, before any offload, those an offload would keep because somebody else
    holds their storage (the same test ``launch_offload`` makes).
    """
    return sum(manager._group(name).resident_swap_bytes() for name in manager.group_names()
               if (prefix is None or name.startswith(prefix))
               and (pattern is None or pattern.match(name)))


class MicrobatchSwapSchedule:
    """Offload each microbatch's activations after its forward and prefetch them before its
    backward, through ``manager``'s atomic API (see the module docstring for the rules).

    Args:
        manager: the :class:`SwapManager` (or anything with its atomic API).
        prefix: group names are ``f"{prefix}mb{i}"``; use one prefix per pipeline stage held by
            this process (e.g. ``"pp0."``) so that stages do not share groups.
        prefetch: how many microbatches ahead of the one whose backward starts are loaded (and,
            in forward, whether an offload may overlap the next forward: ``0`` waits every
            offload at once). At most ``prefetch + 1`` microbatches' swapped bytes are on the
            device at once.

        measure_bytes: record ``peak_resident_bytes`` (it walks the schedule's swap tensors twice
            per microbatch, so it is off by default; ``peak_resident_microbatches`` is always kept).

    Attributes (reset by ``reset_stats()`` only):
        peak_resident_bytes: the largest :func:`resident_swap_bytes` of this schedule's groups
            seen at the schedule's own peak points (end of a forward, start of a backward); only
            with ``measure_bytes=True``.
        peak_resident_microbatches: the most microbatches whose swapped bytes were on the device
            at once, as this schedule moved them.
        offloads, loads, cancelled: how many offloads and loads it launched, and how many of its
            offloads were cancelled by a load while in flight.
        steps, aborts: finished and aborted steps.
    """

    def __init__(self, manager: Any, prefix: str, prefetch: int = 1, measure_bytes: bool = False) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise TypeError(f"prefix must be a non-empty str, got {prefix!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (microbatches to load ahead), got {prefetch!r}")
        self.manager = manager
        self.prefix = prefix
        self.prefetch = prefetch
        self.measure_bytes = bool(measure_bytes)
        self._name_re = re.compile(re.escape(prefix) + r"mb\d+\Z")
        self.reset_stats()
        self._reset_state()

    # ------------------------------------------------------------------ bookkeeping
    def _reset_state(self) -> None:
        self._state: Dict[int, str] = {}      # microbatch -> where its activations are
        self._order: List[int] = []           # forwarded microbatches, in forward order
        self._deferred: Optional[int] = None  # forwarded, offload not launched yet
        self._active: Optional[int] = None    # forward in progress
        self._saved_group: Optional[str] = None

    def reset_stats(self) -> None:
        self.peak_resident_bytes = 0
        self.peak_resident_microbatches = 0
        self.offloads = 0
        self.loads = 0
        self.cancelled = 0
        self.steps = 0
        self.aborts = 0

    def group_name(self, microbatch: int) -> str:
        """The swap group of ``microbatch``."""
        return f"{self.prefix}mb{microbatch}"

    @property
    def max_resident_microbatches(self) -> int:
        """The bound this schedule keeps: microbatches whose swapped bytes may be on the device
        at once (``prefetch + 1``; with ``prefetch == 0`` an offload never overlaps compute, so
        ``1``)."""
        return self.prefetch + 1

    @property
    def active(self) -> bool:
        """Whether the schedule holds any state of the current step."""
        return bool(self._state) or self._active is not None

    def pending(self) -> List[int]:
        """Microbatches forwarded in this step and not yet backwarded, in ascending id."""
        return sorted(mb for mb, s in self._state.items() if s != _DONE)

    def state(self, microbatch: int) -> Optional[str]:
        """Where ``microbatch``'s activations are: ``device``, ``offloading``, ``host``,
        ``loading`` or ``done`` (``None``: not forwarded in this step)."""
        return self._state.get(microbatch)

    def _exists(self, mb: int) -> bool:
        return self.group_name(mb) in self.manager.group_names()

    def _note_peak(self) -> None:
        resident = sum(1 for s in self._state.values() if s in (_DEVICE, _OFFLOADING, _LOADING))
        self.peak_resident_microbatches = max(self.peak_resident_microbatches, resident)
        if self.measure_bytes:
            nbytes = resident_swap_bytes(self.manager, self.prefix, self._name_re)
            self.peak_resident_bytes = max(self.peak_resident_bytes, nbytes)

    @staticmethod
    def _check_mb(microbatch: Any) -> int:
        if isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 0:
            raise TypeError(f"microbatch ids are ints >= 0, got {microbatch!r}")
        return microbatch

    # ------------------------------------------------------------------ transitions
    def _launch_offload(self, mb: int) -> None:
        if self._state.get(mb) != _DEVICE:
            return
        if not self._exists(mb):  # nothing was saved (no grad, or nothing swappable)
            return
        self.manager.launch_offload(self.group_name(mb))
        self._state[mb] = _OFFLOADING
        self.offloads += 1
        if self.prefetch == 0:
            self._wait_offload(mb)

    def _wait_offload(self, mb: int) -> None:
        self._wait(mb, _OFFLOADING, self.manager.wait_offload, _HOST)

    def _wait(self, mb: int, launched: str, wait: Any, done: str) -> None:
        """Wait what ``mb``'s state says was ``launched``; its state is ``done`` after."""
        if self._state.get(mb) != launched:
            return
        if self._exists(mb):  # (gone only if somebody reset the manager meanwhile)
            wait(self.group_name(mb))
        self._state[mb] = done

    def _launch_load(self, mb: int) -> None:
        state = self._state.get(mb)
        if state not in (_OFFLOADING, _HOST):
            return
        if not self._exists(mb):  # its storages died (graph dropped): nothing to load
            self._state[mb] = _DEVICE
            return
        self.manager.launch_load(self.group_name(mb))
        if state == _OFFLOADING:
            self.cancelled += 1
        self._state[mb] = _LOADING
        self.loads += 1

    def _wait_load(self, mb: int) -> None:
        self._wait(mb, _LOADING, self.manager.wait_load, _DEVICE)

    def _flush_deferred(self) -> None:
        """A forward starts: launch the offload deferred since the previous forward ended."""
        mb, self._deferred = self._deferred, None
        if mb is not None:
            self._launch_offload(mb)

    # ------------------------------------------------------------------ events
    def forward_start(self, microbatch: int) -> None:
        """A forward of ``microbatch`` starts: what its regions save goes to its group."""
        mb = self._check_mb(microbatch)
        if self._active is not None:
            raise RuntimeError(
                f"MicrobatchSwapSchedule({self.prefix!r}): forward_start({mb}) while the forward of "
                f"microbatch {self._active} has not ended; call forward_end({self._active}) first.")
        if mb in self._state:
            raise RuntimeError(
                f"MicrobatchSwapSchedule({self.prefix!r}): microbatch {mb} was already forwarded in "
                "this step; call step_end() (or abort()) between steps.")
        self._flush_deferred()
        self._saved_group = self.manager.get_current_group_name()
        self.manager.set_current_group_name(self.group_name(mb))
        self._active = mb

    def forward_end(self, microbatch: int, failed: bool = False) -> None:
        """The forward of ``microbatch`` ended (``failed``: it raised; the current group is
        restored and nothing is scheduled; call :meth:`abort` next)."""
        mb = self._check_mb(microbatch)
        if self._active != mb:
            raise RuntimeError(
                f"MicrobatchSwapSchedule({self.prefix!r}): forward_end({mb}) without forward_start({mb}) "
                f"(forward in progress: {self._active}).")
        self._active = None
        saved, self._saved_group = self._saved_group, None
        self.manager.set_current_group_name(saved)
        if failed:
            return
        self._state[mb] = _DEVICE
        self._order.append(mb)
        self._note_peak()
        # The offload launched when this forward started has overlapped it: release its memory.
        for other, state in list(self._state.items()):
            if state == _OFFLOADING:
                self._wait_offload(other)
        self._deferred = mb

    def backward_start(self, microbatch: int) -> None:
        """The backward of ``microbatch`` starts: make its activations usable and prefetch the
        next ``prefetch`` microbatches."""
        mb = self._check_mb(microbatch)
        if self._active is not None:
            raise RuntimeError(
                f"MicrobatchSwapSchedule({self.prefix!r}): backward_start({mb}) during the forward of "
                f"microbatch {self._active}.")
        state = self._state.get(mb)
        if state is None or state == _DONE:
            raise RuntimeError(
                f"MicrobatchSwapSchedule({self.prefix!r}): backward_start({mb}) but microbatch {mb} "
                + ("was never forwarded in this step." if state is None else "was already backwarded."))
        ahead = [other for other in self.pending() if other != mb][:self.prefetch]
        deferred, self._deferred = self._deferred, None
        if deferred is not None and deferred != mb and deferred not in ahead:
            self._launch_offload(deferred)
        self._launch_load(mb)
        for other, s in list(self._state.items()):
            if s == _OFFLOADING and other not in ahead and other != mb:
                self._wait_offload(other)
        for other in ahead:
            self._launch_load(other)
        self._wait_load(mb)
        self._note_peak()

    def backward_end(self, microbatch: int, failed: bool = False) -> None:
        """The backward of ``microbatch`` finished (its graph is released by the framework)."""
        mb = self._check_mb(microbatch)
        if failed:
            return
        if self._state.get(mb) is None:
            raise RuntimeError(f"MicrobatchSwapSchedule({self.prefix!r}): backward_end({mb}) without "
                               f"backward_start({mb}).")
        self._state[mb] = _DONE

    # ------------------------------------------------------------------ step boundaries
    def _own_groups(self) -> Iterable[str]:
        return [n for n in self.manager.group_names() if self._name_re.match(n)]

    def _finish(self) -> None:
        if self._active is not None:  # a forward raised before forward_end
            self.manager.set_current_group_name(self._saved_group)
        elif self.manager.get_current_group_name() is not None and \
                self._name_re.match(self.manager.get_current_group_name()):
            self.manager.set_current_group_name(None)
        first_error: Optional[BaseException] = None
        for mb, state in list(self._state.items()):
            try:  # leave no copy in flight: a pending offload/load is waited
                if state == _OFFLOADING:
                    self._wait_offload(mb)
                elif state == _LOADING:
                    self._wait_load(mb)
            except Exception as exc:  # noqa: BLE001  (keep cleaning up; re-raised below)
                first_error = first_error or exc
        for name in self._own_groups():
            # Storages still alive (a graph the user kept from an aborted step) stay where they
            # are and give their host buffers back when they die; the name is free again.
            self.manager.discard_group(name)
        self._reset_state()
        if first_error is not None:
            raise first_error

    def step_end(self) -> None:
        """The step is over: wait what is in flight, drop every group of this schedule (their
        graphs are normally gone already) and reset the per-step state."""
        if self._active is not None:
            raise RuntimeError(
                f"MicrobatchSwapSchedule({self.prefix!r}): step_end() during the forward of microbatch "
                f"{self._active}; use abort() on exception paths.")
        self._finish()
        self.steps += 1

    def abort(self) -> None:
        """Exception path: restore the current group, wait what is in flight, drop every group of
        this schedule and reset the per-step state. Safe to call at any time, and twice."""
        had_state = self.active
        self._finish()
        if had_state:
            self.aborts += 1

    def __repr__(self) -> str:
        return (f"MicrobatchSwapSchedule(prefix={self.prefix!r}, prefetch={self.prefetch}, "
                f"state={dict(sorted(self._state.items()))})")
