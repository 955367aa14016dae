"""The Hugging Face example: a Llama decoder built from a small config (random weights, nothing
downloaded), wrapped and chained with one wrap_layers call, trains bit-exactly."""

import importlib.util
import os

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra: pip install -e '.[hf]'")

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_transformers.py")


def load_example():
    spec = importlib.util.spec_from_file_location("hf_transformers_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_decoder_with_swapped_matmuls_trains_bit_exact(capsys):
    assert load_example().main(["--steps", "2", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "losses True, parameters True" in out
    offloaded = float(out.split("swapped: ")[1].split(" MiB")[0])
    assert offloaded > 0
