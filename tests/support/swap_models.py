"""Small models and helpers shared by the swap-engine tests.

Every model here is deterministic (parameters from a private generator) and small, so a
training step takes milliseconds on CPU. ``ToyNet`` is the workhorse:

* ``ToyBlock``: ``x + drop(fc2(masked_fill(gelu(fc1(x)), mask, 0))) * scale`` -- it saves
  activations of several sizes, a buffer (``scale``), views of parameters (``fc1.weight.t()``
  inside ``F.linear``) and the mask passed by keyword;
* ``ToyNet``: ``layers`` blocks that all receive the same ``mask`` buffer by keyword.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.bench.modes import chain_layers
from hyper_parallel.core.activation_checkpoint import SwapManager

__all__ = [
    "ToyBlock",
    "ToyNet",
    "make_input",
    "chain",
    "grads",
    "params",
    "assert_tensors_equal",
    "train",
    "ManagerSpy",
    "live_tensor_count",
    "saved_tensor_nodes",
    "group",
    "round_trip",
    "add_swap",
]

# (retry_offload: the layer chain's second offload try of what a launch skipped as held elsewhere)
MANAGER_CALLS = ("launch_offload", "retry_offload", "wait_offload", "launch_load", "wait_load")


def add_swap(storage: Any, t: torch.Tensor) -> Any:
    """Save ``t`` into ``storage`` as a swap candidate, as a region's pack does (``t`` must be
    one: not a parameter, not empty...); returns its ``SwapView``."""
    facts = SwapManager().backend.saved_facts(t, ())
    assert facts.reason is None, f"not a swap candidate: {facts.reason}"
    return storage.add(facts)


class ToyBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, final_relu: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)
        self.final_relu = final_relu
        self.register_buffer("scale", torch.ones(dim))

    def forward(self, x: torch.Tensor, *, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if mask is not None:
            h = h.masked_fill(mask, 0.0)  # saves `mask` for backward
        out = x + self.drop(self.fc2(h)) * self.scale  # the multiply saves the buffer
        if self.final_relu:
            # relu saves its output: the layer's output is then both saved in the layer's group
            # and consumed by the next layer.
            out = torch.relu(out)
        return out


class ToyNet(nn.Module):
    def __init__(self, layers: int = 4, dim: int = 16, hidden: int = 32, seq: int = 8,
                 dropout: float = 0.0, seed: int = 0, final_relu: bool = False) -> None:
        super().__init__()
        self.seq, self.dim = seq, dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(ToyBlock(dim, hidden, dropout, final_relu) for _ in range(layers))
            self.head = nn.Linear(dim, 1)
        gen = torch.Generator().manual_seed(seed + 1000)
        # Shared by every layer (passed by keyword): True = masked out.
        self.register_buffer("mask", torch.rand(seq, hidden, generator=gen) < 0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask=self.mask)
        return self.head(x).square().mean()


def make_input(net: ToyNet, batch: int = 4, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, net.seq, net.dim, generator=gen)


def chain(layers: Sequence[nn.Module]) -> None:
    """Chain layers that were wrapped one by one (the bench's helper; wrap_layers does both)."""
    chain_layers(layers)


def grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def params(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_tensors_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str = "") -> None:
    assert a.keys() == b.keys(), f"{what}: different keys {sorted(a)} vs {sorted(b)}"
    assert a, f"{what}: nothing to compare"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max abs diff {(a[k] - b[k]).abs().max()})"


def train(model: nn.Module, steps: int = 3, seed: int = 0, lr: float = 1e-2,
          before_backward: Optional[Callable[[int], None]] = None) -> Tuple[List[torch.Tensor], Any]:
    """``steps`` Adam steps of ``model`` on deterministic inputs; returns (losses, optimizer)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(seed)  # dropout
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(make_input(model, seed=seed + step))
        if before_backward is not None:
            before_backward(step)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses, opt


class ManagerSpy:
    """Records calls of the SwapManager's schedule methods (instance attributes shadow the
    class methods, which is what the layer chain calls through)."""

    def __init__(self, names: Sequence[str] = MANAGER_CALLS) -> None:
        self.names = tuple(names)
        self.calls: List[Tuple[str, Any]] = []
        self.in_backward: List[bool] = []

    def __enter__(self) -> "ManagerSpy":
        mgr = SwapManager()
        for name in self.names:
            orig = getattr(mgr, name)

            def spy(*args: Any, _orig: Any = orig, _name: str = name, **kwargs: Any) -> Any:
                self.calls.append((_name, args[0] if args else None))
                self.in_backward.append(torch._C._current_graph_task_id() != -1)
                return _orig(*args, **kwargs)

            setattr(mgr, name, spy)
        return self

    def __exit__(self, *exc: Any) -> None:
        mgr = SwapManager()
        for name in self.names:
            mgr.__dict__.pop(name, None)

    def clear(self) -> None:
        self.calls.clear()
        self.in_backward.clear()


def _live_tensors() -> Iterator[torch.Tensor]:
    gc.collect()
    for obj in gc.get_objects():
        # type(), not isinstance(): some torch module objects warn when isinstance() probes them
        if type(obj) in (torch.Tensor, nn.Parameter) and not obj.is_meta:
            yield obj


def live_tensor_count() -> int:
    return sum(1 for _ in _live_tensors())


def saved_tensor_nodes(out: torch.Tensor) -> List[Any]:
    """Every autograd node reachable from ``out`` (to read their ``_saved_*`` attributes)."""
    seen, todo, nodes = set(), [out.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return nodes


@contextlib.contextmanager
def group(name: Optional[str]) -> Iterator[None]:
    """Run the body with ``name`` as the current swap group (then back to the previous one)."""
    mgr = SwapManager()
    previous = mgr.get_current_group_name()
    mgr.set_current_group_name(name)
    try:
        yield
    finally:
        mgr.set_current_group_name(previous)


def round_trip(name: str) -> None:
    """Offload group ``name`` to host and load it back, with the atomic API."""
    mgr = SwapManager()
    mgr.launch_offload(name)
    mgr.wait_offload(name)
    mgr.launch_load(name)
    mgr.wait_load(name)
