"""bench/gpu_smoke.sh: the parts that run without a GPU (`--check`), and its refusals."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_smoke.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full_env, timeout=300, cwd=ROOT
    )


def test_check_validates_the_script_and_compiles_its_config(tmp_path):
    done = _run("--check", GPU_SMOKE_WORK=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith("gpu_smoke --check: OK (vllm==0.31.0, ")
    # the config it would run: one round, one shard, SmolLM2 in every role on vLLM, tiny's sizes
    from dynamicrubric.config import load_config

    cfg = load_config(tmp_path / "smoke.yaml")
    assert (cfg.preset, cfg.pipeline.rounds, cfg.pipeline.shards) == ("tiny", 1, 1)
    assert {cfg.models.policy, cfg.models.generator, cfg.models.verifier} == {"smollm2-135m-instruct"}
    assert (cfg.engine.engine, cfg.engine.device) == ("vllm", "cuda")
    assert (tmp_path / "smoke-pipeline.yaml").stat().st_size > 0


def test_check_names_a_broken_input(tmp_path):
    dockerfile = tmp_path / "gpu.Dockerfile"
    dockerfile.write_text("FROM scratch\nARG VLLM_VERSION=0.33.0\n")  # no MLFLOW_VERSION / KFP_VERSION
    done = _run("--check", GPU_DOCKERFILE=str(dockerfile), GPU_SMOKE_WORK=str(tmp_path))
    assert done.returncode == 1
    assert done.stdout.strip() == (
        f"gpu_smoke: FAIL at inputs: {dockerfile} lacks one of ARG VLLM_VERSION, MLFLOW_VERSION, KFP_VERSION"
    )


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA GPU")
def test_without_a_gpu_it_stops_before_building_anything(tmp_path):
    done = _run(GPU_VENV=str(tmp_path / "venv"))
    assert done.returncode == 1
    assert done.stdout.strip() == "gpu_smoke: FAIL at inputs: no NVIDIA GPU visible (nvidia-smi -L)"
    assert not (tmp_path / "venv").exists()
    assert _run("--bogus").stdout.strip().endswith("unknown argument --bogus (expected nothing or --check)")
