"""Finding a model's layer stack: the repeated blocks that ``wrap_layers`` wraps and chains (and
that a memory planner plans per layer).

A layer stack is an ``nn.ModuleList`` or ``nn.ModuleDict`` whose blocks all have one class:
``model.model.layers`` in Hugging Face decoders, ``transformer.h`` in GPT-2, ``layers`` (an
``nn.ModuleDict``) in torchtitan. A stack inside a block of another stack (an MoE layer's list of
experts) is part of that block, not a candidate. Of the candidates the longest is the model's
layer stack; none, or two of the same length (an encoder and a decoder), is a ``ValueError`` that
names the candidates and says what to pass instead.
"""

from __future__ import annotations

from typing import List, NamedTuple, Union

from torch import nn

__all__ = ["LayerStack", "find_layer_stack"]


class LayerStack(NamedTuple):
    """A model's layer stack, as :func:`find_layer_stack` found it.

    - ``path``: its attribute path from the model (``"model.layers"``; ``""`` when the model is
      the stack itself), so that ``model.get_submodule(path) is layers``;
    - ``layers``: the ``nn.ModuleList`` / ``nn.ModuleDict`` itself (what ``wrap_layers`` takes);
    - ``block``: the class of its blocks (after wrapping: the wrapped class).
    """

    path: str
    layers: Union[nn.ModuleList, nn.ModuleDict]
    block: type


def _blocks(container: nn.Module) -> List[nn.Module]:
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def _inside(path: str, other: str) -> bool:
    """Whether the module at ``path`` lies below the module at ``other`` (``""``: the model)."""
    return path != other and (other == "" or path.startswith(other + "."))


def _describe(path: str, container: nn.Module) -> str:
    blocks = _blocks(container)
    kinds = sorted({type(b).__name__ for b in blocks})
    return f"`{path or '<the model>'}` ({len(blocks)} x {' / '.join(kinds) or 'nothing'})"


def find_layer_stack(model: nn.Module) -> LayerStack:
    """The layer stack of ``model``: the longest ``nn.ModuleList`` / ``nn.ModuleDict`` whose blocks
    all have one class, outside the blocks of any other such stack.

    A ``ValueError`` names the candidates when there is none (lists of mixed classes are named
    too) or when two of the longest have the same length; pass the stack you mean to
    ``wrap_layers`` (or ``wrap_model(model, layers=...)``) then.

    Example::

        >>> import torch
        >>> from hyper_parallel.integrations import find_layer_stack
        >>> titan = torch.nn.Module()
        >>> titan.layers = torch.nn.ModuleDict({str(i): torch.nn.GELU() for i in range(4)})
        >>> titan.heads = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        >>> find_layer_stack(titan).path
        'layers'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_layer_stack expects an nn.Module, got {type(model).__name__}")
    uniform, mixed = [], []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        blocks = _blocks(module)
        if not blocks:
            continue
        (uniform if len({type(b) for b in blocks}) == 1 else mixed).append((path, module))
    # A stack inside a block of another stack (an MoE layer's experts) belongs to that block.
    outer = [(path, module) for path, module in uniform if not any(_inside(path, other) for other, _ in uniform)]
    if not outer:
        seen = "; found only lists of mixed classes: " + ", ".join(_describe(p, m) for p, m in mixed) if mixed else ""
        raise ValueError(f"find_layer_stack: {type(model).__name__} has no nn.ModuleList / nn.ModuleDict of blocks of "
                         f"one class{seen}. Pass its layers to wrap_layers yourself (e.g. wrap_layers(model.blocks)), "
                         "or wrap_model(model, layers=...).")
    longest = max(len(_blocks(m)) for _, m in outer)
    best = [(p, m) for p, m in outer if len(_blocks(m)) == longest]
    if len(best) > 1:
        raise ValueError(f"find_layer_stack: {type(model).__name__} has {len(best)} layer stacks of {longest} blocks: "
                         + ", ".join(_describe(p, m) for p, m in best)
                         + ". Say which one: wrap each with wrap_layers (e.g. wrap_layers(model."
                         + f"{best[0][0]})), or wrap_model(model, layers=model.{best[0][0]}).")
    path, layers = best[0]
    return LayerStack(path, layers, type(_blocks(layers)[0]))
