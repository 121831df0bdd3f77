# syntax=docker/dockerfile:1
# GPU image for the model stages (rollout, rubrics, judge, train-evaluator, train-policy): CUDA runtime,
# vLLM with the torch and transformers it pins, the project, kfp for the component executor and
# mlflow-skinny as the tracking client. Build from the repository root:
#   docker build -f images/gpu.Dockerfile -t REGISTRY/dynamicrubric-gpu:TAG .
# Python packages are pinned by gpu-constraints.txt (compiled from gpu-requirements.txt, see README.md).

ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# The project as a wheel, built apart so that no source tree or build tool lands in the final image.
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY components ./components
COPY pipelines ./pipelines
RUN pip install --no-cache-dir --no-deps --no-build-isolation "setuptools==80.9.0" \
    && pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM ${CUDA_IMAGE}
# Versions that must match gpu-constraints.txt (tests/test_images.py checks it): change them by
# editing gpu-requirements.txt and recompiling the constraints, not here alone.
ARG VLLM_VERSION=0.31.0
ARG MLFLOW_VERSION=3.17.2
# kfp is installed without its dependencies: the component executor needs nothing else.
ARG KFP_VERSION=2.17.3
ARG APP_UID=10001

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    HOME=/home/app \
    HF_HOME=/home/app/.cache/huggingface \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1

# Ubuntu 24.04's Python 3.12, plus a C compiler and Python headers because Triton (used by vLLM and
# torch.compile) builds small launcher modules at run time. Not pinned to package revisions: Ubuntu's
# archive drops superseded revisions, so an exact pin breaks the build within weeks; the pinned base
# tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv "${VIRTUAL_ENV}" \
    && useradd --create-home --home-dir /home/app --uid "${APP_UID}" --user-group --shell /usr/sbin/nologin app

COPY images/gpu-requirements.txt images/gpu-constraints.txt images/benchmarks.txt /tmp/pins/
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir -c /tmp/pins/gpu-constraints.txt -r /tmp/pins/gpu-requirements.txt \
        "vllm==${VLLM_VERSION}" "mlflow-skinny==${MLFLOW_VERSION}" \
    && pip install --no-cache-dir --no-deps "kfp==${KFP_VERSION}" \
    && pip install --no-cache-dir --no-deps --require-hashes -r /tmp/pins/benchmarks.txt \
    && pip install --no-cache-dir --no-deps /tmp/wheels/dynamicrubric-*.whl \
    && rm -rf /tmp/pins /tmp/wheels

WORKDIR /home/app
USER ${APP_UID}:${APP_UID}
CMD ["dynrubric", "--help"]
