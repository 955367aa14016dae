"""Planning for an accelerator you do not have: the targets and their sources, the roofline, the
caching allocator's rounding, the cost of an op on meta tensors, "this machine" calibrated, the
built-in Hugging Face configurations, and the command line's arguments (issue 35)."""

import doctest
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.plan import __main__ as cli
from hyper_parallel.plan import _stub
from hyper_parallel.planner import allocator, calibrate, model_configs, roofline, targets
from hyper_parallel.backends.torch import calibrate as torch_calibrate, op_cost as torch_op_cost
from hyper_parallel.planner.allocator import allocated_size, reserved_estimate, segment_size
from hyper_parallel.planner.calibrate import MicroBench, Sizes
from hyper_parallel.planner.roofline import bound, copy_seconds, op_seconds, resolve_dtype
from hyper_parallel.planner.targets import TARGETS, Target, load_target_file, target
from hyper_parallel.backends.torch.op_cost import OpCostLog, OpCostMode, op_cost

GiB = 1 << 30
MiB = 1 << 20
aten = torch.ops.aten


def meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


# ----------------------------------------------------------------------------------------- targets
def test_every_builtin_target_is_complete_and_names_its_sources():
    assert set(TARGETS) == {"h100-sxm", "h100-pcie", "h200", "b200", "a100", "mi300x", "ascend-910b"}
    for key, t in TARGETS.items():
        assert t.memory_bytes >= 64 * GiB and t.hbm_bytes_per_s > 1e12 and t.host_link_bytes_per_s >= 32e9, key
        assert {"bfloat16", "float16", "float32"} <= set(t.peak_flops), key
        assert t.peak_flops["float32"] < t.peak_flops["bfloat16"] <= t.peak_flops.get("float8", math.inf), key
        assert not t.calibrated and t.sources and all(isinstance(s, str) and s for s in t.sources), key
        assert set(t.efficiency) == {"matmul", "attention", "memory", "random", "copy"}, key
    # the dense figures (datasheets quote sparse ones, twice as large)
    h100 = target("h100-sxm")
    assert h100.peak_flops["bfloat16"] == 989.4e12 and h100.hbm_bytes_per_s == 3.35e12
    assert h100.memory_bytes == 80 * GiB and h100.host_link_bytes_per_s == 64e9
    assert target("h200").peak_flops == h100.peak_flops and target("h200").hbm_bytes_per_s == 4.8e12
    assert target("a100").peak_flops["bfloat16"] == 312e12 and "float8" not in target("a100").peak_flops
    assert target("mi300x").peak_flops["bfloat16"] == 1307.4e12 and target("mi300x").memory_bytes == 192 * GiB
    assert target("b200").peak_flops["bfloat16"] == 2250e12 and target("b200").memory_bytes == 192 * GiB
    assert target("ascend-910b").allocator == "npu_caching"
    # what is uncertain says so
    assert any("UNCERTAIN" in s for s in target("ascend-910b").sources)
    assert any("UNCERTAIN" in s for s in target("b200").sources)


@pytest.mark.parametrize("key", sorted(TARGETS))
def test_a_target_round_trips_through_json(key, tmp_path):
    t = TARGETS[key]
    text = json.dumps(t.to_json())
    assert Target.from_json(json.loads(text)) == t
    path = tmp_path / f"{key}.json"
    path.write_text(text)
    assert load_target_file(str(path)) == t
    assert hash(Target.from_json(json.loads(text))) == hash(t)


def test_a_user_target_takes_defaults_and_bad_ones_are_clear_errors(tmp_path):
    mine = Target.from_json({"name": "card", "memory_bytes": 24 * GiB, "peak_flops": {"bfloat16": 100e12},
                             "hbm_bytes_per_s": 1e12, "host_link_bytes_per_s": 25e9,
                             "efficiency": {"matmul": 0.5}})
    assert mine.efficiency == {"matmul": 0.5, "attention": 0.5, "memory": 0.8, "random": 0.8, "copy": 0.8}
    assert mine.allocator == "cuda_caching" and mine.sources == () and not mine.calibrated
    assert Target.from_json({**mine.to_json(), "memory_bytes": 24.0 * GiB}) == mine   # (a JSON writer's float)
    base = mine.to_json()
    bad = [
        ({**base, "speed": 1}, "unknown target field"),
        ({k: v for k, v in base.items() if k != "hbm_bytes_per_s"}, "lacks hbm_bytes_per_s"),
        ({**base, "peak_flops": {"bf16": 1e12}}, "unknown dtype 'bf16'"),
        ({**base, "peak_flops": {}}, "peak_flops is empty"),
        ({**base, "efficiency": {"matmul": 1.5}}, "above 1"),
        ({**base, "efficiency": {"gemm": 0.5}}, "unknown op class"),
        ({**base, "allocator": "tlsf"}, "unknown allocator"),
        ({**base, "memory_bytes": -1}, "memory_bytes must be a positive int"),
        ({**base, "hbm_bytes_per_s": 0}, "hbm_bytes_per_s must be a positive"),
    ]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            Target.from_json(data)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        load_target_file(str(broken))
    with pytest.raises(ValueError, match="cannot read the target file"):
        load_target_file(str(tmp_path / "missing.json"))


def test_targets_are_frozen_and_replace_keeps_the_other_efficiencies():
    h100 = target("h100")
    with pytest.raises(AttributeError):
        h100.memory_bytes = 1
    with pytest.raises(TypeError):
        h100.peak_flops["bfloat16"] = 1.0
    slower = h100.replace(efficiency={"matmul": 0.5})
    assert slower.efficiency["matmul"] == 0.5 and slower.efficiency["memory"] == 0.8
    assert target("h100").efficiency["matmul"] == 0.7


def test_target_names_accept_spellings_and_an_unknown_one_lists_the_builtins():
    assert target("H100_SXM") is target("h100-sxm") is target("h100")
    assert target(" Ascend 910B ") is target("910b")
    with pytest.raises(ValueError) as e:
        target("tpu-v5")
    for key in TARGETS:
        assert key in str(e.value)


# ---------------------------------------------------------------------------------------- roofline
def test_roofline_on_hand_computed_examples():
    h100 = target("h100-sxm")
    # 8192^3 bf16 matmul: 2 * 8192^3 = 1.0995e12 FLOPs at 989.4e12 * 0.7 -> 1.5876 ms; its three
    # 128 MiB matrices at 3.35e12 * 0.8 take 0.15 ms: compute-bound
    flops, nbytes = 2 * 8192 ** 3, 3 * 8192 * 8192 * 2
    assert op_seconds(h100, "matmul", flops, nbytes, "bfloat16") == pytest.approx(flops / (989.4e12 * 0.7))
    assert bound(h100, "matmul", flops, nbytes, "bfloat16") == "compute"
    # a 1 GiB bf16 elementwise op reads and writes 1 GiB: 2 GiB / (3.35e12 * 0.8) = 0.8013 ms
    assert op_seconds(h100, "memory", 0, 2 * GiB, "bfloat16") == pytest.approx(2 * GiB / (3.35e12 * 0.8))
    assert op_seconds(h100, "memory", 0, 2 * GiB, "bfloat16") == pytest.approx(0.80130e-3, rel=1e-4)
    assert bound(h100, "memory", 0, 2 * GiB, "bfloat16") == "hbm"
    # attention has its own efficiency: the same FLOPs take 0.7 / 0.5 as long
    assert op_seconds(h100, "attention", flops, 0, "bf16") == pytest.approx(
        op_seconds(h100, "matmul", flops, 0, "bf16") * 0.7 / 0.5)
    # the host link: 1 GiB at 64e9 * 0.8 one direction
    assert copy_seconds(h100, GiB) == pytest.approx(GiB / 51.2e9)
    # a calibrated target (efficiencies 1.0) is priced at its rates
    flat = h100.replace(efficiency={"matmul": 1.0, "memory": 1.0})
    assert op_seconds(flat, "matmul", 989.4e12, 0, "bfloat16") == pytest.approx(1.0)
    # random numbers: their bytes at the random efficiency (a CPU draws slower than it copies)
    slow_draws = h100.replace(efficiency={"random": 0.1})
    assert op_seconds(slow_draws, "random", 0, 2 * GiB, "float32") == pytest.approx(2 * GiB / (3.35e12 * 0.1))
    assert op_seconds(slow_draws, "memory", 0, 2 * GiB, "float32") == pytest.approx(2 * GiB / (3.35e12 * 0.8))
    assert bound(slow_draws, "random", 0, 2 * GiB, "float32") == "hbm"


def test_dropouts_random_draws_are_their_own_op_class():
    """Dropout's ``bernoulli_`` (and the other random ops) are priced as ``random``, by the bytes
    they move, and not listed among the ops counted by bytes only; dropout's arithmetic is."""
    x = torch.ones(64, 32, requires_grad=True)
    with OpCostMode() as mode:
        F.dropout(x, 0.1, training=True).sum().backward()
    log = mode.log
    assert log.bytes_moved["random"] == 64 * 32 * 4 and log.flops["random"] == 0   # (written, not read)
    assert not any(name in log.bytes_only for name in torch_op_cost.RANDOM_OPS)
    mask = torch.empty(10, device="meta")
    assert op_cost(torch.ops.aten.bernoulli_.float, (mask, 0.5), {}, mask) == ("random", 0, 40, "float32")


def test_roofline_dtype_fallback_rule():
    a100, h100 = target("a100"), target("h100-sxm")
    assert resolve_dtype(a100, "float8") == "bfloat16"            # no FP8 units: the 16-bit rate
    assert op_seconds(a100, "matmul", 1e12, 0, "torch.float8_e4m3fn") == op_seconds(a100, "matmul", 1e12, 0, "bf16")
    assert resolve_dtype(h100, "float8") == "float8"
    assert resolve_dtype(h100, "tf32") == "tf32" and resolve_dtype(target("910b"), "tf32") == "float32"
    assert resolve_dtype(h100, "float64") == "float32" and resolve_dtype(h100, "torch.int64") == "float32"
    only_fp32 = Target("cpu-like", 1 << 30, {"float32": 1e11}, 1e10, 1e10)
    with pytest.raises(ValueError, match="no peak for bfloat16"):
        op_seconds(only_fp32, "matmul", 1e9, 0, "bfloat16")
    # no FLOPs: the dtype is not read (an int64 index copy is only bytes)
    assert op_seconds(only_fp32, "memory", 0, 1e10, "bfloat16") == pytest.approx(1e10 / (1e10 * 0.8))
    with pytest.raises(ValueError, match="copy_seconds"):
        op_seconds(h100, "copy", 0, 1, "bf16")
    with pytest.raises(ValueError, match="unknown dtype"):
        op_seconds(h100, "matmul", 1, 0, "float7")


# --------------------------------------------------------------------------------------- allocator
def test_cuda_caching_allocator_rounding_on_hand_computed_examples():
    assert [allocated_size(n) for n in (0, 1, 511, 512, 513, 1000, 1024)] == [0, 512, 512, 512, 1024, 1024, 1024]
    assert allocated_size(4096 * 11008 * 2) == 4096 * 11008 * 2        # a multiple of 512 stays
    assert allocated_size(3 * 1000 * 4 + 1) == 12288                    # 12001 -> 24 blocks of 512
    # torch_npu pads 32 bytes first
    assert [allocated_size(n, "npu_caching") for n in (0, 1, 480, 481, 512)] == [0, 512, 512, 1024, 1024]
    assert allocated_size(12345, "exact") == 12345
    # segments: small requests a 2 MiB one, 1-10 MiB a 20 MiB one, larger their size rounded to 2 MiB
    assert segment_size(1) == 2 * MiB and segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 1) == 20 * MiB and segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(10 * MiB + 1) == 12 * MiB
    assert segment_size(0) == 0
    with pytest.raises(ValueError):
        allocated_size(-1)
    with pytest.raises(ValueError, match="unknown allocator"):
        allocated_size(1, "jemalloc")


def test_reserved_estimate_on_hand_computed_examples():
    assert reserved_estimate([]) == 0
    assert reserved_estimate([100] * 4096) == 2 * MiB                   # 4096 x 512 B = 2 MiB exactly
    assert reserved_estimate([100] * 4097) == 4 * MiB
    assert reserved_estimate([4 * MiB] * 5) == 20 * MiB                 # five fill a 20 MiB segment exactly
    assert reserved_estimate([4 * MiB] * 6) == 40 * MiB                 # the sixth opens another
    assert reserved_estimate([9 * MiB, 9 * MiB, MiB + 1]) == 20 * MiB    # 9+9 leaves 2 MiB: the 1 MiB+ fits
    assert reserved_estimate([9 * MiB, 9 * MiB, 3 * MiB]) == 40 * MiB    # 3 MiB does not
    assert reserved_estimate([100 * MiB + 1]) == 102 * MiB
    assert reserved_estimate([100, 3 * MiB, 50 * MiB]) == (2 + 20 + 50) * MiB
    assert reserved_estimate([100, 3 * MiB], "exact") == 100 + 3 * MiB
    # never below what is allocated
    sizes = [1, 700, 5000, 2 * MiB + 3, 7 * MiB, 11 * MiB, 64 * MiB]
    assert reserved_estimate(sizes) >= sum(allocated_size(s) for s in sizes)


# ---------------------------------------------------------------------------------------- op costs
def test_matmul_flops_and_bytes_on_meta_tensors():
    m, k, n = 64, 128, 32
    a, b = meta(m, k), meta(k, n)
    cost = op_cost(aten.mm.default, (a, b), {}, torch.mm(a, b))
    assert cost == ("matmul", 2 * m * n * k, (m * k + k * n + m * n) * 2, "bfloat16")
    bias = meta(n)
    cost = op_cost(aten.addmm.default, (bias, a, b), {}, torch.addmm(bias, a, b))
    assert cost.flops == 2 * m * n * k and cost.bytes_moved == (n + m * k + k * n + m * n) * 2
    x, y = meta(4, m, k, dtype=torch.float32), meta(4, k, n, dtype=torch.float32)
    cost = op_cost(aten.bmm.default, (x, y), {}, torch.bmm(x, y))
    assert cost.flops == 4 * 2 * m * n * k and cost.dtype == "float32" and cost.op_class == "matmul"


def test_float32_matmuls_count_as_tf32_when_pytorch_allows_it():
    a = meta(16, 16, dtype=torch.float32)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert op_cost(aten.mm.default, (a, a), {}, torch.mm(a, a)).dtype == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    assert op_cost(aten.mm.default, (a, a), {}, torch.mm(a, a)).dtype == ("tf32" if before != "highest" else "float32")


def test_views_and_metadata_ops_move_nothing_and_a_broadcast_input_counts_what_it_holds():
    x = meta(8, 16)
    for func, args, out in [(aten.view.default, (x, [16, 8]), x.view(16, 8)),
                            (aten.transpose.int, (x, 0, 1), x.transpose(0, 1)),
                            (aten.expand.default, (meta(1, 16), [8, 16]), meta(1, 16).expand(8, 16)),
                            (aten.detach.default, (x,), x.detach()),
                            (aten._unsafe_view.default, (x, [128]), x.view(128)),
                            (aten.empty.memory_format, ([1024],), meta(1024))]:
        cost = op_cost(func, args, {}, out)
        assert cost.bytes_moved == 0 and cost.flops == 0 and cost.op_class == "memory", func
    row = meta(1, 16).expand(8, 16)
    cost = op_cost(aten.add.Tensor, (x, row), {}, x + row)
    assert cost.bytes_moved == (8 * 16 + 16 + 8 * 16) * 2           # the broadcast row is read once
    cost = op_cost(aten.copy_.default, (x, row), {}, x)
    assert cost.bytes_moved == (16 + 8 * 16) * 2                     # the destination is written, not read


def test_sdpa_forward_and_backward_get_attention_flops_on_meta_tensors():
    b, h, s, d = 2, 8, 128, 64
    q, k, v = (meta(b, h, s, d, grad=True) for _ in range(3))
    full_fwd = 2 * (2 * b * h * s * s * d)                  # q @ k^T and scores @ v
    full_bwd = 5 * (2 * b * h * s * s * d)                  # the scores again and four gradient products
    causal = (s * (s + 1) // 2) / (s * s)
    for fwd, args in [(aten._scaled_dot_product_flash_attention.default, (q, k, v, 0.0, False)),
                      (aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, False))]:
        with OpCostMode() as mode:
            out = fwd(*args)[0]
            out.sum().backward()
        costs = [c for name, c in mode if c.op_class == "attention"]
        assert [c.flops for c in costs] == [full_fwd, full_bwd], fwd
        assert all(c.dtype == "bfloat16" and c.bytes_moved > 4 * b * h * s * d * 2 for c in costs)
        with OpCostMode() as mode:
            fwd(q, k, v, 0.0, True)[0].sum().backward()
        assert [c.flops for _, c in mode if c.op_class == "attention"] == [int(full_fwd * causal),
                                                                          int(full_bwd * causal)]
        with OpCostMode(causal_skip=False) as mode:
            fwd(q, k, v, 0.0, True)[0].sum().backward()
        assert [c.flops for _, c in mode if c.op_class == "attention"] == [full_fwd, full_bwd]
        q.grad = k.grad = v.grad = None


def test_sdpa_on_meta_runs_the_math_path_and_its_matmuls_are_counted():
    """On the meta device ``F.scaled_dot_product_attention`` decomposes into bmm + softmax (the
    math backend), whatever kernel a real device would pick: its matmuls carry the FLOPs."""
    b, h, s, d = 1, 4, 64, 32
    q, k, v = (meta(b, h, s, d, grad=True) for _ in range(3))
    with OpCostMode() as mode:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert mode.log.flops["matmul"] == 2 * (2 * b * h * s * s * d) + 4 * (2 * b * h * s * s * d)
    assert "aten._safe_softmax" in mode.log.bytes_only


def test_ops_without_a_formula_are_recorded_as_counted_by_bytes_only():
    log = OpCostLog()
    x = meta(4, 4, dtype=torch.float32)
    for func, args, out in [(aten.add.Tensor, (x, x), x + x), (aten.add.Tensor, (x, x), x + x),
                            (aten.silu.default, (x,), F.silu(x)), (aten.clone.default, (x,), x.clone()),
                            (aten._to_copy.default, (x,), x.to(torch.bfloat16)),
                            (aten.view.default, (x, [16]), x.view(16)),
                            (aten.mm.default, (x, x), x @ x)]:
        log.add(func, args, {}, out)
    assert log.bytes_only == {"aten.add": 2, "aten.silu": 1}       # data movement and views are not listed
    assert log.bytes_only_note() == "counted by bytes only (no FLOP formula): aten.add x2, aten.silu x1"
    assert log.calls == 7 and log.flops["matmul"] == 2 * 4 * 4 * 4 and log.flops["memory"] == 0
    assert OpCostLog().bytes_only_note() is None


def test_a_hugging_face_decoder_step_is_priced_on_meta_tensors():
    transformers = pytest.importorskip("transformers", reason="the Hugging Face decoder needs transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        ids = torch.zeros(2, 16, dtype=torch.long)
        with OpCostMode() as mode:
            model(input_ids=ids, labels=ids).loss.backward()
    # every linear's forward and its two backward matmuls (the first layer's input has no
    # gradient to compute: the embedding's output does, so all of them run): 6 * tokens * weights
    tokens = 2 * 16
    linear_weights = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128) + 64 * 256
    assert mode.log.flops["matmul"] >= 6 * tokens * linear_weights
    assert mode.log.bytes_moved["memory"] > 0 and mode.log.bytes_only_note() is not None


# -------------------------------------------------------------------------------------- calibration
class _FakeBench(MicroBench):
    """A device whose every timing is fixed: the algorithm's arithmetic, with no clock."""

    def device_name(self):
        return "fake0"

    def device_kind(self):
        return "cuda"

    def memory_bytes(self):
        return 16 * GiB

    def matmul_dtypes(self):
        return ("float32", "bfloat16", "float8")

    def matmul_seconds(self, n, dtype, iterations):
        return None if dtype == "float8" else {"float32": 2.0, "bfloat16": 0.5}[dtype] * iterations

    def copy_seconds(self, nbytes, iterations):
        return 0.25 * iterations

    def host_copy_seconds(self, nbytes, iterations):
        return 1.0 * iterations

    def random_seconds(self, nbytes, iterations):
        return 2.0 * iterations   # (8 times slower than the copy)


def test_calibration_turns_timings_into_rates():
    sizes = Sizes(matmul_n=100, copy_bytes=1000, iterations=4, repeats=2)
    t = calibrate.calibrate(_FakeBench(), sizes)
    assert t.peak_flops == {"float32": 2 * 100 ** 3 / 2.0, "bfloat16": 2 * 100 ** 3 / 0.5}   # float8: no kernel
    assert t.hbm_bytes_per_s == 2 * 1000 / 0.25 and t.host_link_bytes_per_s == 1000 / 1.0
    assert t.efficiency["random"] == (1000 / 2.0) / (2 * 1000 / 0.25)   # (draws written at 1/16 of the copies' rate)
    assert t.calibrated and {k: v for k, v in t.efficiency.items() if k != "random"} == dict.fromkeys(
        ("matmul", "attention", "memory", "copy"), 1.0) and t.allocator == "cuda_caching"
    assert t.name == "this machine (fake0)" and t.memory_bytes == 16 * GiB and t.sources


def test_this_machine_calibrates_quickly_to_positive_rates():
    t = torch_calibrate.calibrate_this_machine("cpu")
    assert t.calibrated and t.allocator == "exact" and 0 < t.efficiency["random"] <= 1.0
    assert {v for k, v in t.efficiency.items() if k != "random"} == {1.0}
    assert t.name == "this machine (cpu)" and t.memory_bytes == calibrate.host_memory_bytes() > 0
    assert t.peak_flops["float32"] > 0 and t.hbm_bytes_per_s > 0 and t.host_link_bytes_per_s > 0
    assert set(t.peak_flops) <= {"float32", "bfloat16"}
    assert Target.from_json(json.loads(json.dumps(t.to_json()))) == t
    assert cli.resolve_target("this").calibrated            # (--target this: the current device)


# ----------------------------------------------------------------------------------- model configs
def test_llama3_8b_config_has_8_03_billion_parameters_on_the_meta_device():
    transformers = pytest.importorskip("transformers", reason="building the model needs transformers")
    model_type, kwargs = model_configs.config_kwargs(model_configs.model_config("llama3-8b"))
    assert model_type == "llama"
    config = transformers.LlamaConfig(**kwargs)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, config.max_position_embeddings) == \
        (4096, 14336, 32, 32, 8, 128256, 8192)
    assert not config.tie_word_embeddings
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(8.03e9, rel=0.01)
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("name,params", [("llama3-70b", 70.55e9), ("qwen3-8b", 8.19e9), ("mistral-7b", 7.24e9)])
def test_the_other_builtin_configs_build_their_models_on_the_meta_device(name, params):
    transformers = pytest.importorskip("transformers", reason="building the model needs transformers")
    model_type, kwargs = model_configs.config_kwargs(model_configs.model_config(name))
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.01)
    assert model_configs.model_source(name)


def test_a_users_config_json_loads_from_its_file_or_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 512}))
    for path in (str(tmp_path), str(tmp_path / "config.json")):
        label, config, source = model_configs.resolve_model(path)
        assert config == {"model_type": "llama", "hidden_size": 512} and "config.json" in source
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 512}))
    with pytest.raises(ValueError, match="has no model_type"):
        model_configs.load_config_json(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="unknown model 'gpt-9'.*llama3-8b"):
        model_configs.resolve_model("gpt-9")
    fresh = model_configs.model_config("llama3-8b")
    fresh["hidden_size"] = 1
    assert model_configs.model_config("llama3-8b")["hidden_size"] == 4096


# -------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("argv,message", [
    (["--seq", "8192"], "give a model"),
    (["llama3-8b"], "give the sequence length: --seq"),
    (["llama3-8b", "--seq", "0"], "not positive"),
    (["llama3-8b", "--seq", "8k"], "not a whole number"),
    (["llama3-8b", "--seq", "8192", "--batch", "-1"], "not positive"),
    (["llama3-8b", "--seq", "8192", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["llama3-8b", "--seq", "8192", "--optimizer", "adam"], "invalid choice: 'adam'"),
    (["llama3-8b", "--seq", "8192", "--recipe", "plan"], "--recipe plan needs a budget"),
    (["llama3-8b", "--seq", "8192", "--budget", "70GiB"], "add --recipe plan"),
    (["llama3-8b", "--seq", "8192", "--recipe", "plan", "--budget", "70 gigs"], "cannot read the budget"),
    (["llama3-8b", "--seq", "8192", "--recipe", "plan", "--budget", "90GiB"], "more than H100 SXM 80GB's memory"),
    (["llama3-8b", "--seq", "8192", "--no-reshard-after-forward"], "add --fsdp N"),
    (["llama3-8b", "--seq", "8192", "--pp", "33"], "more pipeline stages than the model's 32 layers"),
    (["llama3-8b", "--seq", "8192", "--target", "v100"], "unknown target 'v100'.*h100-sxm.*'this'"),
    (["llama3-8b", "--seq", "8192", "--target", "missing.json"], "cannot read the target file"),
    (["llama-9", "--seq", "8192"], "unknown model 'llama-9'.*llama3-8b"),
])
def test_cli_argument_errors_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    assert __import__("re").search(message, err), err


def test_cli_lists_every_builtin_target(capsys):
    assert cli.main(["--list-targets"]) == 0
    out = capsys.readouterr().out
    for key, t in TARGETS.items():
        assert key in out and t.name in out
    assert "989.4" in out and "this" in out
    assert cli.main(["--list-targets", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {k: Target.from_json(v) for k, v in listed.items()} == dict(TARGETS)


_RESULT = {
    "fits": True, "peak_allocated_bytes": 61 * GiB, "peak_reserved_bytes": 64 * GiB,
    "minimum_bytes": 40 * GiB, "minimum_parts": [("parameters", 30 * GiB), ("activations", 10 * GiB)],
    "plan": ["recompute"] * 30 + ["none"] * 2, "step_s": 1.5, "bound": "compute",
    "notes": ["counted by bytes only (no FLOP formula): aten.mul x83"],
    "measured_or_modelled": {"peak_allocated_bytes": "modelled", "step_s": "measured"},
}


def test_cli_passes_the_run_to_the_planner_and_prints_its_answer(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake(config, **run):
        seen.update(run, config=config)
        return dict(_RESULT)

    monkeypatch.setattr(cli, "plan_for_target", fake)
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps(target("a100").replace(name="my A100").to_json()))
    argv = ["qwen3-8b", "--seq", "4096", "--batch", "2", "--grad-accum", "4", "--precision", "bf16", "--optimizer",
            "sgd", "--dp", "2", "--fsdp", "4", "--no-reshard-after-forward", "--pp", "2", "--recipe", "plan",
            "--budget", "70GiB", "--target", str(mine)]
    assert cli.main(argv) == 0
    assert seen["config"]["model_type"] == "qwen3" and seen["target"].name == "my A100"
    assert {k: seen[k] for k in ("seq", "batch", "grad_accum", "precision", "optimizer", "dp", "fsdp",
                                 "reshard_after_forward", "pp", "recipe", "budget")} == \
        {"seq": 4096, "batch": 2, "grad_accum": 4, "precision": "bf16", "optimizer": "sgd", "dp": 2, "fsdp": 4,
         "reshard_after_forward": False, "pp": 2, "recipe": "plan", "budget": 70 * GiB}
    out = capsys.readouterr().out
    assert "30x recompute, 2x none" in out and "layers 0-29 recompute; 30-31 none" in out
    assert "61.0 GiB  (76% of 80.0 GiB)" in out and "1.500 s" in out
    for line in out.splitlines():   # every number is marked
        if any(word in line for word in ("peak allocated", "peak reserved", "smallest", "parameters", "step time")):
            assert line.rstrip().endswith(("modelled", "measured")), line
    assert "step time" in out and [l for l in out.splitlines() if "step time" in l][0].endswith("measured")
    assert cli.main(argv + ["--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["plan"] == _RESULT["plan"] and answer["model"] == "qwen3-8b"
    assert answer["run"]["budget"] == 70 * GiB and Target.from_json(answer["target"]).name == "my A100"
    assert answer["minimum_parts"] == [["parameters", 30 * GiB], ["activations", 10 * GiB]]


def test_cli_errors_of_the_planner_are_exit_2(monkeypatch, capsys):
    def below_minimum(config, **run):
        raise ValueError("the budget 10.0 GiB is below the smallest reachable peak 40.0 GiB")

    monkeypatch.setattr(cli, "plan_for_target", below_minimum)
    assert cli.main(["llama3-8b", "--seq", "8192", "--recipe", "plan", "--budget", "10GiB"]) == 2
    assert "below the smallest reachable peak" in capsys.readouterr().err


def test_the_stub_states_the_contract():
    assert set(_stub.RESULT_KEYS) == set(_RESULT)
    # (the real planner is behind it: tests/test_target_plan.py; a bad input is a clear error)
    with pytest.raises(ValueError, match="unknown recipe 'some'"):
        _stub.plan_for_target({"num_hidden_layers": 2}, seq=1, batch=1, grad_accum=1, precision="bf16",
                              optimizer="sgd", dp=1, fsdp=1, reshard_after_forward=True, pp=1, recipe="some",
                              budget=None, target=target("h100"))


@pytest.mark.slow
def test_the_module_runs_as_a_program():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-m", "hyper_parallel.plan", "--list-targets"], capture_output=True,
                         text=True, env=env)
    assert out.returncode == 0 and "h100-sxm" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-m", "hyper_parallel.plan", "llama3-8b"], capture_output=True, text=True,
                         env=env)
    assert out.returncode == 2 and "--seq" in out.stderr


def test_docstring_examples():
    for module in (targets, roofline, allocator, calibrate, model_configs, torch_op_cost, torch_calibrate, cli):
        result = doctest.testmod(module, verbose=False)
        assert result.failed == 0, module.__name__


# ------------------------------------------------------------------------------------------ the doc
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "targets.md")


def test_the_doc_lists_every_target_with_its_figures_and_its_json_example_loads():
    text = open(DOC).read()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines()
            if line.startswith("| `") and line.split("|")[1].strip().strip("`") in TARGETS}
    assert set(rows) == set(TARGETS)
    for key, line in rows.items():
        t = TARGETS[key]
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[1] == t.name and cells[2] == f"{t.memory_bytes // GiB} GiB", key
        assert float(cells[3].split()[0].replace(",", "")) * 1e12 == pytest.approx(t.peak_flops["bfloat16"]), key
        assert float(cells[7].split()[0]) * 1e12 == pytest.approx(t.hbm_bytes_per_s), key
        assert float(cells[8].split()[0]) * 1e9 == pytest.approx(t.host_link_bytes_per_s), key
        assert cells[9] == t.allocator, key
    example = text.split("```json", 1)[1].split("```", 1)[0]
    mine = Target.from_json(json.loads(example))
    assert mine.memory_bytes == 180 * GiB and mine.efficiency["matmul"] == 0.65 and mine.efficiency["memory"] == 0.8


def test_efficiencies_from_a_calibration_against_the_published_figures():
    h100 = target("h100-sxm")
    measured = Target("measured", 80 * GiB, {"bfloat16": 600e12}, 3.0e12, 80e9, calibrated=True)
    eff = calibrate.efficiencies_against(measured, h100)
    assert eff == {"matmul": pytest.approx(600 / 989.4), "memory": pytest.approx(3.0 / 3.35), "copy": 1.0}
    assert h100.replace(efficiency=eff).efficiency["attention"] == 0.5


def test_an_optimizer_step_is_priced_by_the_bytes_it_reads_and_writes():
    """In-place ops that return nothing (``_foreach_add_``, ``_fused_adamw_``) write their mutable
    arguments: those bytes count."""
    params, grads = [meta(10, dtype=torch.float32) for _ in range(3)], [meta(10, dtype=torch.float32) for _ in range(3)]
    cost = op_cost(aten._foreach_add_.List, (params, grads), {}, None)
    assert cost == ("memory", 0, 3 * 40 + 3 * 40 + 3 * 40, "float32")
    with torch.device("meta"):
        p = torch.nn.Parameter(torch.empty(100))
        p.grad = torch.empty(100)
        opt = torch.optim.AdamW([p], foreach=True)
        with OpCostMode() as mode:
            opt.step()
    assert mode.log.bytes_moved["memory"] > 4 * 400 and "aten._foreach_addcdiv_" in mode.log.bytes_only
    assert not any(name.startswith("profiler.") for name in mode.log.bytes_only)
