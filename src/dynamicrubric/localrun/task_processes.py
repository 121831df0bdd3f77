"""kfp.local's task processes, forked from a server that has the slow imports done.

Every task of a local run is a fresh Python process, and before any work each one imports torch,
transformers, pandas, pyarrow, mlflow and MLflow's SQL store: about 5 s of a tiny task's 9 s on the
project's 2-core VM, paid by all forty tasks of a run. multiprocessing's fork server imports them once
(`PRELOAD`); each task is then a fork of that server running kfp's own executor
(`kfp.dsl.executor_main`) on the task's component code, which is what kfp.local's `sh -ec` command
runs in a new interpreter. A command of another shape, or one with environment variables of its own
(which a module may have read while it was imported), runs as the command it is.

The server only imports: it starts no threads and no torch thread pool, so forking it is safe, and
each task sets its own torch thread count from its OMP_NUM_THREADS (the OpenMP runtime read the
server's when torch was imported).
"""

from __future__ import annotations

import abc
import logging
import multiprocessing
import multiprocessing.connection
import os
import resource
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import IO

# What a task imports before its work, in the order a task imports it. The built-in local models
# (SmolLM2 and the tiny test model) are Llamas; other architectures are imported by their tasks.
PRELOAD = [
    "numpy",
    "pandas",
    "pyarrow.parquet",
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.llama.configuration_llama",
    "transformers.generation.utils",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "kfp.dsl.executor_main",
    "dynamicrubric.stages.runner",
    "dynamicrubric.engines",
    "dynamicrubric.infra.tracking",
]
EXECUTOR_LINE = "-m kfp.dsl.executor_main"  # in the `sh -ec` script of a lightweight component's task


@dataclass
class Usage:
    """What a finished task process used: its CPU time and those of the processes it waited for, and
    the largest resident set among them."""

    user_s: float = 0.0
    sys_s: float = 0.0
    max_rss_kib: int = 0


class TaskProcess(abc.ABC):
    """One running task: read its output (stdout and stderr together) from `output`, then `wait()`."""

    output: IO[bytes]

    @abc.abstractmethod
    def wait(self) -> tuple[int, Usage]:
        """The task's exit code and what it used, once it has exited."""


class _Subprocess(TaskProcess):
    def __init__(self, command: Sequence[str], env: dict[str, str]):
        self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.output = self._proc.stdout

    def wait(self) -> tuple[int, Usage]:
        # wait4, not wait: its resource usage covers the task process and every process it waited
        # for (a trainer's `accelerate launch` children).
        _, status, usage = os.wait4(self._proc.pid, 0)
        self._proc.returncode = code = os.waitstatus_to_exitcode(status)
        self._proc.stdout.close()
        return code, Usage(usage.ru_utime, usage.ru_stime, usage.ru_maxrss)


# multiprocessing's Process.start polls every earlier child of this process, and the fork server's poll is
# not thread-safe: two threads reading one ended child's status race, and the loser records 255 over the
# winner's exit code (CPython gh-130895). The run's threads start and reap their tasks in turn.
_REAPING = threading.Lock()


class _Fork(TaskProcess):
    def __init__(
        self,
        context,
        component_code: str,
        executor_args: list[str],
        env: dict[str, str],
        target=None,
        target_args: tuple = (),
    ):
        # `target` (with `target_args` before the executor's) runs in the child instead of _run_executor
        # and must end by calling it: the tests' pod stand-in sets the child up as a pod first.
        output_r, output_w = context.Pipe(duplex=False)
        usage_r, usage_w = context.Pipe(duplex=False)
        self._process = context.Process(
            target=target or _run_executor,
            args=(*target_args, component_code, executor_args, env, output_w, usage_w),
            daemon=False,
        )
        with _REAPING:
            self._process.start()
        # The child holds its own copies now: closing ours lets `output` end when the task's processes do.
        output_w.close()
        usage_w.close()
        self._usage = usage_r
        self._output_r = output_r
        self.output = os.fdopen(output_r.fileno(), "rb", closefd=False)

    def wait(self) -> tuple[int, Usage]:
        multiprocessing.connection.wait([self._process.sentinel])  # ended: the join below does not block
        with _REAPING:
            self._process.join()
        try:
            usage = self._usage.recv() if self._usage.poll() else Usage()
        except EOFError:  # a killed task (an OOM kill, say) sent none: poll() saw the pipe's end
            usage = Usage()
        self._usage.close()
        self.output.close()
        self._output_r.close()
        return self._process.exitcode, usage


log = logging.getLogger(__name__)

# multiprocessing's fork server listens at <TMPDIR>/pymp-XXXXXXXX/listener-XXXXXXXX, and an AF_UNIX path
# holds at most 107 bytes: under a longer TMPDIR the server cannot start ("AF_UNIX path too long").
_LISTENER_BYTES = len("/pymp-12345678/listener-12345678")
_AF_UNIX_PATH_MAX = 107


def _fork_server_fits() -> bool:
    return len(os.fsencode(tempfile.gettempdir())) + _LISTENER_BYTES <= _AF_UNIX_PATH_MAX


class TaskStarter:
    """Starts kfp.local's task commands: forked from the preloaded server where the command is a
    lightweight component's, else as a subprocess."""

    def __init__(self, preload: bool = True):
        self._context = None
        if preload and not _fork_server_fits():
            log.warning(
                "TMPDIR %s is too long for multiprocessing's fork server (its socket path would pass the "
                "%d bytes AF_UNIX allows): every task starts as a subprocess, a few seconds slower each",
                tempfile.gettempdir(),
                _AF_UNIX_PATH_MAX,
            )
        elif preload and "forkserver" in multiprocessing.get_all_start_methods():
            self._context = multiprocessing.get_context("forkserver")
            self._context.set_forkserver_preload(PRELOAD)

    def stop(self) -> None:
        """Stop the fork server and wait for it, so that what it and the tasks it forked used counts as
        this process's children's usage (what `wait4` and GNU time report for a whole run), as the
        subprocesses' did. The next task starts a new server."""
        if self._context is not None:
            from multiprocessing import forkserver

            forkserver._forkserver._stop()  # the stdlib's own stop (its tests use it), not public API

    def start(self, command: Sequence[str], env: dict[str, str], own_env: dict[str, str]) -> TaskProcess:
        """`env` is the whole environment of the task; `own_env`, the part kfp.local set for it."""
        parsed = executor_call(command)
        if self._context is None or parsed is None or own_env:
            return _Subprocess(command, env)
        component_code, executor_args = parsed
        return _Fork(self._context, component_code, executor_args, env)


def executor_call(command: Sequence[str]) -> tuple[str, list[str]] | None:
    """(component code, executor arguments) of a kfp.local lightweight-component command
    `sh -ec SCRIPT CODE ARGS...` whose script writes CODE to a file and runs kfp's executor on it with
    ARGS and nothing else; None for any other command."""
    if len(command) < 4 or command[0] != "sh" or command[1] != "-ec":
        return None
    script = command[2]
    lines = [line.strip() for line in script.strip().splitlines() if line.strip()]
    expected_start = [
        "program_path=$(mktemp -d)",
        'printf "%s" "$0" > "$program_path/ephemeral_component.py"',
    ]
    if lines[:2] != expected_start or len(lines) != 3:
        return None
    run = lines[2].split()
    expected_run = [
        "_KFP_RUNTIME=true",
        sys.executable,
        *EXECUTOR_LINE.split(),
        "--component_module_path",
        '"$program_path/ephemeral_component.py"',
        '"$@"',
    ]
    if run != expected_run:
        return None
    return command[3], list(command[4:])


def _run_executor(
    component_code: str, executor_args: list[str], env: dict[str, str], output: Connection, usage: Connection
) -> None:
    """In the forked child: what the `sh -ec` script runs, with this process's output in `output`."""
    import logging
    import runpy
    import tempfile
    import traceback
    from pathlib import Path

    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    output.close()
    os.environ.clear()
    os.environ.update(env)
    os.environ["_KFP_RUNTIME"] = "true"
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    # tqdm's first bar makes a multiprocessing lock, a named semaphore that multiprocessing's resource
    # tracker (shared with the run's process) unregisters only at an interpreter's exit; this process
    # ends by os._exit, so every task with a progress bar left one behind, and each run ended with
    # "resource_tracker: There appear to be 27 leaked semaphore objects". A task's bars are one
    # process's: a thread lock serves them.
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    from dynamicrubric.infra.stopping import Stopped, raise_on_stop_signals

    # A Ctrl-C reaches every process of the terminal's group, the tasks too, and a pod's stop is a
    # SIGTERM: the task unwinds (its temp folders go) and ends without a traceback; the run says it.
    raise_on_stop_signals()
    code = 0
    with tempfile.TemporaryDirectory() as program_path:
        component = Path(program_path) / "ephemeral_component.py"
        component.write_text(component_code)
        sys.argv = ["executor_main", "--component_module_path", str(component), *executor_args]
        try:
            runpy.run_module("kfp.dsl.executor_main", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if isinstance(e.code, int):
                code = e.code
            elif e.code is not None:
                print(e.code, file=sys.stderr)
                code = 1
        except Stopped as e:
            code = e.exit_code
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    usage.send(
        Usage(
            own.ru_utime + waited.ru_utime,
            own.ru_stime + waited.ru_stime,
            max(own.ru_maxrss, waited.ru_maxrss),
        )
    )
    # Everything the task wrote is closed; the interpreter's teardown would only spend time.
    os._exit(code)
