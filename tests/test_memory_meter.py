"""Tests for the memory meter (hyper_parallel.tools.memory), CPU path plus a faked allocator."""

from __future__ import annotations

import doctest
import gc
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import hyper_parallel.tools.memory as memory_impl

memory_public = memory_impl
from hyper_parallel.tools.memory import MemoryMeter, is_host_storage, mark_host

MiB = 1 << 20
FLOAT_MIB = MiB // 4  # number of float32 elements in 1 MiB


class Block(nn.Module):
    """Transformer-ish MLP block: pre-LayerNorm, Linear, GELU, dropout, Linear, residual."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


def make_model(dim: int = 256, hidden: int = 1024, depth: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, dim),
        *[Block(dim, hidden) for _ in range(depth)],
        nn.LayerNorm(dim),
        nn.Linear(dim, 10),
    )


def tensor_bytes(*objs: object) -> int:
    """Bytes of the distinct storages of the given modules' parameters / tensors."""
    seen: dict[int, int] = {}
    for obj in objs:
        tensors = obj.parameters() if isinstance(obj, nn.Module) else [obj]
        for t in tensors:
            st = t.untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


# 1. agreement with torch's MemTracker ------------------------------------------------


def test_training_peak_matches_memtracker() -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(128, 64)
    y = torch.randint(0, 10, (128,))

    # MemTracker only knows what is handed to track_external or created inside it; it
    # counts storage size * element_size (1 for untyped storages) and rounds only on
    # cuda, so on CPU its bytes are exact nbytes() -- the same unit as ours.
    tracker = MemTracker()
    tracker.track_external(model, opt, x, y)
    gc.collect()  # leftovers from earlier tests would only inflate our gc-scan baseline

    # All three run over the *same* op stream. Our meters are entered first (outermost),
    # as their docs recommend; MemTracker is one more dispatch mode on top of them.
    with MemoryMeter("cpu", track=[model, opt]) as meter:  # default: + gc scan
        with MemoryMeter("cpu", track=[model, opt, x, y], scan_gc=False) as strict:
            with tracker:
                for _ in range(2):
                    loss = nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    # MemTracker refuses a second root forward without this.
                    tracker.reset_mod_stats()
                del loss

    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    print(
        f"\nMemTracker peak: {theirs} B; MemoryMeter peak: {meter.peak_bytes} B "
        f"(track-only meter: {strict.peak_bytes} B, gc-scan baseline {meter.baseline_bytes} B)"
    )
    # The strict meter starts from exactly MemTracker's tracked set.
    assert strict.baseline_bytes == tensor_bytes(model, x, y)
    assert abs(strict.peak_bytes - theirs) <= 0.01 * theirs
    # The default meter also counts whatever else is alive in the process.
    assert meter.baseline_bytes >= strict.baseline_bytes
    assert abs(meter.peak_bytes - theirs) <= 0.05 * theirs
    # Sanity: the peak holds at least params + grads + Adam's two moments.
    assert theirs >= 4 * tensor_bytes(model)


# 2. known allocations, views, baseline ----------------------------------------------


def test_known_allocation_and_views() -> None:
    with MemoryMeter("cpu") as m:
        start = m.current_bytes
        assert start == m.baseline_bytes == m.peak_bytes
        x = torch.empty(FLOAT_MIB * 4)  # 4 MiB
        assert m.current_bytes - start == 4 * MiB
        views = [x.view(2, -1), x[1:], x.unsqueeze(0)]
        assert m.current_bytes - start == 4 * MiB  # views share the storage
        del x, views
        assert m.current_bytes == start  # the storage died: its bytes are gone
        y = torch.empty(FLOAT_MIB)  # 1 MiB, after the 4 MiB was freed
        assert m.peak_above_baseline >= 4 * MiB
        assert m.peak_above_baseline < 5 * MiB  # 4 and 1 were never alive together
        del y
    assert m.peak_above_baseline >= 4 * MiB
    assert m.current_bytes == m.baseline_bytes


def test_baseline_counts_existing_tensors() -> None:
    existing = torch.empty(FLOAT_MIB * 2)
    with MemoryMeter("cpu", scan_gc=False) as lean:
        pass
    with MemoryMeter("cpu") as full:
        pass
    with MemoryMeter("cpu", track=[existing], scan_gc=False) as tracked:
        pass
    assert full.baseline_bytes >= 2 * MiB
    assert lean.baseline_bytes == 0
    assert tracked.baseline_bytes == 2 * MiB
    del existing


def test_storage_resize_is_tracked() -> None:
    original = torch.UntypedStorage.resize_
    with MemoryMeter("cpu") as m:
        x = torch.empty(FLOAT_MIB * 4)
        x.untyped_storage().resize_(0)  # free in place, as offloading code does
        assert m.current_bytes == m.baseline_bytes
        x.untyped_storage().resize_(MiB)  # and bring 1 MiB back
        assert m.current_bytes == m.baseline_bytes + MiB
        del x
    assert m.peak_above_baseline == 4 * MiB
    assert torch.UntypedStorage.resize_ is original  # the hook is gone again


# 3. host buffers -----------------------------------------------------------------------


def test_mark_host() -> None:
    host = torch.empty(FLOAT_MIB * 4)
    mark_host(host)
    assert is_host_storage(host) and is_host_storage(host[5:])
    assert is_host_storage(host.untyped_storage())
    assert not is_host_storage(torch.empty(3))

    # Marked before the region: not in the baseline, and ops touching it add nothing.
    with MemoryMeter("cpu") as m:
        host.add_(1.0)
        host.view(2, -1).mul_(2.0)
        act = torch.empty(FLOAT_MIB)  # 1 MiB of real "device" memory
    assert m.peak_above_baseline == MiB
    with MemoryMeter("cpu", track=[host], scan_gc=False) as m2:
        pass
    assert m2.baseline_bytes == 0

    # Marked after registration: its bytes leave the current count of running meters;
    # marked right after allocation, it does not reach the peak either.
    with MemoryMeter("cpu") as m:
        buf = torch.empty(FLOAT_MIB * 4)
        assert m.current_bytes - m.baseline_bytes == 4 * MiB
        mark_host(buf)
        assert m.current_bytes == m.baseline_bytes
        buf.copy_(torch.ones(FLOAT_MIB * 4))  # the 4 MiB source is real memory
    assert m.peak_above_baseline == 4 * MiB  # the source only, not source + buffer
    del host, act, buf


# 4. backward is counted ----------------------------------------------------------------


def test_backward_is_counted() -> None:
    model = make_model(depth=3)
    x = torch.randn(256, 64)
    params = tensor_bytes(model)

    with MemoryMeter("cpu", track=[model]) as fwd:
        with torch.no_grad():
            model(x)
    with MemoryMeter("cpu", track=[model]) as fwd_bwd:
        model(x).sum().backward()
        # every parameter now has a .grad that was produced inside backward
        assert fwd_bwd.current_bytes - fwd_bwd.baseline_bytes >= params
    print(f"\nforward/no_grad peak {fwd.peak_bytes} B, forward+backward peak {fwd_bwd.peak_bytes} B")
    assert fwd_bwd.peak_bytes > fwd.peak_bytes
    assert fwd_bwd.peak_above_baseline >= params + fwd.peak_above_baseline
    model.zero_grad(set_to_none=True)


def test_checkpoint_recompute_in_backward_is_seen() -> None:
    # Non-reentrant checkpointing frees block activations in forward and recomputes them
    # in backward; the meter must see both the saving and the recomputation.
    model = make_model(dim=128, hidden=1024, depth=4)
    x = torch.randn(256, 64)

    def run(use_ckpt: bool) -> MemoryMeter:
        with MemoryMeter("cpu", track=[model]) as m:
            h = model[0](x)
            for blk in model[1:-2]:
                h = checkpoint(blk, h, use_reentrant=False) if use_ckpt else blk(h)
            model[-1](model[-2](h)).sum().backward()
            del h
        model.zero_grad(set_to_none=True)
        return m

    plain, ckpt = run(False), run(True)
    one_hidden = 256 * 1024 * 4  # a single block's widest activation
    print(f"\nno checkpoint peak {plain.peak_bytes} B, checkpointed peak {ckpt.peak_bytes} B")
    assert ckpt.peak_bytes < plain.peak_bytes
    assert ckpt.peak_above_baseline > one_hidden  # the recomputed block is counted


# nesting and other dispatch modes -------------------------------------------------------


def test_nested_meters() -> None:
    with MemoryMeter("cpu") as outer:
        a = torch.empty(FLOAT_MIB * 2)
        with MemoryMeter("cpu") as inner:
            b = torch.empty(FLOAT_MIB)
            del b
        del a
    assert inner.peak_above_baseline == MiB
    assert inner.baseline_bytes >= outer.baseline_bytes + 2 * MiB
    assert outer.peak_above_baseline == 3 * MiB
    assert outer.current_bytes == outer.baseline_bytes


class _StashingMode(TorchDispatchMode):
    """A stand-in for the library's own modes: allocates a buffer inside its handler."""

    def __init__(self) -> None:
        super().__init__()
        self.stash: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not self.stash:
            self.stash.append(torch.zeros(FLOAT_MIB * 2))
        return out


def test_alongside_other_dispatch_modes() -> None:
    with MemoryMeter("cpu") as m:
        with _StashingMode() as mode:
            y = torch.ones(FLOAT_MIB)  # 1 MiB output + 2 MiB stashed by the mode
        assert m.current_bytes - m.baseline_bytes == 3 * MiB
        del y, mode
    assert m.peak_above_baseline == 3 * MiB
    assert m.current_bytes == m.baseline_bytes


def test_reuse_and_reentry() -> None:
    m = MemoryMeter("cpu", scan_gc=False)
    assert m.peak_bytes == m.baseline_bytes == m.current_bytes == 0
    with m:
        with pytest.raises(RuntimeError):
            m.__enter__()
        x = torch.empty(FLOAT_MIB)
    first = m.peak_above_baseline
    with m:
        pass
    assert first == MiB and m.peak_above_baseline == 0
    del x


def test_exception_leaves_no_trace() -> None:
    original = torch.UntypedStorage.resize_
    with pytest.raises(ValueError):
        with MemoryMeter("cpu") as m:
            x = torch.empty(FLOAT_MIB)
            raise ValueError("boom")
    assert m.peak_above_baseline == MiB
    assert torch.UntypedStorage.resize_ is original
    assert not memory_impl._ACTIVE_CPU_TRACKERS
    frozen = m.current_bytes
    del x  # after exit nothing is tracked any more: the frozen values stay
    assert m.current_bytes == frozen


def test_default_device() -> None:
    expected = "cpu"
    if torch.accelerator.is_available():
        expected = torch.accelerator.current_accelerator().type
    assert MemoryMeter().device.type == expected
    assert MemoryMeter("cpu").is_cpu


# accelerator path, against a fake allocator ---------------------------------------------


class _FakeAllocator:
    """Just enough of a device module: allocated bytes and a resettable peak."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.syncs = 0, 0, 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def memory_allocated(self, index: int) -> int:
        return self.allocated

    def max_memory_allocated(self, index: int) -> int:
        return self.peak

    def reset_peak_memory_stats(self, index: int) -> None:
        self.peak = self.allocated

    def synchronize(self, index: int) -> None:
        self.syncs += 1

    def current_device(self) -> int:
        return 0


def test_accelerator_path_with_fake_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeAllocator()
    # No real accelerator here, so the meter falls back to the device module.
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: fake)
    monkeypatch.setattr(
        torch,
        "accelerator",
        SimpleNamespace(current_accelerator=lambda: None, is_available=lambda: False),
    )
    fake.alloc(100)
    with MemoryMeter("cuda:0") as outer:
        fake.alloc(50)
        fake.alloc(-50)
        with MemoryMeter("cuda:0") as inner:  # resets the allocator's peak counter
            fake.alloc(20)
            assert inner.current_bytes == 120
            fake.alloc(-20)
        assert outer.peak_bytes == 150  # not lost to the inner reset
    assert (outer.baseline_bytes, outer.peak_bytes, outer.current_bytes) == (100, 150, 100)
    assert (inner.baseline_bytes, inner.peak_bytes, inner.peak_above_baseline) == (100, 120, 20)
    assert fake.syncs == 4  # enter and exit of both meters


# docs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [memory_public, memory_impl], ids=lambda m: m.__name__)
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_public_surface() -> None:
    assert set(memory_public.__all__) == {"MemoryMeter", "mark_host", "host_allocation", "is_host_storage"}
    for name in memory_public.__all__:
        assert getattr(memory_public, name).__doc__
