"""Integrations with model code, outside the engine (they may import torch and the library they
integrate; ``hyper_parallel.core`` imports neither).

- :func:`find_layer_stack` (torch): a model's layer stack, the longest ``nn.ModuleList`` /
  ``nn.ModuleDict`` of blocks of one class, as a :class:`LayerStack` (its attribute path, the
  stack, the block class).
- :mod:`hyper_parallel.integrations.transformers` (imports ``transformers``; ``pip install -e
  '.[hf]'``): ``wrap_model(model, ...)``, one call that finds a Hugging Face model's layer stack
  and wraps it through the model's own gradient-checkpointing hook. Imported on its own (it is
  not imported here, so that this package stays usable, and cheap, without ``transformers``).

Example::

    >>> import torch
    >>> from hyper_parallel.integrations import find_layer_stack
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = torch.nn.Embedding(16, 8)
    ...         self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    >>> stack = find_layer_stack(Net())
    >>> stack.path, len(stack.layers), stack.block.__name__
    ('blocks', 3, 'Linear')
"""

from hyper_parallel.integrations.layer_stack import LayerStack, find_layer_stack

__all__ = ["LayerStack", "find_layer_stack"]
