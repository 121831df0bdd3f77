"""Failures the GPU path had that the CPU tests did not show, each checked here without a GPU.

- one-GPU launches: no `--cpu` when CUDA is present, and a model left on the wrong device is refused;
- the final checkpoint is gathered on every rank (a collective under FSDP2), saved by rank 0;
- every process of a task resolving one s3:// model: one download, the others wait and reuse it;
- trainer checkpoints of a pod path's output go to its s3:// URI, so a retried pod resumes; a resume
  for another model or config, or with nothing left to train, is refused.
"""

from __future__ import annotations

import pytest
import torch

from dynamicrubric import train


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
