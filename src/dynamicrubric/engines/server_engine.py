"""`ServerEngine`: a client of a model behind an OpenAI-compatible server (see engines/__init__.py)."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamicrubric.config import ServingConfig
from dynamicrubric.engines.base import (
    Engine,
    EngineError,
    Generation,
    answer_token_ids,
    bar_or,
    logsumexp,
    pair_token_ids,
    progress_bar,
    sample_seed,
)
from dynamicrubric.models import resolve_model

if TYPE_CHECKING:
    from dynamicrubric.engines.base import Sampling

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# An OpenAI-compatible server (vLLM's `vllm serve`)

# finish_reason of a sample whose request failed after every retry: it has no text, and the stage that
# asked for it decides (the reward leaves its group out, a standalone stage stops).
FAILED = "failed"


@dataclass
class CallLedger:
    """What happened to every request sent to one server: each request ends in exactly one outcome."""

    ok: int = 0
    timeout: int = 0  # still timing out at the deadline
    unreachable: int = 0  # no connection (server down or restarting) at the deadline
    http_error: int = 0  # an HTTP error: a 4xx at once, a 429/5xx still at the deadline
    retries: int = 0  # extra tries after transient failures, over all requests
    lost_prompts: int = 0  # prompts of failed requests (their verdicts NaN, their samples FAILED)

    @property
    def failed(self) -> int:
        return self.timeout + self.unreachable + self.http_error

    def snapshot(self) -> CallLedger:
        return CallLedger(**vars(self))

    def since(self, before: CallLedger) -> dict[str, int]:
        """The counts added since `before` (a snapshot), by outcome."""
        return {k: v - getattr(before, k) for k, v in vars(self).items()}


class ServerEngine(Engine):
    """Client of one model behind an OpenAI-compatible `/v1/completions` server (vLLM's `vllm serve`,
    a KServe InferenceService, a team's judge service): the same interface as the in-process engines.

    - Prompts go as token ids rendered and encoded here exactly as HFEngine does, so the server adds no
      BOS and the judge's shared prefixes are byte-identical (vLLM's prefix caching serves them).
    - P(yes) comes from the label tokens' log-probabilities (`logprob_token_ids`, vLLM ≥ 0.31), whatever
      their rank; rubrics from the same xgrammar EBNF as the other engines (`structured_outputs`).
    - All of a call's requests are in flight at once, at most `serving.concurrency`. A timeout, a lost
      connection or a 429/5xx is retried with exponential backoff until `serving.deadline_s`; then the
      request fails: its verdicts are NaN and its samples FAILED, never a 0 or a 0.5. `ledger` counts
      every request's outcome.
    """

    def __init__(self, model_ref: str, url: str, serving: ServingConfig) -> None:
        import httpx

        self.model_ref = model_ref
        self.url = url.rstrip("/").removesuffix("/v1")
        self.serving = serving
        self.ledger = CallLedger()
        self._ledger_lock = threading.Lock()
        self.tokenizer = _load_tokenizer(model_ref)
        self.yes_ids, self.no_ids = answer_token_ids(self.tokenizer)
        self.client = httpx.Client(
            base_url=self.url,
            timeout=serving.request_timeout_s,
            limits=httpx.Limits(
                max_connections=serving.concurrency, max_keepalive_connections=serving.concurrency
            ),
        )
        self.served_name, self.context_length = self._served_model()
        self._check_tokenizer()

    # ---- requests

    def _count(self, **deltas: int) -> None:
        with self._ledger_lock:
            for name, delta in deltas.items():
                setattr(self.ledger, name, getattr(self.ledger, name) + delta)

    def _request(self, method: str, path: str, body: dict | None = None, *, prompts: int = 1) -> dict | None:
        """One request, retried while transient until the deadline; its JSON, or None once it failed."""
        import httpx

        deadline = time.monotonic() + self.serving.deadline_s
        delay = 0.5
        while True:
            try:
                response = self.client.request(method, path, json=body)
                if response.status_code == 200:
                    self._count(ok=1)
                    return response.json()
                outcome, detail = "http_error", f"HTTP {response.status_code}: {response.text[:300]}"
                transient = response.status_code == 429 or response.status_code >= 500
            except httpx.TimeoutException as e:
                outcome, detail, transient = (
                    "timeout",
                    f"timed out after {self.serving.request_timeout_s} s ({type(e).__name__})",
                    True,
                )
            except httpx.TransportError as e:
                outcome, detail, transient = "unreachable", f"{type(e).__name__}: {e}", True
            if not transient or time.monotonic() + delay > deadline:
                self._count(**{outcome: 1}, lost_prompts=prompts)
                log.warning("%s %s%s failed (%s); %d prompt(s) lost", method, self.url, path, detail, prompts)
                return None
            self._count(retries=1)
            log.info("%s %s%s: %s; retrying in %.1f s", method, self.url, path, detail, delay)
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
        listing = self._request("GET", "/v1/models")
        if listing is None:
            raise EngineError(
                f"the model server at {self.url} did not answer GET /v1/models (see the log above)"
            )
        models = listing.get("data") or []
        if len(models) != 1:
            named = [m for m in models if m.get("id") == self.model_ref]
            if len(named) != 1:
                ids = [m.get("id") for m in models]
                raise EngineError(
                    f"the server at {self.url} serves {ids}; cannot tell which one is {self.model_ref!r}"
                )
            models = named
        return str(models[0]["id"]), models[0].get("max_model_len")

    def _check_tokenizer(self) -> None:
        """The server must tokenize as our tokenizer does, or the label ids would name other tokens."""
        probe = self.tokenizer.decode(self.yes_ids + self.no_ids) + " Is the answer 42?"
        expected = self.tokenizer.encode(probe, add_special_tokens=False)
        body = {"model": self.served_name, "prompt": probe, "add_special_tokens": False}
        got = self._request("POST", "/tokenize", body)
        if got is None:
            log.warning(
                "%s has no /tokenize: cannot check that it tokenizes like %s", self.url, self.model_ref
            )
        elif got.get("tokens") != expected:
            raise EngineError(
                f"the server at {self.url} ({self.served_name}) tokenizes differently from {self.model_ref!r}: "
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
                    f"{self.context_length} the server at {self.url} serves {self.served_name} with"
                )
        return encoded

    # ---- the engine interface

    def _generate(self, prompts: list[str], sampling: Sampling, desc: str) -> list[Generation]:
        """One request per prompt seeded from (seed, prompt index) as VLLMEngine seeds its requests; a
        prompt whose request failed gets n FAILED samples without text."""
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
            from dynamicrubric.constrained import rubric_grammar

            common["structured_outputs"] = {"grammar": rubric_grammar(sampling.rubric_items)}

        def one(i: int) -> tuple[Generation, int]:
            body = {**common, "prompt": encoded[i], "seed": sample_seed(sampling.seed, i, 0)}
            answer = self._request("POST", "/v1/completions", body)
            if answer is None:
                return Generation([""] * n, [0] * n, [FAILED] * n), n
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            return Generation(
                texts=[c["text"] for c in choices],
                num_tokens=[
                    len(c["token_ids"])
                    if c.get("token_ids") is not None
                    else len(self.tokenizer.encode(c["text"], add_special_tokens=False))
                    for c in choices
                ],
                finish_reasons=["stop" if c.get("finish_reason") == "stop" else "length" for c in choices],
            ), n

        with progress_bar(len(prompts) * n, desc, "sample") as bar:
            return self._map(one, list(range(len(prompts))), bar)

    def yes_probability(
        self, pairs: list[tuple[str, str]], desc: str = "judge", *, bar: Any = None
    ) -> list[float]:
        """P(yes) / (P(yes) + P(no)) from the label tokens' log-probs at the next token; NaN where the
        request failed or the answer carries neither label."""
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
            answer = self._request("POST", "/v1/completions", body, prompts=len(batch))
            if answer is None:
                return [math.nan] * len(batch), len(batch)
            result = [math.nan] * len(batch)
            for choice in answer["choices"]:
                result[choice["index"]] = self._p_yes(choice)
            return result, len(batch)

        with bar_or(bar, len(pairs), desc) as progress:
            return [p for part in self._map(one, batches, progress) for p in part]

    def _p_yes(self, choice: dict) -> float:
        top = ((choice.get("logprobs") or {}).get("top_logprobs") or [None])[0] or {}
        by_id = {int(k.removeprefix("token_id:")): v for k, v in top.items() if k.startswith("token_id:")}
        yes = [by_id[t] for t in self.yes_ids if t in by_id]
        no = [by_id[t] for t in self.no_ids if t in by_id]
        if not yes or not no:  # the server left a label out: no exact value to give
            return math.nan
        return 1.0 / (1.0 + math.exp(logsumexp(no) - logsumexp(yes)))

    def logprobs(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        """From the server's prompt log-probs of prompt+completion (prompt_logprobs=0: the actual token)."""
        if len(prompts) != len(completions):
            raise EngineError(f"logprobs: {len(prompts)} prompts but {len(completions)} completions")
        if not prompts:
            return []
        p_ids = self._token_ids(prompts, 1, "logprobs")
        c_ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in completions]

        def one(i: int) -> tuple[list[float], int]:
            ids = p_ids[i] + c_ids[i]
            body = {"model": self.served_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
            answer = self._request("POST", "/v1/completions", body)
            if answer is None:
                raise EngineError(f"logprobs: the server at {self.url} did not answer for prompt {i}")
            positions = answer["choices"][0]["prompt_logprobs"]
            return [positions[k][str(ids[k])]["logprob"] for k in range(len(p_ids[i]), len(ids))], 1

        with progress_bar(len(prompts), "logprobs", "sequence") as bar:
            return self._map(one, list(range(len(prompts))), bar)

    def close(self) -> None:
        self.client.close()


def _load_tokenizer(model_ref: str) -> Any:
    """The role's tokenizer: a hub id's tokenizer files alone (the weights live on the server), else the
    tokenizer of the resolved folder (a built-in model, a local or staged checkpoint)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from dynamicrubric.models import BUILTIN_MODELS

    hub_id = (
        "://" not in model_ref
        and model_ref not in BUILTIN_MODELS
        and not Path(model_ref).expanduser().exists()
    )
    return AutoTokenizer.from_pretrained(model_ref if hub_id else resolve_model(model_ref))
