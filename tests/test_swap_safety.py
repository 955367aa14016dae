"""Safety of the swap engine: what must never be offloaded,
aliases coming back as aliases, in-place changes and illegal reads being errors."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy, SwapManager, checkpoint_wrapper, swap_wrapper)

from support.swap_models import (ToyBlock, ToyNet, assert_tensors_equal, chain, grads, group, make_input,
                         round_trip, saved_tensor_nodes)

# Every test also runs on the simulated asynchronous device, stream-ordering checker on ([sim]).
pytestmark = pytest.mark.sim_device




# ------------------------------------------------------------------------------ parameters
def test_parameters_buffers_and_their_views_are_never_offloaded():
    torch.manual_seed(0)
    plain = ToyBlock(16, 32)
    block = ToyBlock(16, 32)
    block.load_state_dict(plain.state_dict())
    x0 = torch.randn(4, 8, 16)
    x = x0.clone().requires_grad_()
    plain(x, mask=None).square().mean().backward()

    block = swap_wrapper(block)
    owned = list(block.named_parameters()) + list(block.named_buffers())
    before = {n: (t.data_ptr(), t.detach().clone()) for n, t in owned}
    param_ptrs = {t.untyped_storage().data_ptr() for _, t in owned}
    x = x0.clone().requires_grad_()
    with group("g"):
        loss = block(x).square().mean()
    saved = _saved_tensors(loss)
    on_params = [i for i, (_, t) in enumerate(saved) if t.untyped_storage().data_ptr() in param_ptrs]
    # F.linear saves weight.t() (a view of a parameter); the multiply saves the `scale` buffer.
    assert len(on_params) >= 3, [n for n, _ in saved]
    del saved
    round_trip("g")
    s = SwapManager().stats()
    assert s["kept_bytes"]["parameter"] >= block.fc1.weight.nbytes + block.fc2.weight.nbytes + block.scale.nbytes
    assert s["offloaded_bytes"] > 0
    saved = _saved_tensors(loss)
    for i in on_params:  # still the parameters themselves, not reloaded copies
        assert saved[i][1].untyped_storage().data_ptr() in param_ptrs, saved[i][0]
    del saved
    loss.backward()
    for n, t in owned:
        assert t.data_ptr() == before[n][0] and torch.equal(t.detach(), before[n][1]), n
    assert_tensors_equal(grads(block), grads(plain), "block")


class _Growing(nn.Module):
    """A block whose forward also runs ``self.extra`` once it has one (added after wrapping), or an
    ``outside`` layer that is a plain attribute, not a sub-module."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).relu()
        extra = self._modules.get("extra") or self.__dict__.get("outside")
        return extra(h) if extra is not None else h


def _frozen_linear(seed):
    lin = nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)))
    lin.weight.requires_grad_(False)  # frozen: only the module tells it from an activation
    return lin


def _kept_after_one_step(block, x0):
    SwapManager().reset()
    with group("g"):
        loss = block(x0.clone().requires_grad_()).square().sum()
    round_trip("g")
    loss.backward()
    return SwapManager().stats()["kept_bytes"]


@pytest.mark.parametrize("change", ["new submodule", "replaced submodule", "direct _parameters write",
                                    "del submodule"])
def test_owner_parameters_follow_changes_of_the_module_after_wrapping(change):
    """The region knows its owner's parameter and buffer storages on every call, also after the
    module changed (whatever the engine may remember of it between calls): the frozen weight of a
    sub-module added or replaced after the first call is kept as the owner's ('buffer', as frozen
    parameters are counted), not taken for an activation that somebody else holds ('shared'); an
    FSDP2-style write into ``_parameters`` is seen; a deleted sub-module's weight is the owner's no
    more."""
    torch.manual_seed(0)
    block = swap_wrapper(_Growing())
    x0 = torch.randn(4, 8)
    _kept_after_one_step(block, x0)  # a first call, whatever it may leave remembered
    block.extra = extra = _frozen_linear(1)
    weight = extra.weight
    if change != "new submodule":
        _kept_after_one_step(block, x0)  # a call with extra in the module
    if change == "replaced submodule":  # the same number of children (a count of them would not tell)
        old = extra  # still alive (nor would a weak reference to it)
        block.extra = extra = _frozen_linear(2)
        weight = extra.weight
        assert old.weight is not weight
    elif change == "direct _parameters write":
        weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)
        extra._parameters["weight"] = weight  # no PyTorch registration hook fires
    elif change == "del submodule":
        del block.extra  # no PyTorch registration hook fires either
        object.__setattr__(block, "outside", extra)  # still run, but as a plain attribute
    kept = _kept_after_one_step(block, x0)
    if change == "del submodule":
        # the saved view of extra's weight is held by extra, which is not the owner's any more
        assert kept.get("shared", 0) >= weight.nbytes and kept.get("buffer", 0) == 0, kept
    else:
        assert kept.get("buffer", 0) >= weight.nbytes and kept.get("shared", 0) == 0, kept


def test_explicit_parameter_view_and_frozen_weight_in_a_function_region():
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8, generator=gen))
    frozen = torch.randn(8, 8, generator=gen)  # requires_grad=False, held by the caller
    x0 = torch.randn(4, 8, generator=gen)

    def f(x):
        return torch.tanh(x @ w.t()) @ frozen.t()  # saves w.t() and frozen.t()

    x = x0.clone().requires_grad_()
    f(x).sum().backward()
    ref = (x.grad.clone(), w.grad.clone())
    w.grad = None
    x = x0.clone().requires_grad_()
    with group("g"):
        out = swap_wrapper(f)(x).sum()
    round_trip("g")
    s = SwapManager().stats()["groups"]["g"]
    assert s["kept_bytes"]["parameter"] >= w.nbytes  # w.t(): a view of a leaf that requires grad
    assert s["kept_bytes"]["shared"] >= frozen.nbytes  # frozen.t(): its storage is held by `frozen`
    assert s["offloaded_bytes"] > 0  # tanh's output and the matmul input
    out.backward()
    assert torch.equal(x.grad, ref[0]) and torch.equal(w.grad, ref[1])


def test_tied_embedding_and_head_weights():
    bench_model = pytest.importorskip("hyper_parallel.bench.model")
    cfg = bench_model.GPTConfig(vocab=64, dim=16, heads=2, layers=2, seq=16, dropout=0.1)
    tokens, targets = bench_model.make_batch(cfg, 2, seed=0)
    plain = bench_model.GPT(cfg, seed=0)
    torch.manual_seed(0)
    plain(tokens, targets).backward()

    model = swap_wrapper(bench_model.GPT(cfg, seed=0))
    assert model.head.weight is model.tok_emb.weight
    ptr = model.tok_emb.weight.data_ptr()
    torch.manual_seed(0)
    with group("g"):
        loss = model(tokens, targets)
    round_trip("g")
    s = SwapManager().stats()["groups"]["g"]
    assert s["offloaded_bytes"] > 0
    assert s["kept_bytes"]["parameter"] >= model.tok_emb.weight.nbytes
    head_saved = [t for name, t in _saved_tensors(loss) if t.untyped_storage().data_ptr() == ptr]
    assert head_saved, "the tied weight (head.weight.t()) is saved as the original, never a copy"
    del head_saved
    loss.backward()
    assert model.head.weight is model.tok_emb.weight and model.tok_emb.weight.data_ptr() == ptr
    assert_tensors_equal(grads(model), grads(plain), "tied GPT")


# ------------------------------------------------------------------------------ shared tensors
def test_mask_shared_by_all_layers_is_kept_and_intact():
    base = ToyNet(dropout=0.1)
    net = ToyNet(dropout=0.1)
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
    chain(net.layers)
    mask_before = net.mask.clone()
    mask_ptr = net.mask.data_ptr()
    for step in range(2):
        x = make_input(net, seed=step)
        for model in (base, net):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            loss = model(x)
            if model is net:
                # Layers 0..2 were offloaded; the masked_fill of every layer still reads the mask
                # itself (reading an offloaded tensor here would raise).
                masks = [node._saved_mask for node in saved_tensor_nodes(loss)
                         if type(node).__name__.startswith("MaskedFill")]
                assert len(masks) == len(net.layers)
                assert all(m.data_ptr() == mask_ptr for m in masks)
                del masks
            loss.backward()
        assert_tensors_equal(grads(net), grads(base), f"step {step}")
        assert net.mask.data_ptr() == mask_ptr and torch.equal(net.mask, mask_before)
    s = SwapManager().stats()
    assert s["kept_bytes"]["shared"] >= 2 * (len(net.layers) - 1) * net.mask.nbytes
    assert s["offloaded_bytes"] > 0


def test_layer_output_consumed_by_next_layer_is_kept():
    """With a final relu, each layer saves its own output, which the next layer consumes: at the
    layer's offload the caller still holds it, so it must stay on the device (kept 'shared')."""
    base = ToyNet(final_relu=True)
    net = ToyNet(final_relu=True)
    outputs = {}
    for i, layer in enumerate(net.layers):
        net.layers[i] = swap_wrapper(layer)
        layer.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o))
    chain(net.layers)
    x = make_input(net)
    base(x).backward()
    loss = net(x)
    s = SwapManager().stats()["groups"]
    for i in range(len(net.layers) - 1):
        assert s[f"layer_{i}"]["offloaded_bytes"] > 0, i
        assert s[f"layer_{i}"]["kept_bytes"]["shared"] >= outputs[i].nbytes, i
        node = outputs[i].grad_fn
        assert type(node).__name__ == "ReluBackward0"
        # readable while the layer's group is offloaded: it stayed on the device, as itself
        assert node._saved_result.data_ptr() == outputs[i].data_ptr(), i
    outputs.clear()
    loss.backward()
    assert_tensors_equal(grads(net), grads(base), "relu outputs")


# ------------------------------------------------------------------------------ aliases
def _saved_tensors(out: torch.Tensor) -> list:
    """(node name, attribute, tensor) of every saved tensor reachable from ``out`` (reading one
    goes through the unpack hook)."""
    found = []
    for node in saved_tensor_nodes(out):
        for attr in dir(node):
            if attr.startswith("_saved_"):
                val = getattr(node, attr)
                vals = val if isinstance(val, (tuple, list)) else (val,)
                for j, v in enumerate(vals):
                    if isinstance(v, torch.Tensor):
                        found.append((f"{type(node).__name__}.{attr}[{j}]", v))
    return found


def _describe(saved: list) -> tuple:
    metas = [(name, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) for name, t in saved]
    values = [t.detach().clone() for _, t in saved]
    ptrs = [t.untyped_storage().data_ptr() for _, t in saved]
    partition = sorted(sorted(i for i, p in enumerate(ptrs) if p == q) for q in set(ptrs))
    return metas, values, partition


def _check_round_trip(fn, inputs, params, min_offloaded):
    """Run ``fn`` plain and swap-wrapped (manual group, offload + load), then compare: every
    saved tensor's layout and value, which saved tensors share a storage, and the gradients."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    fn(*leaves).backward()
    ref = [t.grad.clone() for t in leaves] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    leaves = [t.clone().requires_grad_() for t in inputs]
    with group("g"):
        out = swap_wrapper(fn)(*leaves)
    metas, values, partition = _describe(_saved_tensors(out))  # the references die here
    round_trip("g")
    s = SwapManager().stats()["groups"]["g"]
    assert s["loaded_bytes"] == s["offloaded_bytes"] >= min_offloaded, s
    saved = _saved_tensors(out)
    metas2, values2, partition2 = _describe(saved)
    assert metas2 == metas
    assert partition2 == partition, "aliases must come back as aliases of one storage"
    for (name, _), a, b in zip(saved, values, values2):
        assert torch.equal(a, b), name
    del saved
    out.backward()
    got = [t.grad for t in leaves] + [p.grad for p in params]
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    return metas2, partition2


def test_qkv_split_views_reload_as_aliases():
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 5, 12, generator=gen)
    w = nn.Parameter(torch.randn(36, 12, generator=gen))

    def attn_like(x):
        qkv = x @ w.t()  # (2, 5, 36): one storage
        q, k, v = qkv.split(12, dim=-1)
        return ((q * k).sum(-1, keepdim=True) * v.sin()).sum()  # saves q, k (mul) and v (sin)

    metas, partition = _check_round_trip(attn_like, [x0], [w], min_offloaded=2 * 5 * 36 * 4)
    split_views = [i for i, m in enumerate(metas) if m[1] == (2, 5, 12) and m[2] == (180, 36, 1)]
    assert sorted(metas[i][3] for i in split_views) == [0, 12, 24], metas
    assert any(set(split_views) <= set(block) for block in partition), "q, k, v share one storage"


@pytest.mark.no_sim("reads autograd's saved wrapped scalars, which PyTorch cannot detach under any dispatch mode")
def test_expanded_transposed_and_dtype_views_of_one_storage():
    gen = torch.Generator().manual_seed(1)
    w_bf16 = nn.Parameter(torch.randn(8, 8, generator=gen).bfloat16())
    w2 = nn.Parameter(torch.randn(4, 8, generator=gen))
    # bf16-representable float32 values: reading their bytes as bf16 gives finite numbers.
    x0 = torch.randn(4, 8, generator=gen).bfloat16().float()

    def f(x):
        a = x * 2.0                               # (4, 8) float32: the one swapped storage
        s = a.sin()                               # saves a
        b = a.detach().view(torch.bfloat16)       # (4, 16) bfloat16 view of a's bytes
        c = b[:, 1::2] @ w_bf16                   # saves a strided bf16 view (for w_bf16's grad)
        e = a[:, :1].expand(4, 8)                 # stride-0 view
        d = e * w2                                # saves e (for w2's grad)
        m = a.t() @ w2                            # saves a.t() (for w2's grad)
        return s.sum() + c.float().sum() + d.sum() + m.sum()

    metas, partition = _check_round_trip(f, [x0], [w_bf16, w2], min_offloaded=4 * 8 * 4)
    def find(pred, what):
        hits = [i for i, m in enumerate(metas) if pred(m)]
        assert hits, f"no saved {what} in {metas}"
        return hits

    views = (find(lambda m: m[4] == torch.bfloat16 and m[1] == (4, 8) and m[2] == (16, 2), "bf16 view")
             + find(lambda m: m[1] == (8, 4) and m[2] == (1, 8), "transpose")
             + find(lambda m: m[1] == (4, 8) and 0 in m[2], "stride-0 expand")
             + find(lambda m: m[0].startswith("SinBackward") and m[2] == (8, 1), "base"))
    assert any(set(views) <= set(block) for block in partition), (metas, partition)


# ------------------------------------------------------------------------------ in-place changes
def _inplace_region(kind: str):
    """A region whose saved tensor `y` is also returned to the caller (who may modify it)."""
    held = {}

    def body(x):
        y = torch.tanh(x * 3.0)  # tanh saves its output y
        held["y"] = y
        return y.sum() + 0.0

    if kind == "swap_wrapper":
        return swap_wrapper(body), held

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SWAP if op == torch.ops.aten.tanh.default else CheckpointPolicy.MUST_RECOMPUTE

    return checkpoint_wrapper(body, policy_fn=policy), held


@pytest.mark.parametrize("kind", ["swap_wrapper", "checkpoint_must_swap"])
@pytest.mark.parametrize("when", ["before_offload", "after_round_trip_kept", "never_offloaded"])
def test_inplace_change_of_saved_tensor_is_an_error(kind, when):
    region, held = _inplace_region(kind)
    x = torch.randn(4, 4, requires_grad=True)
    with group("g"):
        out = region(x)
    y = held.pop("y")
    if when == "before_offload":
        with torch.no_grad():
            y.mul_(2)
        del y  # nobody else holds it now: the offload must notice the change, not copy it
        round_trip("g")
        if kind == "swap_wrapper":
            assert SwapManager().stats()["kept_bytes"].get("modified_in_place", 0) > 0
    elif when == "after_round_trip_kept":
        round_trip("g")  # `y` is held here: kept on the device ('shared')
        assert SwapManager().stats()["kept_bytes"].get("shared", 0) > 0
        with torch.no_grad():
            y.add_(1)
    else:
        with torch.no_grad():
            y.zero_()
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        out.backward()


# ------------------------------------------------------------------------------ illegal reads
class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return 2 * x * g


class _SquareOnFirstOp(TorchDispatchMode):
    """A user's dispatch mode that applies an autograd.Function to ``h`` when it sees its first op:
    autograd (and the region's pack hook) then runs below autograd's own dispatch keys."""

    def __init__(self, h):
        super().__init__()
        self.h, self.out = h, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.out is None:
            self.out = _Square.apply(self.h)
        return func(*args, **(kwargs or {}))


class _SquaresUnderAMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        with _SquareOnFirstOp(h) as mode:
            torch.zeros(1) + 1
        self.h = h
        return mode.out.sum()


def test_inplace_change_is_an_error_also_when_the_pack_hook_runs_below_autograd():
    """The saved ``h`` is packed from inside a dispatch mode (ADInplaceOrView excluded): its alias
    must still share ``h``'s version counter (a plain detach there would not), so that the in-place
    change after the forward is an error rather than silently wrong gradients."""
    torch.manual_seed(0)
    block = swap_wrapper(_SquaresUnderAMode())
    with group("g"):
        loss = block(torch.randn(2, 4))
    with torch.no_grad():
        block.h.mul_(3)
    del block.h
    round_trip("g")
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        loss.backward()


def test_backward_while_loading_is_an_error():
    x = torch.randn(8, 8, requires_grad=True)
    with group("mb0"):
        out = swap_wrapper(lambda t: (t * 2).sin().sum())(x)
    SwapManager().launch_offload("mb0")
    SwapManager().wait_offload("mb0")
    SwapManager().launch_load("mb0")
    with pytest.raises(RuntimeError, match=r"state 'h2d'.*wait_load\('mb0'\)"):
        out.backward(retain_graph=True)
    SwapManager().wait_load("mb0")
    out.backward()
    x2 = x.detach().clone().requires_grad_()
    (x2 * 2).sin().sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_second_backward_through_a_swap_region_is_an_error():
    x = torch.randn(8, 8, requires_grad=True)
    with group("mb0"):
        out = swap_wrapper(lambda t: (t * 2).sin().sum())(x)
    round_trip("mb0")
    out.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward()


@pytest.mark.slow
@pytest.mark.no_sim("the schedule runs in a subprocess, which does not use the simulated device")
def test_backward_after_offload_without_load_raises_in_python_not_crash():
    script = textwrap.dedent("""
        import torch
        from hyper_parallel.core.activation_checkpoint import SwapManager, swap_wrapper
        mgr = SwapManager()
        block = swap_wrapper(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                                 torch.nn.Linear(64, 64)))
        mgr.set_current_group_name("mb0")
        loss = block(torch.randn(32, 64)).square().sum()
        mgr.set_current_group_name(None)
        mgr.launch_offload("mb0")
        mgr.wait_offload("mb0")
        assert mgr.stats()["offloaded_bytes"] > 0
        loss.backward()
        print("NO ERROR")
    """)
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=root, env=env)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])  # not a signal, not 0
    assert "NO ERROR" not in proc.stdout
    assert "RuntimeError" in proc.stderr
    assert "state 'host'" in proc.stderr and "launch_load('mb0')" in proc.stderr


# ------------------------------------------------------------------------------ lazy-view bits
@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_conj_and_neg_views_keep_their_bit(bit):
    gen = torch.Generator().manual_seed(0)
    z0 = torch.randn(4, 4, dtype=torch.complex64, generator=gen)
    w0 = torch.randn(4, 4, dtype=torch.complex64, generator=gen)

    def f(z, w):
        y = (z * 2).conj() if bit == "conj" else torch._neg_view(z * 2)
        assert y.is_conj() or y.is_neg()
        return (y * w).abs().sum()  # mul saves y (for w's grad)

    z, w = z0.clone().requires_grad_(), w0.clone().requires_grad_()
    f(z, w).backward()
    expected = (z.grad.clone(), w.grad.clone())
    z, w = z0.clone().requires_grad_(), w0.clone().requires_grad_()
    with group("g"):
        out = swap_wrapper(f)(z, w)
    round_trip("g")
    assert SwapManager().stats()["offloaded_bytes"] > 0
    out.backward()
    assert torch.equal(z.grad, expected[0])
    assert torch.equal(w.grad, expected[1])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_nested_tensors_stay_on_the_device_and_gradients_are_exact(layout):
    """A nested tensor has no single shape for a byte copy to rebuild (the strided layout raised
    from the view metadata before it was refused): it is kept where it is, the rest swaps."""
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(2, 3, generator=gen), torch.randn(4, 3, generator=gen)]
    w0 = torch.randn(3, 3, generator=gen)

    def f(nt, w):
        h = (nt * 2).sin()  # sin saves its nested input
        padded = torch.nested.to_padded_tensor(h, 0.0) if layout == "strided" else h.to_padded_tensor(0.0)
        return (padded @ w).square().sum()  # mm and square save plain tensors

    def make():
        nt = torch.nested.nested_tensor([p.clone() for p in parts], layout=getattr(torch, layout),
                                        requires_grad=True)
        return nt, w0.clone().requires_grad_()

    nt, w = make()
    f(nt, w).backward()
    expected = (torch.nested.to_padded_tensor(nt.grad, 0.0) if layout == "strided"
                else nt.grad.to_padded_tensor(0.0), w.grad.clone())
    nt, w = make()
    with group("g"):
        out = swap_wrapper(f)(nt, w)
    round_trip("g")
    stats = SwapManager().stats()
    assert stats["offloaded_bytes"] > 0
    assert stats["kept_bytes"].get("unsupported_tensor") == 0  # counted as kept, its bytes not measured
    out.backward()
    got = torch.nested.to_padded_tensor(nt.grad, 0.0) if layout == "strided" else nt.grad.to_padded_tensor(0.0)
    assert torch.equal(got, expected[0])
    assert torch.equal(w.grad, expected[1])


def test_selective_region_backward_retried_after_loading():
    """A backward that fails because a swapped op output is still on the host must not lose that
    output: after launch_load/wait_load the same backward succeeds, with exact gradients."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def fn(a):
        return (a @ w).relu().sum()

    fn(x).backward()
    expected = w.grad.clone()
    w.grad = None

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SWAP if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    mgr = SwapManager()
    with group("g"):
        loss = checkpoint_wrapper(fn, policy_fn=policy)(x)
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    with pytest.raises(RuntimeError, match="state 'host'"):
        loss.backward(retain_graph=True)
    w.grad = None
    mgr.launch_load("g")
    mgr.wait_load("g")
    loss.backward()
    assert torch.equal(w.grad, expected)
