"""kfp.local's tasks watched as they run: each task's process started (forked from the preloaded
server, task_processes.py) with its share of the cores, its output kept in `task.log`, one line on
the terminal when it ends, and the run's `index.json` of every task's round, role, stage, shard and
artifacts."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from dynamicrubric.infra import logs, tracking_runs
from dynamicrubric.infra.config import STAGE_FACTS
from dynamicrubric.localrun.task_processes import TaskStarter

log = logging.getLogger(__name__)


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


# ------------------------------------------------------------------------------------------------
# One line per task: kfp.local's task subprocesses, with their output kept in a file
# ------------------------------------------------------------------------------------------------

# tqdm's bar ("desc:  40%|####      | 4/10 [00:02<00:03, 2.00batch/s]") and its no-total form.
PROGRESS_LINE = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\|\s*\d+/\d+ \[|\d+(?:\.\d+)?\w*/s\]")
CURSOR_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # ANSI control sequences (tqdm's cursor moves)
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
        self._kfp_filter = _KfpInfoFilter(verbose)  # replaced by the one a run installs (routed)

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
        kfp_filter = self._kfp_filter = _KfpInfoFilter(self.verbose)
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
        env[tracking_runs.TASK_STARTED_ENV] = repr(time.time())  # the stage run starts with the task's time
        numbers: dict = {}
        tty = self.err.isatty()
        if tty:  # a person watches: the task keeps the libraries' bars too (logs.quiet_progress_off_terminal)
            env[logs.TERMINAL_ENV] = "1"
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
                            # without the cursor moves of stacked bars (\x1b[A): a file shows them raw
                            self._write(self.err, f"{label}: {CURSOR_CODES.sub('', text).strip()}\n")
                            last_bar = now
            log_file.write(pending)
            # with the processes it waited for (a trainer's `accelerate launch` children): how many
            # cores the task kept busy and how much memory its largest process held
            code, usage = task.wait()
        seconds = time.monotonic() - started
        run_id = numbers.pop(logs.RUN_KEY, None)
        if code == 0 and run_id and self.tracking_uri:
            try:
                tracking_runs.end_stage_run_at(self.tracking_uri, str(run_id), time.time())
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
        elif code in STOPPED_CODES:
            # Stopped by a Ctrl-C or a pod's stop (stopping.py): the run reports it in one line, so
            # neither this task nor kfp's record of it as a failure adds one.
            entry["status"] = "stopped"
            self._kfp_filter.quiet = True
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


# A task's exit code when a SIGINT or SIGTERM stopped it: 128 + the signal from stopping.Stopped, or
# the negative signal number of a process the signal ended before it could say so.
STOPPED_CODES = {128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM}


class _KfpInfoFilter(logging.Filter):
    """Drops kfp.local's INFO records (it logs through the root logger) unless verbose."""

    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose
        self.quiet = False  # a task was stopped: kfp's records of the run's end say nothing more

    def filter(self, record: logging.LogRecord) -> bool:
        from_kfp = f"{os.sep}kfp{os.sep}" in record.pathname
        if from_kfp and self.quiet:
            return False
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
