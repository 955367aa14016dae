"""Hugging Face model families built from small configs in code (no download), trained as users
train them: train mode, the library's defaults (the KV cache on for decoders), ``model(**batch)``
with ``labels`` (a decoder's causal LM, an encoder's masked LM). The planner's benchmark and its
tests share them (``pip install -e '.[hf]'``).

Example::

    >>> model = build("llama", layers=2, hidden=32)
    >>> float(loss(model, batch("llama", batch=2, seq=16, seed=0))) > 0
    True
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import transformers

VOCAB = 512
MASK_ID = VOCAB - 1  # (an encoder's mask token: its masked-LM batches replace 15% of the inputs by it)


def _decoder(config: str, model: str, **extra) -> Callable[[int, int], torch.nn.Module]:
    def make(layers: int, hidden: int) -> torch.nn.Module:
        cfg = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2)
        cfg.update(extra)
        return getattr(transformers, model)(getattr(transformers, config)(**cfg))
    return make


def _gpt2(layers: int, hidden: int) -> torch.nn.Module:  # (its defaults include dropout 0.1)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=4, n_positions=1024, bos_token_id=1, eos_token_id=2))


def _bert(layers: int, hidden: int) -> torch.nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=hidden * 4, max_position_embeddings=1024, pad_token_id=0))


def _modernbert(layers: int, hidden: int) -> torch.nn.Module:
    return transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=hidden * 3, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2, local_attention=32))


#: name -> ``make(layers, hidden)``: grouped-query attention where the family has it (4 heads, 2 KV),
#: a window of 32 tokens (Mistral, Gemma), 4 experts of which 2 per token (Qwen3-MoE)
FAMILIES: Dict[str, Callable[[int, int], torch.nn.Module]] = {
    "llama": _decoder("LlamaConfig", "LlamaForCausalLM"),
    "mistral": _decoder("MistralConfig", "MistralForCausalLM", sliding_window=32),
    "phi3": _decoder("Phi3Config", "Phi3ForCausalLM"),  # (fused qkv and gate/up projections)
    "qwen3": _decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=16),
    "qwen3_moe": _decoder("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=16, moe_intermediate_size=32,
                          num_experts=4, num_experts_per_tok=2),
    "gemma2": _decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=32),
    "gemma3": _decoder("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, sliding_window=32),
    "gpt2": _gpt2,
    "bert": _bert,
    "modernbert": _modernbert,
}
ENCODERS = ("bert", "modernbert")


def build(family: str, *, layers: int = 4, hidden: int = 64, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised ``family`` model in train mode (one seed, one set of weights)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; the families: {', '.join(FAMILIES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FAMILIES[family](layers, hidden).train()


def batch(family: str, *, batch: int, seq: int, seed: int, device: torch.device = torch.device("cpu")
          ) -> Dict[str, torch.Tensor]:
    """``input_ids`` and ``labels``: the inputs themselves for a decoder (it shifts them); for an
    encoder's masked LM, 15% of the inputs masked and only those labelled (the others -100)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, MASK_ID, (batch, seq), generator=gen)
    if family not in ENCODERS:
        return {"input_ids": ids.to(device), "labels": ids.to(device)}
    masked = torch.rand(batch, seq, generator=gen) < 0.15
    return {"input_ids": ids.masked_fill(masked, MASK_ID).to(device), "labels": ids.masked_fill(~masked, -100).to(device)}


def loss(model: torch.nn.Module, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The training loss as users compute it: ``model(**inputs).loss``."""
    return model(**inputs).loss
