"""The MLflow runs of a pipeline run: its parent run, a run per round and a run per stage task.

`start_pipeline_run` opens (or, for a later segment of a chained run, joins) the parent run;
`stage_run` opens a stage task's run nested under its round's, creating the round's run if it is the
first task there (`_round_run`, which merges the runs parallel first tasks made). Every run starts
with its task's process (`process_started`), and each stage run's end moves its round's and the
parent's on (`extend_spans`, `settle_spans`, `end_stage_run_at`).

Kept apart from `tracking` (the store, the tags, and the lookups that find these runs again) and from
`tracking_records` (what a stage logs into its run once it is open): this module alone decides where
a run sits in the lineage and how long it spans.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from dynamicrubric.infra.config import Config
from dynamicrubric.infra.tracking import (
    PIPELINE_TAG,
    ROUND_TAG,
    STAGE_TAG,
    configured_mlflow,
    find_pipeline_run,
    mlflow_client,
    stage_runs_by_round,
    tracking_uri,
)
from dynamicrubric.infra.tracking_records import StageRun

# The lineage's one logger (these lines were `dynamicrubric.infra.tracking`'s before the split), so that
# what filters or captures it still sees every one.
log = logging.getLogger("dynamicrubric.infra.tracking")


def start_pipeline_run(cfg: Config, run_name: str, rounds: int, *, join: bool = False) -> str:
    """Create the parent run, started with this task's process; return its id ("" when tracking is
    off). The `rounds` runs are not made here: each round's first task makes its run (`_round_run`),
    so that it starts when the round does.

    With `join` (a later segment of a chained run) the newest parent run of `run_name` is reused when
    there is one, so that the whole chain's stage runs sit under one parent."""
    uri = tracking_uri(cfg)
    if not uri:
        return ""
    mlflow = configured_mlflow(cfg)
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
    mlflow = configured_mlflow(cfg)
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
