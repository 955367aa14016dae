"""``MindSporePlatform``: what the framework-neutral core asks of MindSpore (PyNative)."""

from __future__ import annotations

import sys
import weakref
from typing import Any, List

from mindspore import Tensor, nn

from hyper_parallel.platform.base import PlatformBase

from . import _shim
from .tensor_ops import MindSporeTensorOps

__all__ = ["MindSporePlatform"]


class MindSporePlatform(PlatformBase):
    name = "mindspore"

    def __init__(self) -> None:
        super().__init__(MindSporeTensorOps())

    def pipeline_swap(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "pipeline_swap adapts torch.distributed.pipelining schedules; MindSpore has no such schedule "
            "object in PyNative. Drive hyper_parallel.core.activation_checkpoint.microbatch_schedule."
            "MicrobatchSwapSchedule by hand (forward_start/forward_end/backward_start/backward_end per "
            "microbatch, step_end per step), or use SwapManager's atomic API.")

    # ----------------------------------------------------------- layer chain hooks
    def check_layer(self, layer: Any) -> None:
        if not isinstance(layer, nn.Cell):
            raise TypeError(f"set_forward_prefetch_layer expects nn.Cell layers, got {type(layer).__name__}")

    def install_layer_hooks(self, layer: nn.Cell, chain: Any) -> List[Any]:
        self.check_layer(layer)

        def pre_hook(cell: nn.Cell, args: Any) -> None:
            if not _shim.in_backward():  # a recomputation re-runs forward: not a new forward
                chain.forward_start(cell)

        def post_hook(cell: nn.Cell, args: Any, output: Any) -> None:
            if _shim.in_backward():
                return
            # always_call=True: also runs when construct raised, to restore the current group.
            failed = sys.exc_info()[0] is not None or not _shim.recording_grad()
            if chain.forward_end(cell, failed):
                _arm_backward_start(cell, output, chain)

        return [layer.register_forward_pre_hook(pre_hook),
                layer.register_forward_hook(post_hook, always_call=True)]


def _leaves(x: Any) -> List[Any]:
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in _leaves(v)]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in _leaves(v)]
    return [x]


def _arm_backward_start(cell: nn.Cell, output: Any, chain: Any) -> None:
    """Call ``chain.backward_start(cell)`` once, when the gradient of the layer's output is ready,
    i.e. just before the layer's own backward starts."""
    outs = [t for t in _leaves(output)
            if isinstance(t, Tensor) and t._requires_grad]  # pylint: disable=protected-access
    if not outs:
        return
    ref = weakref.ref(cell)
    fired = [False]

    def on_grad(grad: Any) -> None:
        layer = ref()
        if not fired[0] and layer is not None:
            fired[0] = True
            chain.backward_start(layer)

    for t in outs:
        t.register_hook(on_grad)
