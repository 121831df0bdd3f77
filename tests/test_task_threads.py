"""Tasks that kfp.local runs side by side share this machine's cores instead of each starting a
thread per core (which on 2 cores runs several times slower); a task that runs alone gets them all.
The monitor records what each task process (and the processes it waited for) used."""

from __future__ import annotations

import io
import json
import sys

from dynamicrubric.localrun.task_monitor import TaskMonitor, task_entry, task_threads

SHARD_TASK = {"shard": 0}
ALONE_TASK = {"shard": None}  # training, evaluate, aggregate: outside any shard loop


def test_shards_side_by_side_share_the_cores():
    assert task_threads(SHARD_TASK, 2, environ={}, cores=2) == "1"
    assert task_threads(SHARD_TASK, 2, environ={}, cores=16) == "8"
    assert task_threads(SHARD_TASK, 4, environ={}, cores=2) == "1"  # never 0
    assert task_threads(SHARD_TASK, 1, environ={}, cores=2) == "2"


def test_a_task_that_runs_alone_gets_all_the_cores():
    assert task_threads(ALONE_TASK, 2, environ={}, cores=2) == "2"
    assert task_threads(ALONE_TASK, 4, environ={}, cores=16) == "16"


def test_the_users_own_setting_wins():
    assert task_threads(SHARD_TASK, 2, environ={"OMP_NUM_THREADS": "3"}, cores=2) == "3"
    assert task_threads(ALONE_TASK, 2, environ={"OMP_NUM_THREADS": "3"}, cores=2) == "3"


def _command(tmp_path, code: str, params: dict) -> list[str]:
    executor_input = {
        "inputs": {"parameterValues": params},
        "outputs": {"outputFile": str(tmp_path / "task" / "output.json")},
    }
    return [sys.executable, "-c", code, "--executor_input", json.dumps(executor_input)]


def test_a_task_process_runs_torch_with_its_share(tmp_path, monkeypatch):
    """The real path: run_task starts the process, and torch in it takes the count."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the user's own count (xdist's 1) would win
    code = "import os, torch; print('threads', os.environ['OMP_NUM_THREADS'], torch.get_num_threads())"
    monitor = TaskMonitor(out=io.StringIO(), err=io.StringIO(), shards=2, cores=2)
    log = tmp_path / "task" / "task.log"
    assert monitor.run_task(_command(tmp_path, code, {"shard": 1})) == 0
    assert "threads 1 1" in log.read_text()
    assert monitor.run_task(_command(tmp_path, code, {"round_idx": 1})) == 0  # no shard: alone
    assert "threads 2 2" in log.read_text()
    assert [t["threads"] for t in monitor.tasks] == [1, 2]
    # a component that sets its own count (kfp's set_env_variable) keeps it
    assert monitor.run_task(_command(tmp_path, code, {"shard": 1}), env_vars={"OMP_NUM_THREADS": "2"}) == 0
    assert "threads 2 2" in log.read_text()


def test_the_entry_knows_its_shard():
    assert task_entry("rollout", {"inputs": {"parameterValues": {"shard": 1}}})["shard"] == 1
    assert task_entry("train_policy", {"inputs": {"parameterValues": {"round_idx": 1}}})["shard"] is None


def test_cpu_time_and_peak_memory_cover_the_processes_a_task_waits_for(tmp_path):
    """A trainer task's work happens in a child process (`accelerate launch`): its CPU time and its
    memory must count as the task's."""
    child = "import time; b = bytearray(400 * 2**20); t = time.process_time(); exec('while time.process_time() - t < 0.5: pass')"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    out = io.StringIO()
    monitor = TaskMonitor(out=out, err=io.StringIO(), shards=2, cores=2)
    assert monitor.run_task(_command(tmp_path, code, {})) == 0
    (entry,) = monitor.tasks
    assert entry["cpu_user_s"] + entry["cpu_sys_s"] >= 0.45
    assert entry["max_rss_mb"] >= 400  # the child's 400 MiB, not the parent's few MB
    assert "rss " in out.getvalue() and "cpu " in out.getvalue()


def test_the_legend_says_how_to_read_a_135m_run():
    from dynamicrubric.infra.config_loading import load_config
    from dynamicrubric.localrun.round_table import format_legend

    rows = [{"mean_gap": 0.01, "tie_rate": 0.5}]
    local = format_legend(rows, load_config(preset="local"))
    assert "P(yes)" in local and "SmolLM2-135M plays every role" in local
    tiny = format_legend(rows, load_config(preset="tiny"))  # hard verdicts, a random 2-layer model
    assert "P(yes)" not in tiny and "SmolLM2" not in tiny
