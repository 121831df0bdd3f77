"""Tasks that kfp.local runs side by side share this machine's cores instead of each starting a
thread per core (which on 2 cores runs several times slower)."""

from __future__ import annotations

import io
import json
import sys

from dynamicrubric.launch import TaskMonitor, task_threads


def test_cores_are_shared_among_the_shards():
    assert task_threads(2, environ={}, cores=2) == "1"
    assert task_threads(2, environ={}, cores=16) == "8"
    assert task_threads(4, environ={}, cores=2) == "1"  # never 0
    assert task_threads(1, environ={}, cores=2) == "2"


def test_the_users_own_setting_wins():
    assert task_threads(2, environ={"OMP_NUM_THREADS": "3"}, cores=2) == "3"


def test_a_task_process_runs_torch_with_its_share(tmp_path):
    """The real path: run_task starts the process, and torch in it takes the count."""
    code = "import os, torch; print('threads', os.environ['OMP_NUM_THREADS'], torch.get_num_threads())"
    executor_input = {"outputs": {"outputFile": str(tmp_path / "task" / "output.json")}}
    command = [sys.executable, "-c", code, "--executor_input", json.dumps(executor_input)]
    monitor = TaskMonitor(out=io.StringIO(), err=io.StringIO(), threads="1")
    assert monitor.run_task(command) == 0
    assert "threads 1 1" in (tmp_path / "task" / "task.log").read_text()
    # a component that sets its own count (kfp's set_env_variable) keeps it
    assert monitor.run_task(command, env_vars={"OMP_NUM_THREADS": "2"}) == 0
    assert "threads 2 2" in (tmp_path / "task" / "task.log").read_text()
