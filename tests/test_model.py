"""Fast checks of the bench / test model (hyper_parallel.bench.model)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.bench.model import GPT, Block, GPTConfig, make_batch, train_steps

TINY = dict(vocab=64, dim=32, heads=2, layers=2, seq=16)


def tiny(**overrides):
    return GPTConfig(**{**TINY, **overrides})


def test_loss_decreases_without_dropout():
    model = GPT(tiny(dropout=0.0), seed=0)
    losses = train_steps(model, steps=8, batch=8, lr=0.3, seed=0, device="cpu")  # (SGD)
    assert len(losses) == 8
    assert all(isinstance(v, float) for v in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    # mostly monotone: the trend is down, not noise
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= 6, losses


def test_training_is_reproducible_bitwise_with_dropout():
    cfg = tiny(dropout=0.1)
    a = train_steps(GPT(cfg, seed=3), steps=3, batch=4, lr=1e-3, seed=7, device="cpu")
    b = train_steps(GPT(cfg, seed=3), steps=3, batch=4, lr=1e-3, seed=7, device="cpu")
    assert a == b
    c = train_steps(GPT(cfg, seed=3), steps=3, batch=4, lr=1e-3, seed=8, device="cpu")
    assert a != c


def test_init_is_deterministic_and_global_rng_untouched():
    cfg = tiny()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = GPT(cfg, seed=5).state_dict()
    assert torch.equal(state, torch.get_rng_state())
    torch.manual_seed(99)
    b = GPT(cfg, seed=5).state_dict()
    c = GPT(cfg, seed=6).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.qkv.weight"], c["layers.0.attn.qkv.weight"])


def test_mask_buffer_reaches_every_layer_by_keyword():
    model = GPT(tiny(), seed=0)
    seen = []

    def pre_hook(module, args, kwargs):
        seen.append((len(args), set(kwargs), kwargs.get("mask")))

    handles = [layer.register_forward_pre_hook(pre_hook, with_kwargs=True) for layer in model.layers]
    tokens, _ = make_batch(model.cfg, 2, seed=0)
    model(tokens)
    for h in handles:
        h.remove()
    assert len(seen) == len(model.layers)
    for nargs, keys, mask in seen:
        assert nargs == 1
        assert keys == {"mask"}
        assert mask is model.mask  # the buffer itself, shared by every layer


def test_mask_is_causal_boolean_buffer():
    cfg = tiny()
    model = GPT(cfg, seed=0)
    assert "mask" in dict(model.named_buffers())
    assert "mask" in model.state_dict()
    m = model.mask
    assert m.dtype == torch.bool and m.shape == (cfg.seq, cfg.seq)
    expected = torch.ones(cfg.seq, cfg.seq).triu(1).bool()  # True = future = masked
    assert torch.equal(m, expected)
    # the mask stays boolean through a dtype cast of the model
    assert model.to(torch.bfloat16).mask.dtype == torch.bool


def test_block_mask_is_keyword_only():
    cfg = tiny()
    block = Block(cfg)
    x = torch.randn(2, cfg.seq, cfg.dim)
    mask = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).triu(1)
    assert block(x, mask=mask).shape == x.shape
    with pytest.raises(TypeError):
        block(x, mask)


def test_head_weight_tied_to_token_embedding():
    model = GPT(tiny(), seed=0)
    assert model.head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names  # deduplicated
    tokens, targets = make_batch(model.cfg, 2, seed=0)
    model(tokens, targets).backward()
    # the tied weight gets gradient from both uses
    assert model.tok_emb.weight.grad is not None
    before = model.tok_emb.weight.detach().clone()
    train_steps(model, steps=1, batch=2, lr=1e-2, seed=0, device="cpu")
    assert torch.equal(model.head.weight, model.tok_emb.weight)
    assert not torch.equal(before, model.tok_emb.weight)


def test_attention_is_built_from_visible_matmuls():
    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    model = GPT(tiny(), seed=0)
    tokens, _ = make_batch(model.cfg, 2, seed=0)
    with Record():
        model(tokens)
    aten = torch.ops.aten
    names = {str(op) for op in ops}
    assert aten.addmm.default in ops  # qkv / proj / fc
    assert aten.bmm.default in ops  # q @ k^T and probs @ v
    assert aten.masked_fill.Scalar in ops
    assert not any("scaled_dot_product" in n for n in names)
    # two attention bmm per layer
    assert sum(op is aten.bmm.default for op in ops) == 2 * model.cfg.layers


def test_make_batch_is_deterministic_next_token():
    cfg = tiny()
    t1, y1 = make_batch(cfg, 3, seed=11)
    t2, y2 = make_batch(cfg, 3, seed=11)
    t3, _ = make_batch(cfg, 3, seed=12)
    assert t1.shape == y1.shape == (3, cfg.seq)
    assert t1.dtype == torch.long
    assert torch.equal(t1, t2) and torch.equal(y1, y2)
    assert not torch.equal(t1, t3)
    assert torch.equal(t1[:, 1:], y1[:, :-1])
    assert int(t1.min()) >= 0 and int(t1.max()) < cfg.vocab


def test_forward_shapes_and_shorter_sequences():
    cfg = tiny()
    model = GPT(cfg, seed=0).eval()
    tokens, targets = make_batch(cfg, 2, seed=0)
    assert model(tokens).shape == (2, cfg.seq, cfg.vocab)
    assert model(tokens, targets).shape == ()
    short = model(tokens[:, :5])
    # causal: the first 5 positions do not depend on later tokens
    assert torch.allclose(short, model(tokens)[:, :5], atol=1e-6)
    with pytest.raises(ValueError):
        model(torch.zeros(1, cfg.seq + 1, dtype=torch.long))


def test_config_validation():
    with pytest.raises(ValueError):
        GPTConfig(dim=30, heads=4)
    with pytest.raises(ValueError):
        GPTConfig(layers=0)
    with pytest.raises(ValueError):
        GPTConfig(dropout=1.0)


def test_train_steps_meter_and_times():
    entered = []

    class Meter:
        def __init__(self, model, opt):
            self.args = (model, opt)

        def __enter__(self):
            entered.append("enter")
            return self

        def __exit__(self, *exc):
            entered.append("exit")
            return False

    made = []

    def factory(model, opt):
        m = Meter(model, opt)
        made.append(m)
        return m

    model = GPT(tiny(), seed=0)
    times, steps = [], []
    losses = train_steps(model, 2, 2, 1e-3, 0, "cpu", meter=factory, times=times,
                         on_step=lambda i, loss: steps.append((i, loss)))
    assert entered == ["enter", "exit"]
    assert made[0].args[0] is model and isinstance(made[0].args[1], torch.optim.SGD)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert steps == list(enumerate(losses))
