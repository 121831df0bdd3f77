"""An FSDP2 trainer on two nodes, killed after a save and resumed on both, ends where an unbroken run does.

Two nodes are two `python -m dynamicrubric.training.node` processes, the command each node pod of a
TrainJob runs (training/trainjob.py), with the torch runtime's PET_* variables (rank 0 on loopback). Each
has a folder of its own for HOME, TMPDIR and the model cache, and so for the trainer's scratch folder
(checkpoints.scratch_folder): like two pods they share nothing but the store, a real SeaweedFS. Each node
starts its own `accelerate launch` of one gloo CPU process under FSDP2 (the test hook of
training/fsdp_hook.py), so torchrun gives the two ranks GROUP_RANK 0 and 1 and every save splits into
node parts as on a cluster: one process a node is the smallest launch in which a node can lack a file
another node wrote. The kill takes both nodes (a TrainJob whose node fails loses all its pods: JobSet's
failure policy), and the resume runs on two fresh folders (new pods), so each node holds only what it
fetched from the store. This runs the nodes directly, not through the k8s stand-in of
tests/test_trainjob.py, which tests submitting and following a TrainJob: this is about the trainer's
checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file
from test_train import _cfg, _prompts

from dynamicrubric import store
from dynamicrubric.infra.artifacts import read_frame
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.infra.serving import free_port
from dynamicrubric.training.checkpoints import STALL_ENV
from dynamicrubric.training.data import TrainingJob
from dynamicrubric.training.fsdp_hook import FSDP_TEST_ENV

STEPS = 3  # killed after step 1: the resumed run trains two steps from the stored optimizer and sampler


def _start_nodes(
    run: Path, files: dict[str, str], env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """The two nodes of one TrainJob attempt, each in a fresh pod folder `run/node-K`."""
    port = free_port()
    nodes = []
    for rank in (0, 1):
        pod = run / f"node-{rank}"
        for sub in ("home", "tmp", "cache"):
            (pod / sub).mkdir(parents=True)
        node_env = {**os.environ, **(env or {}), FSDP_TEST_ENV: "1", "HOME": str(pod / "home"),
                    "TMPDIR": str(pod / "tmp"), "DYNRUBRIC_CACHE": str(pod / "cache"), "HF_HOME": str(pod / "hf"),
                    "PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1",
                    "PET_MASTER_PORT": str(port)}  # fmt: skip
        command = [sys.executable, "-m", "dynamicrubric.training.node"]
        command += ["--config", files["config"], "--job", files["job"], "--result", files["result"]]
        with open(pod / "log", "w") as log:
            nodes.append(subprocess.Popen(command, env=node_env, cwd=pod / "home", stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
    return nodes


def _kill(nodes: list[subprocess.Popen]) -> None:
    """Each node's whole process tree (torchrun starts its workers in sessions of their own)."""
    tree = []
    for node in nodes:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += [node, *(psutil.Process(node.pid).children(recursive=True))]
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            proc.kill()
    for node in nodes:
        node.wait()
    psutil.wait_procs([p for p in tree if isinstance(p, psutil.Process)], timeout=30)


def _logs(run: Path) -> str:
    return "\n".join(f"--- node-{k}:\n{(run / f'node-{k}' / 'log').read_text()[-3000:]}" for k in (0, 1))


def _wait(run: Path, nodes: list[subprocess.Popen], line: str | None = None, timeout: float = 600) -> None:
    """Until both nodes exit 0, or node 0 prints `line`; a node that fails ends both, as it ends a
    TrainJob, and fails the test with their logs."""
    deadline = time.monotonic() + timeout
    while True:
        if line is not None and line in (run / "node-0" / "log").read_text():
            return
        codes = [node.poll() for node in nodes]
        if codes == [0, 0] and line is None:
            return
        if any(code not in (None, 0) for code in codes) or None not in codes or time.monotonic() > deadline:
            _kill(nodes)
            pytest.fail(f"nodes exited {codes} (waiting for {line or 'both to finish'}):\n{_logs(run)}")
        time.sleep(0.2)


def _job_files(bucket: str, name: str, cfg, prompts: str) -> tuple[TrainingJob, dict[str, str]]:
    """A job whose outputs are in the store, and its config, job and result as the TrainJob hands them."""
    root, model = f"s3://{bucket}/{name}", cfg.models.policy
    job = TrainingJob("train-policy", f"{root}/policy", f"{root}/steps", f"{root}/metrics.parquet", round_idx=1,
                      policy=model, generator=model, prompts_uri=prompts)  # fmt: skip
    files = {"config": f"{root}/config.yaml", "job": f"{root}/job.json", "result": f"{root}/result.json"}
    store.write_bytes(files["config"], cfg.to_yaml().encode())
    store.write_bytes(files["job"], job.to_json().encode())
    return job, files


def _step_files(steps_uri: str) -> dict[str, bytes]:
    return {rel: store.read_bytes(store.join(steps_uri, rel)) for rel in store.list_files(steps_uri)}


def _prompts_by_step(steps_uri: str) -> dict[int, list[str]]:
    """The prompts each step's rollouts answered (every rank's part), one entry per prompt."""
    seen: dict[int, list[str]] = {}
    for rel in store.list_files(steps_uri):
        if rel.endswith("/rollouts.parquet"):
            rollouts = read_frame(store.join(steps_uri, rel), "rollouts")
            step = int(rel.split("/")[0].removeprefix("step-"))
            seen.setdefault(step, []).extend(rollouts.drop_duplicates("prompt_id")["prompt_id"])
    return {step: sorted(ids) for step, ids in sorted(seen.items())}


def _weights(uri: str, local: Path) -> dict[str, torch.Tensor]:
    return load_file(str(store.download_dir(uri, local) / "model.safetensors"))


def _replicated_files(checkpoint: Path) -> dict[str, set[str]]:
    """For each DCP folder of a trainer checkpoint: the files holding its replicated entries (all but the
    ranks' DTensor shards: AdamW's `step` tensors and `param_groups` values), read from its .metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    found = {}
    for meta in checkpoint.glob("*/.metadata"):
        metadata = FileSystemReader(str(meta.parent)).read_metadata()
        sharded = {
            fqn for fqn, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and len(m.chunks) > 1
        }  # fmt: skip
        found[meta.parent.name] = {
            info.relative_path for index, info in metadata.storage_data.items() if index.fqn not in sharded
        }
    return found


# Two gloo processes save a sharded AdamW state through accelerate's own FSDP2 save, with torch's planner,
# then with the trainer's (checkpoints.replicated_entries_with_rank0): argv[1], argv[2].
SAVE_TWICE = """
import sys
from datetime import timedelta

import torch
from accelerate import PartialState
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import save_fsdp_optimizer
from torch.distributed.fsdp import fully_shard

from dynamicrubric.training.checkpoints import replicated_entries_with_rank0

state = PartialState(cpu=True, timeout=timedelta(seconds=60))
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 8)).sum().backward()
optimizer.step()
plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
save_fsdp_optimizer(plugin, None, optimizer, model, sys.argv[1])
replicated_entries_with_rank0()
save_fsdp_optimizer(plugin, None, optimizer, model, sys.argv[2])
state.destroy_process_group()
"""


def test_the_trainer_s_fsdp2_save_puts_every_replicated_entry_in_rank_0_s_file(tmp_path: Path) -> None:
    """accelerate's FSDP2 optimizer save (what transformers' Trainer calls at each checkpoint) on two
    gloo processes: torch's default planner spreads the replicated entries over both ranks' files, so
    a node holding only rank 0's could not load them; after replicated_entries_with_rank0 every one is
    in rank 0's file, and each rank's shards stay in its own."""
    port = free_port()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-c", SAVE_TWICE, str(tmp_path / "torch"), str(tmp_path / "trainer")]
    ranks = [
        subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    try:
        outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    spread = _replicated_files(tmp_path / "torch")["optimizer_0"]
    assert spread == {"__0_0.distcp", "__1_0.distcp"}, spread  # what the fix is for (torch 2.13's default)
    ours = _replicated_files(tmp_path / "trainer")["optimizer_0"]
    assert ours == {"__0_0.distcp"}, ours
    assert sorted(p.name for p in (tmp_path / "trainer" / "optimizer_0").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # fmt: skip


@pytest.mark.slow  # three two-node launches of one process each: about 3 minutes on 2 busy cores
def test_two_fsdp2_nodes_killed_after_a_save_resume_to_the_unbroken_run(s3_env, tmp_path: Path) -> None:
    # Every role's model from the store, as a cluster's nodes stage it (building tiny-random in each pod
    # would cost each node seconds of CPU for nothing this test checks)
    model = f"s3://{s3_env}/tiny-random"
    store.upload_dir(resolve_model("tiny-random"), model)
    cfg = _cfg(
        models={"policy": model, "generator": model, "verifier": model},
        train_policy={"world_size": 2, "num_nodes": 2, "max_steps": STEPS, "save_steps": 1,
                      "per_device_train_batch_size": 2, "process_group_timeout_s": 120},
        data={"num_prompts": 8},  # 3 steps x 2 prompts: within one pass over the pool (docs/training.md)
        judge={"variant": "pointwise"},  # soft scores: the groups are not tied, every step has a gradient
        aggregate={"soft": True},
    )  # fmt: skip
    prompts = f"s3://{s3_env}/prompts.parquet"
    store.write_bytes(prompts, Path(_prompts(tmp_path, cfg)).read_bytes())

    # The unbroken run
    whole, files = _job_files(s3_env, "whole", cfg, prompts)
    _wait(tmp_path / "whole", _start_nodes(tmp_path / "whole", files))

    # Killed on both nodes once step 1's checkpoint is stored (rank 0 stalls there; rank 1 goes on)
    killed, files = _job_files(s3_env, "killed", cfg, prompts)
    nodes = _start_nodes(tmp_path / "killed-1", files, {STALL_ENV: "1"})
    _wait(tmp_path / "killed-1", nodes, line="stalled after step 1")
    _kill(nodes)
    checkpoint = f"{killed.out_uri}.work/checkpoint-00001"
    assert store.is_complete(checkpoint) and not store.is_complete(killed.out_uri)
    assert store.is_complete(f"{killed.out_uri}.work/nodes/node-1/checkpoint-00001")  # node 1's part
    # Every replicated entry (AdamW's step tensors, its param_groups) is in rank 0's file, which every
    # node fetches: DCP's default spread them over the ranks, and node 0 fetches only its own part.
    replicated = _replicated_files(store.download_dir(checkpoint, tmp_path / "checkpoint"))
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(replicated), replicated
    assert replicated["optimizer_0"], replicated  # the optimizer has some
    for folder, names in replicated.items():
        assert all(name.startswith("__0_") for name in names), (folder, names)

    # The retried TrainJob: fresh pods resume from the store
    _wait(tmp_path / "killed-2", _start_nodes(tmp_path / "killed-2", files))
    for k in (0, 1):
        log = (tmp_path / "killed-2" / f"node-{k}" / "log").read_text()
        assert f"resuming from {checkpoint}" in log, log[-3000:]

    # The same steps: every artifact of every step, each rank's part, byte for byte (steps 2 and 3 written
    # by the resumed run, step 1 by the killed one)
    a, b = _step_files(whole.steps_uri), _step_files(killed.steps_uri)
    assert sorted(a) == sorted(b) and {rel.split("/")[0] for rel in a} == {f"step-{s:05d}" for s in (1, 2, 3)}
    differ = [rel for rel in a if a[rel] != b[rel]]
    assert not differ, differ
    # The same prompts at each step: none skipped, none repeated (the unbroken run draws 6 distinct ones)
    seen = _prompts_by_step(killed.steps_uri)
    assert seen == _prompts_by_step(whole.steps_uri)
    assert [len(ids) for ids in seen.values()] == [cfg.train_policy.prompts_per_step] * STEPS, seen
    assert len({i for ids in seen.values() for i in ids}) == STEPS * cfg.train_policy.prompts_per_step, seen
    # The same weights, bit for bit, and trained
    w, r = _weights(whole.out_uri, tmp_path / "w"), _weights(killed.out_uri, tmp_path / "r")
    assert w.keys() == r.keys() and all(torch.equal(w[k], r[k]) for k in w)
    start = _weights(model, tmp_path / "start")
    assert not all(torch.equal(w[k], start[k]) for k in w), "the unbroken run did not train"
