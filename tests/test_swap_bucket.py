"""Bucketed copies (``core/swap_bucket.py``, opt-in with ``SwapManager().set_bucket_bytes``): the
small storages of one region's forward share a host buffer and come back with one copy, each with
its own storage and exact layout.

The integration tests run on the CPU backend and on the simulated device (``[sim]``: deferred
copies, poisoned memory, the happens-before checker), with 1 MiB buckets unless they say
otherwise; ``test_stream_mutations.py`` also runs every ordering mutation with buckets on."""

from __future__ import annotations

import weakref

import pytest
import torch

from hyper_parallel.core.activation_checkpoint import KeepReason, SwapManager, swap_wrapper
from hyper_parallel.core.swap_bucket import SLOT_ALIGN, plan_buckets
from hyper_parallel.core.swap_tensor import TensorState
from hyper_parallel.tools.memory import MemoryMeter

from support import sim_scenarios as sc
from support.swap_models import ToyNet, add_swap, assert_tensors_equal, chain, grads, make_input

pytestmark = pytest.mark.sim_device

MiB = 1 << 20


@pytest.fixture(autouse=True)
def buckets_on(fresh_manager):
    fresh_manager.set_bucket_bytes(MiB)


class _Sized:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def test_plan_packs_small_storages_into_aligned_slots_and_leaves_large_ones_alone():
    ts = [_Sized(100), _Sized(600), _Sized(512), _Sized(1), _Sized(300)]
    buckets, solos = plan_buckets(ts, 8192)  # small: at most 8192 // 16 = 512 bytes
    assert solos == [ts[1]]
    assert buckets == [([ts[0], ts[2], ts[3], ts[4]], [0, 512, 1024, 1536], 1836)]
    assert all(offset % SLOT_ALIGN == 0 for offset in buckets[0][1])


def test_plan_closes_a_bucket_at_its_cap_and_never_makes_a_bucket_of_one():
    ts = [_Sized(100) for _ in range(5)]
    buckets, solos = plan_buckets(ts, 2048)  # four slots fit (the last ends at 1636), the fifth would not
    assert buckets == [(ts[:4], [0, 512, 1024, 1536], 1636)] and solos == [ts[4]]
    assert plan_buckets(ts, 0) == ([], ts)  # bucketing off


def _saved_layout(views):
    return [(v.shape, v.stride(), v.storage_offset(), v.untyped_storage().nbytes(), v.dtype) for v in views]


def _count_copies(monkeypatch, backend):
    calls = []
    original = backend.copy_bytes

    def counting(dst, src, dst_offset=0):
        calls.append(dst_offset)
        original(dst, src, dst_offset)

    monkeypatch.setattr(backend, "copy_bytes", counting)
    return calls


def test_a_region_comes_back_with_one_copy_per_bucket_with_exact_views(monkeypatch, swap_backend):
    mgr = SwapManager()
    storage = mgr.new_storage("g")
    base = torch.randn(6, 10)
    originals = [torch.randn(3, 5), torch.randn(64), base[1:4, 2:7], base.t(), torch.arange(7),
                 torch.randn(2, 3).expand(4, 2, 3), torch.randn(8, 8) > 0]
    # detached, as the packer's aliases are (a view's _base would hold the storage a second time)
    views = [add_swap(storage, t.detach()) for t in originals]
    del base, originals  # only the swap system holds them now (else they are skipped as shared)
    values = [v.get_val().clone() for v in views]
    layout = _saved_layout([v.get_val() for v in views])
    mgr.launch_offload("g"); mgr.wait_offload("g")
    tensors = {id(v._swap_tensor): v._swap_tensor for v in views}.values()
    assert all(t.state is TensorState.HOST for t in tensors)
    buckets = {t.bucket for t in tensors}
    assert len(buckets) == 1 and None not in buckets  # 6 storages (two views share one), one bucket
    copies = _count_copies(monkeypatch, mgr.backend)
    mgr.launch_load("g"); mgr.wait_load("g")
    assert copies == [0], copies  # one host-to-device copy for the whole bucket
    back = [v.get_val() for v in views]
    assert _saved_layout(back) == layout  # shape, stride, storage offset and size, dtype
    assert all(torch.equal(b, v) for b, v in zip(back, values))
    # aliases stay aliases: the two views of `base` share one reloaded storage, others do not
    assert back[2].untyped_storage().data_ptr() == back[3].untyped_storage().data_ptr()
    assert len({b.untyped_storage().data_ptr() for b in back}) == 6
    # ... all inside one device block
    block = next(iter(tensors))._block
    lo, hi = block.data_ptr(), block.data_ptr() + block.untyped_storage().nbytes()
    assert all(lo <= b.untyped_storage().data_ptr() < hi for b in back)


def test_the_bucket_device_block_lives_as_long_as_its_last_member(swap_backend):
    mgr = SwapManager()
    storage = mgr.new_storage("g")
    views = [add_swap(storage, torch.randn(16)) for _ in range(3)]
    mgr.launch_offload("g"); mgr.wait_offload("g")
    mgr.launch_load("g"); mgr.wait_load("g")
    block = weakref.ref(views[0]._swap_tensor._block.untyped_storage())
    for i in range(3):
        views[i].get_val()  # rebuilt, then dropped at once
        views[i] = None     # autograd releases the saved tensor: its slot goes
        assert (block() is None) == (i == 2), i


def test_a_member_autograd_dropped_while_on_the_host_does_not_hold_the_block(swap_backend):
    """A saved tensor whose node died while it was offloaded (a branch that does not reach the
    loss) comes back with its bucket; it must not keep the bucket's block alive after the others."""
    mgr = SwapManager()
    storage = mgr.new_storage("g")
    views = [add_swap(storage, torch.randn(16)) for _ in range(3)]
    mgr.launch_offload("g"); mgr.wait_offload("g")
    views[0] = None  # dropped while on the host
    mgr.launch_load("g"); mgr.wait_load("g")
    block = weakref.ref(views[1]._swap_tensor._block.untyped_storage())
    views[1] = views[2] = None
    assert block() is None


def test_a_budgeted_load_takes_a_bucket_whole_or_not_at_all(swap_backend):
    mgr = SwapManager()
    storage = mgr.new_storage("g")
    views = [add_swap(storage, torch.randn(32)) for _ in range(3)]  # 128 bytes each, one bucket
    mgr.launch_offload("g"); mgr.wait_offload("g")
    tensors = [v._swap_tensor for v in views]
    mgr.launch_load("g", limit_bytes=2 * 128)  # room for two of three: the bucket does not fit
    assert [t.state for t in tensors] == [TensorState.HOST] * 3
    mgr.launch_load("g", limit_bytes=3 * 128)
    assert [t.state for t in tensors] == [TensorState.H2D] * 3
    mgr.wait_load("g")
    assert mgr.stats()["loaded_bytes"] == 3 * 128


def test_swap_wrapper_gradients_are_bitwise_with_buckets_and_without(monkeypatch, swap_backend):
    reference = sc.reference_grads()
    for bucket_bytes in (MiB, 0):
        mgr = SwapManager()
        mgr.reset()
        mgr.set_bucket_bytes(bucket_bytes)
        net = sc.swapped_net()
        mgr.set_current_group_name("g")
        loss = net(make_input(net))
        mgr.set_current_group_name(None)
        mgr.launch_offload("g"); mgr.wait_offload("g")
        stored = [t for s in mgr._group("g").storages() for t in s.swap_tensors if t.state is TensorState.HOST]
        copies = _count_copies(monkeypatch, mgr.backend)
        mgr.launch_load("g"); mgr.wait_load("g")
        monkeypatch.undo()
        loss.backward()
        assert_tensors_equal(grads(net), reference, f"bucket_bytes={bucket_bytes}")
        per_region = len(net.layers)  # the toy's storages are all small: one bucket per region
        assert len(copies) == (per_region if bucket_bytes else len(stored)), (bucket_bytes, len(copies))
        assert len(stored) > 2 * per_region


def test_layer_chain_loads_a_bucket_on_first_use_and_stays_bitwise(monkeypatch, swap_backend):
    mgr = SwapManager()
    net = ToyNet(layers=4)
    reference = ToyNet(layers=4)
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    chain(net.layers)
    x = make_input(net)
    loss = net(x)
    offloaded = mgr.stats()["offloaded_bytes"]
    on_host = sum(1 for name in mgr.group_names() for s in mgr._group(name).storages()
                  for t in s.swap_tensors if t.state is TensorState.HOST)
    copies = _count_copies(monkeypatch, mgr.backend)
    loss.backward()
    reference(x).backward()
    assert_tensors_equal(grads(net), grads(reference), "chained, bucketed")
    s = mgr.stats()
    assert 0 < s["loaded_bytes"] <= offloaded
    # a bucket per layer, plus the layer inputs (offloaded alone, one launch later)
    assert 0 < len(copies) <= 2 * (len(net.layers) - 1) < on_host, (len(copies), on_host)
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0


@pytest.mark.sim_only
def test_a_failed_copy_inside_a_bucket_returns_the_unused_shares(sim):
    mgr = SwapManager()
    net = sc.swapped_net()
    mgr.set_current_group_name("g")
    loss = net(make_input(net))
    mgr.set_current_group_name(None)
    count = [0]

    def fail_second(*args):
        count[0] += 1
        if count[0] == 2:
            raise RuntimeError("injected copy failure")

    sim.before_call["copy_bytes"] = fail_second
    with pytest.raises(RuntimeError, match="injected"):
        mgr.launch_offload("g")
    del sim.before_call["copy_bytes"]
    tensors = [t for s in mgr._group("g").storages() for t in s.swap_tensors]
    in_flight = [t for t in tensors if t.state is TensorState.D2H]
    assert len(in_flight) == 1 and in_flight[0].bucket is not None
    # the started member still holds the bucket's buffer; the failed and unstarted ones gave theirs up
    assert mgr.stats()["host_pool"]["in_use_bytes"] == in_flight[0].bucket.nbytes
    mgr.wait_offload("g")
    mgr.launch_offload("g"); mgr.wait_offload("g")  # the rest go now
    mgr.launch_load("g"); mgr.wait_load("g")
    loss.backward()
    assert_tensors_equal(grads(net), sc.reference_grads(), "grads")
    assert mgr.stats()["host_pool"]["in_use_bytes"] == 0


def test_set_bucket_bytes_checks_its_argument_and_reset_turns_it_off(swap_backend):
    mgr = SwapManager()
    mgr.reset()
    assert mgr.bucket_bytes() == 0  # opt-in
    for bad in (1.5, "1MB", True, None):
        with pytest.raises(TypeError, match="number of bytes"):
            mgr.set_bucket_bytes(bad)
    for bad in (-1, 1, 2 * SLOT_ALIGN - 1):  # a bucket of fewer than two slots would never form
        with pytest.raises(ValueError, match="at least two slots"):
            mgr.set_bucket_bytes(bad)
    mgr.set_bucket_bytes(2 * SLOT_ALIGN)
    assert mgr.bucket_bytes() == 2 * SLOT_ALIGN
    mgr.set_bucket_bytes(0)
    storage = mgr.new_storage("g")
    views = [add_swap(storage, torch.randn(8)) for _ in range(3)]
    mgr.launch_offload("g"); mgr.wait_offload("g")
    assert all(v._swap_tensor.bucket is None for v in views)
    mgr.set_bucket_bytes(MiB)
    mgr.reset()
    assert mgr.bucket_bytes() == 0


@pytest.mark.no_sim("the CPU memory meter counts real CPU storages")
def test_the_cpu_memory_meter_counts_a_bucket_block_once_not_once_more_per_slot():
    backend = SwapManager().backend
    with MemoryMeter("cpu") as meter:
        block = torch.empty(4096, dtype=torch.uint8)
        before = meter.current_bytes
        slots = [backend.slot_bytes(block, 512 * i, 256) for i in range(4)]
        views = [torch.empty(0).set_(s, 0, (64,), (1,)) for s in slots]
        assert meter.current_bytes == before
        assert all(v.untyped_storage().nbytes() == 256 for v in views)


def test_an_empty_storage_among_small_ones_round_trips(swap_backend):
    """A zero-byte storage saved among small ones stays on the device as it is (``empty``; the
    simulated device once failed on its copy), its bucket's siblings go and come back."""
    mgr = SwapManager()
    storage = mgr.new_storage("g")
    originals = [torch.empty(0), torch.randn(4), torch.randn(4)]
    views = [storage.add(mgr.backend.saved_facts(t.clone(), ())) for t in originals]
    assert mgr.stats()["kept_bytes"] == {KeepReason.EMPTY: 0}
    mgr.launch_offload("g"); mgr.wait_offload("g")
    mgr.launch_load("g"); mgr.wait_load("g")
    assert all(torch.equal(v.get_val(), t) for v, t in zip(views, originals))


@pytest.mark.no_sim("a Hugging Face model on the CPU backend")
def test_a_hugging_face_decoder_with_buckets_and_gradient_accumulation_is_bitwise(monkeypatch):
    """As a user would: a Llama decoder from a small config (nothing downloaded), every layer
    swap_wrapper'ed and chained, two micro-batches accumulated; buckets on. Gradients equal the
    plain model's bit for bit, and fewer host-to-device copies come back than without buckets
    (one per storage, or per bucket of small ones; the load launches are one per layer either
    way)."""
    pytest.importorskip("transformers", reason="transformers is an optional extra: pip install -e '.[hf]'")
    from hyper_parallel.core.activation_checkpoint import wrap_layers
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             attn_implementation="sdpa", use_cache=False)
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    def accumulate(model):
        for mb in range(2):
            tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(mb))
            model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def swapped(bucket_bytes):
        SwapManager().reset()
        SwapManager().set_bucket_bytes(bucket_bytes)
        backend = SwapManager().backend
        copy_bytes = type(backend).copy_bytes
        h2d = []

        def counted(self, dst, src, dst_offset=0):  # a load's copy reads a pooled host buffer
            if any(src.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                   for b in SwapManager()._pool.buffers()):
                h2d.append(src.untyped_storage().nbytes())
            return copy_bytes(self, dst, src, dst_offset)

        monkeypatch.setattr(type(backend), "copy_bytes", counted)
        model = build()
        wrap_layers(model.model.layers, swap=True)
        grads_ = accumulate(model)
        monkeypatch.setattr(type(backend), "copy_bytes", copy_bytes)
        return grads_, SwapManager().stats(), h2d

    reference = accumulate(build())
    (got, s, copies), (_, unbucketed, copies_unbucketed) = swapped(MiB), swapped(0)
    assert_tensors_equal(got, reference, "llama, swap_wrapper, buckets, 2 micro-batches")
    assert s["loaded_bytes"] == unbucketed["loaded_bytes"] > 0 and s["host_pool"]["in_use_bytes"] == 0
    assert s["load_launches"] == unbucketed["load_launches"] > 0
    assert 0 < len(copies) < len(copies_unbucketed), (len(copies), len(copies_unbucketed))
