"""WritingBench's official protocol (issue 49, item 4): the critic prompt from the benchmark's own template
with each criterion's whole item, the critic's 1–10 JSON score parsed as upstream parses it, and the score
as upstream's calculate_scores computes it (called here, from the pinned wheel, on the same scores)."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from dynamicrubric.evaluation.writingbench_scores import (
    WritingBenchError,
    parse_critic_reply,
    writingbench_critic_messages,
    writingbench_module,
    writingbench_queries,
    writingbench_scores,
)

BANDS = ("1-2", "3-4", "5-6", "7-8", "9-10")


@pytest.fixture(scope="module")
def queries() -> list[dict]:
    records = writingbench_queries()
    # a handful of real queries, both languages
    return [r for r in records if r["lang"] == "zh"][:2] + [r for r in records if r["lang"] == "en"][:3]


def planted_score(index: int, position: int) -> int:
    """The score the planted critic gives the criterion at `position` of query `index`: 1–10, varied."""
    return (3 * index + 7 * position) % 10 + 1


def planted_critic(messages: list[dict], queries: list[dict]) -> str:
    """A critic that reads which query and criterion it is asked about from the prompt itself (so a
    prompt that lost the criterion gets no score) and answers in upstream's JSON format, fenced."""
    prompt = messages[-1]["content"]
    for record in queries:
        if record["query"] not in prompt:
            continue
        for position, criterion in enumerate(record["checklist"]):
            if str(criterion) in prompt:
                score = planted_score(record["index"], position)
                return f'```json\n{{"score": {score}, "reason": "planted"}}\n```'
    return "I cannot tell which criterion this is."


def judge_all(queries: list[dict], broken: tuple[int, int] | None = None) -> pd.DataFrame:
    rows = []
    for record in queries:
        for position, criterion in enumerate(record["checklist"]):
            messages = writingbench_critic_messages(record["query"], f"answer {record['index']}", criterion)
            reply = planted_critic(messages, queries)
            if (record["index"], position) == broken:
                reply = "The response is strong; score: nine out of ten."  # no JSON: a failed call
            rows.append({"index": record["index"], "criterion": criterion["name"], "reply": reply})
    return pd.DataFrame(rows)


def upstream_overall(queries: list[dict], tmp_path, skip: tuple[int, int] | None = None) -> tuple:
    """calculate_scores.read_scores_file on the planted scores written as upstream's scorer writes them
    (writingbench_task.score_one: per query, per criterion name, a list of {score, reason}; a criterion
    whose reply never parsed is absent)."""
    path = tmp_path / "scores.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for record in queries:
            scores = {}
            for position, criterion in enumerate(record["checklist"]):
                if (record["index"], position) != skip:
                    score = planted_score(record["index"], position)
                    scores.setdefault(criterion["name"], []).append({"score": score, "reason": "planted"})
            f.write(json.dumps({"index": record["index"], "scores": scores}, ensure_ascii=False) + "\n")
    return writingbench_module("calculate_scores").read_scores_file(str(path))


def test_planted_critic_gives_upstreams_score(queries, tmp_path):
    ours = writingbench_scores(judge_all(queries))
    per_query, overall, count, _ = upstream_overall(queries, tmp_path)
    assert ours.failed == 0
    assert ours.score == pytest.approx(overall, abs=1e-12)
    assert ours.score_x10 == pytest.approx(10 * overall, abs=1e-10)
    assert ours.queries == count == len(queries)
    assert ours.per_query == pytest.approx(per_query, abs=1e-12)
    assert 1 < ours.score < 10  # the planted scores vary: not a degenerate all-equal case


def test_a_reply_that_does_not_parse_is_counted_never_scored(queries, tmp_path):
    """The key rule: a failed call is left out and counted, as upstream leaves out a criterion it could
    not score. Scoring it (as 0, or as anything) moves the number away from upstream's."""
    broken = (queries[1]["index"], 2)
    ours = writingbench_scores(judge_all(queries, broken=broken))
    per_query, overall, count, _ = upstream_overall(queries, tmp_path, skip=broken)
    assert ours.failed == 1
    assert ours.criteria == sum(len(r["checklist"]) for r in queries) - 1
    assert ours.score == pytest.approx(overall, abs=1e-12)
    assert ours.per_query == pytest.approx(per_query, abs=1e-12)
    with_zero = judge_all(queries).assign(score=lambda f: [parse_critic_reply(r) for r in f.reply])
    with_zero.loc[
        (with_zero["index"] == broken[0]) & (with_zero.criterion == queries[1]["checklist"][2]["name"]),
        "score",
    ] = 0
    assert with_zero.score.mean() != pytest.approx(overall)  # the check above would catch a 0


def test_critic_prompt_is_upstreams_template_with_the_whole_criterion(queries):
    record = queries[2]
    criterion = record["checklist"][0]
    system, user = writingbench_critic_messages(record["query"], "THE RESPONSE", criterion)
    assert system["role"] == "system" and user["role"] == "user"
    assert system["content"] == writingbench_module("prompt").evaluate_system
    text = user["content"]
    assert record["query"] in text and "```THE RESPONSE```" in text
    # the criterion's name, description and all five score bands, twice (stated, then restated)
    for part in (criterion["name"], criterion["criteria_description"], *(criterion[b] for b in BANDS)):
        assert text.count(part) == 2, part
    assert "Scoring Range: Assign an integer score between 1 to 10" in text
    assert re.search(r'\{\s*"score": an integer score between 1 to 10', text)  # the template's braces


def test_a_criterion_without_its_score_bands_is_refused(queries):
    # the quick protocol's loader keeps only name and description: not enough for the official critic
    criterion = queries[0]["checklist"][0]
    short = {"name": criterion["name"], "criteria_description": criterion["criteria_description"]}
    with pytest.raises(WritingBenchError, match="lacks"):
        writingbench_critic_messages(queries[0]["query"], "x", short)


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ('```json\n{"score": 7, "reason": "fine"}\n```', 7),
        ('Here it is: {"score": 10, "reason": "best"} done', 10),
        ('{"score": 1, "reason": "poor"}', 1),
        ('{"score": "7", "reason": "a string score"}', None),
        ('{"score": 7.5, "reason": "not an integer"}', None),
        ('{"score": 11, "reason": "out of range"}', None),
        ('{"score": 0, "reason": "out of range"}', None),
        ('{"score": true, "reason": "a bool"}', None),
        ('{"score": 7}', None),  # upstream also needs the reason
        ("no json at all", None),
        (None, None),
    ],
)
def test_critic_reply_parsing(reply, score):
    assert parse_critic_reply(reply) == score


@pytest.mark.parametrize("bad", [0, 11, 7.5])
def test_scores_that_are_not_integers_1_to_10_are_refused(bad):
    frame = pd.DataFrame({"index": [1, 1], "criterion": ["a", "b"], "score": [5, bad]})
    with pytest.raises(WritingBenchError, match="integers 1–10"):
        writingbench_scores(frame)
