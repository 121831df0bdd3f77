"""The two processes of a sandboxed test run: the trusted judge and the untrusted worker.

Standard library only: `sandbox_launch.py` reads this file's source into the launcher's config, and the
launcher (`runs.py`) runs it as `python -I -S -c SOURCE judge` or `python -I -S -c SOURCE worker
ENTRY_POINT`, inside the sandbox's read-only view where this package is not installed.

- The worker (untrusted) runs the completion's program (`main.py`: the problem's prompt plus the
  completion) and then serves calls: it reads `[args, kwargs]` frames on fd 3, calls the entry point
  and writes the result as a plain value on fd 4. It never sees the tests.
- The judge (trusted, another user, outside the workers' PID namespaces) runs the problem's prompt
  (for its helpers, with the stub's body left empty) and the test code once, then forks one judge per
  run, which binds `candidate` to a proxy that sends each call to its run's worker and returns the
  decoded result. The runs' judges work at the same time, each on its own copy of that namespace and
  with its own clock (`RunClock`), so when a run is called, and how long it is given, never waits on
  another run being judged. The verdict is the judge's: `check(candidate)` returned normally, every
  assertion held and no answer was rejected. The first judge writes each on fd 3, which only the
  launcher reads, as the runs' judges decide them.

Values cross between the two as JSON trees of exact builtin types (`to_plain` / `from_plain`): the
judge's decoder builds only int, float, complex, str, bytes, bool, None, list, tuple, dict, set and
frozenset objects, so whatever the worker sends, the assertions compare plain values with the
builtin `==`. The worker's encoder refuses subclasses and other types (an object with its own
`__eq__`); a refused answer fails the run even if the test code would catch the error.
"""

import builtins
import json
import mmap
import os
import select
import struct
import sys
import time

MAX_FRAME = 16 << 20  # bytes in one message; a bigger answer is a failure, not a memory blow-up
REQUESTS_FD, REPLIES_FD = 3, 4  # the worker's ends
VERDICT_FD = 3  # the judge's: one verdict a line; run i's calls go out on fd 4+2i, answers come on 5+2i
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
SIGKILL = 9
# How long a run's judge waits on its worker before it looks at the run's clock again: a sibling decided
# meanwhile makes the clock run faster.
CLOCK_SLICE_S = 0.1

_SCALARS = (type(None), bool, int, float, str)
_SEQUENCES = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}


class NotPlainError(TypeError):
    """A value that is not made only of exact builtin types."""


def to_plain(value: object) -> object:
    """A JSON tree for `value`; raises NotPlainError for any subclass or non-builtin type inside it."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind in _SEQUENCES:
        return [_SEQUENCES[kind], *(to_plain(v) for v in value)]
    if kind is dict:
        return ["dict", *(to_plain(x) for item in value.items() for x in item)]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is complex:
        return ["complex", value.real, value.imag]
    raise NotPlainError(f"{kind.__module__}.{kind.__qualname__} is not a plain builtin value")


def from_plain(tree: object) -> object:
    """The value a `to_plain` tree stands for, built only from exact builtin types.

    `tree` comes from json.loads (itself only builtin types); anything but the expected shapes is
    refused, so untrusted input yields a plain value or a ValueError.
    """
    kind = type(tree)
    if kind in _SCALARS:
        return tree
    if kind is not list or not tree or type(tree[0]) is not str:
        raise ValueError(f"malformed value: {type(tree).__name__}")
    tag, items = tree[0], tree[1:]
    if tag == "list":
        return [from_plain(v) for v in items]
    if tag == "tuple":
        return tuple(from_plain(v) for v in items)
    if tag == "set":
        return {from_plain(v) for v in items}
    if tag == "frozenset":
        return frozenset(from_plain(v) for v in items)
    if tag == "dict" and len(items) % 2 == 0:
        values = [from_plain(v) for v in items]
        return dict(zip(values[::2], values[1::2], strict=True))
    if tag == "bytes" and len(items) == 1 and type(items[0]) is str:
        return bytes.fromhex(items[0])
    if tag == "complex" and len(items) == 2 and all(type(v) in (int, float) for v in items):
        return complex(items[0], items[1])
    raise ValueError(f"malformed value: tag {tag[:20]!r} with {len(items)} item(s)")


def write_frame(fd: int, message: object) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"message of {len(data)} bytes exceeds {MAX_FRAME}")
    _write_all(fd, struct.pack(">I", len(data)) + data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class RunClock:
    """A run's time against its limit: wall time, slowed while the batch has more undecided runs than
    CPUs. The runs of a batch are judged at the same time, so n of them on c CPUs get c/n of a CPU each
    at worst (each run's code and judge are sessions, and so scheduler groups, of their own); counting
    a second as min(1, c/n) of one keeps a run's limit from being eaten by its siblings, and a run
    left alone gets the wall clock. `undecided` holds a byte per run of the batch, 1 until it is decided.

    The clock tells the run nothing: it only decides when the run is stopped, and a stopped run has
    failed. Its rate only rises (runs are decided, never added), so waiting `left_s()` at the rate last
    seen never stops a run early."""

    def __init__(self, limit_s: float, cpus: float, undecided: mmap.mmap) -> None:
        self.limit_s, self.cpus, self.undecided = limit_s, cpus, undecided
        self.used_s = 0.0
        self.last = time.monotonic()
        self.rate = self._rate()

    def _rate(self) -> float:
        return min(1.0, self.cpus / max(1, self.undecided[:].count(1)))

    def left_s(self) -> float:
        """Wall seconds the run may still take at the current rate; 0 once its time is used up."""
        now = time.monotonic()
        self.used_s += (now - self.last) * self.rate
        self.last, self.rate = now, self._rate()
        return max(0.0, (self.limit_s - self.used_s) / self.rate)


def _read_exactly(fd: int, n: int, clock: RunClock | None) -> bytes:
    chunks, left = [], n
    while left:
        while clock is not None:
            wait = clock.left_s()
            if wait <= 0:
                raise TimeoutError("no answer within the run's time")
            if select.select([fd], [], [], min(wait, CLOCK_SLICE_S))[0]:
                break
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, clock: RunClock | None = None) -> object:
    (size,) = struct.unpack(">I", _read_exactly(fd, 4, clock))
    if size > MAX_FRAME:
        raise ValueError(f"message of {size} bytes exceeds {MAX_FRAME}")
    return json.loads(_read_exactly(fd, size, clock))


# ---------------------------------------------------------------------------------------------------
# Judge (trusted)


class RejectedAnswer(BaseException):  # noqa: N818 - not an Exception, so `except Exception` in tests cannot swallow it
    """The worker died, broke the protocol, or answered with a value that is not plain."""


class CandidateRaised(Exception):  # noqa: N818 - stands for the candidate's own exception
    """The candidate raised an exception that is not a builtin one."""


class Candidate:
    """Stands for the completion's function in the judge: each call runs in the run's worker."""

    def __init__(self, requests_fd: int, replies_fd: int, clock: RunClock) -> None:
        self.requests_fd, self.replies_fd, self.clock = requests_fd, replies_fd, clock
        self.calls = 0
        self.rejected: str | None = None
        self.timed_out = False

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        request = [to_plain(list(args)), to_plain(kwargs)]  # the tests' own arguments: plain
        try:
            write_frame(self.requests_fd, request)
            reply = read_frame(self.replies_fd, self.clock)
            kind = reply[0] if type(reply) is list and reply else None
            if kind == "return" and len(reply) == 2:
                return from_plain(reply[1])
            if kind == "raise" and len(reply) == 3:
                raised = _exception(str(reply[1]), str(reply[2]))
            elif kind == "rejected" and len(reply) == 2:
                self.rejected = f"the candidate's answer was rejected: {str(reply[1])[:500]}"
            else:
                self.rejected = f"unexpected reply {str(reply)[:200]}"
        except TimeoutError as e:
            self.timed_out = True
            self.rejected = str(e)
        except (OSError, EOFError, ValueError, TypeError, RecursionError, OverflowError, MemoryError) as e:
            self.rejected = f"no valid answer from the candidate: {type(e).__name__}: {str(e)[:500]}"
        if self.rejected:
            raise RejectedAnswer(self.rejected)
        raise raised


def _exception(name: str, message: str) -> Exception:
    """The builtin exception the candidate raised (so tests that expect one still work), else a stand-in."""
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return CandidateRaised(f"{name}: {message}")


def judge() -> None:
    """Prepare the tests, then judge every run at once, each in a process of its own (`_judge_one`);
    write each verdict to VERDICT_FD as it is known.

    Why at once: a judge that called the runs one after the other would tell each run, by when its
    first call came, how long the runs before it were judged, and so whether they passed. Never trusts
    a worker: what comes from it is only ever decoded into plain values.
    """
    _non_dumpable()
    job = json.loads(sys.stdin.buffer.read())
    runs = job["runs"]
    tests = _prepare(job)
    undecided = mmap.mmap(-1, runs)  # shared with the runs' judges: byte i is 1 until run i is decided
    undecided.write(b"\1" * runs)
    verdicts = {}  # read end -> run, one pipe per run's judge
    for run in range(runs):
        verdict_r, verdict_w = os.pipe()
        parent = os.getpid()
        if os.fork() == 0:
            for fd in verdicts:
                os.close(fd)
            os.close(verdict_r)
            _judge_one(job, tests, run, undecided, verdict_w, parent)
        os.close(verdict_w)
        verdicts[verdict_r] = run
    for run in range(runs):  # only run i's judge holds run i's ends now: the worker sees EOF when it ends
        os.close(4 + 2 * run)
        os.close(5 + 2 * run)
    received = dict.fromkeys(verdicts, b"")
    while verdicts:
        for fd in select.select(list(verdicts), [], [])[0]:
            chunk = os.read(fd, 65536)
            if chunk:
                received[fd] += chunk
                continue
            undecided[verdicts.pop(fd)] = 0  # also when its judge died without a verdict
            os.close(fd)
            _write_all(VERDICT_FD, received.pop(fd))  # one line, or nothing: that run gets no verdict
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break


def _prepare(job: dict) -> dict | BaseException:
    """The namespace every run's tests start from, or why it could not be made (each run fails with it).

    The prompt for its imports and helpers (tests use some, e.g. poly in HumanEval/32), its stub given
    an empty body (each run's judge then binds the name to its proxy: tests may call the function by
    name, HumanEval/33), and the test code, which defines `check`. Once, before the runs' judges fork,
    so that no judge imports again what the prompt imports; each judge gets a copy of its own.
    """
    namespace: dict = {"__name__": "__judge__"}
    try:
        exec(compile(job["prompt"] + "    pass\n", "<prompt>", "exec"), namespace)  # noqa: S102 - trusted
        exec(compile(job["test"], "<test>", "exec"), namespace)  # noqa: S102 - the problem's own tests
    except BaseException as e:
        return e
    return namespace


def _judge_one(
    job: dict, tests: dict | BaseException, run: int, undecided: mmap.mmap, out: int, parent: int
) -> None:
    """The judge of one run (a forked child of the first judge; never returns): its calls, its clock,
    its verdict on `out`."""
    try:
        import ctypes  # already loaded by _non_dumpable

        # Dies with the first judge (and so with the launcher): a fork does not inherit it. Had the first
        # judge died before, this one was re-parented and must not go on.
        if ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
            return
        # A session, and so a scheduler autogroup, of its own, as its run's code has: the runs' judges
        # would otherwise share the launcher's one group, a fraction of what their K runs get.
        os.setsid()
        os.close(VERDICT_FD)
        requests_fd, replies_fd = 4 + 2 * run, 5 + 2 * run
        for other in range(job["runs"]):
            if other != run:
                os.close(4 + 2 * other)
                os.close(5 + 2 * other)
        start = time.monotonic()
        clock = RunClock(job["timeout_s"], job["cpus"], undecided)
        verdict = _judge_run(tests, job["entry_point"], Candidate(requests_fd, replies_fd, clock))
        verdict.update(run=run, duration_s=round(time.monotonic() - start, 4))
        undecided[run] = 0  # the others' clocks speed up at once
        _write_all(out, json.dumps(verdict).encode() + b"\n")
    finally:
        os._exit(0)


def _judge_run(tests: dict | BaseException, entry_point: str, candidate: Candidate) -> dict:
    verdict: dict = {"passed": False, "timed_out": False, "calls": 0, "error": None}
    try:
        ready = read_frame(candidate.replies_fd, candidate.clock)
        if ready != ["ready"]:
            raise RejectedAnswer(f"the completion did not load: {str(ready)[:2000]}")
        if isinstance(tests, BaseException):
            raise tests
        tests[entry_point] = candidate
        tests["check"](candidate)
        if candidate.rejected:
            raise RejectedAnswer(candidate.rejected)
        if candidate.calls == 0:
            raise RejectedAnswer("the tests never called the candidate")
        verdict["passed"] = True
    except TimeoutError:  # waiting for "ready"
        candidate.timed_out = True
        verdict["error"] = "no answer within the run's time"
    except BaseException as e:  # a verdict for every ending, whatever the test code raised
        import traceback  # only on failure: each import costs startup time on every run

        verdict["error"] = "".join(traceback.format_exception(e, limit=-3))[-4000:]
    verdict.update(calls=candidate.calls, timed_out=candidate.timed_out)
    return verdict


def _non_dumpable() -> None:
    """Processes of the same user (the fallback runs both as one) can then neither ptrace this one nor
    open its /proc files (memory, fds)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


# ---------------------------------------------------------------------------------------------------
# Worker (runs the untrusted completion; nothing it does here is trusted)


def worker(entry_point: str) -> None:
    namespace: dict = {"__name__": "__main__"}
    try:
        with open("main.py", encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, "main.py", "exec"), namespace)  # noqa: S102 - the sandboxed code
        function = namespace[entry_point]
    except Exception as e:
        import traceback

        traceback.print_exc()
        write_frame(REPLIES_FD, ["error", f"{type(e).__name__}: {e}"[:2000]])
        sys.exit(1)
    write_frame(REPLIES_FD, ["ready"])
    while True:
        try:
            args, kwargs = read_frame(REQUESTS_FD)
        except EOFError:
            return
        try:
            result = function(*from_plain(args), **from_plain(kwargs))
        except Exception as e:
            write_frame(REPLIES_FD, ["raise", type(e).__name__, str(e)[:1000]])
            continue
        try:
            reply = ["return", to_plain(result)]
        except (NotPlainError, RecursionError) as e:
            reply = ["rejected", f"{type(e).__name__}: {e}"[:1000]]
        write_frame(REPLIES_FD, reply)


if __name__ == "__main__":
    if sys.argv[1:2] == ["judge"]:
        judge()
    elif sys.argv[1:2] == ["worker"] and len(sys.argv) == 3:
        worker(sys.argv[2])
    else:
        sys.exit(f"usage: judge | worker ENTRY_POINT, got {sys.argv[1:]}")
