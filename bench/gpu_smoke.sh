#!/usr/bin/env bash
# On one GPU, offline, four steps:
#   1. launch: the real training launch (bench/gpu_launch.py: launch_command -> accelerate launch with
#      accelerate/fsdp.yaml, world size 1, a full-finetune FSDP2 step of tiny-random with a reference model, a
#      DCP checkpoint, a kill and a resume, the export; the reference must equal the policy at step 0);
#   2. full finetune: the same launch path at a Qwen3-1.7B shape (bench/gpu_full.py: random bf16 weights, no
#      LoRA, beta > 0 so TRL holds a reference model, the paper preset's micro-batch and checkpointing), the
#      training process's peak GPU memory against the memory plan's full-finetune arithmetic
#      (config.training_state_gib + activation_memory_gib; fails above 1.25x);
#   3. sampler: the project's HFEngine.generate against transformers' model.generate on the same prompt, n and
#      length in the same process (bench/gpu_sampler.py, bench_rollout's comparison): a Qwen3-8B shape, one
#      512-token prompt, n = 8, 256 new tokens; tokens/s of both and the ratio (a measurement, no bound);
#   4. grpo step: one GRPO step of a Qwen3-8B-shaped model with LoRA, each phase's memory against the plan
#      (bench/gpu_step.py).
# The GPU machine has no network and gets only this working tree (64 MiB at most); it has torch, transformers,
# accelerate and peft, so only the small wheels it lacks travel, in .gpu-wheels/ (ignored by git: carry it):
# trl, datasets, pydantic, their small dependencies, pip, and this project.
#
#   bench/gpu_smoke.sh --prepare   # here, with network: fills .gpu-wheels/ and prints its size
#   bench/gpu_smoke.sh             # on the GPU machine, from the repository root: under 8 minutes
#   bench/gpu_smoke.sh --check     # anywhere, no GPU: syntax, inputs, the time budget, CPU dry runs of every
#                                  # step at a tiny shape (the launches on one gloo process)
#
# It prints one line: `gpu_smoke: PASS ...` (each step's numbers and seconds) or `gpu_smoke: FAIL at <step>:
# <why>`. The GRPO step's JSON goes to $GPU_SMOKE_JSON, else $OUT/gpu_smoke.json when $OUT is set, else
# bench/results/gpu_smoke.json; the other steps' JSONs (gpu_launch.json, gpu_full.json, gpu_sampler.json) and
# the log (gpu_smoke.log) beside it. A step that fails stops the run; the JSONs of the steps before it stay.
# Knobs (environment): PYTHON (the interpreter: python3 on the GPU machine, .venv/bin/python for --prepare
# and --check), GPU_SMOKE_WHEELS (default .gpu-wheels), GPU_SMOKE_WORK (scratch for the venv, default a new
# temporary folder), and each step's seconds at most: GPU_SMOKE_LAUNCH_TIMEOUT (default 100),
# GPU_SMOKE_FULL_TIMEOUT (120), GPU_SMOKE_SAMPLER_TIMEOUT (70), GPU_SMOKE_STEP_TIMEOUT (160, the GRPO step).
# With SETUP_S for the venv, the install and the import check, they must sum to at most MAX_TOTAL_S (480 s:
# the lent GPU's 15 minutes hold the run and a rerun); the script refuses larger ones before it starts.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS="${GPU_SMOKE_WHEELS:-$ROOT/.gpu-wheels}"
STEP_TIMEOUT="${GPU_SMOKE_STEP_TIMEOUT:-160}"
LAUNCH_TIMEOUT="${GPU_SMOKE_LAUNCH_TIMEOUT:-100}"
FULL_TIMEOUT="${GPU_SMOKE_FULL_TIMEOUT:-120}"
SAMPLER_TIMEOUT="${GPU_SMOKE_SAMPLER_TIMEOUT:-70}"
SETUP_S=30     # venv, offline install and the import check: about 20 s
MAX_TOTAL_S=480
# The distributions the GPU machine lacks (as wheel file names spell them), pip to install them with
# (the machine's python3 may have neither pip nor ensurepip), and this project.
NEEDED="trl datasets dill multiprocess pydantic pydantic_core annotated_types typing_inspection pip dynamicrubric"
MAX_WHEELS_MIB=40 # the tree and the wheels travel in 64 MiB together
STARTED=$SECONDS
STEP="setup"

fail() {
    echo "gpu_smoke: FAIL at $STEP: $*"
    [ -z "${BACKGROUND:-}" ] || kill "$BACKGROUND" 2>/dev/null || true # --check's sampler dry run
    exit 1
}

local_python() {
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; elif [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"; else echo python3; fi
}

work_dir() {
    if [ -n "${GPU_SMOKE_WORK:-}" ]; then
        mkdir -p "$GPU_SMOKE_WORK"
        echo "$GPU_SMOKE_WORK"
    else
        mktemp -d "${TMPDIR:-/tmp}/gpu-smoke.XXXXXX"
    fi
}

# The wheel folder holds one wheel of every needed distribution; prints what is missing, else nothing.
missing_wheels() {
    local name missing=""
    for name in $NEEDED; do
        compgen -G "$WHEELS/$name-*.whl" >/dev/null || missing="$missing $name"
    done
    echo "${missing# }"
}

wheels_mib() {
    du -sm "$WHEELS" | cut -f1
}

check_files() {
    for f in bench/gpu_step.py bench/gpu_launch.py bench/gpu_full.py bench/gpu_sampler.py bench/bench_rollout.py \
        bench/peak_hook/sitecustomize.py bench/__init__.py src/dynamicrubric/presets/paper.yaml; do
        [ -f "$f" ] || fail "$f is missing"
    done
}

# Every step's timeout, and the setup's allowance, within MAX_TOTAL_S: a run that fails does so in time.
check_budget() {
    local total=$((SETUP_S + LAUNCH_TIMEOUT + FULL_TIMEOUT + SAMPLER_TIMEOUT + STEP_TIMEOUT))
    [ "$total" -le "$MAX_TOTAL_S" ] || fail "setup ${SETUP_S}s + launch ${LAUNCH_TIMEOUT}s + full finetune \
${FULL_TIMEOUT}s + sampler ${SAMPLER_TIMEOUT}s + grpo step ${STEP_TIMEOUT}s = ${total}s > ${MAX_TOTAL_S}s"
}

# Runs one step's module under its timeout into the log; its last `<name>: ...` line, less the prefix, goes
# to $RESULT; fails the run (at $STEP) when the module fails or runs past its time.
run_step() {
    local name=$1 limit=$2 log=$3 rc=0
    shift 3
    timeout "$limit" "$@" >>"$log" 2>&1 || rc=$?
    step_result "$name" "$limit" "$log" "$rc"
}

step_result() {
    local name=$1 limit=$2 log=$3 rc=$4 line
    [ "$rc" -ne 124 ] || fail "bench/$name.py ran past ${limit}s (see $log)"
    line=$(grep "^$name:" "$log" | tail -n 1 || true)
    [ "$rc" -eq 0 ] || fail "${line:+${line#"$name: FAIL: "}}${line:-bench/$name.py exited with $rc} (see $log)"
    RESULT=${line#"$name: OK "}
}

case "${1:-}" in
--prepare)
    # ---- here, with network: the wheels for Python 3.12 on x86-64 Linux, at this venv's versions
    STEP="prepare"
    PY=$(local_python)
    version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" || fail "$PY has no $1"; }
    pins=(trl==1.16.0)
    for dist in datasets dill multiprocess pydantic pydantic-core annotated-types typing-inspection pip; do
        pins+=("$dist==$(version "$dist")")
    done
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS"
    # --no-deps: every other dependency is already on the GPU machine; binaries only (pydantic-core).
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 -d "$WHEELS" "${pins[@]}" \
        || fail "pip download ${pins[*]} failed"
    # The project's wheel from a clean copy of its sources: build/ in the tree may hold stale files.
    SRC=$(mktemp -d "${TMPDIR:-/tmp}/gpu-smoke-src.XXXXXX")
    trap 'rm -rf "$SRC"' EXIT
    cp -r pyproject.toml README.md src components pipelines "$SRC/"
    "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$WHEELS" "$SRC" \
        >/dev/null || fail "pip wheel of this project failed"
    missing=$(missing_wheels)
    [ -z "$missing" ] || fail "no wheel of: $missing in $WHEELS"
    ls -l "$WHEELS" | awk 'NR > 1 {printf "  %8.2f MiB  %s\n", $5 / 1048576, $9}'
    size=$(wheels_mib)
    [ "$size" -le "$MAX_WHEELS_MIB" ] || fail "$WHEELS is $size MiB, over $MAX_WHEELS_MIB MiB"
    echo "gpu_smoke --prepare: OK ($(du -sh "$WHEELS" | cut -f1) in $(ls "$WHEELS" | wc -l) wheels in $WHEELS: ${pins[*]} dynamicrubric)"
    exit 0
    ;;
--check)
    # ---- anywhere: what can be verified without a GPU
    STEP="syntax"
    bash -n "${BASH_SOURCE[0]}" || fail "bash -n found a syntax error"
    STEP="inputs"
    check_files
    if [ -d "$WHEELS" ]; then
        missing=$(missing_wheels)
        [ -z "$missing" ] || fail "no wheel of: $missing in $WHEELS (run bench/gpu_smoke.sh --prepare)"
        wheels="$(wheels_mib) MiB of wheels in $WHEELS"
    else
        wheels="no $WHEELS yet (bench/gpu_smoke.sh --prepare makes it)"
    fi
    STEP="budget"
    check_budget
    PY=$(local_python)
    STEP="imports"
    # The project's modules that the step imports must need nothing the GPU machine lacks.
    lacking=$("$PY" -c "import sys, bench.gpu_step as g, bench.gpu_launch, bench.gpu_full, bench.gpu_sampler, dynamicrubric.training.grpo, dynamicrubric.training.launcher, dynamicrubric.infra.config
print(' '.join(m for m in g.LACKING if m in sys.modules))") || fail "$PY cannot import bench's GPU steps and dynamicrubric.training"
    [ -z "$lacking" ] || fail "dynamicrubric.training imports $lacking, which the GPU machine lacks"
    STEP="dry run"
    WORK=$(work_dir)
    [ -n "${GPU_SMOKE_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT
    # One model cache for every launch: tiny-random (the reward's verifier) is built once, not per step.
    export DYNRUBRIC_CACHE="$WORK/cache"
    dry_started=$SECONDS
    "$PY" -m bench.gpu_step --device cpu --tiny --out "$WORK/gpu_step.json" >"$WORK/gpu_step.log" 2>&1 \
        || fail "$(grep "^gpu_step:" "$WORK/gpu_step.log" | tail -n 1 | sed "s/^gpu_step: FAIL: //" || true) (log: $WORK/gpu_step.log)"
    STEP="launch dry run"
    launch_started=$SECONDS
    # The same launch on one gloo CPU process (FSDP2 through training/fsdp_hook.py, as on the GPU)
    timeout "$LAUNCH_TIMEOUT" "$PY" -m bench.gpu_launch --work "$WORK/launch" --out "$WORK/gpu_launch.json" \
        >"$WORK/gpu_launch.log" 2>&1 \
        || fail "$(grep "^gpu_launch:" "$WORK/gpu_launch.log" | tail -n 1 | sed "s/^gpu_launch: FAIL: //" || true) (log: $WORK/gpu_launch.log)"
    launch_s=$((SECONDS - launch_started))
    # The sampler's dry run beside the full finetune's (one core each; a CPU dry run's tokens/s mean nothing):
    # 6 s less of --check, which tests/test_gpu_smoke.py runs.
    started=$SECONDS
    timeout "$SAMPLER_TIMEOUT" "$PY" -m bench.gpu_sampler --tiny --out "$WORK/gpu_sampler.json" \
        >"$WORK/gpu_sampler.log" 2>&1 &
    BACKGROUND=$!
    STEP="full finetune dry run"
    # The full-finetune step's launch at the tiny shape, its peak read by bench/peak_hook in the worker (RSS here)
    run_step gpu_full "$FULL_TIMEOUT" "$WORK/gpu_full.log" \
        "$PY" -m bench.gpu_full --tiny --work "$WORK/full" --out "$WORK/gpu_full.json"
    full="$RESULT ($((SECONDS - started))s)"
    STEP="sampler dry run"
    rc=0
    wait "$BACKGROUND" || rc=$?
    BACKGROUND=""
    step_result gpu_sampler "$SAMPLER_TIMEOUT" "$WORK/gpu_sampler.log" "$rc"
    sampler="$RESULT (beside it)"
    echo "gpu_smoke --check: OK (tiny dry run on the CPU in $((launch_started - dry_started))s: $(grep '^gpu_step: OK' "$WORK/gpu_step.log" | cut -c14-); launch dry run in ${launch_s}s: $(grep '^gpu_launch: OK' "$WORK/gpu_launch.log" | cut -c15-); full finetune: $full; sampler: $sampler; $wheels)"
    exit 0
    ;;
"") ;;
*) fail "unknown argument $1 (expected nothing, --prepare or --check)" ;;
esac

# ---- on the GPU machine
STEP="inputs"
check_files
[ -d "$WHEELS" ] || fail "no wheel folder $WHEELS (run bench/gpu_smoke.sh --prepare where there is network, and carry it)"
missing=$(missing_wheels)
[ -z "$missing" ] || fail "no wheel of: $missing in $WHEELS (run bench/gpu_smoke.sh --prepare)"
STEP="budget"
check_budget
STEP="gpu"
{ command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; } || fail "no NVIDIA GPU visible (nvidia-smi -L)"
if [ -n "${GPU_SMOKE_JSON:-}" ]; then
    OUT_JSON="$GPU_SMOKE_JSON"
elif [ -n "${OUT:-}" ]; then
    OUT_JSON="$OUT/gpu_smoke.json"
else
    OUT_JSON="$ROOT/bench/results/gpu_smoke.json"
fi
mkdir -p "$(dirname "$OUT_JSON")"
LOG="$(dirname "$OUT_JSON")/gpu_smoke.log"

STEP="venv"
PY="${PYTHON:-python3}"
WORK=$(work_dir)
VENV="$WORK/venv"
# --system-site-packages for the machine's torch and the rest; --without-pip since ensurepip may be absent.
"$PY" -m venv --without-pip --system-site-packages "$VENV" >"$LOG" 2>&1 || fail "$PY -m venv failed (see $LOG)"
VPY="$VENV/bin/python"
# When the machine's python3 is itself a venv (/opt/torch/.venv), --system-site-packages reaches the base
# interpreter's packages, not that venv's: a .pth file adds its site-packages (after ours, which win).
"$PY" -c "import site; print('\n'.join(site.getsitepackages()))" \
    >"$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/gpu-smoke-base.pth" \
    || fail "cannot list $PY's site-packages"
STEP="install"
PIP_WHEEL=$(compgen -G "$WHEELS/pip-*.whl" | head -n 1)
# pip runs from its own wheel (a zip on sys.path); --no-deps: the rest is on the machine already.
"$VPY" "$PIP_WHEEL/pip" install -q --disable-pip-version-check --no-index --no-deps "$WHEELS"/*.whl \
    >>"$LOG" 2>&1 || fail "pip install from $WHEELS failed (see $LOG)"
STEP="cuda"
"$VPY" -c "import torch, transformers, accelerate, peft, trl, datasets, pydantic, dynamicrubric, sys
sys.exit(0 if torch.cuda.is_available() else 3)" >>"$LOG" 2>&1 \
    || fail "the venv cannot import the training stack or torch sees no CUDA device (see $LOG)"

export DYNRUBRIC_CACHE="$WORK/cache" # tiny-random, the launches' reward verifier, built once
JSON_DIR=$(dirname "$OUT_JSON")
STEP="launch"
started=$SECONDS
run_step gpu_launch "$LAUNCH_TIMEOUT" "$LOG" "$VPY" -m bench.gpu_launch --work "$WORK/launch" --out "$JSON_DIR/gpu_launch.json"
launched="$RESULT ($((SECONDS - started))s)"

# The two new measurements before the long GRPO step: a step that runs out of time leaves theirs.
STEP="full finetune"
started=$SECONDS
run_step gpu_full "$FULL_TIMEOUT" "$LOG" "$VPY" -m bench.gpu_full --work "$WORK/full" --out "$JSON_DIR/gpu_full.json"
full="$RESULT ($((SECONDS - started))s)"

STEP="sampler"
started=$SECONDS
run_step gpu_sampler "$SAMPLER_TIMEOUT" "$LOG" "$VPY" -m bench.gpu_sampler --out "$JSON_DIR/gpu_sampler.json"
sampler="$RESULT ($((SECONDS - started))s)"

STEP="grpo step"
started=$SECONDS
run_step gpu_step "$STEP_TIMEOUT" "$LOG" "$VPY" -m bench.gpu_step --out "$OUT_JSON"
echo "gpu_smoke: PASS $RESULT step+build $((SECONDS - started))s; launch $launched; full finetune $full; sampler $sampler; total $((SECONDS - STARTED))s json=$OUT_JSON"
