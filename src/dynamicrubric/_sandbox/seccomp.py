"""The seccomp filter of the sandboxed code, built as classic BPF and installed by the run's code process.

It refuses kernel facilities whose state outlives a run or is shared by all runs of a user whatever the
namespaces (keyrings and their per-user quotas; locks and inotify watches on the read-only view's
files, which are the same host inodes for every run; page-cache probes), plus io_uring, whose
operations would bypass the filter. They fail with an errno, as on a kernel without them.
Standard library only (see `__main__.py`).
"""

from __future__ import annotations

import ctypes
import struct

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
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


def seccomp_program(machine: str) -> bytes | None:
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


def install_seccomp(program: bytes) -> None:
    """Apply the filter to this process and all it starts (needs PR_SET_NO_NEW_PRIVS, set before)."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = SockFprog(len(program) // 8, program)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
