"""bench/gpu_smoke.sh and its steps (bench/gpu_step.py, gpu_launch.py, gpu_full.py, gpu_sampler.py): the
parts that run without a GPU (`--check` runs every step for real at a tiny shape on the CPU), the 8B and
1.7B shapes' arithmetic, the peak-memory hook, the time budget, and the script's refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_full, gpu_step

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_smoke.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full_env, timeout=600, cwd=ROOT
    )


@pytest.mark.slow  # three training launches: about 60 s on 2 idle cores, 90 s on busy ones
def test_check_runs_one_grpo_step_of_the_tiny_shape_and_the_launch_on_the_cpu(tmp_path):
    # no wheel folder: --check must not need one (it says so in its line)
    done = _run("--check", GPU_SMOKE_WORK=str(tmp_path), GPU_SMOKE_WHEELS=str(tmp_path / "none"))
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith("gpu_smoke --check: OK (tiny dry run on the CPU in ")
    assert "tiny: 139,648 params" in line and f"no {tmp_path / 'none'} yet" in line
    # the real launch (bench/gpu_launch.py) on one gloo CPU process: FSDP2, a DCP checkpoint, a resume
    assert "launch dry run in " in line and "FSDP2 full finetune on 1 cpu rank via accelerate launch" in line
    assert (
        "; full finetune: tiny full finetune (no LoRA, beta 0.01, reference held): 139,648 params, " in line
    )
    assert (
        "; sampler: tiny on cpu, 1 x 16-token prompt, n 4, 8 new: engine " in line and "x (beside it)" in line
    )
    launch = json.loads((tmp_path / "gpu_launch.json").read_text())
    assert launch["ok"] and launch["problems"] == [], launch["problems"]
    assert "--config_file" in launch["command"] and "--cpu" not in launch["command"]
    assert "pytorch_model_fsdp_0/__0_0.distcp" in launch["checkpoint_files"]
    assert launch["reference_sum"] == pytest.approx(launch["starting_sum"], rel=1e-9)
    assert abs(launch["kl"]["1"]) < 1e-6 and sorted(launch["kl"]) == ["1", "2"]

    _check_full_finetune_dry_run(json.loads((tmp_path / "gpu_full.json").read_text()))
    _check_sampler_dry_run(json.loads((tmp_path / "gpu_sampler.json").read_text()))

    result = json.loads((tmp_path / "gpu_step.json").read_text())
    assert result["ok"] and result["problems"] == []
    assert (result["device"], result["shape"], result["params_on"]) == ("cpu", "tiny", ["cpu"])
    # 2 x (7 linears 36,864 + norms 160) + embedding and LM head 2 x 512 x 64 + final norm 64
    assert result["params"] == result["params_by_arithmetic"] == 139_648
    # r=16 x (in + out) over q, k, v, o, gate, up, down = 16 x 1,024 per layer, 2 layers
    assert result["lora_params"] == result["lora_params_by_arithmetic"] == 32_768
    settings = result["settings"]
    # the paper preset's train-policy settings for one process; one group of K=8 in two micro-batches of 4
    assert (
        settings["per_device_train_batch_size"],
        settings["gradient_checkpointing"],
        settings["beta"],
    ) == (
        4,
        True,
        0.01,
    )
    assert (settings["k"], settings["gradient_accumulation_steps"], settings["learning_rate"]) == (8, 2, 1e-6)
    assert (settings["lora_rank"], settings["max_completion_length_paper"]) == (16, 2048)
    assert "why_lora" in settings and "why_shorter" in settings
    # every phase was reached and has the plan's expectation beside it; no GPU numbers on the CPU
    assert list(result["phases"]) == list(gpu_step.PHASES) == list(result["expected"])
    for name, row in result["phases"].items():
        assert row["wall_s"] >= 0 and "peak_gib" not in row
        assert result["expected"][name]["expected_gib"] > 0
        assert result["expected"][name]["arithmetic"].startswith("bf16 weights 139,648 x 2 B")
    assert "activation_memory_gib 16" in result["expected"]["update"]["arithmetic"]
    # the step trained on rewards that differ within the group, on max-length completions
    log = result["step_log"]
    assert log["step"] == 1 and log["reward_std"] > 0 and log["completions/mean_length"] == 8
    assert {"torch", "transformers", "trl", "peft", "accelerate"} <= set(result["versions"])


def _check_full_finetune_dry_run(full: dict) -> None:
    """The full-finetune step's launch at the tiny shape: the launcher's FSDP command, no LoRA, a reference
    model, step 1 logged, and the worker's peak read by bench/peak_hook (RSS: no GPU here)."""
    assert full["ok"] and full["problems"] == [], full["problems"]
    assert (full["device"], full["shape"]) == ("cpu", "tiny")
    assert full["params"] == full["params_built"] == 139_648
    assert "--config_file" in full["command"] and "dynamicrubric.training.process" in full["command"]
    s = full["settings"]
    assert (s["lora_rank"], s["beta"], s["world_size"], s["k"], s["per_device_train_batch_size"]) == (
        0,
        0.01,
        1,
        8,
        4,
    )
    assert s["gradient_checkpointing"] is True and s["activation_memory_gib"] == 16
    # the plan: 139,648 x 16 B + the paper preset's 16 GiB; the reference's bf16 copy said beside it
    assert full["expected"]["plan_gib"] == pytest.approx(139_648 * 16 / 2**30 + 16)
    assert full["expected"]["not_in_plan"]["reference_bf16_gib"] == pytest.approx(139_648 * 2 / 2**30)
    measured = full["measured"]
    assert measured["rank"] == 0 and measured["peak_rss_gib"] > 0.1 and "peak_allocated_gib" not in measured
    assert "ratio" not in full  # no GPU memory to set against the plan on the CPU
    log = full["step_log"]
    assert (
        abs(log["kl"]) < 1e-6 and log["completions/mean_length"] == 8
    )  # the reference is the policy at step 0


def _check_sampler_dry_run(sampler: dict) -> None:
    """bench_rollout's two samplers on the same rows, at the tiny shape on the CPU."""
    assert sampler["ok"] and sampler["problems"] == []
    assert (sampler["device"], sampler["shape"], sampler["prompt_token_count"]) == ("cpu", "tiny", 16)
    assert sampler["settings"] == {"prompt_tokens": 16, "n": 4, "max_new_tokens": 8}
    assert 0 < sampler["engine_tokens"] <= 32 and 0 < sampler["model_generate_tokens"] <= 32
    ratio = sampler["engine_tokens_per_s"] / sampler["model_generate_tokens_per_s"]
    assert sampler["vs_model_generate"] == pytest.approx(ratio)


def test_the_1_7b_shape_and_its_full_finetune_plan():
    # Qwen3-1.7B, tied embeddings: 151,936 x 2,048 + 28 x 50,339,840 + 2,048 = 1.72B
    assert gpu_full.param_count(gpu_full.QWEN3_1_7B) == 1_720_574_976
    settings = gpu_full.step_settings(tiny=False)
    assert (settings["prompt_tokens"], settings["max_completion_length"], settings["k"]) == (512, 256, 8)
    plan = gpu_full.plan(1_720_574_976, settings)
    # config.training_state_gib: 16 B/param on one GPU = 25.64 GiB, + the paper preset's 16 GiB allowance
    assert round(plan["state_gib"], 2) == 25.64 and round(plan["plan_gib"], 2) == 41.64
    assert plan["arithmetic"].endswith("= 41.64 GiB")
    assert round(plan["not_in_plan"]["reference_bf16_gib"], 2) == 3.2
    # the step fails above 1.25 x the plan, as gpu_step's phases do
    assert gpu_full.over_plan(1.25 * 41.64, 41.64) == []
    assert gpu_full.over_plan(52.1, 41.64) == ["peak allocated 52.10 GiB > 1.25 x the plan's 41.64 GiB"]


def test_the_peak_hook_records_a_workers_peak_and_nothing_elsewhere(tmp_path):
    code = "import time; x = bytearray(64 * 2**20); time.sleep(0.6)"  # a 64 MiB peak, 3 polls
    env = {**os.environ, "PYTHONPATH": str(gpu_full.HOOK), gpu_full.PEAK_ENV: str(tmp_path / "peak")}
    env.pop("LOCAL_RANK", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert not (tmp_path / "peak").exists()  # not a torchrun worker: nothing
    subprocess.run(
        [sys.executable, "-c", code], env={**env, "LOCAL_RANK": "0", "RANK": "3"}, check=True, timeout=60
    )
    peak = json.loads((tmp_path / "peak" / "peak-rank3.json").read_text())
    assert peak["rank"] == 3 and peak["peak_rss_gib"] > 64 / 1024
    assert "peak_allocated_gib" not in peak  # torch never imported: no GPU numbers


def test_the_steps_timeouts_fit_the_time_budget(tmp_path):
    text = SCRIPT.read_text()
    defaults = {
        name: int(text.split(f'{name}="${{GPU_SMOKE_{name}:-', 1)[1].split("}", 1)[0])
        for name in ("STEP_TIMEOUT", "LAUNCH_TIMEOUT", "FULL_TIMEOUT", "SAMPLER_TIMEOUT")
    }
    setup = int(text.split("SETUP_S=", 1)[1].split()[0])
    assert setup + sum(defaults.values()) <= int(text.split("MAX_TOTAL_S=", 1)[1].split()[0]) == 480
    # one step's longer timeout past the 8 minutes: refused before anything runs
    done = _run("--check", GPU_SMOKE_FULL_TIMEOUT="200", GPU_SMOKE_WORK=str(tmp_path / "work"))
    assert (done.returncode, done.stdout.strip()) == (
        1,
        "gpu_smoke: FAIL at budget: setup 30s + launch 100s + full finetune 200s + sampler 70s + grpo step 160s "
        "= 560s > 480s",
    )
    assert not (tmp_path / "work").exists()


def test_the_8b_shape_and_its_memory_plan():
    assert gpu_step.param_count(gpu_step.QWEN3_8B) == 8_190_735_360  # Qwen3-8B: 8.19B
    assert gpu_step.lora_param_count(gpu_step.QWEN3_8B, 16) == 43_646_976
    settings = gpu_step.step_settings(tiny=False)
    settings.pop("_train_config")
    plan = {
        name: round(row["expected_gib"], 2)
        for name, row in gpu_step.expectations(gpu_step.QWEN3_8B, settings).items()
    }
    # bf16 weights 15.26 GiB; LoRA fp32 weights 0.16, with grads and Adam 0.65; KV cache 8 x 1,536 tokens
    # x 144 KiB = 1.69; the paper preset's activation allowance 16
    assert plan == {
        "build": 15.42,
        "generation": 17.11,
        "reference": 31.42,
        "reward": 15.91,
        "update": 31.91,
        "end_of_step": 15.91,
    }


def test_the_synthetic_tokenizer_decodes_every_id_of_qwen3s_vocabulary():
    vocab = gpu_step.QWEN3_8B["vocab_size"]
    tokenizer = gpu_step.build_tokenizer(vocab)
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    assert len(tokenizer) == vocab and len(set(tokens)) == vocab and None not in tokens
    assert tokenizer.eos_token_id == vocab - 1
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "w1 w2"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nw1 w2<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids and len(ids) == 7
    # the project's engines take it (bench/gpu_sampler.py wraps it in HFEngine): yes/no are one token each
    from dynamicrubric.engines.base import answer_token_ids

    assert answer_token_ids(tokenizer) == ([3, 4, 5], [6, 7, 8])


def _wheel_folder(path: Path, leave_out: str = "") -> Path:
    path.mkdir()
    for name in _needed_wheels():
        if name != leave_out:
            (path / f"{name}-1.0-py3-none-any.whl").write_bytes(b"")  # the script checks names only here
    return path


def _needed_wheels() -> list[str]:
    text = SCRIPT.read_text()
    return text.split('NEEDED="', 1)[1].split('"', 1)[0].split()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA GPU")
def test_without_a_gpu_or_wheels_it_stops_before_building_anything(tmp_path):
    assert {"trl", "datasets", "pydantic_core", "pip", "dynamicrubric"} <= set(_needed_wheels())
    work = tmp_path / "work"
    wheels = _wheel_folder(tmp_path / "wheels")
    done = _run(GPU_SMOKE_WHEELS=str(wheels), GPU_SMOKE_WORK=str(work))
    assert (done.returncode, done.stdout.strip()) == (
        1,
        "gpu_smoke: FAIL at gpu: no NVIDIA GPU visible (nvidia-smi -L)",
    )
    assert not work.exists()

    partial = _wheel_folder(tmp_path / "partial", leave_out="trl")
    done = _run(GPU_SMOKE_WHEELS=str(partial), GPU_SMOKE_WORK=str(work))
    assert done.stdout.strip() == (
        f"gpu_smoke: FAIL at inputs: no wheel of: trl in {partial} (run bench/gpu_smoke.sh --prepare)"
    )
    done = _run(GPU_SMOKE_WHEELS=str(tmp_path / "absent"))
    assert done.stdout.strip().startswith(
        f"gpu_smoke: FAIL at inputs: no wheel folder {tmp_path / 'absent'} "
    )
    assert (
        _run("--bogus")
        .stdout.strip()
        .endswith("unknown argument --bogus (expected nothing, --prepare or --check)")
    )


def test_a_phase_above_the_tolerance_fails_the_step():
    settings = gpu_step.step_settings(tiny=True)
    settings.pop("_train_config")
    expected = gpu_step.expectations(gpu_step.TINY, settings)
    counts = {"params": 139_648, "params_by_arithmetic": 139_648, "lora_params": 32_768}
    result = {**counts, "lora_params_by_arithmetic": 32_768, "expected": expected}
    limit = gpu_step.TOLERANCE * expected["update"]["expected_gib"]
    result["phases"] = {name: {"wall_s": 1.0, "peak_gib": 0.0} for name in gpu_step.PHASES}
    result["phases"]["update"]["peak_gib"] = limit * 0.99
    assert gpu_step.verdict(result) == []
    result["phases"]["update"]["peak_gib"] = limit * 1.01
    (problem,) = gpu_step.verdict(result)
    assert problem.startswith(f"update peaked at {limit * 1.01:.2f} GiB > 1.25 x expected ")
    del result["phases"]["reward"]
    assert "phases never reached: reward" in gpu_step.verdict(result)
