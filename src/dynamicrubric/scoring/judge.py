"""Stage 3, judging: the frozen verifier answers yes/no for every (rubric item, response).

rubric variant: P(yes) from the verifier's next-token distribution after one item's question; the
verdict is P(yes) >= 0.5. All questions about one response share its context, which the engine
computes once. pointwise baseline: the verifier rates each response alone, with no rubric; it is
written as a one-item rubric of weight 1 so that aggregation treats both the same way.

Memory stays flat as the number of judgments grows (about 532k per shard at the paper's sizes): the
requests are built and judged in bounded chunks of whole responses (`JUDGE_CHUNK_PAIRS` questions), the
chat template is rendered once per response (its prefix) and once per question only as a short
suffix, and what is kept of each judgment is its keys and P(yes) in numpy arrays.

A verdict the engine cannot score (vLLM without the label tokens' log-probs, non-finite logits) is
never guessed: its p_yes is NaN and its verdict false in the judgments artifact, it is counted in
`unscored` and logged, and aggregation refuses NaN verdicts rather than count them as "no".
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from dynamicrubric.engines import Engine, load_engine, progress_bar, prompts_named
from dynamicrubric.infra.artifact_kinds import kind
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import Config
from dynamicrubric.scoring.prompts import (
    JUDGE_ITEM_QUESTION,
    POINTWISE_QUESTION,
    judge_context,
    split_chat_prompt,
)

log = logging.getLogger(__name__)

# Questions judged per engine call: enough to fill many batches, small enough that the chunk's
# strings (one prefix per response, one short suffix per question) stay a few MB.
JUDGE_CHUNK_PAIRS = 4096
_MARK = "\x00QUESTION\x00"  # stands for the question when the template is rendered once per response

Scorer = Callable[[list[tuple[str, str]], Any], list[float]]  # (pairs, progress bar) -> P(yes) per pair


@dataclass
class JudgeChunk:
    """The next questions to judge: their keys (parallel lists) and (prefix, suffix) pairs."""

    prompt_code: list[int] = field(default_factory=list)  # index into the sorted prompt ids
    rubric_idx: list[int] = field(default_factory=list)
    item_idx: list[int] = field(default_factory=list)
    sample_idx: list[int] = field(default_factory=list)
    weight: list[int] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)


def judged_items(rubrics: pd.DataFrame) -> list[list[tuple[int, dict]]]:
    """Each rubric's (item_idx, item) pairs the verifier is to judge: those its `judged_items` column
    names (the policy's reward with judge.item_dropout), every item where the table has no such column."""
    items = [list(i) for i in rubrics["items"]]
    if "judged_items" not in rubrics.columns:
        return [list(enumerate(i)) for i in items]
    return [
        [(int(m), i[int(m)]) for m in kept] for i, kept in zip(items, rubrics["judged_items"], strict=True)
    ]


def _rubrics_by_prompt(rubrics: pd.DataFrame) -> dict[str, list[tuple[int, list[tuple[int, dict]]]]]:
    by_prompt: dict[str, list[tuple[int, list[tuple[int, dict]]]]] = {}
    for pid, ridx, items in zip(
        rubrics["prompt_id"], rubrics["rubric_idx"], judged_items(rubrics), strict=True
    ):
        by_prompt.setdefault(pid, []).append((int(ridx), items))
    for entries in by_prompt.values():
        entries.sort(key=lambda e: e[0])
    return by_prompt


def iter_judge_requests(
    rollouts: pd.DataFrame,
    rubrics: pd.DataFrame | None,
    cfg: Config,
    render: Callable[[list[dict]], str],
    chunk_pairs: int = JUDGE_CHUNK_PAIRS,
) -> Iterator[JudgeChunk]:
    """Chunks of (rubric item, response) questions in key order (prompt_id, sample_idx, rubric_idx,
    item_idx); `rubrics=None` is pointwise (one question per response, rubric 0, item 0, weight 1).
    Where the rubrics have a `judged_items` column only those items are asked (with their item_idx).

    `render` is the verifier's chat template (Engine.chat_prompt). A chunk ends at a response
    boundary once it holds `chunk_pairs` questions, so a response's questions share one chunk."""
    max_chars = cfg.judge.max_response_chars
    by_prompt = None if rubrics is None else _rubrics_by_prompt(rubrics)
    if by_prompt is not None:
        missing = sorted(set(by_prompt) - set(rollouts["prompt_id"]))
        if missing:
            raise ValueError(
                f"rubrics for prompt(s) {missing[:5]} have no responses in the rollouts artifact"
            )
    ordered = rollouts.sort_values(["prompt_id", "sample_idx"], kind="stable")
    prompt_ids = sorted(set(ordered["prompt_id"]))
    code = {pid: i for i, pid in enumerate(prompt_ids)}
    checked = False  # the one-render-per-response shortcut is checked against a full render once
    chunk = JudgeChunk()
    for pid, sample, prompt, response in zip(
        ordered["prompt_id"], ordered["sample_idx"], ordered["prompt"], ordered["response"], strict=True
    ):
        if by_prompt is None:
            questions = [(0, 0, 1, POINTWISE_QUESTION)]
        else:
            questions = [
                (ridx, m, int(item["weight"]), JUDGE_ITEM_QUESTION.format(item=item["text"]))
                for ridx, items in by_prompt.get(pid, [])
                for m, item in items
            ]
        if not questions:
            continue
        context = judge_context(prompt, response, max_chars)
        prefix, suffix_template = split_chat_prompt(render, context, _MARK)
        if suffix_template.count(_MARK) != 1:
            raise ValueError("the chat template altered the judge question; cannot split prefix and question")
        if not checked:
            if split_chat_prompt(render, context, questions[0][3]) != (
                prefix,
                suffix_template.replace(_MARK, questions[0][3]),
            ):
                raise ValueError("the chat template renders a question differently in place of a marker")
            checked = True
        c = code[pid]
        for ridx, m, w, question in questions:
            chunk.prompt_code.append(c)
            chunk.rubric_idx.append(ridx)
            chunk.item_idx.append(m)
            chunk.sample_idx.append(int(sample))
            chunk.weight.append(w)
            chunk.pairs.append((prefix, suffix_template.replace(_MARK, question)))
        if len(chunk.pairs) >= chunk_pairs:
            yield chunk
            chunk = JudgeChunk()
    if chunk.pairs:
        yield chunk


def judge_table(
    requests: Iterable[JudgeChunk], rollouts: pd.DataFrame, rubrics: pd.DataFrame | None, score: Scorer
) -> pa.Table:
    """The judgments table: every question of `requests` (iter_judge_requests over `rollouts` and
    `rubrics`, which give the prompt ids and the progress total) scored by `score`, chunk by chunk."""
    prompt_ids = pa.array(sorted(set(rollouts["prompt_id"])), pa.string())
    if rubrics is None:
        total = len(rollouts)
    else:
        per_prompt = rubrics.assign(n=[len(i) for i in judged_items(rubrics)]).groupby("prompt_id")["n"].sum()
        total = int(rollouts["prompt_id"].map(per_prompt).fillna(0).sum())
    parts: dict[str, list[np.ndarray]] = {
        k: [] for k in ("prompt_code", "rubric_idx", "item_idx", "sample_idx", "weight", "p_yes")
    }
    with progress_bar(total, "judge", "judgment") as bar:
        for chunk in requests:
            with prompts_named([prompt_ids[int(c)].as_py() for c in chunk.prompt_code]):
                p_yes = score(chunk.pairs, bar)
            if len(p_yes) != len(chunk.pairs):
                raise RuntimeError(f"judge: the engine scored {len(p_yes)} of {len(chunk.pairs)} questions")
            for name, dtype in (
                ("prompt_code", np.int32),
                ("rubric_idx", np.int32),
                ("item_idx", np.int32),
                ("sample_idx", np.int32),
                ("weight", np.int8),
            ):
                parts[name].append(np.asarray(getattr(chunk, name), dtype=dtype))
            parts["p_yes"].append(np.asarray(p_yes, dtype=np.float32))
    cols = {
        k: np.concatenate(v) if v else np.zeros(0, np.float32 if k == "p_yes" else np.int32)
        for k, v in parts.items()
    }
    schema = kind("judgments").schema
    return pa.Table.from_arrays(
        [
            prompt_ids.take(pa.array(cols["prompt_code"], pa.int32())),
            pa.array(cols["rubric_idx"], pa.int32()),
            pa.array(cols["item_idx"], pa.int32()),
            pa.array(cols["sample_idx"], pa.int32()),
            pa.array(cols["weight"].astype(np.int8), pa.int8()),
            pa.array(cols["p_yes"] >= 0.5, pa.bool_()),  # NaN (unscored) is not a yes
            pa.array(cols["p_yes"], pa.float32()),
        ],
        schema=schema,
    )


def judge_rollouts(
    rollouts: pd.DataFrame,
    rubrics: pd.DataFrame | None,
    cfg: Config,
    *,
    verifier: str | None = None,
    engine: Engine | None = None,
) -> tuple[pa.Table, dict]:
    """The `judgments` table for every (item, response), and its counts; without `rubrics` (or with
    judge.variant=pointwise) pointwise."""
    verifier = verifier or cfg.models.verifier
    if cfg.models.enable_thinking.verifier:
        raise ValueError(
            "models.enable_thinking.verifier: the judge reads P(yes) at the first token of the verifier's "
            "answer, so a thinking verifier is not supported; set it to false"
        )
    pointwise = cfg.judge.variant == "pointwise" or rubrics is None
    rubrics = None if pointwise else rubrics
    has_questions = pointwise or any(judged_items(rubrics))
    requests_before = None
    if has_questions:
        engine = engine or load_engine(verifier, cfg.engine)
        ledger = getattr(engine, "ledger", None)  # a served verifier's requests
        requests_before = ledger.snapshot() if ledger is not None else None
        render = partial(engine.chat_prompt, enable_thinking=False)

        def score(pairs: list[tuple[str, str]], bar: Any) -> list[float]:
            return engine.yes_probability(pairs, bar=bar)

        judgments = judge_table(iter_judge_requests(rollouts, rubrics, cfg, render), rollouts, rubrics, score)
    else:  # nothing to ask: an empty table of the right schema
        judgments = judge_table([], rollouts, rubrics, lambda p, b: [])
    p_yes = judgments.column("p_yes").to_numpy()
    unscored = int(np.isnan(p_yes).sum())
    if unscored:
        if requests_before is not None:  # the server's requests say why: timeouts, errors, bad replies
            from dynamicrubric.engines.served_calls import OUTCOMES, counts_text

            since = engine.ledger.since(requests_before)
            why = f"requests to {engine.url}: " + counts_text({k: since[k] for k in (*OUTCOMES, "retries")})
        else:
            why = "no yes/no label token among the verifier's log-probs"
        log.warning(
            "judge: %d of %d verdicts could not be scored (%s); they get p_yes NaN and aggregation will "
            "refuse them",
            unscored,
            len(p_yes),
            why,
        )
    verdicts = judgments.column("verdict").to_numpy(zero_copy_only=False)
    counts = {
        "variant": "pointwise" if pointwise else "rubric",
        "judgments": judgments.num_rows,
        "responses": len(rollouts),
        "unscored": unscored,
        "yes_rate": float(verdicts[~np.isnan(p_yes)].mean()) if len(p_yes) > unscored else 0.0,
    }
    return judgments, counts


def run_judge(
    rollouts_uri: str, out_uri: str, cfg: Config, *, rubrics_uri: str | None = None, **options: Any
) -> dict:
    """The judge stage: `judge_rollouts(rollouts, rubrics, cfg, **options)` over artifacts, written to
    `out_uri`; without `rubrics_uri` pointwise."""
    rubrics = read_frame(rubrics_uri, "rubrics") if rubrics_uri and cfg.judge.variant != "pointwise" else None
    judgments, counts = judge_rollouts(read_frame(rollouts_uri, "rollouts"), rubrics, cfg, **options)
    # The inputs are not needed any more: free them (and the pages Arrow's allocator keeps) before
    # the judgments are validated and written, so the two peaks do not add up.
    del rubrics
    gc.collect()
    pa.default_memory_pool().release_unused()
    write_artifact(out_uri, "judgments", judgments)
    log.info("judge: %s -> %s", counts, out_uri)
    return counts
