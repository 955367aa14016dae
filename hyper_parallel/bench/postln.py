"""A post-LN transformer with ``nn.MultiheadAttention`` and a ReLU feed-forward block: the shape of the original
HyperParallel activation-checkpoint tests (16 layers), scaled down for a CPU. Each layer is ``x = norm1(x + drop(attn(x,
x, x)))`` then ``x = norm2(x + drop(mlp(x)))``; the model has the bench GPT's interface (``.layers`` of blocks with
``.attn`` and ``.mlp`` taking ``(x, *, mask)``; ``forward(tokens, targets)`` is the loss; ``cfg.vocab``, ``cfg.seq``),
so every recipe applies and ``make_batch`` feeds it. ``need_weights`` (default True, what ``attn(x, x, x)`` does)
computes attention with ``bmm`` + softmax (ops a policy can save or swap); False calls SDPA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.bench.model import GPTConfig


@dataclass
class PostLNConfig(GPTConfig):
    """:class:`~hyper_parallel.bench.model.GPTConfig`'s fields, its defaults scaled for a CPU, and whether attention is
    ``causal`` (future positions masked) and ``need_weights`` (bmm + softmax)."""

    dim: int = 256
    layers: int = 16
    seq: int = 128
    dropout: float = 0.0
    causal: bool = True
    need_weights: bool = True


class _SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` (batch first) called as self-attention; returns the output only."""

    def __init__(self, cfg: PostLNConfig) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(cfg.dim, cfg.heads, dropout=cfg.dropout, batch_first=True)
        self.need_weights = cfg.need_weights

    def forward(self, x: torch.Tensor, *, mask=None) -> torch.Tensor:
        if mask is not None and mask.shape[-1] != x.shape[1]:
            mask = mask[: x.shape[1], : x.shape[1]]
        return self.mha(x, x, x, attn_mask=mask, need_weights=self.need_weights)[0]


class PostLNLayer(nn.Module):
    """``norm1(x + drop(attn(x)))`` then ``norm2(x + drop(mlp(x)))``."""

    def __init__(self, cfg: PostLNConfig) -> None:
        super().__init__()
        self.attn = _SelfAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim), nn.ReLU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim))
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.drop1 = nn.Dropout(cfg.dropout)
        self.drop2 = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, *, mask=None) -> torch.Tensor:
        x = self.norm1(x + self.drop1(self.attn(x, mask=mask)))
        return self.norm2(x + self.drop2(self.mlp(x)))


class PostLNTransformer(nn.Module):
    """Token embedding, ``cfg.layers`` post-LN layers, an output head; deterministic from ``seed``."""

    def __init__(self, cfg: PostLNConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
            self.layers = nn.ModuleList(PostLNLayer(cfg) for _ in range(cfg.layers))
            self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
            nn.init.normal_(self.tok_emb.weight, std=1.0 / math.sqrt(cfg.dim))
        mask = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).triu(diagonal=1) if cfg.causal else None
        self.register_buffer("mask", mask)  # True = masked out (a future position)

    def forward(self, tokens: torch.Tensor, targets=None) -> torch.Tensor:
        h = self.tok_emb(tokens)
        for layer in self.layers:
            h = layer(h, mask=self.mask)
        logits = self.head(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
