"""The evaluation stages: one task on CPU; on GPUs three (evaluate-samples -> check-samples ->
evaluate), so that no GPU pod runs the policy's code."""

from __future__ import annotations

from dynamicrubric import store
from dynamicrubric.artifacts import read_frame, write_artifact
from dynamicrubric.config import Config
from dynamicrubric.stages.common import (
    EVAL_PROMPTS,
    GENERATOR,
    POLICY,
    PREVIOUS_POLICY,
    VERIFIER,
)
from dynamicrubric.stages.spec import Data, ModelParam, Stage

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
