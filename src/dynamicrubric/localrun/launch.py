"""Run the pipeline locally with kfp.local, compile it, or submit it to a Kubeflow Pipelines host.

A schedule with `pipeline.rounds_per_run` is a chain of runs, one per segment of rounds
(run_plan.segments), so that no run's Argo Workflow object nears Argo's 1 MiB limit. Each segment
after the first starts from the previous one's final policy and generator, found in MLflow (the
LoggedModels the training stages log), and every segment runs under the same run name, so MLflow
keeps one parent run for the chain. Locally the segments run one after another; on a cluster
`submit` creates a segment's run, waits for it to end, then creates the next, and a rerun of the
same command skips the segments MLflow records as done. Between segments the chain stops where
`pipeline.early_stop_tie_rate` would have stopped one long run.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from dynamicrubric.infra import tracking, tracking_runs
from dynamicrubric.infra.config import Config
from dynamicrubric.localrun.task_monitor import TaskMonitor, write_index

log = logging.getLogger(__name__)

FINAL_STATES = ("SUCCEEDED", "FAILED", "SKIPPED", "CANCELED", "CANCELING")


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
    from dynamicrubric.pipelines.run_plan import default_run_name

    return f"{default_run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_local(cfg: Config, *, verbose: bool = False, fresh: bool = False) -> LocalRun:
    """Run every stage in subprocesses on this machine.

    Each task's output goes to `task.log` in its folder; the terminal gets one line per task (or every
    line with `verbose`), the tasks' progress bars, and a failing task's last lines. An index of the
    tasks is written to the run folder (see `write_index`).
    """
    from kfp import local

    from dynamicrubric.pipelines.co_evolution import build_pipeline
    from dynamicrubric.pipelines.run_plan import default_run_name, segments

    root = check_before_launch(cfg)
    chain = segments(cfg)
    if len(chain) > 1 and not tracking.tracking_uri(cfg):
        raise LaunchError(
            "pipeline.rounds_per_run: a chained run finds each segment's start in MLflow; "
            "set pipeline.mlflow_tracking_uri"
        )
    # use_venv=False: the tasks run with this interpreter, which already has the project installed.
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(root),
        enable_caching=cfg.pipeline.caching,
        raise_on_error=True,
    )
    run_name = fresh_run_name(cfg) if fresh else default_run_name(cfg)
    monitor = TaskMonitor(
        verbose=verbose, shards=cfg.pipeline.shards, tracking_uri=tracking.tracking_uri(cfg)
    )
    with monitor.installed():
        try:
            start: dict[str, str] = {}
            for first, last in chain:
                if first > 1:
                    start = segment_start(cfg, run_name, first - 1)
                    if not start:  # stopped early, inside the last segment or by the rule between them
                        break
                    log.info("rounds %d-%d start from %s", first, last, start)
                build_pipeline(cfg, first, last)(config_yaml=cfg.to_yaml(), run_name=run_name, **start)
        except RuntimeError as e:  # kfp.local raises once a task fails; the monitor printed its log
            failed = [t for t in monitor.tasks if t.get("status") == "failed"]
            where = f" (log: {failed[0]['log']})" if failed else ""
            message = re.sub(r"\x1b\[[0-9;]*m", "", _one_line(e))  # kfp colours task names
            raise LaunchError(f"the pipeline stopped: {message}{where}") from e
        finally:
            monitor.starter.stop()
    result = LocalRun(run_name, tracking.find_pipeline_run(cfg, run_name) or "", monitor.tasks)
    if result.parent_run_id:
        tracking_runs.settle_spans(cfg, result.parent_run_id)
    result.run_dirs, result.index_files = write_index(root, monitor.tasks)
    return result


def check_before_launch(cfg: Config) -> Path:
    """What a local run needs that would otherwise fail inside its first tasks, with one line naming the
    key: the pipeline root (returned, created), the prompt sources, the MLflow store."""
    from dynamicrubric.store import StoreError
    from dynamicrubric.tasks import configured_prompts

    try:
        root = Path(cfg.pipeline.pipeline_root).resolve()
    except RuntimeError:  # Python 3.11's Path.resolve on a symlink loop
        raise LaunchError(f"pipeline.pipeline_root: {cfg.pipeline.pipeline_root}: a symlink loop") from None
    # The root is created only once every check has passed: a refusal writes nothing (an empty runs/
    # was left). Until then, the nearest folder that exists must be one this user can create it in.
    there = next(p for p in (root, *root.parents) if p.exists())
    if not there.is_dir():
        raise LaunchError(f"pipeline.pipeline_root: {root}: {os.strerror(errno.ENOTDIR)}")
    if not os.access(there, os.W_OK | os.X_OK):
        raise LaunchError(f"pipeline.pipeline_root: {root}: {os.strerror(errno.EACCES)}")
    for split in ("train", "eval"):
        try:
            configured_prompts(cfg.data, split)
        except (ValueError, OSError, StoreError) as e:
            raise LaunchError(f"data.sources: {_one_line(e)}") from None
    uri = tracking.tracking_uri(cfg)
    problem = tracking.unreachable(uri) if uri else None
    if problem:
        raise LaunchError(f"pipeline.mlflow_tracking_uri: {uri}: {problem}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()
    except OSError as e:
        raise LaunchError(f"pipeline.pipeline_root: {root}: {e.strerror}") from None
    return root


def segment_start(cfg: Config, run_name: str, last: int) -> dict[str, str]:
    """The start parameters of the segment after round `last` (run_plan.start_parameters): round
    `last`'s policy and generator checkpoints as MLflow records them. {} where the run stopped: round
    `last` never ran (the early-stop rule inside a segment skipped it) or its audit tie rate is at
    `pipeline.early_stop_tie_rate` (the rule that one long run would have applied after it), or the
    signal guard fired with `guard.action` stop. With `guard.action` rollback the start is what round
    `last`'s rollback task chose. A round that ran but whose checkpoints MLflow lacks is an error: the
    chain cannot go on."""
    from dynamicrubric.pipelines.run_plan import guard_action, pipeline_variant, start_parameters

    # With guard.action rollback, round `last`'s rollback task chose the next start (its own checkpoints
    # or the last healthy round's) and logged it as "<role>-start-round-<last+1>".
    rolled = guard_action(cfg) == "rollback"
    found = {
        p: tracking.find_model_uri(
            cfg,
            run_name,
            f"{p.removeprefix('start_')}-start-round-{last + 1}"
            if rolled
            else f"{p.removeprefix('start_')}-round-{last}",
        )
        for p in start_parameters(cfg)
    }
    if guard_action(cfg) == "stop":
        if not found["start_policy"]:  # an earlier round's guard fired inside the segment
            log.warning("round %d did not run (guard.action stop): the chain ends there", last)
            return {}
        if tracking.round_metric(cfg, run_name, last, "evaluate", "guard/healthy") == 0:
            log.warning("round %d's signal guard fired (guard.action stop): the chain stops there", last)
            return {}
    threshold = cfg.pipeline.early_stop_tie_rate
    if threshold is not None and pipeline_variant(cfg) != "verifiable":
        if not found["start_policy"]:  # its segment ended (no failure), so the rule skipped the round
            log.warning("round %d did not run (pipeline.early_stop_tie_rate): the chain ends there", last)
            return {}
        audit = "audit-after-aggregate" if pipeline_variant(cfg) == "dynamic" else "audit-aggregate"
        tie_rate = tracking.round_metric(cfg, run_name, last, audit, "tie_rate")
        if tie_rate is not None and tie_rate >= threshold:
            log.warning(
                "round %d's evaluator ties %.3g of the probe samples (pipeline.early_stop_tie_rate %.3g): "
                "the chain stops there",
                last,
                tie_rate,
                threshold,
            )
            return {}
    missing = [
        p.removeprefix("start_") + (f"-start-round-{last + 1}" if rolled else f"-round-{last}")
        for p, uri in found.items()
        if not uri
    ]
    if missing:
        raise LaunchError(
            f"run {run_name}: MLflow ({tracking.tracking_uri(cfg)}) has no {' or '.join(missing)} checkpoint, "
            f"which the rounds after {last} start from"
        )
    return {p: uri for p, uri in found.items() if uri}


def package_paths(out: str, chain: list[tuple[int, int]]) -> list[str]:
    """Where `compile` writes each segment's package: `out` itself for one segment; else beside it,
    `<stem>-rounds-<first>-<last><suffix>` (`out` a file name), or `co_evolution-rounds-<first>-<last>.yaml`
    inside `out` (an existing folder, or a name ending in /). Round numbers are zero-padded so the
    files sort in the order they run."""
    if len(chain) == 1:
        return [out]
    width = len(str(chain[-1][1]))
    path = Path(out)
    if out.endswith("/") or path.is_dir():
        folder, stem, suffix = path, "co_evolution", ".yaml"
    else:
        folder, stem, suffix = path.parent, path.stem, path.suffix or ".yaml"
    return [str(folder / f"{stem}-rounds-{a:0{width}d}-{b:0{width}d}{suffix}") for a, b in chain]


def compile_to(cfg: Config, out: str) -> list[str]:
    """Compile the pipeline to `out`, or one package per segment of a chained schedule
    (`package_paths`); return the paths. A package over MAX_PACKAGE_BYTES is refused with the
    `pipeline.rounds_per_run` that fits."""
    from dynamicrubric.pipelines.co_evolution import MAX_PACKAGE_BYTES, compile_pipeline
    from dynamicrubric.pipelines.run_plan import segments

    chain = segments(cfg)
    paths = package_paths(out, chain)
    if len(paths) > 1:
        Path(paths[0]).parent.mkdir(parents=True, exist_ok=True)
    for (first, last), path in zip(chain, paths, strict=True):
        compile_pipeline(cfg, path, first, last)
        size = Path(path).stat().st_size
        if size > MAX_PACKAGE_BYTES:
            Path(path).unlink()
            fit = rounds_that_fit(cfg)
            split = (
                f"split it with pipeline.rounds_per_run: {fit} (or --rounds-per-run {fit})"
                if fit
                else "even one round is over it: lower pipeline.shards"
            )
            # one line, short enough that the CLI prints it whole (cli_errors.MAX_ERROR_CHARS)
            raise LaunchError(
                f"the package of rounds {first}-{last} would be {size / 1024:.0f} KiB, over the "
                f"{MAX_PACKAGE_BYTES // 1024} KiB limit (its Argo Workflow, several times larger, must stay "
                f"under Argo's 1 MiB): {split}"
            )
    return paths


def rounds_that_fit(cfg: Config) -> int:
    """The most rounds per run whose packages stay under MAX_PACKAGE_BYTES (0: not even one). Measured
    by compiling: a segment after the first (it has the start parameters) of r rounds."""
    from dynamicrubric.pipelines.co_evolution import MAX_PACKAGE_BYTES, compile_pipeline

    rounds = cfg.pipeline.rounds
    fits = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(1, rounds + 1):
            first = 2 if r < rounds else 1  # a later segment where there is one
            package = compile_pipeline(cfg, f"{tmp}/r{r}.yaml", first, first + r - 1)
            if Path(package).stat().st_size > MAX_PACKAGE_BYTES:
                break
            fits = r
    return fits


def submit(
    cfg: Config,
    host: str,
    experiment: str | None,
    run_name: str | None,
    package: str,
    *,
    poll_s: float = 30.0,
    say=print,
) -> list[str]:
    """Compile and create the run on a KFP v2 API server; return the KFP run ids created.

    A chained schedule (`pipeline.rounds_per_run`) is one run per segment: each is created once the
    one before it has succeeded (polled every `poll_s` seconds, a line through `say` when its state
    changes), with the previous segment's final checkpoints from MLflow. A segment whose last round's
    checkpoints MLflow already records under this run name is skipped, so rerunning the same command
    resumes a chain."""
    import kfp

    from dynamicrubric.pipelines.run_plan import default_run_name, segments

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
    chain = segments(cfg)
    packages = compile_to(cfg, package if len(chain) == 1 else str(Path(package).parent) + "/")
    name = run_name or default_run_name(cfg)
    try:
        with warnings.catch_warnings():  # kfp.Client warns about its own future defaults on every call
            warnings.simplefilter("ignore", FutureWarning)
            client = kfp.Client(host=host)
    except Exception as e:  # kfp_server_api and urllib3 errors carry multi-line bodies
        raise LaunchError(f"{host}: submitting the pipeline failed: {_one_line(e)}") from e
    created: list[str] = []
    start: dict[str, str] = {}
    for (first, last), path in zip(chain, packages, strict=True):
        if first > 1:
            start = segment_start(cfg, name, first - 1)
            if not start:
                break
        if len(chain) > 1:
            done = tracking.find_model_uri(cfg, name, f"policy-round-{last}")
            if done:
                say(
                    f"rounds {first}-{last}: done already (MLflow has policy-round-{last} of {name}); skipped"
                )
                continue
        display = name if len(chain) == 1 else f"{name}-rounds-{first}-{last}"
        arguments = {"config_yaml": cfg.to_yaml(), "run_name": name, **start}
        try:
            run = client.create_run_from_pipeline_package(
                path,
                arguments=arguments,
                run_name=display,
                experiment_name=experiment or cfg.pipeline.experiment,
                pipeline_root=cfg.pipeline.pipeline_root,
                enable_caching=cfg.pipeline.caching,
                # None: the server's default identity (`default-editor` in a multi-user Kubeflow profile)
                service_account=cfg.pipeline.service_account or None,
            )
        except Exception as e:  # kfp_server_api and urllib3 errors carry multi-line bodies
            raise LaunchError(f"{host}: submitting the pipeline failed: {_one_line(e)}") from e
        created.append(run.run_id)
        say(
            f"submitted run {run.run_id} to {host}" + ("" if len(chain) == 1 else f" (rounds {first}-{last})")
        )
        if len(chain) > 1 and last < cfg.pipeline.rounds:  # the next segment needs this one's checkpoints
            wait_for_run(client, run.run_id, f"rounds {first}-{last}", poll_s, say)
    return created


def wait_for_run(client, run_id: str, what: str, poll_s: float, say=print) -> None:
    """Poll a KFP run until it ends, with a line whenever its state changes; a run that does not
    succeed is an error that names it."""
    state, started = "", time.monotonic()
    while True:
        try:
            current = client.get_run(run_id).state or "PENDING"
        except Exception as e:  # a transient error of the API server must not lose the chain's place
            log.warning("run %s: %s; asking again in %.0f s", run_id, _one_line(e), poll_s)
            current = state
        if current != state:
            state = current
            say(f"{what}: run {run_id} {state} ({time.monotonic() - started:.0f} s)")
        if state in FINAL_STATES:
            break
        time.sleep(poll_s)
    if state != "SUCCEEDED":
        raise LaunchError(
            f"run {run_id} ({what}) ended {state}; fix what failed and rerun the same command: "
            "segments MLflow records as done are skipped"
        )


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
