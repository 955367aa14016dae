"""Swap schedules shared by the simulated-device tests (hazards and mutations).

Each scenario builds a small ``ToyNet`` whose layers are swap-wrapped, runs one schedule on the
active backend (the tests make it a ``SimDevice``) and returns the gradients, to compare bit for
bit with :func:`reference_grads` (the same net without any wrapper)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch

from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper
from hyper_parallel.testing import SimDevice, per_layer_streams, simulated_device

from support.swap_models import ToyNet, chain, grads, make_input

NET = dict(layers=3, dim=16, hidden=32, seq=8)

#: ``SwapManager().set_bucket_bytes`` for :func:`run_simulated` (tests switch bucketed copies on with it)
BUCKET_BYTES = 0

_REFERENCE: Dict[str, torch.Tensor] = {}


def reference_grads() -> Dict[str, torch.Tensor]:
    """Gradients of one step of the plain net (computed once, on the CPU backend)."""
    if not _REFERENCE:
        net = ToyNet(**NET)
        net(make_input(net)).backward()
        _REFERENCE.update(grads(net))
    return dict(_REFERENCE)


def swapped_net() -> ToyNet:
    net = ToyNet(**NET)
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    return net


def atomic_round_trip(sim: SimDevice, group: str = "g") -> Dict[str, torch.Tensor]:
    """Forward into ``group``; offload, wait, load, wait (atomic API); backward."""
    mgr = SwapManager()
    net = swapped_net()
    mgr.set_current_group_name(group)
    loss = net(make_input(net))
    mgr.set_current_group_name(None)
    mgr.launch_offload(group)
    mgr.wait_offload(group)
    mgr.launch_load(group)
    mgr.wait_load(group)
    loss.backward()
    return grads(net)


def chained_step(sim: SimDevice, layer_streams: bool = False) -> Dict[str, torch.Tensor]:
    """One training step of a chained net (offload/prefetch by the layer chain); with
    ``layer_streams`` every layer runs forward and backward on its own compute stream."""
    net = swapped_net()
    chain(net.layers)
    x = make_input(net)
    if layer_streams:
        per_layer_streams(sim, net.layers)
        x.requires_grad_()  # so that layer 0's full backward hook fires after its backward
    net(x).backward()
    sim.synchronize()  # the gradients were produced on other streams than the one reading them
    out = grads(net)
    sim.synchronize()
    return out


def cancelled_offload(sim: SimDevice, group: str = "g") -> Dict[str, torch.Tensor]:
    """Forward; launch the offload; load before waiting it (cancel); backward."""
    mgr = SwapManager()
    net = swapped_net()
    mgr.set_current_group_name(group)
    loss = net(make_input(net))
    mgr.set_current_group_name(None)
    mgr.launch_offload(group)
    mgr.launch_load(group)
    mgr.wait_load(group)
    loss.backward()
    return grads(net)


def graph_dies_mid_h2d(sim: SimDevice, group: str = "g") -> None:
    """Forward; offload; launch the load; drop the graph before wait_load (an abandoned step)."""
    mgr = SwapManager()
    net = swapped_net()
    mgr.set_current_group_name(group)
    loss = net(make_input(net))
    mgr.set_current_group_name(None)
    mgr.launch_offload(group)
    mgr.wait_offload(group)
    mgr.launch_load(group)
    del loss
    sim.synchronize()


def side_stream_producer(sim: SimDevice, group: str = "g") -> Dict[str, torch.Tensor]:
    """The forward runs on a side compute stream (MoE shared-expert or communication overlap);
    the program orders its default stream after it and drives the swap from there."""
    mgr = SwapManager()
    net = swapped_net()
    main = sim.current_stream()
    side = sim.new_stream()
    x = make_input(net)
    with sim.stream(side):
        side.wait_stream(main)
        mgr.set_current_group_name(group)
        loss = net(x)
        mgr.set_current_group_name(None)
    main.wait_stream(side)
    mgr.launch_offload(group)
    mgr.wait_offload(group)
    mgr.launch_load(group)
    mgr.wait_load(group)
    with sim.stream(side):  # autograd replays a node on its forward's stream
        side.wait_stream(main)
        loss.backward()
    sim.synchronize()  # the gradients were produced on other streams than the one reading them
    out = grads(net)
    sim.synchronize()
    return out


def offload_from_an_unordered_stream(sim: SimDevice, group: str = "g") -> Dict[str, torch.Tensor]:
    """The forward runs on a side stream; the swap is driven from the default stream before that
    stream is ordered after the side stream (the engine must order its copies itself)."""
    mgr = SwapManager()
    net = swapped_net()
    main = sim.current_stream()
    side = sim.new_stream()
    x = make_input(net)
    with sim.stream(side):
        side.wait_stream(main)
        mgr.set_current_group_name(group)
        loss = net(x)
        mgr.set_current_group_name(None)
    mgr.launch_offload(group)
    mgr.wait_offload(group)
    mgr.launch_load(group)
    mgr.wait_load(group)
    with sim.stream(side):
        side.wait_stream(main)
        loss.backward()
    sim.synchronize()  # the gradients were produced on other streams than the one reading them
    out = grads(net)
    sim.synchronize()
    return out


def consumer_on_another_stream(sim: SimDevice, group: str = "g") -> Dict[str, torch.Tensor]:
    """The forward and the offload run on stream ``other`` (``with torch.cuda.stream(s)``), the
    load is waited on the default stream, and the backward runs on ``other`` again (autograd runs
    a node on its forward's stream): ``other`` was never ordered after the load."""
    mgr = SwapManager()
    net = swapped_net()
    main = sim.current_stream()
    other = sim.new_stream()
    x = make_input(net)
    with sim.stream(other):
        other.wait_stream(main)
        mgr.set_current_group_name(group)
        loss = net(x)
        mgr.set_current_group_name(None)
        mgr.launch_offload(group)
        mgr.wait_offload(group)
    main.wait_stream(other)
    mgr.launch_load(group)
    mgr.wait_load(group)
    with sim.stream(other):
        loss.backward()
    sim.synchronize()  # the gradients were produced on other streams than the one reading them
    out = grads(net)
    sim.synchronize()
    return out


def host_buffer_reused_on_another_copy_stream(sim: SimDevice) -> Dict[str, torch.Tensor]:
    """Group ``a`` is loaded on copy stream 1 and its graph dies before the load is waited (its
    host buffers go back to the pool guarded by the load event); group ``b``, of the same sizes,
    is then offloaded on copy stream 2, reusing those buffers while the H2D may still read them."""
    mgr = SwapManager()
    s1, s2 = sim.new_copy_stream(), sim.new_copy_stream()
    net_a = swapped_net()
    mgr.set_current_group_name("a")
    loss_a = net_a(make_input(net_a))
    mgr.set_current_group_name(None)
    mgr.launch_offload("a", s1)
    mgr.wait_offload("a")
    mgr.launch_load("a", s1)
    del loss_a  # abandoned: nobody waits that load
    net_b = swapped_net()
    mgr.set_current_group_name("b")
    loss_b = net_b(make_input(net_b))
    mgr.set_current_group_name(None)
    mgr.launch_offload("b", s2)
    mgr.wait_offload("b")
    mgr.launch_load("b", s2)
    mgr.wait_load("b")
    loss_b.backward()
    return grads(net_b)


def run_simulated(scenario: Callable[[SimDevice], Any], **options: Any) -> Any:
    """Run ``scenario`` on a fresh non-strict ``SimDevice`` (hazards are collected, not raised);
    returns ``(result, violations, sim)``; a scenario that raises returns its exception."""
    with simulated_device(strict=False, check=False, **options) as sim:
        SwapManager().set_bucket_bytes(BUCKET_BYTES)
        try:
            result: Optional[Any] = scenario(sim)
        except Exception as exc:  # noqa: BLE001  (the caller inspects it)
            result = exc
        sim.synchronize()
    return result, list(sim.violations), sim


def equal_grads(got: Any) -> bool:
    ref = reference_grads()
    return isinstance(got, dict) and got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def has_nan(got: Any) -> bool:
    return isinstance(got, dict) and any(torch.isnan(v).any().item() for v in got.values())
