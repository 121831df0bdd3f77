"""kfp.local's task commands run forked from the preloaded server, with the same output, exit code,
environment and torch thread count a fresh interpreter would give them; other commands run as they are.
The commands here are kfp's own: a lightweight component's container command and arguments, with the
placeholders filled and the interpreter replaced as kfp.local does."""

import io
import json
import os
import sys

from kfp import dsl
from kfp.local.subprocess_task_handler import replace_python_executable

from dynamicrubric.localrun.task_monitor import TaskMonitor
from dynamicrubric.localrun.task_processes import TaskStarter, executor_call


# No `from __future__ import annotations` here: KFP reads the component's annotations as types.
@dsl.component(base_image="python:3.11", install_kfp_package=False)
def report(fail: bool, shard: int = 0, burn_s: float = 0.0) -> str:
    import os
    import sys
    import time

    import torch

    start = time.process_time()
    while time.process_time() - start < burn_s:
        pass

    print("threads", os.environ["OMP_NUM_THREADS"], torch.get_num_threads())
    # kfp.local's `sh -ec` script starts the interpreter; the fork server is an interpreter itself
    with open(f"/proc/{os.getppid()}/comm") as parent:
        print("parent", parent.read().strip(), "marker", os.environ.get("TASK_MARKER"))
    print("to stderr", file=sys.stderr)
    if fail:
        raise ValueError("the component failed")
    return "ok"


def _kfp_command(
    tmp_path, fail: bool = False, shard: int | None = None, burn_s: float = 0.0
) -> tuple[list[str], dict]:
    """What kfp.local runs for `report`: its container command and arguments, placeholders filled."""
    container = report.component_spec.implementation.container
    params: dict = {"fail": fail, "burn_s": burn_s}
    if shard is not None:
        params["shard"] = shard
    executor_input = {
        "inputs": {"parameterValues": params},
        "outputs": {
            "parameters": {"Output": {"outputFile": str(tmp_path / "task" / "Output")}},
            "outputFile": str(tmp_path / "task" / "executor_output.json"),
        },
    }
    args = [json.dumps(executor_input) if a == "{{$}}" else a for a in container.args]
    return replace_python_executable([*container.command, *args], sys.executable), executor_input


def test_a_lightweight_components_command_is_read_and_others_are_not(tmp_path):
    command, _ = _kfp_command(tmp_path)
    code, args = executor_call(command)
    assert "def report(fail: bool, shard: int = 0, burn_s: float = 0.0) -> str:" in code
    assert args[args.index("--function_to_execute") + 1] == "report"
    assert executor_call([sys.executable, "-c", "print(1)"]) is None
    changed = [*command[:2], command[2].replace("printf", "echo"), *command[3:]]
    assert executor_call(changed) is None  # a script that does anything else runs as itself
    other_python = [*command[:2], command[2].replace(sys.executable, "/usr/bin/python3.9"), *command[3:]]
    assert executor_call(other_python) is None


def test_a_forked_task_runs_like_a_fresh_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TASK_MARKER", "from-the-run")
    monitor = TaskMonitor(out=io.StringIO(), err=io.StringIO(), shards=2, cores=2)
    command, executor_input = _kfp_command(tmp_path, shard=1)
    assert monitor.run_task(command) == 0
    log = (tmp_path / "task" / "task.log").read_text()
    assert "threads 1 1" in log  # its share of the cores, set after the fork
    assert "parent python" in log  # forked by the server, not started by kfp.local's `sh -ec` script
    assert "marker from-the-run" in log and "to stderr" in log
    output = json.loads((tmp_path / "task" / "executor_output.json").read_text())
    assert output["parameterValues"]["Output"] == "ok"  # kfp's executor wrote the task's output

    command, _ = _kfp_command(tmp_path, fail=True)
    assert monitor.run_task(command) == 1
    log = (tmp_path / "task" / "task.log").read_text()
    assert "ValueError: the component failed" in log and "Traceback" in log
    assert [t["status"] for t in monitor.tasks] == ["ok", "failed"]


def test_a_component_with_its_own_environment_runs_as_a_subprocess(tmp_path):
    """A variable kfp.local sets for the task may have been read while the server imported its modules
    (an OpenMP or Hugging Face setting): such a task gets a fresh interpreter."""
    monitor = TaskMonitor(out=io.StringIO(), err=io.StringIO(), shards=2, cores=2)
    command, _ = _kfp_command(tmp_path, shard=0)
    assert monitor.run_task(command, env_vars={"TASK_MARKER": "own"}) == 0
    log = (tmp_path / "task" / "task.log").read_text()
    assert "parent sh marker own" in log


def test_without_preloading_every_task_is_a_subprocess(tmp_path):
    monitor = TaskMonitor(out=io.StringIO(), err=io.StringIO(), shards=2, cores=2, preload=False)
    command, _ = _kfp_command(tmp_path, shard=0)
    assert monitor.run_task(command) == 0
    assert "parent sh " in (tmp_path / "task" / "task.log").read_text()


def test_a_forked_tasks_usage_is_its_own(tmp_path):
    """CPU time and peak memory of the forked task (and what it waited for), not the server's imports."""
    command, _ = _kfp_command(tmp_path, shard=0)
    task = TaskStarter().start(command, {**os.environ, "OMP_NUM_THREADS": "1"}, own_env={})
    output = task.output.read()
    code, usage = task.wait()
    assert code == 0 and b"threads 1 1" in output
    assert 0 < usage.user_s + usage.sys_s < 5  # the imports (5 s and more) were the server's
    assert usage.max_rss_kib > 100_000  # torch is mapped in the task: its pages count as its memory


def test_a_stopped_server_hands_its_tasks_usage_to_this_process(tmp_path):
    """GNU time and wait4 count a process's waited-for descendants: once the server is stopped and
    waited for, the CPU time of the tasks it forked counts as this process's children's, as the
    subprocesses' did (bench_demo reads a whole run's CPU time and peak memory that way)."""
    import resource

    starter = TaskStarter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    command, _ = _kfp_command(tmp_path, shard=0, burn_s=1.0)
    task = starter.start(command, {**os.environ, "OMP_NUM_THREADS": "1"}, own_env={})
    task.output.read()
    assert task.wait()[0] == 0
    starter.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert after.ru_utime - before.ru_utime >= 0.95


def test_under_a_tmpdir_too_long_for_the_fork_servers_socket_tasks_run_as_subprocesses(
    tmp_path, monkeypatch, caplog
):
    """The fork server's socket lives in TMPDIR, and an AF_UNIX path holds 107 bytes: under a longer
    TMPDIR a run failed on its first task ("AF_UNIX path too long"). It starts its tasks as subprocesses
    instead, and says so."""
    import tempfile

    long_tmp = tmp_path / ("t" * (100 - len(str(tmp_path))))
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    command, _ = _kfp_command(tmp_path, shard=0)
    with caplog.at_level("WARNING"):
        task = TaskStarter().start(command, {**os.environ, "OMP_NUM_THREADS": "1"}, own_env={})
    output = task.output.read()
    assert task.wait()[0] == 0 and b"parent sh " in output, output[-2000:]
    assert "too long for multiprocessing's fork server" in caplog.text


def test_tasks_ending_while_others_start_keep_their_exit_codes():
    """A local run starts and waits for its tasks from several threads. multiprocessing's Process.start
    polls every earlier child of the process, and with the fork server two threads polling one ended
    child race for its exit status: the loser records 255 over the winner's 0 (CPython gh-130895), and
    a tiny run failed on a task that had written its outputs ("exit code 255"). Six threads start and
    wait for quick tasks side by side, as a ParallelFor's tasks are; every one must report its 0 (without
    the fix this failed three runs in three)."""
    import multiprocessing
    import threading

    from quick_task import quick_task

    from dynamicrubric.localrun.task_processes import _Fork

    context = multiprocessing.get_context("forkserver")
    codes: list[int] = []

    def starts_and_waits() -> None:
        for _ in range(40):
            task = _Fork(context, "", [], {}, target=quick_task)
            task.output.read()
            codes.append(task.wait()[0])

    threads = [threading.Thread(target=starts_and_waits) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(codes) == 240 and set(codes) == {0}, sorted(set(codes))
