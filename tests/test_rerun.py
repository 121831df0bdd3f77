"""`dynrubric stage NAME --from-run` reruns a finished pipeline's task from what MLflow recorded (config,
seed, samples, model references, inputs) and writes the same bytes the pipeline wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynamicrubric.infra import tracking
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.infra.models import prepare_model
from dynamicrubric.scoring.rollout import run_rollout
from dynamicrubric.stages.declarations import STAGES
from dynamicrubric.stages.rerun import inputs_by_name

# Each stage's task in the last round (its models are checkpoints there, not base models; the shard
# offset of the signal audit's second shard matters), and prepare-data's in round 0.
TASKS = {
    "prepare_data": "prepare-data",
    "rollout": "audit-rollout-1",
    "candidates": "generator-candidates-1",
    "rubrics": "audit-after-rubrics-1",
    "judge": "audit-after-judge-1",
    "aggregate": "audit-after-aggregate",
    "train_evaluator": "train-evaluator",
    "train_policy": "train-policy",
    "evaluate": "evaluate",
}
RERUN_STAGES = tuple(TASKS)
STORE_MARKERS = ("_COMPLETE",)  # the store's completion marker holds a token new on every write


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
    """For each stage, its task's MLflow run (see TASKS)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tiny_run["tracking_uri"])
    experiment = client.get_experiment_by_name(tiny_run["cfg"].pipeline.experiment).experiment_id
    last = str(tiny_run["cfg"].pipeline.rounds)
    runs = client.search_runs([experiment], "", max_results=5000)
    chosen = {}
    for stage, name in TASKS.items():
        round_text = "0" if stage == "prepare_data" else last
        matches = [
            r
            for r in runs
            if r.data.tags.get(tracking.STAGE_TAG) == name
            and r.data.tags.get(tracking.ROUND_TAG) == round_text
        ]
        assert len(matches) == 1, f"no single {name} run in round {round_text}"
        chosen[stage] = client.get_run(matches[0].info.run_id)
    return chosen


def _output_uri(run, name: str | None = None) -> str:
    for d in run.inputs.dataset_inputs:
        tags = {t.key: t.value for t in d.tags}
        if tags.get("mlflow.data.context") == "output" and name in (None, tags.get(tracking.NAME_TAG)):
            return tags["uri"]
    raise AssertionError(f"run {run.info.run_id} logged no output {name or ''}")


def _pipeline_output(run, data) -> Path:
    """Where the pipeline's task wrote output `data`: a dataset output, or a folder (a param)."""
    uri = run.data.params[f"out_{data.name}"] if data.folder else _output_uri(run, data.name)
    return Path(uri.removeprefix("file://"))


def _files(root: Path) -> dict[str, Path]:
    if root.is_file():
        return {"": root}
    return {
        str(p.relative_to(root)): p
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in STORE_MARKERS and ".v-" not in str(p.relative_to(root))
    }


@pytest.mark.parametrize("stage", RERUN_STAGES)
def test_from_run_is_byte_identical(tiny_run, task_runs, stage, tmp_path):
    declared = STAGES[stage]
    run = task_runs[stage]
    outputs = {d.name: tmp_path / "rerun" / d.name for d in declared.outputs}
    flags = [arg for d in declared.outputs for arg in (declared.output_flag(d), str(outputs[d.name]))]
    proc = _stage(
        declared.command,
        "--from-run",
        run.info.run_id,
        *flags,
        "--tracking-uri",
        tiny_run["tracking_uri"],
        cwd=tmp_path,  # another working directory: nothing may depend on the pipeline's
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for d in declared.outputs:
        original, again = _files(_pipeline_output(run, d)), _files(outputs[d.name])
        assert sorted(again) == sorted(original), d.name
        for rel, path in original.items():
            # the trainers' metrics and checkpoint summary too: their time/* measurements go to MLflow
            assert again[rel].read_bytes() == path.read_bytes(), f"{d.name}/{rel}"


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
    assert out.read_bytes() == Path(_output_uri(task_runs["judge"], "judgments")).read_bytes()


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

    from dynamicrubric import store, tasks
    from dynamicrubric.stages.runner import run_stage, start_tracking

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, preset="tiny", overrides={"pipeline": {"mlflow_tracking_uri": tracking_uri}})
    root = f"s3://{s3_env}/runs/r1"
    prompts, rollouts = f"{root}/prepare-data/train_prompts", f"{root}/rollout-1/rollouts"
    write_artifact(prompts, "prompts", tasks.configured_prompts(cfg.data, "train"))
    start_tracking(cfg.to_yaml(), "s3-run")
    run_stage("rollout", cfg.to_yaml(), "s3-run", 1, label="audit", prompts=prompts, out_rollouts=rollouts,
              policy="tiny-random", shard=1, num_shards=2, seed=7)  # fmt: skip

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(cfg.pipeline.experiment).experiment_id
    (run,) = client.search_runs([experiment], f"tags.`{tracking.STAGE_TAG}` = 'audit-rollout-1'")
    run = client.get_run(run.info.run_id)
    inputs = {u for uris in inputs_by_name(run).values() for u in uris}
    assert inputs == {prompts} and _output_uri(run) == rollouts  # s3:// URIs, not pod paths

    out = f"s3://{s3_env}/rerun/rollouts"
    proc = _stage("rollout", "--from-run", run.info.run_id, "--out", out, "--tracking-uri", tracking_uri,
                  cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert store.read_bytes(out) == store.read_bytes(rollouts)


@pytest.mark.parametrize("stage", ["train_evaluator", "train_policy"])
def test_the_trainers_measurements_are_in_mlflow_not_in_their_artifacts(task_runs, stage):
    """Time is measured anew on every run, so it stays out of the trainers' metrics artifact (which a
    rerun writes again byte for byte) and goes to the stage's MLflow run, step by step."""
    run = task_runs[stage]
    metrics = read_frame(str(_pipeline_output(run, STAGES[stage].outputs[-1])), "metrics")
    assert STAGES[stage].outputs[-1].name == "metrics"
    assert not metrics["name"].str.startswith("time/").any()
    assert run.data.metrics["train_wall_s"] > 0
    timed = [k for k in run.data.metrics if k.endswith("/time/step_s")]
    assert len(timed) == 1
    assert run.data.metrics[timed[0]] > 0
