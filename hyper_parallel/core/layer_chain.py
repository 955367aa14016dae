"""The per-layer offload/prefetch schedule behind ``SwapManager().set_forward_prefetch_layer``.

Forward: when a layer that has a successor finishes, its group's offload is launched; then (for
every layer, the last one included) the predecessor's offload is waited, which frees the
predecessor's device memory. Storages that the first launch skipped because somebody else still
held them (typically the layer's input, still bound to the caller's loop variable) are launched
again at that point (unless this is the last layer) and waited one layer later. The copy of layer ``i`` therefore overlaps the compute of layer
``i + 1``, and by the time the last layer is done only it and its predecessor's in-flight copy
remain (waiting in the last layer too frees one more layer before the loss and the head run). Backward: when a layer's backward starts,
the predecessor's load is launched (overlapping this layer's backward; at most
``SwapManager().prefetch_budget()`` bytes of it) and this layer's own load, launched one layer
earlier, is waited. The last layer is never offloaded; the first never prefetches. Module hooks
(installed through the backend) drive the three entry points below; they do nothing while a
checkpointed region is being recomputed.

This timetable is the same on every device: without streams (a CPU build) the copies are done
when the launches return and the waits order nothing, but the states, launches and waits, and so
what is on the device when, are the accelerator's.

The chain reaches its manager only through :class:`ChainManager`.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, List, Optional, Protocol

__all__ = ["LayerChain", "ChainManager"]


class ChainManager(Protocol):
    """What the layer chain uses of its manager (``SwapManager``, where each is documented): its
    backend and lock, the public schedule calls, and three calls of the package's schedules,
    ``chain_group`` (a chained layer's group), ``switch_group`` (make a group current, returning
    the previous name) and ``retry_offload`` (the second try of what a launch skipped as held
    elsewhere). The chain calls them with the lock held."""

    backend: Any
    lock: Any

    def chain_group(self, group_name: str) -> Any: ...
    def switch_group(self, group_name: Optional[str]) -> Optional[str]: ...
    def retry_offload(self, group_name: str) -> None: ...
    def prefetch_budget(self) -> Optional[int]: ...
    def launch_offload(self, group_name: str) -> None: ...
    def wait_offload(self, group_name: str) -> None: ...
    def launch_load(self, group_name: str, *, storages: Any = None, limit_bytes: Optional[int] = None) -> None: ...
    def wait_load(self, group_name: str) -> None: ...


class _Forward:
    """The storages one forward call of a chained layer saved, and the record of the predecessor's
    forward that fed it. Its backward loads exactly these (several forwards of a layer may wait for
    their backward: gradient accumulation, micro-batches) and prefetches the predecessor's."""

    __slots__ = ("_refs", "prev", "__weakref__")

    def __init__(self, prev: Optional["_Forward"]) -> None:
        # Weak references in the order the storages were made (a loaded forward goes back in
        # backward-use order, the reverse); a plain list is cheaper to make than a WeakSet.
        self._refs: List[weakref.ref] = []
        self.prev = weakref.ref(prev) if prev is not None else None

    def add(self, storage: Any) -> None:
        """A storage made while this forward runs (``SwapManager.new_storage``)."""
        self._refs.append(weakref.ref(storage))

    def live(self) -> List[Any]:
        """The storages of this forward still alive, in the order they were made."""
        return [s for s in (r() for r in self._refs) if s is not None]


class _Link:
    __slots__ = ("name", "group", "prev", "next", "saved_group_names", "handles", "hooks", "forwards", "last_forward")

    def __init__(self, name: str, group: Any) -> None:
        self.name = name
        self.group = group  # its SwapGroup: a chain's group lives as long as the chain
        self.prev: Optional[weakref.ref] = None
        self.next: Optional[weakref.ref] = None
        self.saved_group_names: List[Optional[str]] = []
        self.handles: List[Any] = []  # removable handles of the hooks we installed (not of copied ones)
        self.hooks: List["_ChainHook"] = []
        self.forwards: List[_Forward] = []  # forward calls running now (nested calls stack up)
        self.last_forward: Optional[_Forward] = None  # the last finished one: what the next layer's feeds on


class _ChainHook:
    """The forward pre-hook (``post=False``) or forward hook (``post=True``) of one chained layer.

    A class rather than a closure so that copies of a chained model behave: ``copy.deepcopy`` of
    the model gives the copy its own links (the copied layers are chained among themselves, with
    new group names), and pickling says plainly that it is not supported.
    """

    __slots__ = ("chain", "post", "layer", "active")

    def __init__(self, chain: "LayerChain", post: bool, layer: Any) -> None:
        self.chain = chain
        self.post = post
        self.layer = weakref.ref(layer)
        self.active = True  # False once the chain was cleared (hooks of copies have no handle)

    def __call__(self, module: Any, args: Any, output: Any = None) -> None:
        if not self.active:
            return
        b = self.chain._m.backend
        if b.in_backward():  # a recomputation re-runs forward: not a new forward
            return
        # The manager's lock: autograd threads (one per device) may call in at once. The plain
        # lock (a C-level context), not ``_locked``: this runs twice per layer, and the forgets
        # deferred by finalizers can wait for the next region's ``new_storage``.
        if not self.post:
            with self.chain._m.lock:
                self.chain.forward_start(module)
            return
        # Also called when forward raised, to restore the current group.
        failed = sys.exc_info()[0] is not None or not b.grad_recording()
        with self.chain._m.lock:
            armed = self.chain.forward_end(module, failed)
        if armed:
            self.chain._arm_backward_start(module, output, self.chain._links[module].last_forward)

    def __deepcopy__(self, memo: dict) -> "_ChainHook":
        original = self.layer()
        copy = memo.get(id(original)) if original is not None else None
        if copy is None or not self.active:  # not copied as part of its layer: an inert hook
            hook = _ChainHook(self.chain, self.post, original if original is not None else self)
            hook.active = False
            return hook
        hook = _ChainHook(self.chain, self.post, copy)
        self.chain._adopt_copy(original, copy, memo, hook)
        return hook

    def __reduce__(self) -> Any:
        if not self.active:  # left behind in a copy after SwapManager().reset(): pickles as a no-op
            return (_inert, ())
        raise TypeError(
            "a model whose layers are chained with SwapManager().set_forward_prefetch_layer (or wrap_layers) "
            "cannot be pickled: save model.state_dict() instead (keys are unchanged by wrapping), or call "
            "SwapManager().reset() first to remove the chain's hooks. copy.deepcopy works and gives the "
            "copy its own chain.")


def _inert_hook(*args: Any) -> None:
    """What an inactive chain hook becomes when its module is pickled: a hook that does nothing."""
    return None


def _inert() -> Any:
    return _inert_hook


class LayerChain:
    """Layer order and the hooks that drive a :class:`SwapManager` from it."""

    def __init__(self, manager: ChainManager) -> None:
        self._m = manager
        self._links: "weakref.WeakKeyDictionary[Any, _Link]" = weakref.WeakKeyDictionary()
        self._count = 0
        # The records of the chained layer forwards running now (innermost last): a storage made
        # while one runs belongs to that forward.
        self._running: List[_Forward] = []

    def storage_made(self, storage: Any) -> None:
        """A region made ``storage`` (``SwapManager.new_storage``): it belongs to the innermost
        chained forward running now, if any."""
        if self._running:
            self._running[-1].add(storage)

    def group_name(self, layer: Any) -> Optional[str]:
        link = self._links.get(layer)
        return link.name if link is not None else None

    def uses(self, group_name: str) -> bool:
        """Whether a live chained layer has the group ``group_name``."""
        return any(link.name == group_name for link in self._links.values())

    def _new_link(self, layer: Any) -> _Link:
        """A link (and its group) for ``layer``, not chained to any other yet."""
        name = f"layer_{self._count}"
        self._count += 1
        link = self._links[layer] = _Link(name, self._m.chain_group(name))
        return link

    def _link_of(self, layer: Any) -> _Link:
        link = self._links.get(layer)
        if link is None:
            link = self._new_link(layer)
            link.hooks = [_ChainHook(self, False, layer), _ChainHook(self, True, layer)]
            link.handles = self._m.backend.register_forward_hooks(layer, link.hooks[0], link.hooks[1])
        return link

    @staticmethod
    def _alive(ref: Optional[weakref.ref]) -> Any:
        return ref() if ref is not None else None

    def link(self, first: Any, second: Any) -> None:
        # Validate everything before touching any layer: a rejected call changes nothing.
        for layer in (first, second):
            if not self._m.backend.is_module(layer):
                raise TypeError(f"set_forward_prefetch_layer expects {self._m.backend.module_type} layers, "
                                f"got {type(layer).__name__}")
        if first is second:
            raise ValueError("set_forward_prefetch_layer: first and second are the same layer.")
        a, b = self._links.get(first), self._links.get(second)
        succ = self._alive(a.next) if a is not None else None
        if succ is not None and succ is not second:
            raise ValueError(f"set_forward_prefetch_layer: {type(first).__name__} ({a.name}) already "
                             f"has a different successor ({self._links[succ].name}).")
        pred = self._alive(b.prev) if b is not None else None
        if pred is not None and pred is not first:
            raise ValueError(f"set_forward_prefetch_layer: {type(second).__name__} ({b.name}) already "
                             f"has a different predecessor ({self._links[pred].name}).")
        if succ is second:
            return  # already declared
        node = second
        while node is not None:  # walking forward from `second` must not reach `first`
            if node is first:
                raise ValueError("set_forward_prefetch_layer: this pair would close a cycle; the layer "
                                 "order must be a chain (each layer once, the first has no predecessor).")
            nxt = self._links.get(node)
            node = self._alive(nxt.next) if nxt is not None else None
        a, b = self._link_of(first), self._link_of(second)
        a.next = weakref.ref(second)
        b.prev = weakref.ref(first)

    def clear(self) -> None:
        for link in list(self._links.values()):
            for handle in link.handles:
                handle.remove()
            for hook in link.hooks:
                hook.active = False
        self._links = weakref.WeakKeyDictionary()
        self._count = 0
        self._running = []

    # ------------------------------------------------------------------ copies
    def _adopt_copy(self, original: Any, copy: Any, memo: dict, hook: _ChainHook) -> None:
        """``copy.deepcopy`` is copying ``original``'s hook ``hook`` into ``copy``: give ``copy`` a
        link of its own (its hooks are the copied ones) and link it to the copies of
        ``original``'s neighbours that were already adopted. Whichever of two neighbours is
        copied second makes the link, so a whole copied stack ends up chained like the original."""
        link = self._links.get(copy) or self._new_link(copy)
        link.hooks.append(hook)
        olink = self._links.get(original)
        if olink is None:
            return
        pred = memo.get(id(self._alive(olink.prev)))
        if pred is not None and pred in self._links and link.prev is None:
            self._links[pred].next = weakref.ref(copy)
            link.prev = weakref.ref(pred)
        succ = memo.get(id(self._alive(olink.next)))
        if succ is not None and succ in self._links and link.next is None:
            self._links[succ].prev = weakref.ref(copy)
            link.next = weakref.ref(succ)

    def _arm_backward_start(self, layer: Any, output: Any, forward: Optional[_Forward]) -> None:
        """Call ``backward_start(layer, forward)`` once, when the gradient of the layer's output is
        ready, i.e. just before the layer's own backward starts."""
        b = self._m.backend
        outs = [t for t in b.tree_leaves(output) if b.is_tensor(t) and b.requires_grad(t)]
        if not outs:
            return
        ref = weakref.ref(layer)
        fired = [False]

        def on_grad(grad: Any) -> None:
            module = ref()
            if not fired[0] and module is not None:
                fired[0] = True
                with self._m.lock:  # (the plain lock, as in _ChainHook.__call__)
                    self.backward_start(module, forward)

        for t in outs:
            b.register_grad_hook(t, on_grad)

    # ------------------------------------------------------------------ hook entry points
    def forward_start(self, layer: Any) -> None:
        link = self._links.get(layer)
        if link is None:
            raise RuntimeError(
                f"{type(layer).__name__} runs the layer-chain hooks of another layer but is not chained "
                "itself (a copy.copy of a chained layer shares its hooks). Use copy.deepcopy (the copy gets "
                "its own chain), or chain the copied layers with wrap_layers / set_forward_prefetch_layer.")
        link.saved_group_names.append(self._m.switch_group(link.name))
        prev = self._alive(link.prev)
        fed_by = self._links[prev].last_forward if prev is not None and prev in self._links else None
        record = _Forward(fed_by)
        link.forwards.append(record)
        self._running.append(record)

    def forward_end(self, layer: Any, failed: bool) -> bool:
        """Returns whether the backward-start hook should be armed on the outputs."""
        link = self._links.get(layer)
        if link is None or not link.saved_group_names:
            return False  # our pre-hook never ran (an earlier pre-hook raised): nothing to undo
        self._m.switch_group(link.saved_group_names.pop())
        self._running.pop()
        record = link.forwards.pop()
        if failed:
            return False
        link.last_forward = record
        has_next = link.next is not None and link.next() is not None
        if has_next:
            self._m.launch_offload(link.name)
        prev = link.prev() if link.prev is not None else None
        if prev is not None:
            prev_link = self._links[prev]
            prev_group = prev_link.group
            if prev_group.offload_pending:
                self._m.wait_offload(prev_group.name)
            # When the predecessor's offload was launched, the caller still held its input (the
            # `h` of `for layer in layers: h = layer(h)`), so that storage was skipped. The caller
            # has moved on by now: offload it too; it is waited when the next layer ends (so not
            # after the last layer, where nothing would wait for it before backward).
            if has_next and prev_group.has_retryable():
                self._m.retry_offload(prev_group.name)
            before = prev_link.prev() if prev_link.prev is not None else None
            if before is not None:
                before_group = self._links[before].group
                if before_group.offload_pending:
                    self._m.wait_offload(before_group.name)
        return True

    def backward_start(self, layer: Any, forward: Optional[_Forward] = None) -> None:
        """The backward of ``layer``'s forward call ``forward`` starts: bring that call's swapped
        tensors back (on demand if nothing prefetched them), then prefetch the predecessor's
        call that fed it, up to ``SwapManager().prefetch_budget()`` bytes, in backward-use order,
        so that its copy overlaps this layer's backward."""
        link = self._links.get(layer)
        if link is None:  # the chain was reset while a graph was alive
            return
        own = link.group
        mine = forward.live() if forward is not None else None
        if own.pending_load_bytes(mine):
            self._m.launch_load(link.name, storages=mine)
        prev = self._alive(link.prev)
        fed_by = forward.prev() if forward is not None and forward.prev is not None else None
        if prev is not None and (forward is None or fed_by is not None):
            prev_group = self._links[prev].group
            budget = self._m.prefetch_budget()
            theirs = fed_by.live() if fed_by is not None and budget != 0 else None
            if budget != 0 and prev_group.pending_load_bytes(theirs):
                self._m.launch_load(prev_group.name, storages=theirs, limit_bytes=budget)
        if own.load_pending:
            self._m.wait_load(link.name)
