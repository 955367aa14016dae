"""``TorchPlatform``: what the framework-neutral core asks of PyTorch."""

from __future__ import annotations

import sys
import weakref
from typing import Any, List

import torch
from torch.utils._pytree import tree_leaves

from hyper_parallel.platform.base import PlatformBase

from . import _shim
from .tensor_ops import TorchTensorOps

__all__ = ["TorchPlatform"]


class TorchPlatform(PlatformBase):
    name = "torch"

    def __init__(self) -> None:
        super().__init__(TorchTensorOps())

    def pipeline_swap(self, *args: Any, **kwargs: Any) -> Any:
        from .pipeline import pipeline_swap
        return pipeline_swap(*args, **kwargs)

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
