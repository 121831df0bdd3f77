"""What each pipeline task does, as plain functions over local paths and strings.

A KFP component (components/stages.py) does nothing but call one of these; here the stage
is run, shards are merged, and lineage goes to MLflow. Keeping this in the library means every
task can be run and tested without KFP, and `dynrubric stage NAME` reruns the same code.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from dynamicrubric import logs, store, tracking
from dynamicrubric.artifacts import empty_table, read_frame, read_frames, write_artifact
from dynamicrubric.config import Config, config_from_yaml
from dynamicrubric.models import model_reference


def _setup(config_yaml: str) -> Config:
    logs.setup()
    logs.skip_the_exit_collection()
    return config_from_yaml(config_yaml)


def check_shard(shard: int, num_shards: int) -> None:
    if num_shards < 1:
        raise ValueError(f"num_shards (--num-shards) must be >= 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard (--shard) must be within 0..{num_shards - 1}, got {shard}")


def preflight(*uris: str, folders: Sequence[str] = (), inputs: Sequence[str] = ()) -> None:
    """Check every output (`uris` are files, `folders` folders) can be written before inputs are read
    or a model is loaded: a missing bucket found after the compute throws the compute away. Two outputs
    at one path, or an output at an input's path, would overwrite one with the other without a word,
    and a local file output where a folder is (or the reverse) fails only once written, so they are
    refused too."""
    seen: dict[str, str] = {}
    for uri in (u for u in inputs if u):
        seen.setdefault(_identity(uri), f"the input {uri}")
    for uri in (u for u in (*uris, *folders) if u):
        other = seen.get(_identity(uri))
        if other is not None:
            raise ValueError(f"{uri}: an output cannot be written where {other} is")
        seen[_identity(uri)] = f"the output {uri}"
    for uri in (u for u in uris if u and not store.is_s3(u)):
        if store.local_path(uri).is_dir():
            raise ValueError(f"{uri}: exists and is a folder, not a file")
    for uri in (u for u in folders if u and not store.is_s3(u)):
        path = store.local_path(uri)
        if path.exists() and not path.is_dir():
            raise ValueError(f"{uri}: exists and is not a folder")
    for uri in (*uris, *folders):
        store.check_writable(uri)


def _identity(uri: str) -> str:
    """One spelling per location: a local path resolved (./a and a are one file), an S3 URI as given."""
    return uri.rstrip("/") if store.is_s3(uri) else str(store.local_path(uri).resolve())


def _merged(paths: list[str], kind: str, workdir: str) -> str:
    """One artifact holding all shards (a single path is used as it is)."""
    if len(paths) == 1:
        return paths[0]
    out = str(Path(workdir) / f"{kind}.parquet")
    write_artifact(out, kind, read_frames(paths, kind))
    return out


def write_kfp_metrics(summary, values: dict) -> None:
    """Numbers for the KFP UI, plus a file at the artifact's path: kfp.local treats a cached output whose
    file is missing as stale, and a Metrics artifact has none of its own, which would rerun the task."""
    import json

    finite = {k: float(v) for k, v in values.items() if isinstance(v, int | float) and v == v}
    for name, value in finite.items():
        summary.log_metric(name, value)
    Path(summary.path).parent.mkdir(parents=True, exist_ok=True)
    Path(summary.path).write_text(json.dumps(finite, sort_keys=True))


def start_tracking(config_yaml: str, run_name: str) -> str:
    """Create the MLflow parent run; later tasks find it by `run_name` (see tracking.py)."""
    cfg = _setup(config_yaml)
    return tracking.start_pipeline_run(cfg, run_name, cfg.pipeline.rounds)


def prepare_data(
    config_yaml: str, run_name: str, train_prompts: str, eval_prompts: str, anchor_lists: str
) -> dict:
    """Training and held-out prompts, and the user's anchor lists (Nectar format) for R_anchor."""
    from dynamicrubric import tasks

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    preflight(train_prompts, eval_prompts, anchor_lists)
    with store.outputs_as_a_set(train_prompts, eval_prompts, anchor_lists) as (train, held_out, lists_out):
        write_artifact(train, "prompts", tasks.configured_prompts(cfg.data, "train"))
        write_artifact(held_out, "prompts", tasks.configured_prompts(cfg.data, "eval"))
        lists = [tasks.load_nectar(uri) for uri in cfg.data.anchors]
        write_artifact(lists_out, "anchors", pd.concat(lists) if lists else empty_table("anchors"))
    with tracking.stage_run(cfg, run_name, 0, "prepare_data", started=started) as run:
        if run:
            for uri, kind in [
                (train_prompts, "prompts"),
                (eval_prompts, "prompts"),
                (anchor_lists, "anchors"),
            ]:
                run.log_artifact_dataset(uri, kind, "output")
    return {"train_prompts": len(read_frame(train_prompts, "prompts"))}


def rollout(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    label: str,
    prompts: str,
    out: str,
    policy: str,
    shard: int,
    num_shards: int,
    seed: int,
) -> dict:
    from dynamicrubric.rollout import run_rollout

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    check_shard(shard, num_shards)
    preflight(out, inputs=[prompts])
    counts = run_rollout(prompts, out, cfg, policy=policy, seed=seed, shard=shard, num_shards=num_shards)
    with tracking.stage_run(cfg, run_name, round_idx, f"{label}-rollout-{shard}", started=started) as run:
        if run:
            run.log_params(
                {"policy": model_reference(policy), "seed": seed, "shard": shard, "num_shards": num_shards}
            )
            run.log_artifact_dataset(prompts, "prompts", "input")
            run.log_artifact_dataset(out, "rollouts", "output")
            run.log_metrics(counts)
    return counts


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
    config_yaml: str,
    run_name: str,
    round_idx: int,
    rollouts: str,
    prompts: str,
    anchor_lists: str,
    shard: int,
    num_shards: int,
    out_candidates: str,
    out_anchors: str,
) -> dict:
    """The generator's candidate sets: the policy's rollouts plus this shard's anchor lists.

    The anchors output ranks the sets that have a reference order: rollouts ranked by verifiable
    correctness (correct ≻ incorrect) and the user's human-ranked lists.
    """
    from dynamicrubric import tasks

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    check_shard(shard, num_shards)
    preflight(out_candidates, out_anchors, inputs=[rollouts, prompts, anchor_lists])
    policy_sets = read_frame(rollouts, "rollouts")
    outcome_lists = tasks.anchors_from_outcomes(
        policy_sets, read_frame(prompts, "prompts"), timeout_s=cfg.evaluate.sandbox_timeout_s
    )
    if not cfg.data.anchors_from_outcomes:
        outcome_lists = outcome_lists.iloc[0:0]
    user_lists = read_frame(anchor_lists, "anchors")
    list_ids = sorted(user_lists["list_id"].unique())
    mine = set(list_ids[shard::num_shards])
    user_lists = user_lists[user_lists["list_id"].isin(mine)]
    with store.outputs_as_a_set(out_candidates, out_anchors) as (sets_out, ranked_out):
        write_artifact(sets_out, "rollouts", pd.concat([policy_sets, rollouts_from_anchors(user_lists)]))
        write_artifact(ranked_out, "anchors", pd.concat([outcome_lists, user_lists]))
    counts = {
        "policy_sets": policy_sets["prompt_id"].nunique(),
        "ranked_policy_sets": outcome_lists["list_id"].nunique(),
        "anchor_lists": len(mine),
    }
    with tracking.stage_run(
        cfg, run_name, round_idx, f"generator-candidates-{shard}", started=started
    ) as run:
        if run:
            run.log_params({"shard": shard, "num_shards": num_shards})
            run.log_artifact_dataset(rollouts, "rollouts", "input")
            run.log_artifact_dataset(prompts, "prompts", "input")  # their answers rank the rollouts
            run.log_artifact_dataset(anchor_lists, "anchors", "input")
            run.log_artifact_dataset(out_candidates, "rollouts", "output")
            run.log_artifact_dataset(out_anchors, "anchors", "output")
            run.log_metrics(counts)
    return counts


def rubrics(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    label: str,
    candidates: str,
    out: str,
    generator: str,
    samples: int,
    shard: int,
    seed: int,
) -> dict:
    from dynamicrubric.rubrics import run_rubrics

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    preflight(out, inputs=[candidates])
    counts = run_rubrics(candidates, out, cfg, generator=generator, samples=samples, seed=seed)
    with tracking.stage_run(cfg, run_name, round_idx, f"{label}-rubrics-{shard}", started=started) as run:
        if run:
            run.log_params(
                {"generator": model_reference(generator), "samples": samples, "seed": seed, "shard": shard}
            )
            run.log_artifact_dataset(candidates, "rollouts", "input")
            run.log_artifact_dataset(out, "rubrics", "output")
            run.log_metrics(counts)
    return counts


def judge(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    label: str,
    candidates: str,
    rubrics: str,
    out: str,
    verifier: str,
    shard: int,
) -> dict:
    from dynamicrubric.judge import run_judge

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    preflight(out, inputs=[candidates, rubrics])
    counts = run_judge(candidates, out, cfg, rubrics_uri=rubrics or None, verifier=verifier)
    with tracking.stage_run(cfg, run_name, round_idx, f"{label}-judge-{shard}", started=started) as run:
        if run:
            run.log_params({"verifier": model_reference(verifier), "shard": shard})
            run.log_artifact_dataset(candidates, "rollouts", "input")
            if rubrics:
                run.log_artifact_dataset(rubrics, "rubrics", "input")
            run.log_artifact_dataset(out, "judgments", "output")
            run.log_metrics({k: v for k, v in counts.items() if k != "variant"})
    return counts


def aggregate(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    label: str,
    judgments: list[str],
    candidates: list[str],
    rubrics: list[str],
    anchors: list[str],
    out_scores: str,
    out_rewards: str,
    out_diagnostics: str,
    out_metrics: str,
    prompts: str = "",
) -> dict:
    """Aggregate the shards. Without `anchors` but with `prompts`, the responses are ranked by their
    verifiable correctness first, so the mean gap (Δgap) has a reference ordering to measure against."""
    from dynamicrubric.aggregate import run_aggregate

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    variant = "pointwise" if not rubrics else cfg.rubrics.variant
    outputs = (out_scores, out_rewards, out_diagnostics, out_metrics)
    preflight(*outputs, inputs=[*judgments, *candidates, *rubrics, *anchors, prompts])
    with tempfile.TemporaryDirectory() as work, store.outputs_as_a_set(*outputs) as staged:
        candidates_uri = _merged(candidates, "rollouts", work)
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
        overall = run_aggregate(
            _merged(judgments, "judgments", work),
            candidates_uri,
            *staged,
            rubrics_uri=_merged(rubrics, "rubrics", work) if rubrics else None,
            anchors_uri=anchors_uri,
            soft=cfg.aggregate.soft,
            round_idx=round_idx,
            variant=variant,
        )
    with tracking.stage_run(cfg, run_name, round_idx, f"{label}-aggregate", started=started) as run:
        if run:
            inputs = [(u, "judgments") for u in judgments] + [(u, "rollouts") for u in candidates]
            inputs += [(u, "rubrics") for u in rubrics] + [(u, "anchors") for u in anchors]
            inputs += [(prompts, "prompts")] if prompts else []
            for uri, kind in inputs:
                run.log_artifact_dataset(uri, kind, "input")
            for uri, kind in [
                (out_scores, "scores"),
                (out_rewards, "rewards"),
                (out_diagnostics, "diagnostics"),
                (out_metrics, "metrics"),
            ]:
                run.log_artifact_dataset(uri, kind, "output")
            run.log_metrics(overall)
    return overall


def train_evaluator(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    candidate_sets: list[str],
    anchors: list[str],
    generator: str,
    verifier: str,
    out_model: str,
    out_steps: str,
    out_metrics: str,
) -> dict:
    """Online GRPO on the generator over P_{t−1}'s candidate sets (see dynamicrubric.train)."""
    from dynamicrubric import train

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    preflight(out_metrics, folders=(out_model, out_steps), inputs=[*candidate_sets, *anchors])
    result = train.launch(
        "train-evaluator",
        cfg,
        candidates=list(candidate_sets),
        anchors=list(anchors),
        generator=generator,
        verifier=verifier,
        out_uri=out_model,
        steps_uri=out_steps,
        metrics_uri=out_metrics,
        round_idx=round_idx,
    )
    with tracking.stage_run(cfg, run_name, round_idx, "train_evaluator", started=started) as run:
        if run:
            run.log_params(
                {
                    "generator": model_reference(generator),
                    "verifier": model_reference(verifier),
                    "steps": tracking.artifact_uri(out_steps),  # the per-step artifacts' folder
                }
            )
            for uri in candidate_sets:
                run.log_artifact_dataset(uri, "rollouts", "input")
            for uri in anchors:
                run.log_artifact_dataset(uri, "anchors", "input")
            run.log_artifact_dataset(out_metrics, "metrics", "output")
            run.log_metrics_table(out_metrics)
            run.log_model(run_name, f"generator-round-{round_idx}", out_model, {"base": generator})
    return result


def train_policy(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    prompts: str,
    policy: str,
    generator: str,
    verifier: str,
    out_model: str,
    out_steps: str,
    out_metrics: str,
) -> dict:
    """Online GRPO on the policy, rewarded by the round's evaluator (see dynamicrubric.train)."""
    from dynamicrubric import train

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    preflight(out_metrics, folders=(out_model, out_steps), inputs=[prompts])
    result = train.launch(
        "train-policy",
        cfg,
        prompts_uri=prompts,
        policy=policy,
        generator=generator,
        verifier=verifier,
        out_uri=out_model,
        steps_uri=out_steps,
        metrics_uri=out_metrics,
        round_idx=round_idx,
    )
    with tracking.stage_run(cfg, run_name, round_idx, "train_policy", started=started) as run:
        if run:
            run.log_params(
                {
                    "policy": model_reference(policy),
                    "generator": model_reference(generator),
                    "verifier": model_reference(verifier),
                    "steps": tracking.artifact_uri(out_steps),  # the per-step artifacts' folder
                }
            )
            run.log_artifact_dataset(prompts, "prompts", "input")
            run.log_artifact_dataset(out_metrics, "metrics", "output")
            run.log_metrics_table(out_metrics)
            run.log_model(run_name, f"policy-round-{round_idx}", out_model, {"base": policy})
    return result


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


def evaluate_samples(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    eval_prompts: str,
    policy: str,
    previous_policy: str,
    out_samples: str,
) -> dict:
    """Evaluate's first phase as a task of its own (on GPUs): the policy's held-out samples and the
    previous policy's one for the win rate (`evaluate.sample_held_out`), as one rollouts artifact."""
    from dynamicrubric.evaluate import _Engines, sample_held_out

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    preflight(out_samples, inputs=[eval_prompts])
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
    with tracking.stage_run(cfg, run_name, round_idx, "evaluate-samples", started=started) as run:
        if run:
            run.log_params(
                {
                    "policy": model_reference(policy),
                    "previous": model_reference(previous_policy) if previous_policy else "",
                }
            )
            run.log_artifact_dataset(eval_prompts, "prompts", "input")
            run.log_artifact_dataset(out_samples, "rollouts", "output")
            run.summary.update({"samples": len(samples)})
    return {"samples": len(samples)}


def check_samples(
    config_yaml: str, run_name: str, round_idx: int, eval_prompts: str, samples: str, out_outcomes: str
) -> dict:
    """Evaluate's checker phase as a CPU task of its own: the policy's held-out samples scored by their
    tasks' checkers (HumanEval in the sandbox), so no GPU pod runs the policy's code."""
    from dynamicrubric.evaluate import check_samples as check
    from dynamicrubric.evaluate import split_samples

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    preflight(out_outcomes, inputs=[eval_prompts, samples])
    policy_samples, _previous = split_samples(read_frame(samples, "rollouts"), cfg)
    outcomes = check(policy_samples, read_frame(eval_prompts, "prompts"), cfg.evaluate.sandbox_timeout_s)
    write_artifact(out_outcomes, "outcomes", outcomes)
    counts = {"checked": len(outcomes), "unscored": int(outcomes["score"].isna().sum())}
    with tracking.stage_run(cfg, run_name, round_idx, "check-samples", started=started) as run:
        if run:
            run.log_artifact_dataset(eval_prompts, "prompts", "input")
            run.log_artifact_dataset(samples, "rollouts", "input")
            run.log_artifact_dataset(out_outcomes, "outcomes", "output")
            run.summary.update(counts)
    return counts


def evaluate(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    eval_prompts: str,
    policy: str,
    generator: str,
    verifier: str,
    previous_policy: str,
    out_metrics: str,
    out_plots: str,
    out_units: str = "",
    samples: str = "",
    outcomes: str = "",
) -> dict:
    """The evaluate stage; `samples` and `outcomes` (both or neither) are its first two phases done by
    the evaluate-samples and check-samples tasks, which the pipeline runs where evaluate has GPUs."""
    from dynamicrubric.evaluate import run_evaluate

    started = time.perf_counter()
    cfg = _setup(config_yaml)
    if bool(samples) != bool(outcomes):
        raise ValueError(
            "evaluate: give both the samples and their outcomes (--samples, --outcomes) or neither"
        )
    preflight(out_metrics, out_units, folders=(out_plots,), inputs=[eval_prompts, samples, outcomes])
    if samples and not policy:  # the split pipeline hands no model to this task: the samples say whose
        from dynamicrubric.evaluate import split_samples

        current, previous = split_samples(read_frame(samples, "rollouts"), cfg)
        policy = str(current["policy"].iloc[0])
        previous_policy = str(previous["policy"].iloc[0]) if len(previous) else ""
    # Metrics, plots and units are published together once all exist: a failure leaves none (no empty
    # plots/). An empty out_units writes no units.
    with store.outputs_as_a_set(out_metrics, out_plots, out_units) as (metrics_out, plots_out, units_out):
        result = run_evaluate(
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
    with tracking.stage_run(cfg, run_name, round_idx, "evaluate", started=started) as run:
        if run:
            for uri, kind in ((samples, "rollouts"), (outcomes, "outcomes")):
                if uri:
                    run.log_artifact_dataset(uri, kind, "input")
            params = {
                "policy": model_reference(policy),
                "generator": model_reference(generator),
                "verifier": model_reference(verifier),
                "previous": model_reference(previous_policy) if previous_policy else "",
            }
            run.log_params(params)
            run.log_artifact_dataset(eval_prompts, "prompts", "input")
            run.log_artifact_dataset(out_metrics, "metrics", "output")
            if out_units:
                run.log_artifact_dataset(out_units, "units", "output")
            run.log_metrics_table(out_metrics)
            run.log_dir(out_plots, f"plots/round-{round_idx}")
            for role, metrics in metrics_by_role(result).items():
                model_id = run.find_model(run_name, f"{role}-round-{round_idx}")
                if model_id:  # link each checkpoint to the numbers about its own role
                    run.log_model_metrics(model_id, metrics)
            # the task's log line (these are logged above, per step, by log_metrics_table)
            run.summary.update({k: result[k] for k in ("policy/accuracy", "policy/win_rate") if k in result})
    return result
