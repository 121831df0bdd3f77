"""The sandbox's launcher: makes a run's namespaces and view, then starts the judge and the code.

Run by `sandbox.py` as `python -I -S _sandbox_launcher.py`, with the run's config as JSON on stdin, in
a new session, as the caller's user (root locally and in CI). Standard library only, and few imports:
it starts for every run. The module docstring of `sandbox.py` says what each step is for.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
SETUP_FAILED = 127  # exit code of a launcher child that could not exec
JUDGE_UID = 65533  # the judge's user when running as root: not `nobody`, who runs the code
ALLOW_WEAK_ENV = "DYNRUBRIC_SANDBOX_ALLOW_WEAK"
VIEW_DIR = "/sandbox"  # the code's working directory inside the view
DEVICES = ("null", "zero", "full", "random", "urandom")

# Prepended to what the code runs when no network namespace could be made: refuses the operations
# that reach the network or start other programs. Audit hooks cannot be removed once added.
_FALLBACK_GUARD = """
import sys as _sys
def _sandbox_guard(event, args, _blocked=("socket.", "subprocess.Popen", "os.system", "os.exec",
        "os.posix_spawn", "os.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function")):
    if event.startswith(_blocked):
        raise PermissionError(f"sandbox: {event} is not allowed (no network namespace available)")
_sys.addaudithook(_sandbox_guard)
del _sys, _sandbox_guard
"""
_RUN_SCRIPT = "import runpy\nrunpy.run_path('main.py', run_name='__main__')\n"


# ---------------------------------------------------------------------------------------------------

_libc = None


def _libc_call(name: str, *args: int | str | bytes | None) -> str | None:
    """Call a libc function; None on success, else the error text."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    converted = [
        a.encode() if isinstance(a, str) else a if a is None or isinstance(a, bytes) else ctypes.c_ulong(a)
        for a in args
    ]
    if getattr(_libc, name)(*converted) != 0:
        errno = ctypes.get_errno()
        return f"{name}{tuple(a for a in args if not isinstance(a, int))} failed: {os.strerror(errno)}"
    return None


def _check(err: str | None) -> None:
    if err:
        raise OSError(err)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc_call("mount", source, target, fstype, flags, data))


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
    """Unshare what the kernel allows (the PID namespace comes later, for the code only)."""
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        err = _libc_call("unshare", CLONE_NEWUSER)
        if err:
            isolation["notes"].append(f"no user namespace ({err}); no namespace can be made")
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
    for name, flag in (("mountns", CLONE_NEWNS), ("netns", CLONE_NEWNET), ("ipcns", CLONE_NEWIPC)):
        err = _libc_call("unshare", flag)
        if err:
            isolation["notes"].append(f"no {name} ({err})")
        else:
            isolation[name] = True


def _bind_read_only(source: str, target: str) -> None:
    """Bind `source` at `target` read-only, keeping the flags a user namespace may not clear."""
    _mount(source, target, None, MS_BIND | MS_REC)
    st = os.statvfs(source).f_flag
    kept = 0
    for st_flag, ms_flag in (
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ):
        if st & st_flag:
            kept |= ms_flag
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def _build_view(config: dict) -> None:
    """The code's filesystem (see the module docstring), mounted under base/root in this namespace."""
    base = config["base"]
    root, scratch = f"{base}/root", f"{base}/scratch"
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    # One size-capped tmpfs is all the code can write: the disk quota, shared by its four uses.
    _mount(
        "tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['disk_mb']}m,nr_inodes=16k,mode=755"
    )
    owner = config["user"] or [os.getuid(), os.getgid()]
    for name in ("work", "tmp", "var_tmp", "shm"):
        os.mkdir(f"{scratch}/{name}", 0o700)
    for name in ("tmp", "var_tmp", "shm"):
        os.chmod(f"{scratch}/{name}", 0o1777)
    _write_code(f"{scratch}/work", config["code"], owner)

    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    done: list[str] = []
    for path in config["exposed"]:
        if any(path == d or path.startswith(d + "/") for d in done):
            continue  # already inside a recursive bind
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)  # e.g. /bin -> usr/bin, resolved inside the view
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            _bind_read_only(path, target)
            done.append(path)
        elif os.path.isfile(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
            _bind_read_only(path, target)
    for pattern in config["hidden"]:
        for path in glob.glob(pattern):
            if any(path.startswith(d + "/") for d in done) and os.path.isdir(root + path):
                _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")

    dev = f"{root}/dev"
    os.mkdir(dev)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for name in DEVICES:
        open(f"{dev}/{name}", "w").close()
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, f"{dev}/{name}")
    os.symlink("/proc/self/fd/1", f"{dev}/stdout")
    os.symlink("/proc/self/fd/2", f"{dev}/stderr")
    for name, inside in (("shm", "/dev/shm"), ("tmp", "/tmp"), ("var_tmp", "/var/tmp"), ("work", VIEW_DIR)):
        os.makedirs(root + inside, exist_ok=True)
        _mount(f"{scratch}/{name}", root + inside, None, MS_BIND)
    os.mkdir(f"{root}/proc")  # mounted by init, inside the PID namespace
    _mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _write_code(folder: str, code: str, owner: list[int]) -> None:
    path = f"{folder}/main.py"
    with open(path, "w", encoding="utf-8") as f:
        f.write(code)
    for p in (folder, path):
        os.chown(p, owner[0], owner[1])


def _set_fds(mapping: dict[int, int]) -> None:
    """Make fd `target` a copy of `source` for each item, whatever numbers the sources have."""
    high = {target: fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, 100) for target, source in mapping.items()}
    for target, source in high.items():
        os.dup2(source, target)  # inheritable: kept across exec


def _drop_privileges(limits: dict, user: list[int] | None, nproc: int | None) -> None:
    for res, value in (
        (resource.RLIMIT_AS, limits["as"]),
        (resource.RLIMIT_CPU, limits["cpu"]),
        (resource.RLIMIT_FSIZE, limits["fsize"]),
        (resource.RLIMIT_NOFILE, limits["nofile"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))  # the hard limit too, so the code cannot raise it
    if nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if user:
        os.setgroups([])
        os.setgid(user[1])
        os.setuid(user[0])
    # After the uid change, which clears it: die with the parent; no set-uid escalation.
    _check(_libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
    _check(_libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))


def _exec_in_child(config: dict, error_w: int, *, judge: bool, fds: dict[int, int]) -> None:
    """Runs in a forked child: enter the view, set limits and user, exec the judge or the code."""
    try:
        _set_fds(fds)
        view = config["isolation"]["view"]
        user = config["user"]
        # RLIMIT_NPROC counts all of the uid's processes. In a fresh user namespace (kernel >= 5.14) the
        # count starts near zero; otherwise the uid's existing processes (counted before the chroot
        # hides them) are added.
        nproc = config["limits"]["nproc"]
        if not judge:
            nproc += (
                2 if config["isolation"]["userns"] else _count_processes(user[0] if user else os.getuid())
            )
        if view:
            os.chroot(f"{config['base']}/root")
        python, source = config["python"], config["child_source"]
        env = {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        if judge:
            os.chdir("/")
            user = [JUDGE_UID, JUDGE_UID] if user else None
            limits = {**config["limits"], "fsize": 1 << 20, "nofile": 64}
            _drop_privileges(limits, user, None)
            argv = [python, "-I", "-S", "-c", source, "judge"]
        else:
            workdir = VIEW_DIR if view else f"{config['base']}/work"
            env.update(HOME=workdir, TMPDIR="/tmp" if view else workdir)
            _drop_privileges(config["limits"], user, nproc)
            os.chdir(workdir)
            guard = "" if config["isolation"]["netns"] else _FALLBACK_GUARD
            if config["job"] is None:
                argv = [python, "-I", "-S", "-c", guard + _RUN_SCRIPT]
            else:
                argv = [python, "-I", "-S", "-c", guard + source, "worker", config["job"]["entry_point"]]
        os.execve(python, argv, env)
    except BaseException as e:  # report anything, then leave without running cleanup handlers
        try:
            os.write(error_w, f"{'judge' if judge else 'code'}: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(SETUP_FAILED)


def _init(config: dict, error_w: int, status_w: int, code_fds: dict[int, int], others: list[int]) -> None:
    """PID 1 of the new PID namespace (when there is one): runs the code as its child and reaps.

    The code is not PID 1 itself, so signals behave as usual for it and orphans get reaped. When this
    process exits, the kernel kills everything left in the namespace. Never returns.
    """
    try:
        for fd in others:  # pipe ends of the launcher and the judge: the code must not hold them
            os.close(fd)
        _check(_libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
        if config["isolation"]["view"]:
            # Refused e.g. in a user namespace under a masked /proc: the code then has no /proc at all.
            with contextlib.suppress(OSError):
                _mount("proc", f"{config['base']}/root/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        child = os.fork()
        if child == 0:
            _exec_in_child(config, error_w, judge=False, fds=code_fds)
        os.close(error_w)
        for fd in code_fds.values():
            os.close(fd)
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


def _refusal(isolation: dict) -> str:
    missing = [n for n in ("mountns", "view", "netns", "pidns") if not isolation.get(n)]
    return (
        f"sandbox: no isolated run is possible here (missing: {', '.join(missing)}; "
        f"{'; '.join(isolation['notes'])}). Run as root or where user namespaces are allowed, or in a "
        f"gVisor pod (manifests/), and set {ALLOW_WEAK_ENV}=1 to accept the weaker fallback there."
    )


def _launch() -> int:
    config = json.loads(_read_all(0))  # the parent writes it to our stdin; it holds the tests
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)  # what the code inherits as stdin
    os.close(null)
    report_fd = config["report_fd"]
    os.set_inheritable(report_fd, False)  # the code must not be able to forge the report
    isolation = {"user": config["user_name"], "notes": []}
    isolation.update(dict.fromkeys(("userns", "mountns", "view", "netns", "pidns", "ipcns"), False))
    config["isolation"] = isolation
    if config["namespaces"]:
        _enter_namespaces(isolation)
        if isolation["mountns"]:
            try:
                _build_view(config)
                isolation["view"] = True
            except OSError as e:
                isolation["notes"].append(f"no read-only view ({e}); the host filesystem is visible")
    else:
        isolation["notes"].append("namespaces disabled by the caller; using the fallback guards")
    if not isolation["view"]:
        _write_code(f"{config['base']}/work", config["code"], config["user"] or [os.getuid(), os.getgid()])
    # Same-user processes (the fallback) can then neither ptrace this process nor read its memory.
    _check(_libc_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0))
    job = config["job"]
    error_r, error_w = os.pipe()  # setup errors; EOF once every child has exec'd (close-on-exec)
    judge_pid = None
    code_fds: dict[int, int] = {}
    launcher_fds: list[int] = []
    if job is not None:
        job_r, job_w = os.pipe()
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        verdict_r, verdict_w = os.pipe()
        # The judge is made before the PID namespace, so the code's namespace does not contain it.
        judge_pid = os.fork()
        if judge_pid == 0:
            _exec_in_child(config, error_w, judge=True, fds={0: job_r, 3: req_w, 4: rep_r, 5: verdict_w})
        for fd in (job_r, req_w, rep_r, verdict_w):
            os.close(fd)
        code_fds = {3: req_r, 4: rep_w}
        launcher_fds = [job_w, verdict_r]
    if config["namespaces"]:
        err = _libc_call("unshare", CLONE_NEWPID)
        if err:
            isolation["notes"].append(f"no pidns ({err}); stray processes are found by session and folder")
        else:
            isolation["pidns"] = True
    refused = not config["allow_weak"] and not all(
        isolation[n] for n in ("mountns", "view", "netns", "pidns")
    )
    if not refused and not all(isolation[n] for n in ("mountns", "view", "netns", "pidns")):
        isolation["notes"].append(f"running with weak isolation ({ALLOW_WEAK_ENV} or allow_weak)")
    os.write(report_fd, json.dumps({"isolation": isolation}).encode() + b"\n")
    if refused:
        if judge_pid:
            os.kill(judge_pid, signal.SIGKILL)
        os.write(report_fd, json.dumps({"refused": _refusal(isolation)}).encode() + b"\n")
        return 0
    status_r, status_w = os.pipe()  # the code's exit status, from init
    init = os.fork()
    if init == 0:
        _init(config, error_w, status_w, code_fds, [error_r, status_r, *launcher_fds])
    for fd in (error_w, status_w, *code_fds.values()):
        os.close(fd)
    outcome: dict = {"verdict": None}
    if job is not None:
        with contextlib.suppress(BrokenPipeError):  # a judge that died early is reported below
            os.write(launcher_fds[0], json.dumps(job).encode())
        os.close(launcher_fds[0])
    setup_error = _read_all(error_r).decode(errors="replace")
    if job is not None:
        verdict = _read_all(launcher_fds[1])
        with contextlib.suppress(json.JSONDecodeError):
            outcome["verdict"] = json.loads(verdict) if verdict else None
        os.kill(init, signal.SIGKILL)  # the verdict is in; whatever the code still does is cut off
        os.waitpid(judge_pid, 0)
    status = json.loads(_read_all(status_r) or b"{}")
    os.waitpid(init, 0)
    missing_status = job is None and not status
    outcome.update(
        setup_error=setup_error or ("init ended without a status" if missing_status else None),
        exit_code=status.get("exit_code"),
        signal=status.get("signal"),
    )
    os.write(report_fd, json.dumps(outcome).encode() + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(_launch())
