"""The stages that score: G writes rubrics, V judges every item and response, and aggregate turns the
verdicts into scores, generator rewards and signal diagnostics."""

from __future__ import annotations

import tempfile
from pathlib import Path

from dynamicrubric import store
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import MAX_SAMPLES, Config
from dynamicrubric.stages.common import (
    GENERATOR,
    LABEL,
    SEED,
    SHARD,
    VERIFIER,
    merged,
)
from dynamicrubric.stages.spec import Data, Param, Stage

# ---- rubrics and judge


def rubrics(
    cfg: Config, round_idx: int, *, label, shard, samples, seed, generator, candidate_sets, out_rubrics
):
    from dynamicrubric.scoring.rubrics import run_rubrics

    return run_rubrics(candidate_sets, out_rubrics, cfg, generator=generator, samples=samples, seed=seed)


RUBRICS = Stage(
    "rubrics",
    "the generator writes weighted rubric items per candidate set",
    rubrics,
    lambda v: f"{v['label']}-rubrics-{v['shard']}",
    params=(
        LABEL,
        SHARD,
        Param(
            "samples",
            int,
            "rubric samples G per candidate set (default: rubrics.samples)",
            None,
            bounds=(1, MAX_SAMPLES),
        ),
        SEED,
    ),
    models=(GENERATOR,),
    inputs=(Data("candidate_sets", "rollouts", "candidate sets (a rollouts artifact)"),),
    outputs=(Data("rubrics", "rubrics", "rubrics artifact to write"),),
)


def judge(cfg: Config, round_idx: int, *, label, shard, verifier, candidate_sets, rubrics, out_judgments):
    from dynamicrubric.scoring.judge import run_judge

    counts = run_judge(candidate_sets, out_judgments, cfg, rubrics_uri=rubrics or None, verifier=verifier)
    return {k: v for k, v in counts.items() if k != "variant"}


JUDGE = Stage(
    "judge",
    "the verifier answers yes/no per rubric item and response",
    judge,
    lambda v: f"{v['label']}-judge-{v['shard']}",
    params=(LABEL, SHARD),
    models=(VERIFIER,),
    inputs=(
        Data("candidate_sets", "rollouts", "candidate sets (a rollouts artifact)"),
        Data("rubrics", "rubrics", "rubrics artifact; omit for the pointwise judge", optional=True),
    ),
    outputs=(Data("judgments", "judgments", "judgments artifact to write"),),
)


# ---- aggregate


def aggregate(
    cfg: Config,
    round_idx: int,
    *,
    label,
    judgments,
    candidate_sets,
    rubrics,
    anchors,
    prompts,
    out_scores,
    out_rewards,
    out_diagnostics,
    out_metrics,
):
    """Aggregate the shards. Without `anchors` but with `prompts`, the responses are ranked by their
    verifiable correctness first, so the mean gap (Δgap) has a reference ordering to measure against."""
    from dynamicrubric.scoring.aggregate import run_aggregate

    variant = "pointwise" if not rubrics else cfg.rubrics.variant
    outputs = (out_scores, out_rewards, out_diagnostics, out_metrics)
    with tempfile.TemporaryDirectory() as work, store.outputs_as_a_set(*outputs) as staged:
        candidates_uri = merged(candidate_sets, "rollouts", work)
        anchors_uri = merged(anchors, "anchors", work) if anchors else None
        if anchors_uri is None and prompts:
            from dynamicrubric import tasks

            anchors_uri = str(Path(work) / "outcome-anchors.parquet")
            ranked = tasks.anchors_from_outcomes(
                read_frame(candidates_uri, "rollouts"),
                read_frame(prompts, "prompts"),
                timeout_s=cfg.evaluate.sandbox_timeout_s,
            )
            write_artifact(anchors_uri, "anchors", ranked)
        return run_aggregate(
            merged(judgments, "judgments", work),
            candidates_uri,
            *staged,
            rubrics_uri=merged(rubrics, "rubrics", work) if rubrics else None,
            anchors_uri=anchors_uri,
            soft=cfg.aggregate.soft,
            round_idx=round_idx,
            variant=variant,
        )


AGGREGATE = Stage(
    "aggregate",
    "scores, generator rewards and signal diagnostics",
    aggregate,
    lambda v: f"{v['label']}-aggregate",
    params=(LABEL,),
    inputs=(
        Data("judgments", "judgments", "judgments (one per shard)", shards=True),
        Data("candidate_sets", "rollouts", "the judged candidate sets (one per shard)", shards=True),
        Data("rubrics", "rubrics", "rubrics (omit for the pointwise judge)", shards=True, optional=True),
        Data(
            "anchors", "anchors", "reference rankings (for R_anchor and the gap)", shards=True, optional=True
        ),
        Data(
            "prompts", "prompts", "without anchors: rank responses by correctness for the gap", optional=True
        ),
    ),
    outputs=(
        Data("scores", "scores", "scores artifact to write"),
        Data("rewards", "rewards", "generator rewards artifact to write"),
        Data("diagnostics", "diagnostics", "signal diagnostics artifact to write"),
        Data("metrics", "metrics", "metrics artifact to write"),
    ),
    kfp_summary=True,
    kfp_returns="tie_rate",
)
