"""The processes of a launch below the launcher: each run's supervisor and init, the code, the judge.

The launcher forks the judge (`exec_judge`) and one supervisor per run (`supervise`); a supervisor
makes the run's own namespaces and tmpfs, then an init (PID 1 of the run's PID namespace, and leader
of a session of the run's own) forks the process that drops its privileges and execs the code
(`exec_code`). Standard library only (see `__main__.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import resource
import signal

from .common import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    JUDGE_UID,
    KEYCTL_JOIN_SESSION_KEYRING,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    RUN_ID_BASE,
    SAFE_PATH,
    SETUP_FAILED,
    VIEW_DIR,
    check,
    libc_call,
    mount,
    write,
)
from .seccomp import SYSCALLS, install_seccomp
from .view import mount_scratch

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


def _set_fds(mapping: dict[int, int]) -> None:
    """Make fd `target` a copy of `source` for each item, whatever numbers the sources have."""
    high = {target: fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, 1000) for target, source in mapping.items()}
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
    check(libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
    check(libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))


def exec_judge(config: dict, error_w: int, fds: dict[int, int]) -> None:
    """Runs in a forked child: the judge, in the view (no writable storage at all), as its own user."""
    try:
        _set_fds(fds)
        if config["isolation"]["view"]:
            os.chroot(f"{config['base']}/root")
        os.chdir("/")
        user = [JUDGE_UID, JUDGE_UID] if config["user"] else None
        limits = {**config["limits"], "fsize": 1 << 20, "nofile": 64 + len(fds)}
        _drop_privileges(limits, user, None)
        python = config["python"]
        os.execve(python, [python, "-I", "-S", "-c", config["child_source"], "judge"], _env("/"))
    except BaseException as e:  # report anything, then leave without running cleanup handlers
        try:
            os.write(error_w, f"judge: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(SETUP_FAILED)


def _exec_code(config: dict, run: int, error_w: int, fds: dict[int, int]) -> None:
    """Runs in a forked child: the code of one run, in the view, as the sandbox user, with limits."""
    try:
        _set_fds(fds)
        view, user = config["isolation"]["view"], config["user"]
        # RLIMIT_NPROC counts all of the uid's processes. In a fresh user namespace (kernel >= 5.14) the
        # count starts near zero; otherwise the uid's existing processes (counted before the chroot
        # hides them) are added.
        # With host ids of the run's own (as root), the count is exactly the run's processes, this one
        # included.
        nproc = config["limits"]["nproc"]
        isolation = config["isolation"]
        if not (user and isolation["runuserns"]):
            fresh_count = isolation["userns"] or isolation["runuserns"]
            nproc += 2 if fresh_count else _count_processes(user[0] if user else os.getuid())
        if view:
            os.chroot(f"{config['base']}/root")
        workdir = VIEW_DIR if view else f"{config['base']}/work-{run}"
        _drop_privileges(config["limits"], user, nproc)
        if config["seccomp"]:
            install_seccomp(config["seccomp"])
        os.chdir(workdir)
        guard = "" if config["isolation"]["netns"] else _FALLBACK_GUARD
        python = config["python"]
        if config["job"] is None:
            argv = [python, "-I", "-S", "-c", guard + _RUN_SCRIPT]
        else:
            argv = [
                python,
                "-I",
                "-S",
                "-c",
                guard + config["child_source"],
                "worker",
                config["job"]["entry_point"],
            ]
        env = {**_env(workdir), "TMPDIR": "/tmp" if view else workdir}
        os.execve(python, argv, env)
    except BaseException as e:
        try:
            os.write(error_w, f"code[{run}]: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(SETUP_FAILED)


def _env(home: str) -> dict[str, str]:
    return {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": home}


def supervise(config: dict, run: int, error_w: int, status_w: int, fds: dict[int, int]) -> None:
    """One run's supervisor (a forked child of the launcher; never returns): its own mount namespace
    and tmpfs, then a PID namespace whose init runs the code and reaps. Killing this process kills the
    run: init dies with it (PDEATHSIG), and the kernel then kills everything in the namespace."""
    try:
        check(libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
        # A network and IPC namespace per run too: runs of one batch must not reach each other through
        # abstract Unix sockets or SysV IPC.
        for name, flag in (("netns", CLONE_NEWNET), ("ipcns", CLONE_NEWIPC)):
            if config["isolation"][name]:
                check(libc_call("unshare", flag))
        # The run's user and group on the host. As root, ids of the run's own (from its supervisor's pid,
        # unique among live runs): nothing the kernel keeps per user (a key, a lock, a count) is shared
        # with another run or with host processes of `nobody`. The code sees them as `nobody` (65534).
        inside = config["user"] or [os.getuid(), os.getgid()]
        own_ids = config["user"] and config["isolation"]["runuserns"]
        config = {**config, "host_ids": [RUN_ID_BASE + os.getpid()] * 2 if own_ids else inside}
        if config["cgroups"]:  # before any process of the run exists: all of them are inside
            with open(f"{config['cgroups'][run]}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        if config["isolation"]["view"]:
            mount_scratch(config, run)
        if config["isolation"]["pidns"]:
            check(libc_call("unshare", CLONE_NEWPID))
        unshared_r, unshared_w = os.pipe()  # one pipe per direction
        mapped_r, mapped_w = os.pipe()
        init = os.fork()
        if init == 0:
            os.close(unshared_r)
            os.close(mapped_w)
            _init(config, run, error_w, status_w, fds, (unshared_w, mapped_r))
        os.close(unshared_w)
        os.close(mapped_r)
        if config["isolation"]["runuserns"] and os.read(unshared_r, 1) == b"u":  # else init failed
            _map_ids(init, inside, config["host_ids"])
            os.write(mapped_w, b"m")
        os.close(mapped_w)
        os.close(error_w)
        os.close(status_w)
        os.waitpid(init, 0)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.write(error_w, f"run {run}: {type(e).__name__}: {e}\n".encode())
    finally:
        os._exit(0)


def _map_ids(pid: int, inside: list[int], host: list[int]) -> None:
    """Map the run's user and group (and nothing else) in the user namespace of `pid`. Written from
    outside: only a process with the rights in the parent namespace may map a uid other than its own."""
    for name, i in (("uid_map", 0), ("gid_map", 1)):
        write(f"/proc/{pid}/{name}", f"{inside[i]} {host[i]} 1")


def _init(
    config: dict, run: int, error_w: int, status_w: int, fds: dict[int, int], sync: tuple[int, int]
) -> None:
    """PID 1 of the run's PID namespace (when there is one): runs the code as its child and reaps.

    The code is not PID 1 itself, so signals behave as usual for it and orphans get reaped. When this
    process exits, the kernel kills everything left in the namespace. Never returns.
    """
    try:
        check(libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
        if config["isolation"]["pidns"]:
            # A session and process group of the run's own (this process and what it starts), instead of
            # the launcher's, which holds every run of the batch: the kernel groups processes by them
            # whatever their namespaces. ioprio_get/setpriority of the process group read and set the
            # best priority over all of its members, kill(0) signals them all (a plain user's runs share
            # a uid), and the scheduler's autogroup is the session's, its nice (/proc/self/autogroup)
            # written by any member and read by all. The supervisor stays in the launcher's session, so
            # the launcher's group still ends every run (each init dies with its supervisor). Without a
            # PID namespace the fallback finds a run's strays by the launcher's session: no new one.
            os.setsid()
        if config["isolation"]["view"]:
            # Refused e.g. in a user namespace under a masked /proc: the code then has no /proc at all.
            with contextlib.suppress(OSError):
                proc = f"{config['base']}/root/proc"
                mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                for name in ("keys", "key-users"):  # keys of the run's host uid, and every user's key counts
                    mount(f"{config['base']}/root/dev/null", f"{proc}/{name}", None, MS_BIND)
        unshared_w, mapped_r = sync
        if config["isolation"]["runuserns"]:
            # A user namespace of the run's own: what the kernel keeps per user (keyrings, process and
            # other per-user counts) is then the run's alone and goes away with it. A fresh session
            # keyring too: the one inherited from the caller outlives the run.
            # Dumpable while the supervisor writes the id map: the map files of a non-dumpable process
            # belong to the host's root, which a plain user's supervisor is not. No code runs yet.
            check(libc_call("prctl", PR_SET_DUMPABLE, 1, 0, 0, 0))
            check(libc_call("unshare", CLONE_NEWUSER))
            os.write(unshared_w, b"u")
            if os.read(mapped_r, 1) != b"m":
                raise OSError("the run's user namespace got no id map")
            check(libc_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0))
            keyctl = SYSCALLS.get(os.uname().machine, {}).get("keyctl")
            libc = ctypes.CDLL(None, use_errno=True)
            if keyctl is not None and libc.syscall(keyctl, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
                raise OSError(ctypes.get_errno(), "keyctl(KEYCTL_JOIN_SESSION_KEYRING) failed")
        os.close(unshared_w)
        os.close(mapped_r)
        child = os.fork()
        if child == 0:
            _exec_code(config, run, error_w, fds)
        os.close(error_w)
        for fd in fds.values():
            os.close(fd)
        while True:  # reap orphans re-parented to us until the code's own process ends
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                break
        result = {
            "run": run,
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        }
        os.write(status_w, json.dumps(result).encode() + b"\n")
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.write(error_w, f"init {run}: {type(e).__name__}: {e}\n".encode())
    finally:
        os._exit(0)
