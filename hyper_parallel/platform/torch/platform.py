"""``TorchPlatform``: what the framework-neutral core asks of PyTorch."""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, List

import torch
from torch.utils._pytree import tree_leaves

from . import _shim
from .tensor_ops import TorchTensorOps

__all__ = ["TorchPlatform"]


class TorchPlatform:
    name = "torch"

    def __init__(self) -> None:
        self.tensor_ops = TorchTensorOps()

    # The swap engine calls tensor/stream operations on the platform directly.
    def __getattr__(self, item: str) -> Any:
        return getattr(self.tensor_ops, item)

    # ----------------------------------------------------------- public API backends
    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        from .checkpoint import checkpoint
        return checkpoint(*args, **kwargs)

    def checkpoint_wrapper(self, *args: Any, **kwargs: Any) -> Any:
        from .wrapper import checkpoint_wrapper
        return checkpoint_wrapper(*args, **kwargs)

    def swap_wrapper(self, *args: Any, **kwargs: Any) -> Any:
        from .wrapper import swap_wrapper
        return swap_wrapper(*args, **kwargs)

    def create_selective_checkpoint_contexts(self, *args: Any, **kwargs: Any) -> Any:
        from .sac import create_selective_checkpoint_contexts
        return create_selective_checkpoint_contexts(*args, **kwargs)

    def pipeline_swap(self, *args: Any, **kwargs: Any) -> Any:
        from .pipeline import pipeline_swap
        return pipeline_swap(*args, **kwargs)

    # ----------------------------------------------------------- lifecycle
    def on_storage_death(self, storage: Any, callback: Callable[[str], None], name: str) -> None:
        weakref.finalize(storage, callback, name)

    # ----------------------------------------------------------- layer chain hooks
    def check_layer(self, layer: Any) -> None:
        if not isinstance(layer, torch.nn.Module):
            raise TypeError(f"set_forward_prefetch_layer expects nn.Module layers, got {type(layer).__name__}")

    def install_layer_hooks(self, layer: torch.nn.Module, chain: Any) -> List[Any]:

        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            if not _shim.in_backward():  # a recomputation re-runs forward: not a new forward
                chain.forward_start(module)

        def post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if _shim.in_backward():
                return
            # always_call=True: also runs when forward raised, to restore the current group.
            failed = sys.exc_info()[0] is not None or not torch.is_grad_enabled()
            if chain.forward_end(module, failed):
                _arm_backward_start(module, output, chain)

        return [layer.register_forward_pre_hook(pre_hook),
                layer.register_forward_hook(post_hook, always_call=True)]


def _arm_backward_start(module: torch.nn.Module, output: Any, chain: Any) -> None:
    """Call ``chain.backward_start(module)`` once, when the gradient of the layer's output is
    ready, i.e. just before the layer's own backward starts."""
    outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs:
        return
    ref = weakref.ref(module)
    fired = [False]

    def on_grad(grad: torch.Tensor) -> None:
        layer = ref()
        if not fired[0] and layer is not None:
            fired[0] = True
            chain.backward_start(layer)

    for t in outs:
        t.register_hook(on_grad)
