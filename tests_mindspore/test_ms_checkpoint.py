"""Selective checkpointing on MindSpore: dispatch-mode pair, policies, op counting, misuse errors."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, mint, nn, ops

from hyper_parallel.core.activation_checkpoint import (CheckpointPolicy, checkpoint, checkpoint_wrapper,
                                                       create_selective_checkpoint_contexts)
import hyper_parallel.core.activation_checkpoint  # noqa: F401  (binds the backend)
from hyper_parallel.core.backend import active_backend
from hyper_parallel.core.region_state import region_flags

from ms_helpers import (MATMULS, RecordingPolicy, assert_all_equal, counts_of, grads, make_params,
                        region)


def test_platform_is_mindspore():
    assert active_backend().name == "mindspore"


def _loss_plain(x, w1, w2):
    return region(x, w1, w2).sum()


def _loss_ckpt(policy_fn=None, **kw):
    def loss(x, w1, w2):
        return checkpoint(region, x, w1, w2, policy_fn=policy_fn, **kw).sum()
    return loss


def _run_counts(loss_fn):
    x, w1, w2 = make_params()
    out = {}

    def run():
        out["r"] = grads(lambda x: loss_fn(x, w1, w2), [w1, w2], x)
    return counts_of(run), out["r"]


# ------------------------------------------------------------------------------ op counting
def test_save_ops_are_not_rerun_and_recompute_ops_are():
    plain, ref = _run_counts(_loss_plain)
    whole, r_whole = _run_counts(_loss_ckpt())
    save, r_save = _run_counts(_loss_ckpt(policy_fn=RecordingPolicy()))
    assert_all_equal([ref[0]] + ref[1], [r_whole[0]] + r_whole[1])
    assert_all_equal([ref[0]] + ref[1], [r_save[0]] + r_save[1])
    # whole-region recompute re-runs both matmuls and the element-wise ops ...
    assert whole["MatMulExt"] - plain["MatMulExt"] == 2
    assert whole["Sin"] - plain["Sin"] == 1 and whole["Cos"] - plain["Cos"] == 1
    # ... saving the matmuls re-runs only the element-wise ops
    assert save["MatMulExt"] - plain["MatMulExt"] == 0
    assert save["Sin"] - plain["Sin"] == 1 and save["Cos"] - plain["Cos"] == 1


def test_policy_receives_mindspore_ops_and_truthful_is_recompute():
    policy = RecordingPolicy()
    x, w1, w2 = make_params()
    grads(lambda x: _loss_ckpt(policy_fn=policy)(x, w1, w2), [w1, w2], x)
    fwd, rec = policy.names(False), policy.names(True)
    assert fwd[:4] == ["MatMulExt", "Sin", "MatMulExt", "Cos"]
    assert rec == fwd  # asked again for every op while recomputing, in the same order
    assert policy.op_types == {"OpFunc"}
    # the flags are back to 0 once backward is done
    assert region_flags.checkpoint_depth == 0 and region_flags.frames == []  # (frames: (frame, recompute) pairs)


def test_list_policy_by_op_name_and_primitive():
    plain, ref = _run_counts(_loss_plain)
    by_name, r1 = _run_counts(_loss_ckpt(policy_fn=["MatMulExt"]))
    assert by_name["MatMulExt"] == plain["MatMulExt"]
    assert_all_equal(ref[1], r1[1])
    by_prim, r2 = _run_counts(_loss_ckpt(policy_fn=[ops.Sin, ops.Cos()]))  # class / instance
    assert by_prim["Sin"] == plain["Sin"] and by_prim["Cos"] == plain["Cos"]
    assert by_prim["MatMulExt"] - plain["MatMulExt"] == 2
    assert_all_equal(ref[1], r2[1])


def test_bool_answers():
    plain, _ = _run_counts(_loss_plain)
    saved, _ = _run_counts(_loss_ckpt(policy_fn=lambda ctx, op, *a, **k: op.name in MATMULS))
    assert saved["MatMulExt"] == plain["MatMulExt"]
    everything, _ = _run_counts(_loss_ckpt(policy_fn=lambda ctx, op, *a, **k: False))
    assert everything["MatMulExt"] - plain["MatMulExt"] == 2


def test_swap_decision_without_offload_behaves_as_save():
    plain, ref = _run_counts(_loss_plain)
    swap = lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SWAP if op.name in MATMULS else CheckpointPolicy.MUST_RECOMPUTE  # noqa: E731
    counts, r = _run_counts(_loss_ckpt(policy_fn=swap))
    assert counts["MatMulExt"] == plain["MatMulExt"]
    assert_all_equal([ref[0]] + ref[1], [r[0]] + r[1])


def test_random_ops_are_kept_not_rerun_so_dropout_matches():
    def fresh_dropout():
        ms.set_seed(0)  # the CPU Dropout kernel is seeded when the Cell is built
        d = nn.Dropout(p=0.5)
        d.set_train(True)
        return d

    x, w1, w2 = make_params()

    def block(drop):
        return lambda x, w1, w2: mint.sin(drop(mint.matmul(x, w1)))

    def plain_loss(drop):
        return lambda x: block(drop)(x, w1, w2).sum()

    plain_counts = counts_of(lambda: grads(plain_loss(fresh_dropout()), [w1, w2], x))
    ref = grads(plain_loss(fresh_dropout()), [w1, w2], x)
    drop = fresh_dropout()
    policy = RecordingPolicy(lambda name: CheckpointPolicy.PREFER_RECOMPUTE)
    out = {}

    def run():
        out["r"] = grads(lambda x: checkpoint(block(drop), x, w1, w2, policy_fn=policy).sum(), [w1, w2], x)
    counts = counts_of(run)
    assert counts["Dropout"] == plain_counts["Dropout"] == 1  # not re-run ...
    assert "Dropout" not in policy.names(False)               # ... and not left to the policy
    assert counts["MatMulExt"] - plain_counts["MatMulExt"] == 1
    assert_all_equal([ref[0]] + ref[1], [out["r"][0]] + out["r"][1])


# ------------------------------------------------------------------------------ misuse
def test_bad_policy_answer_is_a_type_error_naming_the_op():
    x, w1, w2 = make_params()
    with pytest.raises(TypeError, match=r"returned 42 .* MatMulExt"):
        grads(lambda x: _loss_ckpt(policy_fn=lambda c, o, *a, **k: 42)(x, w1, w2), [w1, w2], x)


def test_policy_must_decide_the_same_in_recompute():
    def flip(ctx, op, *a, **k):
        return CheckpointPolicy.PREFER_RECOMPUTE if ctx.is_recompute else CheckpointPolicy.MUST_SAVE
    x, w1, w2 = make_params()
    with pytest.raises(RuntimeError, match="same choice"):
        grads(lambda x: _loss_ckpt(policy_fn=flip)(x, w1, w2), [w1, w2], x)
    assert region_flags.checkpoint_depth == 0


def test_in_place_change_of_a_saved_output_is_an_error():
    x, w1, w2 = make_params()

    def block(x):
        h = mint.matmul(x, w1)      # SAVE: cached
        return h, mint.sin(h)       # sin saves h: recompute returns the cached h

    def loss(x, allow=False):
        ctx_fn = functools.partial(create_selective_checkpoint_contexts, ["MatMulExt"],
                                   allow_cache_entry_mutation=allow)
        h, y = ms.recompute(block, x, use_reentrant=False, early_stop=False, context_fn=ctx_fn)
        h.copy_(h * 0.0)  # in-place change after the region saved it
        return y.sum()

    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        grads(loss, [w1], x)
    grads(lambda x: loss(x, allow=True), [w1], x)  # explicitly allowed


def test_argument_errors():
    x, w1, w2 = make_params()
    with pytest.raises(ValueError, match="non-reentrant"):
        checkpoint(region, x, w1, w2, use_reentrant=True)
    with pytest.raises(TypeError, match="context_fn"):
        checkpoint(region, x, w1, w2, context_fn=lambda: None)
    with pytest.raises(TypeError, match="callable"):
        checkpoint(42, x)
    with pytest.raises(TypeError, match="swap_inputs"):
        checkpoint(region, x, w1, w2, swap_inputs="yes")
    with pytest.raises(TypeError, match="op names"):
        checkpoint_wrapper(nn.Dense(2, 2), policy_fn=[42])
    with pytest.raises(ValueError, match="non-empty"):
        checkpoint_wrapper(nn.Dense(2, 2), policy_fn=[""])
    with pytest.raises(TypeError, match="unknown option"):
        checkpoint_wrapper(nn.Dense(2, 2), preserve_rng=True)
    cell = checkpoint_wrapper(nn.Dense(2, 2))
    with pytest.raises(ValueError, match="already wrapped"):
        checkpoint_wrapper(cell)
    with pytest.raises(TypeError, match="nn.Cell or a callable"):
        checkpoint_wrapper(42)


def test_without_grad_recording_the_function_just_runs():
    x, w1, w2 = make_params()
    seen = []
    y = checkpoint(region, x, w1, w2, policy_fn=lambda c, o, *a, **k: seen.append(o) or False)
    assert np.array_equal(y.asnumpy(), region(x, w1, w2).asnumpy())
    assert seen == []  # no dispatch mode was installed: nothing is saved outside a grad transform


def test_exception_inside_region_restores_state():
    x, w1, w2 = make_params()

    def boom(x, w1, w2):
        region(x, w1, w2)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        grads(lambda x: checkpoint(boom, x, w1, w2, policy_fn=RecordingPolicy()).sum(), [w1, w2], x)
    assert region_flags.checkpoint_depth == 0
    # MindSpore still works normally afterwards, and so does the library
    loss, g = grads(lambda x: _loss_ckpt(policy_fn=["MatMulExt"])(x, w1, w2), [w1, w2], x)
    ref = grads(lambda x: _loss_plain(x, w1, w2), [w1, w2], x)
    assert_all_equal([ref[0]] + ref[1], [loss] + g)


def test_early_stop_option_passes_through():
    x, w1, w2 = make_params()
    ref = grads(lambda x: _loss_plain(x, w1, w2), [w1, w2], x)
    got = grads(lambda x: _loss_ckpt(policy_fn=["MatMulExt"], early_stop=True)(x, w1, w2), [w1, w2], x)
    assert_all_equal([ref[0]] + ref[1], [got[0]] + got[1])


def test_create_selective_checkpoint_contexts_with_mindspore_recompute():
    x, w1, w2 = make_params()
    plain, ref = _run_counts(_loss_plain)
    ctx_fn = functools.partial(create_selective_checkpoint_contexts, ["MatMulExt"])

    def loss(x, w1, w2):
        return ms.recompute(region, x, w1, w2, use_reentrant=False, early_stop=False, context_fn=ctx_fn).sum()
    counts, got = _run_counts(loss)
    assert counts["MatMulExt"] == plain["MatMulExt"]
    assert_all_equal([ref[0]] + ref[1], [got[0]] + got[1])


# ------------------------------------------------------------------------------ wrappers
class _Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.body = nn.SequentialCell([nn.Dense(4, 8), nn.Dense(8, 4)])
        self.head = nn.Dense(4, 2)

    def construct(self, x):
        return self.head(mint.tanh(self.body(x)))


def _net(seed=0):
    ms.set_seed(seed)
    return _Net()


def test_wrapped_cell_keeps_names_attributes_and_checkpoints(tmp_path):
    ref = _net()
    names = [p.name for p in ref.get_parameters()]
    keys = list(ref.parameters_dict().keys())
    net = _net()
    net.body[0] = checkpoint_wrapper(net.body[0], policy_fn=["MatMul"])
    net.head = checkpoint_wrapper(net.head)
    assert [p.name for p in net.get_parameters()] == names
    assert list(net.parameters_dict().keys()) == keys
    assert type(net.body[0]).__name__ == "CheckpointedDense" and isinstance(net.body[0], nn.Dense)
    assert net.head.weight.shape == (2, 4) and net.body[0].in_channels == 4
    # checkpoints load either way
    path = str(tmp_path / "wrapped.ckpt")
    ms.save_checkpoint(net, path)
    plain = _net(seed=1)
    not_loaded, _ = ms.load_param_into_net(plain, ms.load_checkpoint(path))
    assert not not_loaded
    for p, q in zip(plain.get_parameters(), net.get_parameters()):
        assert np.array_equal(p.asnumpy(), q.asnumpy())
    # and train identically
    x = Tensor(np.random.RandomState(0).randn(3, 4).astype(np.float32))
    a = grads(lambda x: ref(x).sum(), ref.trainable_params(), x)
    b = grads(lambda x: net(x).sum(), net.trainable_params(), x)
    assert_all_equal([a[0]] + a[1], [b[0]] + b[1])


def test_wrapped_function():
    x, w1, w2 = make_params()
    wrapped = checkpoint_wrapper(region, policy_fn=["MatMulExt"])
    assert wrapped.__name__ == "region"
    ref = grads(lambda x: _loss_plain(x, w1, w2), [w1, w2], x)
    got = grads(lambda x: wrapped(x, w1, w2).sum(), [w1, w2], x)
    assert_all_equal([ref[0]] + ref[1], [got[0]] + got[1])
