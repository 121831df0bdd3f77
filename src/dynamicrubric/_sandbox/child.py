"""The two processes of a sandboxed test run: the trusted judge and the untrusted worker.

Standard library only: `sandbox_launch.py` reads this file's source into the launcher's config, and the
launcher (`runs.py`) runs it as `python -I -S -c SOURCE judge` or `python -I -S -c SOURCE worker
ENTRY_POINT`, inside the sandbox's read-only view where this package is not installed.

- The worker (untrusted) runs the completion's program (`main.py`: the problem's prompt plus the
  completion) and then serves calls: it reads `[args, kwargs]` frames on fd 3, calls the entry point
  and writes the result as a plain value on fd 4. It never sees the tests.
- The judge (trusted, another process, another user, outside the workers' PID namespaces) runs the
  problem's prompt (for its helpers, with the stub's body left empty) and the test code, with
  `candidate` bound to a proxy that sends each call to a worker and returns the decoded result; one
  run after the other, each with a fresh namespace and its own deadline. The verdict is the judge's:
  `check(candidate)` returned normally, every assertion held and no answer was rejected. It is written
  to fd 3, which only the launcher reads.

Values cross between the two as JSON trees of exact builtin types (`to_plain` / `from_plain`): the
judge's decoder builds only int, float, complex, str, bytes, bool, None, list, tuple, dict, set and
frozenset objects, so whatever the worker sends, the assertions compare plain values with the
builtin `==`. The worker's encoder refuses subclasses and other types (an object with its own
`__eq__`); a refused answer fails the run even if the test code would catch the error.
"""

import builtins
import json
import os
import select
import struct
import sys
import time

MAX_FRAME = 16 << 20  # bytes in one message; a bigger answer is a failure, not a memory blow-up
REQUESTS_FD, REPLIES_FD = 3, 4  # the worker's ends
VERDICT_FD = 3  # the judge's: one verdict a line; run i's calls go out on fd 4+2i, answers come on 5+2i
PR_SET_DUMPABLE = 4

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
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError("no answer within the run's time")
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, deadline: float | None = None) -> object:
    (size,) = struct.unpack(">I", _read_exactly(fd, 4, deadline))
    if size > MAX_FRAME:
        raise ValueError(f"message of {size} bytes exceeds {MAX_FRAME}")
    return json.loads(_read_exactly(fd, size, deadline))


# ---------------------------------------------------------------------------------------------------
# Judge (trusted)


class RejectedAnswer(BaseException):  # noqa: N818 - not an Exception, so `except Exception` in tests cannot swallow it
    """The worker died, broke the protocol, or answered with a value that is not plain."""


class CandidateRaised(Exception):  # noqa: N818 - stands for the candidate's own exception
    """The candidate raised an exception that is not a builtin one."""


class Candidate:
    """Stands for the completion's function in the judge: each call runs in the run's worker."""

    def __init__(self, requests_fd: int, replies_fd: int, deadline: float) -> None:
        self.requests_fd, self.replies_fd, self.deadline = requests_fd, replies_fd, deadline
        self.calls = 0
        self.rejected: str | None = None
        self.timed_out = False

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        request = [to_plain(list(args)), to_plain(kwargs)]  # the tests' own arguments: plain
        try:
            write_frame(self.requests_fd, request)
            reply = read_frame(self.replies_fd, self.deadline)
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
    """Run the tests against each run's worker in turn; write each verdict to VERDICT_FD as it is known.

    Never trusts a worker: what comes from it is only ever decoded into plain values.
    """
    _non_dumpable()
    job = json.loads(sys.stdin.buffer.read())
    for run in range(job["runs"]):
        start = time.monotonic()
        requests_fd, replies_fd = 4 + 2 * run, 5 + 2 * run
        verdict = _judge_run(job, Candidate(requests_fd, replies_fd, start + job["timeout_s"]))
        verdict.update(run=run, duration_s=round(time.monotonic() - start, 4))
        os.close(requests_fd)  # the worker sees EOF and ends
        os.close(replies_fd)
        os.write(VERDICT_FD, json.dumps(verdict).encode() + b"\n")


def _judge_run(job: dict, candidate: Candidate) -> dict:
    verdict: dict = {"passed": False, "timed_out": False, "calls": 0, "error": None}
    try:
        ready = read_frame(candidate.replies_fd, candidate.deadline)
        if ready != ["ready"]:
            raise RejectedAnswer(f"the completion did not load: {str(ready)[:2000]}")
        namespace: dict = {"__name__": "__judge__"}
        # The prompt for its imports and helpers (tests use some, e.g. poly in HumanEval/32); the
        # stub it ends with gets an empty body and is then replaced by the proxy, as tests may call
        # the function by name (HumanEval/33). A fresh namespace per run: no state carries over.
        exec(compile(job["prompt"] + "    pass\n", "<prompt>", "exec"), namespace)  # noqa: S102 - trusted
        namespace[job["entry_point"]] = candidate
        exec(compile(job["test"], "<test>", "exec"), namespace)  # noqa: S102 - the problem's own tests
        namespace["check"](candidate)
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
