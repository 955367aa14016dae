"""``checkpoint_wrapper``: the enclosing model's view does not change (state_dict keys, parameter
names, attributes, indexing)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint_wrapper

from support.helpers import (MATMUL_OPS, aten, assert_all_equal, assert_state_equal, count_ops,
                     forward_backward_counts, gpt_in_mode, make_params, policy_for_matmuls, region,
                     rerun_counts, tiny_gpt_config, train_snapshot)

WRAP_KINDS = {
    "whole": {},
    "save_mm": dict(policy_fn=policy_for_matmuls(CheckpointPolicy.MUST_SAVE)),
    "op_list": dict(policy_fn=[aten.addmm.default]),
}


def _gpt(seed=0, **cfg):
    from hyper_parallel.bench.model import GPT
    return GPT(tiny_gpt_config(**cfg), seed=seed)


def _wrap_layers(model, **kw):
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, **kw)
    return model


def _batch(model, batch=2, seed=0):
    from hyper_parallel.bench.model import make_batch
    return make_batch(model.cfg, batch, seed)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 4))


# -- identity of the wrapped module ---------------------------------------------------------------


def test_module_is_wrapped_in_place():
    layer = nn.Linear(4, 4)
    params = list(layer.parameters())
    out = checkpoint_wrapper(layer)
    assert out is layer
    assert isinstance(layer, nn.Linear)
    assert type(layer).__name__ == "CheckpointedLinear"
    assert all(a is b for a, b in zip(layer.parameters(), params))
    # one wrapped class per original class
    assert type(checkpoint_wrapper(nn.Linear(2, 2))) is type(layer)


@pytest.mark.parametrize("kind", list(WRAP_KINDS))
def test_state_dict_keys_and_parameter_names_unchanged(kind):
    plain = _gpt()
    wrapped = _wrap_layers(_gpt(), **WRAP_KINDS[kind])
    wrapped.layers[0].attn = checkpoint_wrapper(wrapped.layers[0].attn)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in wrapped.named_buffers()] == [n for n, _ in plain.named_buffers()]
    assert [n for n, _ in wrapped.named_modules()] == [n for n, _ in plain.named_modules()]
    assert not any("_checkpoint_wrapped_module" in k for k in wrapped.state_dict())


def test_function_wrapping_leaves_state_dict_unchanged():
    plain = _gpt()
    for mode in ("funcrecompute", "funcsave"):
        model = gpt_in_mode(mode)
        assert list(model.state_dict()) == list(plain.state_dict())
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_attribute_access_reaches_original():
    model = _wrap_layers(_gpt())
    layer = model.layers[0]
    assert isinstance(layer.attn.qkv, nn.Linear)
    assert layer.attn.qkv.weight is model.get_submodule("layers.0.attn.qkv").weight
    assert layer.attn.heads == model.cfg.heads
    assert layer.ln1.normalized_shape == (model.cfg.dim,)
    # setting attributes reaches the original too
    layer.attn.heads = layer.attn.heads
    layer.extra_flag = 3
    assert layer.extra_flag == 3


def test_wrapped_sequential_is_indexable_and_runs():
    seq = _mlp()
    ref_seq = copy.deepcopy(seq)
    first = seq[0]
    wrapped = checkpoint_wrapper(seq)
    assert wrapped[0] is first and len(wrapped) == 3
    assert isinstance(wrapped[-1], nn.Linear)
    assert [type(m) for m in wrapped] == [nn.Linear, nn.GELU, nn.Linear]
    assert isinstance(wrapped[0:2], nn.Sequential)
    x = torch.randn(5, 6, requires_grad=True)
    out = wrapped(x)
    ref = ref_seq(x)
    assert torch.equal(out, ref)
    assert_all_equal(torch.autograd.grad(out.sum(), [x, *wrapped.parameters()]),
                     torch.autograd.grad(ref.sum(), [x, *ref_seq.parameters()]))


def test_wrapped_module_list_is_indexable():
    layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
    items = list(layers)
    wrapped = checkpoint_wrapper(layers)
    assert len(wrapped) == 3
    assert all(wrapped[i] is items[i] for i in range(3))
    assert list(wrapped) == items
    wrapped.append(nn.Linear(3, 3))
    assert len(wrapped) == 4 and list(wrapped.state_dict())[-1] == "3.bias"


def test_inner_submodules_of_wrapped_model_are_reachable_by_index():
    model = _wrap_layers(_gpt())
    assert type(model.layers[1]).__name__ == "CheckpointedBlock"
    assert model.layers[1].mlp.fc is model.get_submodule("layers.1.mlp.fc")
    assert len(model.layers) == model.cfg.layers


# -- checkpoints load either way -----------------------------------------------------------------


@pytest.mark.parametrize("kind", list(WRAP_KINDS))
def test_load_state_dict_both_ways(kind):
    source = _gpt(seed=1)
    wrapped = _wrap_layers(_gpt(seed=2), **WRAP_KINDS[kind])
    tokens, _ = _batch(source)
    source.eval()
    wrapped.eval()
    assert not torch.equal(wrapped(tokens), source(tokens))
    wrapped.load_state_dict(source.state_dict())  # unwrapped -> wrapped, strict
    assert torch.equal(wrapped(tokens), source(tokens))

    fresh = _gpt(seed=3).eval()
    wrapped_source = _wrap_layers(_gpt(seed=4), **WRAP_KINDS[kind]).eval()
    fresh.load_state_dict(wrapped_source.state_dict())  # wrapped -> unwrapped, strict
    assert torch.equal(fresh(tokens), wrapped_source(tokens))


# -- functions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(WRAP_KINDS))
def test_wrapped_function_same_result(kind):
    x, w1, w2 = make_params()
    kw = {"policy_fn": [aten.mm.default]} if kind == "op_list" else WRAP_KINDS[kind]
    wrapped = checkpoint_wrapper(region, **kw)
    assert callable(wrapped) and wrapped is not region
    assert wrapped.__name__ == region.__name__ and wrapped.__doc__ == region.__doc__
    out = wrapped(x, w1, w2)
    ref = region(x, w1, w2)
    assert torch.equal(out, ref)
    assert_all_equal(torch.autograd.grad(out.sum(), [x, w1, w2]),
                     torch.autograd.grad(ref.sum(), [x, w1, w2]))


def test_wrapped_function_is_really_checkpointed():
    x, w1, w2 = make_params()
    _, plain = forward_backward_counts(lambda: region(x, w1, w2))
    _, whole = forward_backward_counts(lambda: checkpoint_wrapper(region)(x, w1, w2))
    _, saved = forward_backward_counts(
        lambda: checkpoint_wrapper(region, policy_fn=[aten.mm.default])(x, w1, w2))
    assert rerun_counts(plain, whole, [aten.mm.default]) == {aten.mm.default: 2}
    assert rerun_counts(plain, saved, [aten.mm.default]) == {aten.mm.default: 0}


def test_wrapped_function_passes_kwargs_and_options():
    x, w1, w2 = make_params()

    def fn(x, *, w, scale):
        return torch.mm(x, w).sin() * scale

    wrapped = checkpoint_wrapper(fn, policy_fn=[aten.mm.default], determinism_check="none",
                                 early_stop=False, preserve_rng_state=True)
    out = wrapped(x, w=w1, scale=3.0)
    assert torch.equal(out, fn(x, w=w1, scale=3.0))


def test_wrapped_bound_method_keeps_module_view():
    block = _mlp()
    ref = copy.deepcopy(block)
    block.forward = checkpoint_wrapper(block.forward)
    assert list(block.state_dict()) == list(ref.state_dict())
    x = torch.randn(3, 6, requires_grad=True)
    _, plain = forward_backward_counts(lambda: ref(x))
    _, got = forward_backward_counts(lambda: block(x))
    # the first Linear and the GELU are re-run; early stop ends recompute before the last addmm,
    # whose output backward does not need
    assert rerun_counts(plain, got, [aten.addmm.default, aten.gelu.default]) == {
        aten.addmm.default: 1, aten.gelu.default: 1}


# -- bad arguments ---------------------------------------------------------------------------------


def test_wrapping_twice_is_value_error():
    layer = checkpoint_wrapper(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already"):
        checkpoint_wrapper(layer)
    with pytest.raises(ValueError, match="already"):
        checkpoint_wrapper(layer, policy_fn=[aten.addmm.default])


@pytest.mark.parametrize("kwargs", [
    dict(swap_inputs="yes"),
    dict(swap_inputs=1),
    dict(unknown_option=True),
    dict(context_fn=lambda: None),
    dict(policy_fn=3),
    dict(policy_fn=["aten.mm.default"]),
], ids=["swap_inputs_str", "swap_inputs_int", "unknown", "context_fn", "policy_int",
        "policy_list_str"])  # use_reentrant=True is a ValueError, as in checkpoint: tests/test_usability.py
def test_bad_arguments_are_type_errors_and_leave_module_untouched(kwargs):
    layer = nn.Linear(2, 2)
    with pytest.raises(TypeError):
        checkpoint_wrapper(layer, **kwargs)
    assert type(layer) is nn.Linear  # failed validation did not half-wrap it
    assert type(checkpoint_wrapper(layer)).__name__ == "CheckpointedLinear"


@pytest.mark.parametrize("target", [3, "layer", None, torch.ones(2)])
def test_non_callable_is_type_error(target):
    with pytest.raises(TypeError):
        checkpoint_wrapper(target)


def test_unknown_option_message_names_it():
    with pytest.raises(TypeError, match="bogus"):
        checkpoint_wrapper(nn.Linear(2, 2), bogus=1)


# -- hooks -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(WRAP_KINDS))
@pytest.mark.parametrize("when", ["before", "after"])
def test_user_hooks_fire_once_and_can_change_values(kind, when):
    ref = _mlp()
    mlp = _mlp()
    events = []

    def pre_hook(module, args):
        events.append("pre")
        return (args[0] * 2.0,)

    def fwd_hook(module, args, out):
        events.append("fwd")
        return out + 1.0

    def bwd_hook(module, grad_in, grad_out):
        events.append("bwd")

    def add_hooks(m, record=True):
        m.register_forward_pre_hook(pre_hook if record else lambda mod, a: (a[0] * 2.0,))
        m.register_forward_hook(fwd_hook if record else lambda mod, a, o: o + 1.0)
        if record:
            m.register_full_backward_hook(bwd_hook)

    if when == "before":
        add_hooks(mlp)
        checkpoint_wrapper(mlp, **WRAP_KINDS[kind])
    else:
        checkpoint_wrapper(mlp, **WRAP_KINDS[kind])
        add_hooks(mlp)
    add_hooks(ref, record=False)
    x = torch.randn(3, 6, requires_grad=True)
    out = mlp(x)
    want = ref(x)
    assert torch.equal(out, want)
    assert events == ["pre", "fwd"]
    out.sum().backward()
    # the recomputation runs the original forward, not the module's hooks
    assert events == ["pre", "fwd", "bwd"]
    gx = x.grad.clone()
    x.grad = None
    want.sum().backward()
    assert torch.equal(gx, x.grad)
    assert_all_equal([p.grad for p in mlp.parameters()], [p.grad for p in ref.parameters()])


def test_forward_hook_with_kwargs_sees_mask():
    model = _wrap_layers(_gpt())
    seen = []
    model.layers[0].register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs["mask"] is model.mask), with_kwargs=True)
    tokens, targets = _batch(model)
    model(tokens, targets).backward()
    assert seen == [True]


def test_train_eval_switch_reaches_wrapped_layers():
    model = _wrap_layers(_gpt())
    model.eval()
    assert not any(m.training for m in model.modules())
    tokens, _ = _batch(model)
    a = model(tokens)
    b = model(tokens)
    assert torch.equal(a, b)  # no dropout in eval
    model.train()
    assert all(m.training for m in model.modules())


# -- copies ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["whole", "save_mm"])
def test_deepcopy_of_wrapped_model_trains_and_stays_wrapped(kind):
    original = _wrap_layers(_gpt(), **WRAP_KINDS[kind])
    clone = copy.deepcopy(original)
    assert type(clone.layers[0]) is type(original.layers[0])
    assert all(p is not q for p, q in zip(clone.parameters(), original.parameters()))
    assert list(clone.state_dict()) == list(_gpt().state_dict())

    losses, params, grads = train_snapshot(clone)
    ref_losses, ref_params, ref_grads = train_snapshot(_gpt())
    assert losses == ref_losses
    assert_state_equal(params, ref_params)
    assert_state_equal(grads, ref_grads)
    # the original was not trained along with the copy
    assert all(p.grad is None for p in original.parameters())
    # the copy is still checkpointed: backward re-runs linear layers
    tokens, targets = _batch(clone)
    _, plain = forward_backward_counts(lambda: _gpt()(tokens, targets))
    _, got = forward_backward_counts(lambda: clone(tokens, targets))
    extra = rerun_counts(plain, got, [aten.addmm.default])[aten.addmm.default]
    assert (extra > 0) if kind == "whole" else (extra == 0)
    _, got_ln = forward_backward_counts(lambda: clone(tokens, targets))
    assert rerun_counts(plain, got_ln, [aten.native_layer_norm.default])[aten.native_layer_norm.default] > 0


def test_torch_save_whole_wrapped_model():
    import io
    model = _wrap_layers(_gpt())
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.layers[0]).__name__ == "CheckpointedBlock"


def test_wrapper_does_not_add_parameters_or_buffers_to_count():
    plain = _gpt()
    wrapped = _wrap_layers(_gpt())
    assert sum(p.numel() for p in wrapped.parameters()) == sum(p.numel() for p in plain.parameters())
    assert len(list(wrapped.buffers())) == len(list(plain.buffers()))


def test_tied_weights_survive_wrapping():
    model = _wrap_layers(_gpt())
    assert model.head.weight is model.tok_emb.weight
    assert "head.weight" not in dict(model.named_parameters())


def test_wrapped_layer_under_no_grad_runs_directly():
    model = _wrap_layers(_gpt(), policy_fn=policy_for_matmuls(CheckpointPolicy.MUST_SAVE))
    tokens, _ = _batch(model)
    model.eval()
    with torch.no_grad():
        counts = count_ops(lambda: model(tokens))
    plain = _gpt().eval()
    with torch.no_grad():
        want = count_ops(lambda: plain(tokens))
    assert {op: counts[op] for op in MATMUL_OPS} == {op: want[op] for op in MATMUL_OPS}
