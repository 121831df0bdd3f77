"""Every pipeline stage, declared once: its parameters, models, input and output artifacts, and the
function that does its work (frames in, frames out live in the method modules; these read and write
the artifacts).

From a declaration come the KFP component (components/stages.py, generated), the `dynrubric stage`
flags (cli.py), the MLflow run's params and datasets (runner.py) and `--from-run` (rerun.py).
Values reach `run` by name: params and models as given, artifacts as URIs ("" or [] when an optional
one is absent, a list for sharded ones), outputs as `out_<name>`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd

from dynamicrubric import store
from dynamicrubric.artifacts import empty_table, read_frame, read_frames, write_artifact
from dynamicrubric.config import Config
from dynamicrubric.stages.spec import Data, ModelParam, Param, Stage

LABEL = Param("label", str, "which use of the stage in the round (generator, audit-after, ...)", "stage")
SHARD = Param("shard", int, "this shard's index", 0)
NUM_SHARDS = Param("num_shards", int, "number of prompt shards", 1)
SEED = Param("seed", int, "sampling seed (default: the config's seed)", None)
POLICY = ModelParam("policy", "the policy (reference or checkpoint)", default_from="policy")
GENERATOR = ModelParam("generator", "the generator G (reference or checkpoint)", default_from="generator")
VERIFIER = ModelParam("verifier", "the frozen verifier V", default_from="verifier")
PREVIOUS_POLICY = ModelParam("previous_policy", "P_{t-1}, for the win rate (omit: none)")


def check_shard(values: dict) -> None:
    shard, num_shards = values["shard"], values["num_shards"]
    if num_shards < 1:
        raise ValueError(f"num_shards (--num-shards) must be >= 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard (--shard) must be within 0..{num_shards - 1}, got {shard}")


def _merged(paths: list[str], kind: str, workdir: str) -> str:
    """One artifact holding all shards (a single path is used as it is)."""
    if len(paths) == 1:
        return paths[0]
    out = str(Path(workdir) / f"{kind}.parquet")
    write_artifact(out, kind, read_frames(paths, kind))
    return out


# ---- prepare-data


def prepare_data(cfg: Config, round_idx: int, *, out_train_prompts, out_eval_prompts, out_anchor_lists):
    """Training and held-out prompts, and the user's anchor lists (Nectar format) for R_anchor."""
    from dynamicrubric import tasks

    outputs = (out_train_prompts, out_eval_prompts, out_anchor_lists)
    with store.outputs_as_a_set(*outputs) as (train, held_out, lists_out):
        write_artifact(train, "prompts", tasks.configured_prompts(cfg.data, "train"))
        write_artifact(held_out, "prompts", tasks.configured_prompts(cfg.data, "eval"))
        lists = [tasks.load_nectar(uri) for uri in cfg.data.anchors]
        write_artifact(lists_out, "anchors", pd.concat(lists) if lists else empty_table("anchors"))
    return {"train_prompts": len(read_frame(out_train_prompts, "prompts"))}


PREPARE_DATA = Stage(
    "prepare_data",
    "training and held-out prompts, and anchor lists",
    prepare_data,
    lambda v: "prepare-data",
    outputs=(
        Data("train_prompts", "prompts", "training prompts artifact to write"),
        Data("eval_prompts", "prompts", "held-out prompts artifact to write"),
        Data("anchor_lists", "anchors", "the user's ranked lists (anchors artifact) to write"),
    ),
)


# ---- rollout


def rollout(cfg: Config, round_idx: int, *, label, shard, num_shards, seed, policy, prompts, out_rollouts):
    from dynamicrubric.rollout import run_rollout

    return run_rollout(
        prompts, out_rollouts, cfg, policy=policy, seed=seed, shard=shard, num_shards=num_shards
    )


ROLLOUT = Stage(
    "rollout",
    "the policy samples K responses per prompt",
    rollout,
    lambda v: f"{v['label']}-rollout-{v['shard']}",
    params=(LABEL, SHARD, NUM_SHARDS, SEED),
    models=(POLICY,),
    inputs=(Data("prompts", "prompts", "prompts artifact"),),
    outputs=(Data("rollouts", "rollouts", "rollouts artifact to write"),),
    check=check_shard,
)


# ---- candidates


def rollouts_from_anchors(anchors: pd.DataFrame) -> pd.DataFrame:
    """Anchor lists as candidate sets (rollouts-shaped), so rubrics and judging treat them alike."""
    return pd.DataFrame(
        {
            "prompt_id": anchors["list_id"],
            "sample_idx": anchors["sample_idx"],
            "prompt": anchors["prompt"],
            "response": anchors["response"],
            "num_tokens": anchors["response"].str.split().str.len().fillna(0).astype(int),
            "finish_reason": "stop",
            "policy": "anchor:" + anchors["source"],
            "seed": 0,
        }
    )


def candidates(
    cfg: Config,
    round_idx: int,
    *,
    shard,
    num_shards,
    rollouts,
    prompts,
    anchor_lists,
    out_candidate_sets,
    out_anchors,
):
    """The generator's candidate sets: the policy's rollouts plus this shard's anchor lists. The
    anchors output ranks the sets that have a reference order: rollouts ranked by verifiable
    correctness (correct ≻ incorrect) and the user's human-ranked lists."""
    from dynamicrubric import tasks

    policy_sets = read_frame(rollouts, "rollouts")
    outcome_lists = tasks.anchors_from_outcomes(
        policy_sets, read_frame(prompts, "prompts"), timeout_s=cfg.evaluate.sandbox_timeout_s
    )
    if not cfg.data.anchors_from_outcomes:
        outcome_lists = outcome_lists.iloc[0:0]
    user_lists = read_frame(anchor_lists, "anchors")
    mine = set(sorted(user_lists["list_id"].unique())[shard::num_shards])
    user_lists = user_lists[user_lists["list_id"].isin(mine)]
    with store.outputs_as_a_set(out_candidate_sets, out_anchors) as (sets_out, ranked_out):
        write_artifact(sets_out, "rollouts", pd.concat([policy_sets, rollouts_from_anchors(user_lists)]))
        write_artifact(ranked_out, "anchors", pd.concat([outcome_lists, user_lists]))
    return {
        "policy_sets": policy_sets["prompt_id"].nunique(),
        "ranked_policy_sets": outcome_lists["list_id"].nunique(),
        "anchor_lists": len(mine),
    }


CANDIDATES = Stage(
    "candidates",
    "candidate sets and their reference rankings",
    candidates,
    lambda v: f"generator-candidates-{v['shard']}",
    params=(SHARD, NUM_SHARDS),
    inputs=(
        Data("rollouts", "rollouts", "the policy's rollouts"),
        Data("prompts", "prompts", "the prompts the rollouts answer (their answers rank the rollouts)"),
        Data("anchor_lists", "anchors", "human-ranked lists (anchors artifact)"),
    ),
    outputs=(
        Data("candidate_sets", "rollouts", "candidate sets (rollouts artifact) to write"),
        Data("anchors", "anchors", "reference rankings (anchors artifact) to write"),
    ),
    check=check_shard,
)


# ---- rubrics and judge


def rubrics(
    cfg: Config, round_idx: int, *, label, shard, samples, seed, generator, candidate_sets, out_rubrics
):
    from dynamicrubric.rubrics import run_rubrics

    return run_rubrics(candidate_sets, out_rubrics, cfg, generator=generator, samples=samples, seed=seed)


RUBRICS = Stage(
    "rubrics",
    "the generator writes weighted rubric items per candidate set",
    rubrics,
    lambda v: f"{v['label']}-rubrics-{v['shard']}",
    params=(
        LABEL,
        SHARD,
        Param("samples", int, "rubric samples G per candidate set (default: rubrics.samples)", None),
        SEED,
    ),
    models=(GENERATOR,),
    inputs=(Data("candidate_sets", "rollouts", "candidate sets (a rollouts artifact)"),),
    outputs=(Data("rubrics", "rubrics", "rubrics artifact to write"),),
)


def judge(cfg: Config, round_idx: int, *, label, shard, verifier, candidate_sets, rubrics, out_judgments):
    from dynamicrubric.judge import run_judge

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
    from dynamicrubric.aggregate import run_aggregate

    variant = "pointwise" if not rubrics else cfg.rubrics.variant
    outputs = (out_scores, out_rewards, out_diagnostics, out_metrics)
    with tempfile.TemporaryDirectory() as work, store.outputs_as_a_set(*outputs) as staged:
        candidates_uri = _merged(candidate_sets, "rollouts", work)
        anchors_uri = _merged(anchors, "anchors", work) if anchors else None
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
            _merged(judgments, "judgments", work),
            candidates_uri,
            *staged,
            rubrics_uri=_merged(rubrics, "rubrics", work) if rubrics else None,
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


# ---- evaluate (one task on CPU; on GPUs three: evaluate-samples -> check-samples -> evaluate)


def evaluate_samples(cfg: Config, round_idx: int, *, policy, previous_policy, eval_prompts, out_samples):
    """The policy's held-out samples and the previous policy's one for the win rate
    (`evaluate.sample_held_out`), as one rollouts artifact."""
    from dynamicrubric.evaluate import _Engines, sample_held_out

    pool = _Engines(cfg, None)
    samples = sample_held_out(
        cfg,
        read_frame(eval_prompts, "prompts"),
        pool,
        policy=policy,
        previous_policy=previous_policy or None,
        seed=cfg.seed,
    )
    pool.release()
    write_artifact(out_samples, "rollouts", samples)
    return {"samples": len(samples)}


EVAL_PROMPTS = Data("eval_prompts", "prompts", "held-out prompts artifact")

EVALUATE_SAMPLES = Stage(
    "evaluate_samples",
    "evaluate's first phase: the policy's held-out samples (and the previous policy's, for the win rate)",
    evaluate_samples,
    lambda v: "evaluate-samples",
    models=(POLICY, PREVIOUS_POLICY),
    inputs=(EVAL_PROMPTS,),
    outputs=(Data("samples", "rollouts", "rollouts artifact to write"),),
)


def check_samples(cfg: Config, round_idx: int, *, eval_prompts, samples, out_outcomes):
    """The policy's held-out samples scored by their tasks' checkers (HumanEval in the sandbox), in a
    CPU task of its own so that no GPU pod runs the policy's code."""
    from dynamicrubric.evaluate import check_samples as check
    from dynamicrubric.evaluate import split_samples

    policy_samples, _previous = split_samples(read_frame(samples, "rollouts"), cfg)
    outcomes = check(policy_samples, read_frame(eval_prompts, "prompts"), cfg.evaluate.sandbox_timeout_s)
    write_artifact(out_outcomes, "outcomes", outcomes)
    return {"checked": len(outcomes), "unscored": int(outcomes["score"].isna().sum())}


CHECK_SAMPLES = Stage(
    "check_samples",
    "evaluate's second phase: the held-out samples scored by their tasks' checkers (code in the sandbox)",
    check_samples,
    lambda v: "check-samples",
    inputs=(EVAL_PROMPTS, Data("samples", "rollouts", "rollouts artifact of evaluate-samples")),
    outputs=(Data("outcomes", "outcomes", "outcomes artifact to write"),),
)

# Evaluator variants whose rubrics the generator writes (the pointwise judge uses the verifier alone).
GENERATOR_VARIANTS = ("dynamic", "static")


def metrics_by_role(result: dict[str, float]) -> dict[str, dict[str, float]]:
    """Evaluate's metrics split by the model they describe: `policy/*` belong to the policy checkpoint,
    the generator-written variants' (`dynamic/*`, `static/*`) to the generator checkpoint."""
    by_role: dict[str, dict[str, float]] = {"policy": {}, "generator": {}}
    for key, value in result.items():
        variant = key.split("/", 1)[0]
        if variant == "policy":
            by_role["policy"][key] = value
        elif variant in GENERATOR_VARIANTS:
            by_role["generator"][key] = value
    return by_role


def _check_evaluate(values: dict) -> None:
    if bool(values["samples"]) != bool(values["outcomes"]):
        raise ValueError(
            "evaluate: give both the samples and their outcomes (--samples, --outcomes) or neither"
        )
    if not values["policy"] and not values["samples"]:
        raise ValueError("evaluate: give --policy, or --samples and --outcomes")


def evaluate(
    cfg: Config,
    round_idx: int,
    *,
    policy,
    generator,
    verifier,
    previous_policy,
    eval_prompts,
    samples,
    outcomes,
    out_metrics,
    out_plots,
    out_units,
):
    """The evaluate stage; `samples` and `outcomes` (both or neither) are its first two phases done by
    the evaluate-samples and check-samples tasks, which the pipeline runs where evaluate has GPUs."""
    from dynamicrubric.evaluate import run_evaluate, split_samples

    if samples and not policy:  # the split pipeline hands no model to this task: the samples say whose
        current, previous = split_samples(read_frame(samples, "rollouts"), cfg)
        policy = str(current["policy"].iloc[0])
        previous_policy = str(previous["policy"].iloc[0]) if len(previous) else ""
    # Metrics, plots and units are published together once all exist: a failure leaves none (no empty
    # plots/). An empty out_units writes no units.
    with store.outputs_as_a_set(out_metrics, out_plots, out_units) as (metrics_out, plots_out, units_out):
        return run_evaluate(
            eval_prompts,
            metrics_out,
            plots_out,
            cfg,
            policy=policy,
            generator=generator,
            verifier=verifier,
            previous_policy=previous_policy or None,
            labelled_uris=tuple(cfg.data.labelled),
            round_idx=round_idx,
            out_units_uri=units_out or None,
            samples_uri=samples or None,
            outcomes_uri=outcomes or None,
        )


def _evaluate_lineage(run, run_name: str, round_idx: int, values: dict, result: dict) -> None:
    run.log_metrics_table(values["out_metrics"])
    run.log_dir(values["out_plots"], f"plots/round-{round_idx}")
    for role, metrics in metrics_by_role(result).items():
        model_id = run.find_model(run_name, f"{role}-round-{round_idx}")
        if model_id:  # link each checkpoint to the numbers about its own role
            run.log_model_metrics(model_id, metrics)
    # the task's log line (these are logged above, per step, by log_metrics_table)
    run.summary.update({k: result[k] for k in ("policy/accuracy", "policy/win_rate") if k in result})


EVALUATE = Stage(
    "evaluate",
    "evaluator accuracy and policy quality on held-out data",
    evaluate,
    lambda v: "evaluate",
    models=(
        ModelParam("policy", "the policy (reference or checkpoint); not with --samples"),
        GENERATOR,
        VERIFIER,
        PREVIOUS_POLICY,
    ),
    inputs=(
        EVAL_PROMPTS,
        Data("samples", "rollouts", "the held-out samples, from evaluate-samples", optional=True),
        Data("outcomes", "outcomes", "their checker scores, from check-samples", optional=True),
    ),
    outputs=(
        Data("metrics", "metrics", "metrics artifact to write"),
        Data("plots", "folder", "folder for the PNG plots", kfp_type="Artifact"),
        Data("units", "units", "units artifact to write (per prompt and pair, for intervals)", optional=True),
    ),
    lineage=_evaluate_lineage,
    kfp_summary=True,
    check=_check_evaluate,
)


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        PREPARE_DATA,
        ROLLOUT,
        CANDIDATES,
        RUBRICS,
        JUDGE,
        AGGREGATE,
        TRAIN_EVALUATOR,
        TRAIN_POLICY,
        EVALUATE_SAMPLES,
        CHECK_SAMPLES,
        EVALUATE,
    )
}
