"""A small GPT-like ``nn.Cell`` for the MindSpore tests, the modes the RFC compares, and a
deterministic training loop.

Written so that what checkpointing and swapping see is easy to reason about:

* attention is written op by op (``nn.Dense`` -> ``MatMul``/``BiasAdd``, ``mint.matmul`` ->
  ``MatMulExt``, an additive causal mask, ``ops.softmax`` -> ``Softmax``), so a policy can
  single out the matmuls by ``op.name``;
* the causal mask is one tensor that ``GPT.construct`` passes, by keyword, to every layer (shared
  by all layers);
* dropout is on (``nn.Dropout``; on CPU the kernel keeps its own RNG state).

Only ops with CPU kernels in MindSpore 2.10 are used (``mint.nn.functional.layer_norm`` and
``mint`` dropout / random ops have none there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops

MODES = ("none", "recompute", "funcrecompute", "save", "funcsave", "swap", "funcswap", "saveall")
SWAP_WRAPPER_MODES = ("none", "swap", "swap_with_policy")

#: what the "save matmuls" / "swap matmuls" policies single out (by ``op.name``)
MATMUL_OPS = frozenset({"MatMul", "MatMulExt", "BatchMatMul", "BatchMatMulExt"})


@dataclass
class Config:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 3
    seq: int = 16
    dropout: float = 0.1
    mlp_ratio: int = 4


def _init(shape: Tuple[int, ...], rng: np.random.RandomState, scale: float = 0.02) -> Tensor:
    return Tensor((rng.randn(*shape) * scale).astype(np.float32))


def _dense(n_in: int, n_out: int, rng: np.random.RandomState, has_bias: bool = True) -> nn.Dense:
    return nn.Dense(n_in, n_out, weight_init=_init((n_out, n_in), rng),
                    bias_init=Tensor(np.zeros(n_out, np.float32)) if has_bias else "zeros",
                    has_bias=has_bias)


class Attention(nn.Cell):
    def __init__(self, cfg: Config, rng: np.random.RandomState) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.qkv = _dense(cfg.dim, 3 * cfg.dim, rng)
        self.proj = _dense(cfg.dim, cfg.dim, rng)
        self.attn_drop = nn.Dropout(p=cfg.dropout)
        self.resid_drop = nn.Dropout(p=cfg.dropout)

    def construct(self, x: Tensor, mask: Tensor) -> Tensor:
        b, s, d = x.shape
        qkv = self.qkv(x).reshape(b, s, 3, self.heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = mint.matmul(q, k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(self.head_dim))
        scores = scores + mask[:s, :s]
        probs = self.attn_drop(ops.softmax(scores, -1))
        out = mint.matmul(probs, v).transpose(0, 2, 1, 3).reshape(b, s, d)
        return self.resid_drop(self.proj(out))


class MLP(nn.Cell):
    def __init__(self, cfg: Config, rng: np.random.RandomState) -> None:
        super().__init__()
        self.fc1 = _dense(cfg.dim, cfg.mlp_ratio * cfg.dim, rng)
        self.fc2 = _dense(cfg.mlp_ratio * cfg.dim, cfg.dim, rng)
        self.drop = nn.Dropout(p=cfg.dropout)

    def construct(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(ops.gelu(self.fc1(x))))


class Block(nn.Cell):
    def __init__(self, cfg: Config, rng: np.random.RandomState) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm((cfg.dim,))
        self.attn = Attention(cfg, rng)
        self.ln2 = nn.LayerNorm((cfg.dim,))
        self.mlp = MLP(cfg, rng)

    def construct(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Cell):
    def __init__(self, cfg: Config, seed: int = 0) -> None:
        super().__init__()
        rng = np.random.RandomState(seed)
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim, embedding_table=_init((cfg.vocab, cfg.dim), rng))
        self.pos = Parameter(_init((cfg.seq, cfg.dim), rng), name="pos")
        self.drop = nn.Dropout(p=cfg.dropout)
        self.layers = nn.CellList([Block(cfg, rng) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm((cfg.dim,))
        self.head = _dense(cfg.dim, cfg.vocab, rng, has_bias=False)
        self.mask = Tensor(np.triu(np.full((cfg.seq, cfg.seq), -1e9, np.float32), 1))

    def construct(self, idx: Tensor, targets: Tensor) -> Tensor:
        b, s = idx.shape
        x = self.drop(self.tok(idx) + self.pos[:s])
        for layer in self.layers:
            x = layer(x, mask=self.mask)
        logits = self.head(self.ln_f(x))
        return ops.cross_entropy(logits.reshape(b * s, -1), targets.reshape(b * s))


def make_batch(cfg: Config, batch: int, seed: int) -> Tuple[Tensor, Tensor]:
    rng = np.random.RandomState(1000 + seed)
    data = rng.randint(0, cfg.vocab, size=(batch, cfg.seq + 1)).astype(np.int32)
    return Tensor(data[:, :-1]), Tensor(data[:, 1:])


def build(mode: str = "none", swap_wrapper_mode: Optional[str] = None, seed: int = 0,
          swap_threshold_bytes: Optional[int] = None, **cfg: Any) -> GPT:
    """Seed MindSpore, build the model (dropout kernels are seeded at construction), apply a mode."""
    ms.set_seed(seed)
    model = GPT(Config(**cfg), seed=seed)
    model.set_train(True)
    if swap_wrapper_mode is not None:
        return apply_swap_wrapper_mode(model, swap_wrapper_mode, swap_threshold_bytes)
    return apply_mode(model, mode)


# ------------------------------------------------------------------------------ the modes
def _api() -> Any:
    from hyper_parallel.core import activation_checkpoint
    return activation_checkpoint


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    policy = _api().CheckpointPolicy
    return policy.MUST_SAVE if op.name in MATMUL_OPS else policy.MUST_RECOMPUTE


def save_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The RFC's "save" mode: MUST_SAVE for every op (LayerNorm, BiasAdd, Dropout... included)."""
    return _api().CheckpointPolicy.MUST_SAVE


def swap_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    policy = _api().CheckpointPolicy
    return policy.MUST_SWAP if op.name in MATMUL_OPS else policy.MUST_RECOMPUTE


def swap_if_at_least(threshold_bytes: int) -> Callable[[Tensor], Any]:
    def policy_fn(t: Tensor) -> Any:
        policy = _api().CheckpointPolicy
        return policy.MUST_SWAP if t.nbytes >= threshold_bytes else policy.MUST_SAVE
    return policy_fn


def chain_layers(layers: Any) -> None:
    manager = _api().SwapManager()
    layers = list(layers)
    for i in range(len(layers) - 1):
        manager.set_forward_prefetch_layer(layers[i], layers[i + 1])


def _wrap_functions(model: GPT, policy_fn: Any = None, swap_inputs: bool = False) -> None:
    wrap = _api().checkpoint_wrapper
    for layer in model.layers:
        for sub in (layer.attn, layer.mlp):
            # a bound method in, a callable out, stored on the instance: Cell.__call__ runs it
            object.__setattr__(sub, "construct", wrap(sub.construct, policy_fn=policy_fn, swap_inputs=swap_inputs))


def _wrap_layers(model: GPT, policy_fn: Any = None, swap_inputs: bool = False) -> None:
    wrap = _api().checkpoint_wrapper
    for layer in model.layers:
        wrap(layer, policy_fn=policy_fn, swap_inputs=swap_inputs)  # wraps the Cell in place


def apply_mode(model: GPT, mode: str) -> GPT:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    if mode == "recompute":
        _wrap_layers(model)
    elif mode == "funcrecompute":
        _wrap_functions(model)
    elif mode == "save":
        _wrap_layers(model, policy_fn=save_matmuls)
    elif mode == "funcsave":
        _wrap_functions(model, policy_fn=save_matmuls)
    elif mode == "saveall":
        _wrap_layers(model, policy_fn=save_everything)
    elif mode == "swap":
        _wrap_layers(model, policy_fn=swap_matmuls, swap_inputs=True)
        chain_layers(model.layers)
    elif mode == "funcswap":
        _wrap_functions(model, policy_fn=swap_matmuls, swap_inputs=True)
        chain_layers(model.layers)
    return model


def apply_swap_wrapper_mode(model: GPT, mode: str, threshold: Optional[int] = None) -> GPT:
    if mode not in SWAP_WRAPPER_MODES:
        raise ValueError(f"unknown swap_wrapper mode {mode!r}")
    if mode == "none":
        return model
    wrap = _api().swap_wrapper
    policy_fn = None if mode == "swap" else swap_if_at_least(threshold if threshold is not None else 12000)
    for layer in model.layers:
        # in place: assigning a sub-cell as an attribute (layer.attn = ...) makes MindSpore
        # re-prefix its parameter names ("attn.qkv.weight"), wrapped or not
        wrap(layer.attn, policy_fn=policy_fn)
    chain_layers(model.layers)
    return model


# ------------------------------------------------------------------------------ training
def train(model: GPT, steps: int = 3, batch: int = 4, lr: float = 0.05, seed: int = 0,
          on_step: Optional[Callable[[int], None]] = None) -> Tuple[List[float], Dict[str, np.ndarray]]:
    """SGD for ``steps`` steps; returns the losses and the final gradients (by parameter name)."""
    opt = nn.SGD(model.trainable_params(), learning_rate=lr)
    grad_fn = ms.value_and_grad(model, None, opt.parameters)
    losses: List[float] = []
    grads_by_name: Dict[str, np.ndarray] = {}
    for step in range(steps):
        idx, tgt = make_batch(model.cfg, batch, seed + step)
        loss, grads = grad_fn(idx, tgt)
        losses.append(float(loss.asnumpy()))
        grads_by_name = {p.name: g.asnumpy() for p, g in zip(opt.parameters, grads)}
        opt(grads)
        if on_step is not None:
            on_step(step)
    return losses, grads_by_name
