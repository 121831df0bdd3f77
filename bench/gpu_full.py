"""One full-finetune GRPO step of a random-initialised Qwen3-1.7B-shaped model through the project's launcher,
its measured peak GPU memory against the GPU memory plan's full-finetune arithmetic.

    python -m bench.gpu_full [--work DIR] [--out PATH]   # on one GPU (bench/gpu_smoke.sh runs it offline)
    python -m bench.gpu_full --tiny                      # the same launch at a tiny shape (gloo CPU without CUDA)

The path of bench/gpu_launch.py: `launcher.launch_command` → `accelerate launch` with accelerate/fsdp.yaml →
`dynamicrubric.training.process` → GRPOTrainer, FSDP2 at world size 1 through training/fsdp_hook.py's test hook.
What differs is the size and what is measured: the model is a Qwen3-1.7B shape (1,720,574,976 parameters, tied
embeddings) with random weights, stored here in bf16 with bench/gpu_step.py's synthetic tokenizer; no LoRA and
β > 0, so the trainer keeps fp32 master weights, gradients and Adam's moments of every parameter and TRL holds
a reference model; the paper preset's memory settings for one process (micro-batch 4, gradient checkpointing,
β, learning rate, K = 8), one prompt of 512 tokens and 256-token completions (the whole smoke run must finish
in under 8 minutes). The reward is the tiny preset's pointwise judge, in-process (its 2,048-token verifier
reads the prompt truncated). The training process's peak is read inside it by bench/peak_hook (a
sitecustomize on its PYTHONPATH: the command stays the launcher's own); the launch is stopped once step 1 is
logged (the export is bench/gpu_launch.py's check, and 3.4 GB to write here).

The plan (config.check_gpu_memory_plan) for one training GPU without vLLM: `training_state_gib(params, 1)`
(16 B/param) + `activation_memory_gib`. It has no term for the reference model's bf16 copy (2 B/param over
world_size with β > 0 and no LoRA), which the JSON states beside it. Writes one JSON and prints one last line,
`gpu_full: OK ...` or `gpu_full: FAIL: ...` (exit 1): the launch failed, or its peak allocated GPU memory
exceeded TOLERANCE x the plan.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import RESULTS, machine_info, one_line, write_verdict
from bench.gpu_launch import launch, training_job
from bench.gpu_step import GIB, TINY, TOLERANCE, build_model, build_tokenizer, param_count

HOOK = Path(__file__).parent / "peak_hook"  # its sitecustomize.py records the worker's peaks
PEAK_ENV = "DYNRUBRIC_BENCH_PEAK_DIR"
STEP_LINE = "{'loss': "  # the Trainer's log of step 1: the update, and so the step's peak, is behind it
GRACE_S = 1.0  # after that line, before the kill: 5 of the hook's polls
LAUNCH_TIMEOUT_S = 240  # the launch's own bound; gpu_smoke.sh bounds the whole script tighter

# Qwen/Qwen3-1.7B's config.json (the shape only, as gpu_step.QWEN3_8B).
QWEN3_1_7B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}


def step_settings(tiny: bool) -> dict[str, Any]:
    """The paper preset's memory settings of train-policy for one process, and what this step changes."""
    from dynamicrubric.infra.config_loading import load_config

    paper = load_config(preset="paper")
    t = paper.train_policy
    return {
        "preset": "paper (train_policy's memory settings), tiny (the reward)",
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "gradient_checkpointing": t.gradient_checkpointing,
        "beta": t.beta,
        "learning_rate": t.learning_rate,
        "loss_type": t.loss_type,
        "activation_memory_gib": t.activation_memory_gib,
        "k": paper.rollout.k,
        "prompts_per_step": 1,  # one group of K: two micro-batches of 4, as gpu_step's
        "lora_rank": 0,
        "world_size": 1,
        "prompt_tokens": 16 if tiny else 512,  # words of the synthetic vocabulary: one token each
        "max_completion_length": 8 if tiny else 256,
        "max_completion_length_paper": paper.rollout.max_new_tokens,
        "why_shorter": (
            "the whole smoke run must finish in under 8 minutes; the plan's activation allowance is sized for "
            "4 x 2,560 tokens, which this step stays inside"
        ),
    }


def plan(params: int, s: dict[str, Any]) -> dict[str, Any]:
    """The GPU memory plan's expectation for one training GPU of this step, and what it leaves out."""
    from dynamicrubric.infra.config import TRAINING_STATE_BYTES_PER_PARAM, training_state_gib

    state = training_state_gib(params, s["world_size"])
    act = s["activation_memory_gib"]
    reference = params * 2 / GIB / s["world_size"]
    return {
        "plan_gib": state + act,
        "arithmetic": (
            f"fp32 weights + grads + Adam {params:,} x {TRAINING_STATE_BYTES_PER_PARAM} B / {s['world_size']} = "
            f"{state:.2f} + activation_memory_gib {act:g} (paper preset) + colocated vLLM 0 (transformers "
            f"generates) = {state + act:.2f} GiB"
        ),
        "state_gib": state,
        "not_in_plan": {
            "reference_bf16_gib": reference,
            "why": "with beta > 0 and no LoRA TRL keeps a bf16 reference copy; check_gpu_memory_plan has no "
            "term for it (its shards at rest: 2 B/param / world_size; grpo.reference_sharded_by_layer shards "
            "it layer by layer, so its forward gathers one layer at a time; at world size 1 it is whole)",
        },
    }


def write_model(folder: Path, shape: dict[str, int], device: torch.device) -> int:
    """The random model and its tokenizer as a Hugging Face folder: bf16 on GPU (the stored dtype of
    every model of the plans), fp32 for the CPU dry run (as training loads it there). Returns its number
    of parameters (a tied embedding counted once)."""
    tokenizer = build_tokenizer(shape["vocab_size"])
    model = build_model(shape, tokenizer, device)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # this process keeps only its CUDA context during the launch
    return params


def run(work: Path, tiny: bool, result: dict[str, Any]) -> list[str]:
    """Build, launch, stop after step 1, and compare; fills `result` as it goes."""
    os.environ.setdefault("DYNRUBRIC_CACHE", str(work / "cache"))
    from dynamicrubric.infra.config_loading import load_config
    from dynamicrubric.training import launcher

    cuda = torch.cuda.is_available()
    shape = TINY if tiny else QWEN3_1_7B
    s = step_settings(tiny)
    params = param_count(shape)
    result.update(shape="tiny" if tiny else "qwen3-1.7b", model_config=shape, settings=s, params=params)
    result["expected"] = plan(params, s)
    result["plan_gib"] = result["expected"]["plan_gib"]

    started = time.perf_counter()
    result["params_built"] = write_model(
        work / "model", shape, torch.device("cuda", 0) if cuda else torch.device("cpu")
    )
    result["build_s"] = time.perf_counter() - started
    prompt = " ".join(f"w{i}" for i in range(s["prompt_tokens"]))
    (work / "prompts.jsonl").write_text(json.dumps({"prompt": prompt, "reference": "w1", "split": "train"}))
    keys = ("per_device_train_batch_size", "gradient_checkpointing", "beta", "learning_rate", "loss_type")
    keys += ("activation_memory_gib", "prompts_per_step", "lora_rank", "world_size")
    train = {k: s[k] for k in keys} | {"max_steps": 1, "save_steps": 1000}  # no trainer checkpoint
    cfg = load_config(
        preset="tiny",
        overrides={
            "data": {"sources": [str(work / "prompts.jsonl")], "num_prompts": 1},
            "rollout": {"k": s["k"], "max_new_tokens": s["max_completion_length"]},
            "train_policy": train,
            "judge": {"variant": "pointwise", "max_response_chars": 200},
            "engine": {"long_prompts": "truncate"},  # the verifier's context is 2,048 tokens
            "aggregate": {"soft": True},
        },
    )
    job, cmd, env = training_job(work, cfg, str(work / "model"))
    result["command"] = cmd
    problems = []
    if result["params_built"] != params:
        problems.append(f"{result['params_built']:,} params built, not {params:,} by arithmetic")
    if str(launcher.accelerate_config(2, cuda=True)) not in cmd:
        problems.append("launch_command did not pass the FSDP config")
    peaks = work / "peak"
    env |= {
        PEAK_ENV: str(peaks),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOK), env.get("PYTHONPATH")])),
    }
    started = time.perf_counter()
    text = launch(
        cmd, env, work / "launch.log", stop_at=STEP_LINE, grace_s=GRACE_S, timeout_s=LAUNCH_TIMEOUT_S
    )
    result["launch_s"] = time.perf_counter() - started
    logged = [line for line in text.splitlines() if STEP_LINE in line]
    with contextlib.suppress(ValueError, SyntaxError):  # the Trainer logs numbers as strings
        step = ast.literal_eval(logged[-1][logged[-1].index(STEP_LINE) :])
        result["step_log"] = {k: float(v) for k, v in step.items() if _number(v)}
    if "rank 0: reference model sum|w|" not in text:
        problems.append("the training process logged no reference model (beta > 0 must keep one)")
    try:
        measured = json.loads((peaks / "peak-rank0.json").read_text())
    except (OSError, ValueError):
        return [
            *problems,
            f"no peak recorded in {peaks} (bench/peak_hook did not run in the training process)",
        ]
    result["measured"] = measured
    if cuda:
        if "peak_allocated_gib" not in measured:
            return [*problems, "the training process recorded no GPU memory: did it run on the CPU?"]
        result["measured_gib"] = measured["peak_allocated_gib"]  # the step's verdict reads this one
        result["ratio"] = result["measured_gib"] / result["plan_gib"]
        problems += over_plan(result["measured_gib"], result["plan_gib"])
    elif measured.get("peak_rss_gib", 0.0) <= 0:
        problems.append("the training process recorded no memory at all")
    return problems


def over_plan(measured_gib: float, plan_gib: float) -> list[str]:
    """The step's verdict on memory: a peak above TOLERANCE x the plan fails it (as gpu_step's phases)."""
    if measured_gib <= TOLERANCE * plan_gib:
        return []
    return [f"peak allocated {measured_gib:.2f} GiB > {TOLERANCE:g} x the plan's {plan_gib:.2f} GiB"]


def _number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_full", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_full.json")
    parser.add_argument(
        "--work", type=Path, default=None, help="scratch folder (default: a new temporary one)"
    )
    parser.add_argument("--tiny", action="store_true", help="gpu_step's 2-layer, hidden-64 shape")
    a = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {"device": "cuda" if cuda else "cpu", "tolerance": TOLERANCE}
    result["machine"] = machine_info()
    if cuda:
        result["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
    with contextlib.ExitStack() as stack:
        work = a.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-full.")))
        work.mkdir(parents=True, exist_ok=True)
        try:
            problems = run(work, a.tiny, result)
        except Exception as e:  # LaunchFailed among them: said in one line; the JSON keeps what was measured
            problems = [one_line(e)]
    if not write_verdict("gpu_full", a.out, result, problems):
        return 1
    m, e = result["measured"], result["expected"]
    memory = (
        f"peak {m['peak_allocated_gib']:.1f} GiB allocated ({m['peak_reserved_gib']:.1f} reserved) = "
        f"{result['ratio']:.2f} x plan {e['plan_gib']:.1f} GiB"
        if cuda
        else f"no GPU memory (CPU; peak RSS {m['peak_rss_gib']:.2f} GiB)"
    )
    kl = result.get("step_log", {}).get("kl")
    print(
        f"gpu_full: OK {result['shape']} full finetune (no LoRA, beta {result['settings']['beta']:g}, reference "
        f"held): {result['params']:,} params, {memory}, KL {kl if kl is None else f'{kl:.2g}'}, "
        f"build {result['build_s']:.0f}s + launch to step 1 {result['launch_s']:.0f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
