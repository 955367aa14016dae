"""The target planner's step time on "this machine", against the same step measured.

Calibrates this CPU (``calibrate_this_machine``: a micro-benchmark of matmuls and copies), predicts
one training step with ``plan_for_target`` (the roofline of the ops traced on the meta device),
and times the same step for real on one thread with the planner's clock, for three models: the
bench GPT (a model factory: hand-written attention, dropout, tied head) and two Hugging Face
decoders (a Llama with grouped-query attention, a Qwen3 with norms on queries and keys), each
width 512. Calibration and measurement alternate ``--rounds`` times, so that a slow stretch of a
shared machine does not land on one side only; the median ratio per model is the figure
(target: within 20%). A benchmark, not a test: it times things.

    python benchmarks/target_step_time.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable, Dict, Tuple

import torch

from hyper_parallel.backends.torch.calibrate import calibrate_this_machine
from hyper_parallel.backends.torch.hf_trace import build_model
from hyper_parallel.bench.model import GPT, GPTConfig, model_factory
from hyper_parallel.plan.target_planner import plan_for_target
from hyper_parallel.tools.clock import no_gc, step_clock

HF = {
    "llama": {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4000,
              "max_position_embeddings": 1024, "tie_word_embeddings": False},
    "qwen3": {"model_type": "qwen3", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 4000,
              "max_position_embeddings": 1024, "tie_word_embeddings": False},
}


def _models(seq: int) -> Dict[str, Tuple[Any, torch.nn.Module, Callable[[torch.nn.Module, torch.Tensor], Any]]]:
    """name -> (what the planner plans, the real model, its loss on a batch of ids)."""
    cfg = GPTConfig(vocab=4000, dim=512, heads=8, layers=4, seq=seq)
    out = {"bench-gpt": (model_factory(cfg), GPT(cfg), lambda m, ids: m(ids, ids))}
    for name, config in HF.items():
        out[name] = (config, build_model(config, config["num_hidden_layers"], torch.float32, "cpu"),
                     lambda m, ids: m(input_ids=ids, labels=ids, use_cache=False).loss)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--models", default="bench-gpt,llama,qwen3")
    args = ap.parse_args()
    torch.set_num_threads(1)  # (the planner's clock is the process's CPU time on one thread)
    clock = step_clock("cpu")
    models = _models(args.seq)
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in models]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; use {', '.join(models)}")
    ratios: Dict[str, list] = {name: [] for name in chosen}
    for name in chosen:
        _, model, loss = models[name]
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 4000, (args.batch, args.seq))

        def step_seconds() -> float:
            with no_gc():
                t0 = clock()
                loss(model, ids).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return clock() - t0

        step_seconds()  # (warm-up: the optimizer's and the allocator's first-step work)
        for _ in range(args.rounds):
            here = calibrate_this_machine("cpu")
            predicted = plan_for_target(models[name][0], seq=args.seq, batch=args.batch, grad_accum=1,
                                        precision="fp32", optimizer="sgd", dp=1, fsdp=1, reshard_after_forward=True,
                                        pp=1, recipe="none", budget=None, target=here)["step_s"]
            measured = min(step_seconds() for _ in range(2))
            ratios[name].append(predicted / measured)
            print(f"{name}: predicted {predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms "
                  f"({100 * (ratios[name][-1] - 1):+.1f}%)", flush=True)
    for name in chosen:
        median = statistics.median(ratios[name])
        print(f"{name}: median predicted / measured - 1 = {100 * (median - 1):+.1f}% "
              f"[{'ok' if abs(median - 1) <= 0.2 else 'MISS'}: within 20%]")


if __name__ == "__main__":
    main()
