"""find_layer_stack: a model's layer stack (the longest nn.ModuleList / nn.ModuleDict of blocks
of one class, outside other stacks' blocks), or a clear error naming the candidates; and the
SelfCheckpointing seam a model library's integration plugs its layers into."""

import doctest

import pytest
import torch
from torch import nn

import hyper_parallel.core.wrapping as wrapping
import hyper_parallel.integrations as integrations
import hyper_parallel.integrations.layer_stack as layer_stack
from hyper_parallel.bench.model import GPT, GPTConfig
from hyper_parallel.core.activation_checkpoint import wrap_layers
from hyper_parallel.integrations import LayerStack, find_layer_stack


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(8))  # longer than the stack, but inside its blocks


class Decoder(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(8, 4)
        self.model.layers = nn.ModuleList(MoEBlock() for _ in range(layers))
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 8)])  # same class, shorter


def test_the_stack_of_decoders_gpt2_and_torchtitan():
    model = Decoder()
    stack = find_layer_stack(model)
    assert isinstance(stack, LayerStack)
    assert stack.path == "model.layers" and stack.layers is model.model.layers and stack.block is MoEBlock
    assert model.get_submodule(stack.path) is stack.layers
    gpt = GPT(GPTConfig(vocab=16, dim=8, heads=2, layers=3, seq=8))
    assert find_layer_stack(gpt).path == "layers"
    titan = nn.Module()
    titan.layers = nn.ModuleDict({str(i): Expert() for i in range(4)})
    assert find_layer_stack(titan) == ("layers", titan.layers, Expert)
    stack_itself = nn.ModuleList(Expert() for _ in range(2))
    assert find_layer_stack(stack_itself).path == ""
    # After wrapping, the stack is found the same way (its blocks share the wrapped class).
    wrap_layers(gpt.layers)
    found = find_layer_stack(gpt)
    assert found.path == "layers" and found.block.__name__ == "CheckpointedBlock"


def test_no_stack_or_a_tie_is_a_value_error_naming_the_candidates():
    with pytest.raises(ValueError, match=r"has no nn.ModuleList / nn.ModuleDict of blocks of one class; found only "
                                         r"lists of mixed classes: `mixed` \(2 x Embedding / Linear\)"):
        model = nn.Module()
        model.mixed = nn.ModuleList([nn.Linear(2, 2), nn.Embedding(2, 2)])
        find_layer_stack(model)
    with pytest.raises(ValueError, match=r"has no nn.ModuleList"):
        find_layer_stack(nn.Linear(2, 2))
    t5 = nn.Module()
    t5.encoder, t5.decoder = nn.Module(), nn.Module()
    t5.encoder.block = nn.ModuleList(Expert() for _ in range(3))
    t5.decoder.block = nn.ModuleList(MoEBlock() for _ in range(3))
    with pytest.raises(ValueError, match=r"has 2 layer stacks of 3 blocks: `encoder.block` \(3 x Expert\), "
                                         r"`decoder.block` \(3 x MoEBlock\). Say which one: .*wrap_model\(model, "
                                         r"layers=model.encoder.block\)"):
        find_layer_stack(t5)
    with pytest.raises(TypeError, match="expects an nn.Module"):
        find_layer_stack([nn.Linear(2, 2)])


class Selfish(nn.Module):
    """A block that decides itself when to checkpoint its forward, and calls the function it is
    handed for it (the shape of Hugging Face's GradientCheckpointingLayer)."""

    checkpoint_me = False

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = []

    def forward(self, x, note=None):
        if self.checkpoint_me and torch.is_grad_enabled():
            return self.run_checkpointed(lambda y: self.fc(y).relu(), x)
        return self.fc(x).relu()


class Hand:
    def __init__(self, run):
        self.run = run

    def __get__(self, obj, owner=None):
        return self if obj is None else (lambda fn, *args: self.run(obj, fn, *args))


def test_a_self_checkpointing_family_is_handed_our_checkpoint(monkeypatch):
    checked = []
    family = wrapping.SelfCheckpointing(
        Selfish, members=lambda kind, run: {"checkpoint_me": kind == "checkpoint", "run_checkpointed": Hand(run)},
        check=lambda module, kind: checked.append((id(module), kind)), anchor=None)
    monkeypatch.setattr(wrapping, "_FAMILIES", [])
    wrapping.register_self_checkpointing(family)
    torch.manual_seed(0)
    plain = nn.Sequential(Selfish(), Selfish())
    torch.manual_seed(0)
    model = nn.Sequential(Selfish(), Selfish())
    wrap_layers(model, policy_fn=lambda ctx, op, *a, **k: False, swap_inputs=False)
    assert set(checked) == {(id(model[0]), "checkpoint"), (id(model[1]), "checkpoint")}  # before wrapping
    layer = model[0]
    assert type(layer).__name__ == "CheckpointedSelfish" and "forward" not in type(layer).__dict__
    assert layer.checkpoint_me is True
    x0 = torch.randn(3, 4, requires_grad=True)
    x1 = x0.detach().clone().requires_grad_()
    plain(x0).sum().backward()
    model(x1).sum().backward()
    assert torch.equal(x0.grad, x1.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))
    with pytest.raises(TypeError, match="expects a SelfCheckpointing"):
        wrapping.register_self_checkpointing(Selfish)


@pytest.mark.parametrize("module", [integrations, layer_stack], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_public_surface():
    assert integrations.__all__ == ["LayerStack", "find_layer_stack"]
