"""Does the online trainer learn? The RLVR check of the TRL policy trainer on this CPU.

SmolLM2-135M-Instruct is trained by `dynamicrubric.training` (TRL's GRPOTrainer, the verifiable reward:
reasoning-gym's own checker) on easy arithmetic prompts; its avg@k on held-out prompts is measured
before and after with the same sampling seeds, and the paired difference gets a 95% bootstrap
interval over prompts (bench/stats.py). The config is bench/study/learns.yaml.

    python -m bench.learns [--config bench/study/learns.yaml] [--out bench/results/learns_verifiable.json]

Writes the JSON (config, steps, prompts, samples, accuracies with intervals, the difference, the
per-step training curve) and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
import time
from pathlib import Path

import pandas as pd

from bench.stats import bootstrap_mean, paired_difference
from dynamicrubric import tasks
from dynamicrubric.engines import load_engine
from dynamicrubric.evaluation.evaluate import check_samples
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import Config
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.scoring.rollout import sample_rollouts
from dynamicrubric.training import launcher
from dynamicrubric.training.data import TrainingJob
from dynamicrubric.training.monitoring import timing_frame

HERE = Path(__file__).parent
EVAL_SEED = 12345  # the same sampling seed before and after training: a paired comparison


def per_prompt_accuracy(cfg: Config, model: str, prompts: pd.DataFrame) -> pd.Series:
    """avg@k per held-out prompt: the checker's mean score over evaluate.samples samples."""
    engine = load_engine(str(resolve_model(model)), cfg.engine)
    sampling = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"k": cfg.evaluate.samples})})
    rollouts = sample_rollouts(engine, prompts, sampling, seed=EVAL_SEED, policy=model)
    scored = check_samples(rollouts, prompts, cfg.evaluate.sandbox_timeout_s)
    return scored.groupby("prompt_id")["score"].mean().reindex(prompts["prompt_id"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "study" / "learns.yaml"))
    parser.add_argument("--out", default=str(HERE / "results" / "learns_verifiable.json"))
    parser.add_argument("--work", default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    work = Path(args.work or tempfile.mkdtemp(prefix="learns-"))
    work.mkdir(parents=True, exist_ok=True)
    train_prompts = tasks.configured_prompts(cfg.data, "train")
    eval_prompts = tasks.configured_prompts(cfg.data, "eval")
    write_artifact(str(work / "prompts.parquet"), "prompts", train_prompts)
    policy = cfg.models.policy
    timings = {}

    started = time.perf_counter()
    before = per_prompt_accuracy(cfg, policy, eval_prompts)
    timings["eval_before_s"] = time.perf_counter() - started

    started = time.perf_counter()
    result = launcher.launch(
        cfg,
        TrainingJob(
            "train-policy",
            prompts_uri=str(work / "prompts.parquet"),
            policy=policy,
            out_uri=str(work / "policy"),
            steps_uri=str(work / "steps"),
            metrics_uri=str(work / "metrics.parquet"),
            round_idx=1,
        ),
    )
    timings["train_s"] = time.perf_counter() - started

    started = time.perf_counter()
    after = per_prompt_accuracy(cfg, str(work / "policy"), eval_prompts)
    timings["eval_after_s"] = time.perf_counter() - started

    # time/step_s comes with the result: the metrics artifact holds what a rerun reproduces
    metrics = pd.concat([read_frame(str(work / "metrics.parquet"), "metrics"), timing_frame(result)])
    curve = {
        name: group.sort_values("step")["value"].round(6).tolist()
        for name, group in metrics.groupby("name")
        if name in ("reward_mean", "reward_std", "kl", "frac_reward_zero_std", "entropy", "time/step_s")
    }
    t = cfg.train_policy
    result = {
        "what": "held-out avg@k of SmolLM2-135M-Instruct before and after online GRPO with the verifiable reward",
        "command": "python -m bench.learns",
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, 2 cores (shared with other work)",
        "config": cfg.model_dump(mode="json"),
        "steps": t.max_steps,
        "prompts_per_step": t.prompts_per_step,
        "samples_per_prompt": cfg.rollout.k,
        "training_completions": t.max_steps * t.prompts_per_step * cfg.rollout.k,
        "train_pool": len(train_prompts),
        "held_out_prompts": len(eval_prompts),
        "eval_samples_per_prompt": cfg.evaluate.samples,
        "accuracy_before": bootstrap_mean(before.to_numpy()),
        "accuracy_after": bootstrap_mean(after.to_numpy()),
        "difference": paired_difference(after.to_numpy(), before.to_numpy()),
        "curve": curve,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    d = result["difference"]
    print(
        f"accuracy {result['accuracy_before']['mean']:.3f} -> {result['accuracy_after']['mean']:.3f}; "
        f"difference {d['mean']:+.3f} [95% CI {d['low']:+.3f}, {d['high']:+.3f}] over {d['n']} prompts"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
