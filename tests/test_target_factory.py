"""The target planner on a model that is not a Hugging Face config: a model factory
(``phase_trace.ModelFactory``), here the bench GPT (hand-written attention, dropout, a causal-mask
buffer, a head tied to the embedding). "This machine" as the target: the step traced on the meta
device counts, phase by phase, the bytes the same step counts on real CPU tensors; the whole step
composed from two traced layers takes exactly the bytes a real step of the whole model takes,
measured by the planner's CPU meter; and the command line takes a factory."""

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers", reason="the target planner imports its Hugging Face tracer")

from hyper_parallel.backends.torch.phase_trace import ModelFactory, apply_option, apply_plan, trace_factory  # noqa: E402
from hyper_parallel.bench.model import GPT, GPTConfig, make_batch, model_factory  # noqa: E402
from hyper_parallel.plan import __main__ as cli  # noqa: E402
from hyper_parallel.plan.target_planner import plan_for_target  # noqa: E402
from hyper_parallel.planner.targets import Target  # noqa: E402
from hyper_parallel.tools.memory import MemoryMeter  # noqa: E402

CFG = GPTConfig(vocab=256, dim=64, heads=4, layers=4, seq=64, dropout=0.1)
SEQ, BATCH = 64, 2
#: A CPU whose allocator counts storages as they are (the rates do not matter for bytes).
CPU_EXACT = Target("cpu (exact)", 1 << 34, {"float32": 1e11, "bfloat16": 1e11}, 1e10, 1e10, allocator="exact",
                   calibrated=True)


def _plan(factory, recipe="none", *, optimizer="sgd", grad_accum=1, budget=None, tgt=CPU_EXACT):
    return plan_for_target(factory, seq=SEQ, batch=BATCH, grad_accum=grad_accum, precision="fp32",
                           optimizer=optimizer, dp=1, fsdp=1, reshard_after_forward=True, pp=1, recipe=recipe,
                           budget=budget, target=tgt)


@pytest.mark.parametrize("option", ["none", "full", "selective"])
def test_the_meta_trace_of_the_bench_gpt_counts_the_bytes_a_cpu_run_counts(option):
    """Phase by phase (embedding, each layer's forward and backward, the loss head), the meta
    trace of the factory's model and the same step on a real CPU model count the same bytes."""
    factory = model_factory(CFG)
    meta = trace_factory(factory, seq=SEQ, batch=BATCH, dtype=torch.float32, option=option, allocator="exact",
                         attention="cpu")
    real = GPT(dataclasses.replace(CFG, layers=2), seed=1)
    cpu = trace_factory(factory, seq=SEQ, batch=BATCH, dtype=torch.float32, option=option, allocator="exact",
                        device="cpu", model=real)
    assert list(meta.phases) == list(cpu.phases)
    for name in meta.phases:
        a, b = meta.phases[name], cpu.phases[name]
        assert (a.rise, a.net, sorted(a.kept_sizes)) == (b.rise, b.net, sorted(b.kept_sizes)), name
    # what the trace reads off the model: the tied head has no parameter of its own (its final
    # norm's two), the embedding's are the token and position tables, the mask is a buffer
    assert meta.embed_params == [CFG.vocab * CFG.dim, CFG.seq * CFG.dim]
    assert meta.head_params == [CFG.dim, CFG.dim]
    assert meta.other_buffers == [CFG.seq * CFG.seq] and meta.hidden == CFG.dim
    assert meta.phases["layer1.fwd"].net > 0


def _measured_step(option, optimizer, grad_accum):
    """The bytes a real CPU step of the whole model holds at its peak, and before it (the
    planner's CPU meter over the model, the optimizer and the batch, which the prediction leaves
    out: the caller's), the step's second run (the optimizer's state exists, the gradients do
    not: ``zero_grad(set_to_none=True)``)."""
    model = GPT(CFG, seed=1)
    apply_option(model, option)
    opt = (torch.optim.SGD(model.parameters(), lr=1e-3) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
    tokens, targets = make_batch(CFG, BATCH, seed=2)

    def step():
        for _ in range(grad_accum):
            loss = model(tokens, targets) / grad_accum
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with MemoryMeter("cpu", track=[model, opt, tokens, targets], scan_gc=False) as meter:
        step()
    batch = tokens.nbytes + targets.nbytes
    return meter.baseline_bytes - batch, meter.peak_bytes - batch


@pytest.mark.parametrize("recipe,optimizer,accum", [
    ("none", "sgd", 1), ("none", "adamw", 1), ("full", "sgd", 1), ("selective", "sgd", 1), ("full", "adamw", 2),
    ("selective", "sgd", 2),
])
def test_the_bench_gpt_step_predicted_from_two_traced_layers_equals_the_measured_cpu_step(recipe, optimizer, accum):
    """The planner traces two of the four layers on the meta device and composes the whole step;
    a real CPU step of the four-layer model takes exactly the predicted bytes, its parameters,
    buffers (the mask) and optimizer state exactly the predicted static part."""
    answer = _plan(model_factory(CFG), recipe, optimizer=optimizer, grad_accum=accum)
    parts = dict(answer["peak_parts"])
    static = parts["parameters"] + parts["buffers"] + parts.get("optimizer state", 0)
    baseline, peak = _measured_step({"none": "none", "full": "full", "selective": "selective"}[recipe],
                                    optimizer, accum)
    assert baseline == static
    assert peak == answer["peak_allocated_bytes"]


def test_a_plan_for_the_bench_gpt_applied_to_the_real_model_takes_the_bytes_it_predicts():
    """Under budgets between the smallest peak and the unwrapped one, each plan (an option per
    layer) applied to the real four-layer GPT takes exactly the predicted bytes, within the
    budget."""
    factory = model_factory(CFG)
    slow_link = CPU_EXACT.replace(name="no swapping", host_link_bytes_per_s=1e4)  # (swap too slow to choose)
    none = _plan(factory, tgt=slow_link)
    low, high = none["minimum_bytes"], none["peak_reserved_bytes"]
    assert low < high
    plans = set()
    for k in range(5):
        budget = low + (high - low) * k // 4
        answer = _plan(factory, "plan", budget=budget, tgt=slow_link)
        plan = answer["plan"]
        assert answer["peak_allocated_bytes"] <= budget and "swap" not in plan
        model = GPT(CFG, seed=1)
        apply_plan(model, plan)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        tokens, targets = make_batch(CFG, BATCH, seed=2)
        for _ in range(2):
            with MemoryMeter("cpu", track=[model, opt, tokens, targets], scan_gc=False) as meter:
                model(tokens, targets).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        peak = meter.peak_bytes - tokens.nbytes - targets.nbytes
        assert peak == answer["peak_allocated_bytes"] <= budget, plan
        plans.add(tuple(plan))
    assert len(plans) >= 3  # (the budgets reach different plans: none, mixes, all recomputed)


def test_a_model_factory_says_what_is_wrong_with_it():
    with pytest.raises(ValueError, match="positive int"):
        ModelFactory(lambda n: GPT(CFG), 0, lambda m, ids: m(ids, ids))
    with pytest.raises(ValueError, match="names 2 layers"):
        ModelFactory(lambda n: GPT(CFG), 4, lambda m, ids: m(ids, ids), kinds=("a", "b"))
    with pytest.raises(TypeError, match="callable"):
        ModelFactory(GPT, 4, None)
    with pytest.raises(TypeError, match="not an nn.Module"):
        trace_factory(ModelFactory(lambda n: "model", 4, lambda m, ids: ids), seq=8, batch=1, dtype=torch.float32,
                      option="none")

    def frozen(n):
        model = GPT(dataclasses.replace(CFG, layers=n))
        model.pos_emb.weight.requires_grad_(False)
        return model
    with pytest.raises(ValueError, match="frozen ones \\(pos_emb.weight\\)"):
        _plan(ModelFactory(frozen, 4, lambda m, ids: m(ids, ids)))
    with pytest.raises(ValueError, match="hf-gc is Hugging Face's gradient checkpointing; GPT has no"):
        _plan(model_factory(CFG), "hf-gc")

    def unrolled(n):  # (a loss that calls no layer: the phases cannot be cut)
        return GPT(dataclasses.replace(CFG, layers=n))
    with pytest.raises(ValueError, match="cannot cut GPT's step into layers"):
        _plan(ModelFactory(unrolled, 4, lambda m, ids: m.tok_emb(ids).sum()))


def test_the_command_line_plans_a_model_factory(capsys):
    assert cli.main(["hyper_parallel.bench.model:model_factory", "--seq", "64", "--precision", "fp32",
                     "--optimizer", "sgd", "--target", "this", "--recipe", "full", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["model"].startswith("bench GPT") and answer["plan"] == ["recompute"] * GPTConfig().layers
    assert dict(answer["peak_parts"])["buffers"] == GPTConfig().seq ** 2   # (the bool mask)
    with pytest.raises(SystemExit) as e:
        cli.main(["hyper_parallel.bench.model:GPTConfig", "--seq", "64"])
    assert e.value.code == 2
    assert "not a ModelFactory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["no_such_module_xyz:factory", "--seq", "64"])
    assert "cannot import 'no_such_module_xyz'" in capsys.readouterr().err


def _same_answer(a, b):
    keys = ("peak_allocated_bytes", "peak_reserved_bytes", "minimum_bytes", "minimum_parts", "plan", "peak_parts",
            "step_s", "fits")
    return {k: a[k] for k in keys} == {k: b[k] for k in keys}


@pytest.mark.parametrize("recipe", ["none", "full", "plan"])
def test_a_live_model_plans_for_a_target_as_its_factory_does_and_is_left_as_it_was(recipe):
    """``ModelFactory.from_model``: a model you have (trained a step, gradients and all) planned
    for a target through a meta copy of it: the same answer as the factory that builds it, for the
    bench GPT and a Hugging Face Llama (``hf_trace.model_factory``) on an H100 and on this CPU;
    the live model's parameters, gradients and devices are untouched and nothing of it is copied
    (its storages are the only ones, and the trace runs on meta tensors)."""
    from hyper_parallel.backends.torch.hf_trace import build_model, model_factory as hf_factory
    from hyper_parallel.planner.targets import target
    from test_target_plan import SMALL

    llama = SMALL["llama"]
    live_gpt = GPT(CFG, seed=1)
    live_llama = build_model(llama, llama["num_hidden_layers"], torch.float32, "cpu")
    tokens, targets = make_batch(CFG, BATCH, seed=2)
    live_gpt(tokens, targets).backward()
    before = {name: (p.detach().clone(), p.grad.clone()) for name, p in live_gpt.named_parameters()}
    cases = [(ModelFactory.from_model(live_gpt, lambda m, ids: m(ids, ids)), model_factory(CFG)),
             (hf_factory(live_llama), llama)]
    for tgt, precision in ((target("h100-sxm"), "bf16-mixed"), (CPU_EXACT, "fp32")):
        for live, planned in cases:
            kw = dict(seq=SEQ, batch=BATCH, grad_accum=1, precision=precision, optimizer="adamw", dp=1, fsdp=1,
                      reshard_after_forward=True, pp=1, recipe=recipe, target=tgt)
            budget = None
            if recipe == "plan":
                none = plan_for_target(planned, **{**kw, "recipe": "none"}, budget=None)
                full = plan_for_target(planned, **{**kw, "recipe": "full"}, budget=None)
                budget = (full["peak_reserved_bytes"] + none["peak_reserved_bytes"]) // 2
            assert _same_answer(plan_for_target(live, **kw, budget=budget), plan_for_target(planned, **kw,
                                                                                            budget=budget))
        if recipe == "none":  # (a Hugging Face model you have takes Hugging Face's own checkpointing)
            kw = {**kw, "recipe": "hf-gc"}
            assert _same_answer(plan_for_target(cases[1][0], **kw, budget=None),
                                plan_for_target(llama, **kw, budget=None))
    for name, p in live_gpt.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, before[name][0]) and torch.equal(p.grad, before[name][1])
    assert all(p.grad is None and p.device.type == "cpu" for p in live_llama.parameters())
    assert live_llama.config._attn_implementation == "sdpa"
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in live_llama.model.layers)
    assert len(live_gpt.layers) == CFG.layers and len(live_llama.model.layers) == llama["num_hidden_layers"]


def test_planning_a_model_you_have_keeps_no_reference_to_it():
    """A plan for a target keeps nothing of the live model: once the caller drops it, it is
    freed (a cache of traces keyed by the factory would keep it, and its device memory, alive)."""
    import gc
    import weakref

    model = GPT(CFG, seed=1)
    alive = weakref.ref(model)
    _plan(ModelFactory.from_model(model, lambda m, ids: m(ids, ids)), "full")
    del model
    gc.collect()
    assert alive() is None
