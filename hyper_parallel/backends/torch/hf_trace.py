"""One training step of a Hugging Face decoder, traced on the meta device, phase by phase.

The Hugging Face part of the target planner's trace (the part any model shares:
``phase_trace.py``): :func:`trace_step` builds the causal LM from its configuration with only as
many decoder layers as it takes to see every kind of layer after a first one (two for a Llama), on
the meta device (no memory, no weights, no download), in training mode with SDPA attention running
the target's fused kernel, and traces ``model(input_ids, labels=..., use_cache=False).loss`` and
its backward with :func:`~.phase_trace.trace_phases`. The loss head is Hugging Face's: it upcasts
the logits to float32 before the cross-entropy, and the trace sees it.

The step is traced in the compute dtype (``bfloat16`` for the mixed recipes: what FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16)`` runs); master weights, optimizer state and
communication buffers are the step model's (``planner/step_model.py``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch
import transformers  # (the target planner plans Hugging Face configs: the test/hf extra)
from transformers import AttentionInterface, AttentionMaskInterface, masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .meta_trace import FusedAttentionOnMeta
from .phase_trace import ModelFactory, TracedStep, decoder_layers, trace_phases, traced_layer_count
from hyper_parallel.planner.model_configs import config_kwargs

__all__ = ["trace_step", "build_model", "layer_kinds", "causal_lm_loss", "model_factory"]


def layer_kinds(config: Dict[str, Any]) -> List[str]:
    """The kind of every decoder layer: ``config["layer_types"]`` where the model has several
    (sliding-window and full attention, ...), else one kind, ``"decoder"``."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if isinstance(types, (list, tuple)) and len(types) >= layers:
        return [str(t) for t in types[:layers]]
    return ["decoder"] * layers


def fused_attention(kind: str) -> str:
    """The name of a Hugging Face attention implementation that is SDPA's (``sdpa_attention_forward``
    and ``sdpa_mask``) with ``F.scaled_dot_product_attention`` on meta tensors running the fused
    kernel of ``kind`` (:class:`~.meta_trace.FusedAttentionOnMeta`; real tensors: SDPA as it is).
    Registered as an implementation rather than entered around the step, so that a checkpoint's
    recompute in the backward takes the same kernel as the forward."""
    name = f"hyper_parallel_meta_{kind}"

    def forward(*args: Any, **kwargs: Any) -> Any:
        with FusedAttentionOnMeta(kind):
            return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, masking_utils.sdpa_mask)
    return name


def build_model(config: Dict[str, Any], layers: int, dtype: torch.dtype, device: Any = "meta",
                attention: Optional[str] = None) -> torch.nn.Module:
    """The Hugging Face causal LM of ``config`` with its first ``layers`` decoder layers, in
    ``dtype``, on ``device`` (the meta device: shapes only), in training mode, SDPA attention
    (``attention``: ``"cuda"`` or ``"cpu"``, the fused kernel that SDPA runs on meta tensors)."""

    model_type, kwargs = config_kwargs(config)
    kwargs["num_hidden_layers"] = layers
    if isinstance(kwargs.get("layer_types"), (list, tuple)):
        kwargs["layer_types"] = list(kwargs["layer_types"])[:layers]
    hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
    hf_config._attn_implementation = fused_attention(attention) if attention else "sdpa"
    with torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.train()


@contextlib.contextmanager
def _one_sequence_per_row_on_meta() -> Iterator[None]:
    """Hugging Face's mask code asks whether the position ids pack several sequences in a row
    (``masking_utils.find_packed_sequence_indices``), a question about the data that meta tensors
    cannot answer; the step's position ids are ``arange(seq)``, one sequence per row, whose answer
    is ``None``: give that answer for meta tensors."""
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find(position_ids: torch.Tensor) -> Any:
        return None if position_ids.device.type == "meta" else original(position_ids)

    masking_utils.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def causal_lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's training loss on ``ids`` (its own tokens as labels), on real or
    meta tensors (the one question about the data the mask code asks of meta tensors is answered:
    :func:`_one_sequence_per_row_on_meta`). The training loop keeps the loss only: the logits die
    with the output."""
    with _one_sequence_per_row_on_meta():
        return model(input_ids=ids, labels=ids, use_cache=False).loss


def _use_fused_attention(model: torch.nn.Module, kind: str) -> None:
    # (the implementation is looked up by name at every call: the recompute of a checkpoint set
    # inside the layer's forward, hf-gc, takes it as the forward does)
    model.config._attn_implementation = fused_attention(kind)


def model_factory(model: torch.nn.Module) -> ModelFactory:
    """A Hugging Face causal LM you have, as the target planner's model factory
    (``ModelFactory.from_model`` with :func:`causal_lm_loss`, the kinds of its layers, and SDPA
    running the target's fused kernel as :func:`build_model` sets it)."""
    kinds = layer_kinds(model.config.to_dict())
    return ModelFactory.from_model(model, causal_lm_loss, kinds=kinds,
                                   name=f"{type(model).__name__} ({len(kinds)} layers)",
                                   fused_attention=_use_fused_attention)


def trace_step(config: Dict[str, Any], *, seq: int, batch: int, dtype: torch.dtype, option: str,
               allocator: str = "cuda_caching", attention: str = "cuda", device: Any = "meta",
               model: Optional[torch.nn.Module] = None, accumulate: bool = False) -> TracedStep:
    """Trace one step of ``config``'s model (module docstring) under activation ``option``
    (``phase_trace.OPTIONS``). ``attention``: the fused attention kernel the target runs
    (:class:`~.meta_trace.FusedAttentionOnMeta`); ``device="cpu"`` with ``model`` runs the same
    phases on a real model (a measured profile, for comparing with a meta trace).
    ``accumulate``: the gradients exist before the step (``trace_phases``)."""
    kinds = layer_kinds(config)
    if model is None:
        model = build_model(config, traced_layer_count(kinds), dtype, device, attention)
    if len(decoder_layers(model)) > len(kinds):
        raise ValueError(f"the model has {len(decoder_layers(model))} decoder layers, the config {len(kinds)}")
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return trace_phases(model, lambda: causal_lm_loss(model, ids), kinds=kinds, option=option, allocator=allocator,
                        dtype=dtype, accumulate=accumulate)
