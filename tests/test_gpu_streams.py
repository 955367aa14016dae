"""The stream ordering on a real CUDA device (issue 25); skipped where CUDA is unavailable.

The simulated device (``hyper_parallel.testing``) replaces exactly the four backend primitives that
order a GPU (``TorchBackend.mark_used_by``'s ``record_stream``, ``stream_context``,
``record_event``, ``wait_event``), so only a real device tests them. Here the engine's schedules
run on real CUDA streams, with every copy delayed (the stream it runs on sleeps first:
``torch.cuda._sleep``) and every fresh reload destination filled with NaN on the compute stream,
so a stream that does not wait a copy reads NaN or stale bytes, and a block reused under a copy
in flight is overwritten:

* each schedule (the layer chain; the atomic API with the manager's copy stream and with two
  copy streams of the caller's; buckets; a cancelled offload; a graph that dies mid-load) gives
  the gradients of the unwrapped net, every copy runs on a copy stream, and no block in use by a
  copy is handed out again (``test_schedule_on_cuda``);
* the same schedules run under PyTorch's stream sanitizer, ``TORCH_CUDA_SANITIZER=1``, in a
  subprocess (``test_schedules_under_the_stream_sanitizer``), which also checks that the
  sanitizer does catch a missing wait there;
* each of the four primitives, mutated by monkeypatching, is caught (``test_mutated_primitive_is_caught``);
* with two devices, a group on the second one copies on copy streams made on it
  (``test_copy_streams_are_made_on_the_tensors_device``).

Self-contained (its own small net), runnable from the source tree with ``PYTHONPATH`` (no
install): ``PYTHONPATH=. python -m pytest tests/test_gpu_streams.py``. ``benchmarks/gpu_suite.sh``
runs it first.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from typing import Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.backends.torch.backend import TorchBackend
from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper
from hyper_parallel.testing import _shim

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: it checks real streams, events and record_stream "
                                       "(the simulated device covers the rest on CPU)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS, BATCH, SEQ, DIM, HIDDEN = 4, 4, 64, 64, 256   # activations of 64 KiB and 256 KiB
BUCKET_BYTES = 4 << 20                                 # every saved storage of a layer is small (<= 256 KiB)
DELAY_CYCLES = 100_000_000  # about 50 ms at the H200's clock before each copy: far longer than backward takes
SCRIBBLES_PER_SIZE = 64     # new blocks asked for per freed size: enough to be handed every freed block


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def _input() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1)).cuda()


def _grads(net: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


_REFERENCE: Dict[str, torch.Tensor] = {}


def _reference() -> Dict[str, torch.Tensor]:
    """The unwrapped net's gradients (computed once, with no copy delayed)."""
    if not _REFERENCE:
        net = Net().cuda()
        net(_input()).backward()
        _REFERENCE.update(_grads(net))
    return _REFERENCE


def _swapped_net() -> Net:
    net = Net().cuda()
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    return net


def _forward_into(net: Net, group: str) -> torch.Tensor:
    mgr = SwapManager()
    mgr.set_current_group_name(group)
    try:
        return net(_input())
    finally:
        mgr.set_current_group_name(None)


class Checks:
    """What a schedule did wrong, as readable problems (none: it was right)."""

    def __init__(self) -> None:
        self.copy_streams: List[torch.cuda.Stream] = []  # the current stream of every copy issued
        self.problems: List[str] = []

    def grads(self, net: nn.Module) -> None:
        torch.cuda.synchronize()  # (the values were computed already; nothing is left in flight)
        got, ref = _grads(net), _reference()
        if got.keys() != ref.keys():
            self.problems.append(f"gradients of {sorted(ref.keys() - got.keys())} missing")
        for k in sorted(ref.keys() & got.keys()):
            if not torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-6):  # (NaN is never close)
                self.problems.append(f"gradient {k} differs: max abs diff {(got[k] - ref[k]).abs().max().item()}")

    def copies(self) -> None:
        compute = torch.cuda.current_stream()
        if not self.copy_streams:
            self.problems.append("no copy was issued")
        on_compute = sum(1 for s in self.copy_streams if s == compute)
        if on_compute:
            self.problems.append(f"{on_compute} of {len(self.copy_streams)} copies ran on the compute stream")

    def host_pool_idle(self) -> None:
        gc.collect()
        in_use = SwapManager().stats()["host_pool"]["in_use_bytes"]
        if in_use:
            self.problems.append(f"{in_use} host bytes still in use")


@pytest.fixture
def checks(monkeypatch) -> Checks:
    """Every copy the engine issues is delayed on the stream it runs on and recorded, and every
    reload destination starts as NaN (filled on the compute stream that allocates it)."""
    found = Checks()
    copy_bytes, empty_device_bytes = TorchBackend.copy_bytes, TorchBackend.empty_device_bytes

    def delayed_copy(self, dst, src, dst_offset=0):
        found.copy_streams.append(torch.cuda.current_stream())
        _shim.cuda_sleep(DELAY_CYCLES)
        copy_bytes(self, dst, src, dst_offset)

    def nan_destination(self, nbytes, like):
        out = empty_device_bytes(self, nbytes, like)
        out.fill_(0xFF)  # NaN in every float dtype
        return out

    monkeypatch.setattr(TorchBackend, "copy_bytes", delayed_copy)
    monkeypatch.setattr(TorchBackend, "empty_device_bytes", nan_destination)
    yield found
    torch.cuda.synchronize()  # a mutant's copies land before the next test allocates anything


# ------------------------------------------------------------------ the schedules
def layer_chain(found: Checks) -> None:
    """One training step with the layer chain's offload/prefetch (set_forward_prefetch_layer)."""
    net = _swapped_net()
    mgr = SwapManager()
    for first, second in zip(net.layers, net.layers[1:]):
        mgr.set_forward_prefetch_layer(first, second)
    net(_input()).backward()
    found.grads(net)
    found.copies()


def atomic(found: Checks, offload_stream=None, load_stream=None, bucket_bytes: int = 0) -> None:
    """Forward into a group; launch/wait the offload, launch/wait the load (atomic API); backward."""
    mgr = SwapManager()
    mgr.set_bucket_bytes(bucket_bytes)
    net = _swapped_net()
    loss = _forward_into(net, "g")
    mgr.launch_offload("g", offload_stream)
    mgr.wait_offload("g")
    mgr.launch_load("g", load_stream)
    mgr.wait_load("g")
    loss.backward()
    found.grads(net)
    found.copies()


def two_copy_streams(found: Checks) -> None:
    """The atomic API with the caller's copy streams: offload on one, load on another."""
    atomic(found, torch.cuda.Stream(), torch.cuda.Stream())


def buckets(found: Checks) -> None:
    """The atomic API with each layer's small storages in one host buffer, loaded with one copy."""
    atomic(found, bucket_bytes=BUCKET_BYTES)


def cancelled_offload(found: Checks) -> None:
    """The load is launched while the offload is in flight: it cancels it (the sources stay)."""
    mgr = SwapManager()
    net = _swapped_net()
    loss = _forward_into(net, "g")
    mgr.launch_offload("g")
    mgr.launch_load("g")
    mgr.wait_load("g")
    loss.backward()
    found.grads(net)
    found.copies()
    found.host_pool_idle()


def dying_graph(found: Checks) -> None:
    """The load is launched and the graph dropped before it is waited (an abandoned step): the
    destinations die while their (delayed) H2D still writes them. New tensors of their sizes are
    allocated at once on the compute stream; none may be given a block the copy still writes."""
    mgr = SwapManager()
    net = _swapped_net()
    loss = _forward_into(net, "g")
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    mgr.launch_load("g")
    blocks = {t._block.untyped_storage().nbytes() for s in mgr._group("g").storages() for t in s.swap_tensors
              if t._block is not None}
    del loss
    gc.collect()
    scribbles = [torch.full((n,), 7, dtype=torch.uint8, device="cuda") for n in sorted(blocks)
                 for _ in range(SCRIBBLES_PER_SIZE)]
    torch.cuda.synchronize()  # every delayed H2D has landed
    overwritten = sum(1 for t in scribbles if not bool((t == 7).all()))
    if overwritten:
        found.problems.append(f"{overwritten} new tensors were overwritten by the H2D of a dead destination")
    if not blocks:
        found.problems.append("no reload destination was allocated")
    found.copies()
    found.host_pool_idle()


SCHEDULES: Dict[str, Callable[[Checks], None]] = {
    "layer_chain": layer_chain, "atomic": atomic, "two_copy_streams": two_copy_streams, "buckets": buckets,
    "cancelled_offload": cancelled_offload, "dying_graph": dying_graph}


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_on_cuda(checks, name):
    SCHEDULES[name](checks)
    assert not checks.problems, checks.problems


def test_sanitizer_catches_a_missing_wait(checks, monkeypatch):
    """Run only inside the sanitizer's subprocess (below): with ``wait_event`` doing nothing, the
    D2H reads an activation no wait ordered after compute's write, and the sanitizer raises."""
    sanitizer = _shim.cuda_sanitizer()
    if sanitizer is None:
        pytest.skip("runs only under TORCH_CUDA_SANITIZER=1 (test_schedules_under_the_stream_sanitizer starts it)")
    monkeypatch.setattr(TorchBackend, "wait_event", lambda self, stream, event: None)
    with pytest.raises(sanitizer.CUDASanitizerErrors):
        atomic(checks)


def _pytest_under_the_sanitizer(*select: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider",
                           *select], cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_schedules_under_the_stream_sanitizer():
    """Every schedule but the cancelled offload under ``TORCH_CUDA_SANITIZER=1``: no unsynchronized
    access between streams; and a mutant with no waits is caught there (so the sanitizer is on).

    The cancelled offload is left out: the sanitizer counts ``Tensor.set_`` (how a saved tensor is
    rebuilt over its storage) as a write, so backward reading the kept source while the cancelled
    D2H may still read it (two reads, by design: compute does not wait a cancelled copy) would be
    reported. Its values are checked with delayed copies by ``test_schedule_on_cuda``."""
    proc = _pytest_under_the_sanitizer("-k", "test_schedule_on_cuda and not cancelled_offload")
    report = f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, report
    assert "5 passed" in proc.stdout, report
    proc = _pytest_under_the_sanitizer("-k", "test_sanitizer_catches_a_missing_wait")
    report = f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0 and "1 passed" in proc.stdout, report


# Each primitive mutated, and the schedule whose check catches it.
MUTANTS = {
    # no record_stream: a dead destination's block is handed out while its H2D still writes it
    "mark_used_by": (lambda self, t, stream: None, dying_graph),
    # no switch: the copies run on the compute stream (correct values, but no overlap at all)
    "stream_context": (lambda self, stream: contextlib.nullcontext(), atomic),
    # no events: nothing waits any copy (compute reads the NaN destinations before the H2D lands)
    "record_event": (lambda self, stream: None, atomic),
    # no waits: the same, with the events recorded
    "wait_event": (lambda self, stream, event: None, atomic),
}


@pytest.mark.parametrize("primitive", sorted(MUTANTS))
def test_mutated_primitive_is_caught(checks, monkeypatch, primitive):
    mutant, schedule = MUTANTS[primitive]
    monkeypatch.setattr(TorchBackend, primitive, mutant)
    schedule(checks)
    assert checks.problems, f"TorchBackend.{primitive} mutated, and {schedule.__name__} noticed nothing"


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices: a copy stream made on the current device instead of the "
                           "tensor's is only wrong where there is another device (the simulated device, which "
                           "replaces new_copy_stream, covers the engine's per-device choice on CPU)")
def test_copy_streams_are_made_on_the_tensors_device(checks):
    """With device 0 current, ``TorchBackend.new_copy_stream`` for device 1 makes a stream of
    device 1, and a group on device 1 copies on it: every copy runs on a device-1 copy stream and
    the gradients are exact.

    Caught mutation: ``self._dm.Stream(device=device)`` -> ``self._dm.Stream()`` (the stream of
    the current device, 0)."""
    one = torch.device("cuda", 1)
    with torch.cuda.device(0):
        assert TorchBackend().new_copy_stream(one).device == one
        plain = Net().to(one)
        plain(_input().to(one)).backward()
        expected = _grads(plain)
        mgr = SwapManager()
        net = Net().to(one)
        for i, layer in enumerate(net.layers):
            net.layers[i] = swap_wrapper(layer)
        mgr.set_current_group_name("g")
        loss = net(_input().to(one))
        mgr.set_current_group_name(None)
        mgr.launch_offload("g")
        mgr.wait_offload("g")
        mgr.launch_load("g")
        mgr.wait_load("g")
        loss.backward()
        torch.cuda.synchronize(one)
    assert checks.copy_streams and all(s.device == one for s in checks.copy_streams), \
        [s.device for s in checks.copy_streams]
    got = _grads(net)
    assert got.keys() == expected.keys()
    assert all(torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-6) for k in expected)
