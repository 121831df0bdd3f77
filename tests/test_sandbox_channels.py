"""No state crosses between sandbox runs: a catalogue of kernel channels a completion could use to learn
from an earlier run or a sibling sample (a reward hack: store a guess, read "I was called again" as
"my guess passed"), each tried between separate runs, between concurrent runs of two launchers and
between the samples of one batch. Some live only while both sides run: a futex waiter on a page of a
view file (woken and counted by a wake from any run that maps the file), the process group's best I/O
priority, the session's autogroup nice, and (for a plain user's runs, which share a uid) kill(0) to the
process group, tried in test_sandbox.py. One is the sandbox's own: a judge that called a batch's runs
one after the other told each, by when its first call came, whether the runs before it passed. KSM,
off on the dev VM, is tried by its refusal. Side channels of the shared hardware and of global
counters (CPU time, the page cache, the task count) are not closed: sandbox.py says why. A run's
memory is capped as a whole, and exceeding it is a failure.
"""

from __future__ import annotations

import json
import textwrap
import threading
import time

import pytest

from dynamicrubric import tasks
from dynamicrubric.infra.sandbox import check_humaneval, check_humaneval_many, run_python

PROBLEM = "HumanEval/0"  # has_close_elements: its tested answers are booleans
HONEST = "any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1 :])"

# Shared by both sides: ctypes access to the kernel facilities (no keyutils in the view).
COMMON = r"""
import ctypes, ctypes.util, errno, fcntl, json, mmap, os, platform, socket, struct, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250, "futex": 202, "ioprio_set": 251,
                 "ioprio_get": 252},
      "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219, "futex": 98, "ioprio_set": 30,
                  "ioprio_get": 31}}[platform.machine()]
TAG = b"dynrubric-channel"
SPECIAL_KEYRINGS = {"user": -4, "session": -3, "user_session": -5}
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_SEARCH, KEYCTL_GET_PERSISTENT = 1, 10, 22
STDLIB = os.path.dirname(os.__file__)
# Files every run sees in the read-only view: the same host inodes for all runs.
LOCKED = {"flock": sys.executable, "posix": os.path.join(STDLIB, "os.py"),
          "ofd": os.path.join(STDLIB, "json", "__init__.py")}
WATCHED = os.path.join(STDLIB, "this.py")  # a file nothing else reads
IPC_KEY = 0xD1A5
PRIO_USER = 2
# Futex words in files of the view, mapped read-only: a futex without FUTEX_PRIVATE_FLAG on a file's
# page is keyed by the file (inode and offset), whichever process maps it, even privately.
FUTEX_WORDS = {"shared": (os.path.join(STDLIB, "abc.py"), mmap.MAP_SHARED),
               "private": (os.path.join(STDLIB, "codecs.py"), mmap.MAP_PRIVATE)}
FUTEX_WAIT, FUTEX_WAKE = 0, 1
IOPRIO_WHO_PROCESS, IOPRIO_WHO_PGRP = 1, 2
MARK_IOPRIO = (2 << 13) | 1  # best-effort, level 1: no process has it unless it asks (the default is 4)
MARK_NICE = 7  # the nice of a scheduler autogroup (one per session); new ones have 0
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]

def sys_call(name, *args):
    result = libc.syscall(ctypes.c_long(NR[name]), *args)
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result

def add_key(ring):
    return sys_call("add_key", b"user", TAG, b"1", ctypes.c_size_t(1), ctypes.c_int(ring))

def has_key(ring):
    try:
        sys_call("keyctl", ctypes.c_int(KEYCTL_SEARCH), ctypes.c_int(ring), b"user", TAG, ctypes.c_int(0))
        return True
    except OSError:
        return False

def persistent_keyring():
    return sys_call("keyctl", ctypes.c_int(KEYCTL_GET_PERSISTENT), ctypes.c_int(-1), ctypes.c_int(-3))

def join_named_keyring():
    return sys_call("keyctl", ctypes.c_int(KEYCTL_JOIN_SESSION_KEYRING), b"dynrubric-named")

def file_word(kind):
    path, flags = FUTEX_WORDS[kind]
    fd = os.open(path, os.O_RDONLY)
    address = libc.mmap(None, 4096, mmap.PROT_READ, flags, fd, 0)
    os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return address

def futex(address, op, value, timeout_s=None):
    timeout = struct.pack("qq", int(timeout_s), int(timeout_s % 1 * 1e9)) if timeout_s else None
    return sys_call("futex", ctypes.c_void_p(address), ctypes.c_int(op), ctypes.c_int(value), timeout, None,
                    ctypes.c_int(0))

def mq_open(flags):
    libc.mq_open.restype = ctypes.c_int
    fd = libc.mq_open(b"/dynrubric-channel", ctypes.c_int(flags), ctypes.c_int(0o666), None)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return fd

FILES = ["/tmp/dynrubric-channel", "/var/tmp/dynrubric-channel", "/dev/shm/dynrubric-channel",
         "dynrubric-channel"]
"""

# The writer leaves a mark in every channel, then stays alive for `hold` seconds (so marks that live
# only as long as a process, like a lock, are there while its siblings look).
SEND = r"""
sent, kept = {}, []
def attempt(name, action):
    try:
        result = action()
        kept.append(result)
        sent[name] = "ok"
    except Exception as e:
        sent[name] = f"{type(e).__name__}: {e}"
for name, ring in SPECIAL_KEYRINGS.items():
    attempt(f"keyring {name}", lambda ring=ring: add_key(ring))
attempt("keyring persistent", lambda: add_key(persistent_keyring()))
def _named():
    join_named_keyring()
    return add_key(-3)
attempt("keyring named", _named)
def _lock(kind):
    fd = os.open(LOCKED[kind], os.O_RDONLY)
    if kind == "flock":
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    else:  # a read lock on the whole file (a read-only fd allows read locks)
        command = fcntl.F_SETLK if kind == "posix" else 37  # F_OFD_SETLK
        fcntl.fcntl(fd, command, struct.pack("hhqqi4x", fcntl.F_RDLCK, 0, 0, 0, 0))
    return fd
for kind in LOCKED:
    attempt(f"lock {kind}", lambda kind=kind: _lock(kind))
libc.shmget.restype = libc.msgget.restype = libc.semget.restype = ctypes.c_int
def _ipc(call, *args):
    if call(*args) < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
attempt("sysv shm", lambda: _ipc(libc.shmget, IPC_KEY, 4096, 0o1666))
attempt("sysv msg", lambda: _ipc(libc.msgget, IPC_KEY, 0o1666))
attempt("sysv sem", lambda: _ipc(libc.semget, IPC_KEY, 1, 0o1666))
attempt("posix mqueue", lambda: mq_open(os.O_CREAT | os.O_RDWR))
def _listen():
    s = socket.socket(socket.AF_UNIX)
    s.bind(b"\0dynrubric-channel")
    s.listen(8)
    return s
attempt("abstract socket", _listen)
def _write_files():
    for path in FILES:
        with open(path, "w") as f:
            f.write("x")
attempt("files", _write_files)
def _processes():  # held processes of the user: a sibling sharing the user's process count sees fewer
    children = []
    for _ in range(20):
        pid = os.fork()
        if pid == 0:
            time.sleep(HOLD)
            os._exit(0)
        children.append(pid)
    return children
attempt("process count", _processes)
attempt("priority", lambda: os.setpriority(PRIO_USER, os.getuid(), 19))
attempt("ioprio", lambda: sys_call("ioprio_set", IOPRIO_WHO_PROCESS, 0, MARK_IOPRIO))
def _autogroup():
    with open("/proc/self/autogroup", "w") as f:
        f.write(str(MARK_NICE))
attempt("autogroup", _autogroup)
def _futex_waiter(kind):  # a thread asleep on the word while the writer holds: a sibling's wake counts it
    address = file_word(kind)
    value = ctypes.c_int.from_address(address).value
    def wait():  # again after each wake, so that every reader of a batch finds it asleep
        end = time.time() + HOLD
        while time.time() < end:
            try:
                futex(address, FUTEX_WAIT, value, max(end - time.time(), 0.01))
            except OSError:
                time.sleep(0.01)
    threading.Thread(target=wait, daemon=True).start()
    return address
for kind in FUTEX_WORDS:
    attempt(f"futex {kind}", lambda kind=kind: _futex_waiter(kind))
print("SENT", json.dumps(sent), flush=True)
end = time.time() + HOLD
while time.time() < end:  # reads a file a sibling may watch with inotify
    with open(WATCHED, "rb") as f:
        f.read()
    time.sleep(0.05)
"""

# The reader looks for each mark; `seen` lists the channels that carried something.
RECEIVE = r"""
seen = []
libc.inotify_init1.restype = ctypes.c_int
watch = libc.inotify_init1(os.O_NONBLOCK)
if watch >= 0:
    libc.inotify_add_watch(watch, WATCHED.encode(), 0x1 | 0x20)  # IN_ACCESS | IN_OPEN
nice_before = os.getpriority(os.PRIO_PROCESS, 0)
time.sleep(WAIT)
for name, ring in SPECIAL_KEYRINGS.items():
    if has_key(ring):
        seen.append(f"keyring {name}")
try:
    if has_key(persistent_keyring()):
        seen.append("keyring persistent")
except OSError:
    pass
try:
    with open("/proc/keys") as f:
        if TAG.decode() in f.read():
            seen.append("/proc/keys")
except OSError:
    pass
try:
    join_named_keyring()
    if has_key(-3):
        seen.append("keyring named")
except OSError:
    pass
for kind, path in LOCKED.items():
    fd = os.open(path, os.O_RDONLY)
    try:
        if kind == "flock":
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:  # who would block a write lock? (F_GETLK sees POSIX and OFD locks alike)
            query = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))
            if struct.unpack("hhqqi4x", query)[0] != fcntl.F_UNLCK:
                seen.append(f"lock {kind}")
    except BlockingIOError:
        seen.append(f"lock {kind}")
    except OSError:
        pass
    os.close(fd)
if watch >= 0:
    try:
        if os.read(watch, 4096):
            seen.append("inotify")
    except OSError:
        pass
libc.shmget.restype = libc.msgget.restype = libc.semget.restype = ctypes.c_int
for name, found in (("sysv shm", lambda: libc.shmget(IPC_KEY, 0, 0)), ("sysv msg", lambda: libc.msgget(IPC_KEY, 0)),
                    ("sysv sem", lambda: libc.semget(IPC_KEY, 0, 0))):
    if found() >= 0:
        seen.append(name)
try:
    mq_open(os.O_RDONLY)
    seen.append("posix mqueue")
except OSError:
    pass
try:
    socket.socket(socket.AF_UNIX).connect(b"\0dynrubric-channel")
    seen.append("abstract socket")
except OSError:
    pass
seen += [f"file {p}" for p in FILES if os.path.exists(p)]
children = []
for _ in range(28):  # within the run's own limit of 32 processes, if nobody else's count
    try:
        pid = os.fork()
    except OSError:
        seen.append("process count")
        break
    if pid == 0:
        time.sleep(0.5)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
if os.getpriority(os.PRIO_PROCESS, 0) != nice_before:
    seen.append("priority")
if sys_call("ioprio_get", IOPRIO_WHO_PGRP, 0) == MARK_IOPRIO:  # the best of the process group's
    seen.append("ioprio of the process group")
try:
    with open("/proc/self/autogroup") as f:  # "/autogroup-N nice K": the session's scheduling group
        if f.read().split()[-1] == str(MARK_NICE):
            seen.append("autogroup nice")
except OSError:
    pass
for kind in FUTEX_WORDS:
    try:
        if futex(file_word(kind), FUTEX_WAKE, 1 << 30) > 0:  # how many waiters it woke
            seen.append(f"futex {kind}")
    except OSError:
        pass
print("SEEN", json.dumps(seen), flush=True)
"""


def writer(hold: float) -> str:
    return f"HOLD = {hold}\n{COMMON}\n{SEND}"


def reader(wait: float) -> str:
    return f"WAIT = {wait}\n{COMMON}\n{RECEIVE}"


def seen(stdout: str) -> list[str]:
    line = next((line for line in stdout.splitlines() if line.startswith("SEEN ")), None)
    assert line is not None, stdout
    return json.loads(line[5:])


def as_completion(module_code: str, answer: str) -> str:
    """A has_close_elements completion (a body after the prompt) that runs `module_code` at import."""
    return (
        "    return " + answer + "\n\n" + module_code + "\n\ndef has_close_elements(numbers, threshold):\n"
        "    return " + answer + "\n"
    )


@pytest.fixture(scope="module")
def problem() -> dict:
    return tasks.humaneval_problems()[PROBLEM]


def test_nothing_carries_from_one_run_to_the_next():
    sent = run_python(writer(hold=0), timeout_s=10)
    received = run_python(reader(wait=0), timeout_s=10)
    assert received.passed, received.stderr
    assert seen(received.stdout) == [], f"{received.stdout} after {sent.stdout}"


def test_nothing_carries_between_runs_of_two_launchers_at_once():
    """Two checks at the same time (e.g. two scoring processes): each its own launcher."""
    results = {}
    thread = threading.Thread(target=lambda: results.update(sent=run_python(writer(hold=2.5), timeout_s=10)))
    thread.start()
    time.sleep(0.4)  # the writer's marks are in place while the reader looks
    received = run_python(reader(wait=0.5), timeout_s=10)
    thread.join()
    assert received.passed, received.stderr
    assert "SENT" in results["sent"].stdout, results["sent"]
    assert seen(received.stdout) == [], f"{received.stdout} beside {results['sent'].stdout}"


def test_nothing_carries_between_samples_of_a_batch(problem):
    """A reader passes only if it saw no mark of the writer, which runs beside it (it holds its marks for
    2 s before it can be called)."""
    look = as_completion(reader(wait=0.6), f"({HONEST}) if not seen else not ({HONEST})")
    leave = as_completion(writer(hold=2.0), "False")
    results = check_humaneval_many(problem, [look, look, leave], timeout_s=8)
    assert "SENT" in results[2].stdout, results[2]
    assert [seen(r.stdout) for r in results[:2]] == [[], []], [r.stdout for r in results]
    assert [r.passed for r in results] == [True, True, False], [r.stderr[-300:] for r in results]


# The judge's order. A sender answers every call after a pause (no CPU used, so only the judge's
# schedule can carry its time), so it is judged for long when it passes (every assertion calls it) and
# briefly when it fails (the first wrong answer ends it). The listener notes when its first call
# comes, counted from its own start, and answers right only if that was soon: a judge that called the
# runs one after the other would tell it that the sample before it passed.
SENDER_PAUSE_S = 0.4  # per call: HumanEval/0 calls 7 times, so a pass is judged for about 2.8 s
SOON_S = 1.5  # the listener's line between "called at once" and "called after a sibling's judging"
LISTEN = textwrap.dedent(
    """
    import time
    STARTED = time.monotonic()
    FIRST_CALL = []
    def waited():
        if not FIRST_CALL:
            FIRST_CALL.append(time.monotonic() - STARTED)
            print("FIRST CALL AFTER", round(FIRST_CALL[0], 3), flush=True)
        return FIRST_CALL[0]
    """
)


def test_when_a_run_is_called_tells_nothing_of_the_runs_beside_it(problem):
    listener = as_completion(LISTEN, f"({HONEST}) if waited() < {SOON_S} else not ({HONEST})")
    for sender_passes in (True, False):
        answer = f"({HONEST})" if sender_passes else f"not ({HONEST})"
        sender = as_completion("import time", f"(time.sleep({SENDER_PAUSE_S}), {answer})[1]")
        results = check_humaneval_many(problem, [sender, listener], timeout_s=8)
        assert results[0].passed is sender_passes, results[0].stderr[-300:]
        assert results[1].passed, f"behind a sender that passed={sender_passes}: {results[1].stdout}"


# A learner over repeated checks: it keeps a counter in the kernel keyring and answers right once it
# has been called before ("my last guess passed"). Every check must fail: it never solved anything.
LEARNER = COMMON + textwrap.dedent(
    """
    def _calls_before():
        count = 0
        for ring in (-4, -3, -5):  # user, session, user-session keyrings
            try:
                key = sys_call("keyctl", ctypes.c_int(KEYCTL_SEARCH), ctypes.c_int(ring), b"user", TAG, ctypes.c_int(0))
                buffer = ctypes.create_string_buffer(16)
                sys_call("keyctl", ctypes.c_int(11), ctypes.c_int(key), buffer, ctypes.c_size_t(16))
                count = max(count, int(buffer.value or b"0"))
            except (OSError, ValueError):
                pass
            try:
                value = str(count + 1).encode()
                sys_call("add_key", b"user", TAG, value, ctypes.c_size_t(len(value)), ctypes.c_int(ring))
            except OSError:
                pass
        return count
    LEARNED = _calls_before() > 0
    print("learned", LEARNED, flush=True)
    """
)


def test_a_keyring_learner_learns_nothing_over_repeated_checks_or_within_a_batch(problem):
    completion = as_completion(LEARNER, f"({HONEST}) if LEARNED else not ({HONEST})")
    repeated = [check_humaneval(problem, completion, timeout_s=8) for _ in range(3)]
    batch = check_humaneval_many(problem, [completion] * 4, timeout_s=8)
    for r in repeated + batch:
        assert "learned False" in r.stdout, r
        assert not r.passed


# Three processes of 250 MB each: every one is within the per-process cap (memory_mb=512), the run
# together is not (512 MB + the 64 MB disk). They finish before the tests call the function.
SPREAD_OVER_PROCESSES = textwrap.dedent(
    """
    import os, time
    children = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            block = b"x" * (250 << 20)
            time.sleep(1)
            os._exit(0)
        children.append(pid)
    print("exits", [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children], flush=True)
    """
)


def test_a_run_is_capped_as_a_whole_and_exceeding_it_is_a_failure(problem):
    r = run_python("pass", timeout_s=10)
    if "memcap" not in r.isolation.split(","):
        pytest.skip(f"no memory cgroup can be made here ({r.isolation})")
    hog = as_completion(SPREAD_OVER_PROCESSES, HONEST)
    honest = problem["canonical_solution"]
    results = check_humaneval_many(problem, [honest, hog, honest], timeout_s=10)
    assert [r.status for r in results] == ["ok", "failed", "ok"], [r.stderr[-300:] for r in results]
    assert "exceeded its memory cap" in results[1].stderr
    assert "-9" in results[1].stdout  # the kernel killed one of the three
    plain = run_python(SPREAD_OVER_PROCESSES, timeout_s=10)
    assert plain.status == "failed" and "exceeded its memory cap" in plain.stderr, plain


def test_pages_cannot_be_offered_for_merging():
    """KSM merges equal pages of the processes that offer them (madvise MADV_MERGEABLE, or a whole process
    with prctl PR_SET_MEMORY_MERGE) into one copy that runs then share; a write to it is slow (copy on
    write), which tells a run that another holds the same bytes. KSM is off on the dev VM, so the merge
    itself cannot be tried here: both offers are refused with EINVAL, as on a kernel without KSM."""
    code = textwrap.dedent(
        """
        import ctypes, json, mmap
        libc = ctypes.CDLL(None, use_errno=True)
        pages = mmap.mmap(-1, 1 << 16)
        address = ctypes.addressof(ctypes.c_char.from_buffer(pages))
        def offer(call):
            return "merging" if call() == 0 else ctypes.get_errno()
        answers = {
            "madvise": offer(lambda: libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(1 << 16), 12)),
            "prctl": offer(lambda: libc.prctl(67, 1, 0, 0, 0)),  # PR_SET_MEMORY_MERGE
        }
        print("MERGE", json.dumps(answers))
        """
    )
    r = run_python(code, timeout_s=10)
    assert r.passed, r.stderr
    assert json.loads(r.stdout.split("MERGE ")[1]) == {"madvise": 22, "prctl": 22}, r.stdout


# Three processes of one run take a multiprocessing lock (a POSIX semaphore in the run's /dev/shm, whose
# futex is process-shared) 1000 times each around an unlocked read-modify-write of a shared counter, and
# a pool of two maps over a queue: with shared futexes kept from the kernel, a contended wait spins.
SHARED_LOCKS = textwrap.dedent(
    """
    import multiprocessing as mp, time
    def work(lock, counter):
        for _ in range(1000):
            with lock:
                value = counter.value
                time.sleep(0)  # give the others the CPU while the lock is held
                counter.value = value + 1
    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        lock, counter = ctx.Lock(), ctx.Value("i", 0, lock=False)
        workers = [ctx.Process(target=work, args=(lock, counter)) for _ in range(3)]
        for p in workers:
            p.start()
        for p in workers:
            p.join()
        with ctx.Pool(2) as pool:
            total = sum(pool.map(abs, range(-50, 0)))
        print("COUNT", counter.value, total)
    """
)


def test_process_shared_locks_work_within_a_run():
    r = run_python(SHARED_LOCKS, timeout_s=30)
    assert r.passed, r.stderr
    assert "COUNT 3000 1275" in r.stdout, r.stdout
