"""Run the pipeline locally with kfp.local, compile it, or submit it to a Kubeflow Pipelines host."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dynamicrubric import logs, tracking
from dynamicrubric.config import STAGE_FACTS, Config
from dynamicrubric.stats import wilson_interval
from dynamicrubric.task_processes import TaskStarter

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


def task_threads(
    entry: dict, shards: int, environ: dict[str, str] | None = None, cores: int | None = None
) -> str:
    """OMP_NUM_THREADS for one locally run task: the user's own setting, else this machine's cores
    shared among the tasks that run beside it.

    kfp.local runs a pipeline's tasks one at a time except the iterations of a shard loop
    (ParallelFor with parallelism = pipeline.shards), so a task with a `shard` runs beside its
    `shards` siblings and every other task (training, evaluate, aggregate) runs alone and gets all the
    cores. torch starts one thread per core in every process; two processes whose threads fight for
    the same few cores run several times slower than with a share each (5-13x measured on 2 cores).
    A task that sets its own count (the trainers' `torch_threads`) still wins.
    """
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS"):
        return environ["OMP_NUM_THREADS"]
    cores = cores or len(os.sched_getaffinity(0))
    beside = max(1, shards) if entry.get("shard") is not None else 1
    return str(max(1, cores // beside))


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
    import json

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


# ------------------------------------------------------------------------------------------------
# One line per task: kfp.local's task subprocesses, with their output kept in a file
# ------------------------------------------------------------------------------------------------

# tqdm's bar ("desc:  40%|####      | 4/10 [00:02<00:03, 2.00batch/s]") and its no-total form.
PROGRESS_LINE = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\|\s*\d+/\d+ \[|\d+(?:\.\d+)?\w*/s\]")
FAILED_TAIL_LINES = 40
# kfp.local warns once per task about settings that only a cluster uses (images, display names).
KFP_NOISE = (r".*non-Python base image.*", r".*have no effect in the current local runner.*")


def _component_role(component: str) -> str:
    """A task's role when its component has no `label` parameter (config.STAGE_FACTS)."""
    facts = STAGE_FACTS.get(component)
    return facts.role if facts else ""


def _executor_input(full_command: list[str]) -> tuple[str, dict]:
    """The component function's name and the executor input from a kfp.local task command."""
    args = dict(zip(full_command, full_command[1:], strict=False))
    try:
        executor_input = json.loads(args.get("--executor_input", "{}"))
    except ValueError:
        executor_input = {}
    return args.get("--function_to_execute", "?"), executor_input


def task_entry(component: str, executor_input: dict) -> dict:
    """A task's index entry: its folder, round, role, stage, shard and artifact URIs."""
    inputs, outputs = executor_input.get("inputs", {}), executor_input.get("outputs", {})
    params = inputs.get("parameterValues", {})
    role = params.get("label") or _component_role(component)
    folder = str(Path(outputs.get("outputFile", "")).parent) if outputs.get("outputFile") else ""

    def uris(section: dict) -> dict[str, list[str]]:
        return {
            name: [a.get("uri", "") for a in group.get("artifacts", [])]
            for name, group in section.get("artifacts", {}).items()
        }

    return {
        "folder": folder,
        "component": component,
        "stage": component.replace("_", "-"),
        "round": int(params.get("round_idx", 0)),
        "role": role,
        "shard": int(params["shard"]) if "shard" in params else None,
        "inputs": uris(inputs),
        "outputs": uris(outputs),
        "cached": False,
    }


def _uris(value) -> list[str]:
    values = value if isinstance(value, list) else [value]
    return [v.uri for v in values if hasattr(v, "uri")]


def _cached_entry(task_spec, io_store, outputs: dict) -> dict:
    """The index entry of a task taken from the cache, from the arguments kfp.local resolved for it."""
    from kfp.local.orchestrator.orchestrator_utils import OrchestratorUtils

    component = re.sub(r"-\d+$", "", task_spec.component_ref.name.removeprefix("comp-")).replace("-", "_")
    try:
        arguments = OrchestratorUtils.make_task_arguments(task_spec.inputs, io_store)
    except Exception as e:  # the index is a convenience: never fail a run over it
        log.debug("index: arguments of cached task %s: %s", component, e)
        arguments = {}
    params = {k: v for k, v in arguments.items() if not _uris(v)}
    output_uris = {name: _uris(v) for name, v in outputs.items() if _uris(v)}
    first = next((u for us in output_uris.values() for u in us), "")
    return {
        "folder": str(Path(first).parent) if first else "",
        "component": component,
        "stage": component.replace("_", "-"),
        "round": int(params.get("round_idx", 0)),
        "role": params.get("label") or _component_role(component),
        "shard": int(params["shard"]) if "shard" in params else None,
        "inputs": {name: _uris(v) for name, v in arguments.items() if _uris(v)},
        "outputs": output_uris,
        "cached": True,
        "status": "cached",
    }


def task_label(entry: dict) -> str:
    parts = [f"r{entry['round']}" if entry["round"] else "setup", entry["role"], entry["stage"]]
    if entry["shard"] is not None:
        parts.append(f"shard {entry['shard']}")
    return " ".join(p for p in parts if p)


class TaskMonitor:
    """Stands in for kfp.local's task runner output while a pipeline runs (see `installed`)."""

    def __init__(
        self,
        verbose: bool = False,
        out=None,
        err=None,
        shards: int | None = None,
        cores: int | None = None,
        tracking_uri: str = "",
        preload: bool = True,
    ):
        self.verbose = verbose
        self.starter = TaskStarter(preload)  # tasks forked from a server that has the imports done
        self.tracking_uri = tracking_uri  # where the tasks' stage runs are, to end them at the exit
        # Side-by-side tasks of a shard loop, to set each task's OMP_NUM_THREADS (see task_threads);
        # None: every task inherits this process's setting.
        self.shards = shards
        self.cores = cores
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.tasks: list[dict] = []
        self._lock = threading.Lock()
        self._local = threading.local()  # the entry of the task this worker thread is running

    def _write(self, stream, text: str) -> None:
        with self._lock:
            stream.write(text)
            stream.flush()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Route kfp.local's task processes through `run_task`, and drop its own chatter (its INFO
        lines, rules, indentation and the warnings about cluster-only settings) unless verbose.

        kfp.local has no option for any of this; it calls these module attributes at run time, so
        they are swapped for the run and put back after it.
        """
        from kfp.local import logging_utils, subprocess_task_handler
        from kfp.local.orchestrator import task_executor

        saved = [
            (subprocess_task_handler, "run_local_subprocess", self.run_task),
            (task_executor, "execute_single_task", self._wrap_execute(task_executor.execute_single_task)),
            # kfp's own handler and format while it logs: one log format, ours
            (logging_utils, "local_logger_context", contextlib.nullcontext),
            # it swaps builtins.print for an indenting one, which parallel workers race on
            (logging_utils, "indented_print", contextlib.nullcontext),
            (logging_utils, "print_horizontal_line", lambda: None),
        ]
        originals = [(module, name, getattr(module, name)) for module, name, _ in saved]
        kfp_filter = _KfpInfoFilter(self.verbose)
        handlers = logging.getLogger().handlers
        with warnings.catch_warnings():
            if not self.verbose:
                for pattern in KFP_NOISE:
                    warnings.filterwarnings("ignore", message=pattern)
            for module, name, replacement in saved:
                setattr(module, name, replacement)
            for handler in handlers:
                handler.addFilter(kfp_filter)
            try:
                yield
            finally:
                for module, name, original in originals:
                    setattr(module, name, original)
                for handler in handlers:
                    handler.removeFilter(kfp_filter)

    def _wrap_execute(self, execute):
        """Index every task, cached or not (a cache hit never reaches run_task)."""

        def execute_single_task(task_name, task_spec, *args, **kwargs):
            self._local.entry = None
            outputs, status = execute(task_name, task_spec, *args, **kwargs)
            entry = self._local.entry
            if entry is None:  # a cache hit: nothing ran
                entry = _cached_entry(task_spec, kwargs.get("io_store"), outputs or {})
                with self._lock:
                    self.tasks.append(entry)
            return outputs, status

        return execute_single_task

    def run_task(self, full_command: list[str], env_vars: dict[str, str] | None = None) -> int:
        """Run one task process; keep all its output in `<task folder>/task.log`; return its exit code."""
        component, executor_input = _executor_input(full_command)
        entry = task_entry(component, executor_input)
        self._local.entry = entry
        with self._lock:
            self.tasks.append(entry)
        label = task_label(entry)
        # kfp.local always names an executor output file; without one the log goes to a temporary folder
        folder = Path(entry["folder"] or tempfile.mkdtemp(prefix="dynrubric-task-"))
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / "task.log"
        entry["log"] = str(log_path)
        # the task's share of cores over this process's own environment; a component's env_vars win over both
        share = {}
        if self.shards is not None:
            entry["threads"] = int(task_threads(entry, self.shards, cores=self.cores))
            share = {"OMP_NUM_THREADS": str(entry["threads"])}
        started = time.monotonic()
        env = {**os.environ, **share, **(env_vars or {}), logs.SUMMARY_ENV: "1"}
        env[tracking.TASK_STARTED_ENV] = repr(time.time())  # the stage run starts with the task's time
        numbers: dict = {}
        tty = self.err.isatty()
        last_bar = 0.0
        task = self.starter.start(full_command, env, own_env=env_vars or {})
        with open(log_path, "wb") as log_file:
            pending = b""
            while chunk := task.output.read1(65536):
                log_file.write(chunk)
                pending += chunk
                *segments, pending = re.split(rb"(?<=[\r\n])", pending)
                for raw in segments:
                    text = raw.decode(errors="replace").rstrip("\r\n")
                    summary = logs.parse_summary(text)
                    if summary is not None:
                        numbers.update(summary)
                    elif self.verbose:
                        self._write(self.out, f"  [{label}] {text}\n")
                    elif text.strip() and PROGRESS_LINE.search(text):
                        now = time.monotonic()
                        if tty and now - last_bar > 0.2:  # a live bar, redrawn in place
                            self._write(self.err, f"\r\x1b[2K{label}: {text.strip()}")
                            last_bar = now
                        elif not tty and now - last_bar > 30:  # a log file: one bar line in 30 s
                            self._write(self.err, f"{label}: {text.strip()}\n")
                            last_bar = now
            log_file.write(pending)
            # with the processes it waited for (a trainer's `accelerate launch` children): how many
            # cores the task kept busy and how much memory its largest process held
            code, usage = task.wait()
        seconds = time.monotonic() - started
        run_id = numbers.pop(logs.RUN_KEY, None)
        if code == 0 and run_id and self.tracking_uri:
            try:
                tracking.end_stage_run_at(self.tracking_uri, str(run_id), time.time())
            except Exception as e:  # the task's result stands; only its run's end time is off
                log.warning("MLflow: could not move the end of run %s to its task's exit: %s", run_id, e)
        entry["seconds"] = round(seconds, 1)
        entry["cpu_user_s"] = round(usage.user_s, 1)
        entry["cpu_sys_s"] = round(usage.sys_s, 1)
        entry["max_rss_mb"] = round(usage.max_rss_kib * 1024 / 1e6)  # MB (10^6 B)
        cores_busy = (usage.user_s + usage.sys_s) / max(seconds, 1e-9)
        entry["numbers"] = numbers
        clear = "\r\x1b[2K" if tty else ""
        stamp = time.strftime("%H:%M:%S")
        if code == 0:
            entry["status"] = "ok"
            numbers.pop("time_s", None)
            self._write(
                self.out,
                f"{clear}{stamp} done   {label:<34} {seconds:6.1f}s  cpu {cores_busy:3.1f}x  "
                f"rss {entry['max_rss_mb'] / 1000:4.1f} GB  {logs.format_numbers(numbers)}\n",
            )
        else:
            entry["status"] = "failed"
            tail = log_path.read_text(errors="replace").splitlines()[-FAILED_TAIL_LINES:]
            body = "".join(f"    {line}\n" for line in tail)
            self._write(
                self.err,
                f"{clear}{stamp} FAILED {label} after {seconds:.1f}s (exit code {code}); "
                f"the last lines of {log_path}:\n{body}",
            )
        return code


class _KfpInfoFilter(logging.Filter):
    """Drops kfp.local's INFO records (it logs through the root logger) unless verbose."""

    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        from_kfp = f"{os.sep}kfp{os.sep}" in record.pathname
        return self.verbose or not from_kfp or record.levelno >= logging.WARNING


def write_index(root: Path, tasks: list[dict]) -> tuple[list[str], list[str]]:
    """Write `index.json` into each pipeline-run folder that this run wrote to; return the folders
    and the files.

    kfp.local names task folders after its own DAG (`for-loop-4-iteration-1/rollout-2`); the index
    says which round, role, stage and shard each one is, where its log is, and which artifact files
    it read and wrote (Parquet files, named after the component's outputs, without an extension).
    A fully cached run writes no folder of its own: its index goes to the folder its outputs are in.
    """

    def run_dir(uri: str) -> str | None:
        try:
            rel = Path(uri).resolve().relative_to(root)
        except ValueError:
            return None
        return str(root / rel.parts[0]) if rel.parts else None

    ran = [t for t in tasks if not t["cached"] and t["folder"]]
    dirs = Counter(d for t in ran if (d := run_dir(t["folder"])))
    if not dirs:
        dirs = Counter(d for t in tasks for uris in t["outputs"].values() for u in uris if (d := run_dir(u)))
    written = []
    for folder in dirs:
        entries = []
        for t in tasks:
            entry = dict(t)
            if entry["folder"] and run_dir(entry["folder"]) == folder:
                entry["folder"] = str(Path(entry["folder"]).relative_to(folder))
            entries.append(entry)
        entries.sort(
            key=lambda e: (e["round"] is None, e["round"] or 0, e["role"], e["stage"], e["shard"] or 0)
        )
        index = Path(folder) / "index.json"
        tmp = index.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"run_folder": folder, "tasks": entries}, indent=1) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, index)  # atomic
        written.append(str(index))
    return list(dirs), written


# ------------------------------------------------------------------------------------------------
# The round table
# ------------------------------------------------------------------------------------------------

# Columns of the round table: (header, metric source stage, metric, sample-size metric, meaning).
SMALL_N = 100  # below this many samples an accuracy gets its 95% interval

LEGEND = [
    (
        "mean_gap",
        "mean score gap E(best) - E(other) of the policy's responses, by G_t's rubrics (higher is better)",
    ),
    ("tie_rate", "share of response pairs with equal scores (a tie gives the policy no direction)"),
    ("uniformity", "share of candidate sets whose responses all scored the same"),
    ("evaluator_acc", "pairwise accuracy of the evaluator on labelled lists; n = labelled pairs"),
    ("policy_acc", "accuracy of P_t on held-out prompts; n = scored samples"),
    ("win_rate", "share of held-out prompts where P_t beats P_t-1 (ties count half); n = prompts"),
]


def round_table(cfg: Config, parent_run_id: str) -> list[dict]:
    """Per-round headline numbers from MLflow: the signal audit of the round's evaluator on P_{t-1}'s
    probe samples (after the generator update, for the dynamic variant) and the eval results, each
    accuracy as (value, n)."""
    if not parent_run_id:
        return []
    variant = _main_variant(cfg)
    table = []
    for t, stages in sorted(tracking.stage_runs_by_round(cfg, parent_run_id).items()):
        if t == 0:
            continue  # data preparation only
        by_stage = {s.data.tags.get(tracking.STAGE_TAG): s.data.metrics for s in stages}
        agg = by_stage.get("audit-after-aggregate") or by_stage.get("audit-aggregate") or {}
        ev = by_stage.get("evaluate", {})
        table.append(
            {
                "round": t,
                "mean_gap": agg.get("mean_gap"),
                "tie_rate": agg.get("tie_rate"),
                "uniformity": agg.get("uniformity_rate"),
                "evaluator_acc": _with_n(
                    ev,
                    f"{variant}/pairwise_accuracy",
                    f"{variant}/labelled_pairs",
                    f"{variant}/labelled_lists",
                ),
                "policy_acc": _with_n(ev, "policy/accuracy", "policy/samples"),
                "win_rate": _with_n(ev, "policy/win_rate", "policy/win_rate_prompts"),
            }
        )
    return table


def _with_n(metrics: dict, key: str, n_key: str, counted: str = "") -> tuple[float, int] | None:
    """(value, n); NaN with n = 0 when the stage ran (`counted` was logged) but had nothing to measure,
    e.g. no labelled pair; None when the metric was not measured at all."""
    if not any(k in metrics for k in (key, n_key, counted) if k):
        return None
    return metrics.get(key, float("nan")), int(metrics.get(n_key, 0))


def _main_variant(cfg: Config) -> str:
    from dynamicrubric.pipelines.co_evolution import pipeline_variant

    return pipeline_variant(cfg)


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rounds recorded)"
    headers = list(rows[0])
    cells = [[_fmt(r[h]) for h in headers] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


# The built-in 135M model: numbers from it need reading at its scale (see scale_notes).
SMALL_MODEL = "smollm2-135m-instruct"


def format_legend(rows: list[dict], cfg: Config | None = None) -> str:
    shown = set(rows[0]) if rows else set()
    width = max(len(name) for name, _ in LEGEND)
    lines = [f"  {name.ljust(width)}  {meaning}" for name, meaning in LEGEND if name in shown]
    lines.append(f"  (n=…) is the sample size; [lo-hi] a 95% Wilson interval, shown when n < {SMALL_N}.")
    lines += scale_notes(cfg) if cfg is not None else []
    return "\n".join(lines)


def scale_notes(cfg: Config) -> list[str]:
    """How to read the table for this config's verdicts and, with the built-in 135M model, its size."""
    notes = []
    if cfg.aggregate.soft:
        notes.append(
            "  Scores weight each item by the verifier's P(yes) (aggregate.soft), so two responses tie only "
            "when V is equally sure of both; hard yes/no verdicts tie far more often."
        )
    if {cfg.models.policy, cfg.models.generator, cfg.models.verifier} == {SMALL_MODEL}:
        notes.append(
            "  SmolLM2-135M plays every role here: its P(yes) moves little with the response, so gaps are "
            "small, an evaluator_acc whose interval holds 0.5 is chance, and a few steps "
            "of training change nothing measurable. The run shows the signal the method trains on, end to "
            "end; docs/results.md measures what it does at this size."
        )
    return notes


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):  # (proportion, n)
        p, n = value
        if p != p:  # NaN: nothing to measure (e.g. no labelled pair)
            return f"- (n={n})"
        text = f"{p:.3f} (n={n})"
        if 0 < n < SMALL_N and 0.0 <= p <= 1.0:
            lo, hi = wilson_interval(p, n)
            text += f" [{lo:.2f}-{hi:.2f}]"
        return text
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def report(cfg: Config, result: LocalRun) -> str:
    """What `dynrubric run` prints at the end: the round table with its legend, where everything is,
    and whether anything ran at all."""
    rows = round_table(cfg, result.parent_run_id)
    out = ["", format_table(rows), "", "Legend:", format_legend(rows, cfg), ""]
    if result.tasks and result.ran == 0:
        out.append(
            f"All {len(result.tasks)} tasks were cached: nothing ran, the numbers are the earlier run's. "
            "Pass --fresh to run again (or delete "
            f"{Path(cfg.pipeline.pipeline_root).resolve() / '.kfp_cache'} to drop the cache)."
        )
    elif result.tasks and result.ran < len(result.tasks):
        out.append(
            f"{len(result.tasks) - result.ran} of {len(result.tasks)} tasks were taken from the cache."
        )
    out.append(f"Pipeline root: {Path(cfg.pipeline.pipeline_root).resolve()}")
    for folder, index in zip(result.run_dirs, result.index_files, strict=True):
        out.append(f"Run folder:    {folder}  (which task folder is which: {index})")
    plots = [
        (t.get("round") or 0, uri)
        for t in result.tasks
        if t["stage"] == "evaluate"
        for uri in t["outputs"].get("plots", [])
    ]
    if plots:
        last = max(plots)[1]
        out.append(f"Plots (PNG):   {last}  (open with any image viewer, e.g. xdg-open {last}/accuracy.png)")
    uri = tracking.tracking_uri(cfg)
    if uri and result.parent_run_id:
        out.append(f"MLflow parent run {result.parent_run_id}. Open the UI with:")
        out.append(f"  mlflow ui --backend-store-uri {uri}")
    return "\n".join(out) + "\n"
