"""The seccomp filter of the sandboxed code, built as classic BPF and installed by the run's code process.

It refuses kernel facilities whose state outlives a run or is shared by all runs of a user whatever the
namespaces (keyrings and their per-user quotas; page-cache probes), and every object the kernel keys
by a file (locks, leases, dnotify/inotify/fanotify watches, futexes): the read-only view's files are
the same host inodes for every run, so such an object is one that all runs of the machine can reach
at once. It also refuses KSM (pages shared by content across processes) and io_uring, whose
operations would bypass the filter. They fail with an errno, as on a kernel without them; futexes
keep working within a process (below).
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
        "cachestat": 451, "futex_waitv": 449, "futex_wake": 454, "futex_wait": 455, "futex_requeue": 456,
        "fcntl": 72, "socket": 41, "socketpair": 53, "futex": 202, "madvise": 28, "prctl": 157,
    },
    "aarch64": {
        "add_key": 217, "request_key": 218, "keyctl": 219, "flock": 32, "inotify_init1": 26,
        "fanotify_init": 262, "perf_event_open": 241, "bpf": 280, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "preadv2": 286, "cachestat": 451,
        "futex_waitv": 449, "futex_wake": 454, "futex_wait": 455, "futex_requeue": 456,
        "fcntl": 25, "socket": 198, "socketpair": 199, "futex": 98, "madvise": 233, "prctl": 167,
    },
}  # fmt: skip
# Allowed, with a rule on their arguments (below); every other syscall in the table is refused outright.
# The futex2 calls (futex_waitv, futex_wake, futex_wait, futex_requeue) are refused: their private flag
# sits in memory (waitv, requeue) or is not worth a rule of its own, and glibc does not use them.
RULED = ("fcntl", "socket", "socketpair", "futex", "madvise", "prctl")
# fcntl commands that lock, lease or watch a file: F_GETLK, F_SETLK, F_SETLKW, the OFD locks, F_SETLEASE,
# F_GETLEASE, F_NOTIFY (dnotify).
LOCK_COMMANDS = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026)
# Socket families that the run's network namespace makes private: AF_UNIX, AF_INET, AF_INET6, AF_NETLINK.
# Others, like AF_VSOCK (not namespaced: it reaches the host), are refused.
SOCKET_FAMILIES = (1, 2, 10, 16)
# futex(2) without FUTEX_PRIVATE_FLAG is keyed by what backs the word: for a page of a file, even mapped
# privately, that is the file's inode and offset, so a waiter in one run is woken (and counted) by a
# wake in any other run that maps the same file of the view. Private futexes (keyed by the process's
# memory) are all that Python and glibc use within a process and pass untouched. The shared ones never
# reach the kernel: a wait returns EAGAIN at once (the word "changed": every caller re-checks its
# condition and waits again, so a process-shared lock still works, by spinning), a wake returns 0 (woke
# nobody; nobody in a run ever sleeps on a shared key), and the PI operations fail with ENOSYS.
FUTEX_PRIVATE_FLAG = 128
FUTEX_COMMAND = 0x7F  # the command without FUTEX_PRIVATE_FLAG and FUTEX_CLOCK_REALTIME (256)
FUTEX_WAITS = (0, 9, 11)  # FUTEX_WAIT, FUTEX_WAIT_BITSET, FUTEX_WAIT_REQUEUE_PI
# FUTEX_WAKE, FUTEX_REQUEUE, FUTEX_CMP_REQUEUE, FUTEX_WAKE_OP, FUTEX_WAKE_BITSET
FUTEX_WAKES = (1, 3, 4, 5, 10)
# KSM merges equal pages of the processes that offer them into one shared copy, whose copy-on-write on
# the next write is timed to learn what another process holds: offering is refused, as without KSM.
MADV_MERGEABLE, PR_SET_MEMORY_MERGE = 12, 67
X32_SYSCALL_BIT = 0x40000000
EPERM, EAGAIN, EINVAL, ENOSYS, ENOLCK, EAFNOSUPPORT = 1, 11, 22, 38, 37, 97


def seccomp_program(machine: str) -> bytes | None:
    """The filter as classic BPF (struct sock_filter items), or None for an architecture without a table."""
    if machine not in SYSCALLS:
        return None
    nr = SYSCALLS[machine]
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
    errno = 0x00050000  # SECCOMP_RET_ERRNO | the errno
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    jset, alu_and = 0x45, 0x54  # BPF_JMP|JSET|K, BPF_ALU|AND|K
    arg = [16 + 8 * i for i in range(6)]  # offsets of seccomp_data.args[i] (their low 32 bits)

    def refuse_if(values: tuple[int, ...], code: int) -> list[tuple]:
        return [item for v in values for item in ((jeq, 0, 1, v), (ret, 0, 0, errno | code))]

    def only(values: tuple[int, ...], code: int) -> list[tuple]:
        return [x for v in values for x in ((jeq, 0, 1, v), (ret, 0, 0, allow))] + [(ret, 0, 0, errno | code)]

    def when(name: str, body: list[tuple]) -> list[tuple]:  # for syscall `name` (nr in A), then `body`
        return [(jeq, 0, len(body), nr[name]), *body]

    def refuse_arg(index: int, values: tuple[int, ...], code: int) -> list[tuple]:  # else allowed
        return [(load, 0, 0, arg[index]), *refuse_if(values, code), (ret, 0, 0, allow)]

    blocked = tuple(nr[n] for n in nr if n not in RULED)
    shared_futex = [
        (load, 0, 0, arg[1]),
        (jset, 0, 1, FUTEX_PRIVATE_FLAG),
        (ret, 0, 0, allow),
        (alu_and, 0, 0, FUTEX_COMMAND),
        *refuse_if(FUTEX_WAITS, EAGAIN),
        *refuse_if(FUTEX_WAKES, 0),  # SECCOMP_RET_ERRNO with 0: the call returns 0 without running
        (ret, 0, 0, errno | ENOSYS),
    ]
    program = [
        (load, 0, 0, 4),  # arch: a 32-bit syscall (int 0x80) has other numbers, so it is never allowed
        (jeq, 1, 0, AUDIT_ARCH[machine]),
        (ret, 0, 0, kill),
        (load, 0, 0, 0),  # the syscall number
        (jge, 0, 1, X32_SYSCALL_BIT),  # the x32 ABI's numbers
        (ret, 0, 0, errno | EPERM),
        *refuse_if(blocked, EPERM),
        *when("fcntl", refuse_arg(1, LOCK_COMMANDS, ENOLCK)),
        *when("socket", [(load, 0, 0, arg[0]), *only(SOCKET_FAMILIES, EAFNOSUPPORT)]),
        *when("socketpair", [(load, 0, 0, arg[0]), *only(SOCKET_FAMILIES, EAFNOSUPPORT)]),
        *when("futex", shared_futex),
        *when("madvise", refuse_arg(2, (MADV_MERGEABLE,), EINVAL)),
        *when("prctl", refuse_arg(0, (PR_SET_MEMORY_MERGE,), EINVAL)),
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
