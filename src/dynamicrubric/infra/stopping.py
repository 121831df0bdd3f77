"""Ending on SIGINT or SIGTERM (Ctrl-C, or a pod being stopped) in one line and with nothing left.

Python's default SIGTERM ends the process on the spot: no `finally`, no `atexit`, so temp folders
(a training launch's config and job, multiprocessing's pymp-*) stayed in TMPDIR, and the training
processes it had started ran on to the end. Here either signal raises `Stopped` in the main thread,
which unwinds like any exception (temp folders removed, child process groups stopped) and which the
command line reports in one line. A child process this project starts runs in its own process group
(`run_child`): a Ctrl-C reaches only the parent, so the children print no KeyboardInterrupt tracebacks
of their own, and the parent stops them with a SIGTERM when it is stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 30.0  # how long a stopped child may take to clean up before it is killed


class Stopped(BaseException):  # noqa: N818 (like KeyboardInterrupt: not an error of the program)
    """The process was asked to stop by `signum`. A BaseException, so `except Exception` clean-up
    code that reports errors does not report it as one."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_pending: int | None = None  # the signal being acted on


def _stop(signum: int, frame: object) -> None:
    global _pending
    # One signal stops: a second one (a repeated Ctrl-C, the pod's stop after the terminal's) must not
    # interrupt with a traceback of its own the clean-up the first one started.
    if _pending is not None:
        return
    _pending = signum
    raise Stopped(signum)


def _unraisable(previous):
    def hook(args) -> None:
        global _pending
        if isinstance(args.exc_value, Stopped):
            # Raised inside a finalizer (a weakref callback, a __del__), where Python prints the
            # exception and goes on: the signal is sent again, to land in the main thread's own code.
            _pending = None
            timer = threading.Timer(0.05, os.kill, (os.getpid(), args.exc_value.signum))
            timer.daemon = True
            timer.start()
            return
        previous(args)

    return hook


def raise_on_stop_signals() -> None:
    """From now on SIGINT and SIGTERM raise `Stopped` in the main thread."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)
    sys.unraisablehook = _unraisable(sys.unraisablehook)


def run_child(cmd: Sequence[str], env: dict[str, str] | None = None) -> int:
    """`subprocess.run(cmd).returncode`, the child in a process group of its own, which gets a SIGTERM
    (then, after GRACE_S, a SIGKILL) when this process is stopped or fails while waiting."""
    proc = subprocess.Popen(list(cmd), env=env, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        stop_group(proc)
        raise


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to `proc`'s process group; SIGKILL to whatever is left of it after GRACE_S (its other
    processes, accelerate's workers, may outlive its leader)."""
    deadline = time.monotonic() + GRACE_S
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=GRACE_S)
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
