"""Whole runs whose tasks see only what their pods would (tests/pod_launcher.py): artifacts delivered and
uploaded as KFP's launcher does, through a real SeaweedFS, each task in its own filesystem under its
stage's memory limit, MLflow reached over HTTP as a cluster's tasks reach it."""

from __future__ import annotations

import io
import json
import os

import pytest
from pod_components import folder_pipeline
from pod_launcher import S3_MOUNT, PodLauncher, pod_isolation_problem, stage_cache, stage_memory

from dynamicrubric import store
from dynamicrubric.infra import tracking
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.localrun import launch, task_monitor

pytestmark = pytest.mark.skipif(pod_isolation_problem() is not None, reason=str(pod_isolation_problem()))


@pytest.fixture
def s3_mount():
    """The pods' /s3 mount point (KFP's images have one): made here if missing, removed after."""
    made = not S3_MOUNT.exists()
    S3_MOUNT.mkdir(exist_ok=True)
    yield
    if made:
        S3_MOUNT.rmdir()


def _run_as_pods(
    tmp_path, bucket: str, hog_mib: int = 0, limit_mib: int = 512, cache_mib: int = 0
) -> tuple[dict | None, PodLauncher]:
    from kfp import local

    root, pods = tmp_path / "root", tmp_path / "pods"
    pods.mkdir(exist_ok=True)
    monitor = task_monitor.TaskMonitor(out=io.StringIO(), err=io.StringIO())
    launcher = PodLauncher(root, bucket, pods, lambda stage: limit_mib << 20, lambda stage: 64 << 20)
    monitor.starter = launcher
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=False)
    host = [str(root), str(pods), str(tmp_path), os.environ["DYNRUBRIC_CACHE"]]
    try:
        with monitor.installed():
            task = folder_pipeline(host_paths=host, hog_mib=hog_mib, cache_mib=cache_mib)
    finally:
        monitor.starter.stop()
    output = task.output if not any(t.get("status") == "failed" for t in monitor.tasks) else None
    return (json.loads(output) if output else None), launcher


def test_a_pod_sees_its_inputs_through_the_store_and_nothing_of_the_machine(tmp_path, s3_env, s3_mount):
    """The reader gets the writer's folder by an s3:// URI at /s3/..., as KFP's launcher delivers it
    (uploaded flat, key by key), and sees none of the paths the machine that runs the test has."""
    seen, launcher = _run_as_pods(tmp_path, s3_env, cache_mib=8)
    assert seen is not None, launcher.ran
    assert seen["uri"].startswith(f"s3://{s3_env}/") and seen["path"] == "/s3/" + seen["uri"][5:]
    assert seen["b"] == "b" and seen["seen"] == []
    key = seen["uri"].removeprefix(f"s3://{s3_env}/")
    listed = store.list_files(f"s3://{s3_env}/{key}")
    assert sorted(listed) == ["a.txt", "sub/b.txt"]
    assert [t["stage"] for t in launcher.ran] == ["write_folder", "read_folder"]
    assert 8 << 20 <= launcher.ran[-1]["cache_peak"] < 64 << 20  # its cache is the volume, and is counted


def test_a_pod_over_its_memory_limit_is_killed(tmp_path, s3_env, s3_mount):
    """A task that allocates more than its stage's memory limit is killed as a pod is OOM-killed."""
    seen, launcher = _run_as_pods(tmp_path, s3_env, hog_mib=400, limit_mib=200)
    assert seen is None
    reader = launcher.ran[-1]
    assert reader["stage"] == "read_folder" and reader["oom_killed"], launcher.ran


def test_a_pod_that_fills_its_model_cache_past_its_size_limit_is_evicted(tmp_path, s3_env, s3_mount):
    """A task that writes more into its model-cache volume than the volume's sizeLimit is evicted."""
    seen, launcher = _run_as_pods(tmp_path, s3_env, cache_mib=100)
    assert seen is None
    reader = launcher.ran[-1]
    assert reader["stage"] == "read_folder" and "over its sizeLimit" in reader["evicted"], launcher.ran


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_chained_tiny_run_as_pods(tmp_path, s3_env, mlflow_server, s3_mount, monkeypatch):
    """The tiny preset's 2 rounds as a chain of two 1-round runs with every task a pod: round 2's run
    starts from round 1's policy and generator by the s3:// URIs MLflow recorded for them, which are
    folders KFP's launcher uploaded flat from the pods of round 1."""
    import yaml

    config = tmp_path / "config.yaml"
    pipeline = {
        "pipeline_root": str(tmp_path / "runs"),
        "rounds_per_run": 1,
        "mlflow_tracking_uri": mlflow_server.url,
        "caching": False,
    }
    # one training step a trainer and one evaluate variant: every artifact still crosses the pods (CI minutes)
    lighter = {
        "train_evaluator": {"max_steps": 1},
        "train_policy": {"max_steps": 1},
        "evaluate": {"variants": ["dynamic"]},
    }
    config.write_text(yaml.safe_dump({"preset": "tiny", "pipeline": pipeline, **lighter}))
    cfg = load_config(config)
    launchers: list[PodLauncher] = []

    def pods(preload: bool = True) -> PodLauncher:
        launchers.append(
            PodLauncher(
                tmp_path / "runs", s3_env, tmp_path / "pods", stage_memory(cfg), stage_cache(cfg), preload
            )
        )
        return launchers[-1]

    (tmp_path / "pods").mkdir()
    monkeypatch.setattr(task_monitor, "TaskStarter", pods)
    result = launch.run_local(cfg)

    ran = [task for launcher in launchers for task in launcher.ran]
    assert {t["stage"] for t in ran} >= {"rollout", "rubrics", "judge", "train_evaluator", "train_policy"}
    assert not any(t.get("oom_killed") or t.get("evicted") for t in ran), ran
    # The trainers' scratch (their local trainer checkpoints) lies in the model-cache volume.
    assert all(t["cache_peak"] > 0 for t in ran if t["stage"].startswith("train_")), ran
    # Round 2's run started from round 1's checkpoints, as the object store holds them.
    for role in ("policy", "generator"):
        uri = tracking.find_model_uri(cfg, result.run_name, f"{role}-round-1")
        assert uri.startswith(f"s3://{s3_env}/"), uri
    final = tracking.find_model_uri(cfg, result.run_name, "policy-round-2")
    assert final.startswith(f"s3://{s3_env}/"), final
