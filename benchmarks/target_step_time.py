"""The target planner's step time on "this machine", against the same step measured.

Calibrates this CPU (``calibrate_this_machine``: a micro-benchmark of matmuls and copies), predicts
one training step of a small Llama-shaped Hugging Face model with ``plan_for_target`` (the roofline
of the ops traced on the meta device), and times the same step for real on one thread with the
planner's clock. Calibration and measurement alternate ``--rounds`` times, so that a slow stretch of
a shared machine does not land on one side only; the median ratio is the figure (target: within
20%). A benchmark, not a test: it times things.

    python benchmarks/target_step_time.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics

import torch

from hyper_parallel.backends.torch.calibrate import calibrate_this_machine
from hyper_parallel.backends.torch.hf_trace import build_model
from hyper_parallel.plan.target_planner import plan_for_target
from hyper_parallel.tools.clock import no_gc, step_clock

CONFIG = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4000,
          "max_position_embeddings": 1024, "tie_word_embeddings": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)  # (the planner's clock is the process's CPU time on one thread)
    model = build_model(CONFIG, CONFIG["num_hidden_layers"], torch.float32, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, CONFIG["vocab_size"], (args.batch, args.seq))
    clock = step_clock("cpu")

    def step_seconds() -> float:
        with no_gc():
            t0 = clock()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return clock() - t0

    step_seconds()  # (warm-up: the optimizer's and the allocator's first-step work)
    ratios = []
    for _ in range(args.rounds):
        here = calibrate_this_machine("cpu")
        predicted = plan_for_target(CONFIG, seq=args.seq, batch=args.batch, grad_accum=1, precision="fp32",
                                    optimizer="sgd", dp=1, fsdp=1, reshard_after_forward=True, pp=1, recipe="none",
                                    budget=None, target=here)["step_s"]
        measured = min(step_seconds() for _ in range(2))
        ratios.append(predicted / measured)
        print(f"predicted {predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms ({100 * (ratios[-1] - 1):+.1f}%)")
    median = statistics.median(ratios)
    print(f"median: predicted / measured - 1 = {100 * (median - 1):+.1f}% "
          f"[{'ok' if abs(median - 1) <= 0.2 else 'MISS'}: within 20%]")


if __name__ == "__main__":
    main()
