"""Does the online generator trainer learn? R_disc of G_0 and G_1 on held-out candidate sets.

P_0 (SmolLM2-135M-Instruct) samples K responses for the training prompts and for held-out prompts,
which become candidate sets (the standalone rollout and candidates stages, with reference rankings
from verifiable outcomes). G_0 is trained online on the training sets (`dynamicrubric.train`:
TRL's GRPOTrainer, R_disc + λ·R_anchor, soft verdicts, rubrics decoded under their JSON schema) into
G_1. Then G_0 and G_1 each write rubrics for the held-out sets with the same seed, the frozen
verifier judges them, and aggregation gives per set: R_disc, tie rate, uniformity and Δgap (the
signal audit of the pipeline, run by the same stage code). Paired differences over sets get 95%
bootstrap intervals (bench/stats.py). The config is bench/study/evaluator_learns.yaml.

    python -m bench.evaluator_learns [--config ...] [--out bench/results/evaluator_learns.json]
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
from dynamicrubric import steps, tasks, train
from dynamicrubric.artifacts import empty_table, read_frame, write_artifact
from dynamicrubric.config import Config, load_config

HERE = Path(__file__).parent
AUDIT_SEED = 4242  # the same rubric-sampling seed for G_0 and G_1: only the generator differs


def candidate_sets(cfg: Config, work: Path, split: str, seed: int) -> tuple[str, str, str]:
    """P_0's K responses per prompt of `split`, as candidate sets with their outcome rankings."""
    y = cfg.to_yaml()
    prompts = str(work / f"{split}-prompts.parquet")
    write_artifact(prompts, "prompts", tasks.configured_prompts(cfg.data, split))
    lists = str(work / "no-lists.parquet")
    write_artifact(lists, "anchors", empty_table("anchors"))
    rollouts = str(work / f"{split}-rollouts.parquet")
    steps.rollout(y, "", 1, split, prompts, rollouts, cfg.models.policy, 0, 1, seed)
    sets, ranked = str(work / f"{split}-sets.parquet"), str(work / f"{split}-anchors.parquet")
    steps.candidates(y, "", 1, rollouts, prompts, lists, 0, 1, sets, ranked)
    return prompts, sets, ranked


def audit(cfg: Config, work: Path, name: str, generator: str, sets: str, ranked: str) -> pd.DataFrame:
    """One row per held-out set: R_disc and the signal diagnostics of `generator`'s rubric for it."""
    y = cfg.to_yaml()
    folder = work / f"audit-{name}"
    rubrics, judgments = str(folder / "rubrics.parquet"), str(folder / "judgments.parquet")
    counts = steps.rubrics(
        y, "", 1, f"audit-{name}", sets, rubrics, generator, cfg.rubrics.samples, 0, AUDIT_SEED
    )
    steps.judge(y, "", 1, f"audit-{name}", sets, rubrics, judgments, cfg.models.verifier, 0)
    out = {k: str(folder / f"{k}.parquet") for k in ("scores", "rewards", "diagnostics", "metrics")}
    steps.aggregate(
        y, "", 1, f"audit-{name}", [judgments], [sets], [rubrics], [ranked],
        out["scores"], out["rewards"], out["diagnostics"], out["metrics"],
    )  # fmt: skip
    rewards = read_frame(out["rewards"], "rewards")
    diag = read_frame(out["diagnostics"], "diagnostics")
    per_set = (
        rewards.merge(diag, on=["prompt_id", "rubric_idx"])
        .groupby("prompt_id")
        .agg(
            r_disc=("r_disc", "mean"),
            tie_rate=("tie_rate", "mean"),
            uniform=("uniform", "mean"),
            mean_gap=("mean_gap", "mean"),
            num_items=("num_items_x", "mean"),
        )
    )
    per_set.attrs["counts"] = counts
    return per_set


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "study" / "evaluator_learns.yaml"))
    parser.add_argument("--out", default=str(HERE / "results" / "evaluator_learns.json"))
    parser.add_argument("--work", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    work = Path(args.work or tempfile.mkdtemp(prefix="evaluator-learns-"))
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    started = time.perf_counter()
    _, train_sets, train_ranked = candidate_sets(cfg, work, "train", seed=1)
    _, held_sets, held_ranked = candidate_sets(cfg, work, "eval", seed=2)
    timings["candidate_sets_s"] = time.perf_counter() - started

    started = time.perf_counter()
    before = audit(cfg, work, "g0", cfg.models.generator, held_sets, held_ranked)
    timings["audit_g0_s"] = time.perf_counter() - started

    started = time.perf_counter()
    train.launch(
        "train-evaluator",
        cfg,
        candidates=[train_sets],
        anchors=[train_ranked],
        generator=cfg.models.generator,
        out_uri=str(work / "generator"),
        steps_uri=str(work / "steps"),
        metrics_uri=str(work / "metrics.parquet"),
        round_idx=1,
    )
    timings["train_s"] = time.perf_counter() - started

    started = time.perf_counter()
    after = audit(cfg, work, "g1", str(work / "generator"), held_sets, held_ranked)
    timings["audit_g1_s"] = time.perf_counter() - started

    after = after.reindex(before.index)
    metrics = read_frame(str(work / "metrics.parquet"), "metrics")
    curve = {
        name: group.sort_values("step")["value"].round(6).tolist()
        for name, group in metrics.groupby("name")
        if name in ("rewards/r_disc/mean", "rewards/r_anchor/mean", "reward_std", "kl", "rubrics/parse_rate",
                    "rubrics/truncated_rate", "judge/yes_rate", "time/step_s")
    }  # fmt: skip
    t = cfg.train_evaluator
    result = {
        "what": "R_disc (soft verdicts) and the signal audit of G_0 vs G_1 on held-out candidate sets of P_0",
        "command": "python -m bench.evaluator_learns",
        "machine": f"{platform.machine()}, 2 cores (shared with other work)",
        "config": cfg.model_dump(mode="json"),
        "steps": t.steps,
        "sets_per_step": t.prompts_per_step,
        "rubric_samples_per_set": cfg.rubrics.train_samples,
        "training_sets": int(read_frame(train_sets, "rollouts")["prompt_id"].nunique()),
        "held_out_sets": len(before),
        "audit_rubric_samples_per_set": cfg.rubrics.samples,
        "parse": {name: frame.attrs["counts"] for name, frame in (("g0", before), ("g1", after))},
        "before": {c: bootstrap_mean(before[c].to_numpy()) for c in before.columns},
        "after": {c: bootstrap_mean(after[c].to_numpy()) for c in after.columns},
        "difference": {
            c: paired_difference(after[c].to_numpy(), before[c].to_numpy())
            for c in ("r_disc", "tie_rate", "uniform", "mean_gap")
        },
        "curve": curve,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=float) + "\n")
    d = result["difference"]["r_disc"]
    print(
        f"R_disc {result['before']['r_disc']['mean']:.4f} -> {result['after']['r_disc']['mean']:.4f}; "
        f"difference {d['mean']:+.4f} [95% CI {d['low']:+.4f}, {d['high']:+.4f}] over {d['n']} held-out sets"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
