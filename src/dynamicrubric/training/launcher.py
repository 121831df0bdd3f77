"""Launching a training stage.

Processes. `launch` (used by the pipeline's training components on one node) runs `training.process`
under `accelerate launch` with one process per GPU the task requests (`train_*.world_size`; FSDP on GPU
with the config shipped in `dynamicrubric/accelerate/`; one GPU is a plain one-process launch); on CPU
the same launcher runs one process (--cpu) or several (gloo). On several nodes every node of the
TrainJob runs `run_node` with its `Rendezvous` (training/node.py, training/trainjob.py). On GPU the
trained model generates with TRL's vLLM colocate mode (sleep mode on), and the reward reaches G and V
through vLLM servers that `run_node` starts on the node's share of `reward_gpus` (serving.py), or
through the user's endpoints (`models.<role>_url`); on CPU the reward loads them in-process (see
docs/training.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from dynamicrubric import store
from dynamicrubric.infra.config import Config, TrainConfig, served_roles
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.infra.stopping import run_child
from dynamicrubric.training import fsdp_hook
from dynamicrubric.training.checkpoints import already_done
from dynamicrubric.training.data import TrainingJob, check_batch, check_context, job_dataset, trainee


class TrainingError(ValueError):
    """A training process stopped on bad input; the message is the one the process raised."""


def accelerate_config(world_size: int, cuda: bool) -> Path | None:
    """The FSDP config shipped in the package, for several GPU processes (for any under the test hook of
    training/fsdp_hook.py); None otherwise."""
    if (world_size > 1 and cuda) or fsdp_hook.asked():
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


RENDEZVOUS_ENV = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


@dataclass(frozen=True)
class Rendezvous:
    """This node's place in a launch over several nodes: how many, its rank, and where rank 0 listens."""

    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Rendezvous:
        """What Kubeflow Trainer's torch runtime sets on every node (the variables torchrun reads)."""
        missing = [name for name in RENDEZVOUS_ENV if not environ.get(name)]
        if missing:
            raise TrainingError(
                f"{', '.join(missing)} not set: a node of a several-node launch takes its rank and rank 0's "
                "address from the torch runtime of Kubeflow Trainer (a TrainJob, see training/trainjob.py)"
            )
        nodes, rank, addr, port = (environ[name] for name in RENDEZVOUS_ENV)
        return cls(int(nodes), int(rank), addr, int(port))


def launch_command(
    world_size: int, args: list[str], node: Rendezvous | None = None, rendezvous_timeout_s: int = 3600
) -> list[str]:
    """`accelerate launch` of the training process with `world_size` processes in all (over the nodes of
    `node`, this machine's rank among them, waiting up to `rendezvous_timeout_s` for the others, else on
    this machine alone): one per GPU with CUDA (FSDP for several), else CPU processes (--cpu for one,
    gloo for several)."""
    cuda = torch.cuda.is_available()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(world_size)]
    cmd += ["--num_machines", str(node.num_nodes if node else 1)]
    if node:
        cmd += ["--machine_rank", str(node.node_rank), "--main_process_ip", node.master_addr]
        cmd += ["--main_process_port", str(node.master_port)]
        # accelerate hands --rdzv_conf to torchrun: the static rendezvous reads `timeout`, c10d `join_timeout`
        timeout = int(rendezvous_timeout_s)
        cmd += ["--rdzv_conf", f"timeout={timeout},join_timeout={timeout}"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no"]
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


def check_job(cfg: Config, job: TrainingJob) -> None:
    """Bad inputs refused in one line before `accelerate launch` starts processes that would load the
    models first and fail with two tracebacks (the process's and accelerate's)."""
    setting = trainee(cfg, job.stage)
    dataset = job_dataset(cfg, job)
    check_batch(job.stage, setting.tcfg, setting.num_generations, len(dataset["prompt"]))
    check_context(job.stage, cfg, job.model_ref, dataset, setting.max_new_tokens, setting.enable_thinking)


def launch(cfg: Config, job: TrainingJob) -> dict:
    """Run a training job in `world_size` fresh processes on this machine and return its final metrics
    (the steps' time measurements under "timings"). The config and the job travel as files."""
    if store.is_complete(job.out_uri):
        return already_done(cfg, job)
    check_job(cfg, job)
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "result.json")
        code = run_node(cfg, job, result, Path(tmp))
        if code != 0:
            raise launch_error(job.stage, result, f"the training process exited with code {code}")
        return json.loads(store.read_bytes(result))


def run_node(
    cfg: Config, job: TrainingJob, result_uri: str, tmp: Path, node: Rendezvous | None = None
) -> int:
    """This machine's part of a training job; returns `accelerate launch`'s exit code.

    With `reward_gpus` it first starts a vLLM server for each reward model it serves
    (`serving.reward_servers`) on this machine's share of them, after the trainer's GPUs, trains with
    their URLs in the config, and stops them whatever happens: every node of a several-node job serves
    its own copies, which its processes reach on localhost. Rank 0 writes the final metrics to
    `result_uri`; the first process that raised, what it raised to `error_uri(result_uri)`."""
    key, tcfg = job.stage.replace("-", "_"), trainee(cfg, job.stage).tcfg
    with contextlib.ExitStack() as servers:
        env = training_env(tcfg, os.environ)
        roles = served_roles(cfg, key) if tcfg.reward_gpus else ()
        if roles:
            from dynamicrubric.infra.serving import reward_gpu_split, reward_servers

            train_gpus, role_gpus = reward_gpu_split(key, cfg, visible_gpus())
            folders = {r: str(resolve_model(getattr(job, r) or getattr(cfg.models, r))) for r in roles}
            urls = servers.enter_context(reward_servers(cfg, key, folders, role_gpus, tmp / "servers"))
            models = cfg.models.model_copy(update={f"{r}_url": url for r, url in urls.items()})
            cfg = cfg.model_copy(update={"models": models})
            env["CUDA_VISIBLE_DEVICES"] = ",".join(train_gpus)
        config_file, job_file = tmp / "config.yaml", tmp / "job.json"
        config_file.write_text(cfg.to_yaml())
        job_file.write_text(job.to_json())
        args = ["--config", str(config_file), "--job", str(job_file), "--result", result_uri]
        # Its own process group, stopped with this process (a pod's SIGTERM, a Ctrl-C): see stopping.py
        return run_child(launch_command(tcfg.world_size, args, node, tcfg.rendezvous_timeout_s), env=env)


def error_uri(result_uri: str) -> str:
    """Where a training process that raised writes what it raised, beside its result."""
    return result_uri + ".error"


def launch_error(stage: str, result_uri: str, otherwise: str) -> Exception:
    """The error a failed training launch raises: what its process raised, said again here (its traceback
    is above), a TrainingError for bad input, a ServedError for a model server's failure; else `otherwise`."""
    if not store.exists(error_uri(result_uri)):
        return RuntimeError(f"{stage}: {otherwise}")
    error = json.loads(store.read_bytes(error_uri(result_uri)))
    if error.get("served"):
        from dynamicrubric.engines import ServedError

        return ServedError(error["message"])
    if error["user"]:
        return TrainingError(error["message"])
    return RuntimeError(f"{stage}: {error['type']}: {error['message']}")


def visible_gpus() -> list[str]:
    """The GPUs this task may use, as CUDA_VISIBLE_DEVICES names them (all of the node's if unset)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
