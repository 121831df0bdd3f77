"""A tiny `dynrubric run` at the default level prints one line per task, the progress bars and the
final report, and nothing else; a rerun of the same config says that it was all cached."""

from __future__ import annotations

import re
import subprocess
import sys

from dynamicrubric.localrun.task_monitor import PROGRESS_LINE
from dynamicrubric.pipelines.run_plan import task_count

TASK_LINE = re.compile(r"^\d\d:\d\d:\d\d done   (setup|r\d+) .+ +\d+\.\ds\b")
# the round table (a line per round) and the guard's block (the same), their legend (a line per column
# shown, the benchmarks' protocol included) and where things are
REPORT_MAX_LINES = 41


def _lines(text: str) -> list[str]:
    # a live progress bar redraws itself with \r; every \r-separated piece counts as its own line here
    return [piece for line in text.splitlines() for piece in line.split("\r") if piece.strip()]


def test_one_line_per_task(tiny_run):
    cfg = tiny_run["cfg"]
    lines = _lines(tiny_run["stdout"] + tiny_run["stderr"])
    progress = [line for line in lines if PROGRESS_LINE.search(line)]
    other = [line for line in lines if not PROGRESS_LINE.search(line)]
    assert other[0].startswith("dynrubric run: preset tiny")
    tasks = [line for line in other if TASK_LINE.match(line)]
    assert len(tasks) == task_count(cfg) == len(tiny_run["index"]["tasks"])
    # everything after the task lines is the report; nothing else is printed (no kfp or MLflow chatter)
    last_task = max(i for i, line in enumerate(other) if TASK_LINE.match(line))
    assert other[1 : last_task + 1] == tasks, [
        line for line in other[1:last_task] if not TASK_LINE.match(line)
    ]
    report = other[last_task + 1 :]
    # stderr carries the progress bars only: a stray line there (a warning, a library's chatter) is named
    stray = [line for line in _lines(tiny_run["stderr"]) if not PROGRESS_LINE.search(line)]
    assert not stray, "stderr:\n" + "\n".join(stray)
    assert len(report) <= REPORT_MAX_LINES, "\n".join(report)
    noise = (
        "Executor",
        "executor_input",
        "WARNING",
        "Inferred schema",
        "base image",
        "de-quantizing",
        "INFO",
    )
    assert not [line for line in other if any(n in line for n in noise)]
    # off a terminal (this run's stderr is a pipe): no library's bars (transformers' "Loading weights",
    # "Writing model shards"), no cursor codes of stacked bars, no library's INFO line
    output = tiny_run["stdout"] + tiny_run["stderr"]
    for unwanted in ("Loading weights", "Writing model shards", "\x1b[", "matplotlib"):
        assert unwanted not in output, [line for line in lines if unwanted in line][:3]
    # every progress line names its task
    assert all(re.match(r"^(setup|r\d+) ", line.strip()) for line in progress), progress[:5]


def test_report_has_legend_sample_sizes_and_where_things_are(tiny_run):
    out = tiny_run["stdout"]
    header = next(line for line in out.splitlines() if line.strip().startswith("round"))
    for column in ("mean_gap", "tie_rate", "uniformity", "evaluator_acc", "policy_acc", "win_rate"):
        assert column in header
    lines = out.splitlines()
    start = lines.index(header)
    rounds = tiny_run["cfg"].pipeline.rounds
    rows = lines[start + 1 : start + 1 + rounds]
    assert [int(r.split()[0]) for r in rows] == list(range(1, rounds + 1))
    for row in rows:  # accuracies with their sample size, and a 95% interval for these small n
        assert re.search(r"\d\.\d{3} \(n=\d+\) \[\d\.\d\d-\d\.\d\d\]", row), row
    # the signal guard's block below it: a line per round, ending with the round's alarms
    guard = lines[start + rounds + 2]
    assert guard.split() == ["round", "gold", "agreement", "canary", "order", "len_corr", "alarm"], guard
    for row in lines[start + rounds + 3 : start + 2 * rounds + 3]:
        assert re.fullmatch(r"\s*\d+\s.*\s(quiet|[a-z,]+)", row), row
    assert "Legend:" in out and "Wilson" in out
    assert f"Run folder:    {tiny_run['run_folder']}" in out
    assert str(tiny_run["run_folder"] / "index.json") in out
    assert "Plots (PNG):" in out and "mlflow ui --backend-store-uri" in out


def test_cached_rerun_says_so(tiny_run):
    proc = subprocess.run(
        [sys.executable, "-m", "dynamicrubric.cli", "run", "--config", str(tiny_run["config"])],
        cwd=tiny_run["workdir"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    n = task_count(tiny_run["cfg"])
    assert f"All {n} tasks were cached: nothing ran" in proc.stdout
    assert "--fresh" in proc.stdout
    assert not TASK_LINE.search(proc.stdout)  # no task ran


def test_a_failing_task_shows_its_error(tmp_path):
    """The quiet log must not hide a failure: the task's own error is printed, with its log file."""
    import yaml

    bad = tmp_path / "anchors.jsonl"
    bad.write_text('{"prompt": "", "answers": []}\n')  # an empty prompt: prepare-data refuses it
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "preset": "tiny",
                "data": {"anchors": [str(bad)]},
                "pipeline": {"pipeline_root": str(tmp_path / "runs"), "rounds": 1, "shards": 1},
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "dynamicrubric.cli", "run", "--config", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1
    assert "FAILED setup prepare-data" in proc.stderr
    assert "'prompt' must be non-empty text" in proc.stderr  # the task's own error line
    assert "task.log" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the pipeline stopped"), last


def test_fresh_takes_a_new_run_name():
    """--fresh: every task's cache key includes the run name, so a new name reuses nothing."""
    from dynamicrubric.cli import build_parser
    from dynamicrubric.infra.config_loading import load_config
    from dynamicrubric.localrun.launch import fresh_run_name
    from dynamicrubric.pipelines.run_plan import default_run_name

    cfg = load_config(preset="tiny")
    assert fresh_run_name(cfg).startswith(default_run_name(cfg) + "-")
    assert build_parser().parse_args(["run", "--preset", "tiny", "--fresh"]).fresh


def test_a_task_process_exits_without_the_last_full_collection():
    """Every object is frozen out of the exit's full collection (1-2 s a task with torch and mlflow
    loaded), unless triton is loaded: its bindings would print pages of leak warnings."""

    def frozen_at_exit(module: str) -> str:
        # atexit runs handlers last-registered first: print the freeze count after ours has run
        probe = (
            "import atexit, gc, sys\n"
            f"if {module!r}:\n    sys.modules[{module!r}] = type(sys)({module!r})\n"
            "atexit.register(lambda: print(gc.get_freeze_count() > 0))\n"
            "from dynamicrubric.infra import logs\n"
            "logs.skip_the_exit_collection()\n"
            "logs.skip_the_exit_collection()\n"
        )
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        return proc.stdout.strip()

    assert frozen_at_exit("") == "True"
    assert frozen_at_exit("triton") == "False"


LOG_PROBE = """
import logging, sys
from dynamicrubric.infra import logs
logs.setup(verbose=sys.argv[1] == "verbose")
logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
logging.getLogger("matplotlib").warning("a library's warning")
logging.getLogger("dynamicrubric.probe").info("the project's line")
from transformers.utils.logging import tqdm
for _ in tqdm(range(3), desc="Loading weights"):
    pass
"""


def _probe(mode: str, **env: str) -> str:
    import os

    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DYNRUBRIC_TERMINAL"))}
    proc = subprocess.run(
        [sys.executable, "-c", LOG_PROBE, mode],
        capture_output=True,
        text=True,
        env={**environ, **env},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_off_a_terminal_libraries_print_warnings_only_and_no_bars():
    quiet = _probe("default")
    assert "the project's line" in quiet and "a library's warning" in quiet
    assert "generated new fontManager" not in quiet
    assert "Loading weights" not in quiet  # transformers' bar: stderr is a pipe here
    # --verbose shows every library's lines; a run whose user watches a terminal keeps the bars
    assert "generated new fontManager" in _probe("verbose")
    assert "Loading weights" in _probe("default", DYNRUBRIC_TERMINAL="1")
