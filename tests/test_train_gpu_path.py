"""Failures the GPU path had that the CPU tests did not show, each checked here without a GPU.

- one-GPU launches: no `--cpu` when CUDA is present, and a model left on the wrong device is refused;
- the final checkpoint is gathered on every rank (a collective under FSDP2), saved by rank 0;
- every process of a task resolving one s3:// model: one download, the others wait and reuse it;
- trainer checkpoints of a pod path's output go to its s3:// URI, so a retried pod resumes; a resume
  for another model or config, or with nothing left to train, is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train import _cfg, _train_policy

from dynamicrubric import store, train
from dynamicrubric.models import resolve_model


def test_launch_command_has_cpu_only_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """launch_command is a pure function of what torch.cuda reports: in-process patch of is_available."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--cpu" in train.launch_command(1, ["train-policy"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    one_gpu = train.launch_command(1, ["train-policy"])
    assert "--cpu" not in one_gpu and "--multi_gpu" not in one_gpu and "--config_file" not in one_gpu
    several = train.launch_command(8, ["train-policy"])
    assert "--cpu" not in several and str(train.accelerate_config(8)) in several


def test_a_model_on_the_wrong_device_is_refused() -> None:
    model = torch.nn.Linear(2, 2)
    train.check_device("train-policy", model, torch.device("cpu"))  # where it is: accepted
    with pytest.raises(
        RuntimeError, match=r"^train-policy: the model's parameters are on cpu, not on cuda:0"
    ):
        train.check_device("train-policy", model, torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="are on meta, not on cpu"):
        train.check_device("train-policy", model.to("meta"), torch.device("cpu"))


# Each process imports everything, says it is ready, and resolves only once the test says go, so that
# both ask for the model at the same moment. Counting store.download_dir calls wraps the real function
# (the real download still runs): the count is what the store served, not a stand-in.
_RESOLVE_SCRIPT = """
import sys, time
from pathlib import Path
from dynamicrubric import store, train

real = store.download_dir
def counted(uri, local):
    print("download", uri, flush=True)
    return real(uri, local)
store.download_dir = counted
ready, go = Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.01)
print("folder", train.resolve_model_ref(sys.argv[1]), flush=True)
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
    gather. accelerate cannot run FSDP on CPU processes (its FSDP type is only set on accelerators), so
    this cannot show the FSDP2 hang itself; it shows every rank calls the gather, which under FSDP2 is
    the collective that rank 0 alone would wait on forever."""
    from transformers import AutoModelForCausalLM

    cfg = _cfg(
        train_policy={"micro_batch_size": 2, "world_size": 2, "lora_rank": 4, "lora_alpha": 8},
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
