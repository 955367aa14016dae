"""Recompute + swap on a Hugging Face ``transformers`` decoder, built from a small config.

    pip install -e '.[hf]'            # transformers (random weights: nothing is downloaded)
    python examples/hf_transformers.py [--steps 3] [--layers 4]

One call, ``wrap_model(model, ...)``, finds the decoder's layer stack (``model.model.layers``),
wraps every layer (attention and MLP matmuls swapped to host memory, everything else recomputed,
the layers' inputs swapped) and chains consecutive layers. The model keeps its defaults,
``use_cache=True`` included: the layers are checkpointed through Hugging Face's own hook, so a
checkpointed layer uses no KV cache in training (Hugging Face's rule and its one-time warning)
and generation uses it as usual. The script trains a few steps next to an unwrapped copy of the
same model and checks that losses, gradients and parameters are equal, then prints the bytes that
went to host memory and back. ``examples/hf_trainer.py`` does the same with the ``Trainer``.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, SwapManager
from hyper_parallel.integrations.transformers import wrap_model

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


def swap_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SWAP if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def build(layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")  # its defaults otherwise: use_cache=True
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def train(model: LlamaForCausalLM, steps: int) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=False)
    return losses


def parse_args(argv, doc: str, steps: int, **extra: dict) -> argparse.Namespace:
    """The examples' command line (``--steps``, ``--layers``, and ``extra`` options), with torch
    on one intra-op thread: the same reduction order in both models, so results compare bitwise."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--layers", type=int, default=4)
    for flag, options in extra.items():
        parser.add_argument(flag, **options)
    torch.set_num_threads(1)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv, __doc__, steps=3)
    plain = build(args.layers)
    wrapped = wrap_model(copy.deepcopy(plain), policy_fn=swap_matmuls, swap_inputs=True)

    reference = train(plain, args.steps)
    losses = train(wrapped, args.steps)
    same_losses = all(torch.equal(a, b) for a, b in zip(reference, losses))
    same_params = all(torch.equal(a, b) for a, b in zip(plain.parameters(), wrapped.parameters()))
    stats = SwapManager().stats()
    kept = {str(reason): nbytes for reason, nbytes in stats["kept_bytes"].items()}
    print(f"model defaults: use_cache={wrapped.config.use_cache}")
    print("losses:", " ".join(f"{loss.item():.5f}" for loss in losses))
    print(f"equal to the unwrapped model: losses {same_losses}, parameters {same_params}")
    print(f"swapped: {stats['offloaded_bytes'] / 2**20:.2f} MiB offloaded, {stats['loaded_bytes'] / 2**20:.2f} MiB "
          f"loaded back; kept on device: {kept}")
    return 0 if same_losses and same_params else 1


if __name__ == "__main__":
    raise SystemExit(main())
