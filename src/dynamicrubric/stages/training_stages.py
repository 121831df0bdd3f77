"""The two training stages, each a launch of `dynamicrubric.training` (GRPO with TRL)."""

from __future__ import annotations

from dynamicrubric.config import Config
from dynamicrubric.stages.common import (
    GENERATOR,
    POLICY,
    VERIFIER,
)
from dynamicrubric.stages.spec import Data, Stage

# ---- training


def _train_lineage(role: str):
    def lineage(run, run_name: str, round_idx: int, values: dict, result: dict) -> None:
        run.log_metrics_table(values["out_metrics"])
        run.log_model(run_name, f"{role}-round-{round_idx}", values[f"out_{role}"], {"base": values[role]})

    return lineage


def train_evaluator(
    cfg: Config,
    round_idx: int,
    *,
    generator,
    verifier,
    candidate_sets,
    anchors,
    out_generator,
    out_steps,
    out_metrics,
):
    """Online GRPO on the generator over P_{t−1}'s candidate sets (see dynamicrubric.training)."""
    from dynamicrubric.training.launcher import launch

    return launch(
        "train-evaluator",
        cfg,
        candidates=list(candidate_sets),
        anchors=list(anchors),
        generator=generator,
        verifier=verifier,
        out_uri=out_generator,
        steps_uri=out_steps,
        metrics_uri=out_metrics,
        round_idx=round_idx,
    )


STEPS = Data("steps", "folder", "folder for the per-step artifacts", kfp_type="Artifact")
TRAIN_METRICS = Data("metrics", "metrics", "per-step metrics artifact to write")

TRAIN_EVALUATOR = Stage(
    "train_evaluator",
    "online GRPO on the generator over candidate sets, rewarded with R_disc + λ·R_anchor",
    train_evaluator,
    lambda v: "train-evaluator",
    models=(GENERATOR, VERIFIER),
    inputs=(
        Data("candidate_sets", "rollouts", "candidate sets (one per shard)", shards=True),
        Data("anchors", "anchors", "their reference rankings (for R_anchor)", shards=True, optional=True),
    ),
    outputs=(
        Data("generator", "model", "checkpoint folder to write", kfp_type="Model"),
        STEPS,
        TRAIN_METRICS,
    ),
    lineage=_train_lineage("generator"),
)


def train_policy(
    cfg: Config, round_idx: int, *, policy, generator, verifier, prompts, out_policy, out_steps, out_metrics
):
    """Online GRPO on the policy, rewarded by the round's evaluator (see dynamicrubric.training)."""
    from dynamicrubric.training.launcher import launch

    return launch(
        "train-policy",
        cfg,
        prompts_uri=prompts,
        policy=policy,
        generator=generator,
        verifier=verifier,
        out_uri=out_policy,
        steps_uri=out_steps,
        metrics_uri=out_metrics,
        round_idx=round_idx,
    )


TRAIN_POLICY = Stage(
    "train_policy",
    "online GRPO on the policy, rewarded by the configured evaluator",
    train_policy,
    lambda v: "train-policy",
    models=(POLICY, GENERATOR, VERIFIER),
    inputs=(Data("prompts", "prompts", "the prompt pool (prompts artifact)"),),
    outputs=(Data("policy", "model", "checkpoint folder to write", kfp_type="Model"), STEPS, TRAIN_METRICS),
    lineage=_train_lineage("policy"),
)
