"""Study v2 of docs/results.md: the four evaluators under online training, with confidence intervals.

    python -m bench.study sizing                         # what the study's size rests on (JSON)
    python -m bench.study pairs                          # >= 200 labelled pairs from held-out outcomes
    python -m bench.study run --variant dynamic          # one variant end to end (static, pointwise, verifiable)
    python -m bench.study run --variant dynamic --check  # rerun it and compare every metric and plot
    python -m bench.study report                         # the tables and plots of docs/results.md

`run` lays bench/study/study.yaml over the `local` preset, sets the variant, and runs:
  1. round 0: the evaluate stage on the untrained models (every variant's starting point);
  2. the N-round pipeline under kfp.local, exactly as `dynrubric run` does (online GRPO on TRL for
     both trainers), in a fresh pipeline root and a fresh SQLite MLflow store under --root;
then reads back what the stages wrote: the evaluate stage's units (one value per held-out prompt,
labelled pair and win-rate prompt), the signal audit's per-set diagnostics, both trainers' per-step
metrics, and every stage's wall time (MLflow). Every accuracy, gap and rate gets a 95% percentile
bootstrap interval over its units (bench/stats.py). Everything is seeded: a rerun gives the same
numbers; only wall times change.

`sizing` measures, on the untrained SmolLM2-135M-Instruct, the share of candidate sets (K samples of
one prompt) whose verifiable outcomes are mixed, per candidate task, and the seconds per step of each
trainer on the study config; `plan` in its JSON shows the arithmetic from those to the step counts.
The labelled pairs (bench/study/pairs.jsonl) are the untrained policy's answers to held-out prompts
that no variant trains or evaluates on, a correct one "chosen" and a wrong one "rejected" by the checker.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

from bench import RESULTS, machine_info
from bench.stats import bootstrap_mean, paired_units, unit_intervals
from dynamicrubric import tasks
from dynamicrubric.evaluation.labelled import OUTCOMES_PREFIX
from dynamicrubric.infra import tracking
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import Config
from dynamicrubric.infra.config_loading import _merge, load_config

HERE = Path(__file__).parent / "study"
PLOTS = Path(__file__).parent.parent / "docs" / "results"  # per-variant plots for the report
STUDY_CONFIG = HERE / "study.yaml"
PAIRS = HERE / "pairs.jsonl"
SIZING = RESULTS / "study_sizing.json"
VARIANTS: dict[str, dict] = {
    "dynamic": {"evaluate": {"variants": ["dynamic"]}},
    "static": {"rubrics": {"variant": "static"}, "evaluate": {"variants": ["static"]}},
    "pointwise": {"judge": {"variant": "pointwise"}, "evaluate": {"variants": ["pointwise"]}},
    # The checker is this variant's evaluator: on pairs labelled by the checker it is right by
    # construction, so the evaluate stage measures no evaluator for it.
    "verifiable": {"judge": {"variant": "verifiable"}, "evaluate": {"variants": []}},
}
# Short-answer tasks a 135M model solves sometimes; `sizing` measures which split its K samples.
CANDIDATE_TASKS = [
    "reasoning_gym:basic_arithmetic",
    "reasoning_gym:chain_sum",
    "reasoning_gym:products",
    "reasoning_gym:gcd",
    "reasoning_gym:lcm",
    "reasoning_gym:leg_counting",
    "reasoning_gym:letter_counting",
    "reasoning_gym:simple_equations",
]
SIZING_PROMPTS = 24  # per candidate task: K samples each
SIZING_SEED = 7  # a data seed the study's own prompts (data.seed 0) and the pairs (PAIR_SEED) do not use
MIN_PAIRS = 200
PAIR_SEED = 1
# Prompts per task sampled at a time: 2 x 160 held-out prompts gave 113 pairs (37% mixed).
PAIR_PROMPTS_PER_SOURCE = 160
BUDGET_S = 90 * 60  # per variant, on 2 idle cores

log = logging.getLogger("bench.study")


def study_config(variant: str, root: Path, preset: str | None = None, extra: dict | None = None) -> Config:
    """The study's config for one variant; its pipeline root and MLflow store live under `root`.
    `extra` is laid over everything (tests shrink the study with it)."""
    overrides = {
        **VARIANTS[variant],
        "data": {"labelled": [str(PAIRS.resolve())]},
        "pipeline": {
            "pipeline_root": str(root / "runs"),
            "mlflow_tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
        },
    }
    return load_config(STUDY_CONFIG, preset=preset, overrides=_merge(overrides, extra or {}))


# --------------------------------------------------------------------------------------------------
# sizing
# --------------------------------------------------------------------------------------------------


def mixed_share(cfg: Config, sources: list[str], prompts_per_task: int) -> dict[str, dict]:
    """Per task: the share of K-sample sets with mixed checker outcomes (some right, some wrong), and
    the mean accuracy, each with its bootstrap interval over prompts."""
    from dynamicrubric.engines import load_engine
    from dynamicrubric.evaluation.evaluate import check_samples
    from dynamicrubric.scoring.rollout import sample_rollouts

    engine = load_engine(cfg.models.policy, cfg.engine)
    out = {}
    for source in sources:
        started = time.perf_counter()
        prompts = tasks.load_prompts([source], prompts_per_task, "train", seed=SIZING_SEED)
        rollouts = sample_rollouts(engine, prompts, cfg, seed=SIZING_SEED, policy=cfg.models.policy)
        scores = check_samples(rollouts, prompts, cfg.evaluate.sandbox_timeout_s).groupby("prompt_id")[
            "score"
        ]
        out[source] = {
            "mixed": bootstrap_mean((scores.max() > scores.min()).astype(float)),
            "accuracy": bootstrap_mean(scores.mean()),
            "seconds": round(time.perf_counter() - started, 1),
        }
        log.info(
            "sizing: %s mixed %.2f accuracy %.3f",
            source,
            out[source]["mixed"]["mean"],
            out[source]["accuracy"]["mean"],
        )
    engine.close()
    return out


def step_costs(cfg: Config, work: Path, steps: int = 2) -> dict[str, Any]:
    """Seconds per step of both trainers on the study config (the dynamic reward), their per-step
    split, and the seconds of the once-a-round stages that do not scale with steps."""
    from dynamicrubric.evaluation.evaluate import run_evaluate
    from dynamicrubric.infra.artifact_kinds import empty_table
    from dynamicrubric.stages.runner import run_stage
    from dynamicrubric.training import launcher
    from dynamicrubric.training.data import TrainingJob
    from dynamicrubric.training.monitoring import timing_frame

    probe = cfg.model_copy(
        update={
            "train_evaluator": cfg.train_evaluator.model_copy(update={"max_steps": steps}),
            "train_policy": cfg.train_policy.model_copy(update={"max_steps": steps}),
        }
    )
    y, d, seconds = probe.to_yaml(), probe.data, {}
    prompts, held_out = str(work / "prompts.parquet"), str(work / "eval_prompts.parquet")
    write_artifact(prompts, "prompts", tasks.configured_prompts(d, "train"))
    write_artifact(held_out, "prompts", tasks.configured_prompts(d, "eval"))

    started = time.perf_counter()
    lists = str(work / "no-lists.parquet")
    write_artifact(lists, "anchors", empty_table("anchors"))
    rollouts, sets, ranked = (str(work / f"{n}.parquet") for n in ("rollouts", "sets", "ranked"))
    run_stage("rollout", y, "", 1, label="generator", prompts=prompts, out_rollouts=rollouts,
              policy=probe.models.policy, shard=0, num_shards=1, seed=1)  # fmt: skip
    run_stage("candidates", y, "", 1, rollouts=rollouts, prompts=prompts, anchor_lists=lists, shard=0, num_shards=1,
              out_candidate_sets=sets, out_anchors=ranked)  # fmt: skip
    seconds["generator_candidates"] = time.perf_counter() - started

    started = time.perf_counter()
    run_evaluate(
        held_out,
        str(work / "eval.parquet"),
        str(work / "plots"),
        probe,
        labelled_uris=[str(PAIRS)],
        round_idx=0,
    )
    seconds["evaluate"] = time.perf_counter() - started

    curves = {}
    for trainer, kwargs in (
        ("train-evaluator", {"candidates": [sets], "anchors": [ranked], "generator": probe.models.generator}),
        ("train-policy", {"prompts_uri": prompts, "policy": probe.models.policy}),
    ):
        metrics_uri = str(work / f"{trainer}.metrics.parquet")
        result = launcher.launch(
            probe,
            TrainingJob(
                trainer,
                out_uri=str(work / trainer),
                steps_uri=str(work / f"{trainer}.steps"),
                metrics_uri=metrics_uri,
                round_idx=1,
                **kwargs,
            ),
        )
        timing = timing_frame(result).groupby("name")["value"].mean()  # not in the artifact
        curves[trainer] = {name: round(float(v), 1) for name, v in timing.items()}
    return {
        "steps_measured": steps,
        "per_step_s": curves,
        "once_per_round_s": {k: round(v, 1) for k, v in seconds.items()},
    }


def plan(cfg: Config, costs: dict[str, Any], budget_s: float = BUDGET_S) -> dict[str, Any]:
    """The arithmetic from measured costs to a variant's wall time at the configured step counts.

    A round = generator candidates + S_g evaluator steps + the signal audit + S_p policy steps +
    evaluate; the audit writes and judges two rubrics per held-out set, estimated from the policy
    step's rubric and judge seconds per prompt. Round 0 is one evaluate."""
    g, p = costs["per_step_s"]["train-evaluator"], costs["per_step_s"]["train-policy"]
    once = costs["once_per_round_s"]
    per_prompt = (
        p.get("time/rubrics_s", 0.0) + p.get("time/judge_s", 0.0)
    ) / cfg.train_policy.prompts_per_step
    held_out = cfg.data.eval_prompts * len(cfg.data.sources)
    audit_s = 2 * held_out * per_prompt
    s_g, s_p, rounds = cfg.train_evaluator.max_steps, cfg.train_policy.max_steps, cfg.pipeline.rounds
    round_s = (
        once["generator_candidates"]
        + s_g * g["time/step_s"]
        + audit_s
        + s_p * p["time/step_s"]
        + once["evaluate"]
    )
    total = rounds * round_s + once["evaluate"]
    return {
        "formula": "rounds x (candidates + S_g x evaluator step + audit + S_p x policy step + evaluate) + evaluate",
        "evaluator_steps": s_g,
        "policy_steps": s_p,
        "rounds": rounds,
        "audit_s_estimate": round(audit_s, 1),
        "round_s": round(round_s, 1),
        "total_min": round(total / 60, 1),
        "budget_min": budget_s / 60,
    }


# --------------------------------------------------------------------------------------------------
# pairs
# --------------------------------------------------------------------------------------------------


def make_pairs(out: Path, minimum: int = MIN_PAIRS) -> int:
    """Chosen/rejected pairs from the untrained policy's samples on held-out prompts (one per prompt
    with mixed outcomes), sampling further prompts until there are `minimum`; returns the count."""
    from dynamicrubric.engines import load_engine
    from dynamicrubric.evaluation.evaluate import check_samples
    from dynamicrubric.scoring.rollout import sample_rollouts

    cfg = load_config(STUDY_CONFIG)
    study_eval = set(tasks.configured_prompts(cfg.data, "eval")["prompt"])
    engine = load_engine(cfg.models.policy, cfg.engine)
    records: list[dict] = []
    done: set[str] = set()
    per_source, batch = PAIR_PROMPTS_PER_SOURCE, 0
    while len(records) < minimum:
        if per_source > 4096:
            raise RuntimeError(f"pairs: only {len(records)} pairs from {per_source} prompts per task")
        # the streams are deterministic, so a longer draw extends a shorter one: sample only the new prompts
        prompts = tasks.load_prompts(cfg.data.sources, per_source, "eval", seed=PAIR_SEED)
        prompts = prompts[~prompts["prompt"].isin(study_eval) & ~prompts["prompt_id"].isin(done)]
        done |= set(prompts["prompt_id"])
        rollouts = sample_rollouts(engine, prompts, cfg, seed=PAIR_SEED + batch, policy=cfg.models.policy)
        scored = check_samples(rollouts, prompts, cfg.evaluate.sandbox_timeout_s).merge(
            rollouts[["prompt_id", "sample_idx", "response"]], on=["prompt_id", "sample_idx"]
        )
        text = prompts.set_index("prompt_id")["prompt"]
        for prompt_id, group in scored.sort_values(["prompt_id", "sample_idx"]).groupby(
            "prompt_id", sort=True
        ):
            right = group.loc[group["score"] == 1.0, "response"].tolist()
            wrong = [r for r in group.loc[group["score"] == 0.0, "response"] if r.strip()]
            if right and wrong:
                records.append(
                    {"id": prompt_id, "prompt": text[prompt_id], "chosen": right[0], "rejected": wrong[0]}
                )
        log.info("pairs: %d from %d prompts per task", len(records), per_source)
        per_source, batch = per_source + PAIR_PROMPTS_PER_SOURCE, batch + 1
    engine.close()
    out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    return len(records)


# --------------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------------


def run_variant(
    variant: str, root: Path, plots: Path, preset: str | None = None, extra: dict | None = None
) -> dict[str, Any]:
    from dynamicrubric.evaluation.evaluate import run_evaluate
    from dynamicrubric.localrun.launch import run_local

    root = root.resolve() / variant
    if root.exists():  # a fresh store: kfp.local's cache and old MLflow runs would skew the numbers
        shutil.rmtree(root)
    root.mkdir(parents=True)
    cfg = study_config(variant, root, preset, extra)
    machine = machine_info()

    log.info("study %s: round 0, the untrained models", variant)
    started = time.perf_counter()
    held_out = tasks.configured_prompts(cfg.data, "eval")
    eval_prompts = str(root / "round0" / "eval_prompts.parquet")
    write_artifact(eval_prompts, "prompts", held_out)
    round0_units = str(root / "round0" / "units.parquet")
    round0 = run_evaluate(
        eval_prompts,
        str(root / "round0" / "metrics.parquet"),
        str(root / "round0" / "plots"),
        cfg,
        labelled_uris=cfg.data.labelled,
        round_idx=0,
        out_units_uri=round0_units,
    )
    round0_s = time.perf_counter() - started

    log.info("study %s: the %d-round pipeline under kfp.local", variant, cfg.pipeline.rounds)
    started = time.perf_counter()
    local = run_local(cfg)
    pipeline_s = time.perf_counter() - started

    outputs = task_outputs(local.tasks)
    units = pd.concat(
        [read_frame(round0_units, "units")]
        + [read_frame(u, "units") for u in outputs.get(("evaluate", ""), {}).values()],
        ignore_index=True,
    )
    copy_plots(local.tasks, plots)
    return {
        "variant": variant,
        "command": f"python -m bench.study run --variant {variant}"
        + (f" --preset {preset}" if preset else ""),
        "config": cfg.model_dump(mode="json"),
        "machine": machine,
        "prompts": {
            "train_pool": len(tasks.configured_prompts(cfg.data, "train")),
            "held_out": len(held_out),
            "labelled_pairs": sum(1 for _ in PAIRS.open()),
        },
        "round0": {"metrics": round0, "wall_s": round0_s},
        "pipeline_wall_s": pipeline_s,
        "stages": stage_runs(cfg, local.parent_run_id),
        "evaluate": {"intervals": round_intervals(units), "units": units_json(units)},
        "audit": audit_intervals(outputs),
        "steps": step_curves(outputs, trainer_timings(cfg, local.parent_run_id)),
    }


def task_outputs(tasks_index: list[dict]) -> dict[tuple[str, str], dict[int, str]]:
    """(stage, role) -> {round: the URI of the output the study reads}: evaluate's units, each
    audit aggregate's diagnostics, each trainer's metrics."""
    wanted = {
        "evaluate": "units",
        "aggregate": "diagnostics",
        "train-policy": "metrics",
        "train-evaluator": "metrics",
    }
    out: dict[tuple[str, str], dict[int, str]] = {}
    for t in tasks_index:
        name = wanted.get(t["stage"])
        if name is None or not t["outputs"].get(name):
            continue
        role = t["role"] if t["stage"] == "aggregate" else ""
        if t["stage"] == "aggregate" and not role.startswith("audit"):
            continue
        out.setdefault((t["stage"], role), {})[t["round"]] = t["outputs"][name][0]
    return out


def own_pairs_apart(units: pd.DataFrame) -> pd.DataFrame:
    """The units with the pairs built from the policy's own samples (OUTCOMES_PREFIX) moved to a
    measure of their own ("pair_soft" -> "pair_soft_own"): they change with P_t, so neither two rounds
    nor two runs share them, and "pair_soft" is the labelled set alone."""
    own = units["measure"].str.startswith("pair") & units["unit_id"].str.startswith(OUTCOMES_PREFIX)
    return units.assign(measure=units["measure"].where(~own, units["measure"] + "_own"))


def round_intervals(units: pd.DataFrame) -> dict[str, dict[str, dict]]:
    """Round -> "<variant>/<measure>" -> bootstrap interval over the units; plus for every round
    after 0 the paired difference from round 0 on the same prompts and pairs ("Δ r0 ...").

    Evaluator accuracy ("pair_soft", "pair_hard") is over the labelled pairs alone, the same set in
    every round and variant; the pairs the evaluate stage adds from the policy's own held-out samples
    change with P_t, so they get their own measure ("pair_soft_own", "pair_hard_own")."""
    units = own_pairs_apart(units)
    out: dict[str, dict[str, dict]] = {}
    for t, group in units.groupby("round", sort=True):
        out[str(t)] = unit_intervals(group)
        if t == 0:
            continue
        for (variant, measure), now in group.groupby(["variant", "measure"]):
            base = units[
                (units["round"] == 0) & (units["variant"] == variant) & (units["measure"] == measure)
            ]
            if measure == "win" or measure.endswith("_own") or base.empty:
                continue
            out[str(t)][f"Δr0/{variant}/{measure}"] = paired_units(now, base)
    return out


def units_json(units: pd.DataFrame) -> list[list]:
    """The units as compact rows [round, variant, measure, unit_id, value], kept so that `report` can
    pair variants on the same prompts and pairs."""
    cols = ["round", "variant", "measure", "unit_id", "value"]
    return [[int(r[0]), r[1], r[2], r[3], round(float(r[4]), 6)] for r in units[cols].itertuples(index=False)]


def audit_intervals(outputs: dict[tuple[str, str], dict[int, str]]) -> dict[str, dict[str, dict]]:
    """Round -> "<label>/<measure>" -> interval over the probe sets: Δgap, tie rate, uniform rate,
    for G_{t−1} ("audit-before") and G_t ("audit-after"), or the fixed evaluator ("audit"); for the
    dynamic variant also the paired after − before difference over the same sets."""
    out: dict[str, dict[str, dict]] = {}
    per_round: dict[int, dict[str, pd.DataFrame]] = {}
    for (stage, label), by_round in outputs.items():
        if stage != "aggregate":
            continue
        for t, uri in by_round.items():
            d = read_frame(uri, "diagnostics").groupby("prompt_id", sort=True)
            per_set = pd.DataFrame(
                {
                    "mean_gap": d["mean_gap"].mean(),
                    "tie_rate": d["tie_rate"].mean(),
                    "uniform": d["uniform"].mean(),
                }
            )
            per_round.setdefault(t, {})[label] = per_set
            for measure in per_set.columns:
                out.setdefault(str(t), {})[f"{label}/{measure}"] = bootstrap_mean(per_set[measure])
    for t, labels in per_round.items():
        if "audit-before" in labels and "audit-after" in labels:
            for measure in ("mean_gap", "tie_rate", "uniform"):
                after, before = (
                    labels[x][measure].rename("value").rename_axis("unit_id").reset_index()
                    for x in ("audit-after", "audit-before")
                )
                out[str(t)][f"after−before/{measure}"] = paired_units(after.dropna(), before.dropna())
    return out


STEP_METRICS = (
    "reward_mean", "reward_std", "kl", "entropy", "frac_reward_zero_std", "rewards/r_disc/mean",
    "rewards/r_anchor/mean", "rubrics/parse_rate", "judge/yes_rate", "signal/tie_rate", "signal/uniformity_rate",
    "signal/mean_gap", "time/step_s", "time/generation_s", "time/rubrics_s", "time/judge_s", "time/reward_s",
    "time/update_s",
)  # fmt: skip


def step_curves(
    outputs: dict[tuple[str, str], dict[int, str]],
    timings: dict[tuple[str, int], dict[str, list]] | None = None,
) -> dict[str, dict[str, dict[str, list]]]:
    """Trainer -> round -> metric -> per-step values, from the trainers' metrics artifacts and, for the
    time/* measurements (which the artifacts leave out, so that a rerun reproduces them), from
    `timings` (trainer_timings: the trainers' MLflow runs)."""
    out: dict[str, dict[str, dict[str, list]]] = {}
    for trainer in ("train-evaluator", "train-policy"):
        for t, uri in sorted(outputs.get((trainer, ""), {}).items()):
            m = read_frame(uri, "metrics")
            curves = {
                name: [round(float(v), 6) for v in g.sort_values("step")["value"]]
                for name, g in m[m["name"].isin(STEP_METRICS)].groupby("name")
            }
            measured = (timings or {}).get((trainer, t), {})
            curves.update({name: values for name, values in measured.items() if name in STEP_METRICS})
            out.setdefault(trainer, {})[str(t)] = dict(sorted(curves.items()))
    return out


def trainer_timings(cfg: Config, parent_run_id: str) -> dict[tuple[str, int], dict[str, list]]:
    """(trainer, round) -> time/* metric -> per-step values, from the trainers' MLflow runs."""
    client = tracking.mlflow_client(cfg)
    out: dict[tuple[str, int], dict[str, list]] = {}
    for round_idx, runs in tracking.stage_runs_by_round(cfg, parent_run_id).items():
        for run in runs:
            trainer = run.data.tags[tracking.STAGE_TAG]
            if trainer not in ("train-evaluator", "train-policy"):
                continue
            curves = out.setdefault((trainer, round_idx), {})
            for key in (k for k in run.data.metrics if "time/" in k):  # "<variant>/time/step_s"
                history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda x: x.step)
                curves[key[key.index("time/") :]] = [round(float(x.value), 6) for x in history]
    return out


def copy_plots(tasks_index: list[dict], dest: Path) -> list[Path]:
    """The last round's evaluate-stage plots, copied to `dest` (docs/results/<variant>/ for the report)."""
    evaluations = [t for t in tasks_index if t["stage"] == "evaluate" and t["outputs"].get("plots")]
    dest.mkdir(parents=True, exist_ok=True)
    if not evaluations:
        return []
    last = Path(max(evaluations, key=lambda t: t["round"])["outputs"]["plots"][0])
    return [Path(shutil.copy2(png, dest / png.name)) for png in sorted(last.glob("*.png"))]


def stage_runs(cfg: Config, parent_run_id: str) -> list[dict[str, Any]]:
    """Every stage run of the pipeline run: round, stage (shard suffix dropped), seconds, metrics."""
    rows = []
    for run in (r for runs in tracking.stage_runs_by_round(cfg, parent_run_id).values() for r in runs):
        tags = run.data.tags
        rows.append(
            {
                "round": int(tags[tracking.ROUND_TAG]),
                "stage": re.sub(r"-\d+$", "", tags[tracking.STAGE_TAG]),
                "task": tags[tracking.STAGE_TAG],
                "seconds": run.data.metrics.pop("stage_wall_s"),
                "metrics": dict(sorted(run.data.metrics.items())),
            }
        )
    return sorted(rows, key=lambda r: (r["round"], r["task"]))


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------


def _max_steps(train_config: dict) -> int:
    """A recorded train config's step count: results recorded before TRL's name say `steps`."""
    return train_config["max_steps"] if "max_steps" in train_config else train_config["steps"]


def fmt_interval(r: dict | None, digits: int = 3) -> str:
    """ "0.344 [0.29, 0.40] (n=64)"; "–" when missing or undefined."""
    if not r or r.get("n", 0) == 0 or r["mean"] != r["mean"]:
        return "–"
    return f"{r['mean']:.{digits}f} [{r['low']:.{digits}f}, {r['high']:.{digits}f}] (n={r['n']})"


def summary_rows(results: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per variant and round: policy accuracy, win rate, evaluator accuracy (soft and hard),
    and the audit's Δgap and tie rate, each with its interval."""
    rows = []
    for result in results:
        v = result["variant"]
        ev, audit = round_intervals(units_frame(result)), result["audit"]  # the units are the record
        for t in sorted(ev, key=int):
            a = audit.get(t, {})
            label = "audit-after" if v == "dynamic" else "audit"
            rows.append(
                {
                    "variant": v,
                    "round": t,
                    "policy avg@k": fmt_interval(ev[t].get("policy/avg_at_k")),
                    "Δ avg@k vs r0": fmt_interval(ev[t].get("Δr0/policy/avg_at_k")),
                    "win rate vs prev": fmt_interval(ev[t].get("policy/win")),
                    "eval acc (soft)": fmt_interval(ev[t].get(f"{v}/pair_soft")),
                    "eval acc (hard)": fmt_interval(ev[t].get(f"{v}/pair_hard")),
                    "audit Δgap": fmt_interval(a.get(f"{label}/mean_gap")),
                    "audit tie rate": fmt_interval(a.get(f"{label}/tie_rate")),
                }
            )
    return rows


def variant_differences(results: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Paired differences between variants at the last round, on the same held-out prompts (policy
    avg@k) and the same labelled pairs (evaluator accuracy, soft verdicts)."""
    units = {r["variant"]: own_pairs_apart(units_frame(r)) for r in results}
    rows = []
    names = list(units)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            last = min(units[a]["round"].max(), units[b]["round"].max())
            row = {
                "a − b": f"{a} − {b}",
                "round": str(last),
                "policy avg@k": fmt_interval(
                    paired_units(
                        _pick(units[a], last, "policy", "avg_at_k"),
                        _pick(units[b], last, "policy", "avg_at_k"),
                    )
                ),
            }
            ea, eb = _pick(units[a], last, a, "pair_soft"), _pick(units[b], last, b, "pair_soft")
            row["eval acc (soft)"] = fmt_interval(paired_units(ea, eb)) if len(ea) and len(eb) else "–"
            rows.append(row)
    return rows


def units_frame(result: dict[str, Any]) -> pd.DataFrame:
    """A result's evaluate units (see `units_json`) as a frame."""
    return pd.DataFrame(
        result["evaluate"]["units"], columns=["round", "variant", "measure", "unit_id", "value"]
    )


def _pick(units: pd.DataFrame, t: int, variant: str, measure: str) -> pd.DataFrame:
    """One round's units of one variant and measure."""
    return units[(units["round"] == t) & (units["variant"] == variant) & (units["measure"] == measure)]


def markdown(rows: list[dict[str, Any]]) -> str:
    headers = list(rows[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(r[h]) for h in headers) + " |" for r in rows]
    return "\n".join(lines)


def stage_seconds(result: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Seconds per stage and round, summed over shards; round 0 is the untrained models' evaluation."""
    table: dict[str, dict[int, float]] = {}
    for s in result["stages"]:
        row = table.setdefault(s["stage"], {})
        row[s["round"]] = row.get(s["round"], 0.0) + s["seconds"]
    table.setdefault("evaluate", {})[0] = result["round0"]["wall_s"]
    return table


def step_split(result: dict[str, Any]) -> list[dict[str, str]]:
    """Mean seconds per training step, and its split, per trainer and round. The policy's rubrics
    and judge are the evaluator scoring its samples; the generator's generation is its rubric samples."""
    parts = ("step", "generation", "rubrics", "judge", "update")
    rows = []
    for trainer, by_round in result["steps"].items():
        for t, curves in sorted(by_round.items(), key=lambda kv: int(kv[0])):
            means = {p: curves.get(f"time/{p}_s") for p in parts}
            if not means["step"]:
                continue
            rows.append(
                {
                    "trainer": trainer,
                    "round": t,
                    "steps": str(len(means["step"])),
                    **{f"{p} (s)": f"{sum(v) / len(v):.1f}" if v else "–" for p, v in means.items()},
                }
            )
    return rows


def write_step_plots(results: list[dict[str, Any]], dest: Path) -> list[Path]:
    """Per-step curves of every variant: the policy trainer's reward, tie rate, Δgap, KL, yes and parse
    rates, the evaluator trainer's R_disc, R_anchor, KL, parse and yes rates, and each round's held-out
    accuracy with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dest.mkdir(parents=True, exist_ok=True)
    panels = [
        ("train-policy", "reward_mean", "policy reward (mean)"),
        ("train-policy", "signal/tie_rate", "tie rate of the policy's groups"),
        ("train-policy", "signal/mean_gap", "Δgap of the policy's groups"),
        ("train-policy", "kl", "policy KL to the round's start"),
        ("train-policy", "judge/yes_rate", "verifier yes rate (policy steps)"),
        ("train-policy", "rubrics/parse_rate", "rubrics parsed (policy steps)"),
        ("train-evaluator", "rewards/r_disc/mean", "generator R_disc"),
        ("train-evaluator", "rewards/r_anchor/mean", "generator R_anchor"),
        ("train-evaluator", "kl", "generator KL to the round's start"),
        ("train-evaluator", "rubrics/parse_rate", "rubrics parsed (generator steps)"),
        ("train-evaluator", "judge/yes_rate", "verifier yes rate (generator steps)"),
    ]
    fig, axes = plt.subplots(3, 4, figsize=(20, 12))
    for ax, (trainer, name, title) in zip(axes.flat, panels, strict=False):
        for result in results:
            xs, ys = [], []
            for _, curves in sorted(result["steps"].get(trainer, {}).items(), key=lambda kv: int(kv[0])):
                values = curves.get(name, [])
                xs += [len(xs) + i + 1 for i in range(len(values))]
                ys += values
            if ys:
                ax.plot(xs, ys, marker=".", label=result["variant"])
        ax.set_title(title)
        ax.set_xlabel("step (rounds concatenated)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax = axes.flat[-1]
    for result in results:
        ev = result["evaluate"]["intervals"]
        rounds = sorted(ev, key=int)
        means = [ev[t]["policy/avg_at_k"]["mean"] for t in rounds]
        lows = [ev[t]["policy/avg_at_k"]["low"] for t in rounds]
        highs = [ev[t]["policy/avg_at_k"]["high"] for t in rounds]
        ax.errorbar(
            [int(t) for t in rounds], means, yerr=[[m - lo for m, lo in zip(means, lows, strict=True)], [h - m for m, h in zip(means, highs, strict=True)]],
            marker="o", capsize=3, label=result["variant"],
        )  # fmt: skip
    ax.set_title("held-out avg@k (95% bootstrap CI)")
    ax.set_xlabel("round")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = dest / "steps.png"
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    return [path]


def report(results: list[dict[str, Any]]) -> str:
    out = ["### Per variant and round (95% bootstrap intervals)\n", markdown(summary_rows(results)) + "\n"]
    if len(results) > 1:
        out += ["### Paired differences between variants\n", markdown(variant_differences(results)) + "\n"]
    for result in results:
        m, p, c = result["machine"], result["prompts"], result["config"]
        out.append(f"### {result['variant']}\n")
        out.append(
            f"`{result['command']}`: {p['train_pool']} training prompts, {p['held_out']} held-out prompts, "
            f"{p['labelled_pairs']} labelled pairs; K={c['rollout']['k']}, {c['pipeline']['rounds']} rounds of "
            f"{_max_steps(c['train_evaluator'])} evaluator and {_max_steps(c['train_policy'])} policy steps, seed "
            f"{c['seed']}. {m['cpu']}, {m['cores']} cores, torch {m['torch']}. Pipeline "
            f"{result['pipeline_wall_s'] / 60:.1f} min + round-0 evaluation {result['round0']['wall_s'] / 60:.1f} min.\n"
        )
        audit_rows = [
            {"round": t, "measure": k, "interval": fmt_interval(v, 4)}
            for t, measures in sorted(result["audit"].items(), key=lambda kv: int(kv[0]))
            for k, v in measures.items()
        ]
        if audit_rows:
            out.append(markdown(audit_rows) + "\n")
        split = step_split(result)
        if split:
            out.append(markdown(split) + "\n")
        seconds = stage_seconds(result)
        rounds = sorted({t for row in seconds.values() for t in row})
        rows = [
            {"stage": s, **{f"round {t} (s)": f"{row[t]:.0f}" if t in row else "–" for t in rounds}}
            for s, row in seconds.items()
        ]
        out.append(markdown(rows) + "\n")
    return "\n".join(out)


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Every number that differs between two results of one variant, wall times and speeds aside."""

    def numbers(result: dict[str, Any]) -> dict[str, Any]:
        out = {f"round0/{k}": v for k, v in result["round0"]["metrics"].items()}
        for s in result["stages"]:
            out.update({f"round{s['round']}/{s['task']}/{k}": v for k, v in s["metrics"].items()})
        out.update({f"units/{u[0]}/{u[1]}/{u[2]}/{u[3]}": u[4] for u in result["evaluate"]["units"]})
        out.update({f"audit/{t}/{k}": v["mean"] for t, ms in result["audit"].items() for k, v in ms.items()})
        for trainer, by_round in result["steps"].items():
            for t, curves in by_round.items():
                out.update(
                    {f"steps/{trainer}/{t}/{k}": v for k, v in curves.items() if not k.startswith("time/")}
                )
        return out

    x, y = numbers(a), numbers(b)
    keys = sorted(k for k in x.keys() | y.keys() if not k.endswith("_s"))  # seconds and tokens_per_s
    return [f"{k}: {x.get(k)} != {y.get(k)}" for k in keys if x.get(k) != y.get(k)]


def plot_differences(a: Path, b: Path) -> list[str]:
    """Every plot that is not byte for byte the same in folders a and b (a seeded rerun draws the same)."""
    names = sorted({p.name for p in a.glob("*.png")} | {p.name for p in b.glob("*.png")})
    return [
        f"plot {name}: {a / name} != {b / name}"
        for name in names
        if not (
            (a / name).exists() and (b / name).exists() and (a / name).read_bytes() == (b / name).read_bytes()
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.study", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sizing = sub.add_parser("sizing", help=f"mixed-outcome share per task and step costs -> {SIZING.name}")
    sizing.add_argument(
        "part", choices=["tasks", "costs"], help="tasks: mixed-outcome share per candidate task (choose the "
        "study's sources from it); costs: seconds per step on study.yaml (needs the pairs) and the plan",
    )  # fmt: skip
    sizing.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    sub.add_parser("pairs", help=f"write {PAIRS.relative_to(HERE.parent.parent)}")
    run = sub.add_parser("run", help="one variant end to end")
    run.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    run.add_argument("--preset", default=None, help="lay the study over this preset (tiny: a smoke run)")
    run.add_argument("--root", type=Path, default=Path("runs/study"), help="pipeline roots and MLflow stores")
    run.add_argument(
        "--out", type=Path, default=None, help="result JSON (default bench/results/study_<variant>.json)"
    )
    run.add_argument(
        "--check", action="store_true", help="compare with the committed result instead of replacing it"
    )
    rep = sub.add_parser("report", help="markdown tables and plots from the result JSONs")
    rep.add_argument("results", nargs="*", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    if args.command == "sizing":
        cfg = load_config(STUDY_CONFIG)
        result = json.loads(SIZING.read_text()) if SIZING.exists() else {}
        if args.part == "tasks":
            result["tasks"] = {
                "command": "python -m bench.study sizing tasks",
                "machine": machine_info(),
                "prompts_per_task": SIZING_PROMPTS,
                "k": cfg.rollout.k,
                "max_new_tokens": cfg.rollout.max_new_tokens,
                "mixed_share": mixed_share(cfg, CANDIDATE_TASKS, SIZING_PROMPTS),
            }
        else:
            work = args.work or Path(tempfile.mkdtemp(prefix="study-sizing-"))
            work.mkdir(parents=True, exist_ok=True)
            cfg = study_config("dynamic", work)  # the costliest variant: its evaluator writes rubrics
            costs = {
                "command": "python -m bench.study sizing costs",
                "machine": machine_info(),
                **step_costs(cfg, work),
            }
            result["costs"] = costs
            result["plan"] = plan(cfg, costs)
        _write(SIZING, result)
        print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1, default=float))
    elif args.command == "pairs":
        print(f"{make_pairs(PAIRS)} pairs -> {PAIRS}")
    elif args.command == "run":
        committed = RESULTS / f"study_{args.variant}.json"
        if args.check and not committed.exists():
            parser.error(f"--check: {committed} does not exist")
        # A check (or an --out run) leaves the committed result and plots alone.
        path = args.out or (args.root if args.check else RESULTS) / committed.name
        committed_plots = PLOTS / args.variant
        plots = (
            committed_plots if path.resolve() == committed.resolve() else path.parent / f"{path.stem}_plots"
        )
        result = run_variant(args.variant, args.root, plots, args.preset)
        _write(path, result)
        print(report([result]))
        print(f"-> {path}, plots in {plots}")
        if args.check:
            diff = differences(json.loads(committed.read_text()), result) + plot_differences(
                committed_plots, plots
            )
            print(f"{len(diff)} difference(s) from {committed}" + "".join(f"\n  {d}" for d in diff[:20]))
            return 1 if diff else 0
    else:
        paths = args.results or [RESULTS / f"study_{v}.json" for v in VARIANTS]
        results = [json.loads(p.read_text()) for p in paths if p.exists()]
        results = [r for r in results if "evaluate" in r]  # results of the first study have no units
        if not results:
            parser.error(
                "report: no study v2 result found; run `python -m bench.study run --variant V` first"
            )
        write_step_plots(results, PLOTS)
        print(report(results))
    return 0


def _write(path: Path, result: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=float) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
