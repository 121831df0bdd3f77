"""What the launcher's parts share: the kernel's constants, the layout of a run, and a libc caller.

Standard library only (see `__main__.py`). `dynamicrubric.infra.sandbox_launch` imports SAFE_PATH and
ALLOW_WEAK_ENV from here, so that the caller and the launcher agree on them.
"""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
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

_libc = None


def libc_call(name: str, *args: int | str | bytes | None) -> str | None:
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


def check(err: str | None) -> None:
    if err:
        raise OSError(err)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(libc_call("mount", source, target, fstype, flags, data))


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
