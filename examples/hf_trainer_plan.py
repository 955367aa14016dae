"""Plan a Hugging Face model's activation memory for the ``Trainer``, from one batch of its dataloader.

    pip install -e '.[hf]'                # transformers + accelerate; nothing is downloaded
    python examples/hf_trainer_plan.py [--steps 4] [--layers 4] [--budget 3MiB]

A Llama decoder built from a small config (its defaults, ``use_cache=True``) is handed to an
unchanged ``Trainer``. Before ``train()``, ``plan_memory`` profiles one step on the first batch the
Trainer's dataloader yields (found in the model: ``model.model.layers``), chooses per layer what
to keep, recompute or swap so that the step peaks at ``--budget`` (default: halfway between the
smallest reachable peak and the peak with nothing wrapped), and the plan is applied in place.
The Trainer then trains as usual; the script checks the losses and the final parameters against an
unwrapped copy trained the same way, bit for bit, and prints the plan's report.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
from transformers import Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling example

import hyper_parallel.integrations.transformers  # noqa: E402,F401  (hands HF layers our checkpoint)
from hf_trainer import Tokens, fit, trainer_args  # noqa: E402
from hf_transformers import build, parse_args  # noqa: E402
from hyper_parallel.core.activation_checkpoint import plan_memory  # noqa: E402


def main(argv=None) -> int:
    args = parse_args(argv, __doc__, steps=4,
                      **{"--budget": {"default": None, "help": "bytes or e.g. 3MiB (default: halfway, see above)"}})
    plain = build(args.layers)
    planned = copy.deepcopy(plain)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model=planned, args=trainer_args(out, args.steps),
                          train_dataset=Tokens(4 * args.steps, 32, planned.config.vocab_size))
        batch = next(iter(trainer.get_train_dataloader()))  # one batch, as the Trainer feeds it

        def step_fn() -> None:
            planned(**batch).loss.backward()

        budget = args.budget
        if budget is None:  # a first plan only to read the range of budgets worth planning
            span = plan_memory(planned, step_fn, "1TiB")
            budget = (span.min_budget_bytes + span.reference_peak_bytes) // 2
        plan = plan_memory(planned, step_fn, budget)
        plan.apply()
        print(plan.report())
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        reference = fit(plain, args.steps, out)
    same_losses = len(losses) == args.steps and losses == reference
    same_params = all(torch.equal(a, b) for a, b in zip(plain.parameters(), planned.parameters()))
    print("losses:", " ".join(f"{loss:.5f}" for loss in losses))
    print(f"equal to the unwrapped model: losses {same_losses}, parameters {same_params}")
    return 0 if same_losses and same_params else 1


if __name__ == "__main__":
    raise SystemExit(main())
