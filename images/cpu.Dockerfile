# syntax=docker/dockerfile:1
# CPU image for the light stages (aggregate, evaluate without a model, the pipeline's bookkeeping):
# Python 3.11, the CPU build of torch and the project with all its dependencies. Build from the
# repository root:
#   docker build -f images/cpu.Dockerfile -t REGISTRY/dynamicrubric-cpu:TAG .
# Python packages are pinned by cpu-constraints.txt (compiled from pyproject.toml, see README.md).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY components ./components
COPY pipelines ./pipelines
RUN pip install --no-cache-dir --no-deps --no-build-isolation "setuptools==80.9.0" \
    && pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
# Must match cpu-constraints.txt (tests/test_images.py checks it).
ARG TORCH_VERSION=2.13.0
# The CPU wheel index: the default PyPI torch is a CUDA build several GB larger.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG APP_UID=10001

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/app

RUN useradd --create-home --home-dir /home/app --uid "${APP_UID}" --user-group --shell /usr/sbin/nologin app

COPY images/cpu-constraints.txt images/benchmarks.txt /tmp/pins/
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir -c /tmp/pins/cpu-constraints.txt /tmp/wheels/dynamicrubric-*.whl \
    && pip install --no-cache-dir --no-deps --require-hashes -r /tmp/pins/benchmarks.txt \
    && rm -rf /tmp/pins /tmp/wheels

WORKDIR /home/app
USER ${APP_UID}:${APP_UID}
CMD ["dynrubric", "--help"]
