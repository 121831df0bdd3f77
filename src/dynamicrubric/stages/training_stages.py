"""The two training stages, each a launch of `dynamicrubric.training` (GRPO with TRL)."""

from __future__ import annotations

import time

from dynamicrubric.infra import tracking_records
from dynamicrubric.infra.config import Config
from dynamicrubric.stages.common import (
    GENERATOR,
    POLICY,
    VERIFIER,
)
from dynamicrubric.stages.spec import Data, Stage

# ---- training


def _train(cfg: Config, job) -> dict:
    """On this task's machine, or on num_nodes nodes as a Kubeflow Trainer TrainJob that the task submits
    and follows (training/on_nodes.py)."""
    from dynamicrubric import store

    # One writer at a time: a second run into this checkpoint is refused here, before it launches
    with store.held_for_writing(job.out_uri, job.stage):
        if getattr(cfg, job.stage.replace("-", "_")).num_nodes > 1:
            from dynamicrubric.training.on_nodes import train_on_nodes

            result = train_on_nodes(cfg, job)
        else:
            from dynamicrubric.training.launcher import launch

            result = launch(cfg, job)
    started = time.perf_counter()
    sets = _traced_steps(cfg, job)
    return {**result, "traced_sets": sets, "tracing_s": time.perf_counter() - started}


def _traced_steps(cfg: Config, job) -> list[dict]:
    """Judged sets of some training steps (pipeline.traced_steps_every), for the stage's MLflow traces."""
    from dynamicrubric.evaluation.traced_sets import step_sets
    from dynamicrubric.infra.config import policy_variant

    variant = policy_variant(cfg) if job.stage == "train-policy" else "dynamic"
    return step_sets(
        job.steps_uri,
        cfg.pipeline.traced_steps_every,
        cfg.pipeline.traced_sets,
        variant=variant,
        generator=job.generator,
        verifier=job.verifier,
    )


def _train_lineage(role: str):
    def lineage(run, run_name: str, round_idx: int, values: dict, result: dict) -> None:
        run.log_metrics_table(values["out_metrics"])
        # measurements: in MLflow, not in the artifacts (a rerun could not write them again)
        run.log_metric_rows(result.get("timings", []))
        run.log_metrics({k: v for k, v in result.items() if k == "train_wall_s"})
        if result.get("traced_sets"):  # some steps' judged sets, as the evaluate stage traces its own
            started = time.perf_counter()
            ids = tracking_records.log_traced_sets(run, result["traced_sets"], round_idx)
            tracing_s = result["tracing_s"] + time.perf_counter() - started  # reading the steps, then logging
            run.log_metrics({"traced_sets": len(ids), "tracing_s": tracing_s})
        run.log_model(run_name, f"{role}-round-{round_idx}", values[f"out_{role}"], {"base": values[role]})

    return lineage


def train_evaluator(cfg: Config, round_idx: int, *, generator, verifier, candidate_sets, anchors, **out):
    """Online GRPO on the generator over P_{t−1}'s candidate sets (see dynamicrubric.training)."""
    from dynamicrubric.training.data import TrainingJob

    outputs = (out["out_generator"], out["out_steps"], out["out_metrics"], round_idx)
    models = {"generator": generator, "verifier": verifier}
    job = TrainingJob("train-evaluator", *outputs, candidates=candidate_sets, anchors=anchors, **models)
    return _train(cfg, job)


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


def train_policy(cfg: Config, round_idx: int, *, policy, generator, verifier, prompts, **out):
    """Online GRPO on the policy, rewarded by the round's evaluator (see dynamicrubric.training)."""
    from dynamicrubric.training.data import TrainingJob

    outputs = (out["out_policy"], out["out_steps"], out["out_metrics"], round_idx)
    job = TrainingJob(
        "train-policy", *outputs, policy=policy, generator=generator, verifier=verifier, prompts_uri=prompts
    )
    return _train(cfg, job)


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
