"""One runner for every stage: complete and check the values, check the outputs can be written, do
the work, then log the task's lineage to MLflow — the same for a KFP task, `dynrubric stage` and a
`--from-run` rerun."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamicrubric import store
from dynamicrubric.evaluation.plots import PLOTS_FOLDER_FILES
from dynamicrubric.infra import logs, tracking, tracking_runs
from dynamicrubric.infra.config import Config
from dynamicrubric.infra.config_loading import config_from_yaml
from dynamicrubric.infra.model_references import REFERENCE_FILE, follow_reference, model_reference
from dynamicrubric.infra.models import BUILTIN_MODELS
from dynamicrubric.stages.declarations import STAGES
from dynamicrubric.stages.spec import Data, Stage

STAGE_PARAM = "stage"  # every stage run logs its stage's name, so a rerun knows what it is rerunning


def run_stage(name: str, config_yaml: str, run_name: str, round_idx: int, **values: Any) -> dict:
    """Set up a task process, then run stage `name` on the config's YAML (see `execute`)."""
    started = time.perf_counter()
    return execute(STAGES[name], task_config(config_yaml), run_name, round_idx, values, started=started)


def run_task(name: str, config_path: str, run_name: str, round_idx: int, **values: Any) -> dict:
    """A KFP task's entry point: the config is the start-tracking task's `config` artifact, read from
    the path the launcher put it at (see `start_tracking`)."""
    return run_stage(name, Path(config_path).read_text(), run_name, round_idx, **values)


def task_config(config_yaml: str) -> Config:
    """A task process's set-up (its log format, no last garbage collection at exit) and its config."""
    logs.setup()
    logs.skip_the_exit_collection()
    return config_from_yaml(config_yaml)


def execute(
    stage: Stage, cfg: Config, run_name: str, round_idx: int, values: dict, *, started: float | None = None
) -> dict:
    """Run `stage` on `values` (by name; see declarations.py), logging to MLflow under `run_name`
    (none when it is empty); return the numbers of the task's log line."""
    started = time.perf_counter() if started is None else started
    if round_idx < 0:
        raise ValueError(f"stage {stage.command}: --round: expected 0 or more, got {round_idx}")
    values = complete(stage, cfg, values)
    if stage.check:
        stage.check(values)
    outputs = [(d, values[f"out_{d.name}"]) for d in stage.outputs]
    models = [values[m.name] for m in stage.models if _is_location(values[m.name])]
    preflight(
        *(uri for d, uri in outputs if not d.folder),
        folders=[(uri, folder_kind(d)) for d, uri in outputs if d.folder],
        inputs=[*(uri for d in stage.inputs for uri in _uris(values[d.name])), *models],
    )
    result = stage.run(cfg, round_idx, **values)
    task = stage.task_name(values)
    with tracking_runs.stage_run(
        cfg, run_name, round_idx, task, started=started, command=stage.command
    ) as run:
        if run:
            log_lineage(run, stage, run_name, round_idx, values, result)
    return result


def complete(stage: Stage, cfg: Config, values: dict) -> dict:
    """Every value the stage takes: a model not given is the config's (models.<role>) or "" where it is
    optional, an optional artifact not given is "" (a list of shards: []), a param its default."""
    known = {p.name for p in stage.params} | {m.name for m in stage.models} | {d.name for d in stage.inputs}
    known |= {f"out_{d.name}" for d in stage.outputs}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"stage {stage.command}: unknown value {unknown[0]!r}; it takes {sorted(known)}")
    done = dict(values)
    for p in stage.params:
        if done.get(p.name) is None:
            if p.required:
                raise ValueError(f"stage {stage.command}: --{p.name.replace('_', '-')} is required")
            done[p.name] = p.default
        elif p.bounds and not p.bounds[0] <= done[p.name] <= p.bounds[1]:
            raise ValueError(
                f"stage {stage.command}: --{p.name.replace('_', '-')}: expected "
                f"{p.bounds[0]}..{p.bounds[1]}, got {done[p.name]}"
            )
    for m in stage.models:
        if not done.get(m.name):
            done[m.name] = getattr(cfg.models, m.default_from) if m.default_from else ""
        # a rollback's folder names the checkpoint it chose: the stage loads (and logs) that one
        done[m.name] = follow_reference(done[m.name])
    for d in stage.inputs:
        if not done.get(d.name):
            if not d.optional:
                raise ValueError(f"stage {stage.command}: --{d.name.replace('_', '-')} is required")
            done[d.name] = [] if d.shards else ""
        elif d.shards and isinstance(done[d.name], str):
            done[d.name] = [done[d.name]]
    for d in stage.outputs:
        key = f"out_{d.name}"
        if not done.get(key):
            if not d.optional:
                raise ValueError(f"stage {stage.command}: {stage.output_flag(d)} is required")
            done[key] = ""
    return done


def log_lineage(run, stage: Stage, run_name: str, round_idx: int, values: dict, result: dict) -> None:
    """The stage's params, the model references it loaded, its input and output datasets (inputs
    tagged with their name and position, so that a rerun hands each back where it was), the folders
    it wrote, and its numbers."""
    params: dict[str, object] = {STAGE_PARAM: stage.name}
    params.update({p.name: values[p.name] for p in stage.params})
    params.update({m.name: model_reference(values[m.name]) if values[m.name] else "" for m in stage.models})
    params.update(
        {f"out_{d.name}": tracking.artifact_uri(values[f"out_{d.name}"]) for d in stage.outputs if d.folder}
    )
    run.log_params(params)
    for d in stage.inputs:
        for position, uri in enumerate(_uris(values[d.name])):
            run.log_artifact_dataset(uri, d.kind, "input", name=d.name, position=position)
    for d in stage.outputs:
        uri = values[f"out_{d.name}"]
        if uri and not d.folder:
            run.log_artifact_dataset(uri, d.kind, "output", name=d.name)
    if stage.lineage:
        stage.lineage(run, run_name, round_idx, values, result)
    else:
        run.log_metrics(result)


def _uris(value: str | list[str]) -> list[str]:
    return [u for u in ([value] if isinstance(value, str) else value) if u]


def _is_location(ref: str) -> bool:
    """A model reference that names a place (a folder, file:// or s3://), not a built-in name or hub id."""
    return bool(ref) and ref not in BUILTIN_MODELS and ("://" in ref or Path(ref).expanduser().exists())


def folder_kind(data: Data) -> str:
    """What a folder output holds: "model" (a checkpoint, whichever role), "reference" (a folder naming
    one), else its name (plots, steps)."""
    return data.kind if data.kind in ("model", "reference") else data.name


def preflight(*uris: str, folders: Sequence[tuple[str, str]] = (), inputs: Sequence[str] = ()) -> None:
    """Check every output (`uris` are files, `folders` (uri, kind) pairs) can be written before inputs
    are read or a model is loaded: a missing bucket found after the compute throws the compute away.

    Nothing the stage did not write may be lost. Two outputs at one path, an output at an input's path,
    or one path inside another (a folder output holding an input or another output, an output inside
    an input's folder) would overwrite or remove one with the other without a word; a folder output
    replaces the whole folder at its path, so only one this project wrote for the same kind of output
    may be there. A local file output where a folder is (or the reverse) fails only once written. All
    are refused, comparing paths and URIs in one canonical form (store.canonical)."""
    files = [u for u in uris if u]
    folders = [(u, kind) for u, kind in folders if u]
    known: list[tuple[str, str, bool]] = []  # (canonical, how to name it, whether it is an output)
    for uri in (u for u in inputs if u):
        known.append((store.canonical(uri), f"the input {uri}", False))
    for uri, is_folder in [*((u, False) for u in files), *((u, True) for u, _ in folders)]:
        here = store.canonical(uri)
        for there, other, other_is_output in known:
            if here == there:
                raise ValueError(f"{uri}: an output cannot be written where {other} is")
            if is_folder and store.within(there, here):
                raise ValueError(f"{uri}: the folder output would remove {other}, which is inside it")
            if store.within(here, there):
                raise ValueError(f"{uri}: an output cannot be written inside {other}")
            if other_is_output and store.within(there, here):
                raise ValueError(f"{uri}: an output cannot be written where {other} is inside it")
        known.append((here, f"the output {uri}", True))
    for uri in (u for u in files if not store.is_s3(u)):
        if store.local_path(uri).is_dir():
            raise ValueError(f"{uri}: exists and is a folder, not a file")
    for uri, kind in folders:
        if not store.is_s3(uri):
            path = store.local_path(uri)
            if path.exists() and not path.is_dir():
                raise ValueError(f"{uri}: exists and is not a folder")
        _check_replaceable(uri, kind)
    for uri in (*files, *(u for u, _ in folders)):
        store.check_writable(uri)


_STEP_FOLDER = re.compile(r"step-\d+")
_REPLACE_HINT = "writing the output would remove it: choose another path, or remove it yourself"


def _check_replaceable(uri: str, kind: str) -> None:
    """Refuse a folder output whose path holds anything but an earlier output of the same kind.

    A published folder (a checkpoint, the plots) is this project's when its completion marker is there,
    and its kind shows in the files the marker lists (a model has config.json, the plots are the plot
    files). The steps folder is written file by file with no marker, so a retried or resumed training
    adds to it: it is this project's when it holds only step-NNNNN folders."""
    if store.is_s3(uri):
        rels = store.list_files(uri)
        if not rels:
            return
        tops = {r.split("/", 1)[0] for r in rels}
        nested = all("/" in r for r in rels)
    else:
        path = store.local_path(uri)
        if not path.is_dir() or not any(path.iterdir()):
            return  # absent or empty: nothing to lose
        tops = {p.name for p in path.iterdir()}
        nested = all(p.is_dir() for p in path.iterdir())
    if kind == "steps":
        if nested and all(_STEP_FOLDER.fullmatch(t) for t in tops):
            return
        raise ValueError(
            f"{uri}: a folder that is not a training run's steps folder is there; {_REPLACE_HINT}"
        )
    manifest = store.read_manifest(uri)
    if manifest is None:
        raise ValueError(
            f"{uri}: a folder that dynrubric did not write is there (no {store.COMPLETE_MARKER} marker); "
            + _REPLACE_HINT
        )
    listed = manifest["files"]
    names = set(listed) if listed is not None else {r for r in tops if r != store.COMPLETE_MARKER}
    found = (
        "model"
        if "config.json" in names
        else "reference"
        if names == {REFERENCE_FILE}
        else "plots"
        if names <= PLOTS_FOLDER_FILES
        else "other"
    )
    if found != kind:
        raise ValueError(f"{uri}: holds a dynrubric {found} folder, not a {kind} folder; {_REPLACE_HINT}")


def write_kfp_metrics(summary: Any, values: dict) -> None:
    """Numbers for the KFP UI, plus a file at the artifact's path: kfp.local treats a cached output whose
    file is missing as stale, and a Metrics artifact has none of its own, which would rerun the task."""
    finite = {k: float(v) for k, v in values.items() if isinstance(v, int | float) and v == v}
    for name, value in finite.items():
        summary.log_metric(name, value)
    Path(summary.path).parent.mkdir(parents=True, exist_ok=True)
    Path(summary.path).write_text(json.dumps(finite, sort_keys=True))


def start_tracking(config_yaml: str, run_name: str, first_round: int = 1, config_path: str = "") -> str:
    """Create the MLflow parent run, or join it for a later segment of a chained run (`first_round`
    > 1: every segment's tasks log under the one parent run of `run_name`); later tasks find it by
    `run_name` (see tracking_runs.py). With `config_path`, write the checked config there: the pipeline's
    tasks read it from that artifact rather than each taking the YAML inline."""
    cfg = task_config(config_yaml)
    if config_path:
        Path(config_path).parent.mkdir(parents=True, exist_ok=True)
        Path(config_path).write_text(cfg.to_yaml())
    return tracking_runs.start_pipeline_run(cfg, run_name, cfg.pipeline.rounds, join=first_round > 1)
