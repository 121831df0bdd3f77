# syntax=docker/dockerfile:1
# MLflow tracking server for manifests/base/mlflow.yaml: mlflow (same version as the project's client),
# psycopg2 for the PostgreSQL backend store and boto3 to proxy artifacts to S3. Build from the
# repository root:
#   docker build -f images/mlflow.Dockerfile -t REGISTRY/dynamicrubric-mlflow:TAG .

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE}
# Must match mlflow-constraints.txt (tests/test_images.py checks it).
ARG MLFLOW_VERSION=3.17.2
ARG APP_UID=10001

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/app

RUN useradd --create-home --home-dir /home/app --uid "${APP_UID}" --user-group --shell /usr/sbin/nologin app

COPY images/mlflow-requirements.txt images/mlflow-constraints.txt /tmp/pins/
RUN pip install --no-cache-dir -c /tmp/pins/mlflow-constraints.txt -r /tmp/pins/mlflow-requirements.txt \
        "mlflow==${MLFLOW_VERSION}" \
    && rm -rf /tmp/pins

WORKDIR /home/app
USER ${APP_UID}:${APP_UID}
EXPOSE 5000
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
