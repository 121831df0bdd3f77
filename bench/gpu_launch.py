"""The real training launch on one GPU: a full finetune under FSDP2 through the project's launcher.

    python -m bench.gpu_launch [--work DIR] [--out PATH]   # on the GPU machine (bench/gpu_smoke.sh runs it)

The same path a training task takes: `launcher.launch_command` → `accelerate launch` with
`dynamicrubric/accelerate/fsdp.yaml` → `dynamicrubric.training.process` → GRPOTrainer. One process (world size 1)
takes FSDP2 through the test hook of training/fsdp_hook.py (a one-GPU task is otherwise a plain launch); without
CUDA the same runs on a gloo CPU process (gpu_smoke.sh --check). The model is tiny-random (built here, offline),
the reward the tiny preset's pointwise judge, in-process on the CPU; β > 0 and no LoRA, so TRL keeps a reference
model. It trains step 1, stores its DCP trainer checkpoint, is killed there as a lost pod is, then a second
launch resumes from the checkpoint, trains step 2 and exports. It checks that the reference equals the policy at
step 0 (the reference's weights sum as the starting model's do; KL at step 1 ≈ 0), that the checkpoint is
FSDP's sharded state (.distcp files), and that the resume and the export happened. Writes one JSON and prints
one last line, `gpu_launch: OK ...` or `gpu_launch: FAIL: ...` (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import RESULTS, machine_info, one_line, write_verdict

KL_TOLERANCE = 1e-3  # |KL| at step 1; a reference of zeros gives a KL of order 10 or more
RUN_TIMEOUT_S = 120  # each of the two launches (gpu_smoke.sh bounds both together)
PROMPTS = [
    {"prompt": f"What is {a} + {b}?", "reference": str(a + b), "split": "train"}
    for a in range(4)
    for b in (1, 2)
]


class LaunchFailed(Exception):
    pass


def launch(
    cmd: list[str],
    env: dict[str, str],
    log: Path,
    stop_at: str | None = None,
    grace_s: float = 0.0,
    timeout_s: float = RUN_TIMEOUT_S,
) -> str:
    """Run one launch to its end (or, with `stop_at`, until a line holds it, then, `grace_s` later, kill it
    and its workers: torchrun starts each in a session of its own), for `timeout_s` at most; its output
    goes to `log` and is returned. A SIGTERM (gpu_smoke.sh's `timeout`) kills them too: a GPU left held by
    an orphaned worker would fail every step after it."""
    import psutil

    lines: list[str] = []
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            deadline = time.monotonic() + timeout_s
            reached = False
            for line in proc.stdout:
                out.write(line)
                lines.append(line)
                if stop_at and stop_at in line:
                    reached = True
                    time.sleep(grace_s)  # e.g. for a watcher in the worker to record what it saw last
                    break
                if time.monotonic() > deadline:
                    break
        finally:
            workers = psutil.Process(proc.pid).children(recursive=True)
            if stop_at or proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                for worker in workers:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        worker.kill()
            rc = proc.wait()
            psutil.wait_procs(workers, timeout=30)
            signal.signal(signal.SIGTERM, previous)
    text = "".join(lines)
    if stop_at and not reached:
        raise LaunchFailed(f"the launch never printed {stop_at!r} (exit {rc}; see {log})")
    if not stop_at and rc != 0:
        raise LaunchFailed(f"the launch exited with {rc} (see {log})")
    return text


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through launch's cleanup, which Python's default exit skips


def training_job(work: Path, cfg: Any, policy: str) -> tuple[Any, list[str], dict[str, str]]:
    """A train-policy job of `policy` on `cfg`'s train prompts, written into `work` as a training task
    writes it, and the launcher's command and environment for it (FSDP2 through the test hook, whatever
    the world size). Returns the job, the command and the environment."""
    from dynamicrubric import tasks
    from dynamicrubric.infra.artifacts import write_artifact
    from dynamicrubric.training import launcher
    from dynamicrubric.training.data import TrainingJob
    from dynamicrubric.training.fsdp_hook import FSDP_TEST_ENV

    prompts_uri = str(work / "prompts.parquet")
    write_artifact(prompts_uri, "prompts", tasks.configured_prompts(cfg.data, "train"))
    job = TrainingJob("train-policy", str(work / "policy"), str(work / "steps"),
                      metrics_uri=str(work / "metrics.parquet"), round_idx=1, policy=policy,
                      generator="tiny-random", prompts_uri=prompts_uri)  # fmt: skip
    (work / "config.yaml").write_text(cfg.to_yaml())
    (work / "job.json").write_text(job.to_json())
    env = {**launcher.training_env(cfg.train_policy, os.environ), FSDP_TEST_ENV: "1"}
    args = ["--config", str(work / "config.yaml"), "--job", str(work / "job.json")]
    os.environ[FSDP_TEST_ENV] = "1"  # launch_command reads it here
    return job, launcher.launch_command(cfg.train_policy.world_size, args), env


def run(work: Path, result: dict[str, Any]) -> list[str]:
    """Both launches and the checks; returns the problems found (empty: passed)."""
    os.environ.setdefault("DYNRUBRIC_CACHE", str(work / "cache"))
    from transformers import AutoModelForCausalLM

    from dynamicrubric import store
    from dynamicrubric.infra.artifacts import read_frame
    from dynamicrubric.infra.config_loading import load_config
    from dynamicrubric.infra.models import resolve_model
    from dynamicrubric.training import launcher
    from dynamicrubric.training.checkpoints import STALL_ENV

    cuda = torch.cuda.is_available()
    (work / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    train = {"max_steps": 2, "save_steps": 1, "world_size": 1, "beta": 0.01, "lora_rank": 0}
    train |= {"prompts_per_step": 2, "per_device_train_batch_size": 4}
    cfg = load_config(
        preset="tiny",
        overrides={
            "data": {"sources": [str(work / "prompts.jsonl")], "num_prompts": len(PROMPTS)},
            "train_policy": train,
            "judge": {"variant": "pointwise"},  # soft scores from the in-process verifier (CPU)
            "aggregate": {"soft": True},
        },
    )
    job, cmd, env = training_job(work, cfg, "tiny-random")
    result["command"] = cmd
    problems = []
    if str(launcher.accelerate_config(2, cuda=True)) not in cmd:
        problems.append("launch_command did not pass the FSDP config")

    started = time.perf_counter()
    first = launch(cmd, {**env, STALL_ENV: "1"}, work / "launch-1.log", stop_at="stalled after step 1")
    result["first_launch_s"] = time.perf_counter() - started
    # The reference at step 0: its weights, in the run's dtype, sum as the starting model's do.
    dtype = torch.bfloat16 if cuda else torch.float32
    start = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random"), dtype=dtype)
    expected = sum(p.detach().double().abs().sum().item() for p in start.parameters())
    # No device map: TRL's "auto" default on CUDA would spread the reference over every GPU it sees.
    maps = re.findall(r"rank 0: reference model device map (.+)", first)
    result["reference_device_map"] = maps[-1] if maps else None
    if maps and maps[-1] != "None":
        problems.append(f"the reference model was loaded with a device map ({maps[-1]}), not placed by FSDP")
    logged = re.findall(r"rank 0: reference model sum\|w\| (\S+)", first)
    result["reference_sum"], result["starting_sum"] = (float(logged[-1]) if logged else None), expected
    if not logged:
        problems.append("the training process logged no reference model")
    elif abs(float(logged[-1]) - expected) > 1e-9 * expected:
        problems.append(f"the reference's sum|w| is {logged[-1]}, the starting model's {expected!r}")
    stored = f"{job.out_uri}.work/checkpoint-00001"
    files = [f.removeprefix(stored + "/") for f in store.list_files(stored)]
    result["checkpoint_files"] = sorted(files)
    if not store.is_complete(stored):
        problems.append(f"no complete trainer checkpoint {stored}")
    elif not any(f.endswith(".distcp") for f in files):
        problems.append(f"the trainer checkpoint holds no DCP shards (.distcp): {sorted(files)}")

    started = time.perf_counter()
    second = launch(cmd + ["--result", str(work / "result.json")], env, work / "launch-2.log")
    result["second_launch_s"] = time.perf_counter() - started
    if f"resuming from {stored}" not in second:
        problems.append("the second launch did not resume from the stored checkpoint")
    if not store.is_complete(job.out_uri):
        problems.append("no exported model")
    metrics = read_frame(job.metrics_uri, "metrics")
    kl = metrics[metrics["name"] == "kl"].set_index("step")["value"].to_dict()
    result["kl"] = {int(k): float(v) for k, v in kl.items()}
    if sorted(kl) != [1, 2]:
        problems.append(f"KL logged at steps {sorted(kl)}, not [1, 2]")
    elif abs(kl[1]) > KL_TOLERANCE:
        problems.append(f"KL at step 1 is {kl[1]:.3g}: the reference is not the starting policy")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_launch.json")
    parser.add_argument(
        "--work", type=Path, default=None, help="scratch folder (default: a new temporary one)"
    )
    a = parser.parse_args(argv)
    result: dict[str, Any] = {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "machine": machine_info(),
    }
    with contextlib.ExitStack() as stack:
        work = a.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-launch.")))
        work.mkdir(parents=True, exist_ok=True)
        try:
            problems = run(work, result)
        except Exception as e:  # said in one line; the JSON keeps what was measured
            problems = [one_line(e)]
    if not write_verdict("gpu_launch", a.out, result, problems):
        return 1
    print(
        f"gpu_launch: OK FSDP2 full finetune on 1 {result['device']} rank via accelerate launch: reference = policy "
        f"at step 0 (KL {result['kl'][1]:.2g}), DCP checkpoint, resume, export in "
        f"{result['first_launch_s']:.0f}+{result['second_launch_s']:.0f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
