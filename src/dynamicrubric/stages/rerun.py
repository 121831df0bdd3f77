"""Rerun one task of a finished pipeline run from what MLflow recorded about it.

`dynrubric stage NAME --from-run RUN_ID [--from-task ROUND/TASK] --out URI ...` takes everything but
where to write from the run: the pipeline's config (the parent run's `config.yaml`), the task's round,
its declared params and model references (MLflow params) and its input artifacts (dataset inputs, by
their name and position tags), and runs the stage as the pipeline's task ran it. Written to a new
place, the outputs are byte-identical to the pipeline's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from dynamicrubric.infra import tracking
from dynamicrubric.infra.config_loading import config_from_yaml
from dynamicrubric.stages.declarations import STAGES
from dynamicrubric.stages.runner import STAGE_PARAM, execute


class RerunError(RuntimeError):
    """A run or task that cannot be rerun as asked; one line, names the run."""


def _client(tracking_uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=tracking_uri)


def check_existing_store(tracking_uri: str) -> None:
    """A rerun reads a run that exists: refuse a tracking store that is not there before MLflow opens
    it, since opening one creates it (an empty mlflow.db, and the folders of its path, were left behind
    by a refusal)."""
    problem = tracking.unreachable(tracking_uri)
    sqlite = tracking_uri.startswith("sqlite:///")
    if not problem and sqlite and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
        problem = "no such database file"
    plain = not tracking.uri_scheme(tracking_uri)  # a plain path: MLflow's file store
    if not problem and plain and not Path(tracking_uri).is_dir():
        problem = "no such folder"
    if problem:
        raise RerunError(f"--tracking-uri {tracking_uri}: {problem}")


def find_stage_run(tracking_uri: str, run_id: str, task: str | None = None):
    """The MLflow run of one stage task: `run_id` itself, or with `task` ("ROUND/NAME", e.g.
    "1/generator-judge-0") the task of that name under the pipeline run `run_id`."""
    from mlflow.exceptions import MlflowException

    check_existing_store(tracking_uri)
    client = _client(tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise RerunError(f"--from-run {run_id}: no such MLflow run in {tracking_uri}") from e
    stage = run.data.tags.get(tracking.STAGE_TAG)
    if task is None:
        if stage in (None, "pipeline"):
            raise RerunError(
                f"--from-run {run_id} is not a stage's run; name the task with --from-task ROUND/NAME "
                "(e.g. 1/generator-judge-0)"
            )
        return run
    round_text, _, name = task.partition("/")
    if not round_text.isdigit() or not name:
        raise RerunError(f"--from-task {task!r}: expected ROUND/NAME, e.g. 1/generator-judge-0")
    pipeline = _pipeline_run(client, run)
    experiment = pipeline.info.experiment_id
    candidates = [pipeline.info.run_id]
    candidates += [
        r.info.run_id
        for r in client.search_runs(
            [experiment],
            filter_string=f"tags.mlflow.parentRunId = '{pipeline.info.run_id}'",
            max_results=5000,
        )
        if r.data.tags.get(tracking.ROUND_TAG) == round_text and tracking.STAGE_TAG not in r.data.tags
    ]
    for parent in candidates:
        found = client.search_runs(
            [experiment],
            filter_string=f"tags.mlflow.parentRunId = '{parent}' and tags.`{tracking.STAGE_TAG}` = '{name}' "
            f"and tags.`{tracking.ROUND_TAG}` = '{round_text}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if found:
            return client.get_run(found[0].info.run_id)
    raise RerunError(f"--from-task {task}: pipeline run {pipeline.info.run_id} has no such task")


def _pipeline_run(client, run):
    """The pipeline (parent) run above `run`, or `run` itself."""
    seen = 0
    while run.data.tags.get(tracking.STAGE_TAG) != "pipeline":
        parent = run.data.tags.get("mlflow.parentRunId")
        seen += 1
        if not parent or seen > 5:
            raise RerunError(f"run {run.info.run_id} does not belong to a dynrubric pipeline run")
        run = client.get_run(parent)
    return run


def pipeline_config(tracking_uri: str, run) -> str:
    """The config YAML the pipeline ran with (logged by start_tracking as `config.yaml`)."""
    client = _client(tracking_uri)
    pipeline = _pipeline_run(client, run)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(pipeline.info.run_id, "config.yaml", tmp)
        except Exception as e:  # MLflow raises several types for a missing artifact
            raise RerunError(f"pipeline run {pipeline.info.run_id} has no config.yaml artifact") from e
        return Path(path).read_text()


def inputs_by_name(run) -> dict[str, list[str]]:
    """The task's input artifacts by their name in the stage's declaration, each list in the order the
    task was given it (shards), as the URIs it logged."""
    found: dict[str, list[tuple[int, str]]] = {}
    for d in run.inputs.dataset_inputs:
        tags = {t.key: t.value for t in d.tags}
        if tags.get("mlflow.data.context") == "input":
            name = tags.get(tracking.NAME_TAG, tags.get("kind", d.dataset.name))
            found.setdefault(name, []).append((int(tags.get(tracking.POSITION_TAG, 0)), tags["uri"]))
    return {name: [uri for _, uri in sorted(uris)] for name, uris in found.items()}


def rerun(stage_name: str, tracking_uri: str, run_id: str, task: str | None, outputs: dict[str, str]) -> dict:
    """Rerun a task of stage `stage_name` of a pipeline run, writing its outputs (`out_<name>` -> URI)
    where `outputs` says; return its numbers."""
    stage = STAGES[stage_name]
    run = find_stage_run(tracking_uri, run_id, task)
    params = run.data.params
    name = run.data.tags[tracking.STAGE_TAG]
    if params.get(STAGE_PARAM) != stage.name:
        what = (
            f"a {params[STAGE_PARAM].replace('_', '-')} task"
            if STAGE_PARAM in params
            else "not a rerunnable task"
        )
        raise RerunError(f"run {run.info.run_id} is task {name!r}, {what}, not {stage.command}")
    inputs = inputs_by_name(run)
    values: dict = dict(outputs)
    for p in stage.params:
        text = params.get(p.name)
        values[p.name] = None if text in (None, "None") else p.type(text)
    for m in stage.models:
        values[m.name] = params.get(m.name, "")
    for d in stage.inputs:
        uris = inputs.get(d.name, [])
        if not d.shards and len(uris) > 1:
            raise RerunError(
                f"run {run.info.run_id} ({name}) logged {len(uris)} {d.name} inputs, expected one"
            )
        values[d.name] = uris if d.shards else (uris[0] if uris else "")
    cfg = config_from_yaml(pipeline_config(tracking_uri, run))
    return execute(stage, cfg, "", int(run.data.tags[tracking.ROUND_TAG]), values)
