"""Hugging Face model configurations built in code, so that real model shapes plan with no
download: each is the ``config.json`` of a published checkpoint, as a plain dict.

No framework is imported here: a caller with ``transformers`` makes the config object, e.g.
``transformers.AutoConfig.for_model(*config_kwargs(model_config("llama3-8b")))`` (the command line
``python -m hyper_parallel.plan`` does), or ``LlamaConfig(**kwargs)``. A user's own ``config.json``
(a file, or a checkpoint folder holding one) reads the same way: :func:`load_config_json`.

    >>> cfg = model_config("llama3-8b")
    >>> cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    ('llama', 4096, 32, 8)
    >>> model_type, kwargs = config_kwargs(cfg)
    >>> model_type, "model_type" in kwargs
    ('llama', False)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import types
from typing import Any, Dict, Mapping, Tuple

__all__ = ["ModelConfig", "MODEL_CONFIGS", "model_config", "model_source", "load_config_json", "resolve_model",
           "config_kwargs"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A built-in configuration: ``fields`` as in the checkpoint's ``config.json`` (with
    ``model_type``), and the ``source`` it mirrors."""

    name: str
    fields: Mapping[str, Any]
    source: str
    #: approximate parameter count, for listings (the model's own count is the reference)
    params: str = ""


_LLAMA3_COMMON = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 8192,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}

#: The built-in configurations by name.
MODEL_CONFIGS: Mapping[str, ModelConfig] = types.MappingProxyType({
    "llama3-8b": ModelConfig(
        "llama3-8b",
        types.MappingProxyType({**_LLAMA3_COMMON, "hidden_size": 4096, "intermediate_size": 14336,
                                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}),
        "meta-llama/Meta-Llama-3-8B, config.json (Hugging Face Hub, April 2024)",
        "8.03B",
    ),
    "llama3-70b": ModelConfig(
        "llama3-70b",
        types.MappingProxyType({**_LLAMA3_COMMON, "hidden_size": 8192, "intermediate_size": 28672,
                                "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}),
        "meta-llama/Meta-Llama-3-70B, config.json (Hugging Face Hub, April 2024)",
        "70.55B",
    ),
    "qwen3-8b": ModelConfig(
        "qwen3-8b",
        types.MappingProxyType({
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 12288,
            "max_position_embeddings": 40960,
            "max_window_layers": 36,
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "vocab_size": 151936,
        }),
        "Qwen/Qwen3-8B, config.json (Hugging Face Hub, April 2025)",
        "8.19B",
    ),
    "mistral-7b": ModelConfig(
        "mistral-7b",
        types.MappingProxyType({
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
            "vocab_size": 32000,
        }),
        "mistralai/Mistral-7B-v0.1, config.json (Hugging Face Hub, September 2023; v0.3 differs: vocabulary "
        "32768, rope_theta 1e6, no sliding window)",
        "7.24B",
    ),
})


def model_config(name: str) -> Dict[str, Any]:
    """A fresh copy of the built-in configuration ``name`` (a dict with ``model_type``).

    >>> model_config("gpt-5")
    Traceback (most recent call last):
    ...
    ValueError: unknown model 'gpt-5'; the built-in configurations are llama3-8b, llama3-70b, qwen3-8b, mistral-7b, or give the path of a Hugging Face config.json
    """
    key = name.strip().lower().replace("_", "-")
    if key not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; the built-in configurations are {', '.join(MODEL_CONFIGS)}, "
                         "or give the path of a Hugging Face config.json")
    return copy.deepcopy(dict(MODEL_CONFIGS[key].fields))


def model_source(name: str) -> str:
    """The checkpoint a built-in configuration mirrors."""
    return MODEL_CONFIGS[name.strip().lower().replace("_", "-")].source


def load_config_json(path: str) -> Dict[str, Any]:
    """A Hugging Face ``config.json`` as a dict: ``path`` is the file or a folder holding it. It
    must name its ``model_type`` (how ``transformers`` knows the architecture)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the model config {file!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the model config {file!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"the model config {file!r} is not a JSON object")
    if not isinstance(data.get("model_type"), str):
        raise ValueError(f"the model config {file!r} has no model_type: give a Hugging Face config.json "
                         "(it names its architecture, e.g. \"model_type\": \"llama\")")
    return data


def resolve_model(spec: str) -> Tuple[str, Dict[str, Any], str]:
    """``(label, config, source)`` for a built-in name or a path to a ``config.json``.

    >>> label, cfg, source = resolve_model("Qwen3-8B")
    >>> label, cfg["num_hidden_layers"], source.split(",")[0]
    ('qwen3-8b', 36, 'Qwen/Qwen3-8B')
    """
    key = spec.strip().lower().replace("_", "-")
    if key in MODEL_CONFIGS:
        return key, model_config(key), MODEL_CONFIGS[key].source
    if os.path.exists(spec) or spec.endswith(".json"):
        return spec, load_config_json(spec), f"{spec} (a user's config.json)"
    return spec, model_config(spec), ""  # (raises: unknown name, with the list)


def config_kwargs(config: Mapping[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """``(model_type, the other fields)``: the arguments of ``transformers.AutoConfig.for_model``."""
    fields = copy.deepcopy(dict(config))
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError("the config has no model_type (a Hugging Face config names its architecture)")
    return model_type, fields
