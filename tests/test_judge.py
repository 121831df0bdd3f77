"""The judge stage: chunked requests, one render per response, unscored verdicts counted and refused."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from dynamicrubric.engines import HFEngine
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.scoring.aggregate import AggregateError, aggregate
from dynamicrubric.scoring.judge import iter_judge_requests, judge_table, run_judge
from dynamicrubric.scoring.prompts import JUDGE_ITEM_QUESTION, judge_context, split_chat_prompt

ITEMS = [{"text": "The answer is a digit", "weight": 5}, {"text": "It is short", "weight": 2}]


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return HFEngine("tiny-random", device="cpu", batch_size=4)


def _rollouts() -> pd.DataFrame:
    responses = {"p1": ["4", "4", "5 because 2+3", "four"], "p0": ["2", "It is 2.", "3", "two"]}
    return pd.DataFrame(
        [
            {
                "prompt_id": pid,
                "sample_idx": j,
                "prompt": f"What is {pid}?",
                "response": r,
                "num_tokens": 1,
                "finish_reason": "stop",
                "policy": "hand",
                "seed": 0,
            }
            for pid, rs in responses.items()
            for j, r in enumerate(rs)
        ]
    )


def _rubrics() -> pd.DataFrame:
    base = {
        "variant": "dynamic",
        "generator": "g",
        "generator_prompt": "",
        "completion": "",
        "finish_reason": "stop",
    }
    return pd.DataFrame(
        [
            {**base, "prompt_id": "p0", "rubric_idx": 1, "items": ITEMS[:1], "parse_status": "json"},
            {**base, "prompt_id": "p0", "rubric_idx": 0, "items": ITEMS, "parse_status": "json"},
            {**base, "prompt_id": "p1", "rubric_idx": 0, "items": [], "parse_status": "empty"},
        ]
    )


def test_chunks_hold_whole_responses_in_key_order(engine: HFEngine) -> None:
    cfg = load_config(preset="tiny")
    chunks = list(iter_judge_requests(_rollouts(), _rubrics(), cfg, engine.chat_prompt, chunk_pairs=2))
    assert [len(c.pairs) for c in chunks] == [3, 3, 3, 3]  # 3 questions per p0 response, none for p1
    keys = [
        k for c in chunks for k in zip(c.prompt_code, c.sample_idx, c.rubric_idx, c.item_idx, strict=True)
    ]
    assert keys == sorted(keys) and len(set(keys)) == 12
    # One render per response gives exactly the pairs a full render of each question gives.
    rollouts = _rollouts().set_index(["prompt_id", "sample_idx"])
    for c in chunks:
        for s, r, m, (prefix, suffix) in zip(c.sample_idx, c.rubric_idx, c.item_idx, c.pairs, strict=True):
            row = rollouts.loc[("p0", s)]
            context = judge_context(row["prompt"], row["response"], cfg.judge.max_response_chars)
            question = JUDGE_ITEM_QUESTION.format(item=ITEMS[m]["text"])
            assert (prefix, suffix) == split_chat_prompt(engine.chat_prompt, context, question), (r, m)


def test_chunk_size_does_not_change_the_judgments(engine: HFEngine) -> None:
    cfg = load_config(preset="tiny")

    def score(pairs, bar):
        return engine.yes_probability(pairs, bar=bar)

    def judged(rubrics, chunk_pairs: int):
        requests = iter_judge_requests(_rollouts(), rubrics, cfg, engine.chat_prompt, chunk_pairs)
        return judge_table(requests, _rollouts(), rubrics, score)

    small = judged(_rubrics(), chunk_pairs=1)
    large = judged(_rubrics(), chunk_pairs=10_000)
    assert small.equals(large) and small.num_rows == 12
    pointwise = judged(None, chunk_pairs=3)
    assert pointwise.num_rows == 8 and set(pointwise.column("weight").to_pylist()) == {1}


def test_unscored_verdicts_are_counted_and_refused_by_aggregation(tmp_path, engine: HFEngine) -> None:
    from transformers import AutoModelForCausalLM

    from dynamicrubric.infra.models import resolve_model

    cfg = load_config(preset="tiny")
    write_artifact(str(tmp_path / "r.parquet"), "rollouts", _rollouts())
    write_artifact(str(tmp_path / "s.parquet"), "rubrics", _rubrics())
    broken = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random"))
    import torch

    with torch.no_grad():  # no finite logit for any label token: no verdict can be scored
        broken.get_output_embeddings().weight[engine.yes_ids + engine.no_ids] = float("nan")
    nan_engine = HFEngine("broken", model=broken, tokenizer=engine.tokenizer)
    args = (str(tmp_path / "r.parquet"), str(tmp_path / "j.parquet"), cfg)
    counts = run_judge(*args, rubrics_uri=str(tmp_path / "s.parquet"), engine=nan_engine)
    judgments = read_frame(str(tmp_path / "j.parquet"), "judgments")
    assert counts["unscored"] == counts["judgments"] == 12
    assert judgments["p_yes"].map(math.isnan).all() and not judgments["verdict"].any()
    for soft in (False, True):
        with pytest.raises(AggregateError, match="12 verdict"):
            aggregate(judgments, _rollouts(), _rubrics(), soft=soft)

    counts = run_judge(*args, rubrics_uri=str(tmp_path / "s.parquet"), engine=engine)
    judgments = read_frame(str(tmp_path / "j.parquet"), "judgments")
    assert counts["unscored"] == 0 and np.isfinite(judgments["p_yes"]).all()
    assert aggregate(judgments, _rollouts(), _rubrics()).scores["score"].between(0, 1).all()


def test_a_thinking_verifier_is_refused(tmp_path, engine: HFEngine) -> None:
    cfg = load_config(preset="tiny", overrides={"models": {"enable_thinking": {"verifier": True}}})
    write_artifact(str(tmp_path / "r.parquet"), "rollouts", _rollouts())
    with pytest.raises(ValueError, match="enable_thinking.verifier"):
        run_judge(str(tmp_path / "r.parquet"), str(tmp_path / "j.parquet"), cfg, engine=engine)
