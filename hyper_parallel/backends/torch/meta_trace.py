"""A trace of live bytes and op costs, phase by phase, for planning a target you do not have.

:class:`LiveBytesMode` is a ``TorchDispatchMode`` that sees every op a step runs (forward,
backward, recompute, optimizer) on meta tensors (or real ones: the same code measures a CPU run)
and keeps two records per *phase* (a named stretch of the step, e.g. ``"layer1.fwd"``, that the
caller opens with :meth:`LiveBytesMode.mark`):

- **memory**: every storage an op makes is counted from its birth to its death (a weak reference
  on the storage says when autograd, the caller or the allocator's last holder drops it), each
  rounded as the target's allocator rounds a request (``planner/allocator.py``; ``exact`` counts
  ``nbytes``). Per phase: the live bytes at its start and end and the highest in between, and the
  sizes of the storages it made that are alive at its peak and at its end (for the reserved
  estimate). Storages made before the mode was entered (parameters, input ids) are not counted:
  the caller counts them as the static part of the step.
- **time**: every op's cost (``backends/torch/op_cost.py``), kept per phase so that it can be
  priced on any target later (``roofline.op_seconds``).

Why weak references on storages, not ``saved_tensors_hooks``: what occupies memory is storages,
whoever holds them (autograd's saved tensors, a checkpoint's inputs, a cache, the caller), and a
view must count once; the same rule as the planner's CPU meter (``tools/memory.py``), so that a
meta trace and a measured CPU run count the same bytes.

:class:`FusedAttentionOnMeta` makes ``F.scaled_dot_product_attention`` on meta tensors call the
fused kernel the target runs (on the meta device PyTorch otherwise takes the math path, which
materialises the ``seq x seq`` score matrix that no GPU kernel allocates).

Example (a linear layer's forward and backward on the meta device)::

    >>> import torch
    >>> with torch.device("meta"):
    ...     w = torch.empty(256, 128, requires_grad=True)
    ...     x = torch.empty(64, 128, requires_grad=True)
    >>> with LiveBytesMode() as mode:
    ...     mode.mark("fwd")
    ...     y = torch.nn.functional.linear(x, w).relu()
    ...     mode.mark("bwd")
    ...     y.sum().backward()
    ...     mode.mark("end")
    >>> mode.phases["fwd"].net     # relu's output, which relu saves; the linear's output died with it
    65536
    >>> mode.phases["bwd"].end - mode.phases["fwd"].start >= 256 * 128 * 4 + 64 * 128 * 4   # the two grads stay
    True
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hyper_parallel.planner.allocator import allocated_size
from .op_cost import OpCost, OpCostLog

__all__ = ["Phase", "LiveBytesMode", "FusedAttentionOnMeta"]


@dataclasses.dataclass
class Phase:
    """One named stretch of a traced step (module docstring). Bytes are absolute live bytes of
    what the trace counts; ``peak_sizes`` / ``kept_sizes``: storages this phase made, alive at its
    peak / at its end (allocator-rounded sizes)."""

    name: str
    start: int
    end: int = 0
    peak: int = 0
    peak_sizes: List[int] = dataclasses.field(default_factory=list)
    kept_sizes: List[int] = dataclasses.field(default_factory=list)
    costs: List[OpCost] = dataclasses.field(default_factory=list)

    @property
    def net(self) -> int:
        """What the phase leaves behind: live bytes at its end minus at its start."""
        return self.end - self.start

    @property
    def rise(self) -> int:
        """The phase's peak above its start."""
        return self.peak - self.start


class LiveBytesMode(TorchDispatchMode):
    """Live storages and op costs per phase (module docstring). ``allocator``: how a request is
    rounded (``cuda_caching``, ``npu_caching``, ``exact``)."""

    def __init__(self, allocator: str = "exact") -> None:
        super().__init__()
        self.allocator = allocator
        self.live = 0
        self.phases: Dict[str, Phase] = {}
        self.order: List[str] = []
        self.log = OpCostLog()
        # id(storage) -> (weak reference, rounded size, index of the phase that made it)
        self._entries: Dict[int, Tuple[weakref.ref, int, int]] = {}
        self._current: Optional[Phase] = None

    # ------------------------------------------------------------------ phases
    def mark(self, name: str) -> None:
        """Close the current phase and open ``name`` (a name seen before is reopened under a
        numbered name, ``name#2``, so that nothing is merged silently)."""
        self._close()
        if name in self.phases:
            k = 2
            while f"{name}#{k}" in self.phases:
                k += 1
            name = f"{name}#{k}"
        self._current = Phase(name, start=self.live, peak=self.live)
        self.phases[name] = self._current
        self.order.append(name)

    def _close(self) -> None:
        phase = self._current
        if phase is None:
            return
        phase.end = self.live
        index = len(self.order) - 1
        phase.kept_sizes = [size for ref, size, born in self._entries.values() if born == index and ref() is not None]

    def __exit__(self, *exc: Any) -> Any:
        self._close()
        self._current = None
        return super().__exit__(*exc)

    # ------------------------------------------------------------------ counting
    def _register(self, storage: torch.UntypedStorage) -> bool:
        key = id(storage)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is storage:
            return False
        size = allocated_size(int(storage.nbytes()), self.allocator)
        self._entries[key] = (weakref.ref(storage, self._death(key)), size, len(self.order) - 1)
        self.live += size
        return size > 0

    def _death(self, key: int) -> Any:
        def on_death(ref: weakref.ref) -> None:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is ref:
                del self._entries[key]
                self.live -= entry[1]
        return on_death

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        grew = False
        leaves, _ = tree_flatten(out)
        if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            # (an output over an input's storage, a view or an in-place result, is no new memory; nor
            # is a view of a storage made before the trace, a parameter's ``t()``)
            inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided \
                        and _storage_key(leaf) not in inputs:
                    grew |= self._register(leaf.untyped_storage())
        phase = self._current
        if phase is not None:
            phase.costs.append(self.log.add(func, args, kwargs, out))
            if grew and self.live > phase.peak:
                phase.peak = self.live
                index = len(self.order) - 1
                phase.peak_sizes = [size for ref, size, born in self._entries.values()
                                    if born == index and ref() is not None]
        return out


def _storage_key(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # (no storage: sparse, nested)
        return None


class FusedAttentionOnMeta(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on meta tensors runs the fused kernel of ``kind``:

    - ``"cuda"``: FlashAttention (``aten._scaled_dot_product_flash_attention``) without a mask,
      the memory-efficient kernel (``_scaled_dot_product_efficient_attention``) with one: what
      PyTorch picks on an H100 / A100 for bf16 / fp16 (grouped-query attention is native to the
      flash kernel: ``enable_gqa`` passes the fewer key/value heads as they are);
    - ``"cpu"``: the CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``), what
      PyTorch's CPU build picks (grouped-query attention likewise native).

    Real tensors and float32 inputs on ``"cuda"`` (no flash kernel: PyTorch would take the
    memory-efficient one) are passed through / handled as described; anything this class cannot
    map (dropout with a mask on a CPU, ...) keeps PyTorch's own path.
    """

    def __init__(self, kind: str = "cuda") -> None:
        super().__init__()
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"unknown attention kernel kind {kind!r}; use 'cuda' or 'cpu'")
        self.kind = kind
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention or \
                getattr(func, "__name__", "") == "scaled_dot_product_attention":
            out = self._fused(*args, **kwargs)
            if out is not None:
                self.calls += 1
                return out
        return func(*args, **kwargs)

    def _fused(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
               enable_gqa: bool = False) -> Optional[torch.Tensor]:
        if query.device.type != "meta":
            return None
        aten = torch.ops.aten
        if key.shape[-3] != query.shape[-3] and not enable_gqa:
            return None  # (PyTorch would refuse it too)
        if self.kind == "cpu":
            return aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if attn_mask is None and query.dtype in (torch.bfloat16, torch.float16):
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                            False, scale=scale)[0]
        if key.shape[-3] != query.shape[-3]:  # (the efficient kernel has no native GQA: PyTorch repeats)
            groups = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(groups, dim=-3)
            value = value.repeat_interleave(groups, dim=-3)
        return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, True, dropout_p,
                                                            is_causal, scale=scale)[0]

