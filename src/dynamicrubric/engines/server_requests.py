"""One try of a request to a model server, below `ServerEngine`: the error of a try that gave no usable
answer (`RequestLost`: its ledger outcome and whether to try again), the HTTP backend that bounds every try
by one wall-clock end, and the checks of a completions reply's choices. Apart from server_engine.py:
this is the transport and the reply's shape, the same for every call the engine makes."""

from __future__ import annotations

import threading
import time
from typing import Any


class RequestLost(Exception):
    """One try of a request that gave no usable answer: its ledger outcome, what happened, and whether
    trying again may help (a timeout, a lost connection, a 429/5xx, a cut body, an aborted request)."""

    def __init__(self, outcome: str, detail: str, transient: bool) -> None:
        super().__init__(detail)
        self.outcome, self.detail, self.transient = outcome, detail, transient


# --------------------------------------------------------------------------------------------------
# One wall-clock bound per request, whatever the server does. httpcore's timeouts bound each socket
# operation, so a server that trickles a byte at a time holds a request forever; this backend gives every
# connect, read and write of the calling thread's request only the time left until that request's end.

current_request_end = threading.local()


def _time_left(timeout: float | None, error: type[Exception]) -> float | None:
    end = getattr(current_request_end, "at", None)
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise error("the request's time is up")
    return left if timeout is None else min(timeout, left)


def bounded_backend() -> Any:
    import httpcore

    class Stream(httpcore.NetworkStream):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            return self.inner.read(max_bytes, _time_left(timeout, httpcore.ReadTimeout))

        def write(self, buffer: bytes, timeout: float | None = None) -> None:
            self.inner.write(buffer, _time_left(timeout, httpcore.WriteTimeout))

        def close(self) -> None:
            self.inner.close()

        def start_tls(self, *args: Any, **kwargs: Any) -> Any:
            return Stream(self.inner.start_tls(*args, **kwargs))

        def get_extra_info(self, info: str) -> Any:
            return self.inner.get_extra_info(info)

    class Backend(httpcore.NetworkBackend):
        def __init__(self) -> None:
            self.inner = httpcore.SyncBackend()

        def connect_tcp(self, host: str, port: int, timeout: float | None = None, **kwargs: Any) -> Any:
            timeout = _time_left(timeout, httpcore.ConnectTimeout)
            return Stream(self.inner.connect_tcp(host, port, timeout, **kwargs))

        def connect_unix_socket(self, path: str, timeout: float | None = None, **kwargs: Any) -> Any:
            timeout = _time_left(timeout, httpcore.ConnectTimeout)
            return Stream(self.inner.connect_unix_socket(path, timeout, **kwargs))

        def sleep(self, seconds: float) -> None:
            self.inner.sleep(seconds)

    return Backend()


def reply_finish_reasons(choices: list[dict]) -> list[str]:
    """The choices' finish reasons, each "stop" or "length"; RequestLost for a request the server aborted
    ("abort", or none given: never a finished text, so never a rubric or a verdict) or any other."""
    reasons = [c.get("finish_reason") for c in choices]
    if any(r in (None, "abort") for r in reasons):
        raise RequestLost("aborted", f"finish_reason {reasons}", True)
    if any(r not in ("stop", "length") for r in reasons):
        raise RequestLost("malformed", f"finish_reason {reasons}", False)
    return reasons


def checked_choices(answer: dict, count: int) -> list[dict]:
    """The reply's `count` choices in index order, or RequestLost: vLLM answers every prompt × n, indexed."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise RequestLost("malformed", "a reply without its choices", False)
    indices = [c.get("index") for c in choices]
    if not all(type(i) is int for i in indices) or sorted(indices) != list(range(count)):
        raise RequestLost("malformed", f"{len(choices)} choice(s) for the {count} asked", False)
    return sorted(choices, key=lambda c: c["index"])
