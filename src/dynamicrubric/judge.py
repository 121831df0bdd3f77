"""Stage 3, judging: the frozen verifier answers yes/no for every (rubric item, response).

rubric variant: P(yes) from the verifier's next-token distribution after one item's question; the
verdict is P(yes) >= 0.5. All questions about one response share its context, which the engine
computes once. pointwise baseline: the verifier rates each response alone, with no rubric; it is
written as a one-item rubric of weight 1 so that aggregation treats both the same way.
"""

from __future__ import annotations

import logging

import pandas as pd

from dynamicrubric.artifacts import read_frame, write_artifact
from dynamicrubric.config import Config
from dynamicrubric.engines import Engine, load_engine
from dynamicrubric.prompts import (
    JUDGE_ITEM_QUESTION,
    POINTWISE_QUESTION,
    judge_context,
    split_chat_prompt,
)

log = logging.getLogger(__name__)


def judge_requests(rollouts: pd.DataFrame, rubrics: pd.DataFrame | None, cfg: Config) -> pd.DataFrame:
    """One row per (rubric item, response): the keys of the judgment plus the context and question."""
    max_chars = cfg.judge.max_response_chars
    rows = []
    if rubrics is None:  # pointwise
        for r in rollouts.itertuples():
            rows.append(
                (
                    r.prompt_id,
                    0,
                    0,
                    r.sample_idx,
                    1,
                    judge_context(r.prompt, r.response, max_chars),
                    POINTWISE_QUESTION,
                )
            )
    else:
        by_prompt = {pid: g.sort_values("sample_idx") for pid, g in rollouts.groupby("prompt_id", sort=False)}
        missing = sorted(set(rubrics["prompt_id"]) - set(by_prompt))
        if missing:
            raise ValueError(
                f"rubrics for prompt(s) {missing[:5]} have no responses in the rollouts artifact"
            )
        for rubric in rubrics.itertuples():
            for r in by_prompt[rubric.prompt_id].itertuples():
                context = judge_context(r.prompt, r.response, max_chars)
                for m, item in enumerate(rubric.items):
                    question = JUDGE_ITEM_QUESTION.format(item=item["text"])
                    rows.append(
                        (r.prompt_id, rubric.rubric_idx, m, r.sample_idx, item["weight"], context, question)
                    )
    columns = ["prompt_id", "rubric_idx", "item_idx", "sample_idx", "weight", "context", "question"]
    requests = pd.DataFrame(rows, columns=columns)
    # Questions about the same response next to each other, so the engine reuses their context.
    return requests.sort_values(["prompt_id", "sample_idx", "rubric_idx", "item_idx"], kind="stable")


def run_judge(
    rollouts_uri: str,
    out_uri: str,
    cfg: Config,
    *,
    rubrics_uri: str | None = None,
    verifier: str | None = None,
    engine: Engine | None = None,
) -> dict:
    """Judge every (item, response); without `rubrics_uri` (or with judge.variant=pointwise) pointwise."""
    verifier = verifier or cfg.models.verifier
    pointwise = cfg.judge.variant == "pointwise" or rubrics_uri is None
    rollouts = read_frame(rollouts_uri, "rollouts")
    rubrics = None if pointwise else read_frame(rubrics_uri, "rubrics")
    requests = judge_requests(rollouts, rubrics, cfg)
    if len(requests):
        engine = engine or load_engine(verifier, cfg.engine)
        pairs = [
            split_chat_prompt(engine.chat_prompt, c, q)
            for c, q in zip(requests["context"], requests["question"], strict=True)
        ]
        p_yes = engine.yes_probability(pairs, desc="judge")
    else:
        p_yes = []
    judgments = requests.drop(columns=["context", "question"]).assign(p_yes=p_yes)
    judgments["verdict"] = judgments["p_yes"] >= 0.5
    write_artifact(out_uri, "judgments", judgments)
    counts = {
        "variant": "pointwise" if pointwise else "rubric",
        "judgments": len(judgments),
        "responses": len(rollouts),
        "yes_rate": float(judgments["verdict"].mean()) if len(judgments) else 0.0,
    }
    log.info("judge: %s -> %s", counts, out_uri)
    return counts
