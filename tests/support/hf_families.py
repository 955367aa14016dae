"""Hugging Face model families built from small configs in code (no download), as users train
them: train mode, the library's defaults (the KV cache on for decoders), ``model(input_ids=...,
labels=...).loss``. Shared by the planner's tests over families and by ``benchmarks/planner.py``.

Example::

    >>> model = build("llama")
    >>> ids = batch(model, batch=2, seq=16, seed=0)
    >>> float(model(input_ids=ids, labels=ids).loss) > 0
    True
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import transformers

VOCAB = 512


def _decoder(config_cls: Callable[..., object], model_cls: Callable[..., torch.nn.Module], **extra) -> Callable[..., torch.nn.Module]:
    def make(layers: int = 4, hidden: int = 64) -> torch.nn.Module:
        cfg = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2)
        cfg.update(extra)
        return model_cls(config_cls(**cfg))
    return make


def _gpt2(layers: int = 4, hidden: int = 64) -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2))


def _bert(layers: int = 4, hidden: int = 64) -> torch.nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=hidden * 4, max_position_embeddings=512, pad_token_id=0))


def _modernbert(layers: int = 4, hidden: int = 64) -> torch.nn.Module:
    return transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=hidden * 3, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2, local_attention=32))


FAMILIES: Dict[str, Callable[..., torch.nn.Module]] = {
    "llama": _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": _decoder(transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=32),
    "phi3": _decoder(transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "qwen3": _decoder(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, head_dim=16),
    "qwen3_moe": _decoder(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, head_dim=16,
                          moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "gemma2": _decoder(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, head_dim=16, sliding_window=32),
    "gemma3": _decoder(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, head_dim=16,
                       sliding_window=32),
    "gpt2": _gpt2,
    "bert": _bert,
    "modernbert": _modernbert,
}


def build(name: str, *, layers: int = 4, hidden: int = 64, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised ``name`` model in train mode (same seed, same weights)."""
    torch.manual_seed(seed)
    return FAMILIES[name](layers=layers, hidden=hidden).train()


def batch(model: torch.nn.Module, *, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Token ids for ``model`` (the special ids 0-2 left out)."""
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The training loss as users compute it (labels = inputs: causal LM, or masked LM on all)."""
    return model(input_ids=ids, labels=ids).loss
