"""What a selective checkpoint region decided and kept, op call by op call (framework-neutral).

Forward records, for every op call the policy was asked about, the decision and what was kept
(the op output for SAVE, swap handles for SWAP, nothing for RECOMPUTE). Recomputation replays the
region from its first op and finds each call's record by ``(op key, n-th call of that op)``. The
backends' dispatch modes call :meth:`SelectiveRegion.forward_op` and
:meth:`SelectiveRegion.recompute_op` for every op; everything else happens here, once.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Callable, DefaultDict, Dict, Hashable, List, Optional, Set, Tuple

from .backend import Backend, OpKind
from .policy import (CheckpointPolicy, Decision, SelectiveCheckpointContext, collective_decision,
                     normalize_policy)
from .replay_log import ReplayLog
from .saved import Saved
from .storage import Storage
from .swap_tensor import SwapView

__all__ = ["OpLog", "RECOMPUTE", "SelectiveRegion"]


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


RECOMPUTE = _Marker("RECOMPUTE")  # nothing kept: the op runs again

_NOT_IN_FORWARD = (
    "selective checkpoint: op {label} (call #{index}) ran during recomputation but not in forward. The region "
    "must run the same ops in forward and recompute; check for control flow that depends on global state or "
    "on tensor values that changed.")
_RELEASED = (
    "selective checkpoint: backward ran a second time through a region whose saved/swapped op outputs were "
    "released by the first backward. Backward through a selectively checkpointed region only once per forward "
    "(retain_graph=True cannot reuse them); a backward split in halves (zero-bubble pipeline schedules: "
    "stage_backward_input then stage_backward_weight) must run its halves in one RecomputeSession "
    "(pipeline_swap and pipeline_recompute do that for torch.distributed.pipelining schedules).")


class _Calls(ReplayLog):
    """The forward calls of one op key, in order: kept value (``kept``) and decision."""

    __slots__ = ("decisions",)

    def __init__(self) -> None:
        super().__init__()
        self.decisions: List[Decision] = []


class OpLog:
    """Per op key, the forward calls in order: decision and kept value. (One dict lookup per op
    call: an op key's hash can be a Python function, e.g. PyTorch's ``OpOverload``.)"""

    def __init__(self) -> None:
        self._calls: Dict[Hashable, _Calls] = {}
        self._unasked: Set[Tuple[Hashable, int]] = set()  # replayed without asking the policy

    # ------------------------------------------------------------------ forward
    def record(self, key: Hashable, decision: Decision, kept: Any, asked: bool = True) -> int:
        """Record one forward call; ``kept`` is ignored for RECOMPUTE. ``asked=False``: the
        engine decided without the policy (recompute will not ask it either)."""
        calls = self._calls.get(key)
        if calls is None:
            calls = self._calls[key] = _Calls()
        index = len(calls.kept)
        calls.decisions.append(decision)
        calls.kept.append(RECOMPUTE if decision is Decision.RECOMPUTE else kept)
        if not asked:
            self._unasked.add((key, index))
        return index

    def recompute_instead(self, key: Hashable, index: int) -> None:
        """What was kept for this call is no longer valid (overwritten in place later in the
        forward): recompute the op instead, without holding the policy to its forward answer."""
        self._calls[key].kept[index] = RECOMPUTE
        self._unasked.add((key, index))

    # ------------------------------------------------------------------ recompute
    def start_replay(self) -> None:
        """Each recomputation replays the region from its first op."""
        for calls in self._calls.values():
            calls.replayed = 0

    def next_call(self, key: Hashable, op_label: Any) -> Tuple[int, Any, bool, Any]:
        """The record of the next call of ``key`` in this replay: ``(index, kept, ask_policy,
        calls)``; ``calls`` goes back to :meth:`check` and :meth:`consume`."""
        calls = self._calls.get(key)
        if calls is None:  # (never ran in forward: counted all the same, for the error below)
            calls = self._calls[key] = _Calls()
        index = calls.next(op_label, _NOT_IN_FORWARD, _RELEASED)
        ask = not self._unasked or (key, index) not in self._unasked
        return index, calls.kept[index], ask, calls

    @staticmethod
    def check(calls: Any, index: int, decision: Decision, op_label: Any) -> None:
        """The policy's answer during recomputation must be the one it gave in forward."""
        forward = calls.decisions[index]
        if decision is not forward:
            raise RuntimeError(
                f"selective checkpoint: policy_fn chose {forward.value.upper()} for op {op_label} in "
                f"forward but {decision.value.upper()} while recomputing it; the policy must make the "
                "same choice in both (ctx.is_recompute tells them apart for logging, not for deciding).")

    @staticmethod
    def consume(calls: Any, index: int) -> None:
        """Backward has the kept value: release it (device memory goes as soon as it can)."""
        calls.consume(index)


class SelectiveRegion:
    """One selective checkpoint call: asks the policy per op in forward, keeps what it says to
    keep, and hands the kept values back when the region is recomputed.

    ``policy_fn=None`` is whole-region recompute (used where random ops must be kept because the
    framework cannot replay the RNG: every other op re-runs, no policy is asked).
    ``storage_factory`` gives the swap ``Storage`` that MUST_SWAP outputs go to (created on first
    use, so a region that swaps nothing registers nothing).

    Rules that hold whatever the policy says:

    - ops the checkpoint itself issues (``OpKind.MACHINERY``) and ops that write to an argument
      (``OpKind.MUTATING``) always run again: replaying an output cannot replay a write. A kept
      output that a later op of the forward overwrites in place is recomputed instead (the write
      is replayed in the same order);
    - ops that draw random numbers (``OpKind.RANDOM``) follow the policy where the framework
      replays the RNG in recompute; when such an op is kept and drew numbers in forward,
      recompute leaves the generator exactly where the forward left it after the op, so later
      random ops draw the same numbers. Where the RNG cannot be replayed they are always kept.
    - ops that communicate (``OpKind.COLLECTIVE``) and their waits (``OpKind.WAIT``) are kept
      unless the policy answers ``MUST_RECOMPUTE``: ``PREFER_RECOMPUTE`` (and ``False``) keep
      them (SAVE), SAVE / SWAP answers are honoured. A wait for a collective that does re-run
      re-runs with it, whatever the policy says (an issued collective is always waited).
    - while a sub-module excluded from recomputation runs (``checkpoint_exclude_wrapper``), and
      while recomputation hands back its outputs, the region is ``suspended``: those ops run
      without being logged or replayed.
    """

    def __init__(self, backend: Backend, policy_fn: Optional[Callable[..., Any]],
                 storage_factory: Callable[[], Storage], allow_cache_entry_mutation: bool = False,
                 whole: bool = False) -> None:
        self._b = backend
        # Whole-region recompute where the framework replays random ops: forward is not observed
        # (no dispatch mode), recompute only keeps writes off state that lives outside it.
        self.whole = whole
        self._replayed: Set[int] = set()  # storages produced by the current recomputation
        self.policy_fn = policy_fn
        self.allow_mutation = allow_cache_entry_mutation
        self.log = OpLog()
        self._storage_factory = storage_factory
        self._swap_storage: Optional[Any] = None  # the storage MUST_SWAP outputs go to, once there is one
        self._kinds: Dict[int, Tuple[Any, OpKind]] = {}  # id(op) -> (op, its kind)
        # storage id -> (op key, index) of kept outputs viewing it: an in-place op on one of them
        # later in the forward destroys the value that was kept (see ``_forget_mutated``).
        self._kept_by_storage: DefaultDict[int, List[Tuple[Hashable, int]]] = defaultdict(list)
        self._rng_after: Dict[Tuple[Hashable, int], Any] = {}
        # One context object per direction, updated per op (the policy sees the current op's).
        self._ctx_forward = SelectiveCheckpointContext(is_recompute=False)
        self._ctx_recompute = SelectiveCheckpointContext(is_recompute=True)
        self.policy_error: Optional[BaseException] = None
        self.suspended = 0  # > 0 while an excluded sub-module runs inside the region's forward
        # Storage ids of the outputs of collectives that re-run: their waits re-run too.
        self._rerun_collectives: Set[int] = set()

    # ------------------------------------------------------------------ dispatch entry points
    def forward_op(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Run one op of the region's forward and keep its output if the policy says so."""
        if self.suspended:
            return _run(func, args, kwargs)  # an excluded sub-module: recomputation skips it whole
        # The op's kind, remembered per op object (by identity: an op's own hash can be a Python
        # function, e.g. PyTorch's OpOverload's); _kind asks the backend the first time.
        seen = self._kinds.get(id(func))
        kind = seen[1] if seen is not None and seen[0] is func else self._kind(func)
        if kind is OpKind.MACHINERY:
            return _run(func, args, kwargs)
        if kind is OpKind.MUTATING:
            out = _run(func, args, kwargs)
            self._forget_mutated(func, args, kwargs)
            return out
        b = self._b
        key = b.op_key(func)
        if kind is OpKind.COLLECTIVE or kind is OpKind.WAIT:
            out = _run(func, args, kwargs)
            if kind is OpKind.WAIT and self._reads_rerun_collective(args, kwargs):
                decision = Decision.RECOMPUTE
                self._keep(key, decision, out, asked=False)
            else:
                decision = self._ask(self._ctx_forward, func, key, args, kwargs, out, collective=True)
                self._keep(key, decision, out)
            if decision is Decision.RECOMPUTE and kind is OpKind.COLLECTIVE:
                self._rerun_collectives.update(b.storage_id(t) for t in b.tree_leaves(out) if b.is_tensor(t))
            return out
        if kind is OpKind.RANDOM:
            if not b.rng_replayable:
                out = _run(func, args, kwargs)
                self._keep(key, Decision.SAVE, out, asked=False)
                return out
            before = b.rng_state(args)
            out = _run(func, args, kwargs)
            after = b.rng_state(args)
            decision = self._ask(self._ctx_forward, func, key, args, kwargs, out)
            index = self._keep(key, decision, out)
            if decision is not Decision.RECOMPUTE and not b.rng_equal(before, after):
                self._rng_after[(key, index)] = after
            return out
        out = _run(func, args, kwargs)
        decision = self._ask(self._ctx_forward, func, key, args, kwargs, out)
        if decision is not Decision.RECOMPUTE and b.cannot_hand_back(func, args):
            # The answer is recorded (and checked again in recompute) but nothing is kept: the op
            # runs again in recomputation. Reported, never silently dropped.
            warnings.warn(
                f"selective checkpoint on {b.name}: the policy answered {decision.value.upper()} for {key}, "
                "whose kept output the framework cannot hand back during recomputation; it is recomputed "
                "instead (results stay bit-exact; answer RECOMPUTE for it to silence this warning).",
                UserWarning, stacklevel=2)
            self.log.record(key, decision, RECOMPUTE)
        else:
            self._keep(key, decision, out)
        return out

    def start_replay(self) -> None:
        """A recomputation starts (each one replays the region from its first op)."""
        self.log.start_replay()
        self._replayed.clear()

    def recompute_op(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Run one op of the region's recomputation: re-run it, or hand back what forward kept."""
        if self.suspended:
            return _run(func, args, kwargs)  # handing back an excluded sub-module's outputs
        seen = self._kinds.get(id(func))  # (as in forward_op)
        kind = seen[1] if seen is not None and seen[0] is func else self._kind(func)
        if kind is OpKind.MACHINERY:
            return _run(func, args, kwargs)
        if kind is OpKind.MUTATING:
            return self._note(self._replay_write(func, args, kwargs))
        if self.whole:
            return self._note(self._replay_write(func, args, kwargs))
        key = self._b.op_key(func)
        index, kept, ask, calls = self.log.next_call(key, key)
        if ask:
            decision = self._ask(self._ctx_recompute, func, key, args, kwargs,
                                 collective=kind is OpKind.COLLECTIVE or kind is OpKind.WAIT)
            self.log.check(calls, index, decision, key)
        if kept is RECOMPUTE:
            return self._note(self._replay_write(func, args, kwargs))
        value = self._note(self._b.tree_map(self._take, kept))  # may raise (not loaded): the record then stays usable
        if self._rng_after:
            rng = self._rng_after.pop((key, index), None)
            if rng is not None:
                self._b.set_rng_state(rng)
        self.log.consume(calls, index)  # backward has it: device memory goes as soon as it can
        return value

    def _note(self, out: Any) -> Any:
        b = self._b
        for t in b.tree_leaves(out):
            if b.is_tensor(t):
                self._replayed.add(b.storage_id(t))
        return out

    def _replay_write(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Re-run an op in recomputation. Writes to tensors the recomputation produced are
        replayed as in forward; a write to state that lives outside the region (BatchNorm's
        running statistics, any buffer updated in place) already happened in forward, so the op
        runs on a copy of that argument: the state is updated exactly once per forward."""
        b = self._b
        written = b.written_tensors(func, args, kwargs)
        if not written:
            return _run(func, args, kwargs)
        outside = {id(t): b.clone(t) for t in written if b.storage_id(t) not in self._replayed}
        if outside:
            swap = lambda x: outside.get(id(x), x)  # noqa: E731
            args, kwargs = b.tree_map(swap, args), b.tree_map(swap, kwargs)
        return _run(func, args, kwargs)

    # ------------------------------------------------------------------ policy
    def _kind(self, func: Any) -> OpKind:
        kind = self._b.op_kind(func)
        if self._b.persistent_ops:  # (elsewhere a new op object per call: nothing to remember)
            self._kinds[id(func)] = (func, kind)  # (the op object is held: its id stays its own)
        return kind

    def _ask(self, ctx: SelectiveCheckpointContext, func: Any, key: Hashable, args: Tuple[Any, ...],
             kwargs: Dict[str, Any], out: Any = None, collective: bool = False) -> Decision:
        if self.policy_fn is None:
            return Decision.SAVE if collective else Decision.RECOMPUTE
        ctx.op_output = out
        try:
            answer = self.policy_fn(ctx, func, *args, **kwargs)
            if type(answer) is not CheckpointPolicy:  # (a member, the common answer, needs no call)
                answer = normalize_policy(answer, key, self._b.convert_policy)
            if collective:
                return collective_decision(answer)
            return answer._decision
        except Exception as err:
            # The region's caller re-raises this one: an operator such as `a @ b` would otherwise
            # replace a TypeError by its own "unsupported operand" message.
            if hasattr(err, "add_note"):
                err.add_note(f"(raised by policy_fn for op {key} while "
                             f"{'recomputing' if ctx.is_recompute else 'running the forward of'} a "
                             "selectively checkpointed region)")
            self.policy_error = err
            raise
        finally:
            ctx.op_output = None

    # ------------------------------------------------------------------ keeping
    def _keep(self, key: Hashable, decision: Decision, out: Any, asked: bool = True) -> int:
        if decision is Decision.RECOMPUTE:
            return self.log.record(key, decision, None, asked)
        b = self._b
        index = self.log.record(key, decision,
                                b.tree_map(self._save if decision is Decision.SAVE else self._swap, out), asked)
        if not self.allow_mutation:
            for t in b.tree_leaves(out):
                if b.is_tensor(t):
                    self._kept_by_storage[b.storage_id(t)].append((key, index))
        return index

    def _reads_rerun_collective(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        if not self._rerun_collectives:
            return False
        b = self._b
        return any(b.is_tensor(t) and b.storage_id(t) in self._rerun_collectives
                   for t in b.tree_leaves((args, kwargs)))

    def _forget_mutated(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """An op that writes to its arguments ran in forward. A kept output it overwrote no longer
        holds the value backward needs (e.g. CPU dropout fills an ``empty_like`` output with
        ``bernoulli_``; ``ReLU(inplace=True)`` overwrites a saved matmul): that op is recomputed
        instead, which replays the same writes in the same order."""
        if not self._kept_by_storage:
            return
        b = self._b
        for t in b.written_tensors(func, args, kwargs):
            for key, index in self._kept_by_storage.pop(b.storage_id(t), ()):
                self.log.recompute_instead(key, index)
                self._rng_after.pop((key, index), None)

    def _save(self, x: Any) -> Any:
        b = self._b
        if b.is_tensor(x):
            return Saved(b.alias(x), b.version, check=not self.allow_mutation)
        return x

    def _swap(self, x: Any) -> Any:
        if not self._b.is_tensor(x):
            return x
        storage = self._swap_storage = self._storage_factory()
        return storage.add(self._b.saved_facts(x, ()), check=not self.allow_mutation)

    def _take(self, x: Any) -> Any:
        if isinstance(x, (Saved, SwapView)):
            return self._b.hand_back(x.get_val())
        return x


def _run(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return func(*args, **kwargs) if kwargs else func(*args)
