"""What a policy function may answer, and how each answer is interpreted."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint as torch_ckpt

from hyper_parallel.core.activation_checkpoint import (
    CheckpointPolicy, SelectiveCheckpointContext, checkpoint, checkpoint_wrapper,
    create_selective_checkpoint_contexts)
from hyper_parallel.core.policy import Decision, normalize_policy

from support.helpers import (MATMUL_OPS, REGION_FORWARD_OPS, RecordingPolicy, aten, assert_all_equal,
                     forward_backward_counts, make_params, policy_for_matmuls, region, rerun_counts)

TorchPolicy = torch_ckpt.CheckpointPolicy

SAVED = {aten.mm.default: 0}          # matmuls not re-run in backward
RECOMPUTED = {aten.mm.default: 2}     # both matmuls re-run in backward


def _plain_backward_counts():
    x, w1, w2 = make_params()
    return forward_backward_counts(lambda: region(x, w1, w2))[1]


def _checkpointed_rerun(policy_fn, ops=(aten.mm.default, aten.sin.default)):
    x, w1, w2 = make_params()
    _, backward = forward_backward_counts(lambda: checkpoint(region, x, w1, w2, policy_fn=policy_fn))
    return rerun_counts(_plain_backward_counts(), backward, ops)


def _region_grads(policy_fn=None, checkpointed=True):
    x, w1, w2 = make_params()
    out = checkpoint(region, x, w1, w2, policy_fn=policy_fn) if checkpointed else region(x, w1, w2)
    return torch.autograd.grad(out.sum(), [x, w1, w2])


# -- the enum ------------------------------------------------------------------------------


def test_enum_has_exactly_the_five_members():
    assert [m.name for m in CheckpointPolicy] == [
        "MUST_SAVE", "PREFER_SAVE", "MUST_RECOMPUTE", "PREFER_RECOMPUTE", "MUST_SWAP"]


@pytest.mark.parametrize("member, decision", [
    (CheckpointPolicy.MUST_SAVE, Decision.SAVE),
    (CheckpointPolicy.PREFER_SAVE, Decision.SAVE),
    (CheckpointPolicy.MUST_RECOMPUTE, Decision.RECOMPUTE),
    (CheckpointPolicy.PREFER_RECOMPUTE, Decision.RECOMPUTE),
    (CheckpointPolicy.MUST_SWAP, Decision.SWAP),
])
def test_member_decision(member, decision):
    assert normalize_policy(member, aten.mm.default) is member
    assert member.decision is decision


# -- normalisation, unit level --------------------------------------------------------------


def test_bool_answers_follow_pytorch():
    assert normalize_policy(True, aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert normalize_policy(False, aten.mm.default) is CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("value", ["save", None, 1, 0, 1.0, Decision.SAVE, [CheckpointPolicy.MUST_SAVE]])
def test_normalize_rejects_other_values(value):
    with pytest.raises(TypeError) as info:
        normalize_policy(value, aten.mm.default)
    assert "aten.mm.default" in str(info.value)
    assert repr(value) in str(info.value)


def test_selective_checkpoint_context_repr_and_fields():
    ctx = SelectiveCheckpointContext(is_recompute=True)
    assert ctx.is_recompute is True and ctx.op_output is None
    assert "is_recompute=True" in repr(ctx)


# -- every accepted answer, end to end: does the op get re-run? ----------------------------


ANSWERS = [
    (CheckpointPolicy.MUST_SAVE, SAVED),
    (CheckpointPolicy.PREFER_SAVE, SAVED),
    (CheckpointPolicy.MUST_RECOMPUTE, RECOMPUTED),
    (CheckpointPolicy.PREFER_RECOMPUTE, RECOMPUTED),
    # no offload is ever launched: MUST_SWAP behaves exactly like MUST_SAVE
    (CheckpointPolicy.MUST_SWAP, SAVED),
    (True, SAVED),
    (False, RECOMPUTED),
    (TorchPolicy.MUST_SAVE, SAVED),
    (TorchPolicy.PREFER_SAVE, SAVED),
    (TorchPolicy.MUST_RECOMPUTE, RECOMPUTED),
    (TorchPolicy.PREFER_RECOMPUTE, RECOMPUTED),
    (TorchPolicy.MUST_CPU_OFFLOAD, SAVED),     # = MUST_SWAP, which really keeps the output
    (TorchPolicy.PREFER_CPU_OFFLOAD, SAVED),
]


@pytest.mark.parametrize("answer, expected", ANSWERS, ids=[str(a) for a, _ in ANSWERS])
def test_answer_decides_whether_matmuls_rerun(answer, expected):
    rerun = _checkpointed_rerun(policy_for_matmuls(answer))
    assert rerun[aten.mm.default] == expected[aten.mm.default]
    assert rerun[aten.sin.default] == 1  # the other ops are always recomputed here
    assert_all_equal(_region_grads(policy_for_matmuls(answer)), _region_grads(checkpointed=False))


@pytest.mark.parametrize("torch_member, ours", [
    (TorchPolicy.MUST_SAVE, CheckpointPolicy.MUST_SAVE),
    (TorchPolicy.PREFER_SAVE, CheckpointPolicy.PREFER_SAVE),
    (TorchPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE),
    (TorchPolicy.PREFER_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE),
    (TorchPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.MUST_SWAP),
    (TorchPolicy.PREFER_CPU_OFFLOAD, CheckpointPolicy.MUST_SWAP),
])
def test_torch_members_map_to_ours(torch_member, ours):
    from hyper_parallel.core.backend import active_backend
    assert normalize_policy(torch_member, aten.mm.default, active_backend().convert_policy) is ours


@pytest.mark.parametrize("value", ["save", None, 1, 0, 2.5, object()])
def test_bad_answer_is_type_error_naming_op_and_value(value):
    x, w1, w2 = make_params()
    with pytest.raises(TypeError) as info:
        checkpoint(region, x, w1, w2, policy_fn=policy_for_matmuls(value,
                                                                     other=CheckpointPolicy.PREFER_RECOMPUTE))
    msg = str(info.value)
    assert "aten.mm.default" in msg, msg
    assert repr(value) in msg, msg


def test_bad_answer_for_a_non_matmul_op_names_that_op():
    x, w1, w2 = make_params()

    def policy_fn(ctx, op, *args, **kwargs):
        return "nope" if op is aten.sin.default else CheckpointPolicy.MUST_SAVE

    with pytest.raises(TypeError, match=r"aten\.sin\.default") as info:
        checkpoint(region, x, w1, w2, policy_fn=policy_fn)
    assert "'nope'" in str(info.value)


def test_bad_answer_under_matmul_operator_still_names_op_and_value():
    x, w1, _ = make_params()
    with pytest.raises(TypeError, match=r"aten\.mm\.default") as info:
        checkpoint(lambda a: (a @ w1).sin(), x, policy_fn=lambda ctx, op, *a, **k: "save")
    assert "'save'" in str(info.value)


# -- a list of ops as the policy -----------------------------------------------------------


@pytest.mark.parametrize("container", [list, tuple, set, frozenset])
def test_op_list_saves_exactly_those_ops(container):
    rerun = _checkpointed_rerun(container([aten.mm.default]))
    assert rerun[aten.mm.default] == 0
    assert rerun[aten.sin.default] == 1


def test_op_list_with_other_op_saves_that_one_and_recomputes_matmuls():
    rerun = _checkpointed_rerun([aten.sin.default])
    assert rerun[aten.mm.default] == 2
    assert rerun[aten.sin.default] == 0


def test_empty_op_list_recomputes_everything():
    rerun = _checkpointed_rerun([], ops=list(REGION_FORWARD_OPS))
    assert rerun == REGION_FORWARD_OPS


def test_op_list_grads_bitwise_equal_plain():
    assert_all_equal(_region_grads([aten.mm.default]), _region_grads(checkpointed=False))


def _packet_error_check(exc_info):
    msg = str(exc_info.value)
    assert "torch.ops.aten.mm.default" in msg, msg
    assert "OpOverloadPacket" in msg, msg


def test_op_packet_in_list_is_value_error_with_advice():
    x, w1, w2 = make_params()
    with pytest.raises(ValueError) as info:
        checkpoint(region, x, w1, w2, policy_fn=[aten.mm.default, torch.ops.aten.mm])
    _packet_error_check(info)


def test_op_packet_in_list_is_value_error_for_wrapper_and_contexts():
    with pytest.raises(ValueError) as info:
        checkpoint_wrapper(torch.nn.Linear(2, 2), policy_fn=[torch.ops.aten.mm])
    _packet_error_check(info)
    with pytest.raises(ValueError) as info:
        create_selective_checkpoint_contexts([torch.ops.aten.mm])
    _packet_error_check(info)


@pytest.mark.parametrize("entry", ["aten.mm.default", torch.mm, 3, None])
def test_non_op_in_list_is_type_error(entry):
    x, w1, w2 = make_params()
    with pytest.raises(TypeError) as info:
        checkpoint(region, x, w1, w2, policy_fn=[aten.mm.default, entry])
    assert repr(entry) in str(info.value)
    with pytest.raises(TypeError):
        create_selective_checkpoint_contexts([entry])


@pytest.mark.parametrize("bad", [3, "mm"])
def test_non_callable_policy_is_type_error(bad):
    x, w1, w2 = make_params()
    with pytest.raises(TypeError):
        checkpoint(region, x, w1, w2, policy_fn=bad)


@pytest.mark.parametrize("bad, exc", [([torch.ops.aten.mm], ValueError), (3, TypeError)])
def test_bad_policy_is_rejected_under_no_grad_too(bad, exc):
    x, w1, w2 = make_params()
    with torch.no_grad(), pytest.raises(exc):
        checkpoint(region, x, w1, w2, policy_fn=bad)


# -- what the policy is asked ---------------------------------------------------------------


def test_policy_sees_is_recompute_false_in_forward_true_in_recompute():
    x, w1, w2 = make_params()
    policy = RecordingPolicy()
    out = checkpoint(region, x, w1, w2, policy_fn=policy, early_stop=False)
    forward_calls = list(policy.calls)
    assert forward_calls, "policy never asked in forward"
    assert all(flag is False for flag, _ in forward_calls)
    out.sum().backward()
    recompute_calls = policy.calls[len(forward_calls):]
    assert all(flag is True for flag, _ in recompute_calls)
    # the same ops, in the same order, are asked again while recomputing (SAVE ops included)
    assert [op for _, op in recompute_calls] == [op for _, op in forward_calls]
    assert aten.mm.default in [op for _, op in recompute_calls]


def test_policy_with_early_stop_asks_a_prefix_in_recompute():
    x, w1, w2 = make_params()
    policy = RecordingPolicy()
    out = checkpoint(region, x, w1, w2, policy_fn=policy)
    n = len(policy.calls)
    out.sum().backward()
    fwd, rec = policy.ops(False), policy.ops(True)
    assert len(fwd) == n
    assert 0 < len(rec) <= len(fwd)
    assert rec == fwd[:len(rec)]


def test_op_output_is_given_in_forward_only():
    x, w1, w2 = make_params()
    seen = []

    def policy_fn(ctx, op, *args, **kwargs):
        if op is aten.mm.default:
            seen.append((ctx.is_recompute, ctx.op_output))
        return CheckpointPolicy.MUST_SAVE

    out = checkpoint(region, x, w1, w2, policy_fn=policy_fn)
    out.sum().backward()
    forward = [o for flag, o in seen if not flag]
    recompute = [o for flag, o in seen if flag]
    assert len(forward) == 2 and all(isinstance(o, torch.Tensor) for o in forward)
    assert torch.equal(forward[0], torch.mm(x, w1).detach())
    assert recompute and all(o is None for o in recompute)


def test_policy_gets_op_args_and_kwargs():
    x, w1, w2 = make_params()
    shapes = []

    def policy_fn(ctx, op, *args, **kwargs):
        if op is aten.mm.default and not ctx.is_recompute:
            shapes.append(tuple(a.shape for a in args))
        return CheckpointPolicy.PREFER_RECOMPUTE

    checkpoint(region, x, w1, w2, policy_fn=policy_fn)
    assert shapes == [((6, 5), (5, 5)), ((6, 5), (5, 5))]


def test_random_and_mutating_ops_rerun_without_asking():
    x, w1, w2 = make_params()
    policy = RecordingPolicy()  # matmuls saved, the rest recomputed

    def fn(x, w1):
        h = torch.mm(x, w1)
        h = torch.nn.functional.dropout(h, p=0.5, training=True)
        h = h * 1.0
        h.add_(1.0)                    # mutates an argument
        return h.sin()

    torch.manual_seed(3)
    out = checkpoint(fn, x, w1, policy_fn=policy)
    out.sum().backward()
    asked = {op for _, op in policy.calls}
    assert aten.mm.default in asked
    for op in asked:
        assert not op._schema.is_mutable, op
        assert torch.Tag.nondeterministic_seeded not in op.tags, op
    assert aten.add_.Tensor not in asked
    # bitwise equal to plain with the same RNG: the dropout mask was reproduced, not replayed
    g = (x.grad.clone(), w1.grad.clone())
    x.grad = w1.grad = None
    torch.manual_seed(3)
    fn(x, w1).sum().backward()
    assert_all_equal(g, (x.grad, w1.grad))


def _mutating_region(x, w1):
    h = torch.mm(x, w1)
    h.mul_(2.0)  # overwrites the value a SAVE policy kept for mm
    return h.sin()


def test_saved_output_mutated_later_in_the_region_is_recomputed_instead():
    # The kept value no longer exists once the region overwrote it in place, so that op is
    # recomputed (replaying the same in-place writes): gradients stay exact, and mm re-runs.
    x, w1, _ = make_params()
    _, plain = forward_backward_counts(lambda: _mutating_region(x, w1))
    x.grad = w1.grad = None
    _, got = forward_backward_counts(lambda: checkpoint(_mutating_region, x, w1, policy_fn=[aten.mm.default]))
    assert rerun_counts(plain, got, [aten.mm.default]) == {aten.mm.default: 1}
    want = torch.autograd.grad(_mutating_region(x, w1).sum(), [x, w1])
    out = checkpoint(_mutating_region, x, w1, policy_fn=[aten.mm.default])
    assert_all_equal(torch.autograd.grad(out.sum(), [x, w1]), want)


def test_saved_output_mutated_after_the_region_is_an_error():
    x, w1, _ = make_params()
    out = checkpoint(lambda a, b: torch.mm(a, b), x, w1, policy_fn=[aten.mm.default])
    y = out.sin()  # sin saves `out`, the very tensor the policy kept for mm
    with torch.no_grad():
        out.mul_(2.0)
    with pytest.raises(RuntimeError, match="in-?place"):
        y.sum().backward()


def _dropout_region(x, w1, w2):
    h = torch.nn.functional.dropout(torch.mm(x, w1), p=0.3, training=True).tanh()
    return torch.nn.functional.dropout(torch.mm(h, w2), p=0.3, training=True).sin()


def _dropout_grads(policy_fn=None, checkpointed=True):
    x, w1, w2 = make_params()
    torch.manual_seed(11)
    out = checkpoint(_dropout_region, x, w1, w2, policy_fn=policy_fn) if checkpointed \
        else _dropout_region(x, w1, w2)
    return torch.autograd.grad(out.sum(), [x, w1, w2])


@pytest.mark.parametrize("policy", [None, lambda *a, **k: False, [aten.mm.default],
                                    policy_for_matmuls(CheckpointPolicy.MUST_SWAP)],
                         ids=["whole", "recompute_all", "save_mm", "swap_mm"])
def test_dropout_region_is_bitwise_equal(policy):
    assert_all_equal(_dropout_grads(policy), _dropout_grads(checkpointed=False))


@pytest.mark.parametrize("policy", [lambda *a, **k: True, lambda *a, **k: CheckpointPolicy.PREFER_SAVE],
                         ids=["true", "prefer_save"])
def test_save_everything_policy_with_dropout_is_bitwise_equal(policy):
    assert_all_equal(_dropout_grads(policy), _dropout_grads(checkpointed=False))


def test_policy_deciding_differently_in_recompute_is_runtime_error():
    x, w1, w2 = make_params()

    def fickle(ctx, op, *args, **kwargs):
        if op in MATMUL_OPS:
            return CheckpointPolicy.MUST_RECOMPUTE if ctx.is_recompute else CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    out = checkpoint(region, x, w1, w2, policy_fn=fickle)
    with pytest.raises(RuntimeError) as info:
        out.sum().backward()
    msg = str(info.value)
    assert "aten.mm.default" in msg and "SAVE" in msg and "RECOMPUTE" in msg, msg


def test_an_op_that_runs_in_recompute_but_not_in_forward_is_runtime_error():
    """Control flow that changed between forward and recompute (a global flag here): the extra op
    is named with its call number, and the region's ops must be the same in both."""
    x, w1, _ = make_params()
    extra = {"on": False}

    def changing(a, w):
        y = torch.mm(a, w)
        if extra["on"]:
            y = torch.tanh(y)
        return y.sin()

    out = checkpoint(changing, x, w1, policy_fn=policy_for_matmuls(CheckpointPolicy.MUST_SAVE))
    extra["on"] = True
    with pytest.raises(RuntimeError, match=r"op aten\.tanh\.default \(call #0\) ran during recomputation but "
                                           r"not in forward"):
        out.sum().backward()


def test_op_log_counts_the_calls_of_an_op_forward_never_ran():
    from hyper_parallel.core.selective import OpLog

    log = OpLog()
    log.start_replay()
    for n in range(2):
        with pytest.raises(RuntimeError, match=rf"op u \(call #{n}\) ran during recomputation"):
            log.next_call("u", "u")


def test_policy_switching_between_save_and_swap_is_runtime_error():
    x, w1, w2 = make_params()

    def fickle(ctx, op, *args, **kwargs):
        if op in MATMUL_OPS:
            return CheckpointPolicy.MUST_SWAP if ctx.is_recompute else CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    out = checkpoint(region, x, w1, w2, policy_fn=fickle)
    with pytest.raises(RuntimeError, match="SWAP"):
        out.sum().backward()


def test_must_and_prefer_of_the_same_action_may_alternate():
    # strength is not a decision: MUST_SAVE in forward and PREFER_SAVE in recompute is the same choice
    x, w1, w2 = make_params()

    def policy_fn(ctx, op, *args, **kwargs):
        if op in MATMUL_OPS:
            return CheckpointPolicy.PREFER_SAVE if ctx.is_recompute else CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE if ctx.is_recompute else CheckpointPolicy.MUST_RECOMPUTE

    assert_all_equal(_region_grads(policy_fn), _region_grads(checkpointed=False))


def test_policy_used_through_torch_checkpoint_with_partial():
    x, w1, w2 = make_params()
    ctx_fn = functools.partial(create_selective_checkpoint_contexts, policy_for_matmuls(True))
    out = torch_ckpt.checkpoint(region, x, w1, w2, use_reentrant=False, context_fn=ctx_fn)
    assert_all_equal(torch.autograd.grad(out.sum(), [x, w1, w2]), _region_grads(checkpointed=False))
