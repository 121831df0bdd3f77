"""Training throughput of the GRPO stage (train-policy): full finetune vs LoRA, in tokens/s.

Runs the real stage (`train_policy`: artifacts in, checkpoint folder out) on synthetic rollouts of a
fixed size and reads the per-step `tokens_per_s` metric (prompt + completion tokens through forward
and backward per second of optimiser step). The first step is dropped as warm-up; the median of the
rest is reported, with the stage's wall time end to end (model load, the no-grad reference pass, the
steps, and writing the checkpoint).

    python -m bench.bench_train                                  # tiny-random
    python -m bench.bench_train --model smollm2-135m-instruct    # SmolLM2-135M

Results for each model are merged into bench/results/train.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench import RESULTS, machine_info, print_table, write_result
from dynamicrubric.artifacts import read_frame, write_artifact
from dynamicrubric.config import TrainConfig
from dynamicrubric.train import train_policy

WORDS = [
    "the",
    "answer",
    "is",
    "a",
    "of",
    "to",
    "and",
    "we",
    "add",
    "two",
    "numbers",
    "so",
    "first",
    "then",
    "result",
    "equals",
    "check",
    "step",
]


def synthetic(folder: Path, prompts: int, k: int, words: int, seed: int) -> tuple[str, str]:
    """`prompts` x `k` rollouts of about `words` words each, with random scores in [0, 1]."""
    rng = random.Random(seed)
    rollouts, scores = [], []
    for p in range(prompts):
        prompt = f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}? Explain each step briefly."
        for s in range(k):
            response = " ".join(rng.choice(WORDS) for _ in range(words))
            rollouts.append(
                {"prompt_id": f"p{p}", "sample_idx": s, "prompt": prompt, "response": response,
                 "num_tokens": words, "finish_reason": "stop", "policy": "bench", "seed": seed}
            )  # fmt: skip
            scores.append(
                {
                    "prompt_id": f"p{p}",
                    "rubric_idx": 0,
                    "sample_idx": s,
                    "score": rng.random(),
                    "num_items": 1,
                }
            )
    write_artifact(str(folder / "rollouts.parquet"), "rollouts", rollouts)
    write_artifact(str(folder / "scores.parquet"), "scores", scores)
    return str(folder / "rollouts.parquet"), str(folder / "scores.parquet")


def run(model: str, mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rollouts, scores = synthetic(folder, args.prompts, args.k, args.words, seed=0)
        cfg = TrainConfig(
            learning_rate=1e-5,
            micro_batch_size=args.micro_batch,
            grad_accum=1,
            lora_rank=args.lora_rank if mode == "lora" else 0,
            gradient_checkpointing=args.gradient_checkpointing,
        )
        t = time.perf_counter()
        train_policy(
            rollouts, scores, model, str(folder / "ckpt"), cfg, metrics_uri=str(folder / "m.parquet")
        )
        wall = time.perf_counter() - t
        m = read_frame(str(folder / "m.parquet"), "metrics")
        per_step = m[m["name"] == "tokens_per_s"].sort_values("step")["value"].tolist()
    steady = per_step[1:] or per_step
    return {
        "mode": mode,
        "steps": len(per_step),
        "tokens_per_s": statistics.median(steady),
        "tokens_per_s_per_step": per_step,
        "stage_wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--k", type=int, default=4, help="responses per prompt")
    ap.add_argument("--words", type=int, default=48, help="words per response (about 1-2 tokens each)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    args = ap.parse_args()

    runs = [run(args.model, mode, args) for mode in ("full", "lora")]
    import torch

    entry = {
        "model": args.model,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "rows": f"{args.prompts} prompts x {args.k} responses, ~{args.words} words each",
        "micro_batch": args.micro_batch,
        "lora_rank": args.lora_rank,
        "gradient_checkpointing": args.gradient_checkpointing,
        "runs": runs,
        # the machines are shared: a high load average means the numbers are lower bounds
        "load_average_1m_at_end": os.getloadavg()[0],
    }
    path = RESULTS / "train.json"
    result = json.loads(path.read_text()) if path.exists() else {"benchmark": "train", "models": {}}
    result["machine"] = machine_info()
    result["models"][args.model] = entry
    print_table(
        [("model", args.model), ("rows", entry["rows"]), ("micro-batch", args.micro_batch)]
        + [(f"{r['mode']} tokens/s (median of {r['steps'] - 1} steps)", r["tokens_per_s"]) for r in runs]
        + [(f"{r['mode']} stage wall time, s", r["stage_wall_s"]) for r in runs]
    )
    print("wrote", write_result("train", result))


if __name__ == "__main__":
    main()
