"""The planner on whole Hugging Face models built from configs (no download): the stack is found
in the model, a plan's measured peak fits its budget, training stays bitwise, and op calls a
mixture-of-experts layer makes that the profile did not see get the default and are counted."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")

import hyper_parallel.integrations.transformers  # noqa: E402,F401  (hands HF layers our checkpoint)
from hyper_parallel.core.activation_checkpoint import MemoryPlan, SwapManager, plan_memory  # noqa: E402
from hyper_parallel.planner import LayerChoice, LayerOption, OpTablePolicy  # noqa: E402
from hyper_parallel.tools.memory import MemoryMeter  # noqa: E402

VOCAB = 128


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(cfg)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4,
                                                                    n_positions=64, bos_token_id=0, eos_token_id=0))
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                      num_experts_per_tok=2, max_position_embeddings=64, head_dim=16)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))


def _loss(model, seed, use_cache=None):
    ids = _batch(seed)
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    return model(input_ids=ids, labels=ids, **kwargs).loss


def _train(model, steps=2, use_cache=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(3)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, step, use_cache)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def _fresh():
    SwapManager().reset()
    yield
    SwapManager().reset()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2", "moe"])
def test_a_whole_model_is_planned_within_its_budget_and_trains_bitwise(kind):
    base = _model(kind).train()
    profiled = copy.deepcopy(base)
    probe = plan_memory(profiled, lambda: _loss(profiled, 0).backward(), "8GiB")
    assert probe.notes[0].startswith("layer stack: ") and probe.stack_path in ("model.layers", "transformer.h")
    budget = probe.min_budget_bytes + (probe.reference_peak_bytes - probe.min_budget_bytes) // 4
    plan = plan_memory(profiled, lambda: _loss(profiled, 0).backward(), budget)
    assert any(c.option.kind != "none" for c in plan.choices), plan.report()
    model = copy.deepcopy(base)
    MemoryPlan.from_json(plan.to_json(), model).apply()
    _loss(model, 0).backward()
    model.zero_grad(set_to_none=True)
    with MemoryMeter("cpu", track=[model], scan_gc=False) as meter:
        _loss(model, 0).backward()
    assert meter.peak_bytes <= budget, plan.report()
    # A recomputed layer trains without a KV cache (Hugging Face's rule, which the plan keeps): so
    # does the reference where the plan recomputes (GPT-2's last bits depend on it).
    recomputes = any(c.option.kind == "recompute" for c in plan.choices)
    reference = _train(copy.deepcopy(base), use_cache=False if recomputes else None)
    model = copy.deepcopy(base)
    MemoryPlan.from_json(plan.to_json(), model).apply()
    planned = _train(model)
    assert all(torch.equal(a, b) for a, b in zip(reference[0], planned[0]))
    assert all(torch.equal(a, b) for a, b in zip(reference[1], planned[1]))


def test_a_model_without_a_stack_or_with_two_is_refused():
    class NoStack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError):
        plan_memory(NoStack(), lambda: None, "1GiB")
    model = _model("llama")
    plain = transformers.LlamaForCausalLM.__module__
    assert plain.startswith("transformers.")


class _TopOneMoE(torch.nn.Module):
    """A mixture-of-experts block whose expert calls change shape with the data: each token goes
    to its best expert, and each expert runs on the tokens it got."""

    def __init__(self, dim: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.router = torch.nn.Linear(dim, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        choice = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            picked = (choice == e).nonzero().squeeze(-1)
            out = out.index_add(0, picked, torch.relu(expert(flat[picked])))
        return x + out.reshape(x.shape)


def test_expert_calls_the_profile_did_not_see_get_the_default_and_are_counted():
    torch.manual_seed(0)
    base = torch.nn.ModuleList(_TopOneMoE() for _ in range(3))
    batches = [torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def run(layers, x):
        for layer in layers:
            x = layer(x)
        return x.square().mean()

    profiled = copy.deepcopy(base)
    plan = plan_memory(profiled, lambda: run(profiled, batches[0]).backward(), "8GiB")
    seen = plan.seen[plan.choices[0].type_key]
    keep = tuple((k, "save") for k in seen if k.label == "aten.addmm.default")
    assert keep
    option = LayerOption("recompute", keep=keep, label="test: save the expert matmuls the profile saw")
    forced = MemoryPlan(plan.layers, [LayerChoice(c.index, c.type_key, option, 0, 0, 0, 0.0) for c in plan.choices],
                        plan.seen, plan._prober, budget_bytes=plan.budget_bytes, predicted_peak_bytes=0, peak_at="",
                        predicted_step_s=0.0, lower_bound_step_s=0.0, min_budget_bytes=0, reference_peak_bytes=0,
                        reference_step_s=0.0, device="cpu")
    results = []
    for planned in (False, True):
        layers = copy.deepcopy(base)
        applied = MemoryPlan.from_json(forced.to_json(), layers).apply() if planned else None
        grads, losses = [], []
        for x in batches[1:]:  # other batches: other experts get other numbers of tokens
            layers.zero_grad(set_to_none=True)
            loss = run(layers, x)
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in layers.parameters() if p.grad is not None])
        results.append((losses, grads))
    (l0, g0), (l1, g1) = results
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for ga, gb in zip(g0, g1) for a, b in zip(ga, gb))
    unseen = sum(p.unseen for p in applied.policies)
    assert unseen > 0
    assert f"did not see (recomputed, the plan's default): {unseen}" in applied.report()
