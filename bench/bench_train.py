"""Where an online training step's time goes, and what scoring inside the reward function saves.

Runs the real train-policy stage (TRL GRPOTrainer, the dynamic reward: G writes a rubric per group,
V judges every item and completion) for `--steps` steps at `--prompts` × K completions, and splits
each step into generation, rubrics, judge, the rest of the reward (aggregation, artifacts) and the
update, from the per-step metrics the trainer records. The first step is warm-up; the others are
averaged. Then it runs the same stages on the last step's rollouts the way the standalone pipeline
would, one process each (`dynrubric stage rubrics | judge | aggregate`, every process loading its
model), and reports separate / in-reward as the ratio: the in-reward path keeps the generator and
verifier loaded across steps.

    python -m bench.bench_train                                  # tiny-random
    python -m bench.bench_train --model smollm2-135m-instruct    # SmolLM2-135M, 8 prompts x 8

Results are merged into bench/results/train.json by model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench import RESULTS, machine_info, print_table, write_result
from dynamicrubric import tasks, train
from dynamicrubric.artifacts import read_frame, write_artifact
from dynamicrubric.config import load_config

PARTS = (
    "time/generation_s",
    "time/rubrics_s",
    "time/judge_s",
    "time/reward_s",
    "time/update_s",
    "time/step_s",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    overrides = {
        "models": {"policy": args.model, "generator": args.model, "verifier": args.model},
        "data": {"num_prompts": max(args.prompts, 8)},
        "rollout": {"k": args.k, "max_new_tokens": args.max_new_tokens},
        "rubrics": {"max_new_tokens": 160, "max_response_chars": 300},
        "train_policy": {
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "micro_batch_size": 16 if args.prompts * args.k % 16 == 0 else args.k,
            "lora_rank": 16,
            "save_steps": args.steps,
        },
    }
    cfg = load_config(preset="local", overrides=overrides)
    info = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = str(work / "prompts.parquet")
        write_artifact(prompts, "prompts", tasks.configured_prompts(cfg.data, "train"))
        started = time.perf_counter()
        train.launch(
            "train-policy",
            cfg,
            prompts_uri=prompts,
            policy=args.model,
            generator=args.model,
            out_uri=str(work / "policy"),
            steps_uri=str(work / "steps"),
            metrics_uri=str(work / "metrics.parquet"),
            round_idx=1,
        )
        wall = time.perf_counter() - started
        metrics = read_frame(str(work / "metrics.parquet"), "metrics")
        timed = metrics[metrics["name"].isin(PARTS) & (metrics["step"] > 1)]
        per_step = timed.groupby("name")["value"].mean().to_dict()

        # The same scoring as separate stage processes, on the last step's rollouts.
        step = work / "steps" / f"step-{args.steps:05d}"
        config = work / "config.yaml"
        config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        out = work / "separate"
        commands = {
            "rubrics": ["rubrics", "--candidate-sets", str(step / "rollouts.parquet"), "--out", str(out / "rubrics.parquet")],
            "judge": ["judge", "--candidate-sets", str(step / "rollouts.parquet"), "--rubrics", str(out / "rubrics.parquet"),
                      "--out", str(out / "judgments.parquet")],
            "aggregate": ["aggregate", "--judgments", str(out / "judgments.parquet"), "--candidate-sets",
                          str(step / "rollouts.parquet"), "--rubrics", str(out / "rubrics.parquet"),
                          "--out-scores", str(out / "s.parquet"), "--out-rewards", str(out / "r.parquet"),
                          "--out-diagnostics", str(out / "d.parquet"), "--out-metrics", str(out / "m.parquet")],
        }  # fmt: skip
        separate = {}
        for name, command in commands.items():
            started = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "dynamicrubric.cli", "stage", *command, "--config", str(config)],
                check=True,
                capture_output=True,
            )
            separate[name] = time.perf_counter() - started

    in_reward = per_step.get("time/reward_s", float("nan"))
    result = {
        "what": "online train-policy step split (dynamic reward) and the reward vs separate stage processes",
        "command": f"python -m bench.bench_train --model {args.model}",
        "machine": info,
        "batch": f"{args.prompts} prompts x {args.k} completions, {args.max_new_tokens} new tokens, LoRA r=16",
        "steps_averaged": args.steps - 1,
        "per_step_s": {k.removeprefix("time/"): round(v, 2) for k, v in sorted(per_step.items())},
        "separate_stage_processes_s": {k: round(v, 2) for k, v in separate.items()},
        "separate_over_in_reward": round(sum(separate.values()) / in_reward, 2),
        "stage_wall_s": round(wall, 1),
    }
    path = RESULTS / "train.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged = {k: v for k, v in merged.items() if isinstance(v, dict) and "per_step_s" in v}
    merged[args.model] = result
    write_result("train", merged)
    print_table(
        [(f"per step: {k}", v) for k, v in result["per_step_s"].items()]
        + [(f"separate: {k}", v) for k, v in result["separate_stage_processes_s"].items()]
        + [("separate / in-reward", result["separate_over_in_reward"])]
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
