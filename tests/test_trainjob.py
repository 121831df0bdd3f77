"""A training stage on several nodes as a Kubeflow Trainer TrainJob (training/trainjob.py,
training/on_nodes.py).

The object is built with the SDK's own models and checked field by field. Submitting, following,
failing, cancelling and retrying run against tests/k8s_standin.py, a named stand-in of the Kubernetes
API and of Trainer's controller (no API server can run here): the `kubernetes` client talks to it over
HTTP with a kubeconfig, as a task does outside a pod, and it runs each node as a real process with the
torch runtime's PET_* variables, so two nodes train together (gloo over loopback) on SeaweedFS.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from k8s_standin import KubernetesStandIn
from kubeflow_trainer_api import models as k8s
from safetensors.torch import load_file
from test_train import _cfg

from dynamicrubric import store, tasks
from dynamicrubric.infra import tracking
from dynamicrubric.infra.artifacts import write_artifact
from dynamicrubric.infra.config import S3_ENV
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.infra.models import prepare_model
from dynamicrubric.infra.serving import free_port
from dynamicrubric.training import launcher
from dynamicrubric.training.checkpoints import STALL_ENV
from dynamicrubric.training.data import TrainingJob
from dynamicrubric.training.on_nodes import TrainJobFailed, train_on_nodes
from dynamicrubric.training.trainjob import API_VERSION, TORCH_RUNTIME, NodeFiles, train_job, trainjob_name

# Both of the paper's trainers on 2 nodes of 8 GPUs: each node trains on 6 (policy) or 7 (evaluator) and
# serves its own reward models on the rest (the policy's G and V, the evaluator's V).
TWO_NODES = {
    "train_policy": {"num_nodes": 2, "world_size": 12, "reward_gpus": 4, "prompts_per_step": 36},
    "train_evaluator": {"num_nodes": 2, "world_size": 14, "reward_gpus": 2, "prompts_per_step": 35},
    "pipeline": {"s3_secret": "dynamicrubric-s3"},
}


def _job() -> TrainingJob:
    return TrainingJob("train-policy", "s3://runs/r1/policy", "s3://runs/r1/policy-steps", round_idx=1,
                       policy="s3://runs/r0/policy", prompts_uri="s3://runs/r0/prompts.parquet")  # fmt: skip


def test_a_two_node_stage_renders_as_a_trainjob_field_by_field():
    scheduling = {"node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, "image_pull_secrets": ["regcred"],
                  "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule",
                                   "toleration_seconds": 60}]}  # fmt: skip
    cfg = load_config(
        preset="paper", overrides={**TWO_NODES, "pipeline": {**TWO_NODES["pipeline"], **scheduling}}
    )
    built = train_job(cfg, _job(), name="r1-train-policy", namespace="team-a", config_uri="s3://runs/r1/config.yaml",
                      job_uri="s3://runs/r1/job.json", result_uri="s3://runs/r1/result.json")  # fmt: skip
    d = built.to_dict()
    assert (d["apiVersion"], d["kind"]) == (API_VERSION, "TrainJob")
    assert d["metadata"]["name"] == "r1-train-policy" and d["metadata"]["namespace"] == "team-a"
    spec = d["spec"]
    assert spec["runtimeRef"] == {"name": TORCH_RUNTIME}
    assert spec["activeDeadlineSeconds"] == cfg.pipeline.stage_resources("train_policy").timeout_s
    trainer = spec["trainer"]
    assert trainer["numNodes"] == 2 and trainer["image"] == cfg.pipeline.image
    per_node = {"nvidia.com/gpu": "8", "cpu": "64", "memory": "512Gi"}  # (12 training + 4 reward) / 2 nodes
    # the scratch emptyDir's size as a request, so the scheduler places the node pod on a disk that holds it
    requests = {**per_node, "ephemeral-storage": cfg.pipeline.model_cache_size}
    assert trainer["resourcesPerNode"] == {"limits": per_node, "requests": requests}
    cache = [{"name": "DYNRUBRIC_CACHE", "value": "/model-cache/dynamicrubric"},
             {"name": "HF_HOME", "value": "/model-cache/huggingface"}]  # fmt: skip
    assert trainer["env"][:2] == cache and [e["name"] for e in trainer["env"][2:]] == list(S3_ENV)
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in trainer["env"][2:]} == {"dynamicrubric-s3"}
    # the node pods get what a GPU task of the pipeline gets, through the runtime's patch
    (patch,) = spec["runtimePatches"]
    assert patch["manager"] == "dynamicrubric.io/training"
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]
    assert node["name"] == "node" and pod["metadata"] == {
        # admitted to the store (networkpolicies.yaml); no Istio sidecar between the nodes' rendezvous
        "labels": {"dynamicrubric.io/s3-client": "true", "sidecar.istio.io/inject": "false"},
    }
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}
    ]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.pipeline.shm_size}},
        {"name": "model-cache", "emptyDir": {"sizeLimit": cfg.pipeline.model_cache_size}},
    ]
    assert pod["spec"]["containers"] == [{"name": "node", "volumeMounts": [
        {"name": "dshm", "mountPath": "/dev/shm"}, {"name": "model-cache", "mountPath": "/model-cache"}]}]  # fmt: skip
    assert trainer["command"] == [sys.executable, "-m", "dynamicrubric.training.node", "--config",
        "s3://runs/r1/config.yaml", "--job", "s3://runs/r1/job.json", "--result", "s3://runs/r1/result.json"]  # fmt: skip
    # what the SDK's models accept back is the same object: it validates against them
    assert k8s.TrainerV1alpha1TrainJob.from_dict(d).to_dict() == d


def test_the_network_settings_of_the_config_reach_every_node_pod():
    """pipeline.node_network: NCCL's variables on the node container, the RDMA device plugin's resource
    per node, a Multus network annotation and IPC_LOCK (RDMA registers memory), where Trainer lets a
    TrainJob set each: trainer.env, resourcesPerNode, the pod template patch's annotations and the node
    container patch's securityContext. Variables the TrainJob sets itself are refused."""
    network = {
        "env": {"NCCL_IB_HCA": "=mlx5_0,mlx5_1", "NCCL_SOCKET_IFNAME": "=eth0"},
        "annotations": {"k8s.v1.cni.cncf.io/networks": "ib-a,ib-b"},
        "resources": {"rdma/rdma_shared_device_a": "1"},
        "ipc_lock": True,
    }
    cfg = load_config(
        preset="paper",
        overrides={**TWO_NODES, "pipeline": {**TWO_NODES["pipeline"], "node_network": network}},
    )
    d = train_job(cfg, _job(), name="n", namespace="team-a", config_uri="s3://b/c", job_uri="s3://b/j",
                  result_uri="s3://b/r").to_dict()  # fmt: skip
    trainer = d["spec"]["trainer"]
    assert trainer["env"][-2:] == [{"name": "NCCL_IB_HCA", "value": "=mlx5_0,mlx5_1"},
                                   {"name": "NCCL_SOCKET_IFNAME", "value": "=eth0"}]  # fmt: skip
    for kind in ("limits", "requests"):
        assert trainer["resourcesPerNode"][kind]["rdma/rdma_shared_device_a"] == "1"
    (patch,) = d["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"k8s.v1.cni.cncf.io/networks": "ib-a,ib-b"}
    (container,) = pod["spec"]["containers"]
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert k8s.TrainerV1alpha1TrainJob.from_dict(d).to_dict() == d
    with pytest.raises(Exception, match="PET_NODE_RANK is set by the TrainJob itself"):
        load_config(preset="paper", overrides={"pipeline": {"node_network": {"env": {"PET_NODE_RANK": "1"}}}})


def test_the_compiled_two_node_package_submits_from_a_task_without_gpus(tmp_path):
    """In the compiled paper package the two training tasks request no GPU (they submit and follow);
    the other GPU tasks keep theirs. They take no checkpoint as an input artifact, which KFP's launcher
    would download into their pods: round 2's trainers get round 1's checkpoints by their URIs."""
    from kfp import compiler

    from dynamicrubric.pipelines.co_evolution import build_pipeline

    cfg = load_config(
        preset="paper", overrides={**TWO_NODES, "pipeline": {**TWO_NODES["pipeline"], "rounds": 2}}
    )
    package = tmp_path / "two-nodes.yaml"
    compiler.Compiler().compile(build_pipeline(cfg), str(package))
    spec = next(yaml.safe_load_all(package.read_text()))
    resources = {
        name: e["container"].get("resources", {}) for name, e in spec["deploymentSpec"]["executors"].items()
    }
    for stage in ("train-policy-on-nodes", "train-evaluator-on-nodes"):
        assert "accelerator" not in resources[f"exec-{stage}"], stage
        assert resources[f"exec-{stage}"]["cpuLimit"] == 1.0
        assert set(spec["components"][f"comp-{stage}"]["inputDefinitions"]["artifacts"]) <= {
            "config", "prompts", "candidate_sets", "anchors"}  # fmt: skip
    assert resources["exec-rollout"]["accelerator"]["resourceCount"] == "1"
    given = spec["root"]["dag"]["tasks"]["train-policy-on-nodes-2"]["inputs"]["parameters"]
    assert given["policy_ckpt_uri"] == {
        "taskOutputParameter": {"outputParameterKey": "policy_uri", "producerTask": "train-policy-on-nodes"}
    }
    assert given["generator_ckpt_uri"]["taskOutputParameter"]["outputParameterKey"] == "generator_uri"


def test_every_node_launches_the_whole_world_size_from_the_runtime_rendezvous():
    env = {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
    }
    words = launcher.launch_command(6, ["--config", "c.yaml"], launcher.Rendezvous.from_env(env))
    flag = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}
    assert flag["--num_processes"] == "6" and flag["--num_machines"] == "2"
    assert flag["--machine_rank"] == "1" and flag["--main_process_ip"] == "job-node-0-0.job"
    assert flag["--main_process_port"] == "29400"
    # TrainConfig.rendezvous_timeout_s's default
    assert flag["--rdzv_conf"] == "timeout=3600,join_timeout=3600"
    with pytest.raises(launcher.TrainingError, match="^PET_NODE_RANK, PET_MASTER_PORT not set: a node"):
        launcher.Rendezvous.from_env({"PET_NNODES": "2", "PET_MASTER_ADDR": "x"})


def test_a_node_waits_for_the_others_as_long_as_the_config_says(tmp_path):
    """The launch a node runs honours `rendezvous_timeout_s` (torch's static rendezvous would wait 600 s):
    rank 0's node alone, with 4 s, gives up after about 4 s with torch's own rendezvous timeout."""
    cfg = _cfg(train_policy={"world_size": 2, "num_nodes": 2, "rendezvous_timeout_s": 4})
    node = launcher.Rendezvous(2, 0, "127.0.0.1", free_port())
    cmd = launcher.launch_command(2, ["--config", "c.yaml"], node, cfg.train_policy.rendezvous_timeout_s)
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode != 0 and time.monotonic() - started < 120
    assert "DistStoreError: Timed out after" in proc.stderr, proc.stderr[-2000:]
    assert "waiting for clients. 1/2 clients joined" in proc.stderr


def test_the_nodes_get_the_store_s_uris_of_the_task_s_pod_paths_and_no_other_local_path(tmp_path):
    """A KFP task sees its inputs as /s3/b/k (/minio/b/k): the TrainJob's nodes, other pods, read them by
    their s3:// URIs. A local path no node can reach is refused before anything is submitted, naming
    the field."""
    cfg = _cfg(train_policy={"world_size": 2, "num_nodes": 2})
    job = TrainingJob("train-policy", "/s3/runs/r1/policy", "/s3/runs/r1/steps", "/s3/runs/r1/m.parquet",
                      policy="/minio/runs/r0/policy", generator="/s3/runs/r1/generator", verifier="Qwen/Qwen3-8B",
                      prompts_uri="/s3/runs/r0/prompts.parquet")  # fmt: skip
    files = NodeFiles.of(cfg, job)
    assert (files.job.policy, files.job.generator) == ("s3://runs/r0/policy", "s3://runs/r1/generator")
    assert files.job.verifier == "Qwen/Qwen3-8B" and files.job.prompts_uri == "s3://runs/r0/prompts.parquet"
    assert files.job.out_uri == "s3://runs/r1/policy.work/trainjob/out"
    local = tmp_path / "g1"
    local.mkdir()
    refused = {
        "job.generator": {"generator": str(local)},
        "job.prompts_uri": {"prompts_uri": str(tmp_path / "prompts.parquet")},
        "job.out_uri": {"out_uri": str(tmp_path / "policy")},
    }
    for field, change in refused.items():
        bad = dataclasses.replace(job, **change)
        with pytest.raises(launcher.TrainingError) as e:
            NodeFiles.of(cfg, bad)
        value = next(iter(change.values()))
        assert str(e.value) == (f"train-policy: {field} is {value!r}, a path the TrainJob's nodes cannot reach "
                                "(each is another pod, with its own filesystem): give it as an s3:// URI")  # fmt: skip
    evaluator = TrainingJob("train-evaluator", "s3://runs/r1/g", "s3://runs/r1/s", generator="tiny-random",
                            candidates=("/s3/runs/r1/c0", str(tmp_path / "c1")))  # fmt: skip
    with pytest.raises(launcher.TrainingError, match=r"^train-evaluator: job.candidates is '/"):
        NodeFiles.of(cfg, evaluator)
    # a model the node would take from the config (the job names none) is checked there
    from_config = _cfg(train_policy={"world_size": 2, "num_nodes": 2}, models={"verifier": str(local)})
    with pytest.raises(launcher.TrainingError, match=r"^train-policy: models.verifier is "):
        NodeFiles.of(from_config, dataclasses.replace(job, verifier=""))


def test_a_node_of_a_trainjob_with_another_node_count_refuses_to_start(tmp_path):
    """A rank that would train at another world size than configured is refused before anything loads."""
    cfg = _cfg(train_policy={"world_size": 2, "num_nodes": 2})
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    (tmp_path / "job.json").write_text(
        TrainingJob("train-policy", str(tmp_path / "p"), str(tmp_path / "s")).to_json()
    )
    env = {
        **os.environ,
        "PET_NNODES": "3",
        "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": "1",
    }
    args = [
        "--config",
        str(tmp_path / "config.yaml"),
        "--job",
        str(tmp_path / "job.json"),
        "--result",
        "r.json",
    ]
    proc = subprocess.run([sys.executable, "-m", "dynamicrubric.training.node", *args], env=env, capture_output=True,
                          text=True, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: train-policy: the TrainJob runs 3 node(s) (PET_NNODES) but num_nodes is 2 "
        "in the config; every rank must train at the world size it was configured for")  # fmt: skip


def test_nodes_that_cannot_split_the_processes_evenly_are_refused():
    with pytest.raises(Exception, match="world_size 6 does not split evenly over num_nodes 4"):
        load_config(preset="paper", overrides={"train_policy": {"num_nodes": 4}})


def test_a_node_reads_its_config_and_job_from_the_store(s3_env, tmp_path):
    """A TrainJob's node has no file of the KFP task's: the process reads the config and the job from
    their s3:// URIs. The job's checkpoint is already complete (a retried node after the work was
    done), so the process only reads, recognises it and reports the recorded numbers."""
    import os
    import sys

    from dynamicrubric import store
    from dynamicrubric.training.checkpoints import SUMMARY_FILE

    cfg = load_config(preset="tiny")
    root = f"s3://{s3_env}/r1"
    done = tmp_path / "policy"
    done.mkdir()
    (done / SUMMARY_FILE).write_text(json.dumps({"final": {"reward_mean": 0.5}, "metrics_rows": []}))
    store.upload_dir(done, f"{root}/policy")
    store.write_bytes(f"{root}/config.yaml", cfg.to_yaml().encode())
    job = TrainingJob("train-policy", f"{root}/policy", f"{root}/steps", policy="tiny-random")
    store.write_bytes(f"{root}/job.json", job.to_json().encode())
    result = tmp_path / "result.json"
    args = ["--config", f"{root}/config.yaml", "--job", f"{root}/job.json", "--result", str(result)]
    proc = subprocess.run([sys.executable, "-m", "dynamicrubric.training.process", *args], env=dict(os.environ),
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(result.read_text()) == {"reward_mean": 0.5, "timings": []}


# ---- against the Kubernetes stand-in: two CPU nodes train together

# 8 prompts, 2 a step, 2 steps; one process on each of 2 nodes (gloo), a trainer checkpoint every step.
NODES_TRAIN = {
    "world_size": 2,
    "num_nodes": 2,
    "max_steps": 2,
    "save_steps": 1,
    "per_device_train_batch_size": 2,
}


@pytest.fixture
def cluster(s3_env, seaweed, tmp_path, tmp_path_factory, monkeypatch):
    """The stand-in with the S3 secret, its kubeconfig as the task's, and a clean environment for the
    nodes (no S3 credentials of the test's own: they must come from the secret). The nodes see none of
    the test session's folders but their own pod's (a mount namespace where the machine allows it), and
    the task runs as in its pod: `TASK_POD / s3` stands for its /s3 mount (the KFP launcher's local
    paths of s3:// artifacts), where `_nodes_job` delivers its inputs."""
    base_env = {k: v for k, v in os.environ.items() if k not in S3_ENV and not k.startswith(("KUBE", "PET_"))}
    standin = KubernetesStandIn(tmp_path / "pods", {"dynamicrubric-s3": seaweed.env()}, base_env,
                                hide=tmp_path_factory.getbasetemp()).start()  # fmt: skip
    mounts = {f"{tmp_path / TASK_POD}/s3/": "s3://", **tracking.POD_PREFIXES}
    monkeypatch.setattr(tracking, "POD_PREFIXES", mounts)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(standin.kubeconfig(tmp_path / "kubeconfig", "team-a")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr("dynamicrubric.training.on_nodes.POLL_S", 0.5)
    yield standin
    standin.stop()
    assert standin.unhandled == []
    # no training process of a node outlives it (a stalled one would sleep on after the test)
    leftover = [p for p in Path("/proc").glob("[0-9]*/cmdline") if str(tmp_path / "pods") in _read(p)]
    assert leftover == [], leftover


def _read(path: Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# What a node of this test holds at most (about 1 GiB measured: the node, accelerate and one training
# process); the stand-in enforces it where the machine allows (k8s_standin.pod_limits_available).
NODE_MEMORY = "2Gi"


def _nodes_cfg(**pipeline):
    pipeline = {
        "s3_secret": "dynamicrubric-s3",
        "resources": {"train_policy": {"cpu": "2", "memory": NODE_MEMORY}},
        **pipeline,
    }
    return _cfg(train_policy=NODES_TRAIN, data={"num_prompts": 8}, pipeline=pipeline)


TASK_POD = "task-pod"  # the KFP task's pod folder, under the test's tmp_path (see `cluster`)


def _nodes_job(bucket: str, name: str, cfg) -> TrainingJob:
    """The job as the KFP task sees it in its pod: the prompts and G_t (in the store) delivered as local
    paths under its /s3 mount, as KFP's launcher delivers input artifacts (this copies them there)."""
    mount = Path(TASK_POD, "s3").resolve()
    prompts, generator = f"{bucket}/{name}/prompts.parquet", f"{bucket}/{name}/generator"
    write_artifact(f"s3://{prompts}", "prompts", tasks.configured_prompts(cfg.data, "train"))
    store.upload_dir(prepare_model("tiny-random"), f"s3://{generator}")
    (mount / prompts).parent.mkdir(parents=True, exist_ok=True)
    (mount / prompts).write_bytes(store.read_bytes(f"s3://{prompts}"))
    store.download_dir(f"s3://{generator}", mount / generator)
    root = f"s3://{bucket}/{name}"
    return TrainingJob("train-policy", f"{root}/policy", f"{root}/steps", f"{root}/metrics.parquet", round_idx=1,
                       policy="tiny-random", generator=str(mount / generator), prompts_uri=str(mount / prompts))  # fmt: skip


def test_a_service_account_that_may_not_create_trainjobs_fails_the_task_in_one_line(cluster, s3_env):
    """The API's refusal (RBAC: 403) named with what to check; nothing is left behind to delete."""
    cfg = _nodes_cfg()
    job = _nodes_job(s3_env, "denied", cfg)
    cluster.refuse[("POST", "trainjobs")] = 403
    with pytest.raises(TrainJobFailed) as denied:
        train_on_nodes(cfg, job)
    assert str(denied.value) == (
        f"TrainJob team-a/{trainjob_name(job)}: the Kubernetes API answered 403 Forbidden: the task's service "
        "account may not manage TrainJobs or read pods in this namespace (manifests/base/rbac.yaml)"
    )
    assert cluster.created == [] and cluster.deleted == []


def test_an_api_that_stops_answering_leaves_the_trainjob_for_the_retry(cluster, s3_env, monkeypatch):
    """Server errors while the task follows are waited out (API_PATIENCE_S); past that the task fails in
    one line and leaves its TrainJob training, for its retry to follow: deleting hours of training over
    a restarting API server would be the worse failure."""
    monkeypatch.setattr("dynamicrubric.training.on_nodes.API_PATIENCE_S", 2.0)
    cfg = _nodes_cfg()
    job = _nodes_job(s3_env, "unreachable", cfg)
    name = trainjob_name(job)
    cluster.node_env[STALL_ENV] = "1"
    cluster.refuse[("GET", "pods")] = 503
    with pytest.raises(TrainJobFailed) as lost:
        train_on_nodes(cfg, job)
    assert str(lost.value) == (
        f"TrainJob team-a/{name}: no status from the Kubernetes API for 2 s (503 Service Unavailable); it is left running for "
        "the task's retry to follow"
    )
    assert cluster.deleted == [] and cluster.job(name) is not None


# What the scheduler says of a node pod whose ephemeral-storage request (pipeline.model_cache_size) no
# node's disk holds (kube-scheduler's fit and preemption plugins, as `kubectl describe pod` shows it).
NO_DISK = ("0/4 nodes are available: 4 Insufficient ephemeral-storage. preemption: 0/4 nodes are available: "
           "4 No preemption victims found for incoming pod.")  # fmt: skip


def test_a_node_pod_that_cannot_be_scheduled_is_explained_once_and_fails_the_task_in_time(
    cluster, s3_env, capfd
):
    """Node pods the scheduler cannot place: the task prints its reason and message once (not at each
    poll), and after pipeline.schedule_timeout_s deletes the TrainJob and fails in one line that says
    why. The stage's own deadline (120 s) is what ends the wait without the schedule timeout."""
    cfg = _nodes_cfg(
        schedule_timeout_s=3,
        resources={"train_policy": {"cpu": "2", "memory": NODE_MEMORY, "timeout_s": 120}},
    )
    job = _nodes_job(s3_env, "unschedulable", cfg)
    name = trainjob_name(job)
    cluster.unschedulable = NO_DISK
    started = time.monotonic()
    with pytest.raises(TrainJobFailed) as failed:
        train_on_nodes(cfg, job)
    waited = time.monotonic() - started
    why = f"node-0, node-1 not scheduled: Unschedulable: {NO_DISK}"
    assert str(failed.value) == (f"TrainJob team-a/{name}: deleted, its node pods not all placed in 3 s "
                                 f"(pipeline.schedule_timeout_s): {why}")  # fmt: skip
    assert 3 < waited < 90, waited
    out = capfd.readouterr().out
    assert out.count(why) == 1 and f"TrainJob team-a/{name}: {why}\n" in out, out
    assert f"TrainJob team-a/{name}: node-0 Pending, node-1 Pending" in out
    assert cluster.deleted == [name] and cluster.job(name) is None and len(cluster.created) == 1


PROBE = """
import os, sys
print("task's file visible:", os.path.exists(os.environ["TASK_FILE"]), flush=True)
held = b"x" * (512 * 2**20)  # written, so every page is held
print("survived", flush=True)
"""


def test_a_stand_in_node_sees_only_its_pod_and_holds_only_its_memory(cluster, tmp_path):
    """The stand-in's nodes are as strict as pods: a path of the task's handed on the command line fails
    the node; where the machine allows, a file of the task's is not there for it, and a node that
    writes 512 MiB under a 256Mi limit is killed as an OOM-killed pod is."""
    from dynamicrubric.training.on_nodes import TrainJobs

    cfg = _cfg(train_policy={"world_size": 2, "num_nodes": 2},
               pipeline={"resources": {"train_policy": {"cpu": "1", "memory": "256Mi"}}})  # fmt: skip
    task_file = tmp_path / TASK_POD / "input.txt"
    task_file.parent.mkdir()
    task_file.write_text("the task's")
    jobs = TrainJobs.connect()

    def run(name: str, command: list[str]) -> str:
        body = train_job(cfg, _job(), name=name, namespace="team-a", config_uri="s3://b/c", job_uri="s3://b/j",
                         result_uri="s3://b/r").to_dict()  # fmt: skip
        body["spec"]["trainer"]["command"] = command
        jobs.create(body)
        for _ in range(600):
            job = cluster.job(name)
            if job.conditions:
                return job.conditions[-1]["message"]
            time.sleep(0.2)
        raise TimeoutError(name)

    # Both nodes run the command; whichever ends first ends the job (CI saw node 1 killed first).
    def failed_node(message: str, code: int) -> int:
        match = re.fullmatch(rf"node (\d) exited with code {code}", message)
        assert match, message
        return int(match.group(1))

    node = failed_node(run("handed", [sys.executable, "-c", "pass", str(task_file)]), 1)
    log = cluster.job("handed").nodes[node].log.read_text()
    assert f"stand-in: this pod has no {task_file} (a path of another pod's filesystem)" in log
    if not cluster.pod_limits:
        pytest.skip("no mount namespace or memory cgroup here (needs root and cgroup v1's memory controller)")
    cluster.node_env["TASK_FILE"] = str(task_file)
    node = failed_node(run("greedy", [sys.executable, "-c", PROBE]), -9)
    log = cluster.job("greedy").nodes[node].log.read_text()
    assert "task's file visible: False" in log and "survived" not in log
    assert {n.memory_limit for n in cluster.job("greedy").nodes} == {256 * 2**20}


# A node that stands in for training: rank 0 exports the policy it was handed, read from the store
# by its URI, as the trained model, and writes a step's file, the metrics and the result.
EXPORTING_NODE = """
import os, sys
from pathlib import Path
from dynamicrubric import store
from dynamicrubric.training.data import TrainingJob
job = TrainingJob.from_json(store.read_bytes(sys.argv[2]).decode())
assert store.is_complete(job.generator), job.generator
if os.environ["PET_NODE_RANK"] == "0":
    store.upload_dir(store.download_dir(job.policy, Path("export")), job.out_uri)
    store.write_bytes(store.join(job.steps_uri, "step-00001", "scores.parquet"), b"step 1")
    store.write_bytes(job.metrics_uri, b"metrics")
    store.write_bytes(sys.argv[3], b'{"loss": 0.5}')
"""
# The KFP task: train_on_nodes as the on-nodes component calls it, with the nodes above.
TASK = """
import json, sys
from pathlib import Path
from dynamicrubric.infra import tracking
from dynamicrubric.infra.config_loading import config_from_yaml
from dynamicrubric.training import on_nodes, trainjob
from dynamicrubric.training.data import TrainingJob
on_nodes.POLL_S = 0.2
tracking.POD_PREFIXES = json.loads(sys.argv[3])
trainjob.node_command = lambda *uris: [sys.executable, "-c", sys.argv[4], *uris]
cfg, job = config_from_yaml(Path(sys.argv[1]).read_text()), TrainingJob.from_json(Path(sys.argv[2]).read_text())
print("result", json.dumps(on_nodes.train_on_nodes(cfg, job)))
"""
PADDING = 12 << 20  # each input checkpoint's weights, beside tiny-random's own 5 MB


def test_the_task_runs_under_a_disk_limit_below_its_two_input_checkpoints(cluster, s3_env, seaweed, tmp_path):
    """The KFP task of a stage on several nodes holds next to nothing on its pod's disk: the policy and
    the generator reach the nodes as store URIs (the on-nodes component takes them so: KFP would
    download an input artifact into the pod), and the export reaches the task's output by server-side
    copies, never through the pod. Its pod's ephemeral-storage limit, held as the kubelet holds it
    (evicted once over), is below the two checkpoints' size, and below the export's."""
    from pod_limits import run_with_disk_limit

    cfg = _nodes_cfg()
    pod = (tmp_path / TASK_POD).resolve()
    mount, root = pod / "s3" / s3_env / "small-disk", f"s3://{s3_env}/small-disk"
    checkpoints = {}
    for role in ("policy", "generator"):
        folder = tmp_path / role
        shutil.copytree(prepare_model("tiny-random"), folder)
        (folder / "padding.bin").write_bytes(os.urandom(PADDING))
        checkpoints[role] = f"{root}/{role}-0"
        store.upload_dir(folder, checkpoints[role])
    sizes = [
        sum(e["size"] for e in store.read_manifest(uri)["files"].values()) for uri in checkpoints.values()
    ]
    limit = 16 << 20
    assert limit < min(sizes) and limit < sum(sizes) / 2
    # What the launcher delivers: the prompts (an input artifact) into the pod's /s3 mount; nothing else.
    mount.mkdir(parents=True)
    write_artifact(str(mount / "prompts.parquet"), "prompts", tasks.configured_prompts(cfg.data, "train"))
    job = TrainingJob("train-policy", str(mount / "policy"), str(mount / "steps"), str(mount / "metrics.parquet"),
                      round_idx=1, prompts_uri=str(mount / "prompts.parquet"), **checkpoints)  # fmt: skip
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    (tmp_path / "job.json").write_text(job.to_json())
    env = {
        **os.environ,
        "TMPDIR": str(pod / "tmp"),
        "DYNRUBRIC_CACHE": str(pod / "cache"),
        "HF_HOME": str(pod / "hf"),
    }
    (pod / "tmp").mkdir()
    args = [
        str(tmp_path / "config.yaml"),
        str(tmp_path / "job.json"),
        json.dumps(tracking.POD_PREFIXES),
        EXPORTING_NODE,
    ]
    proc, record = run_with_disk_limit([sys.executable, "-c", TASK, *args], pod, limit, timeout=300, env=env,
                                       cwd=pod, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    assert proc.returncode == 0 and "evicted" not in record, (record, proc.stdout[-3000:])
    assert 'result {"loss": 0.5}' in proc.stdout
    out = f"{root}/policy"  # the output artifact's URI: the task wrote it there, and left its pod path empty
    assert store.read_manifest(out)["files"] == store.read_manifest(checkpoints["policy"])["files"]
    assert not (mount / "policy").exists()
    assert (mount / "steps" / "step-00001" / "scores.parquet").read_bytes() == b"step 1"
    handed = TrainingJob.from_json(store.read_bytes(f"{out}.work/trainjob/job.json").decode())
    assert (handed.policy, handed.generator) == (checkpoints["policy"], checkpoints["generator"])
    assert record["disk_peak"] < limit
    client = seaweed.client()
    _no_export_copy_left(client, out)  # published: the nodes' export is gone
    # A retry, in a fresh pod (its pod paths empty): no second TrainJob, the outputs copied again, and an
    # upload a node left open under the TrainJob's prefix aborted.
    shutil.rmtree(mount / "steps")
    _open_upload(client, f"{out}.work/trainjob/out.work/checkpoint-00001/model.safetensors")
    assert train_on_nodes(cfg, job) == {"loss": 0.5} and len(cluster.created) == 1
    assert (mount / "steps" / "step-00001" / "scores.parquet").read_bytes() == b"step 1"
    assert store.read_manifest(out)["files"] == store.read_manifest(checkpoints["policy"])["files"]
    _no_export_copy_left(client, out)


def _weights(uri: str, local: Path) -> dict[str, torch.Tensor]:
    return load_file(str(store.download_dir(uri, local) / "model.safetensors"))


def _left_under(client, uri: str) -> tuple[list[str], list[str]]:
    """The keys, and the keys of unfinished multipart uploads, under a folder `uri` of the store."""
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    prefix = prefix.rstrip("/") + "/"
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [o["Key"].removeprefix(prefix) for page in pages for o in page.get("Contents", [])]
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return keys, [u["Key"].removeprefix(prefix) for u in uploads]


def _open_upload(client, uri: str) -> None:
    """A multipart upload begun at `uri` with one part stored and never completed, as a node killed
    mid-upload leaves it."""
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024)


def _no_export_copy_left(client, out_uri: str) -> None:
    """After a stage on nodes succeeds, its work prefix keeps only the small files a retry copies again:
    no second copy of the export (the nodes' `trainjob/out`), no trainer checkpoint, no open upload."""
    keys, uploads = _left_under(client, f"{out_uri}.work")
    assert keys and not [k for k in keys if k.startswith(("trainjob/out/", "trainjob/out.work/"))], keys
    assert uploads == []


@pytest.mark.slow  # three 2-node launches, each two processes on 2 cores: about 3 min
def test_two_nodes_train_a_failed_trainjob_fails_the_task_and_a_retry_resumes(
    cluster, s3_env, seaweed, tmp_path, capfd
):
    cfg = _nodes_cfg()

    # 1. An uninterrupted TrainJob: both nodes train, the task copies their outputs to its own.
    whole = _nodes_job(s3_env, "whole", cfg)
    final = train_on_nodes(cfg, whole)
    out = capfd.readouterr().out
    name = trainjob_name(whole)
    assert f"TrainJob team-a/{name}: submitted, 2 nodes x 1 GPUs, 2 training processes" in out
    assert f"TrainJob team-a/{name}: complete" in out
    assert "[node-0] node 0 of 2: rank 0 at 127.0.0.1:" in out and "[node-1] node 1 of 2" in out
    assert "loss" in final and {r["step"] for r in final["timings"]} == {1, 2}  # both steps trained
    assert store.is_complete(whole.out_uri) and store.exists(whole.metrics_uri)
    assert store.list_files(whole.steps_uri)  # every step's scoring artifacts, both ranks'
    (created,) = cluster.created
    assert created["spec"]["trainer"]["numNodes"] == 2 and cluster.authorizations == {"Bearer standin-token"}
    # the nodes were handed the store's URIs of the task's /s3 inputs, and ran under their pods' limits
    handed = TrainingJob.from_json(store.read_bytes(f"{whole.out_uri}.work/trainjob/job.json").decode())
    assert handed.prompts_uri == f"s3://{s3_env}/whole/prompts.parquet"
    assert handed.generator == f"s3://{s3_env}/whole/generator"
    if cluster.pod_limits:
        assert {n.memory_limit for n in cluster.job(name).nodes} == {2 * 2**30}
    client = seaweed.client()
    _no_export_copy_left(client, whole.out_uri)

    # 2. Node 1 lost after step 1's checkpoint: the TrainJob fails, so does the task, in one line.
    killed = _nodes_job(s3_env, "killed", cfg)
    name = trainjob_name(killed)
    cluster.node_env[STALL_ENV] = "1"

    def lose_node_1() -> None:
        for _ in range(600):
            if cluster.job(name):
                break
            time.sleep(0.5)
        cluster.wait_for_log(name, "stalled after step 1")
        cluster.kill_node(name, 1)

    threading.Thread(target=lose_node_1, daemon=True).start()
    with pytest.raises(TrainJobFailed) as failed:
        train_on_nodes(cfg, killed)
    assert str(failed.value) == (f"train-policy: TrainJob team-a/{name} failed: NodeFailed: node 1 exited with "
                                 "code -9")  # fmt: skip
    stored = f"{killed.out_uri}.work/trainjob/out.work"
    assert store.is_complete(f"{stored}/checkpoint-00001")  # rank 0's files, the marker after every node's
    assert store.is_complete(f"{stored}/nodes/node-1/checkpoint-00001")  # node 1's: its rank's RNG state
    part = store.read_manifest(f"{stored}/nodes/node-1/checkpoint-00001")["files"]
    assert set(part) == {"rng_state_1.pth"}, part  # what rank 0 cannot upload: it is on node 1's disk
    assert not store.is_complete(killed.out_uri)
    # ... and, as a node killed mid-upload leaves it, an unfinished multipart upload of its next save
    _open_upload(client, f"{stored}/checkpoint-00002/model.safetensors")
    assert _left_under(client, f"{killed.out_uri}.work")[1] == [
        "trainjob/out.work/checkpoint-00002/model.safetensors"
    ]

    # 3. The retried task: the failed TrainJob goes, a new one resumes from step 1's checkpoint in the store
    #    (the nodes are fresh scratch folders) and ends with the uninterrupted run's weights.
    cluster.node_env.clear()
    capfd.readouterr()
    train_on_nodes(cfg, killed)
    out = capfd.readouterr().out
    assert (
        cluster.deleted == [name] and f"TrainJob team-a/{name}: deleting the one a failed attempt left" in out
    )
    assert f"resuming from {killed.out_uri}.work/trainjob/out.work/checkpoint-00001" in out
    a, b = _weights(whole.out_uri, tmp_path / "a"), _weights(killed.out_uri, tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _no_export_copy_left(client, killed.out_uri)  # the killed attempt's upload aborted too


@pytest.mark.slow  # one 2-node launch, stopped after its first step
def test_a_killed_task_s_retry_follows_its_trainjob_and_a_cancelled_task_deletes_it(
    cluster, s3_env, tmp_path
):
    """A task killed outright (SIGKILL: an evicted or OOM-killed pod) leaves its TrainJob training; the
    retried task follows that TrainJob rather than start over. KFP cancels a task by stopping its pod
    (SIGTERM): the task deletes its TrainJob, whose nodes would otherwise hold their GPUs until its
    deadline."""
    cfg = _nodes_cfg()
    job = _nodes_job(s3_env, "cancelled", cfg)
    name = trainjob_name(job)
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    (tmp_path / "job.json").write_text(job.to_json())
    cluster.node_env[STALL_ENV] = "1"
    script = (
        "import sys; from pathlib import Path\n"
        "from dynamicrubric.infra.config_loading import config_from_yaml\n"
        "from dynamicrubric.training.data import TrainingJob\n"
        "from dynamicrubric.training import on_nodes\n"
        "on_nodes.POLL_S = 0.5\n"
        "import json; from dynamicrubric.infra import tracking; tracking.POD_PREFIXES = json.loads(sys.argv[3])\n"
        "on_nodes.train_on_nodes(config_from_yaml(Path(sys.argv[1]).read_text()), "
        "TrainingJob.from_json(Path(sys.argv[2]).read_text()))\n"
    )
    mounts = json.dumps(tracking.POD_PREFIXES)  # the task's pod mounts, as `cluster` set them here
    args = [sys.executable, "-c", script, str(tmp_path / "config.yaml"), str(tmp_path / "job.json"), mounts]

    def task() -> subprocess.Popen:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = task()
    try:
        for _ in range(600):
            if cluster.job(name):
                break
            time.sleep(0.5)
        cluster.wait_for_log(name, "stalled after step 1")
        first.kill()
        first.wait()
        nodes = cluster.job(name).nodes
        assert all(node.proc.poll() is None for node in nodes)  # nothing deleted it: it trains on

        retried = task()
        try:
            for line in retried.stdout:
                if "following it" in line:
                    break
            assert line.strip() == (f"TrainJob team-a/{name}: still running from an earlier attempt of this task; "
                                    "following it")  # fmt: skip
            retried.send_signal(signal.SIGTERM)
            output, _ = retried.communicate(timeout=120)
        finally:
            retried.kill()
    finally:
        first.kill()
    assert len(cluster.created) == 1  # followed, not submitted again
    assert retried.returncode != 0
    assert f"TrainJob team-a/{name}: deleted (the task was cancelled)" in output
    assert cluster.deleted == [name] and cluster.job(name) is None
    assert all(node.proc.poll() is not None for node in nodes)
