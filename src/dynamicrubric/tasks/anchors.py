"""Anchor lists (rank 1 = best, equal ranks are ties): Nectar-format files, chosen/rejected pairs,
and the policy's own rollouts ranked by their verifiable outcomes."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    pass

from dynamicrubric.tasks.checkers import is_verifiable, score_group
from dynamicrubric.tasks.sources import ANCHOR_COLUMNS, TaskError, is_present, read_records, uri_stem

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# Anchor lists


def _anchor_frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=ANCHOR_COLUMNS)
    return df.astype({"sample_idx": "int32", "rank": "int32"})


def _dense_ranks(values: list[float], best_is_low: bool) -> list[int]:
    order = sorted(set(values), reverse=not best_is_low)
    position = {v: i + 1 for i, v in enumerate(order)}
    return [position[v] for v in values]


_NECTAR_TURN = re.compile(r"\s*Human:\s*(.*?)\s*Assistant:\s*", re.DOTALL)


def _nectar_prompt(prompt: str) -> str:
    """Nectar prompts are '\\n\\nHuman: ...\\n\\nAssistant:'; a single turn is reduced to its text."""
    m = _NECTAR_TURN.fullmatch(prompt)
    if m and "Human:" not in m.group(1):
        return m.group(1)
    return prompt.strip()


def load_nectar(uri: str) -> pd.DataFrame:
    """Ranked lists from a Nectar-format file: rows of `prompt` and `answers` [{answer, model, rank}].

    Ranks are made dense (1 = best, equal ranks are ties); lists with fewer than two answers or all
    ranks equal carry no order and are dropped (counted in the log).
    """
    records = read_records(uri)
    stem = uri_stem(uri)
    rows: list[dict] = []
    dropped = 0
    for i, rec in enumerate(records):
        prompt, answers = rec.get("prompt"), rec.get("answers")
        if not isinstance(prompt, str) or not prompt.strip():
            raise TaskError(f"{uri}: row {i}: 'prompt' must be non-empty text; found columns {sorted(rec)}")
        if not isinstance(answers, list):
            raise TaskError(
                f"{uri}: row {i}: 'answers' must be a list of {{answer, model, rank}}, got {type(answers).__name__}"
            )
        texts, ranks = [], []
        for j, ans in enumerate(answers):
            if not isinstance(ans, dict) or not isinstance(ans.get("answer"), str):
                raise TaskError(
                    f"{uri}: row {i}, answer {j}: expected an object with text 'answer', got {ans!r}"
                )
            rank = ans.get("rank")
            if not isinstance(rank, int | float) or isinstance(rank, bool) or not math.isfinite(rank):
                raise TaskError(f"{uri}: row {i}, answer {j}: 'rank' must be a number, got {rank!r}")
            texts.append(ans["answer"])
            ranks.append(float(rank))
        if len(texts) < 2 or len(set(ranks)) < 2:
            dropped += 1
            continue
        list_id = str(rec["id"]) if is_present(rec.get("id")) else f"{stem}/{i}"
        ranked = zip(range(len(texts)), texts, _dense_ranks(ranks, best_is_low=True), strict=True)
        rows += _list_rows(list_id, _nectar_prompt(prompt), ranked, "nectar")
    if dropped:
        log.info("%s: dropped %d list(s) with fewer than two answers or no order", uri, dropped)
    if not rows:
        raise TaskError(f"{uri}: no ranked list with at least two differently ranked answers")
    return _anchor_frame(rows)


def _list_rows(list_id: str, prompt: str, ranked: Iterable[tuple[Any, str, int]], source: str) -> list[dict]:
    """An anchor list's rows from its (sample_idx, response, rank) triples."""
    return [
        {
            "list_id": list_id,
            "sample_idx": int(idx),
            "rank": rank,
            "prompt": prompt,
            "response": text,
            "source": source,
        }
        for idx, text, rank in ranked
    ]


def _message_text(value: Any, where: str) -> str:
    """A response given as text, or as a chat (list of {role, content}) whose last message is taken."""
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and isinstance(value[-1], dict)
        and isinstance(value[-1].get("content"), str)
    ):
        return value[-1]["content"]
    raise TaskError(f"{where}: expected text or a list of {{role, content}} messages, got {value!r:.80}")


def load_pairs(uri: str) -> pd.DataFrame:
    """Lists of two (chosen rank 1, rejected rank 2) from a RewardBench-style file with `prompt`,
    `chosen` and `rejected`; pairs whose two responses are identical carry no order and are dropped."""
    records = read_records(uri)
    stem = uri_stem(uri)
    rows: list[dict] = []
    dropped = 0
    for i, rec in enumerate(records):
        missing = [c for c in ("prompt", "chosen", "rejected") if c not in rec]
        if missing:
            raise TaskError(f"{uri}: row {i} lacks {missing}; pairs need prompt, chosen, rejected")
        prompt = _message_text(rec["prompt"], f"{uri}: row {i}: 'prompt'")
        chosen = _message_text(rec["chosen"], f"{uri}: row {i}: 'chosen'")
        rejected = _message_text(rec["rejected"], f"{uri}: row {i}: 'rejected'")
        if chosen == rejected:
            dropped += 1
            continue
        list_id = str(rec["id"]) if is_present(rec.get("id")) else f"{stem}/{i}"
        rows += _list_rows(list_id, prompt, [(0, chosen, 1), (1, rejected, 2)], "pairs")
    if dropped:
        log.info("%s: dropped %d pair(s) whose chosen and rejected are identical", uri, dropped)
    if not rows:
        raise TaskError(f"{uri}: no usable chosen/rejected pair")
    return _anchor_frame(rows)


def prompt_rows(responses: pd.DataFrame, prompts_df: pd.DataFrame, what: str) -> dict[str, dict]:
    """prompt_id -> prompt row, for responses that must all answer one of `prompts_df`'s prompts."""
    rows = {row["prompt_id"]: row for row in prompts_df.to_dict("records")}
    unknown = sorted(set(responses["prompt_id"]) - set(rows))
    if unknown:
        raise TaskError(f"{what} name {len(unknown)} prompt_id(s) not in the prompts, e.g. {unknown[:3]}")
    return rows


def anchors_from_outcomes(
    rollouts_df: pd.DataFrame,
    prompts_df: pd.DataFrame,
    timeout_s: float = 10,
    *,
    workers: int | None = None,
) -> pd.DataFrame:
    """Rank each prompt's rollouts by verifiable correctness: score descending → dense rank.

    list_id is the prompt_id and sample_idx the rollout's. Prompts that cannot be verified (no task
    scorer, no reference) are skipped, and so are prompts whose rollouts all score the same, since a
    list of equal ranks carries no order. HumanEval tests run in the sandbox, one batch per prompt, on
    `workers` threads.
    """
    for name, df, cols in (
        ("rollouts", rollouts_df, ["prompt_id", "sample_idx", "response"]),
        ("prompts", prompts_df, ["prompt_id", "prompt", "reference", "meta"]),
    ):
        missing = [c for c in cols if c not in df.columns]
        if missing:
            raise TaskError(f"{name} frame lacks column(s) {missing}; has {list(df.columns)}")
    prompts = prompt_rows(rollouts_df, prompts_df, "rollouts")
    verifiable = {pid for pid, row in prompts.items() if is_verifiable(row)}
    skipped = set(rollouts_df["prompt_id"]) - verifiable
    if skipped:
        log.info("anchors from outcomes: %d prompt(s) without a verifiable outcome skipped", len(skipped))
    todo = rollouts_df[rollouts_df["prompt_id"].isin(verifiable)]
    groups = [(pid, group.index, group["response"].tolist()) for pid, group in todo.groupby("prompt_id")]
    with ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1)) as pool:
        scored = list(pool.map(lambda g: score_group(prompts[g[0]], g[2], timeout_s=timeout_s), groups))
    scores = pd.Series(
        [s for group_scores in scored for s in group_scores],
        index=[i for _, index, _ in groups for i in index],
        dtype=float,
    )
    todo = todo.assign(score=scores, prompt=todo["prompt_id"].map(lambda pid: prompts[pid]["prompt"]))
    ranked, uniform = ranked_by_score(todo)
    kept = todo["prompt_id"].nunique() - uniform
    log.info("anchors from outcomes: %d list(s) kept, %d with all-equal scores dropped", kept, uniform)
    return ranked


def ranked_by_score(scored: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Each prompt's responses ranked by their outcome score (dense ranks, 1 = best) as anchor lists,
    and the number of prompts left out because all their scores were equal (no order to learn from).
    `scored` has columns prompt_id, sample_idx, prompt, response, score."""
    unscored = scored["score"].isna()
    if unscored.any():  # the sandbox failed on them: their rank is unknown, not last
        log.warning(
            "ranking by outcome: %d unscored response(s) left out of their lists", int(unscored.sum())
        )
    rows: list[dict] = []
    uniform = 0
    for pid, group in scored[~unscored].groupby("prompt_id", sort=True):
        if group["score"].nunique() < 2:
            uniform += 1
            continue
        ranks = _dense_ranks(group["score"].tolist(), best_is_low=False)
        ranked = zip(group["sample_idx"], group["response"], ranks, strict=True)
        rows += _list_rows(pid, group["prompt"].iloc[0], ranked, "outcomes")
    return _anchor_frame(rows).sort_values(["list_id", "sample_idx"], ignore_index=True), uniform
