"""Swap schedules shared by the simulated-device tests (hazards and mutations).

Each scenario builds a small ``ToyNet`` whose layers are swap-wrapped, runs one schedule on the
active backend (the tests make it a ``SimDevice``) and returns the gradients, to compare bit for
bit with :func:`reference_grads` (the same net without any wrapper)."""

from __future__ import annotations

import gc
from typing import Any, Callable, Dict, Optional, Tuple

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


def forward_into(net: ToyNet, group: str, x: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The loss of one forward of ``net`` whose swap regions save into ``group``."""
    mgr = SwapManager()
    mgr.set_current_group_name(group)
    try:
        return net(make_input(net) if x is None else x)
    finally:
        mgr.set_current_group_name(None)


def round_trip(group: str, copy_stream: Any = None) -> None:
    """Offload ``group``, wait, load it back, wait (atomic API, on ``copy_stream``)."""
    mgr = SwapManager()
    mgr.launch_offload(group, copy_stream)
    mgr.wait_offload(group)
    mgr.launch_load(group, copy_stream)
    mgr.wait_load(group)


# ------------------------------------------------------------------ issue 25: the five hazard classes
def cancelled_offload_buffer_reused(sim: SimDevice) -> Dict[str, torch.Tensor]:
    """Group ``a``'s offload on copy stream 1 is cancelled by its load while the D2H may still
    write the host buffers, which go back to the pool (guarded by the D2H event); group ``b``, of
    the same sizes, is then offloaded on copy stream 2 into those buffers. Returns ``b``'s grads
    (``a``'s, which never left the device, must be exact too: checked here)."""
    mgr = SwapManager()
    s1, s2 = sim.new_copy_stream(), sim.new_copy_stream()
    net_a, net_b = swapped_net(), swapped_net()
    loss_a = forward_into(net_a, "a")
    mgr.launch_offload("a", s1)
    mgr.launch_load("a", s1)  # cancels the offload: nothing waits its D2H
    mgr.wait_load("a")
    loss_b = forward_into(net_b, "b")
    round_trip("b", s2)
    loss_b.backward()
    loss_a.backward()
    assert equal_grads(grads(net_a)), "group a (offload cancelled) has wrong gradients"
    return grads(net_b)


def failed_copy_buffer_reused(sim: SimDevice) -> Dict[str, torch.Tensor]:
    """Group ``a`` is loaded on copy stream 1 and abandoned (its host buffers go back guarded by
    the load's event while the H2D may still read them). Group ``b``'s offload on copy stream 2
    takes one of those buffers (its copy stream waits that guard) and its first copy fails: the
    buffer goes back with a new guard. Group ``c`` is then offloaded on copy stream 3 into it."""
    mgr = SwapManager()
    s1, s2, s3 = sim.new_copy_stream(), sim.new_copy_stream(), sim.new_copy_stream()
    net_a, net_b, net_c = swapped_net(), swapped_net(), swapped_net()
    loss_a = forward_into(net_a, "a")
    mgr.launch_offload("a", s1)
    mgr.wait_offload("a")
    mgr.launch_load("a", s1)
    del loss_a  # abandoned: nobody waits that load
    loss_b = forward_into(net_b, "b")

    def fail(*args: Any) -> None:
        del sim.before_call["copy_bytes"]  # only the first copy fails
        raise RuntimeError("injected copy failure")

    sim.before_call["copy_bytes"] = fail
    try:
        mgr.launch_offload("b", s2)
    except RuntimeError as exc:
        assert "injected" in str(exc), exc
    else:
        raise AssertionError("the injected copy failure did not reach launch_offload's caller")
    loss_c = forward_into(net_c, "c")
    round_trip("c", s3)
    loss_c.backward()
    loss_b.backward()  # b never left the device
    assert equal_grads(grads(net_b)), "group b (failed offload) has wrong gradients"
    return grads(net_c)


def reload_on_another_copy_stream_dies(sim: SimDevice) -> None:
    """A group offloaded on copy stream 1 is loaded on copy stream 2, and its graph dies before
    the load is waited: the destinations are freed while the H2D on stream 2 still writes them."""
    mgr = SwapManager()
    s1, s2 = sim.new_copy_stream(), sim.new_copy_stream()
    net = swapped_net()
    loss = forward_into(net, "g")
    mgr.launch_offload("g", s1)
    mgr.wait_offload("g")
    mgr.launch_load("g", s2)
    del loss
    gc.collect()
    sim.synchronize()


def host_buffer_shared_by_two_devices(sim: SimDevice) -> Dict[str, torch.Tensor]:
    """Host buffers are one pool for every device, streams are per device: group ``a`` (device 0)
    makes its round trip, and its host buffers go back to the pool while device 0's H2D may still
    read them; group ``b``, of the same sizes on device 1, is then offloaded into them on device
    1's copy stream, which waits only device 1's compute. Returns ``b``'s gradients."""
    net_a, net_b = swapped_net(), sim.place(swapped_net(), 1)
    loss_a = forward_into(net_a, "a")
    round_trip("a")
    loss_b = forward_into(net_b, "b", sim.place(make_input(net_b), 1))
    round_trip("b")
    loss_b.backward()
    loss_a.backward()
    assert equal_grads(grads(net_a)), "group a (device 0) has wrong gradients"
    return sim.place(grads(net_b), 0)


def load_waited_on_another_stream_graph_dies(sim: SimDevice) -> None:
    """A load launched on the default stream (the destinations belong to its pool) is waited on
    stream ``other``; then the graph dies before anything unpacks a reloaded tensor: the blocks go
    back to the default stream's pool, which never waited the H2D."""
    mgr = SwapManager()
    net = swapped_net()
    main, other = sim.current_stream(), sim.new_stream()
    loss = forward_into(net, "g")
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    mgr.launch_load("g")
    with sim.stream(other):
        other.wait_stream(main)
        mgr.wait_load("g")
    del loss
    gc.collect()
    sim.synchronize()


class TwoStreamBlock(torch.nn.Module):
    """``h = fc(x)`` saved twice in one region: by ``sin`` on the current stream and by ``cos`` on
    ``side`` (a block that overlaps part of its work on a side stream); returns ``(a, b)``, the
    second produced on ``side`` and not joined back into the current stream."""

    def __init__(self, sim: SimDevice, side: Any) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(NET["dim"], NET["dim"])
        self.sim, self.side = sim, side

    def forward(self, x: torch.Tensor) -> Any:
        h = self.fc(x)
        a = h.sin() + h.exp()  # saves h, and exp's output, on the current stream
        main = self.sim.current_stream()
        with self.sim.stream(self.side):
            self.side.wait_stream(main)
            b = h.cos()  # saves h again, on the side stream
        return a, b


def storage_saved_on_two_streams(sim: SimDevice) -> None:
    """A storage saved on the default stream and again on a side stream; the offload is launched
    and waited on the default stream before it waits the side stream (the side stream's read may
    still be in flight when the engine releases the source). Checks the gradients itself."""
    mgr = SwapManager()
    main, side = sim.current_stream(), sim.new_stream()
    x = torch.randn(4, NET["seq"], NET["dim"], generator=torch.Generator().manual_seed(0))
    plain = TwoStreamBlock(sim, side)
    a, b = plain(x)
    main.wait_stream(side)
    sim.mark_used_by(b, main)  # (the program's own record_stream: b, made on the side stream, is used here)
    (a + b).square().mean().backward()
    expected = grads(plain)
    block = swap_wrapper(TwoStreamBlock(sim, side))
    a, b = forward_into(block, "g", x)
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    main.wait_stream(side)
    sim.mark_used_by(b, main)
    loss = (a + b).square().mean()
    mgr.launch_load("g")
    mgr.wait_load("g")
    loss.backward()
    assert equal_grads(grads(block), expected), "wrong gradients"


def graph_dies_mid_d2h(sim: SimDevice, group: str = "g") -> None:
    """Forward; launch the offload; drop the graph before wait_offload (an abandoned step): the
    sources die while their D2H may still read them."""
    mgr = SwapManager()
    net = swapped_net()
    loss = forward_into(net, group)
    mgr.launch_offload(group)
    del loss
    gc.collect()
    sim.synchronize()


# ------------------------------------------------------------------ launches on two copy streams, partial cancels
def load_split_over_two_copy_streams(sim: SimDevice, group: str = "g") -> Dict[str, torch.Tensor]:
    """Forward; offload and wait; load the first half of the bytes (the tensors backward needs
    first) on copy stream 1 and the rest on copy stream 2; one ``wait_load``; backward. The wait
    must wait both launches' events: each copy stream orders only its own copies."""
    mgr = SwapManager()
    s1, s2 = sim.new_copy_stream(), sim.new_copy_stream()
    net = swapped_net()
    loss = forward_into(net, group)
    mgr.launch_offload(group)
    mgr.wait_offload(group)
    total = mgr.stats()["groups"][group]["offloaded_bytes"]
    mgr.launch_load(group, s1, limit_bytes=total // 2)
    mgr.launch_load(group, s2)
    assert s1.copies and s2.copies, "the load was not split over the two copy streams"
    mgr.wait_load(group)
    loss.backward()
    return grads(net)


def two_offload_launches_one_wait(sim: SimDevice, group: str = "g") -> Dict[str, torch.Tensor]:
    """Two forwards into one group, each offload launched on its own copy stream after its
    forward, then one ``wait_offload`` (it must wait both launches before releasing the sources),
    one round-trip load and both backwards. Returns the summed gradients."""
    mgr = SwapManager()
    s1, s2 = sim.new_copy_stream(), sim.new_copy_stream()
    net = swapped_net()
    loss1 = forward_into(net, group)
    mgr.launch_offload(group, s1)
    loss2 = forward_into(net, group, make_input(net, seed=1))
    mgr.launch_offload(group, s2)
    mgr.wait_offload(group)
    mgr.launch_load(group)
    mgr.wait_load(group)
    (loss1 + loss2).backward()
    return grads(net)


def reference_two_forwards() -> Dict[str, torch.Tensor]:
    """The gradients of :func:`two_offload_launches_one_wait` without any wrapper."""
    net = ToyNet(**NET)
    (net(make_input(net)) + net(make_input(net, seed=1))).backward()
    return grads(net)


def partial_cancel(sim: SimDevice, group: str = "g") -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
    """Forward; launch the offload; while it is in flight, load the tensors backward needs first
    (``limit_bytes``: the bytes of the first storage in backward order, so at least one is
    cancelled and others stay in flight); then wait the offload, which must release the rest;
    load the rest; backward. Returns the gradients and the resident swap bytes at each point."""
    mgr = SwapManager()
    net = swapped_net()
    loss = forward_into(net, group)
    resident = {"forward": mgr.resident_swap_bytes(group)}
    mgr.launch_offload(group)
    first = mgr._group(group).storages()[-1].swap_tensors[-1]  # (backward needs it first)
    bucket = first.bucket
    limit = bucket.nbytes if bucket is not None else first.nbytes
    mgr.launch_load(group, limit_bytes=limit)
    mgr.wait_offload(group)
    resident["after_wait_offload"] = mgr.resident_swap_bytes(group)
    resident["limit"] = limit
    mgr.launch_load(group)
    mgr.wait_load(group)
    loss.backward()
    return grads(net), resident


class SideStreamAllocation(torch.nn.Module):
    """``h = fc(x)`` allocated on ``side`` (its block belongs to the side stream's pool) and saved
    there by ``cos``, then saved again by ``sin`` on the current stream after it waited ``side``;
    ``side`` then waits the current stream (the program hands ``h`` back to its owner). Without
    ``side``, all on the current stream (the reference)."""

    def __init__(self, sim: SimDevice, side: Any = None) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(NET["dim"], NET["dim"])
        self.sim, self.side = sim, side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.side is None:
            h = self.fc(x)
            return h.sin() + h.cos()
        main = self.sim.current_stream()
        with self.sim.stream(self.side):
            self.side.wait_stream(main)
            h = self.fc(x)
            b = h.cos()  # saves h on the side stream
        main.wait_stream(self.side)
        self.sim.mark_used_by(b, main)
        out = h.sin() + b  # saves h again, on the current stream
        self.side.wait_stream(main)
        return out


def allocated_on_a_side_stream(sim: SimDevice) -> None:
    """A storage allocated and saved on a side stream, saved again on the default stream, whose
    offload is launched and waited on the default stream: its block returns to the side stream's
    pool, which never waited the D2H, so the engine must protect it. Checks the gradients."""
    x = torch.randn(4, NET["seq"], NET["dim"], generator=torch.Generator().manual_seed(0))
    plain = SideStreamAllocation(sim)
    plain(x).square().mean().backward()
    expected = grads(plain)
    block = swap_wrapper(SideStreamAllocation(sim, sim.new_stream()))
    loss = forward_into(block, "g", x).square().mean()
    round_trip("g")
    loss.backward()
    assert equal_grads(grads(block), expected), "wrong gradients"


def two_forwards_then_the_second_backward(sim: SimDevice) -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
    """A chained net runs two forwards (both graphs alive, as in gradient accumulation or two
    micro-batches in flight), then the second one's backward, then the first's. Returns the
    gradients and the resident swap bytes after the first forward, after both, and after the
    second backward (in all groups, and in the last layer's: the first forward's last layer was
    never offloaded, and the second backward must bring back only its own forward's tensors)."""
    mgr = SwapManager()
    net = swapped_net()
    chain(net.layers)
    resident = {}
    loss1 = net(make_input(net))
    resident["first_forward"] = mgr.resident_swap_bytes()
    loss2 = net(make_input(net, seed=1))
    resident["both_forwards"] = mgr.resident_swap_bytes()
    loss2.backward()
    resident["second_backward"] = mgr.resident_swap_bytes()
    resident["second_backward_last_layer"] = mgr.resident_swap_bytes(mgr.layer_group_name(net.layers[-1]))
    loss1.backward()
    return grads(net), resident


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


def equal_grads(got: Any, ref: Optional[Dict[str, torch.Tensor]] = None) -> bool:
    """Whether ``got`` equals ``ref`` (default: :func:`reference_grads`) bit for bit."""
    ref = reference_grads() if ref is None else ref
    return isinstance(got, dict) and got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def has_nan(got: Any) -> bool:
    return isinstance(got, dict) and any(torch.isnan(v).any().item() for v in got.values())
