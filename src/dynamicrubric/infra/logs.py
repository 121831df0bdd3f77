"""One log format for every process, and the one-line task summary a stage hands to `dynrubric run`.

`dynrubric run` shows one line per pipeline task. Each task runs in its own process (kfp.local), so a
stage prints its key numbers as one marked line on stdout (`emit_summary`); the launcher keeps the
task's whole output in a log file and shows that marked line alone (see launch.py).
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import math
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"
SUMMARY_MARK = "::dynrubric-summary::"
SUMMARY_ENV = "DYNRUBRIC_TASK_SUMMARY"  # set by `dynrubric run` for its tasks: only they print the line
# Set by `dynrubric run` for its tasks when its own stderr is a terminal: a task's stderr is always a
# pipe to the run, which redraws the tasks' bars in place only for a person watching.
TERMINAL_ENV = "DYNRUBRIC_TERMINAL"
# The loggers whose INFO lines a user reads: the library's, a module run as a script, the benchmarks.
PROJECT_LOGGERS = ("dynamicrubric", "__main__", "bench")


class LibraryInfoFilter(logging.Filter):
    """Drops other libraries' records below WARNING (matplotlib's "generated new fontManager", ...):
    what a user reads at the default level is the project's own lines and everyone's warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".")[0] in PROJECT_LOGGERS


def setup(verbose: bool = False) -> None:
    """Configure the root logger: our format on its handlers, and the level; off a terminal, no
    third-party progress bars (`quiet_progress_off_terminal`). `verbose` shows every library's lines."""
    level = logging.DEBUG if verbose else logging.INFO
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level, format=FORMAT, datefmt=DATEFMT)
    else:  # e.g. the KFP executor's own handler in a task process: our format for what follows
        for handler in root.handlers:
            handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
    root.setLevel(level)
    for handler in root.handlers:  # once per handler, however often setup runs in one process
        for old in [f for f in handler.filters if isinstance(f, LibraryInfoFilter)]:
            handler.removeFilter(old)
        if not verbose:
            handler.addFilter(LibraryInfoFilter())
    quiet_progress_off_terminal()


def quiet_progress_off_terminal() -> None:
    """Turn off Hugging Face's progress bars (transformers' "Loading weights", "Writing model shards",
    the hub's and datasets') unless a person watches: in a log file, CI or `kubectl logs` each redraw is
    a line of its own, with cursor codes. The project's own bars (engines.base.progress_bar) stay: they
    refresh every few seconds off a terminal and carry the stage's rate. Libraries imported later read
    the environment; those already imported (a task forked from the preloading server) are told now."""
    if sys.stderr.isatty() or os.environ.get(TERMINAL_ENV) == "1":
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()


def skip_the_exit_collection() -> None:
    """Exit without Python's last full garbage collection: with torch, transformers and mlflow loaded it
    walks millions of objects for 1-2 s (measured: `import torch, mlflow` exits in 1.06 s, 0.19 s with
    this), a cost every task process pays once more after its work is written. Registered once per
    process; see `_freeze_at_exit`."""
    if not getattr(skip_the_exit_collection, "registered", False):
        atexit.register(_freeze_at_exit)
        skip_the_exit_collection.registered = True


def _freeze_at_exit() -> None:
    """`gc.freeze()` moves every live object out of the collector's reach; objects still referenced are
    freed as the interpreter tears down, as before, and only garbage in reference cycles is left to the
    OS. Not where triton is loaded (TRL imports it): its nanobind bindings print a page of "leaked
    instance" warnings when their objects outlive the module."""
    if "triton" not in sys.modules:
        gc.freeze()


RUN_KEY = "mlflow_run_id"  # in the summary line: the stage run `dynrubric run` ends at the task's exit


def emit_summary(numbers: dict[str, object], run_id: str | None = None) -> None:
    """Print a stage's key numbers as one marked line (finite numbers only, at most 8 of them), and
    the id of its MLflow run, when the process is a task of `dynrubric run` (elsewhere the line would
    only be noise)."""
    if not os.environ.get(SUMMARY_ENV):
        return
    finite = {
        k: v
        for k, v in numbers.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    keep: dict[str, object] = dict(list(finite.items())[:8])
    if run_id:
        keep[RUN_KEY] = run_id
    sys.stdout.write(SUMMARY_MARK + json.dumps(keep) + "\n")
    sys.stdout.flush()


def parse_summary(line: str) -> dict[str, object] | None:
    """The numbers (and RUN_KEY) of a line written by `emit_summary`, or None for any other line."""
    text = line.strip()
    if not text.startswith(SUMMARY_MARK):
        return None
    try:
        numbers = json.loads(text.removeprefix(SUMMARY_MARK))
    except ValueError:
        return None
    return numbers if isinstance(numbers, dict) else None


def format_numbers(numbers: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items())
