"""The Hugging Face examples: a Llama decoder built from a small config with its defaults (random
weights, nothing downloaded), wrapped with one call, trains bit-exactly by hand and with the
transformers Trainer."""

import dataclasses
import importlib.util
import os
import tempfile

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra: pip install -e '.[hf]'")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
NEEDS_ACCELERATE = pytest.mark.skipif(not HAS_ACCELERATE, reason="the transformers Trainer needs accelerate, which is "
                                                                  "not installed: pip install -e '.[hf]'")


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"{name}_example", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def swapped_mib(out):
    return float(out.split("swapped: ")[1].split(" MiB")[0])


def test_llama_decoder_with_its_defaults_and_swapped_matmuls_trains_bit_exact(capsys):
    assert load_example("hf_transformers").main(["--steps", "2", "--layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "use_cache=True" in out and "losses True, parameters True" in out
    assert swapped_mib(out) > 0


@NEEDS_ACCELERATE
@pytest.mark.slow
def test_the_trainer_trains_a_wrapped_llama_bit_exact(capsys):
    assert load_example("hf_trainer").main(["--steps", "2", "--layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "losses True, parameters True" in out
    assert swapped_mib(out) > 0


@NEEDS_ACCELERATE
def test_the_trainer_with_its_own_checkpointing_on_a_wrapped_model_is_a_clear_error():
    example = load_example("hf_trainer")
    model = example.wrap_model(example.build(2))
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    flag = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, max_steps=1, report_to=[], use_cpu=True,
                                              save_strategy="no", **{flag: True})
        trainer = transformers.Trainer(model=model, args=args, train_dataset=example.Tokens(4, 8, 256))
        with pytest.raises(ValueError, match="wrapped by hyper_parallel's checkpoint_wrapper; Hugging Face's gradient "
                                             "checkpointing cannot be switched on or off on it as well"):
            trainer.train()


@NEEDS_ACCELERATE
@pytest.mark.slow
def test_a_plan_made_from_one_trainer_batch_trains_bit_exact(capsys):
    assert load_example("hf_trainer_plan").main(["--steps", "2", "--layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "losses True, parameters True" in out
    assert "layer stack: LlamaForCausalLM.model.layers" in out and "predicted peak" in out
