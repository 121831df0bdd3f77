"""MLflow lineage against a real `mlflow server` (PostgreSQL store, artifacts proxied to SeaweedFS).

The client side sets only MLFLOW_TRACKING_URI, as a pipeline pod on a cluster does; for the
artifact upload it holds no S3 credentials at all, so the bytes can only reach the bucket through
the server's artifact proxy. Everything is read back with MlflowClient (and boto3 for the bucket).
"""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest
from mlflow import MlflowClient
from mlflow_server import MLFLOW_BUCKET

from dynamicrubric import store
from dynamicrubric.infra import tracking, tracking_runs
from dynamicrubric.infra.artifacts import write_artifact
from dynamicrubric.infra.config_loading import load_config

PROMPTS = [
    {
        "prompt_id": f"p{i}",
        "task": "basic_arithmetic",
        "prompt": f"What is {i} + 1?",
        "reference": str(i + 1),
        "meta": None,
    }
    for i in range(3)
]


@pytest.fixture
def cfg(mlflow_server, monkeypatch):
    """A config in its own experiment; the tracking URI comes from the environment, as in a pod."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL", raising=False)
    return load_config(
        preset="tiny",
        overrides={"pipeline": {"experiment": f"lineage-{uuid.uuid4().hex[:8]}", "mlflow_tracking_uri": ""}},
    )


@pytest.fixture
def client(mlflow_server) -> MlflowClient:
    return MlflowClient(tracking_uri=mlflow_server.url)


@pytest.fixture
def no_s3_credentials(monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")  # nor a profile to fall back on
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    store.reset_client()
    yield
    store.reset_client()


def _children(client: MlflowClient, run_id: str) -> list:
    experiment = client.get_run(run_id).info.experiment_id
    return client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")


def test_run_tree_parent_rounds_and_stages(cfg, client):
    run_name = "tree-run"
    parent_id = tracking_runs.start_pipeline_run(cfg, run_name, rounds=2)
    assert tracking.tracking_uri(cfg).startswith("http://127.0.0.1:")

    parent = client.get_run(parent_id)
    assert client.get_experiment(parent.info.experiment_id).name == cfg.pipeline.experiment
    assert parent.data.tags[tracking.PIPELINE_TAG] == run_name
    assert parent.data.tags[tracking.STAGE_TAG] == "pipeline"
    assert parent.data.params["rollout.k"] == "4" and parent.data.params["models.policy"] == "tiny-random"
    assert [a.path for a in client.list_artifacts(parent_id)] == ["config.yaml"]
    assert tracking.find_pipeline_run(cfg, run_name) == parent_id

    # a round's run is made by its first task, started with it (MLflow cannot move a start later)
    assert _children(client, parent_id) == []
    with tracking_runs.stage_run(cfg, run_name, 2, "policy-rollout") as stage:
        stage.log_metrics({"reward_mean": 0.25, "responses": 12, "truncated": True})
    with tracking_runs.stage_run(cfg, run_name, 0, "prepare-data") as prep:
        pass
    rounds = {
        r.data.tags[tracking.ROUND_TAG]: r
        for r in _children(client, parent_id)
        if r.info.run_id != prep.run_id
    }
    assert sorted(rounds) == ["2"]
    assert rounds["2"].info.run_name == "round-2"
    assert rounds["2"].info.start_time == client.get_run(stage.run_id).info.start_time
    assert rounds["2"].info.end_time == client.get_run(stage.run_id).info.end_time

    rollout = client.get_run(stage.run_id)
    assert rollout.data.tags["mlflow.parentRunId"] == rounds["2"].info.run_id
    assert rollout.data.tags[tracking.STAGE_TAG] == "policy-rollout"
    assert rollout.data.metrics == {"reward_mean": 0.25, "responses": 12.0}  # booleans are not metrics
    assert client.get_run(prep.run_id).data.tags["mlflow.parentRunId"] == parent_id

    missing = pytest.raises(RuntimeError, match="no parent run for pipeline run 'never-started'")
    with missing, tracking_runs.stage_run(cfg, "never-started", 1, "rollout"):
        pass


def test_artifact_dataset_input_has_its_s3_source(cfg, client, s3_env):
    uri = f"s3://{s3_env}/runs/lineage/train_prompts.parquet"
    write_artifact(uri, "prompts", PROMPTS)
    tracking_runs.start_pipeline_run(cfg, "dataset-run", rounds=1)
    with tracking_runs.stage_run(cfg, "dataset-run", 1, "generator-rollout") as stage:
        stage.log_artifact_dataset(uri, "prompts", "input")

    (logged,) = client.get_run(stage.run_id).inputs.dataset_inputs
    assert logged.dataset.name == "prompts"
    assert json.loads(logged.dataset.source)["uri"] == uri
    # the URI is part of the identity: the same bytes at another URI are another dataset
    assert (
        logged.dataset.digest == hashlib.sha256(uri.encode() + b"\0" + store.read_bytes(uri)).hexdigest()[:16]
    )
    tags = {t.key: t.value for t in logged.tags}
    assert tags["mlflow.data.context"] == "input" and tags["kind"] == "prompts"
    assert json.loads(logged.dataset.profile)["num_rows"] == len(PROMPTS)


def test_checkpoint_is_a_logged_model_pointing_at_its_uri(cfg, client):
    ckpt = "s3://checkpoints/runs/model-run/round-1/policy"
    tracking_runs.start_pipeline_run(cfg, "model-run", rounds=1)
    with tracking_runs.stage_run(cfg, "model-run", 1, "train-policy") as stage:
        model_id = stage.log_model("model-run", "policy-r1", ckpt, {"round": 1, "base": "tiny-random"})
        assert stage.find_model("model-run", "policy-r1") == model_id
        assert stage.find_model("other-run", "policy-r1") is None
        stage.log_model_metrics(model_id, {"policy/accuracy": 0.75, "skipped": "not a number"})

    model = client.get_logged_model(model_id)
    assert model.name == "policy-r1" and model.source_run_id == stage.run_id
    assert model.tags["uri"] == ckpt and model.tags[tracking.PIPELINE_TAG] == "model-run"
    assert model.params == {"round": "1", "base": "tiny-random"}
    assert {(m.key, m.value) for m in model.metrics} == {("policy/accuracy", 0.75)}
    # ... and it is the training run's model output
    assert [m.model_id for m in client.get_run(stage.run_id).outputs.model_outputs] == [model_id]


def test_plots_go_through_the_artifact_proxy_into_the_bucket(
    cfg,
    client,
    mlflow_server,
    no_s3_credentials,
    tmp_path,
):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = tmp_path / "plots"
    plots.mkdir()
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([1, 2], [0.4, 0.6])
    fig.savefig(plots / "accuracy.png")
    plt.close(fig)
    png = (plots / "accuracy.png").read_bytes()
    assert png.startswith(b"\x89PNG")

    tracking_runs.start_pipeline_run(cfg, "plot-run", rounds=1)
    with tracking_runs.stage_run(cfg, "plot-run", 1, "evaluate") as stage:
        stage.log_dir(str(plots), "plots")

    run = client.get_run(stage.run_id)
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")  # proxied, not a direct s3:// URI
    assert [(a.path, a.file_size) for a in client.list_artifacts(stage.run_id, "plots")] == [
        ("plots/accuracy.png", len(png))
    ]
    # The object is in the server's bucket, under this run's id (read with the test's own credentials).
    s3 = mlflow_server.s3.client()
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=MLFLOW_BUCKET)["Contents"]]
    (key,) = [k for k in keys if stage.run_id in k and k.endswith("plots/accuracy.png")]
    assert s3.get_object(Bucket=MLFLOW_BUCKET, Key=key)["Body"].read() == png
