"""A small GPT for the tests and the benchmarks, written so that what recompute and swap see is easy to reason about:
attention by hand (``torch.matmul`` + ``masked_fill`` + softmax: ``aten.mm`` / ``addmm`` / ``bmm`` reach the dispatcher,
where a policy can target them); one causal-mask buffer passed by keyword to every layer (a tensor shared by all layers,
which a swap system must keep on the device); the head tied to the token embedding (a parameter used twice); dropout on
by default (bit-exactness of recompute tested with RNG). Deterministic: ``GPT(cfg, seed)`` draws from a private
generator, ``make_batch(cfg, batch, seed)`` likewise, and ``train_steps`` seeds dropout per step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, ClassVar, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.backends.torch.phase_trace import ModelFactory


@dataclass
class GPTConfig:
    """Shape of the model: ``vocab`` tokens (the head is tied to their embedding), width ``dim``, ``heads`` attention
    heads, ``layers`` blocks in ``model.layers``, ``seq`` the longest sequence (the mask buffer is ``(seq, seq)``), the
    feed-forward's hidden width ``mlp_ratio * dim``, the ``dropout`` of attention and residual branches. Checked: every
    size >= 1, ``dim`` divisible by ``heads``, dropout in [0, 1)."""

    vocab: int = 512
    dim: int = 256
    heads: int = 4
    layers: int = 4
    seq: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.1
    SIZES: ClassVar[Tuple[str, ...]] = ("vocab", "dim", "heads", "layers", "seq", "mlp_ratio")

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.dim % self.heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        for field in self.SIZES:
            if int(getattr(self, field)) < 1:
                raise ValueError(f"{name}.{field} must be >= 1, got {getattr(self, field)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{name}.dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    """Multi-head causal self-attention, written out op by op."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` is boolean, True where a position must NOT be attended."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)  # three views of one tensor
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        if mask.shape[-1] != t or mask.shape[-2] != t:
            mask = mask[:t, :t]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        scores = scores.masked_fill(mask, float("-inf"))
        probs = self.attn_drop(torch.softmax(scores, dim=-1))
        out = torch.matmul(probs, v)  # (b, heads, t, head_dim)
        out = out.transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(out))


class MLP(nn.Module):
    """Position-wise feed-forward block: Linear, GELU, Linear, dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.dim
        self.fc = nn.Linear(cfg.dim, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask=mask)
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """Token + position embeddings, ``cfg.layers`` blocks, final norm, tied head."""

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        # PyTorch's default init draws from the global RNG; it is overwritten by
        # reset_parameters below, so restore the global RNG afterwards.
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
            self.pos_emb = nn.Embedding(cfg.seq, cfg.dim)
            self.drop = nn.Dropout(cfg.dropout)
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.dim)
            self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        mask = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).triu(diagonal=1)
        self.register_buffer("mask", mask)  # True = future position, masked out
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic GPT-2 style init from ``seed`` (global RNG untouched)."""
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        std = 0.02
        proj_std = std / math.sqrt(2 * self.cfg.layers)

        def normal_(p: torch.Tensor, s: float) -> None:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(s))

        normal_(self.tok_emb.weight, std)
        normal_(self.pos_emb.weight, std)
        for layer in self.layers:
            for ln in (layer.ln1, layer.ln2):
                ln.weight.fill_(1.0)
                ln.bias.zero_()
            for lin, s in ((layer.attn.qkv, std), (layer.attn.proj, proj_std), (layer.mlp.fc, std),
                           (layer.mlp.proj, proj_std)):
                normal_(lin.weight, s)
                lin.bias.zero_()
        self.ln_f.weight.fill_(1.0)
        self.ln_f.bias.zero_()

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(batch, t, vocab)``; the mean cross-entropy if ``targets`` is given."""
        _, t = tokens.shape
        if t > self.cfg.seq:
            raise ValueError(f"sequence length {t} exceeds cfg.seq={self.cfg.seq}")
        pos = torch.arange(t, device=tokens.device)
        h = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for layer in self.layers:
            h = layer(h, mask=self.mask)
        logits = self.head(self.ln_f(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def model_factory(cfg: Optional[GPTConfig] = None) -> ModelFactory:
    """The GPT of ``cfg`` (default: the bench's, ``GPTConfig()``) as the target planner's model
    factory: built with as few layers as the planner traces, its loss the cross-entropy on the
    batch's own tokens. On the command line::

        python -m hyper_parallel.plan hyper_parallel.bench.model:model_factory --seq 256 --precision fp32 --target this

    >>> model_factory(GPTConfig(layers=6)).layers
    6
    """
    cfg = cfg if cfg is not None else GPTConfig()
    return ModelFactory(lambda layers: GPT(replace(cfg, layers=layers)), cfg.layers,
                        lambda model, ids: model(ids, ids), name=f"bench GPT ({cfg.layers} layers, dim {cfg.dim})")


def make_batch(cfg: GPTConfig, batch: int, seed: int, device: Any = "cpu"):
    """A deterministic ``(tokens, targets)`` pair, both int64 ``(batch, cfg.seq)``: arithmetic progressions modulo
    ``vocab`` with a random start and stride in ``[1, 4]``, the targets the next tokens (the stride can only be read
    from the context: attention has something to learn)."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 5, (batch, 1), generator=gen)
    pos = torch.arange(cfg.seq + 1).unsqueeze(0)
    seqs = (start + stride * pos) % cfg.vocab
    tokens = seqs[:, :-1].contiguous().to(device)
    targets = seqs[:, 1:].contiguous().to(device)
    return tokens, targets


def train_steps(model: nn.Module, steps: int, batch: int, lr: float, seed: int, device: Any = "cpu",
                meter: Any = None, times: Optional[List[float]] = None,
                on_step: Optional[Callable[[int, float], None]] = None) -> List[float]:
    """Train ``model`` (a :class:`GPT`, wrapped or not) ``steps`` steps of the benchmark harness (SGD) on
    ``make_batch(cfg, batch, seed + i)``, dropout seeded from ``seed + i``, and return the losses. ``meter`` wraps the
    loop (a context manager, or ``meter(model, optimizer)`` returning one); ``times`` receives each step's forward +
    backward seconds; ``on_step(i, loss)`` is called after each step. Example::

        >>> len(train_steps(GPT(GPTConfig(vocab=64, dim=32, heads=2, layers=2, seq=16)), 2, batch=2, lr=0.1, seed=0))
        2
    """
    from hyper_parallel.bench.harness import Variant, optimizer_for, train_step

    v = Variant("train_steps", "none", model, optimizer_for(model, lr))
    if meter is not None and not hasattr(meter, "__enter__") and not callable(meter):
        raise TypeError(f"meter must be a context manager or a callable, got {type(meter)!r}")
    ctx = meter if hasattr(meter, "__enter__") else meter(model, v.optimizer) if meter else contextlib.nullcontext()
    model.train()
    with ctx:
        for step in range(int(steps)):
            loss, seconds, _ = train_step(v, make_batch(model.cfg, batch, seed + step, device=device), seed + step,
                                          device)
            v.losses.append(loss)
            if times is not None:
                times.append(seconds)
            if on_step is not None:
                on_step(step, loss)
    return v.losses


class ResidualMLP(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))`` on ``(..., dim)`` inputs: the block of :class:`SmallOpsNet` (and of the pipeline
    example)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class SmallOpsNet(nn.Module):
    """``blocks`` :class:`ResidualMLP` blocks in ``.layers`` on ``(batch, dim)`` inputs; the loss is the mean square of
    the output. A block saves about eight small tensors, so the cost per saved tensor dominates a step: the model of
    ``benchmarks/swap_overhead.py``. Deterministic from ``seed`` (the global RNG untouched);
    ``model(*model.make_batch(batch, seed))`` is a loss."""

    def __init__(self, blocks: int = 48, dim: int = 32, hidden: int = 64, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            self.layers = nn.ModuleList(ResidualMLP(dim, hidden) for _ in range(blocks))
        self.dim = dim

    def make_batch(self, batch: int, seed: int, device: Any = "cpu") -> Tuple[torch.Tensor]:
        """A deterministic ``(x,)`` of shape ``(batch, dim)`` (the runner's batch form)."""
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        return (torch.randn(batch, self.dim, generator=gen).to(device),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()
