"""Run the pipeline locally with kfp.local, compile it, or submit it to a Kubeflow Pipelines host."""

from __future__ import annotations

import json
import logging
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from dynamicrubric import tracking
from dynamicrubric.config import Config
from dynamicrubric.task_monitor import TaskMonitor, write_index

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A pipeline that cannot be compiled, run or submitted as configured; one line, names the key."""


@dataclass
class LocalRun:
    """What `dynrubric run` reports about one local run."""

    run_name: str
    parent_run_id: str  # MLflow ("" when tracking is off)
    tasks: list[dict] = field(default_factory=list)  # one entry per task, as in index.json
    run_dirs: list[str] = field(default_factory=list)  # pipeline-run folders holding this run's outputs
    index_files: list[str] = field(default_factory=list)

    @property
    def ran(self) -> int:
        return sum(not t["cached"] for t in self.tasks)


def fresh_run_name(cfg: Config) -> str:
    """A run name no earlier run used: every task's cache key includes it, so nothing is reused."""
    from dynamicrubric.pipelines.co_evolution import default_run_name

    return f"{default_run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_local(cfg: Config, *, verbose: bool = False, fresh: bool = False) -> LocalRun:
    """Run every stage in subprocesses on this machine.

    Each task's output goes to `task.log` in its folder; the terminal gets one line per task (or every
    line with `verbose`), the tasks' progress bars, and a failing task's last lines. An index of the
    tasks is written to the run folder (see `write_index`).
    """
    from kfp import local

    from dynamicrubric.pipelines.co_evolution import build_pipeline, default_run_name

    root = check_before_launch(cfg)
    # use_venv=False: the tasks run with this interpreter, which already has the project installed.
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(root),
        enable_caching=cfg.pipeline.caching,
        raise_on_error=True,
    )
    pipeline = build_pipeline(cfg)
    run_name = fresh_run_name(cfg) if fresh else default_run_name(cfg)
    monitor = TaskMonitor(
        verbose=verbose, shards=cfg.pipeline.shards, tracking_uri=tracking.tracking_uri(cfg)
    )
    with monitor.installed():
        try:
            pipeline(config_yaml=cfg.to_yaml(), run_name=run_name)
        except RuntimeError as e:  # kfp.local raises once a task fails; the monitor printed its log
            failed = [t for t in monitor.tasks if t.get("status") == "failed"]
            where = f" (log: {failed[0]['log']})" if failed else ""
            message = re.sub(r"\x1b\[[0-9;]*m", "", _one_line(e))  # kfp colours task names
            raise LaunchError(f"the pipeline stopped: {message}{where}") from e
        finally:
            monitor.starter.stop()
    result = LocalRun(run_name, tracking.find_pipeline_run(cfg, run_name) or "", monitor.tasks)
    result.run_dirs, result.index_files = write_index(root, monitor.tasks)
    return result


def check_before_launch(cfg: Config) -> Path:
    """What a local run needs that would otherwise fail inside its first tasks, with one line naming the
    key: the pipeline root (returned, created), the prompt sources, the MLflow store."""
    from dynamicrubric.store import StoreError
    from dynamicrubric.tasks import configured_prompts

    root = Path(cfg.pipeline.pipeline_root).resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()
    except OSError as e:
        raise LaunchError(f"pipeline.pipeline_root: {root}: {e.strerror}") from None
    for split in ("train", "eval"):
        try:
            configured_prompts(cfg.data, split)
        except (ValueError, OSError, StoreError) as e:
            raise LaunchError(f"data.sources: {_one_line(e)}") from None
    uri = tracking.tracking_uri(cfg)
    problem = tracking.unreachable(uri) if uri else None
    if problem:
        raise LaunchError(f"pipeline.mlflow_tracking_uri: {uri}: {problem}")
    return root


def compile_to(cfg: Config, out: str) -> str:
    from dynamicrubric.pipelines.co_evolution import compile_pipeline, task_count

    tasks = task_count(cfg)
    if tasks > 150:
        log.warning(
            "%d tasks per run: above the ~150 a cluster's workflow object holds; lower rounds or shards",
            tasks,
        )
    return compile_pipeline(cfg, out)


def submit(cfg: Config, host: str, experiment: str | None, run_name: str | None, package: str) -> str:
    """Compile and create a run on a KFP v2 API server; returns the KFP run id."""
    import kfp

    from dynamicrubric.pipelines.co_evolution import default_run_name

    if not cfg.pipeline.pipeline_root.startswith(("s3://", "minio://", "gs://")):
        raise LaunchError(
            f"pipeline.pipeline_root: {cfg.pipeline.pipeline_root!r} is local; a cluster run needs an object-store "
            "root such as s3://bucket/runs"
        )
    if tracking.tracking_uri(cfg).startswith("sqlite"):
        raise LaunchError(
            "pipeline.mlflow_tracking_uri: a sqlite file is not reachable from cluster pods; "
            "use the MLflow server's http:// URI (see docs/deploy.md)"
        )
    compile_to(cfg, package)
    name = run_name or default_run_name(cfg)
    try:
        with warnings.catch_warnings():  # kfp.Client warns about its own future defaults on every call
            warnings.simplefilter("ignore", FutureWarning)
            client = kfp.Client(host=host)
        run = client.create_run_from_pipeline_package(
            package,
            arguments={"config_yaml": cfg.to_yaml(), "run_name": name},
            run_name=name,
            experiment_name=experiment or cfg.pipeline.experiment,
            pipeline_root=cfg.pipeline.pipeline_root,
            enable_caching=cfg.pipeline.caching,
            # None: the server's default identity (`default-editor` in a multi-user Kubeflow profile)
            service_account=cfg.pipeline.service_account or None,
        )
    except Exception as e:  # kfp_server_api and urllib3 errors carry multi-line bodies
        raise LaunchError(f"{host}: submitting the pipeline failed: {_one_line(e)}") from e
    return run.run_id


def _one_line(e: Exception) -> str:
    """The server's own message for an HTTP error (str() of an ApiException is just "(400)" first),
    else the exception's first line."""

    import kfp_server_api

    if isinstance(e, kfp_server_api.ApiException):
        body = e.body.decode(errors="replace") if isinstance(e.body, bytes) else (e.body or "")
        try:
            message = json.loads(body).get("message") or body
        except (ValueError, AttributeError):
            message = body
        lines = str(message).strip().splitlines()
        return f"HTTP {e.status} {e.reason}: {lines[0] if lines else '(no message)'}"
    lines = str(e).strip().splitlines()
    return lines[0] if lines else repr(e)
