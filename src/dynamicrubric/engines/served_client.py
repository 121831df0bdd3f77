"""`ServedClient`: the requests to one OpenAI-compatible server, counted in a ledger. What `ServerEngine` (a
model behind `vllm serve`) and `ChatJudge` (any chat endpoint, a GPT-4.1-class judge included) share.

Every request has `serving.request_timeout_s` of wall-clock time for everything (connect, send, the whole
answer); a timeout, a lost connection, a 429/5xx, a cut body or an aborted request is retried with
exponential backoff, and all of a call's requests (or, inside `budget()`, all of a step's) end within
`serving.deadline_s`. A request without a usable answer ends as None, its outcome in `ledger`: its
caller leaves the verdict or sample out (NaN, FAILED), never a 0 or a 0.5.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from dynamicrubric.engines.served_calls import CallLedger, ServedError, counts_text
from dynamicrubric.engines.server_requests import RequestLost, bounded_backend, current_request_end
from dynamicrubric.infra.config import ServingConfig

log = logging.getLogger(__name__)


class ServedClient:
    """The transport to one server: `url` (with or without /v1), `name` for messages, an optional bearer
    `api_key` (sent as Authorization: never logged)."""

    def __init__(self, url: str, serving: ServingConfig, *, name: str, api_key: str = "") -> None:
        import httpcore

        self.url = url.rstrip("/").removesuffix("/v1")
        self.serving = serving
        self.name = name
        self.ledger = CallLedger()
        self._ledger_lock = threading.Lock()
        self._budget_end: float | None = None
        self._auth = [("Authorization", f"Bearer {api_key}")] if api_key else []
        self._pool = httpcore.ConnectionPool(
            max_connections=serving.concurrency,
            max_keepalive_connections=serving.concurrency,
            network_backend=bounded_backend(),
        )

    def _count(self, **deltas: int) -> None:
        with self._ledger_lock:
            for name, delta in deltas.items():
                setattr(self.ledger, name, getattr(self.ledger, name) + delta)

    @contextlib.contextmanager
    def budget(self) -> Iterator[None]:
        """Every request of the calls made inside ends within one `serving.deadline_s` from here (a
        training step's calls of this role); outside, each call has its own."""
        self._budget_end = time.monotonic() + self.serving.deadline_s
        try:
            yield
        finally:
            self._budget_end = None

    def _call_end(self) -> float:
        return self._budget_end or time.monotonic() + self.serving.deadline_s

    def _send(self, method: str, path: str, body: dict | None, end: float) -> dict:
        """One try: the reply's JSON object, or RequestLost saying what went wrong."""
        import httpcore

        left = end - time.monotonic()
        if left <= 0:
            raise RequestLost("timeout", "no time left in serving.deadline_s", False)
        content = json.dumps(body).encode() if body is not None else None
        headers = [("Content-Type", "application/json")] if body is not None else []
        current_request_end.at = end
        try:
            response = self._pool.request(
                method,
                self.url + path,
                headers=headers + self._auth,
                content=content,
                extensions={"timeout": dict.fromkeys(("connect", "read", "write", "pool"), left)},
            )
        except httpcore.TimeoutException as e:
            raise RequestLost(
                "timeout", f"no complete answer within {left:.1f} s ({type(e).__name__})", True
            ) from e
        except (httpcore.NetworkError, httpcore.ProtocolError) as e:
            raise RequestLost("unreachable", f"{type(e).__name__}: {e}", True) from e
        finally:
            current_request_end.at = None
        if response.status != 200:
            text = response.content[:200].decode(errors="replace")
            transient = response.status == 429 or response.status >= 500
            raise RequestLost("http_error", f"HTTP {response.status}: {text}", transient)
        try:
            answer = json.loads(response.content)
        except ValueError as e:  # a body cut short (a proxy, a dying server): asking again may help
            raise RequestLost("malformed", f"a reply that is not JSON ({e})", True) from e
        if not isinstance(answer, dict):
            raise RequestLost(
                "malformed", f"a reply that is not a JSON object: {type(answer).__name__}", False
            )
        return answer

    def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        prompts: int = 1,
        parse: Callable[[dict], Any] = lambda answer: answer,
        end: float | None = None,
    ) -> Any:
        """One request, retried while its failure is transient: parse(its JSON), or None once it failed
        (its outcome in the ledger). Every try ends by `end` (default: serving.deadline_s from now) and
        within serving.request_timeout_s."""
        end = end if end is not None else time.monotonic() + self.serving.deadline_s
        delay = 0.5
        while True:
            try:
                request_end = min(time.monotonic() + self.serving.request_timeout_s, end)
                result = parse(self._send(method, path, body, request_end))
                self._count(ok=1)
                return result
            except RequestLost as e:
                lost = e
            if not lost.transient or time.monotonic() + delay >= end:
                self._count(**{lost.outcome: 1}, lost_prompts=prompts)
                log.warning(
                    "%s %s%s: %s (%s); %d prompt(s) lost",
                    method, self.url, path, lost.outcome, lost.detail, prompts,
                )  # fmt: skip
                return None
            self._count(retries=1)
            log.info(
                "%s %s%s: %s (%s); retrying in %.1f s",
                method,
                self.url,
                path,
                lost.outcome,
                lost.detail,
                delay,
            )
            time.sleep(delay)
            delay = min(2 * delay, 10.0)

    def _map(self, fn: Any, items: list, bar: Any) -> list:
        """fn(item) for every item with `serving.concurrency` requests in flight, results in order; each
        fn returns (result, units done) and `bar` advances by the units."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=self.serving.concurrency) as pool:
            futures = [pool.submit(fn, item) for item in items]
            results = []
            for f in futures:
                results.append(f.result())
                bar.update(results[-1][1])
        return [r for r, _ in results]

    def _served_models(self) -> list[dict]:
        """GET /v1/models: the served models ({id, max_model_len?, ...}); ServedError when unanswered."""

        def parse(listing: dict) -> list[dict]:
            models = listing.get("data")
            if not isinstance(models, list) or not all(isinstance(m, dict) and "id" in m for m in models):
                raise RequestLost("malformed", "GET /v1/models: no list of models with ids", False)
            return models

        models = self._request("GET", "/v1/models", parse=parse)
        if models is None:
            raise ServedError(
                f"{self.name} did not answer GET /v1/models ({counts_text(vars(self.ledger))}; see the log above)"
            )
        return models

    def close(self) -> None:
        self._pool.close()
