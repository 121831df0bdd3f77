"""Launching a training stage.

Processes. `launch` (used by the pipeline's training components) runs `training.process` under
`accelerate launch` with one process per GPU the task requests (`train_*.world_size`; FSDP on GPU
with the config shipped in `dynamicrubric/accelerate/`; one GPU is a plain one-process launch); on CPU
the same launcher runs one process (--cpu) or several (gloo). On GPU the trained model generates with
TRL's vLLM colocate mode (sleep mode on), and the reward reaches G and V through vLLM servers that
`launch` starts on the task's `reward_gpus` (serving.py), or through the user's endpoints
(`models.<role>_url`); on CPU the reward loads them in-process (see docs/training.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import torch

from dynamicrubric import store
from dynamicrubric.config import Config, TrainConfig, served_roles
from dynamicrubric.models import resolve_model
from dynamicrubric.training.checkpoints import already_done
from dynamicrubric.training.data import TrainingJob, check_batch, check_context, job_dataset, trainee


class TrainingError(ValueError):
    """A training process stopped on bad input; the message is the one the process raised."""


def accelerate_config(world_size: int, cuda: bool) -> Path | None:
    """The FSDP config shipped in the package, for several GPU processes; None otherwise."""
    if world_size > 1 and cuda:
        return Path(str(resources.files("dynamicrubric").joinpath("accelerate", "fsdp.yaml")))
    return None


# glibc's malloc serves a request of this many bytes or more with its own mapping, returned to the
# system when freed. By default that threshold rises with every large block freed (up to 32 MiB), so a
# CPU backward pass's many 4-8 MB activations (3,440 tokens x 576 floats is 7.9 MB) end up in the heap,
# which keeps the pages: the local preset's round-1 train-evaluator held 4.36 GB at its peak, of which
# about 2.5 GB was in use. A fixed 4 MiB: peak 2.54 GB, 12% more time for that stage (fresh pages are
# zeroed); 8 MiB: 3.94 GB, +6%; 1 MiB: 2.37 GB, +45% (measured on the 2-core VM, same numbers out).
CPU_MMAP_THRESHOLD = 4 << 20


def training_env(tcfg: TrainConfig, environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """The training processes' environment: `environ` with the config's torch thread count and, on a
    CPU, glibc's mmap threshold (CPU_MMAP_THRESHOLD) unless `environ` sets one."""
    env = dict(environ)
    if tcfg.torch_threads:
        env["OMP_NUM_THREADS"] = str(tcfg.torch_threads)
    if not torch.cuda.is_available():
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(CPU_MMAP_THRESHOLD))
    return env


# Token rows per tile of TRL's fused LM head on a CPU (see bound_lm_head_tiles).
CPU_LM_HEAD_TILE_TOKENS = 256


def bound_lm_head_tiles() -> None:
    """Smaller tiles for TRL's fused LM head (log-probs without the full logits) on a CPU.

    Without Triton it scores every position in tiles of up to 4,096 tokens × 32,768 vocabulary
    columns and folds each tile in torch with several temporaries of the tile's size. Forward and
    backward over 3,500 tokens (the generator's micro-batch of 4 completions) raised peak RSS by
    4.2 GB with TRL's tiles, 0.77 GB with 512-token tiles and 0.51 GB with 256 (SmolLM2's head, measured
    here). Every token's row is computed by the same operations whatever the tile, so losses and
    gradients are unchanged (tests/test_train.py checks it bit for bit). TRL reads the module
    constant at each call.
    """
    from trl.kernels import chunked_logprob

    chunked_logprob.TOKEN_CHUNK_SIZE = min(chunked_logprob.TOKEN_CHUNK_SIZE, CPU_LM_HEAD_TILE_TOKENS)


def launch_command(
    world_size: int, args: list[str], num_nodes: int = 1, cuda: bool | None = None
) -> list[str]:
    """`accelerate launch` of this module with `world_size` processes over `num_nodes` machines: one per
    GPU with CUDA (FSDP for several), else CPU processes (--cpu for one, gloo for several). `cuda`
    defaults to this machine's (a TrainJob's nodes are GPU nodes whatever the submitting task is)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(world_size)]
    cmd += ["--num_machines", str(num_nodes), "--mixed_precision", "no", "--dynamo_backend", "no"]
    fsdp = accelerate_config(world_size, cuda)
    if fsdp is not None:
        cmd += ["--config_file", str(fsdp)]
    elif world_size > 1:
        # torchrun-style processes; without CUDA each one runs on the CPU (TRL's use_cpu) with gloo.
        # (accelerate's --cpu with several processes means an MPI launch, which is not installed.)
        cmd += ["--multi_gpu"]
    elif not cuda:
        # Only without CUDA: --cpu exports ACCELERATE_USE_CPU, which would put a one-GPU run on the CPU.
        cmd += ["--cpu"]
    return cmd + ["-m", "dynamicrubric.training.process", *args]


def launch(cfg: Config, job: TrainingJob) -> dict:
    """Run a training job in `world_size` fresh processes and return its final metrics (the steps'
    time measurements under "timings").

    With `reward_gpus` the task first starts a vLLM server for each reward model it serves
    (`serving.reward_servers`) on the GPUs after the trainer's, trains with their URLs in the config,
    and stops them whatever happens. The config and the job travel as files."""
    if store.is_complete(job.out_uri):
        return already_done(job.out_uri, job.metrics_uri)
    key, setting = job.stage.replace("-", "_"), trainee(cfg, job.stage)
    tcfg = setting.tcfg
    # Bad inputs are refused here, in one line, before `accelerate launch` starts processes that would
    # load the models first and fail with two tracebacks (the process's and accelerate's).
    dataset = job_dataset(cfg, job)
    check_batch(job.stage, tcfg, setting.num_generations, len(dataset["prompt"]))
    check_context(job.stage, cfg, job.model_ref, dataset, setting.max_new_tokens, setting.enable_thinking)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        env = training_env(tcfg, os.environ)
        roles = served_roles(cfg, key) if tcfg.reward_gpus else ()
        if roles:
            from dynamicrubric.serving import reward_gpu_split, reward_servers

            train_gpus, role_gpus = reward_gpu_split(key, cfg, visible_gpus())
            folders = {r: str(resolve_model(getattr(job, r) or getattr(cfg.models, r))) for r in roles}
            urls = servers.enter_context(reward_servers(cfg, key, folders, role_gpus, Path(tmp) / "servers"))
            models = cfg.models.model_copy(update={f"{r}_url": url for r, url in urls.items()})
            cfg = cfg.model_copy(update={"models": models})
            env["CUDA_VISIBLE_DEVICES"] = ",".join(train_gpus)
        config_file, job_file, result_file = (
            Path(tmp) / n for n in ("config.yaml", "job.json", "result.json")
        )
        config_file.write_text(cfg.to_yaml())
        job_file.write_text(job.to_json())
        args = ["--config", str(config_file), "--job", str(job_file), "--result", str(result_file)]
        proc = subprocess.run(launch_command(tcfg.world_size, args), env=env, check=False)
        if proc.returncode != 0:
            error_file = result_file.with_suffix(".error")
            if error_file.exists():  # what the process raised, said again here (its traceback is above)
                error = json.loads(error_file.read_text())
                if error["user"]:
                    raise TrainingError(error["message"])
                raise RuntimeError(f"{job.stage}: {error['type']}: {error['message']}")
            raise RuntimeError(f"{job.stage}: the training process exited with code {proc.returncode}")
        return json.loads(result_file.read_text())


def visible_gpus() -> list[str]:
    """The GPUs this task may use, as CUDA_VISIBLE_DEVICES names them (all of the node's if unset)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
