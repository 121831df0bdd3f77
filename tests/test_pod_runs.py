"""Whole runs whose tasks see only what their pods would (tests/pod_launcher.py): artifacts delivered and
uploaded as KFP's launcher does, through a real SeaweedFS, each task in its own filesystem under its
stage's memory limit, MLflow reached over HTTP as a cluster's tasks reach it."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

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
    """The pods' /s3 mount point (KFP's images have one): made here if missing, removed after. It is the
    machine's one folder, so one test at a time has it: a lock across pytest-xdist's workers (CI saw one
    test's teardown find it not empty while another worker's pods ran)."""
    import fcntl

    with open("/tmp/dynrubric-s3-mount.lock", "w") as lock:  # beside /s3: one per machine
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
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


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_trainer_on_two_nodes_hands_its_model_to_evaluate_as_pods(
    tmp_path, tmp_path_factory, s3_env, seaweed, s3_mount, monkeypatch
):
    """One round of the tiny preset with every task a pod and train-policy at `num_nodes: 2`: its task
    submits a TrainJob to the Kubernetes stand-in, whose two nodes train together (gloo over loopback),
    and publishes their export to its output's URI itself, versioned, by server-side copies; evaluate
    then loads P_1 from the launcher's mirror of that folder in its pod."""
    import yaml
    from k8s_standin import KubernetesStandIn

    from dynamicrubric.infra.config import S3_ENV

    # The nodes get the store's credentials from the secret only, and see no folder of the test's but
    # their own (k8s_standin's mount namespace where the machine allows).
    base_env = {k: v for k, v in os.environ.items() if k not in S3_ENV and not k.startswith(("KUBE", "PET_"))}
    cluster = KubernetesStandIn(tmp_path / "nodes", {"dynamicrubric-s3": seaweed.env()}, base_env,
                                hide=tmp_path_factory.getbasetemp()).start()  # fmt: skip
    # The task reaches the API with a kubeconfig mounted into its pod, as a service account's token is.
    kubeconfig = cluster.kubeconfig(tmp_path / "kubeconfig", "team-a")
    monkeypatch.setenv("KUBECONFIG", "/tmp/kube/config")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # A relative root, as the default `./runs`: the config the nodes read names no path of this machine.
    monkeypatch.chdir(tmp_path)
    pipeline = {
        "pipeline_root": "runs",
        "rounds": 1,
        "shards": 1,
        "mlflow_tracking_uri": "",
        "caching": False,
        "s3_secret": "dynamicrubric-s3",
        "resources": {"train_policy": {"cpu": "2", "memory": "3Gi"}},  # each node's
    }
    # One step a trainer, one evaluate variant, no benchmark: every artifact still crosses the pods.
    lighter = {
        "train_evaluator": {"max_steps": 1},
        "train_policy": {"max_steps": 1, "num_nodes": 2, "world_size": 2, "per_device_train_batch_size": 2},
        "evaluate": {"variants": ["dynamic"], "benchmarks": []},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"preset": "tiny", "pipeline": pipeline, **lighter}))
    cfg = load_config(tmp_path / "config.yaml")
    launchers: list[PodLauncher] = []

    def pods(preload: bool = True) -> PodLauncher:
        launchers.append(PodLauncher(tmp_path / "runs", s3_env, tmp_path / "pods", stage_memory(cfg),
                                     stage_cache(cfg), preload, mounted={"/tmp/kube/config": kubeconfig}))  # fmt: skip
        return launchers[-1]

    (tmp_path / "pods").mkdir()
    monkeypatch.setattr(task_monitor, "TaskStarter", pods)
    try:
        launch.run_local(cfg)
    finally:
        cluster.stop()
    assert cluster.unhandled == []

    ran = {task["stage"]: task for launcher in launchers for task in launcher.ran}
    assert not any(t.get("oom_killed") or t.get("evicted") for t in ran.values()), ran
    trainer, evaluate = ran["train_policy"], ran["evaluate"]
    assert trainer["component"] == "train_policy_on_nodes"  # the TrainJob variant's task
    (created,) = cluster.created
    assert created["spec"]["trainer"]["numNodes"] == 2
    (job,) = cluster.jobs.values()
    assert [n.phase for n in job.nodes] == ["Succeeded", "Succeeded"]
    assert job.conditions[-1]["type"] == "Complete"
    # The export went to the output's URI from the task itself (its pod path stayed empty), versioned.
    (export,) = [uri for uri in trainer.get("not_uploaded", []) if uri.endswith("/policy")]
    assert store.read_manifest(export)["layout"] == "versioned"
    # Evaluate got it as the launcher mirrors it: the marker and the version, and loaded it from there.
    mirror = Path(evaluate["pod"], "s3", export.removeprefix("s3://"))
    assert sorted(os.listdir(mirror)) == [store.COMPLETE_MARKER, store.VERSIONS_DIR]
    assert list(mirror.parent.glob(f".{mirror.name}.v-*"))  # the version it read, pinned flat beside it
