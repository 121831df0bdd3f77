"""MLflow lineage: one parent run per pipeline run, a nested run per round, a nested run per stage.

The pipeline's first task creates the parent run (params: the whole config), started when that
task's process started. A round's run is created by the first of its tasks to reach MLflow, with
that task's start as its own (MLflow cannot move a run's start later), and every stage task opens its
own run nested under its round's, found by the round tag; parallel first tasks that each created one
are merged into the earliest (`tracking_runs._round_run`). Each stage run's end moves its round's and
the parent's end on (`tracking_runs.extend_spans`), so the UI's durations span the round's and the
pipeline's tasks. Stages log their artifacts as MLflow datasets whose source is the artifact URI,
their numbers as metrics, and each checkpoint as an external LoggedModel pointing at its URI.

Tracking is off when the tracking URI is empty. The URI comes from `MLFLOW_TRACKING_URI` when set
(on a cluster), else from `pipeline.mlflow_tracking_uri` in the config.

This module holds what every use of the store shares: the tracking URI and its checks, the tags that
place a run in the lineage, artifact URIs, and the lookups of runs and models already logged. Creating
the runs (parent, round, stage) and keeping their spans is `tracking_runs`; what a stage records in
its run (datasets, params, metrics, models, traces) is `tracking_records`.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from dynamicrubric.infra.config import Config

ROUND_TAG = "dynrubric.round"
STAGE_TAG = "dynrubric.stage"
PIPELINE_TAG = "dynrubric.pipeline_run"
NAME_TAG = "dynrubric.name"  # a dataset input's name in its stage's declaration
POSITION_TAG = "dynrubric.position"  # its place in a list of shards


def tracking_uri(cfg: Config) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.pipeline.mlflow_tracking_uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        # Tasks may run in another working directory: pin a relative database path to an absolute one.
        # abspath, not resolve: a path through a symlink loop is refused by unreachable(), not here
        uri = "sqlite:///" + os.path.abspath(uri.removeprefix("sqlite:///"))
    return uri


# The tracking URIs MLflow takes: a server, a database (SQLAlchemy's dialect[+driver]://), a file store
# (a path or file://), Databricks. Anything else launched a run whose first task failed 20 s later.
TRACKING_SCHEMES = ("", "file", "http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")


def uri_scheme(uri: str) -> str:
    """The scheme of a tracking URI without a driver (`postgresql+psycopg2` is `postgresql`); "" for a
    plain path."""
    return urllib.parse.urlparse(uri).scheme.partition("+")[0].lower() if "://" in uri else ""


def unreachable(uri: str, timeout_s: float = 5.0) -> str | None:
    """Why the tracking store at `uri` cannot be used from here, or None. Its scheme must be one MLflow
    takes; a server must answer its /health; a sqlite database's folder must exist (MLflow creates the
    file, not the folder)."""
    scheme = uri_scheme(uri)
    if scheme not in TRACKING_SCHEMES:
        return (
            f"unsupported scheme {scheme!r}; use http(s)://, sqlite:///, file:// or a database URI "
            "(postgresql://, mysql://, mssql://)"
        )
    if uri.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
                return None
        except urllib.error.HTTPError as e:
            return f"the server answered /health with HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            return f"no MLflow server answers ({getattr(reason, 'strerror', None) or reason})"
    if uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        if not folder.is_dir():
            return f"the database's folder {folder} does not exist"
    return None


def configured_mlflow(cfg: Config):
    import mlflow

    user_value = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(tracking_uri(cfg))
    # set_tracking_uri also exports MLFLOW_TRACKING_URI, which tracking_uri() reads first: put back the
    # user's value so that a later config in this process (or a child process) is not pinned to this one.
    if user_value is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = user_value
    return mlflow


# Where a KFP launcher mounts an object-store URI inside a pod: s3://b/k is read and written as /s3/b/k.
POD_PREFIXES = {"/s3/": "s3://", "/minio/": "s3://", "/gcs/": "gs://"}


def artifact_uri(path_or_uri: str) -> str:
    """The artifact's own URI for what a component sees: pod paths (/s3/b/k, /minio/b/k, /gcs/b/k) map
    back to s3:// or gs:// URIs, minio:// becomes s3:// (MLflow rejects minio://), a local path becomes
    absolute; other URIs are returned as they are."""
    for prefix, scheme in POD_PREFIXES.items():
        if path_or_uri.startswith(prefix):
            return scheme + path_or_uri.removeprefix(prefix)
    if path_or_uri.startswith("minio://"):
        return "s3://" + path_or_uri.removeprefix("minio://")
    if "://" not in path_or_uri:
        return str(Path(path_or_uri).resolve())
    return path_or_uri


def mlflow_source(uri: str) -> str:
    """The source MLflow records for an artifact (see artifact_uri)."""
    return artifact_uri(uri)


def _run_experiment(cfg: Config, run_name: str) -> str | None:
    """The id of the experiment a pipeline run `run_name` logs to; None without a run name, a tracking
    store, or the experiment (nothing was logged)."""
    if not run_name or not tracking_uri(cfg):
        return None
    experiment = configured_mlflow(cfg).get_experiment_by_name(cfg.pipeline.experiment)
    return experiment.experiment_id if experiment is not None else None


def find_pipeline_run(cfg: Config, run_name: str) -> str | None:
    """The id of the newest parent run created for `run_name`."""
    experiment = _run_experiment(cfg, run_name)
    if experiment is None:
        return None
    client = configured_mlflow(cfg).MlflowClient()
    runs = client.search_runs(
        [experiment],
        filter_string=f"tags.`{PIPELINE_TAG}` = '{run_name}' and tags.`{STAGE_TAG}` = 'pipeline'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def find_model_uri(cfg: Config, run_name: str, name: str) -> str | None:
    """The URI of the newest checkpoint `name` (e.g. "policy-round-3", as the training stages log it)
    that the pipeline run `run_name` logged, or None."""
    experiment = _run_experiment(cfg, run_name)
    if experiment is None:
        return None
    models = configured_mlflow(cfg).search_logged_models(
        experiment_ids=[experiment],
        filter_string=f"name = '{name}' AND tags.`{PIPELINE_TAG}` = '{run_name}'",
        order_by=[{"field_name": "creation_timestamp", "ascending": False}],
        output_format="list",
    )
    return models[0].tags.get("uri") if models else None


def round_metric(cfg: Config, run_name: str, round_idx: int, stage: str, metric: str) -> float | None:
    """A metric of the newest finished stage run `stage` (as MLflow names it, e.g.
    "audit-after-aggregate") in round `round_idx` of the pipeline run `run_name`, or None."""
    parent = find_pipeline_run(cfg, run_name)
    if parent is None:
        return None
    runs = [
        r
        for r in stage_runs_by_round(cfg, parent).get(round_idx, [])
        if r.data.tags.get(STAGE_TAG) == stage and r.info.status == "FINISHED" and metric in r.data.metrics
    ]
    runs.sort(key=lambda r: r.info.start_time, reverse=True)
    return runs[0].data.metrics[metric] if runs else None


def mlflow_client(cfg: Config):
    """An MLflow client of the config's tracking store."""
    return configured_mlflow(cfg).MlflowClient()


def stage_runs_by_round(cfg: Config, parent_run_id: str) -> dict[int, list]:
    """The stage runs of one pipeline run, by round: round 0's sit under the parent run, the others
    under their round's run. Every round that has a run appears."""
    client = mlflow_client(cfg)
    experiment = client.get_run(parent_run_id).info.experiment_id

    def children(run_id: str) -> list:
        return client.search_runs(
            [experiment], filter_string=f"tags.mlflow.parentRunId = '{run_id}'", max_results=5000
        )

    by_round: dict[int, list] = {0: []}
    for child in children(parent_run_id):
        if STAGE_TAG in child.data.tags:
            by_round[0].append(child)
        else:
            by_round[int(child.data.tags[ROUND_TAG])] = children(child.info.run_id)
    return by_round
