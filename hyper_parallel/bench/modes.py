"""The activation-memory modes compared by the bench (SPEC section 5).

Each mode is a few lines on top of the public API; read them as recipes.

``checkpoint_wrapper`` modes (``MODES``)

=================  =============================================================
``none``           plain training, the baseline
``recompute``      every layer wrapped: whole-layer recompute
``funcrecompute``  ``attn.forward`` and ``mlp.forward`` of every layer wrapped
                   as functions: whole-function recompute
``save``           every layer wrapped with ``save_matmuls``: matmul outputs
                   saved, everything else recomputed
``funcsave``       ``save_matmuls`` on ``attn.forward`` / ``mlp.forward``
``swap``           every layer wrapped with ``swap_matmuls`` and
                   ``swap_inputs=True``; layers chained for offload/prefetch
``funcswap``       ``swap_matmuls`` on ``attn.forward`` / ``mlp.forward``;
                   layers chained for offload/prefetch
=================  =============================================================

``swap_wrapper`` modes (``SWAP_WRAPPER_MODES``)

=====================  =========================================================
``none``               plain training, the baseline
``swap``               every ``layer.attn`` wrapped: all it saves is swapped
``swap_with_policy``   the same, but only tensors of at least a size threshold
                       are swapped (``swap_if_at_least``); smaller ones saved
=====================  =========================================================

The library is imported lazily, so the ``none`` modes work without it.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

__all__ = [
    "MODES",
    "SWAP_WRAPPER_MODES",
    "DEFAULT_SWAP_THRESHOLD_BYTES",
    "MATMUL_OPS",
    "save_matmuls",
    "swap_matmuls",
    "swap_if_at_least",
    "chain_layers",
    "apply_mode",
    "apply_swap_wrapper_mode",
]

MODES = ("none", "recompute", "funcrecompute", "save", "funcsave", "swap", "funcswap")
SWAP_WRAPPER_MODES = ("none", "swap", "swap_with_policy")

# On the bench's default model (batch 4, seq 256, heads 4, dim 128, float32)
# one attention score / probability matrix is 4 MiB and every other tensor the
# attention saves is at most 1 MiB: a 4 MiB threshold swaps the former and keeps
# the latter.  The bench derives the threshold from its actual shape and dtype
# (``attention_matrix_bytes`` in ``hyper_parallel.bench.__main__``).
DEFAULT_SWAP_THRESHOLD_BYTES = 4 * 1024 * 1024


def _api():
    # Imported on first use so that the baseline runs without the library core.
    from hyper_parallel.core import activation_checkpoint

    return activation_checkpoint


def _matmul_ops():
    import torch

    aten = torch.ops.aten
    return frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default})


#: The matmul overloads the ``save`` / ``swap`` policies single out.  Note the
#: overloads (``aten.mm.default``), not the packets (``aten.mm``): a policy
#: function is called with an ``OpOverload``.  ``torch.matmul`` and
#: ``nn.Linear`` decompose into these before dispatch.
MATMUL_OPS = _matmul_ops()


def save_matmuls(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy: keep matmul outputs, recompute the rest.

    ``aten.mm`` / ``aten.addmm`` / ``aten.bmm`` outputs are saved (MUST_SAVE);
    every other op (layer norm, GELU, softmax, dropout, adds, views...) is
    re-run in backward (MUST_RECOMPUTE).  Expensive ops are not redone; cheap,
    memory-hungry element-wise results are.

    Usage::

        model.layers[i] = checkpoint_wrapper(layer, policy_fn=save_matmuls)
    """
    policy = _api().CheckpointPolicy
    if op in MATMUL_OPS:
        return policy.MUST_SAVE
    return policy.MUST_RECOMPUTE


def swap_matmuls(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy: swap matmul outputs, recompute the rest.

    Like ``save_matmuls`` but the matmul outputs are MUST_SWAP: cached in the
    swap manager, offloaded to host after the layer's forward and prefetched
    before its backward.  Offload only happens for layers chained with
    ``SwapManager().set_forward_prefetch_layer``; unchained it behaves like
    ``save_matmuls``.

    Usage::

        model.layers[i] = checkpoint_wrapper(layer, policy_fn=swap_matmuls, swap_inputs=True)
        SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
    """
    policy = _api().CheckpointPolicy
    if op in MATMUL_OPS:
        return policy.MUST_SWAP
    return policy.MUST_RECOMPUTE


def swap_if_at_least(threshold_bytes: int) -> Callable:
    """A ``swap_wrapper`` policy: swap tensors of at least ``threshold_bytes``.

    Returns ``policy_fn(tensor)`` giving MUST_SWAP when
    ``tensor.numel() * tensor.element_size() >= threshold_bytes`` and MUST_SAVE
    otherwise: large activations (attention scores / probabilities) go to the
    host, small ones stay, which saves most memory for few transfers.

    Usage::

        layer.attn = swap_wrapper(layer.attn, policy_fn=swap_if_at_least(4 << 20))
    """
    threshold = int(threshold_bytes)
    if threshold < 0:
        raise ValueError(f"threshold_bytes must be >= 0, got {threshold_bytes}")

    def policy_fn(tensor):
        policy = _api().CheckpointPolicy
        if tensor.numel() * tensor.element_size() >= threshold:
            return policy.MUST_SWAP
        return policy.MUST_SAVE

    policy_fn.threshold_bytes = threshold
    policy_fn.__name__ = f"swap_if_at_least_{threshold}"
    policy_fn.__doc__ = f"MUST_SWAP for tensors of at least {threshold} bytes, else MUST_SAVE."
    return policy_fn


def chain_layers(layers) -> None:
    """Declare the forward order of ``layers`` to the swap manager.

    After this a layer's swapped activations are offloaded when the next layer
    has run its forward and prefetched when the next layer starts its backward;
    the last layer is never offloaded.
    """
    manager = _api().SwapManager()
    layers = list(layers)
    for i in range(len(layers) - 1):
        manager.set_forward_prefetch_layer(layers[i], layers[i + 1])


def _wrap_functions(model: nn.Module, policy_fn=None, swap_inputs: bool = False) -> None:
    checkpoint_wrapper = _api().checkpoint_wrapper
    for layer in model.layers:
        for sub in (layer.attn, layer.mlp):
            # A bound method in, a callable out, stored on the instance so that
            # ``sub(...)`` (nn.Module.__call__) runs the wrapped function.
            if policy_fn is None and not swap_inputs:
                sub.forward = checkpoint_wrapper(sub.forward)
            else:
                sub.forward = checkpoint_wrapper(sub.forward, policy_fn=policy_fn, swap_inputs=swap_inputs)


def _wrap_layers(model: nn.Module, policy_fn=None, swap_inputs: bool = False) -> None:
    checkpoint_wrapper = _api().checkpoint_wrapper
    for i, layer in enumerate(model.layers):
        if policy_fn is None and not swap_inputs:
            model.layers[i] = checkpoint_wrapper(layer)
        else:
            model.layers[i] = checkpoint_wrapper(layer, policy_fn=policy_fn, swap_inputs=swap_inputs)


def apply_mode(model: nn.Module, mode: str, *, swap_wrapper: bool = False,
               swap_threshold_bytes: Optional[int] = None) -> nn.Module:
    """Apply ``mode`` to ``model`` (in place) and return it.

    ``mode`` is one of ``MODES``, or of ``SWAP_WRAPPER_MODES`` when
    ``swap_wrapper`` is true (see ``apply_swap_wrapper_mode``).  ``model`` must
    have ``.layers`` whose items have ``.attn`` and ``.mlp`` sub-modules.
    """
    if swap_wrapper:
        return apply_swap_wrapper_mode(model, mode, swap_threshold_bytes=swap_threshold_bytes)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "none":
        return model
    if mode == "recompute":
        _wrap_layers(model)
    elif mode == "funcrecompute":
        _wrap_functions(model)
    elif mode == "save":
        _wrap_layers(model, policy_fn=save_matmuls)
    elif mode == "funcsave":
        _wrap_functions(model, policy_fn=save_matmuls)
    elif mode == "swap":
        _wrap_layers(model, policy_fn=swap_matmuls, swap_inputs=True)
        chain_layers(model.layers)
    elif mode == "funcswap":
        _wrap_functions(model, policy_fn=swap_matmuls, swap_inputs=True)
        chain_layers(model.layers)
    return model


def apply_swap_wrapper_mode(model: nn.Module, mode: str, *,
                            swap_threshold_bytes: Optional[int] = None) -> nn.Module:
    """Apply one of ``SWAP_WRAPPER_MODES`` to ``model`` (in place) and return it.

    ``swap_threshold_bytes`` (default ``DEFAULT_SWAP_THRESHOLD_BYTES``) is the
    size from which ``swap_with_policy`` swaps a tensor.
    """
    if mode not in SWAP_WRAPPER_MODES:
        raise ValueError(f"unknown swap_wrapper mode {mode!r}; expected one of {', '.join(SWAP_WRAPPER_MODES)}")
    if mode == "none":
        return model
    swap_wrapper = _api().swap_wrapper
    if mode == "swap":
        for layer in model.layers:
            layer.attn = swap_wrapper(layer.attn)
    else:  # swap_with_policy
        threshold = DEFAULT_SWAP_THRESHOLD_BYTES if swap_threshold_bytes is None else swap_threshold_bytes
        policy_fn = swap_if_at_least(threshold)
        for layer in model.layers:
            layer.attn = swap_wrapper(layer.attn, policy_fn=policy_fn)
    chain_layers(model.layers)
    return model
