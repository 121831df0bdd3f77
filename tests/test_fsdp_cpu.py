"""The GPU path's FSDP2 training, run on two gloo CPU processes.

The same `launch_command` / `accelerate launch` with the same `accelerate/fsdp.yaml` and the same GRPOTrainer
set-up as on GPU; the one difference is the test hook of training/fsdp_hook.py, which makes accelerate take
FSDP for CPU processes (it does so only for accelerators). A full finetune with a reference model (β > 0):
sharded training, a DCP trainer checkpoint, a kill and a resume from it, the final gather and export.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from test_train import _cfg, _prompts, kill_after_checkpoint

from dynamicrubric import store
from dynamicrubric.infra.artifacts import read_frame
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.training import launcher
from dynamicrubric.training.data import TrainingJob
from dynamicrubric.training.fsdp_hook import FSDP_TEST_ENV


def _shard_sums(model: torch.nn.Module, world: int) -> list[float]:
    """sum|w| of each rank's FSDP2 shards of `model`'s parameters (dim-0 chunks, as fully_shard cuts them)."""
    sums = [0.0] * world
    for p in model.parameters():
        for rank, chunk in enumerate(torch.chunk(p.detach(), world, dim=0)):
            sums[rank] += chunk.double().abs().sum().item()
    return sums


@pytest.mark.slow  # two 2-process launches: about a minute on 2 busy cores
def test_fsdp2_on_two_cpu_processes_trains_checkpoints_resumes_and_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv(FSDP_TEST_ENV, "1")
    cfg = _cfg(
        train_policy={
            "max_steps": 2,
            "save_steps": 1,
            "per_device_train_batch_size": 2,
            "world_size": 2,
            "beta": 0.01,  # a reference model (full finetune: no LoRA)
            "process_group_timeout_s": 1234,
        },
        judge={"variant": "pointwise"},  # soft scores: the groups are not tied, the step has a gradient
        aggregate={"soft": True},
    )
    assert cfg.train_policy.lora_rank == 0
    args_seen = launcher.launch_command(2, ["x"])
    assert str(launcher.accelerate_config(2, cuda=True)) in args_seen  # the GPU path's config file

    job = TrainingJob("train-policy", str(tmp_path / "policy"), str(tmp_path / "steps"),
                      metrics_uri=str(tmp_path / "metrics.parquet"), round_idx=1, policy="tiny-random",
                      generator="tiny-random", prompts_uri=_prompts(tmp_path, cfg))  # fmt: skip
    first = kill_after_checkpoint(cfg, job, step=1, world_size=2)

    # Its process group has the config's timeout on both ranks
    for rank in (0, 1):
        assert f"rank {rank}: process group timeout {timedelta(seconds=1234)}" in first, first[-3000:]
    # The reference is sharded (DDP would log the whole model's sum on each rank) and holds the starting
    # weights on every rank: each rank's shards sum as the starting model's chunks do (a rank left with
    # RAM-efficient loading's zeros logs 0).
    start = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random"))
    expected = _shard_sums(start, 2)
    logged = {int(r): float(v) for r, v in re.findall(r"rank (\d): reference model sum\|w\| (\S+)", first)}
    assert sorted(logged) == [0, 1], first[-3000:]
    for rank in (0, 1):
        assert logged[rank] == pytest.approx(expected[rank], rel=1e-9), (rank, logged, expected)
        # placed by FSDP, not by a transformers device map (on CUDA "auto" would spread it over every GPU)
        assert f"rank {rank}: reference model device map None" in first, first[-3000:]
        # sharded layer by layer as the policy is, plus TRL's root unit: its forward gathers one layer at a
        # time, not the whole model (TRL alone: 1 unit)
        units = start.config.num_hidden_layers + 1
        assert f"rank {rank}: reference model in {units} FSDP units" in first, first[-3000:]

    # The step-1 trainer checkpoint is FSDP's sharded state (DCP files of both ranks) in the store
    work = f"{job.out_uri}.work/checkpoint-00001"
    assert store.is_complete(work) and not store.is_complete(job.out_uri)
    files = [f.removeprefix(work + "/") for f in store.list_files(work)]
    distcp = [f for f in files if f.endswith(".distcp")]
    assert any("__0_" in f for f in distcp) and any("__1_" in f for f in distcp), files

    capfd.readouterr()
    launcher.launch(cfg, job)  # the retried task: resumes from the stored checkpoint, trains step 2
    err = capfd.readouterr().err
    assert f"resuming from {work}" in err
    for rank in (0, 1):
        assert f"rank {rank}: gathered the trained weights" in err, err[-3000:]
    metrics = read_frame(job.metrics_uri, "metrics")
    kl = metrics[metrics["name"] == "kl"].set_index("step")["value"]
    assert sorted(kl.index) == [1, 2]
    assert abs(kl[1]) < 1e-6, kl  # step 1: the policy is the starting model, as the reference is
    trained = AutoModelForCausalLM.from_pretrained(store.local_path(job.out_uri))
    changed = [n for n, p in trained.named_parameters() if not torch.equal(p, start.get_parameter(n))]
    assert changed, "the exported model equals the starting model"
