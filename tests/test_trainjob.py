"""A two-node training stage as a Kubeflow Trainer TrainJob, built with the SDK's own models and checked
field by field (no Kubernetes API server here: the object is what would be submitted)."""

from __future__ import annotations

import shlex
import subprocess

import pytest
from kubeflow_trainer_api import models as k8s

from dynamicrubric.config import S3_ENV, load_config
from dynamicrubric.training import launcher
from dynamicrubric.training.data import TrainingJob
from dynamicrubric.training.trainjob import API_VERSION, TORCH_RUNTIME, node_command, train_job

TWO_NODES = {"train_policy": {"num_nodes": 2}, "pipeline": {"s3_secret": "dynamicrubric-s3"}}


def _job() -> TrainingJob:
    return TrainingJob("train-policy", "s3://runs/r1/policy", "s3://runs/r1/policy-steps", round_idx=1,
                       policy="s3://runs/r0/policy", prompts_uri="s3://runs/r0/prompts.parquet")  # fmt: skip


def test_a_two_node_stage_renders_as_a_trainjob_field_by_field():
    cfg = load_config(preset="paper", overrides=TWO_NODES)
    built = train_job(cfg, _job(), name="r1-train-policy", namespace="team-a",
                      config_uri="s3://runs/r1/config.yaml", job_uri="s3://runs/r1/train-policy.json")  # fmt: skip
    d = built.to_dict()
    assert (d["apiVersion"], d["kind"]) == (API_VERSION, "TrainJob")
    assert d["metadata"]["name"] == "r1-train-policy" and d["metadata"]["namespace"] == "team-a"
    spec = d["spec"]
    assert spec["runtimeRef"] == {"name": TORCH_RUNTIME}
    assert spec["activeDeadlineSeconds"] == cfg.pipeline.stage_resources("train_policy").timeout_s
    trainer = spec["trainer"]
    assert trainer["numNodes"] == 2 and trainer["image"] == cfg.pipeline.image
    per_node = {"nvidia.com/gpu": "3", "cpu": "64", "memory": "512Gi"}  # world_size 6 over 2 nodes
    assert trainer["resourcesPerNode"] == {"limits": per_node, "requests": per_node}
    assert [e["name"] for e in trainer["env"]] == list(S3_ENV)
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in trainer["env"]} == {"dynamicrubric-s3"}
    # what the SDK's models accept back is the same object: it validates against them
    assert k8s.TrainerV1alpha1TrainJob.from_dict(d).to_dict() == d


def test_every_node_launches_the_whole_world_size_from_the_runtime_rendezvous(tmp_path):
    cmd = node_command(6, 2, "s3://runs/r1/config.yaml", "s3://runs/r1/job.json")
    assert cmd[:2] == ["sh", "-c"]
    # The shell expands the runtime's variables and nothing else: run the line through `sh` with echo
    # in place of the interpreter, as a node would with PET_* set.
    env = {"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "trainjob-node-0-0.trainjob", "PET_MASTER_PORT": "29400"}
    line = cmd[2].replace(shlex.quote(launcher.sys.executable), "echo", 1)
    words = subprocess.run(
        ["sh", "-c", line], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    flag = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}
    assert flag["--num_processes"] == "6" and flag["--num_machines"] == "2"
    assert flag["--machine_rank"] == "1" and flag["--main_process_ip"] == env["PET_MASTER_ADDR"]
    assert flag["--main_process_port"] == "29400"
    assert flag["--config_file"] == str(launcher.accelerate_config(6, cuda=True))  # FSDP, on GPU nodes
    assert words[words.index("-m", words.index("--num_processes")) + 1] == "dynamicrubric.training.process"
    assert (flag["--config"], flag["--job"]) == ("s3://runs/r1/config.yaml", "s3://runs/r1/job.json")


def test_nodes_that_cannot_split_the_processes_evenly_are_refused():
    with pytest.raises(Exception, match="world_size 6 does not split evenly over num_nodes 4"):
        load_config(preset="paper", overrides={"train_policy": {"num_nodes": 4}})


def test_a_node_reads_its_config_and_job_from_the_store(s3_env, tmp_path):
    """A TrainJob's node has no file of the KFP task's: the process reads the config and the job from
    their s3:// URIs. The job's checkpoint is already complete (a retried node after the work was
    done), so the process only reads, recognises it and reports the recorded numbers."""
    import json
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
