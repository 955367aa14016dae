"""Hugging Face decoders as users run them: built from small configs with their defaults (the KV
cache on, GPT-2's dropout on), in train mode, wrapped with one wrap_model call in every way
(whole-layer recompute, a selective policy with SAVE and SWAP, swapped layer inputs,
swap_wrapper; chained), two AdamW steps: losses, gradients and parameters bitwise equal to the
unwrapped model, the cache left as it was by backward, and generation from the wrapped model
equal to generation from the unwrapped one."""

import copy
import doctest

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra: pip install -e '.[hf]'")

from transformers import (DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from hyper_parallel.core.activation_checkpoint import (CheckpointPolicy, SwapManager, checkpoint_wrapper,  # noqa: E402
                                                       swap_wrapper, wrap_layers)
from hyper_parallel.integrations import find_layer_stack  # noqa: E402
import hyper_parallel.integrations.transformers as hf_integration  # noqa: E402
from hyper_parallel.integrations.transformers import wrap_model  # noqa: E402

aten = torch.ops.aten
VOCAB, SEQ = 128, 16
MATMULS = {aten.mm.default, aten.addmm.default}
ATTENTION = {aten.bmm.default, aten._softmax.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default}


def save_attention_swap_matmuls(ctx, op, *args, **kwargs):
    if op in MATMULS:
        return CheckpointPolicy.MUST_SWAP
    if op in ATTENTION:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def llama(attn="sdpa"):
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation=attn))


def qwen3(attn):
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=64, attn_implementation=attn))


def gpt2(attn="sdpa"):  # its defaults include dropout 0.1 (attention, residual, embedding)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                      bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, attn_implementation=attn))


def qwen3_moe(attn="sdpa"):
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=8, max_position_embeddings=64, attn_implementation=attn))


MODELS = {
    "llama": llama,
    "qwen3_sdpa": lambda: qwen3("sdpa"),
    "qwen3_eager": lambda: qwen3("eager"),
    "gpt2": gpt2,
    "qwen3_moe": qwen3_moe,
}
WRAPPINGS = {
    "whole": dict(chain=False),
    "selective": dict(policy_fn=save_attention_swap_matmuls),
    "swap_inputs": dict(swap_inputs=True),
    "swap_wrapper": dict(swap=True),
}
SWAPS = {"selective", "swap_inputs", "swap_wrapper"}  # chained: something really went to the host and back
SLOW_MODELS = {"qwen3_moe"}  # the heaviest (its experts loop per token group)


def build(name, seed=0):
    torch.manual_seed(seed)
    model = MODELS[name]()
    model.train()
    return model


def batch(step):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(10 + step))


def train(model, steps=2, **call):
    """Losses and gradients of ``steps`` AdamW steps (dropout seeded per step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record = []
    for step in range(steps):
        ids = batch(step)
        torch.manual_seed(100 + step)
        loss = model(input_ids=ids, labels=ids, **call).loss
        loss.backward()
        record.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return record


def assert_same_training(reference, record, plain, wrapped):
    for (loss0, grads0), (loss1, grads1) in zip(reference, record):
        assert torch.equal(loss0, loss1), (loss0, loss1)
        assert grads0.keys() == grads1.keys()
        assert all(torch.equal(grads0[k], grads1[k]) for k in grads0), [k for k in grads0
                                                                       if not torch.equal(grads0[k], grads1[k])]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), wrapped.parameters()))


def cache_lengths(model):
    """The cache's length after a training forward, and after its backward."""
    cache = DynamicCache(config=model.config)
    ids = batch(7)
    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=ids, cache=cache).loss
    after_forward = cache.get_seq_length()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return after_forward, cache.get_seq_length()


def generate(model):
    model.eval()
    prompt = batch(9)[:, :6]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    model.train()
    return out


@pytest.mark.parametrize("wrapping", list(WRAPPINGS))
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_MODELS else n for n in MODELS])
def test_wrapped_decoder_with_its_defaults_trains_bit_exact(name, wrapping):
    plain = build(name)
    wrapped = copy.deepcopy(plain)
    assert wrapped.config.use_cache  # the model's default: the cache is on
    assert wrap_model(wrapped, **WRAPPINGS[wrapping]) is wrapped
    stack = find_layer_stack(wrapped)
    assert type(stack.layers[0]).__name__.startswith("Swapped" if wrapping == "swap_wrapper" else "Checkpointed")
    # The reference is the unwrapped model trained as Hugging Face trains a checkpointed one: with
    # the cache off where layers recompute (its rule, which wrap_model keeps). For Llama and Qwen
    # that is bit-identical to training with the cache on; GPT-2's attention reads its keys from
    # the cache's torch.cat (contiguous) or straight from the projection (a strided view), which
    # rounds gradients differently (Hugging Face's own gradient checkpointing does the same).
    reference = train(plain, use_cache=wrapping == "swap_wrapper")
    record = train(wrapped)  # the model's defaults: use_cache from its config
    assert_same_training(reference, record, plain, wrapped)
    offloaded = SwapManager().stats()["offloaded_bytes"]
    assert (offloaded > 0) == (wrapping in SWAPS), offloaded
    # Backward leaves the cache as forward left it: recompute cannot append to it a second time.
    # Recomputed layers have it off in training (Hugging Face's rule); swap_wrapper layers use it.
    forward_len, backward_len = cache_lengths(wrapped)
    assert backward_len == forward_len == (SEQ if wrapping == "swap_wrapper" else 0)
    assert cache_lengths(plain) == (SEQ, SEQ)
    assert list(plain.state_dict()) == list(wrapped.state_dict())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_MODELS else n for n in MODELS])
def test_generation_and_eval_mode_of_a_wrapped_model_equal_the_unwrapped(name):
    plain = build(name)
    wrapped = wrap_model(copy.deepcopy(plain), policy_fn=save_attention_swap_matmuls, swap_inputs=True)
    assert torch.equal(generate(plain), generate(wrapped))
    # eval mode with gradients: Hugging Face does not checkpoint there (nor do we): same values, cache on.
    for model in (plain, wrapped):
        model.eval()
    ids = batch(3)
    grads = []
    for model in (plain, wrapped):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        assert out.cache is not None and out.cache.get_seq_length() == SEQ
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_gradient_accumulation_through_a_wrapped_llama():
    plain = build("llama")
    wrapped = wrap_model(copy.deepcopy(plain), policy_fn=save_attention_swap_matmuls, swap_inputs=True)
    for model in (plain, wrapped):
        for step in range(3):  # three micro-batches, one backward each, gradients summed
            ids = batch(step)
            model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), wrapped.parameters()))


def test_wrap_layers_on_the_stack_takes_the_same_route():
    # After importing the integration, wrap_layers(model.model.layers) on a Hugging Face stack hands
    # the layers our checkpoint too: the model's defaults train bit-exactly.
    plain = build("qwen3_eager")
    wrapped = copy.deepcopy(plain)
    wrap_layers(wrapped.model.layers, policy_fn=save_attention_swap_matmuls, swap_inputs=True)
    assert_same_training(train(plain), train(wrapped), plain, wrapped)
    assert SwapManager().stats()["offloaded_bytes"] > 0


@pytest.mark.parametrize("wrapping", ["whole", "selective"])
def test_gpt2_blocks_wrapped_alone_train_bitwise(wrapping):
    # GPT-2's model hands its blocks the cache positionally; a checkpointed block drops it itself
    # (the rule is per layer), so wrap_layers on model.transformer.h alone trains like the plain
    # model, without wrap_model's model-level flag.
    # (the reference trains with the cache off, as the recomputed blocks do: see above)
    plain = build("gpt2")
    wrapped = copy.deepcopy(plain)
    wrap_layers(wrapped.transformer.h, **WRAPPINGS[wrapping])
    assert_same_training(train(plain, use_cache=False), train(wrapped), plain, wrapped)


def test_only_the_checkpointed_layers_leave_the_cache():
    # A plan wraps some layers: the others keep writing the model's cache as its defaults say.
    model = build("gpt2")
    checkpoint_wrapper(model.transformer.h[0])
    checkpoint_wrapper(model.transformer.h[2])
    ids = batch(0)
    cache = model(input_ids=ids, labels=ids).past_key_values
    lengths = [cache.get_seq_length(i) for i in range(4)]
    assert lengths == [0, SEQ, 0, SEQ], lengths


def test_hugging_face_gradient_checkpointing_and_a_wrapper_do_not_mix():
    model = build("llama")
    model.activation_checkpointing_enable()  # Hugging Face's own (gradient_checkpointing_enable is its old name)
    with pytest.raises(ValueError, match="wrap_model: Hugging Face's gradient checkpointing is on in LlamaForCausalLM"):
        wrap_model(model)
    with pytest.raises(ValueError, match="checkpoint_wrapper: this LlamaDecoderLayer has Hugging Face's gradient "
                                         "checkpointing on"):
        checkpoint_wrapper(model.model.layers[0])
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    model = wrap_model(build("llama"))
    with pytest.raises(ValueError, match="this CheckpointedLlamaDecoderLayer is wrapped by hyper_parallel's "
                                         "checkpoint_wrapper; Hugging Face's gradient checkpointing cannot be "
                                         "switched"):
        model.activation_checkpointing_enable()
    model = build("llama")
    swap_wrapper(model.model.layers[1])
    with pytest.raises(ValueError, match="wrapped by hyper_parallel's swap_wrapper"):
        model.activation_checkpointing_enable()


def test_a_wrapped_model_pickles_and_deep_copies_with_its_route():
    model = wrap_model(build("llama"), chain=False)
    clone = copy.deepcopy(model)
    layer = clone.model.layers[0]
    assert type(layer).__name__ == "CheckpointedLlamaDecoderLayer" and layer.gradient_checkpointing is True
    plain = build("llama")
    assert_same_training(train(plain), train(clone), plain, clone)


def test_docstring_examples():
    result = doctest.testmod(hf_integration, verbose=False)
    assert result.attempted > 0 and result.failed == 0
    assert hf_integration.__all__ == ["checkpoint_above", "wrap_model", "family_of"]


@pytest.mark.slow
@pytest.mark.parametrize("wrapping", ["whole", "selective", "swap_wrapper"])
def test_a_wrapped_model_under_torch_compile(wrapping):
    # Hugging Face's layer hook, our checkpoint and the policy are traced (swap regions run eagerly
    # behind a graph break): gradients equal the eager unwrapped model's within the compiler's tolerance.
    plain = build("llama")
    compiled = torch.compile(wrap_model(copy.deepcopy(plain), **WRAPPINGS[wrapping]), backend="aot_eager")
    reference = train(plain, steps=1, use_cache=wrapping == "swap_wrapper")
    record = train(compiled, steps=1)
    (loss0, grads0), (loss1, grads1) = reference[0], record[0]
    assert torch.allclose(loss0, loss1, rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads0.values(), grads1.values()))
