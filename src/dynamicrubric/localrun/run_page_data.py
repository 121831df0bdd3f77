"""What the run report page shows, read from MLflow: the parent run, the round table, each round's
signals, the rewards per training step, the judge-call ledger and the traced sets (`collect`). Apart
from the page's HTML (run_page.py, run_page_sections.py): this is the only part that talks to MLflow,
and what it returns is plain data the page renders."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from dynamicrubric.evaluation.benchmark_judge import judge_label
from dynamicrubric.evaluation.plots import TRACED_SETS
from dynamicrubric.infra import tracking
from dynamicrubric.infra.config import Config
from dynamicrubric.localrun.round_table import GUARD_COLUMNS, LEGEND, round_table, scale_notes
from dynamicrubric.localrun.run_page_benchmarks import table_data as benchmark_table

# The signal curves over rounds: (key in a round's signals, label, the audit metric it comes from).
SIGNALS = [
    ("mean_gap", "mean gap", "mean_gap"),
    ("tie_rate", "tie rate", "tie_rate"),
    ("uniformity", "uniformity", "uniformity_rate"),
    ("r_disc", "R_disc", "r_disc_mean"),
]
AUDIT_STAGES = ("audit-after-aggregate", "audit-aggregate")
TRAINING_STAGES = ("train-evaluator", "train-policy")
MAX_STEP_SERIES = 6  # reward curves per training run shown


def collect(cfg: Config, parent_run_id: str) -> dict:
    """Everything the page shows, from MLflow: the parent run, the round table, the signals per round,
    the rewards per training step, the judge-call ledger and the traced sets per round."""
    client = tracking.mlflow_client(cfg)
    parent = client.get_run(parent_run_id)
    by_round = tracking.stage_runs_by_round(cfg, parent_run_id)
    rows = round_table(cfg, parent_run_id)
    rounds = []
    evaluated: dict[int, dict] = {}  # each round's evaluate metrics, for the benchmark table
    for row in rows:
        t = row["round"]
        stages = {s.data.tags.get(tracking.STAGE_TAG): s for s in by_round.get(t, [])}
        audit = next((stages[a].data.metrics for a in AUDIT_STAGES if a in stages), {})
        signals = {key: audit.get(metric) for key, _, metric in SIGNALS}
        for key in ("evaluator_acc", "policy_acc", "win_rate"):
            signals[key] = row[key][0] if row[key] else None
        ledger: dict[str, float] = {}
        for stage in by_round.get(t, []):
            for key, value in stage.data.metrics.items():
                if "/calls_" in key:
                    kind = key.rsplit("/calls_", 1)[1]
                    ledger[kind] = ledger.get(kind, 0.0) + value
        evaluate = stages.get("evaluate")
        if evaluate is not None:
            evaluated[t] = evaluate.data.metrics
        guard = {
            k.removeprefix("guard/"): v
            for k, v in (evaluate.data.metrics if evaluate else {}).items()
            if k.startswith("guard/")
        }
        rounds.append(
            {
                "round": t,
                "row": row,
                "guard": guard,
                "alarm": evaluate.data.tags.get("guard.alarm", "") if evaluate else "",
                "signals": signals,
                "steps": _step_rewards(client, [stages[s] for s in TRAINING_STAGES if s in stages]),
                "ledger": ledger,
                "sets": _traced_sets(client, stages.get("evaluate"), t),
            }
        )
    info = parent.info
    return {
        "run_name": parent.data.tags.get(tracking.PIPELINE_TAG, info.run_name),
        "run_id": parent_run_id,
        "experiment": cfg.pipeline.experiment,
        "tracking_uri": tracking.tracking_uri(cfg),
        "start_ms": info.start_time,
        "end_ms": info.end_time,
        "preset": cfg.preset,
        "variant": _variant(cfg),
        "models": {
            "policy": cfg.models.policy,
            "generator": cfg.models.generator,
            "verifier": cfg.models.verifier,
        },
        "legend": [
            (name, meaning)
            for name, meaning in LEGEND
            if rows and name in rows[0] and name not in GUARD_COLUMNS
        ],
        "benchmarks": benchmark_table(
            evaluated, judge_label(cfg), {b.name: b.protocol for b in cfg.evaluate.benchmarks}
        )
        if cfg.evaluate.benchmarks
        else None,
        "guard_action": cfg.guard.action,
        "notes": [n.strip() for n in scale_notes(cfg)],
        "rounds": rounds,
    }


def _variant(cfg: Config) -> str:
    from dynamicrubric.pipelines.run_plan import pipeline_variant

    return pipeline_variant(cfg)


def _step_rewards(client, runs: list) -> dict[str, list[tuple[int, float]]]:
    """The training runs' reward metrics per step ("<stage> <metric>" -> [(step, value)])."""
    series = {}
    for run in runs:
        # the mean reward TRL logs per step, and each reward function's mean (R_disc, R_anchor, the score)
        keys = sorted(
            k
            for k in run.data.metrics
            if k.endswith("reward_mean") or ("rewards/" in k and k.endswith("/mean"))
        )
        for key in keys[:MAX_STEP_SERIES]:
            history = client.get_metric_history(run.info.run_id, key)
            points = sorted((int(m.step), float(m.value)) for m in history)
            if points:
                series[f"{run.data.tags.get(tracking.STAGE_TAG)} {key}"] = points
    return series


def _traced_sets(client, evaluate_run, round_idx: int) -> list[dict]:
    """The judged candidate sets the round's evaluate stage traced ([] when none were logged)."""
    if evaluate_run is None:
        return []
    path = f"plots/round-{round_idx}/{TRACED_SETS}"
    names = {a.path for a in client.list_artifacts(evaluate_run.info.run_id, f"plots/round-{round_idx}")}
    if path not in names:
        return []
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

    before = os.environ.get(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name)
    # no "Downloading artifacts" bar after `dynrubric run`'s report: a run prints its task lines and report
    os.environ[MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name] = "false"
    try:
        with tempfile.TemporaryDirectory(prefix="dynrubric-page-") as tmp:
            local = client.download_artifacts(evaluate_run.info.run_id, path, tmp)
            return json.loads(Path(local).read_text())
    finally:
        if before is None:
            os.environ.pop(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name, None)
        else:
            os.environ[MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name] = before
