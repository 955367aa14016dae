"""Split backward (zero-bubble pipeline schedules): the input half (``stage_backward_input``) and
the weight half (``stage_backward_weight``) run through the same graph; a ``RecomputeSession``
makes them share one recomputation of every checkpoint region (whole, selective, with swapped op
outputs and swapped inputs), frees what the weight half consumed, and leaves ordinary backward
exactly as it was.

Recomputation is counted from the ops that run (``OpCounter``), not from the library's counters:
``aten.gelu.default`` and ``aten.native_layer_norm.default`` only run in forward and when a region
is recomputed (backward runs ``gelu_backward`` / ``native_layer_norm_backward``).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from hyper_parallel.core.activation_checkpoint import (CheckpointPolicy, RecomputeSession, SwapManager,
                                                       checkpoint_wrapper)
from hyper_parallel.tools.memory import MemoryMeter

from support.helpers import OpCounter, aten

D, H, LAYERS = 32, 64, 2
GELU = aten.gelu.default
NORM = aten.native_layer_norm.default


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def swap_addmm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SWAP if op == aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE


# name -> checkpoint_wrapper arguments (None: not checkpointed, the reference)
VARIANTS: Dict[str, Optional[Dict[str, Any]]] = {
    "whole": {},
    "selective": {"policy_fn": [aten.addmm.default]},
    "swap": {"policy_fn": swap_addmm, "swap_inputs": True},
}


def make_stage(wrap: Optional[Dict[str, Any]]) -> nn.Sequential:
    torch.manual_seed(0)
    stage = nn.Sequential(*[Block() for _ in range(LAYERS)])
    if wrap is not None:
        for block in stage:
            checkpoint_wrapper(block, **wrap)
    return stage


def _input(mb: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + mb)
    return torch.randn(4, 8, D, generator=g).requires_grad_()


def split_backward(stage: nn.Module, session: Optional[RecomputeSession], offload: bool = False,
                   meter: Optional[MemoryMeter] = None) -> Dict[str, Any]:
    """Forward one micro-batch, then its input half and its weight half (as a zero-bubble
    schedule runs them), the halves in ``session`` if given. ``offload``: the micro-batch's swap
    group goes to the host after forward and comes back before the input half."""
    mgr = SwapManager()
    x = _input()
    out: Dict[str, Any] = {}
    with OpCounter() as fwd:
        if offload:
            mgr.set_current_group_name("mb0")
        y = stage(x)
        if offload:
            mgr.set_current_group_name(None)
            mgr.launch_offload("mb0")
            mgr.wait_offload("mb0")
    grad_y = torch.ones_like(y)
    with OpCounter() as input_half:
        if offload:
            mgr.launch_load("mb0")
            mgr.wait_load("mb0")
        with session if session is not None else contextlib.nullcontext():
            _, groups = stage_backward_input([y], [grad_y], [x], stage.parameters())
    if meter is not None:
        out["between_bytes"] = meter.current_bytes - meter.baseline_bytes
    if session is not None:
        out["kept"] = session.kept
        values = session.kept_values()
        out["kept_bytes"] = sum({v.untyped_storage()._cdata: v.untyped_storage().nbytes() for v in values}.values())
        out["kept_refs"] = [weakref.ref(v) for v in values]
        del values
    with OpCounter() as weight_half:
        with session.last_half() if session is not None else contextlib.nullcontext():
            stage_backward_weight(stage.parameters(), groups)
    del groups, y
    gc.collect()
    if meter is not None:
        out["after_bytes"] = meter.current_bytes - meter.baseline_bytes
    out.update(fwd=fwd.counts, input_half=input_half.counts, weight_half=weight_half.counts,
               grads=[p.grad.clone() for p in stage.parameters()] + [x.grad.clone()])
    return out


@pytest.fixture(scope="module")
def reference() -> Dict[str, Any]:
    return split_backward(make_stage(None), None)


@pytest.mark.parametrize("variant,offload", [("whole", False), ("selective", False), ("swap", False),
                                              ("swap", True)],
                         ids=["whole", "selective", "swap-on-device", "swap-offloaded"])
def test_split_backward_recomputes_once_and_matches(variant, offload, reference):
    session = RecomputeSession("mb0")
    res = split_backward(make_stage(VARIANTS[variant]), session, offload=offload)
    for a, b in zip(res["grads"], reference["grads"]):
        assert torch.equal(a, b)
    assert res["fwd"][GELU] == LAYERS and res["fwd"][NORM] == LAYERS
    assert res["input_half"][GELU] == LAYERS and res["input_half"][NORM] == LAYERS  # one recomputation
    assert res["weight_half"][GELU] == 0 and res["weight_half"][NORM] == 0          # ... shared
    assert session.regions == LAYERS and session.closed and session.kept == 0
    assert res["kept"] > 0
    if offload:
        assert SwapManager().stats()["offloaded_bytes"] > 0


def test_without_a_session_whole_region_recomputes_per_backward_call(reference):
    res = split_backward(make_stage(VARIANTS["whole"]), None)
    for a, b in zip(res["grads"], reference["grads"]):
        assert torch.equal(a, b)
    # PyTorch's weight half runs one autograd.grad per parameter group: each recomputes again.
    assert res["input_half"][GELU] == LAYERS
    assert res["weight_half"][GELU] >= LAYERS


def test_without_a_session_selective_region_says_what_to_do():
    with pytest.raises(RuntimeError, match="RecomputeSession"):
        split_backward(make_stage(VARIANTS["selective"]), None)


@pytest.mark.parametrize("variant", ["whole", "selective"])
def test_weight_half_frees_what_the_session_kept(variant):
    """Between the halves the session holds the recomputed activations (what the stage holds
    without checkpointing); after the weight half they are gone and live memory is what an
    uncheckpointed split backward leaves (parameters, gradients, inputs)."""
    with MemoryMeter("cpu", scan_gc=False) as plain_meter:
        plain = split_backward(make_stage(None), None, meter=plain_meter)
    session = RecomputeSession("mb0")
    with MemoryMeter("cpu", scan_gc=False) as meter:
        res = split_backward(make_stage(VARIANTS[variant]), session, meter=meter)
    assert res["kept_bytes"] > 0
    if variant == "whole":
        # (a selective region also holds what its policy kept and backward never asks for: the
        # SAVE'd output of each block's last addmm, until the graph dies)
        assert res["between_bytes"] <= plain["between_bytes"]
    assert all(ref() is None for ref in res["kept_refs"])  # every kept recomputed tensor died
    assert res["after_bytes"] == plain["after_bytes"]


def test_interleaved_microbatches_each_recompute_once():
    """Zero-bubble order: I(0) I(1) W(0) W(1), one session per micro-batch."""
    stage = make_stage(VARIANTS["selective"])
    ref_stage = make_stage(None)
    for model, sessions in ((stage, [RecomputeSession("mb0"), RecomputeSession("mb1")]), (ref_stage, None)):
        xs = [_input(mb) for mb in range(2)]
        with OpCounter() as counter:
            ys = [model(x) for x in xs]
            groups = []
            for mb in range(2):
                with sessions[mb] if sessions else contextlib.nullcontext():
                    groups.append(stage_backward_input([ys[mb]], [torch.ones_like(ys[mb])], [xs[mb]],
                                                       model.parameters())[1])
            for mb in range(2):
                with sessions[mb].last_half() if sessions else contextlib.nullcontext():
                    stage_backward_weight(model.parameters(), groups[mb])
        model.hp_counts = counter.counts
        model.hp_grads = [p.grad for p in model.parameters()] + [x.grad for x in xs]
    assert stage.hp_counts[GELU] == 2 * 2 * LAYERS   # forward + one recomputation, 2 micro-batches
    assert ref_stage.hp_counts[GELU] == 2 * LAYERS
    for a, b in zip(stage.hp_grads, ref_stage.hp_grads):
        assert torch.equal(a, b)


def test_ordinary_backward_keeps_the_framework_memory_behaviour():
    """Outside a session the boxes only forward to PyTorch's checkpoint: the peak of an ordinary
    backward is that of PyTorch's own non-reentrant checkpoint, byte for byte."""
    peaks = []
    for ours in (True, False):
        stage = make_stage(VARIANTS["whole"] if ours else None)
        x = _input()
        with MemoryMeter("cpu", track=[stage, x], scan_gc=False) as meter:
            y = x
            for block in stage:
                y = block(y) if ours else torch_checkpoint(block, y, use_reentrant=False)
            y.sum().backward()
            del y
        peaks.append(meter.peak_above_baseline)
    assert peaks[0] == peaks[1]


def test_session_rules():
    a, b = RecomputeSession("a"), RecomputeSession("b")
    with a:
        with a:  # re-entering the running session is fine
            pass
        with pytest.raises(RuntimeError, match="while session 'a' is running"):
            with b:
                pass
    with a.last_half():
        pass
    assert a.closed
    with pytest.raises(RuntimeError, match="closed"):
        with a:
            pass
    a.close()  # twice is fine
