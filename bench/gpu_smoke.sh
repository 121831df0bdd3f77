#!/usr/bin/env bash
# On one GPU, offline: first the real training launch (bench/gpu_launch.py: launch_command -> accelerate launch
# with accelerate/fsdp.yaml, world size 1, a full-finetune FSDP2 step of tiny-random with a reference model, a
# DCP checkpoint, a kill and a resume, the export; the reference must equal the policy at step 0), then one
# GRPO step of a Qwen3-8B-shaped model with its memory against the GPU memory plan (bench/gpu_step.py). The GPU machine has no network and gets only this working tree (64 MiB at most); it
# has torch, transformers, accelerate and peft, so only the small wheels it lacks travel, in .gpu-wheels/
# (ignored by git: carry it): trl, datasets, pydantic, their small dependencies, pip, and this project.
#
#   bench/gpu_smoke.sh --prepare   # here, with network: fills .gpu-wheels/ and prints its size
#   bench/gpu_smoke.sh             # on the GPU machine, from the repository root: under 10 minutes
#   bench/gpu_smoke.sh --check     # anywhere, no GPU: syntax, inputs, CPU dry runs of the launch and the tiny shape
#
# It prints one line: `gpu_smoke: PASS ...` or `gpu_smoke: FAIL at <step>: <why>`. The step's JSON goes to
# $GPU_SMOKE_JSON, else $OUT/gpu_smoke.json when $OUT is set, else bench/results/gpu_smoke.json; the launch's
# JSON (gpu_launch.json) and the log (gpu_smoke.log) beside it.
# Knobs (environment): PYTHON (the interpreter: python3 on the GPU machine, .venv/bin/python for --prepare
# and --check), GPU_SMOKE_WHEELS (default .gpu-wheels), GPU_SMOKE_WORK (scratch for the venv, default a new
# temporary folder), GPU_SMOKE_STEP_TIMEOUT (seconds for the step, default 420), GPU_SMOKE_LAUNCH_TIMEOUT
# (seconds for the launch, default 150): 10 minutes in all at most.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS="${GPU_SMOKE_WHEELS:-$ROOT/.gpu-wheels}"
STEP_TIMEOUT="${GPU_SMOKE_STEP_TIMEOUT:-420}"
LAUNCH_TIMEOUT="${GPU_SMOKE_LAUNCH_TIMEOUT:-150}"
# The distributions the GPU machine lacks (as wheel file names spell them), pip to install them with
# (the machine's python3 may have neither pip nor ensurepip), and this project.
NEEDED="trl datasets dill multiprocess pydantic pydantic_core annotated_types typing_inspection pip dynamicrubric"
MAX_WHEELS_MIB=40 # the tree and the wheels travel in 64 MiB together
STARTED=$SECONDS
STEP="setup"

fail() {
    echo "gpu_smoke: FAIL at $STEP: $*"
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
    for f in bench/gpu_step.py bench/gpu_launch.py bench/__init__.py src/dynamicrubric/presets/paper.yaml; do
        [ -f "$f" ] || fail "$f is missing"
    done
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
    PY=$(local_python)
    STEP="imports"
    # The project's modules that the step imports must need nothing the GPU machine lacks.
    lacking=$("$PY" -c "import sys, bench.gpu_step as g, bench.gpu_launch, dynamicrubric.training.grpo, dynamicrubric.training.launcher, dynamicrubric.infra.config
print(' '.join(m for m in g.LACKING if m in sys.modules))") || fail "$PY cannot import bench.gpu_step and dynamicrubric.training"
    [ -z "$lacking" ] || fail "dynamicrubric.training imports $lacking, which the GPU machine lacks"
    STEP="dry run"
    WORK=$(work_dir)
    [ -n "${GPU_SMOKE_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT
    dry_started=$SECONDS
    "$PY" -m bench.gpu_step --device cpu --tiny --out "$WORK/gpu_step.json" >"$WORK/gpu_step.log" 2>&1 \
        || fail "$(grep "^gpu_step:" "$WORK/gpu_step.log" | tail -n 1 | sed "s/^gpu_step: FAIL: //" || true) (log: $WORK/gpu_step.log)"
    STEP="launch dry run"
    launch_started=$SECONDS
    # The same launch on one gloo CPU process (FSDP2 through training/fsdp_hook.py, as on the GPU)
    timeout "$LAUNCH_TIMEOUT" "$PY" -m bench.gpu_launch --work "$WORK/launch" --out "$WORK/gpu_launch.json" \
        >"$WORK/gpu_launch.log" 2>&1 \
        || fail "$(grep "^gpu_launch:" "$WORK/gpu_launch.log" | tail -n 1 | sed "s/^gpu_launch: FAIL: //" || true) (log: $WORK/gpu_launch.log)"
    echo "gpu_smoke --check: OK (tiny dry run on the CPU in $((launch_started - dry_started))s: $(grep '^gpu_step: OK' "$WORK/gpu_step.log" | cut -c14-); launch dry run in $((SECONDS - launch_started))s: $(grep '^gpu_launch: OK' "$WORK/gpu_launch.log" | cut -c15-); $wheels)"
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

STEP="launch"
launch_started=$SECONDS
rc=0
LAUNCH_JSON="$(dirname "$OUT_JSON")/gpu_launch.json"
timeout "$LAUNCH_TIMEOUT" "$VPY" -m bench.gpu_launch --work "$WORK/launch" --out "$LAUNCH_JSON" >>"$LOG" 2>&1 || rc=$?
[ "$rc" -ne 124 ] || fail "bench/gpu_launch.py ran past ${LAUNCH_TIMEOUT}s (see $LOG)"
launched=$(grep '^gpu_launch:' "$LOG" | tail -n 1 || true)
[ "$rc" -eq 0 ] || fail "${launched:+${launched#gpu_launch: FAIL: }}${launched:-bench/gpu_launch.py exited with $rc} (see $LOG)"
launch_s=$((SECONDS - launch_started))

STEP="grpo step"
step_started=$SECONDS
rc=0
timeout "$STEP_TIMEOUT" "$VPY" -m bench.gpu_step --out "$OUT_JSON" >>"$LOG" 2>&1 || rc=$?
[ "$rc" -ne 124 ] || fail "bench/gpu_step.py ran past ${STEP_TIMEOUT}s (see $LOG)"
result=$(grep '^gpu_step:' "$LOG" | tail -n 1 || true)
[ "$rc" -eq 0 ] || fail "${result:+${result#gpu_step: FAIL: }}${result:-bench/gpu_step.py exited with $rc} (see $LOG)"
echo "gpu_smoke: PASS ${result#gpu_step: OK } step+build $((SECONDS - step_started))s; launch ${launched#gpu_launch: OK } (${launch_s}s); total $((SECONDS - STARTED))s json=$OUT_JSON"
