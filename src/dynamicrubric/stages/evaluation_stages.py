"""The evaluation stages: one task on CPU; on GPUs three (evaluate-samples -> check-samples ->
evaluate), so that no GPU pod runs the policy's code."""

from __future__ import annotations

import json
import logging
import time

from dynamicrubric import store
from dynamicrubric.evaluation.benchmark_runs import PROTOCOL_LABELS
from dynamicrubric.evaluation.plots import BENCHMARK_PAIRS, TRACED_SETS
from dynamicrubric.infra import tracking_records
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import Config
from dynamicrubric.stages.common import (
    EVAL_PROMPTS,
    GENERATOR,
    POLICY,
    PREVIOUS_POLICY,
    VERIFIER,
)
from dynamicrubric.stages.spec import Data, ModelParam, Stage

log = logging.getLogger(__name__)

# ---- evaluate (one task on CPU; on GPUs three: evaluate-samples -> check-samples -> evaluate)


def evaluate_samples(cfg: Config, round_idx: int, *, policy, previous_policy, eval_prompts, out_samples):
    """The policy's held-out samples and the previous policy's one for the win rate
    (`evaluate.sample_held_out`), as one rollouts artifact."""
    from dynamicrubric.evaluation.evaluate import Engines, sample_held_out

    pool = Engines(cfg, None)
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
    """The held-out samples of both policies scored by their tasks' checkers (HumanEval in the sandbox),
    in a CPU task of its own so that no GPU pod runs the policy's code: the policy's for its accuracy,
    the previous policy's for the signal guard's gold."""
    from dynamicrubric.evaluation.evaluate import check_samples as check
    from dynamicrubric.evaluation.evaluate import split_samples

    drawn = read_frame(samples, "rollouts")
    split_samples(drawn, cfg, samples)  # refuses samples of another evaluate.samples
    outcomes = check(drawn, read_frame(eval_prompts, "prompts"), cfg.evaluate.sandbox_timeout_s)
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
    previous_units,
    reference_generator,
    out_metrics,
    out_plots,
    out_units,
    out_guard,
    out_items,
):
    """The evaluate stage; `samples` and `outcomes` (both or neither) are its first two phases done by
    the evaluate-samples and check-samples tasks, which the pipeline runs where evaluate has GPUs."""
    from dynamicrubric.evaluation.evaluate import run_evaluate, split_samples

    if samples and not policy:  # the split pipeline hands no model to this task: the samples say whose
        current, previous = split_samples(read_frame(samples, "rollouts"), cfg, samples)
        policy = str(current["policy"].iloc[0])
        previous_policy = str(previous["policy"].iloc[0]) if len(previous) else ""
    # Metrics, plots, units and the guard's verdict are published together once all exist: a failure
    # leaves none (no empty plots/). An empty out_units or out_guard writes none.
    outputs = (out_metrics, out_plots, out_units, out_guard, out_items)
    with store.outputs_as_a_set(*outputs) as (metrics_out, plots_out, units_out, guard_out, items_out):
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
            out_guard_uri=guard_out or None,
            out_items_uri=items_out or None,
            previous_units_uri=previous_units or None,
            reference_generator=reference_generator or None,
        )


def _evaluate_lineage(run, run_name: str, round_idx: int, values: dict, result: dict) -> None:
    run.log_metrics_table(values["out_metrics"])
    run.log_dir(values["out_plots"], f"plots/round-{round_idx}")
    traced = values["out_plots"].rstrip("/") + "/" + TRACED_SETS
    if store.exists(traced):
        started = time.perf_counter()
        ids = tracking_records.log_traced_sets(run, json.loads(store.read_bytes(traced)), round_idx)
        run.log_metrics({"traced_sets": len(ids), "tracing_s": time.perf_counter() - started})
    pairs_uri = values["out_plots"].rstrip("/") + "/" + BENCHMARK_PAIRS
    if store.exists(pairs_uri):
        pairs = json.loads(store.read_bytes(pairs_uri))
        ids = tracking_records.log_benchmark_pairs(run, pairs, round_idx)
        run.log_metrics({"traced_benchmark_prompts": len(ids)})
        if pairs:
            independent = pairs[0].get("judge_independent", False)
            run.set_tags(
                {
                    "benchmark_judge": pairs[0]["judge"],
                    "benchmark_judge_independent": str(independent).lower(),
                }
            )
            run.set_tags(
                {
                    f"benchmark_protocol/{p['benchmark']}": PROTOCOL_LABELS[p.get("protocol", "quick")]
                    for p in pairs
                }
            )
    for role, metrics in metrics_by_role(result).items():
        model_id = run.find_model(run_name, f"{role}-round-{round_idx}")
        if model_id:  # link each checkpoint to the numbers about its own role
            run.log_model_metrics(model_id, metrics)
    guard = values["out_guard"]
    if guard and store.exists(guard):
        # The alarm where the MLflow run list shows it: on this run, its round's run and the parent run.
        record = read_frame(guard, "guard").iloc[0]
        verdict = "quiet" if record["healthy"] else f"fired ({record['alarms']}): {record['reasons']}"
        run.set_tags({"guard.alarm": verdict}, above={f"guard.round-{round_idx}": verdict})
    # the task's log line (these are logged above, per step, by log_metrics_table)
    shown = (
        "policy/accuracy",
        "policy/win_rate",
        "guard/alarm",
        "alpaca_eval/win_rate",
        "arena_hard_v2/win_rate",
        "writingbench/score",
    )
    run.summary.update({k: result[k] for k in shown if k in result})


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
        ModelParam(
            "reference_generator",
            "the round-0 generator: the signal guard's gold for prompts without a checker",
            default_from="generator",
        ),
    ),
    inputs=(
        EVAL_PROMPTS,
        Data("samples", "rollouts", "the held-out samples, from evaluate-samples", optional=True),
        Data("outcomes", "outcomes", "their checker scores, from check-samples", optional=True),
        Data(
            "previous_units",
            "units",
            "the previous round's units (the signal guard's agreement change)",
            optional=True,
        ),
    ),
    outputs=(
        Data("metrics", "metrics", "metrics artifact to write"),
        Data("plots", "folder", "folder for the PNG plots", kfp_type="Artifact"),
        Data("units", "units", "units artifact to write (per prompt and pair, for intervals)", optional=True),
        Data("guard", "guard", "the signal guard's verdict on the round (guard artifact)", optional=True),
        Data(
            "items",
            "item_usefulness",
            "the probe rubric's items: how each splits the responses and agrees with the gold",
            optional=True,
        ),
    ),
    lineage=_evaluate_lineage,
    kfp_summary=True,
    kfp_returns="guard/healthy",
    check=_check_evaluate,
)


# ---- rollback (pipeline.guard.action rollback): the next round's start


def rollback(cfg: Config, round_idx: int, *, start_policy, start_generator, guard, out_policy, out_generator):
    """The next round's policy and generator: round t's when its signal guard found it healthy, else the
    ones round t started from (so, round after round, the last healthy round's). Written as reference
    folders (model_references.write_reference) that name the chosen checkpoints where they are."""
    from dynamicrubric.infra.model_references import model_reference, write_reference

    record = read_frame(guard, "guard").iloc[0]
    if int(record["round"]) != round_idx:
        raise ValueError(
            f"rollback: {guard} is the guard of round {int(record['round'])}, not of round {round_idx}"
        )
    healthy = bool(record["healthy"])
    policy = str(record["policy"]) if healthy else model_reference(start_policy)
    generator = str(record["generator"]) if healthy else model_reference(start_generator)
    write_reference(out_policy, policy)
    if out_generator:
        write_reference(out_generator, generator)
    if not healthy:
        log.warning(
            "round %d: the signal guard's alarm fired (%s): round %d starts from the policy %s and the "
            "generator %s that round %d started from",
            round_idx,
            record["alarms"],
            round_idx + 1,
            policy,
            generator,
            round_idx,
        )
    return {"healthy": float(healthy), "policy": policy, "generator": generator}


def _rollback_lineage(run, run_name: str, round_idx: int, values: dict, result: dict) -> None:
    # The chain's next segment finds its start here (launch.segment_start), as it finds a checkpoint.
    run.log_model(run_name, f"policy-start-round-{round_idx + 1}", result["policy"])
    if values["out_generator"]:
        run.log_model(run_name, f"generator-start-round-{round_idx + 1}", result["generator"])
    run.log_metrics({"healthy": result["healthy"]})


ROLLBACK = Stage(
    "rollback",
    "the next round's start: the round's policy and generator if its guard found it healthy, else its own start",
    rollback,
    lambda v: "rollback",
    models=(
        ModelParam("start_policy", "the policy the round started from", default_from="policy"),
        ModelParam("start_generator", "the generator the round started from", default_from="generator"),
    ),
    inputs=(Data("guard", "guard", "the round's guard artifact (from evaluate)"),),
    outputs=(
        Data("policy", "reference", "folder naming the next round's policy", kfp_type="Model"),
        Data(
            "generator",
            "reference",
            "folder naming the next round's generator",
            optional=True,
            kfp_type="Model",
        ),
    ),
    lineage=_rollback_lineage,
)
