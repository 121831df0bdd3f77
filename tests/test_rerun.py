"""`dynrubric stage NAME --from-run` reruns a finished pipeline's task from what MLflow recorded (config,
seed, samples, model references, inputs) and writes the same bytes the pipeline wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynamicrubric import tracking
from dynamicrubric.artifacts import write_artifact
from dynamicrubric.config import load_config
from dynamicrubric.models import prepare_model
from dynamicrubric.rerun import inputs_by_kind
from dynamicrubric.rollout import run_rollout

RERUN_STAGES = ("rollout", "rubrics", "judge")
# The signal audit's second shard in the last round: P_{t-1} and G_t are checkpoints there, not base
# models, and the shard offset matters.
TASKS = {"rollout": "audit-rollout-1", "rubrics": "audit-after-rubrics-1", "judge": "audit-after-judge-1"}


def _stage(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dynamicrubric.cli", "stage", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def task_runs(tiny_run):
    """For each rerunnable stage, its MLflow run in the last round (checkpoints there, not base models)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tiny_run["tracking_uri"])
    experiment = client.get_experiment_by_name(tiny_run["cfg"].pipeline.experiment).experiment_id
    last = str(tiny_run["cfg"].pipeline.rounds)
    runs = client.search_runs([experiment], f"tags.`{tracking.ROUND_TAG}` = '{last}'", max_results=5000)
    chosen = {}
    for stage in RERUN_STAGES:
        name = TASKS[stage]
        matches = [r for r in runs if r.data.tags.get(tracking.STAGE_TAG) == name]
        assert len(matches) == 1, f"no single {name} run in round {last}"
        chosen[stage] = client.get_run(matches[0].info.run_id)
    return chosen


def _output_uri(run) -> str:
    for d in run.inputs.dataset_inputs:
        tags = {t.key: t.value for t in d.tags}
        if tags.get("mlflow.data.context") == "output":
            return tags["uri"]
    raise AssertionError(f"run {run.info.run_id} logged no output")


@pytest.mark.parametrize("stage", RERUN_STAGES)
def test_from_run_is_byte_identical(tiny_run, task_runs, stage, tmp_path):
    run = task_runs[stage]
    out = tmp_path / f"{stage}.parquet"
    proc = _stage(
        stage,
        "--from-run",
        run.info.run_id,
        "--out",
        str(out),
        "--tracking-uri",
        tiny_run["tracking_uri"],
        cwd=tmp_path,  # another working directory: nothing may depend on the pipeline's
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes() == Path(_output_uri(run)).read_bytes()


def test_from_task_names_a_task_of_the_pipeline_run(tiny_run, task_runs, tmp_path, monkeypatch):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tiny_run["tracking_uri"])
    experiment = client.get_experiment_by_name(tiny_run["cfg"].pipeline.experiment).experiment_id
    (parent,) = client.search_runs([experiment], f"tags.`{tracking.STAGE_TAG}` = 'pipeline'")
    out = tmp_path / "judge.parquet"
    task = f"{tiny_run['cfg'].pipeline.rounds}/{TASKS['judge']}"
    # no --tracking-uri: the default sqlite:///mlflow.db of the directory the run was started in
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    proc = _stage(
        "judge",
        "--from-run",
        parent.info.run_id,
        "--from-task",
        task,
        "--out",
        str(out),
        cwd=tiny_run["workdir"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes() == Path(_output_uri(task_runs["judge"])).read_bytes()


def test_from_run_refuses_options_it_takes_from_the_run(tiny_run, task_runs, tmp_path):
    proc = _stage(
        "judge",
        "--from-run",
        task_runs["judge"].info.run_id,
        "--preset",
        "tiny",
        "--out",
        str(tmp_path / "j"),
        "--tracking-uri",
        tiny_run["tracking_uri"],
        cwd=tmp_path,
    )
    assert proc.returncode != 0 and "--preset" in proc.stderr and "from the run" in proc.stderr
    proc = _stage(
        "judge",
        "--from-run",
        "0" * 32,
        "--out",
        str(tmp_path / "j"),
        "--tracking-uri",
        tiny_run["tracking_uri"],
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "no such MLflow run" in proc.stderr


def test_a_relative_model_path_writes_the_same_bytes(tmp_path, monkeypatch):
    cfg = load_config(None, preset="tiny")
    model = prepare_model("tiny-random")
    prompts = tmp_path / "prompts.parquet"
    from dynamicrubric import tasks

    write_artifact(str(prompts), "prompts", tasks.configured_prompts(cfg.data, "train"))
    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(model, tmp_path)
    run_rollout(str(prompts), str(tmp_path / "a"), cfg, policy=str(model), seed=1)
    run_rollout(str(prompts), str(tmp_path / "b"), cfg, policy=relative, seed=1)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def test_a_task_on_an_s3_root_logs_s3_uris_and_reruns_from_them(s3_env, tmp_path):
    """A cluster run's task reads and writes s3:// artifacts (its pod sees them as /s3/... paths):
    its MLflow lineage records the s3:// URIs, and `--from-run` reruns it from them, byte for byte."""
    import mlflow

    from dynamicrubric import steps, store, tasks

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, preset="tiny", overrides={"pipeline": {"mlflow_tracking_uri": tracking_uri}})
    root = f"s3://{s3_env}/runs/r1"
    prompts, rollouts = f"{root}/prepare-data/train_prompts", f"{root}/rollout-1/rollouts"
    write_artifact(prompts, "prompts", tasks.configured_prompts(cfg.data, "train"))
    steps.start_tracking(cfg.to_yaml(), "s3-run")
    steps.rollout(cfg.to_yaml(), "s3-run", 1, "audit", prompts, rollouts, "tiny-random", 1, 2, 7)

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(cfg.pipeline.experiment).experiment_id
    (run,) = client.search_runs([experiment], f"tags.`{tracking.STAGE_TAG}` = 'audit-rollout-1'")
    run = client.get_run(run.info.run_id)
    inputs = {u for uris in inputs_by_kind(run).values() for u in uris}
    assert inputs == {prompts} and _output_uri(run) == rollouts  # s3:// URIs, not pod paths

    out = f"s3://{s3_env}/rerun/rollouts"
    proc = _stage("rollout", "--from-run", run.info.run_id, "--out", out, "--tracking-uri", tracking_uri,
                  cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert store.read_bytes(out) == store.read_bytes(rollouts)
