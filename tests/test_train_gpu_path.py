"""Failures the GPU path had that the CPU tests did not show, each checked here without a GPU.

- one-GPU launches: no `--cpu` when CUDA is present, and a model left on the wrong device is refused;
- the final checkpoint is gathered on every rank (a collective under FSDP2), saved by rank 0;
- every process of a task resolving one s3:// model: one download, the others wait and reuse it;
- trainer checkpoints of a pod path's output go to its s3:// URI, so a retried pod resumes; a resume
  for another model or config, or past max_steps, is refused; one lost in the export (its checkpoint at
  max_steps) exports from that checkpoint when retried.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import _cfg, _prompts, _train_policy, kill_after_checkpoint

from dynamicrubric import store
from dynamicrubric.infra.artifacts import read_frame
from dynamicrubric.infra.models import cache_dir, resolve_model
from dynamicrubric.training import checkpoints, launcher, monitoring
from dynamicrubric.training.data import TrainingJob


def test_launch_command_has_cpu_only_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """launch_command is a pure function of what torch.cuda reports: in-process patch of is_available."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--cpu" in launcher.launch_command(1, ["train-policy"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    one_gpu = launcher.launch_command(1, ["train-policy"])
    assert "--cpu" not in one_gpu and "--multi_gpu" not in one_gpu and "--config_file" not in one_gpu
    several = launcher.launch_command(8, ["train-policy"])
    assert "--cpu" not in several and str(launcher.accelerate_config(8, cuda=True)) in several


def test_cpu_training_processes_return_their_large_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the trainers get a fixed mmap threshold (the default run's peak memory, see
    CPU_MMAP_THRESHOLD); a user's own setting and the config's thread count are kept; not on a GPU."""
    from dynamicrubric.infra.config_loading import load_config

    tcfg = load_config(preset="tiny").train_policy  # torch_threads: 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env = launcher.training_env(tcfg, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(4 << 20)}
    assert (
        launcher.training_env(tcfg, {"MALLOC_MMAP_THRESHOLD_": "65536"})["MALLOC_MMAP_THRESHOLD_"] == "65536"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "MALLOC_MMAP_THRESHOLD_" not in launcher.training_env(tcfg, {})


def test_a_model_on_the_wrong_device_is_refused() -> None:
    model = torch.nn.Linear(2, 2)
    monitoring.check_device("train-policy", model, torch.device("cpu"))  # where it is: accepted
    with pytest.raises(
        RuntimeError, match=r"^train-policy: the model's parameters are on cpu, not on cuda:0"
    ):
        monitoring.check_device("train-policy", model, torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="are on meta, not on cpu"):
        monitoring.check_device("train-policy", model.to("meta"), torch.device("cpu"))


# Each process imports everything, says it is ready, and resolves only once the test says go, so that
# both ask for the model at the same moment. Counting store.download_dir calls wraps the real function
# (the real download still runs): the count is what the store served, not a stand-in.
_RESOLVE_SCRIPT = """
import sys, time
from pathlib import Path
from dynamicrubric import store
from dynamicrubric.infra.models import resolve_model

real = store.download_dir
def counted(uri, local, **kwargs):
    print("download", uri, flush=True)
    return real(uri, local, **kwargs)
store.download_dir = counted
ready, go = Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.01)
print("folder", resolve_model(sys.argv[1]), flush=True)
"""


def test_processes_resolving_one_s3_model_download_it_once(s3_env: str, tmp_path: Path) -> None:
    uri = f"s3://{s3_env}/models/tiny"
    store.upload_dir(resolve_model("tiny-random"), uri)
    env = {**os.environ, "DYNRUBRIC_CACHE": str(tmp_path / "cache")}
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RESOLVE_SCRIPT, uri, str(tmp_path / f"ready-{i}"), str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a process did not start"
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    stdout = "".join(out for out, _ in outs)
    assert stdout.count("download ") == 1, stdout
    folders = {line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith("folder ")}
    assert len(folders) == 1
    (folder,) = folders
    assert (Path(folder) / store.COMPLETE_MARKER).is_file() and (Path(folder) / "config.json").is_file()
    assert sorted(p.name for p in Path(folder).parent.iterdir()) == [Path(folder).name]  # no temp folder left


def test_two_processes_gather_the_final_weights_on_every_rank(tmp_path: Path, capfd) -> None:
    """A 2-process gloo run with LoRA writes one merged checkpoint, and both ranks took part in the
    gather (DDP here; test_fsdp_cpu.py runs the same under FSDP2 with a full finetune)."""
    from transformers import AutoModelForCausalLM

    cfg = _cfg(
        train_policy={"per_device_train_batch_size": 2, "world_size": 2, "lora_rank": 4, "lora_alpha": 8},
        judge={"variant": "pointwise"},  # soft scores: groups are not tied, so the step has a gradient
        aggregate={"soft": True},
    )
    _train_policy(cfg, tmp_path)
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert f"rank {rank}: gathered the trained weights" in err, err[-3000:]
    assert store.is_complete(str(tmp_path / "policy"))
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert not any("lora" in name for name, _ in trained.named_parameters())
    start = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random"))
    changed = [n for n, p in trained.named_parameters() if not torch.equal(p, start.get_parameter(n))]
    assert changed, "the merged checkpoint equals the starting model: the LoRA update was lost"


def test_a_pod_paths_trainer_checkpoints_go_to_the_object_store() -> None:
    """On a cluster out_uri is the pod's mount /s3/b/k, which is uploaded only when the task succeeds:
    the resumable checkpoints must go to s3://b/k.work itself, with the scratch in the local cache."""
    assert checkpoints.work_prefix("/s3/bucket/runs/r1/policy") == "s3://bucket/runs/r1/policy.work"
    assert checkpoints.work_prefix("/minio/bucket/policy/") == "s3://bucket/policy.work"
    assert checkpoints.work_prefix("s3://bucket/policy") == "s3://bucket/policy.work"
    assert checkpoints.work_prefix("/tmp/run/policy") == "/tmp/run/policy.work"  # a local run keeps it beside
    scratch = checkpoints.scratch_folder("/s3/bucket/runs/r1/policy")
    assert scratch.is_relative_to(cache_dir() / "train-work")
    assert scratch == checkpoints.scratch_folder(
        "s3://bucket/runs/r1/policy"
    )  # the same store folder, one scratch


def test_a_resume_for_another_run_or_past_max_steps_is_refused(s3_env: str, tmp_path: Path) -> None:
    cfg = _cfg(train_policy={"max_steps": 4})
    work = f"s3://{s3_env}/policy.work"
    origin = checkpoints.checkpoint_origin("tiny-random", cfg.train_policy)
    folder = tmp_path / "checkpoint-00002"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    store.upload_dir(folder, f"{work}/checkpoint-00001")  # an older one records nothing: never looked at
    (folder / checkpoints.RESUME_INFO).write_text(json.dumps(origin))
    store.upload_dir(folder, f"{work}/checkpoint-00002")
    assert checkpoints.resume_point("train-policy", work, origin, 4) == f"{work}/checkpoint-00002"
    # raising max_steps continues the run: it is not part of the digest
    longer = _cfg(train_policy={"max_steps": 8}).train_policy
    assert checkpoints.checkpoint_origin("tiny-random", longer) == origin

    def refused(origin: dict, steps: int) -> str:
        with pytest.raises(ValueError) as e:
            checkpoints.resume_point("train-policy", work, origin, steps)
        assert "\n" not in str(e.value) and f"delete {work} to start over" in str(e.value)
        return str(e.value)

    # at max_steps: the task was lost in the export, which a retry runs from this checkpoint
    assert checkpoints.resume_point("train-policy", work, origin, 2) == f"{work}/checkpoint-00002"
    assert "at step 2 and the config asks for max_steps=1: it is trained past the config" in refused(
        origin, 1
    )
    other_model = checkpoints.checkpoint_origin(str(resolve_model("tiny-random")), cfg.train_policy)
    assert "was written for model 'tiny-random'" in refused(other_model, 4)
    other_config = _cfg(train_policy={"max_steps": 4, "learning_rate": 1e-4}).train_policy
    assert "with train config" in refused(checkpoints.checkpoint_origin("tiny-random", other_config), 4)
    (folder / checkpoints.RESUME_INFO).unlink()
    store.upload_dir(folder, f"{work}/checkpoint-00003")
    assert "does not record the model and config" in refused(origin, 4)


@pytest.mark.slow  # three launches: about 90 s on 2 busy cores
def test_a_killed_task_resumes_in_a_fresh_scratch_from_its_s3_work_prefix(
    s3_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    """Killed after its step-2 checkpoint reached SeaweedFS, the task reruns as a retried pod would:
    another node, an empty cache and scratch. It resumes from s3://…/policy.work and ends with the
    weights of an uninterrupted run."""
    # 8 prompts, 2 a step: 4 steps stay inside one pass over the pool (see test_train's sigkill test).
    cfg = _cfg(train_policy={"max_steps": 4, "save_steps": 2}, data={"num_prompts": 8})
    (tmp_path / "whole").mkdir()
    _train_policy(cfg, tmp_path / "whole")

    out_uri = f"s3://{s3_env}/run/policy"
    folder = tmp_path / "killed"
    folder.mkdir()
    job = TrainingJob("train-policy", out_uri, str(folder / "steps"), round_idx=1, policy="tiny-random",
                      generator="tiny-random", prompts_uri=_prompts(folder, cfg))  # fmt: skip
    first_cache = tmp_path / "first-pod-cache"
    kill_after_checkpoint(cfg, job, step=2, env={"DYNRUBRIC_CACHE": str(first_cache)})
    assert store.is_complete(f"{out_uri}.work/checkpoint-00002")
    assert not store.is_complete(out_uri)
    shutil.rmtree(first_cache)  # the first pod's node-local scratch is gone with it

    monkeypatch.setenv("DYNRUBRIC_CACHE", str(tmp_path / "second-pod-cache"))
    capfd.readouterr()
    launcher.launch(cfg, job)
    # a rerun from step 0 would end with the same weights too: it must say it resumed from the store
    assert f"resuming from {out_uri}.work/checkpoint-00002" in capfd.readouterr().err
    for step in (3, 4):  # the resumed steps sampled exactly what the uninterrupted run did
        rel = Path("steps") / f"step-{step:05d}" / "rollouts.parquet"
        assert (tmp_path / "whole" / rel).read_bytes() == (folder / rel).read_bytes(), rel
    a = load_file(str(tmp_path / "whole" / "policy" / "model.safetensors"))
    b = load_file(str(store.download_dir(out_uri, tmp_path / "result") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not store.list_files(f"{out_uri}.work")  # trainer checkpoints cleaned up


@pytest.mark.slow  # two launches: about 80 s on 2 busy cores
def test_a_task_lost_in_the_export_exports_from_its_last_checkpoint_when_retried(
    tmp_path: Path, capfd
) -> None:
    """transformers saves a trainer checkpoint at max_steps; a pod lost after it, in the export, is retried:
    the retry resumes from it with no step left and exports exactly the weights trained there."""
    cfg = _cfg(train_policy={"max_steps": 1, "save_steps": 1})
    job = TrainingJob("train-policy", str(tmp_path / "policy"), str(tmp_path / "steps"),
                      metrics_uri=str(tmp_path / "metrics.parquet"), round_idx=1, policy="tiny-random",
                      generator="tiny-random", prompts_uri=_prompts(tmp_path, cfg))  # fmt: skip
    kill_after_checkpoint(cfg, job, step=1)  # lost with its checkpoint at max_steps stored, nothing exported
    stored = f"{job.out_uri}.work/checkpoint-00001"
    assert store.is_complete(stored) and not store.is_complete(job.out_uri)
    trained = load_file(str(store.download_dir(stored, tmp_path / "stored") / "model.safetensors"))
    capfd.readouterr()
    launcher.launch(cfg, job)
    assert f"resuming from {stored}" in capfd.readouterr().err
    exported = load_file(str(tmp_path / "policy" / "model.safetensors"))
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    steps = read_frame(job.metrics_uri, "metrics")["step"]
    assert sorted(set(steps)) == [1]  # the step trained before the loss, recorded once
    assert not store.list_files(f"{job.out_uri}.work")
