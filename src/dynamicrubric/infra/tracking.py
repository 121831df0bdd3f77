"""MLflow lineage: one parent run per pipeline run, a nested run per round, a nested run per stage.

The pipeline's first task creates the parent run (params: the whole config), started when that
task's process started. A round's run is created by the first of its tasks to reach MLflow, with
that task's start as its own (MLflow cannot move a run's start later), and every stage task opens its
own run nested under its round's, found by the round tag; parallel first tasks that each created one
are merged into the earliest (`_round_run`). Each stage run's end moves its round's and the parent's
end on (`extend_spans`), so the UI's durations span the round's and the pipeline's tasks. Stages log their
artifacts as MLflow datasets whose source is the artifact URI, their numbers as metrics, and each
checkpoint as an external LoggedModel pointing at its URI.

Tracking is off when the tracking URI is empty. The URI comes from `MLFLOW_TRACKING_URI` when set
(on a cluster), else from `pipeline.mlflow_tracking_uri` in the config.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import urllib.parse
import warnings
from collections.abc import Iterator
from pathlib import Path

from dynamicrubric.infra.config import Config

log = logging.getLogger(__name__)

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


def _mlflow(cfg: Config):
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


def start_pipeline_run(cfg: Config, run_name: str, rounds: int, *, join: bool = False) -> str:
    """Create the parent run, started with this task's process; return its id ("" when tracking is
    off). The `rounds` runs are not made here: each round's first task makes its run (`_round_run`),
    so that it starts when the round does.

    With `join` (a later segment of a chained run) the newest parent run of `run_name` is reused when
    there is one, so that the whole chain's stage runs sit under one parent."""
    uri = tracking_uri(cfg)
    if not uri:
        return ""
    mlflow = _mlflow(cfg)
    existing = find_pipeline_run(cfg, run_name) if join else None
    if existing:
        # the round runs are created by their rounds' first tasks (stage_run)
        log.info("MLflow: joined parent run %s at %s", existing, uri)
        return existing
    if uri.startswith("sqlite:///") and mlflow.get_experiment_by_name(cfg.pipeline.experiment) is None:
        # A SQL store's default artifact root is ./mlruns in whatever directory the run starts from;
        # keep a local store's artifacts beside its database (tracking_uri made its path absolute).
        beside_db = Path(uri.removeprefix("sqlite:///")).parent / "mlruns"
        mlflow.create_experiment(cfg.pipeline.experiment, artifact_location=beside_db.as_uri())
    experiment = mlflow.set_experiment(cfg.pipeline.experiment)
    from mlflow.tracking.context.registry import resolve_tags

    # started with this (the pipeline's first) task's process; its end follows the last stage run's
    tags = resolve_tags(
        {PIPELINE_TAG: run_name, STAGE_TAG: "pipeline", **_source_tags(f"pipeline run {run_name}")}
    )
    created = mlflow.MlflowClient().create_run(
        experiment.experiment_id, start_time=int(process_started() * 1000), tags=tags, run_name=run_name
    )
    with mlflow.start_run(run_id=created.info.run_id) as parent:
        params = {k: ("" if v is None else str(v))[:6000] for k, v in cfg.flat().items()}
        mlflow.log_params(params)
        mlflow.log_text(cfg.to_yaml(), "config.yaml")
        parent_id = parent.info.run_id
    log.info(
        "MLflow: parent run %s in experiment %r at %s", parent_id, cfg.pipeline.experiment, tracking_uri(cfg)
    )
    return parent_id


MAX_TAG_CHARS = 5000  # MLflow's limit on a tag's value


class StageRun:
    """Logging helpers bound to one stage's MLflow run."""

    def __init__(self, mlflow, run_id: str):
        self.mlflow = mlflow
        self.run_id = run_id
        self.summary: dict[str, float] = {}  # the numbers of log_metrics, for the task's one log line

    def log_artifact_dataset(
        self, uri: str, kind: str, context: str, *, name: str = "", position: int = 0
    ) -> None:
        """Record an artifact as an MLflow dataset input ('input' or 'output') whose source is its URI,
        tagged with the stage's name for it and, for a list of shards, its position in the list."""
        from dynamicrubric.infra.artifacts import read_frame
        from dynamicrubric.store import read_bytes

        frame = read_frame(uri, kind)
        source = mlflow_source(uri)
        # MLflow keeps one dataset per (name, digest) in an experiment and shows the first source it
        # saw: the URI is part of the digest, so a byte-identical copy at another URI (a task that
        # passes its input through) is a dataset of its own with its own source.
        digest = hashlib.sha256(source.encode() + b"\0" + read_bytes(uri)).hexdigest()[:16]
        tags = {"kind": kind, "uri": source, NAME_TAG: name or kind, POSITION_TAG: str(position)}
        # Schema inference warns about int columns when the dataset is built and again when it is
        # logged (its profile and schema are computed lazily): both stay inside the filter.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ii]nferred schema.*")
            warnings.simplefilter("ignore", UserWarning)
            dataset = self.mlflow.data.from_pandas(frame, source=source, name=kind, digest=digest)
            try:
                self.mlflow.log_input(dataset, context=context, tags=tags)
            except self.mlflow.exceptions.MlflowException as e:
                # Two shards logging the same input at once race on MLflow's check-then-insert of the
                # dataset row (UNIQUE constraint on a SQL store); the row exists now, so once more finds it.
                # sqlite: "UNIQUE constraint failed"; postgres: "duplicate key value"
                message = str(e).lower()
                if "unique constraint" not in message and "duplicate" not in message:
                    raise
                log.info("MLflow: dataset %s was logged concurrently; retrying", uri)
                self.mlflow.log_input(dataset, context=context, tags=tags)

    def set_tags(self, tags: dict[str, str], *, above: dict[str, str] | None = None) -> None:
        """`tags` on this run, and `above` (default: the same) on every run it is nested under (its
        round's run and the pipeline's parent run), where the MLflow run list shows them."""
        client = self.mlflow.MlflowClient()
        run_id, values = self.run_id, tags
        while run_id:
            for key, value in values.items():
                client.set_tag(run_id, key, value[:MAX_TAG_CHARS])
            run_id = client.get_run(run_id).data.tags.get("mlflow.parentRunId", "")
            values = tags if above is None else above

    def log_params(self, params: dict[str, object]) -> None:
        """The stage's inputs that are not artifacts (model references, seeds, shard), to rerun it."""
        self.mlflow.log_params({k: str(v) for k, v in params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        numeric = {
            k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if numeric:
            self.mlflow.log_metrics(numeric, step=step)
            if step is None:
                self.summary.update(numeric)

    def log_metrics_table(self, uri: str) -> None:
        """Log a `metrics` artifact: per-step rows with their step, the rest at step 0."""
        from dynamicrubric.infra.artifacts import read_frame

        self.log_metric_rows(read_frame(uri, "metrics").to_dict("records"))

    def log_metric_rows(self, rows: list[dict]) -> None:
        """Rows shaped as a `metrics` artifact's (name, value, step, variant), each at its step."""
        for row in rows:
            key = f"{row['variant']}/{row['name']}" if row["variant"] else row["name"]
            self.mlflow.log_metric(key, row["value"], step=int(row["step"]))

    def log_model(self, run_name: str, name: str, uri: str, params: dict[str, str] | None = None) -> str:
        """An external LoggedModel pointing at a checkpoint's URI, listed in this run's model outputs;
        returns its model id."""
        from mlflow.entities import LoggedModelOutput

        model = self.mlflow.create_external_model(
            name=name,
            source_run_id=self.run_id,
            params={k: str(v) for k, v in (params or {}).items()},
            tags={"uri": mlflow_source(uri), PIPELINE_TAG: run_name},
        )
        self.mlflow.MlflowClient().log_outputs(
            self.run_id, models=[LoggedModelOutput(model.model_id, step=0)]
        )
        return model.model_id

    def find_model(self, run_name: str, name: str) -> str | None:
        """The id of the LoggedModel `name` logged by this pipeline run, if any."""
        experiment_id = self.mlflow.get_run(self.run_id).info.experiment_id
        models = self.mlflow.search_logged_models(
            experiment_ids=[experiment_id],
            filter_string=f"name = '{name}' AND tags.`{PIPELINE_TAG}` = '{run_name}'",
            output_format="list",
        )
        return models[0].model_id if models else None

    def log_model_metrics(self, model_id: str, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.mlflow.log_metric(key, float(value), model_id=model_id)

    def log_dir(self, local_dir: str, artifact_path: str) -> None:
        self.mlflow.log_artifacts(local_dir, artifact_path)


def _run_experiment(cfg: Config, run_name: str) -> str | None:
    """The id of the experiment a pipeline run `run_name` logs to; None without a run name, a tracking
    store, or the experiment (nothing was logged)."""
    if not run_name or not tracking_uri(cfg):
        return None
    experiment = _mlflow(cfg).get_experiment_by_name(cfg.pipeline.experiment)
    return experiment.experiment_id if experiment is not None else None


def find_pipeline_run(cfg: Config, run_name: str) -> str | None:
    """The id of the newest parent run created for `run_name`."""
    experiment = _run_experiment(cfg, run_name)
    if experiment is None:
        return None
    client = _mlflow(cfg).MlflowClient()
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
    models = _mlflow(cfg).search_logged_models(
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
    return _mlflow(cfg).MlflowClient()


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


TASK_STARTED_ENV = "DYNRUBRIC_TASK_STARTED"  # set by `dynrubric run`: when it started the task's process


def process_started() -> float:
    """When this process started, in seconds since the epoch: a task's work (imports, model loading,
    compute) starts with its process, and so does the task's time on its `done` line. `dynrubric run`
    says when it started the task (TASK_STARTED_ENV); otherwise the kernel's start time, which is only
    good to a second (the boot time it counts from is whole seconds)."""
    if os.environ.get(TASK_STARTED_ENV):
        return float(os.environ[TASK_STARTED_ENV])
    import psutil  # a dependency of accelerate, peft and trl

    return psutil.Process().create_time()


@contextlib.contextmanager
def stage_run(
    cfg: Config,
    run_name: str,
    round_idx: int,
    stage: str,
    *,
    started: float | None = None,
    command: str = "",
) -> Iterator[StageRun | None]:
    """A run for one stage task, nested under its round's run (or the parent for round 0).

    `stage` is spelled as the CLI spells it (train_policy → train-policy). On leaving, the numbers
    given to log_metrics and the stage's time are printed as the task's one summary line (logs.py).

    Stages open their run once the work is done, so a stage that fails leaves no half-logged run
    that could pass for its result; the run is created with the start time of the task's process, so
    its span in MLflow (start to end, the UI's duration and timeline) covers the work it records.
    A run that is still RUNNING under the same round with the same stage name is a killed attempt of
    this task (the process died while logging): it is marked FAILED. `started`, the stage's
    time.perf_counter() when its function began, is also logged as the metric `stage_wall_s` (model
    loading included; process start and imports are not). `command` is the stage's CLI name (judge for
    the task generator-judge-0), which the run's source names in its rerun command.
    """
    from mlflow.tracking.context.registry import resolve_tags

    from dynamicrubric.infra import logs

    stage = stage.replace("_", "-")
    if not run_name or not tracking_uri(cfg):
        yield None
        if started is not None:
            logs.emit_summary({"time_s": round(time.perf_counter() - started, 1)})
        return
    parent_run_id = find_pipeline_run(cfg, run_name)
    if parent_run_id is None:
        raise RuntimeError(f"MLflow: no parent run for pipeline run {run_name!r} in {tracking_uri(cfg)}")
    mlflow = _mlflow(cfg)
    client = mlflow.MlflowClient()
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    start_ms = int(process_started() * 1000)
    nest_under = parent_run_id
    if round_idx > 0:
        nest_under = _round_run(client, experiment_id, parent_run_id, round_idx, start_ms)
    for stale in client.search_runs(
        [experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{nest_under}' and tags.`{STAGE_TAG}` = '{stage}' "
        "and attributes.status = 'RUNNING'",
    ):
        log.warning(
            "MLflow: run %s of %s was left RUNNING by a killed attempt; marking it FAILED",
            stale.info.run_id,
            stage,
        )
        client.set_terminated(stale.info.run_id, status="FAILED")
    # The client's create_run takes a start time (mlflow.start_run does not); resolve_tags adds what
    # mlflow.start_run would (user, source).
    tags = resolve_tags({STAGE_TAG: stage, ROUND_TAG: str(round_idx), "mlflow.parentRunId": nest_under})
    created = client.create_run(experiment_id, start_time=start_ms, tags=tags, run_name=stage)
    run_id = created.info.run_id
    # MLflow's Source column: the command that reruns this task, not the KFP executor's script
    rerun = f"stage {command or stage} --from-run {run_id}"
    for key, value in {**_source_tags(rerun), "mlflow.note.content": RERUN_NOTE.format(rerun=rerun)}.items():
        client.set_tag(run_id, key, value)
    with mlflow.start_run(run_id=run_id) as run:
        stage_run = StageRun(mlflow, run.info.run_id)
        yield stage_run
        summary = dict(stage_run.summary)
        if started is not None:
            wall = time.perf_counter() - started
            mlflow.log_metric("stage_wall_s", wall)
            summary = {"time_s": round(wall, 1), **summary}
    # A round run merged away meanwhile (parallel first tasks) leaves this run under the earliest one.
    if round_idx > 0:
        keep = _round_run(client, experiment_id, parent_run_id, round_idx, start_ms)
        if keep != nest_under:
            client.set_tag(run_id, "mlflow.parentRunId", keep)
    extend_spans(client, run_id, client.get_run(run_id).info.end_time)
    logs.emit_summary(summary, run_id=stage_run.run_id)


RERUN_NOTE = (
    "Rerun this task with `dynrubric {rerun} --out-NAME URI ...` (`dynrubric stage NAME --help` lists the "
    "outputs to give); its config, inputs, params and models come from this run."
)


def _source_tags(what: str) -> dict[str, str]:
    """MLflow's source tags naming `dynrubric <what>`, in place of the script that ran (KFP's
    executor_main.py says nothing about how to rerun a task)."""
    return {"mlflow.source.name": f"dynrubric {what}", "mlflow.source.type": "LOCAL"}


def _round_runs(client, experiment_id: str, parent_run_id: str, round_idx: int) -> list:
    return client.search_runs(
        [experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.`{ROUND_TAG}` = '{round_idx}'",
        max_results=5000,
    )


def _round_run(client, experiment_id: str, parent_run_id: str, round_idx: int, start_ms: int) -> str:
    """The id of round `round_idx`'s run, created (started at `start_ms`, a task's start) when the
    round has none that started as early. Parallel first tasks may each create one: the earliest (by
    start, then id) is kept and the others' children are moved to it before they are deleted, so
    whichever task looks last leaves one round run that starts with the round's first task."""
    from mlflow.exceptions import MlflowException

    found = [
        r
        for r in _round_runs(client, experiment_id, parent_run_id, round_idx)
        if STAGE_TAG not in r.data.tags
    ]
    if all(r.info.start_time > start_ms for r in found):  # none, or all started after this task
        tags = {ROUND_TAG: str(round_idx), "mlflow.parentRunId": parent_run_id}
        tags.update(_source_tags(f"round {round_idx}"))
        created = client.create_run(
            experiment_id, start_time=start_ms, tags=tags, run_name=f"round-{round_idx}"
        )
        # another first task may have merged it away already (it found an earlier one)
        with contextlib.suppress(MlflowException):
            client.set_terminated(created.info.run_id, end_time=start_ms)
        found = [
            r
            for r in _round_runs(client, experiment_id, parent_run_id, round_idx)
            if STAGE_TAG not in r.data.tags
        ]
    keep, *others = sorted(found, key=lambda r: (r.info.start_time, r.info.run_id))
    for other in others:
        for child in client.search_runs(
            [experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{other.info.run_id}'",
            max_results=5000,
        ):
            client.set_tag(child.info.run_id, "mlflow.parentRunId", keep.info.run_id)
            _extend_end(client, keep.info.run_id, child.info.end_time)
        with contextlib.suppress(MlflowException):  # another task merged it first
            client.delete_run(other.info.run_id)
    return keep.info.run_id


def _extend_end(client, run_id: str, end_ms: int | None) -> None:
    """Move a finished run's end to `end_ms` when that is later; its status stays. A round run that
    a parallel task merged away (deleted) is left alone: its stage runs move to the kept one."""
    from mlflow.exceptions import MlflowException

    if end_ms is None:
        return
    info = client.get_run(run_id).info
    if info.status != "RUNNING" and info.lifecycle_stage == "active" and (info.end_time or 0) < end_ms:
        with contextlib.suppress(MlflowException):  # deleted meanwhile
            client.set_terminated(run_id, status=info.status, end_time=end_ms)


def extend_spans(client, run_id: str, end_ms: int | None) -> None:
    """Move the ends of `run_id`'s round run and the pipeline's parent run to `end_ms` when it is
    later: each spans its tasks (start of the first to end of the last)."""
    parent = client.get_run(run_id).data.tags.get("mlflow.parentRunId")
    for _ in range(2):  # stage -> round -> pipeline
        if not parent:
            return
        _extend_end(client, parent, end_ms)
        parent = client.get_run(parent).data.tags.get("mlflow.parentRunId")


def settle_spans(cfg: Config, parent_run_id: str) -> None:
    """Once a pipeline run has ended: each round run ends with its last stage run and the parent
    with the last of them, whatever order the tasks' updates reached MLflow in."""
    client = mlflow_client(cfg)
    latest = 0
    for t, stages in stage_runs_by_round(cfg, parent_run_id).items():
        ends = [s.info.end_time for s in stages if s.info.end_time]
        if not ends:
            continue
        latest = max(latest, *ends)
        if t > 0:
            for r in _round_runs(client, client.get_run(parent_run_id).info.experiment_id, parent_run_id, t):
                if STAGE_TAG not in r.data.tags:
                    _extend_end(client, r.info.run_id, max(ends))
    _extend_end(client, parent_run_id, latest or None)


def end_stage_run_at(uri: str, run_id: str, end_s: float) -> None:
    """Move a finished stage run's end to `end_s` (epoch seconds): `dynrubric run` calls it when the
    task's process has exited, so that the run spans the task's whole time, its exit included (1-7 s
    of interpreter teardown after the run closed, on a loaded 2-core VM)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    status = client.get_run(run_id).info.status
    client.set_terminated(run_id, status=status, end_time=int(end_s * 1000))
    extend_spans(client, run_id, int(end_s * 1000))


GOLD_NAME = "gold"  # the Expectation of a judged response: its rank in its labelled list, its checker score


def log_traced_sets(run: StageRun, sets: list[dict], round_idx: int) -> list[str]:
    """Each judged candidate set (evaluate.traced_sets) as one MLflow trace of the stage's run: a
    span for G's rubrics (items, weights, whether its output parsed, the model), a span per response
    with its score, V's P(yes) on each item as a Feedback named by the item (weight as rationale,
    source LLM_JUDGE with the verifier's reference; a failed verdict as an error, never a 0), and
    the response's gold as an Expectation. Returns the trace ids.

    The assessments go into the trace before it is exported, so a trace is one write to the store
    (log_feedback after the trace is one write per assessment: about 30 ms each on sqlite)."""
    from mlflow.entities import AssessmentError, AssessmentSource, AssessmentSourceType, SpanType
    from mlflow.entities.assessment import Expectation, Feedback
    from mlflow.tracing.trace_manager import InMemoryTraceManager

    # the trace is written when its root span ends, not by a background thread that may lag the run
    os.environ["MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"] = "false"
    mlflow = run.mlflow
    ids = []
    for s in sets:
        judge = AssessmentSource(source_type=AssessmentSourceType.LLM_JUDGE, source_id=s["verifier"])
        items = {(r["rubric_idx"], i): item for r in s["rubrics"] for i, item in enumerate(r["items"])}
        with mlflow.start_span(name=f"judged set {s['set_id']}", span_type=SpanType.EVALUATOR) as root:
            trace_id = root.trace_id
            root.set_inputs({"prompt": s["prompt"], "responses": len(s["responses"])})
            root.set_attributes({"round": round_idx, "job": s["job"], "variant": s["variant"]})
            with mlflow.start_span(name="rubric generation", span_type=SpanType.LLM) as gen:
                gen.set_inputs({"prompt": s["prompt"], "model": s["generator"]})
                gen.set_outputs({"rubrics": s["rubrics"]})
                held = all(r["parse_status"] == "json" for r in s["rubrics"])
                gen.set_attributes({"model": s["generator"], "grammar_held": held})
            assessments = []
            for response in s["responses"]:
                sample = response["sample_idx"]
                with mlflow.start_span(name=f"judge response {sample}", span_type=SpanType.LLM) as span:
                    span.set_inputs({"response": response["response"], "model": s["verifier"]})
                    span.set_outputs({"scores": response["scores"], "gold": response["gold"]})
                    span.set_attributes({"model": s["verifier"], "sample_idx": sample})
                meta = {"sample_idx": str(sample)}
                for v in response["verdicts"]:
                    item = items.get((v["rubric_idx"], v["item_idx"]))
                    if item is None:
                        continue
                    failed = v["p_yes"] is None
                    assessments.append(
                        Feedback(
                            name=f"r{v['rubric_idx']}.{v['item_idx']}: {item['text']}"[:250],
                            value=None if failed else v["p_yes"],
                            error=AssessmentError(
                                error_code="VERDICT_FAILED", error_message="the verifier's call failed"
                            )
                            if failed
                            else None,
                            rationale=f"weight {item['weight']}",
                            source=judge,
                            trace_id=trace_id,
                            span_id=span.span_id,
                            metadata=meta,
                        )
                    )
                if response["gold"]:
                    assessments.append(
                        Expectation(
                            name=GOLD_NAME,
                            value=response["gold"],
                            trace_id=trace_id,
                            span_id=span.span_id,
                            metadata=meta,
                        )
                    )
            root.set_outputs({str(r["sample_idx"]): r["scores"] for r in s["responses"]})
            with InMemoryTraceManager.get_instance().get_trace(trace_id) as live:
                live.info.assessments.extend(assessments)
        ids.append(trace_id)
    return ids
