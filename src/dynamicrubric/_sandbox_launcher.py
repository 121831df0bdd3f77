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
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
SETUP_FAILED = 127  # exit code of a launcher child that could not exec
JUDGE_UID = 65533  # the judge's user when running as root: not `nobody`, who runs the code
RUN_ID_BASE = 1 << 30  # as root, a run's host uid and gid are this plus its supervisor's pid (< 2**22)
ALLOW_WEAK_ENV = "DYNRUBRIC_SANDBOX_ALLOW_WEAK"
VIEW_DIR = "/sandbox"  # the code's working directory inside the view
# A run's writable folders: name in its tmpfs -> place in the view
SCRATCH = {"work": VIEW_DIR, "tmp": "/tmp", "var_tmp": "/var/tmp", "shm": "/dev/shm"}
DEVICES = ("null", "zero", "full", "random", "urandom")
CGROUP_PREFIX = "dynrubric-"  # a run's memory cgroup: dynrubric-<the run's host folder name>-<run>

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
# The seccomp filter of the code: kernel facilities whose state outlives a run or is shared by all runs
# of a user whatever the namespaces (keyrings and their per-user quotas; locks and inotify watches on
# the read-only view's files, which are the same host inodes for every run; page-cache probes), plus
# io_uring, whose operations would bypass the filter. They fail with an errno, as on a kernel without them.

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {  # name -> number, per architecture
    "x86_64": {
        "add_key": 248, "request_key": 249, "keyctl": 250, "flock": 73, "inotify_init": 253,
        "inotify_init1": 294, "fanotify_init": 300, "perf_event_open": 298, "bpf": 321,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "preadv2": 327,
        "cachestat": 451, "fcntl": 72, "socket": 41, "socketpair": 53,
    },
    "aarch64": {
        "add_key": 217, "request_key": 218, "keyctl": 219, "flock": 32, "inotify_init1": 26,
        "fanotify_init": 262, "perf_event_open": 241, "bpf": 280, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "preadv2": 286, "cachestat": 451,
        "fcntl": 25, "socket": 198, "socketpair": 199,
    },
}  # fmt: skip
# fcntl commands that lock, lease or watch a file: F_GETLK, F_SETLK, F_SETLKW, the OFD locks, F_SETLEASE,
# F_GETLEASE, F_NOTIFY (dnotify).
LOCK_COMMANDS = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026)
# Socket families that the run's network namespace makes private: AF_UNIX, AF_INET, AF_INET6, AF_NETLINK.
# Others, like AF_VSOCK (not namespaced: it reaches the host), are refused.
SOCKET_FAMILIES = (1, 2, 10, 16)
X32_SYSCALL_BIT = 0x40000000
EPERM, ENOLCK, EAFNOSUPPORT = 1, 37, 97


def _seccomp_program(machine: str) -> bytes | None:
    """The filter as classic BPF (struct sock_filter items), or None for an architecture without a table."""
    if machine not in SYSCALLS:
        return None
    nr = SYSCALLS[machine]
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
    errno = 0x00050000  # SECCOMP_RET_ERRNO | the errno
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    arg = [16 + 8 * i for i in range(6)]  # offsets of seccomp_data.args[i] (their low 32 bits)

    def refuse_if(values: tuple[int, ...], code: int) -> list[tuple]:
        return [item for v in values for item in ((jeq, 0, 1, v), (ret, 0, 0, errno | code))]

    def only(values: tuple[int, ...], code: int) -> list[tuple]:
        return [x for v in values for x in ((jeq, 0, 1, v), (ret, 0, 0, allow))] + [(ret, 0, 0, errno | code)]

    def when(name: str, body: list[tuple]) -> list[tuple]:  # for syscall `name` (nr in A), then `body`
        return [(jeq, 0, len(body), nr[name]), *body]

    blocked = tuple(nr[n] for n in nr if n not in ("fcntl", "socket", "socketpair"))
    program = [
        (load, 0, 0, 4),  # arch: a 32-bit syscall (int 0x80) has other numbers, so it is never allowed
        (jeq, 1, 0, AUDIT_ARCH[machine]),
        (ret, 0, 0, kill),
        (load, 0, 0, 0),  # the syscall number
        (jge, 0, 1, X32_SYSCALL_BIT),  # the x32 ABI's numbers
        (ret, 0, 0, errno | EPERM),
        *refuse_if(blocked, EPERM),
        *when("fcntl", [(load, 0, 0, arg[1]), *refuse_if(LOCK_COMMANDS, ENOLCK), (ret, 0, 0, allow)]),
        *when("socket", [(load, 0, 0, arg[0]), *only(SOCKET_FAMILIES, EAFNOSUPPORT)]),
        *when("socketpair", [(load, 0, 0, arg[0]), *only(SOCKET_FAMILIES, EAFNOSUPPORT)]),
        (ret, 0, 0, allow),
    ]
    return b"".join(struct.pack("HBBI", *item) for item in program)


def _install_seccomp(program: bytes) -> None:
    """Apply the filter to this process and all it starts (needs PR_SET_NO_NEW_PRIVS, set before)."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = SockFprog(len(program) // 8, program)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


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
    """The read-only part of the code's filesystem (see sandbox.py), mounted under base/root in this
    namespace. Each run adds its own writable tmpfs in a namespace of its own (`_mount_scratch`)."""
    root = f"{config['base']}/root"
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
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
            if os.path.realpath(path) == "/":
                raise OSError("refusing to show the host's whole filesystem in the view")
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
    for inside in SCRATCH.values():
        os.makedirs(root + inside, exist_ok=True)
    os.mkdir(f"{root}/proc")  # mounted by each run's init, inside its PID namespace
    _mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _mount_scratch(config: dict, run: int) -> None:
    """One run's writable storage, in a mount namespace of the run's own: a size-capped tmpfs (the disk
    quota, shared by its four uses) bound at the working directory, /tmp, /var/tmp and /dev/shm."""
    _check(_libc_call("unshare", CLONE_NEWNS))
    base = config["base"]
    scratch = f"{base}/scratch-{run}"
    os.mkdir(scratch, 0o700)
    _mount(
        "tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['disk_mb']}m,nr_inodes=16k,mode=755"
    )
    for name in SCRATCH:
        os.mkdir(f"{scratch}/{name}", 0o700 if name == "work" else 0o1777)
        os.chmod(f"{scratch}/{name}", 0o700 if name == "work" else 0o1777)  # mkdir applies the umask
    _write_code(f"{scratch}/work", config["codes"][run], config["host_ids"])
    for name, inside in SCRATCH.items():
        _mount(f"{scratch}/{name}", f"{base}/root{inside}", None, MS_BIND)


def _write_code(folder: str, code: str, owner: list[int]) -> None:
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = f"{folder}/main.py"
    with open(path, "w", encoding="utf-8") as f:
        f.write(code)
    for p in (folder, path):
        os.chown(p, owner[0], owner[1])


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
    _check(_libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
    _check(_libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))


def _exec_judge(config: dict, error_w: int, fds: dict[int, int]) -> None:
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
            _install_seccomp(config["seccomp"])
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


def _supervise(config: dict, run: int, error_w: int, status_w: int, fds: dict[int, int]) -> None:
    """One run's supervisor (a forked child of the launcher; never returns): its own mount namespace
    and tmpfs, then a PID namespace whose init runs the code and reaps. Killing this process kills the
    run: init dies with it (PDEATHSIG), and the kernel then kills everything in the namespace."""
    try:
        _check(_libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
        # A network and IPC namespace per run too: runs of one batch must not reach each other through
        # abstract Unix sockets or SysV IPC.
        for name, flag in (("netns", CLONE_NEWNET), ("ipcns", CLONE_NEWIPC)):
            if config["isolation"][name]:
                _check(_libc_call("unshare", flag))
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
            _mount_scratch(config, run)
        if config["isolation"]["pidns"]:
            _check(_libc_call("unshare", CLONE_NEWPID))
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
        _write(f"/proc/{pid}/{name}", f"{inside[i]} {host[i]} 1")


def _init(
    config: dict, run: int, error_w: int, status_w: int, fds: dict[int, int], sync: tuple[int, int]
) -> None:
    """PID 1 of the run's PID namespace (when there is one): runs the code as its child and reaps.

    The code is not PID 1 itself, so signals behave as usual for it and orphans get reaped. When this
    process exits, the kernel kills everything left in the namespace. Never returns.
    """
    try:
        _check(_libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
        if config["isolation"]["view"]:
            # Refused e.g. in a user namespace under a masked /proc: the code then has no /proc at all.
            with contextlib.suppress(OSError):
                proc = f"{config['base']}/root/proc"
                _mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                for name in ("keys", "key-users"):  # keys of the run's host uid, and every user's key counts
                    _mount(f"{config['base']}/root/dev/null", f"{proc}/{name}", None, MS_BIND)
        unshared_w, mapped_r = sync
        if config["isolation"]["runuserns"]:
            # A user namespace of the run's own: what the kernel keeps per user (keyrings, process and
            # other per-user counts) is then the run's alone and goes away with it. A fresh session
            # keyring too: the one inherited from the caller outlives the run.
            # Dumpable while the supervisor writes the id map: the map files of a non-dumpable process
            # belong to the host's root, which a plain user's supervisor is not. No code runs yet.
            _check(_libc_call("prctl", PR_SET_DUMPABLE, 1, 0, 0, 0))
            _check(_libc_call("unshare", CLONE_NEWUSER))
            os.write(unshared_w, b"u")
            if os.read(mapped_r, 1) != b"m":
                raise OSError("the run's user namespace got no id map")
            _check(_libc_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0))
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


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


def _lines(fd: int):
    """JSON objects, one a line, as they arrive; ends at EOF."""
    buffer = b""
    while chunk := os.read(fd, 65536):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                yield json.loads(line)
    os.close(fd)


def _allowed(flag: int) -> bool:
    """Whether a namespace of this kind can be made here (asked in a throwaway child)."""
    child = os.fork()
    if child == 0:
        os._exit(1 if _libc_call("unshare", flag) else 0)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _memory_cgroups(config: dict) -> list[str]:
    """One memory cgroup per run, limited to the run's memory: the cap is on all of its processes (and
    the files it writes to its tmpfs) together. Made next to our own cgroup's children (cgroup v2 or
    the v1 memory hierarchy); [] where none can be made (no cgroup we may write to)."""
    with open("/proc/self/cgroup") as f:
        own = dict(line.rstrip("\n").split(":", 2)[1:] for line in f if line.count(":") >= 2)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    candidates = []
    for fields in mounts:
        fstype, options = fields[-3], fields[-1].split(",")
        key = "" if fstype == "cgroup2" else "memory" if fstype == "cgroup" and "memory" in options else None
        if key is None or key not in own:
            continue
        root, path = fields[3], own[key]  # a mount of a sub-tree (in a container) shows it from its root
        if root != "/" and path.startswith(root):
            path = path[len(root) :]
        files = (
            ("memory.max", "memory.swap.max")
            if key == ""
            else ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        )
        candidates.append((fields[4] + path, *files))
    name = CGROUP_PREFIX + os.path.basename(config["base"])
    for folder, limit_file, swap_file in candidates:
        # In cgroup v2 a cgroup with processes (ours) cannot pass controllers to children: try its parent.
        for parent in (folder.rstrip("/"), os.path.dirname(folder.rstrip("/"))):
            made = []
            try:
                v2 = limit_file == "memory.max"
                for run in range(len(config["codes"])):
                    path = f"{parent}/{name}-{run}"
                    os.mkdir(path, 0o700)
                    made.append(path)
                    _write(f"{path}/{limit_file}", str(config["limits"]["run_memory"]))
                    with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                        _write(f"{path}/{swap_file}", "0" if v2 else str(config["limits"]["run_memory"]))
                    with contextlib.suppress(OSError):  # v2: an out-of-memory kill ends the whole run
                        _write(f"{path}/memory.oom.group", "1")
                return made
            except OSError:
                for path in made:
                    with contextlib.suppress(OSError):
                        os.rmdir(path)
    return []


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _oom_killed(cgroup: str) -> bool:
    """Whether the kernel killed a process of the run for exceeding the run's memory."""
    for name in ("memory.events", "memory.oom_control"):  # cgroup v2, v1
        with contextlib.suppress(OSError), open(f"{cgroup}/{name}") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
    return False


def _refusal(isolation: dict) -> str:
    missing = [n for n in ("mountns", "view", "netns", "pidns", "runuserns") if not isolation.get(n)]
    return (
        f"sandbox: no isolated run is possible here (missing: {', '.join(missing)}; "
        f"{'; '.join(isolation['notes'])}). Run as root or where user namespaces are allowed, or in a "
        f"gVisor pod (manifests/cluster/gvisor), and set {ALLOW_WEAK_ENV}=1 to accept the weaker fallback there."
    )


def _launch() -> int:
    config = json.loads(_read_all(0))  # the parent writes it to our stdin; it holds the tests
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)  # what the code inherits as stdin
    os.close(null)
    report_fd = config["report_fd"]
    os.set_inheritable(report_fd, False)  # the code must not be able to forge the report

    def report(item: dict) -> None:
        os.write(report_fd, json.dumps(item).encode() + b"\n")

    isolation = {"user": config["user_name"], "notes": []}
    isolation.update(
        dict.fromkeys(("userns", "mountns", "view", "netns", "pidns", "ipcns", "runuserns", "memcap"), False)
    )
    config["isolation"] = isolation
    config["seccomp"] = _seccomp_program(os.uname().machine)
    isolation["seccomp"] = config["seccomp"] is not None
    if not isolation["seccomp"]:
        isolation["notes"].append(f"no seccomp filter for the {os.uname().machine} architecture")
    if config["namespaces"]:
        _enter_namespaces(isolation)
        if isolation["mountns"]:
            try:
                _build_view(config)
                isolation["view"] = True
            except OSError as e:
                isolation["notes"].append(f"no read-only view ({e}); the host filesystem is visible")
        isolation["pidns"] = _allowed(CLONE_NEWPID)
        if not isolation["pidns"]:
            isolation["notes"].append(
                "no pidns (unshare failed); stray processes are found by session and folder"
            )
        isolation["runuserns"] = _allowed(CLONE_NEWUSER)
        if not isolation["runuserns"]:
            isolation["notes"].append("no user namespace per run (unshare failed)")
    else:
        isolation["notes"].append("namespaces disabled by the caller; using the fallback guards")
    complete = all(isolation[n] for n in ("mountns", "view", "netns", "pidns", "runuserns"))
    config["cgroups"] = _memory_cgroups(config) if complete else []
    isolation["memcap"] = bool(config["cgroups"])
    if complete and not isolation["memcap"]:
        isolation["notes"].append("no memory cgroup to write to: memory is capped per process only")
    if not complete and config["allow_weak"]:
        isolation["notes"].append(f"running with weak isolation ({ALLOW_WEAK_ENV} or allow_weak)")
    report({"isolation": isolation, "cgroups": config["cgroups"]})  # the parent removes them
    if not complete and not config["allow_weak"]:
        report({"refused": _refusal(isolation)})
        return 0
    runs, job, base = len(config["codes"]), config["job"], config["base"]
    owner = config["user"] or [os.getuid(), os.getgid()]
    if not isolation["view"]:
        for run, code in enumerate(config["codes"]):
            _write_code(f"{base}/work-{run}", code, owner)
    # Same-user processes (the fallback) can then neither ptrace this process nor read its memory.
    _check(_libc_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0))

    error_r, error_w = os.pipe()  # setup errors; EOF once every child has exec'd (close-on-exec)
    status_r, status_w = os.pipe()  # the runs' exit statuses, from their inits
    code_fds = []
    for run in range(runs):  # stdout, stderr: files the parent reads; the code writes its end only
        out, err = (
            os.open(f"{base}/{n}-{run}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600) for n in ("out", "err")
        )
        code_fds.append({1: out, 2: err})
    judge_pid, launcher_ends = None, []
    if job is not None:
        job_r, job_w = os.pipe()
        verdict_r, verdict_w = os.pipe()
        judge_fds = {0: job_r, 3: verdict_w}
        for run in range(runs):  # the judge's calls to run i go out on fd 4+2i, answers come on 5+2i
            req_r, req_w = os.pipe()
            rep_r, rep_w = os.pipe()
            judge_fds.update({4 + 2 * run: req_w, 5 + 2 * run: rep_r})
            code_fds[run].update({3: req_r, 4: rep_w})
        judge_pid = os.fork()  # in the launcher's PID namespace: no run's code can see or signal it
        if judge_pid == 0:
            _exec_judge(config, error_w, judge_fds)
        for fd in judge_fds.values():
            os.close(fd)
        launcher_ends = [job_w, verdict_r]
    supervisors = {}
    for run in range(runs):
        pid = os.fork()
        if pid == 0:
            for other, fds in enumerate(code_fds):  # another run's ends must not reach this run's code
                if other != run:
                    for fd in fds.values():
                        os.close(fd)
            for fd in (error_r, status_r, *launcher_ends):
                os.close(fd)
            _supervise(config, run, error_w, status_w, code_fds[run])
        supervisors[run] = pid
    for fds in code_fds:
        for fd in fds.values():
            os.close(fd)
    os.close(error_w)
    os.close(status_w)

    if job is not None:
        with contextlib.suppress(BrokenPipeError):  # a judge that died early is reported below
            os.write(launcher_ends[0], json.dumps({**job, "runs": runs}).encode())
        os.close(launcher_ends[0])
    setup_error = _read_all(error_r).decode(errors="replace")
    if setup_error:
        report({"setup_error": setup_error})
    if job is not None:
        for verdict in _lines(launcher_ends[1]):  # one a line, as the judge decides them
            run = verdict.get("run")
            if run in supervisors:
                if config["cgroups"] and _oom_killed(config["cgroups"][run]):  # even if it answered
                    error = f"the run exceeded its memory cap\n{verdict.get('error') or ''}"
                    verdict = {**verdict, "passed": False, "error": error}
                report({"verdict": verdict})
                # That run is decided: end it now, so it takes no CPU from the runs still being judged.
                os.kill(supervisors[run], signal.SIGKILL)
        for pid in supervisors.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.waitpid(judge_pid, 0)
    for status in _lines(status_r):
        if config["cgroups"]:
            status["oom"] = _oom_killed(config["cgroups"][status["run"]])
        report({"status": status})
    for pid in supervisors.values():
        os.waitpid(pid, 0)
    report({"done": True})
    return 0


if __name__ == "__main__":
    sys.exit(_launch())
