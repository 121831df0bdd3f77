"""Lineage in MLflow, walked from what kfp.local actually did in a finished tiny run.

For every task in the run's index (round, role, stage, shard, and the artifact URIs its executor input
named), the MLflow run of that task must list every artifact it read and wrote with that artifact's
own URI as source; checkpoints are the training runs' model outputs; and the index covers every file
kfp.local wrote. The walk uses whatever tasks the run has, not a fixed list of stages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamicrubric import tracking

BOOKKEEPING = {"executor_output.json", "task.log", "index.json"}


@pytest.fixture(scope="module")
def walked(tiny_run):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tiny_run["tracking_uri"])
    cfg = tiny_run["cfg"]
    experiment = client.get_experiment_by_name(cfg.pipeline.experiment).experiment_id
    runs = [
        client.get_run(r.info.run_id)
        for r in client.search_runs([experiment], max_results=5000)
        if r.data.tags.get(tracking.STAGE_TAG) not in (None, "pipeline")
    ]
    return client, runs


def _datasets(run, context: str) -> dict[str, str]:
    """uri tag -> source for the run's dataset inputs of one context (input | output)."""
    found = {}
    for d in run.inputs.dataset_inputs:
        tags = {t.key: t.value for t in d.tags}
        if tags.get("mlflow.data.context") == context:
            found[tags["uri"]] = json.loads(d.dataset.source)["uri"]
    return found


def _is_model(uri: str) -> bool:
    return (Path(uri) / "config.json").is_file()


def _run_of(task: dict, runs: list):
    """The MLflow run that logged this task's first output (datasets and checkpoints are per task)."""
    outputs = [u for uris in task["outputs"].values() for u in uris]
    for run in runs:
        wrote = set(_datasets(run, "output"))
        if any(str(Path(u).resolve()) in wrote for u in outputs if not _is_model(u) and Path(u).is_file()):
            return run
    return None


def test_every_task_logs_every_input_and_output(tiny_run, walked):
    client, runs = walked
    # stage-models (a plan of model references, no artifact locally) writes nothing; start-tracking only
    # the run's config, which every other task reads as its `config` input and the parent run logs
    assert {t["component"] for t in tiny_run["index"]["tasks"] if not t["outputs"]} <= {"stage_models"}
    (start,) = [t for t in tiny_run["index"]["tasks"] if t["component"] == "start_tracking"]
    (config,) = start["outputs"]["config"]
    (parent,) = client.search_runs(
        [runs[0].info.experiment_id], filter_string=f"tags.`{tracking.STAGE_TAG}` = 'pipeline'"
    )
    logged = Path(client.download_artifacts(parent.info.run_id, "config.yaml")).read_text()
    assert logged == Path(config).read_text()
    tasks = [t for t in tiny_run["index"]["tasks"] if t["outputs"] and t["component"] != "start_tracking"]
    seen_runs = set()
    for task in tasks:
        where = f"{task['stage']} round {task['round']} {task['role']} shard {task['shard']}"
        run = _run_of(task, runs)
        assert run is not None, f"{where}: no MLflow run logged its outputs"
        assert run.data.tags[tracking.ROUND_TAG] == str(task["round"]), where
        assert task["stage"] in run.data.tags[tracking.STAGE_TAG], where
        seen_runs.add(run.info.run_id)
        inputs, outputs = _datasets(run, "input"), _datasets(run, "output")
        # the source MLflow shows is the artifact itself (no dataset merged with another file's)
        assert all(uri == source for uri, source in {**inputs, **outputs}.items()), where
        params = set(run.data.params.values())
        for name, uris in task["inputs"].items():
            if name == "config":  # the run's config: the parent run's config.yaml (above)
                assert uris == [config], where
                continue
            for uri in uris:
                resolved = str(Path(uri).resolve())
                if _is_model(uri):  # a checkpoint read: the model reference the task logged
                    assert resolved in params, f"{where}: input model {name} {uri} not in params {params}"
                else:
                    assert resolved in inputs, f"{where}: input {name} {uri} not logged ({sorted(inputs)})"
        models = {
            client.get_logged_model(m.model_id).tags["uri"]: m.model_id for m in run.outputs.model_outputs
        }
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        for name, uris in task["outputs"].items():
            for uri in uris:
                resolved = str(Path(uri).resolve())
                if _is_model(uri):
                    assert resolved in models, f"{where}: checkpoint {name} is not a model output of its run"
                elif Path(uri).is_dir():  # plots: run artifacts; a trainer's per-step artifacts: their URI
                    assert "plots" in artifacts or resolved in params, f"{where}: {name} folder not logged"
                elif name == "summary":  # KFP's copy of the metrics for its UI: the run's metrics
                    summary = json.loads(Path(uri).read_text())
                    assert set(summary) <= set(run.data.metrics), f"{where}: summary metrics missing"
                else:
                    assert resolved in outputs, f"{where}: output {name} {uri} not logged ({sorted(outputs)})"
    assert len(seen_runs) == len(tasks), "two tasks were matched to one MLflow run"


def test_index_covers_every_file_kfp_wrote(tiny_run):
    folder = tiny_run["run_folder"]
    outputs = {
        Path(u).resolve() for t in tiny_run["index"]["tasks"] for uris in t["outputs"].values() for u in uris
    }
    # A local output folder a later task loaded also has the version it read pinned beside it
    # (`.<name>.v-<token>`, hard links of the same files: store.pinned_folder).
    versions = {o.parent / f".{o.name}.v-": o for o in outputs}
    for path in folder.rglob("*"):
        if path.is_file() and path.name not in BOOKKEEPING:
            assert any(
                path == o or o in path.parents or any(str(p).startswith(str(v)) for p in path.parents)
                for v, o in versions.items()
            ), f"{path} is in no task's outputs"
    for task in tiny_run["index"]["tasks"]:
        assert {"round", "role", "stage", "shard", "folder"} <= set(task)
        assert (folder / task["folder"] / "task.log").is_file(), task["folder"]


def test_each_checkpoint_carries_only_its_own_role_metrics(tiny_run, walked):
    client, runs = walked
    experiment = runs[0].info.experiment_id
    models = list(client.search_logged_models(experiment_ids=[experiment]))
    names = {m.name for m in models}
    rounds = tiny_run["cfg"].pipeline.rounds
    assert {f"{role}-round-{t}" for role in ("policy", "generator") for t in range(1, rounds + 1)} <= names
    for model in models:
        keys = {m.key for m in model.metrics or []}
        assert keys, f"{model.name} has no metrics"
        prefix = ("policy/",) if model.name.startswith("policy") else ("dynamic/", "static/")
        assert all(k.startswith(prefix) for k in keys), f"{model.name}: {sorted(keys)}"


def test_a_stage_runs_span_is_its_tasks_time(tiny_run, walked):
    """A stage run starts when its task's process starts, and `dynrubric run` moves its end to the
    process's exit, so the UI's duration is the task's time on its `done` line (issue 24: within 10%)."""
    _, runs = walked
    checked = 0
    for task in tiny_run["index"]["tasks"]:
        run = _run_of(task, runs)
        if run is None or task.get("seconds") is None:
            continue  # tasks with no MLflow run of their own (start-tracking, stage-models)
        duration = (run.info.end_time - run.info.start_time) / 1000
        where = f"{task['stage']} round {task['round']} shard {task['shard']}"
        # +0.1 s: the task's time is rounded to tenths; the process starts after the monitor's clock does
        assert 0.9 * task["seconds"] <= duration <= task["seconds"] + 0.1, (
            f"{where}: run {duration:.2f} s, task {task['seconds']} s"
        )
        checked += 1
    assert checked >= len(tiny_run["index"]["tasks"]) - 2


def test_a_killed_attempts_run_is_marked_failed(tmp_path, monkeypatch):
    """A task killed while it logged leaves its run RUNNING; the retried task's run marks it FAILED,
    so only the retry's run reads as the task's result."""
    from dynamicrubric.config import load_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        preset="tiny", overrides={"pipeline": {"mlflow_tracking_uri": f"sqlite:///{tmp_path}/m.db"}}
    )
    tracking.start_pipeline_run(cfg, "run-x", rounds=1)
    mlflow = tracking._mlflow(cfg)
    with pytest.raises(KeyboardInterrupt), tracking.stage_run(cfg, "run-x", 1, "judge-0"):
        raise KeyboardInterrupt  # stands in for the kill: mlflow ends the run on an exception...
    client = mlflow.MlflowClient()
    (killed,) = client.search_runs(
        [mlflow.get_experiment_by_name(cfg.pipeline.experiment).experiment_id],
        filter_string=f"tags.`{tracking.STAGE_TAG}` = 'judge-0'",
    )
    client.update_run(killed.info.run_id, status="RUNNING")  # ...which a SIGKILL never lets it do
    with tracking.stage_run(cfg, "run-x", 1, "judge-0") as retry:
        retry.log_metrics({"judgments": 1})
    assert client.get_run(killed.info.run_id).info.status == "FAILED"
    assert client.get_run(retry.run_id).info.status == "FINISHED"
    assert client.get_run(retry.run_id).info.start_time <= tracking.process_started() * 1000 + 1


@pytest.mark.parametrize(
    "seen, expected",
    [
        ("/s3/bucket/runs/x/rollouts", "s3://bucket/runs/x/rollouts"),
        ("/minio/bucket/k", "s3://bucket/k"),
        ("/gcs/bucket/k", "gs://bucket/k"),
        ("minio://bucket/k", "s3://bucket/k"),
        ("s3://bucket/k", "s3://bucket/k"),
    ],
)
def test_pod_paths_map_to_object_store_uris(seen, expected):
    assert tracking.artifact_uri(seen) == expected
    assert tracking.mlflow_source(seen) == expected


def test_local_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tracking.artifact_uri("a/b") == str(tmp_path / "a" / "b")
