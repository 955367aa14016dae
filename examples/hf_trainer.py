"""Training a wrapped Hugging Face decoder with the ``transformers`` ``Trainer``.

    pip install -e '.[hf]' accelerate     # the Trainer needs accelerate; nothing is downloaded
    python examples/hf_trainer.py [--steps 4] [--layers 4]

A Llama decoder is built from a small config with its defaults (``use_cache=True``), wrapped with
one ``wrap_model`` call (matmuls swapped to host memory, attention kept, the rest recomputed, the
layers' inputs swapped, consecutive layers chained), and trained by an unchanged ``Trainer`` next
to an unwrapped copy of the same model. The script checks that the logged losses and the final
parameters are equal, bit for bit, and prints how much went to host memory and back.

Leave the ``Trainer``'s own ``gradient_checkpointing`` off: the wrapped layers recompute already
(turning both on is a clear error that says so).
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from typing import Dict, List

import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling example

from hf_transformers import build, parse_args  # noqa: E402
from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, SwapManager  # noqa: E402
from hyper_parallel.integrations.transformers import wrap_model  # noqa: E402

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default}
ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default}


def policy_fn(ctx, op, *args, **kwargs):
    if op in MATMULS:
        return CheckpointPolicy.MUST_SWAP
    if op in ATTENTION:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (the labels are the inputs: causal language modelling)."""

    def __init__(self, count: int, length: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_args(out: str, steps: int) -> TrainingArguments:
    return TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)


def fit(model: LlamaForCausalLM, steps: int, out: str) -> List[float]:
    trainer = Trainer(model=model, args=trainer_args(out, steps),
                      train_dataset=Tokens(4 * steps, 32, model.config.vocab_size))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv=None) -> int:
    args = parse_args(argv, __doc__, steps=4)
    plain = build(args.layers)
    wrapped = wrap_model(copy.deepcopy(plain), policy_fn=policy_fn, swap_inputs=True)
    with tempfile.TemporaryDirectory() as out:
        reference = fit(plain, args.steps, out)
        losses = fit(wrapped, args.steps, out)
    same_losses = len(losses) == args.steps and losses == reference
    same_params = all(torch.equal(a, b) for a, b in zip(plain.parameters(), wrapped.parameters()))
    stats = SwapManager().stats()
    print("losses:", " ".join(f"{loss:.5f}" for loss in losses))
    print(f"equal to the unwrapped model: losses {same_losses}, parameters {same_params}")
    print(f"swapped: {stats['offloaded_bytes'] / 2**20:.2f} MiB offloaded, {stats['loaded_bytes'] / 2**20:.2f} MiB "
          "loaded back")
    return 0 if same_losses and same_params else 1


if __name__ == "__main__":
    raise SystemExit(main())
