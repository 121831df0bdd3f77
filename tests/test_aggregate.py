"""Aggregation: scores, generator rewards and diagnostics on hand-computed cases, plus input checks."""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import pandas as pd
import pytest

from dynamicrubric.infra.artifact_kinds import empty_table
from dynamicrubric.infra.artifacts import read_artifact, write_artifact
from dynamicrubric.scoring.aggregate import (
    AggregateError,
    aggregate,
    run_aggregate,
    score_responses,
)


def log_sigmoid(x: float) -> float:
    return math.log(1 / (1 + math.exp(-x)))


def rollouts(**sizes: int) -> pd.DataFrame:
    """rollouts(a=4, b=2): K responses (sample_idx 0..K-1) per prompt."""
    rows = [(p, s) for p, k in sizes.items() for s in range(k)]
    return pd.DataFrame(rows, columns=["prompt_id", "sample_idx"])


def judged(
    prompt: str, weights: list[int], verdicts: list[list[int]], rubric_idx: int = 0, p_yes=None
) -> pd.DataFrame:
    """Judgment rows from a verdict matrix: verdicts[sample_idx][item_idx]."""
    rows = []
    for s, row in enumerate(verdicts):
        for i, (w, v) in enumerate(zip(weights, row, strict=True)):
            p = p_yes[s][i] if p_yes is not None else (0.9 if v else 0.1)
            rows.append((prompt, rubric_idx, i, s, w, bool(v), p))
    return pd.DataFrame(
        rows, columns=["prompt_id", "rubric_idx", "item_idx", "sample_idx", "weight", "verdict", "p_yes"]
    )


def anchors(list_id: str, ranks: list[int]) -> pd.DataFrame:
    """An anchor list over the candidate set: ranks[sample_idx] (1 = best)."""
    return pd.DataFrame({"list_id": list_id, "sample_idx": range(len(ranks)), "rank": ranks})


def scores_of(result, prompt: str = "a") -> list[float]:
    s = result.scores
    return s[s.prompt_id == prompt].sort_values("sample_idx")["score"].tolist()


def row(frame: pd.DataFrame, prompt: str = "a", rubric_idx: int = 0) -> pd.Series:
    rows = frame[(frame.prompt_id == prompt) & (frame.rubric_idx == rubric_idx)]
    assert len(rows) == 1
    return rows.iloc[0]


# Three responses scoring 1.0, 0.5, 0.0 under two weight-1 items.
THREE = judged("a", [1, 1], [[1, 1], [1, 0], [0, 0]])


def test_weighted_score_paper_example():
    # Fig. 1 of the paper: weights 5, 3, 2 and verdicts yes, no, yes → (5 + 2) / 10.
    result = aggregate(judged("a", [5, 3, 2], [[1, 0, 1]]), rollouts(a=1))
    assert scores_of(result) == [pytest.approx(0.7)]
    assert result.scores["num_items"].tolist() == [3]


def test_scores_cover_every_rollout_and_every_rubric():
    two_rubrics = pd.concat(
        [judged("a", [1], [[1], [0]], rubric_idx=0), judged("a", [2, 3], [[0, 1], [1, 1]], rubric_idx=3)]
    )
    scores = score_responses(two_rubrics, rollouts(a=2))
    assert scores[["rubric_idx", "sample_idx"]].values.tolist() == [[0, 0], [0, 1], [3, 0], [3, 1]]
    assert scores["score"].tolist() == pytest.approx([1.0, 0.0, 0.6, 1.0])


def test_r_disc_of_an_item_every_response_passes_is_zero():
    rewards = aggregate(judged("a", [4], [[1], [1], [1], [1]]), rollouts(a=4)).rewards
    assert row(rewards)["r_disc"] == 0.0
    # Next to a 2-of-4 item it still counts in the weight total: (1·0 + 1·0.25) / 2.
    rewards = aggregate(judged("a", [1, 1], [[1, 1], [1, 1], [1, 0], [1, 0]]), rollouts(a=4)).rewards
    assert row(rewards)["r_disc"] == pytest.approx(0.125)


def test_r_disc_of_one_item_passed_by_half():
    rewards = aggregate(judged("a", [1], [[1], [0], [1], [0]]), rollouts(a=4)).rewards
    assert row(rewards)["r_disc"] == pytest.approx(0.25)
    assert row(rewards)["num_items"] == 1


def test_r_anchor_exact_value_for_three():
    # S = 1.0, 0.5, 0.0 ranked 1, 2, 3: pairs (1,2): logσ(.5)/(1·1), (1,3): logσ(1)/(2·1), (2,3): logσ(.5)/(1·2).
    rewards = aggregate(THREE, rollouts(a=3), anchors=anchors("a", [1, 2, 3])).rewards
    expected = log_sigmoid(0.5) + log_sigmoid(1.0) / 2 + log_sigmoid(0.5) / 2
    assert row(rewards)["r_anchor"] == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(-0.867746, abs=1e-6)


def test_r_anchor_prefers_the_correct_order_to_the_reversed_one():
    both = pd.concat([THREE, THREE.assign(prompt_id="b")])
    lists = pd.concat([anchors("a", [1, 2, 3]), anchors("b", [3, 2, 1])])
    rewards = aggregate(both, rollouts(a=3, b=3), anchors=lists).rewards
    assert row(rewards, "a")["r_anchor"] > row(rewards, "b")["r_anchor"]


def test_r_anchor_with_tied_ranks_uses_rank_values_and_skips_tied_pairs():
    # Ranks 1, 1, 2: only the pairs (sample 0, sample 2) and (sample 1, sample 2), each at distance 1, 2^0.
    rewards = aggregate(THREE, rollouts(a=3), anchors=anchors("a", [1, 1, 2])).rewards
    assert row(rewards)["r_anchor"] == pytest.approx(log_sigmoid(1.0) + log_sigmoid(0.5), abs=1e-12)


def test_r_anchor_is_null_without_a_ranking_of_this_candidate_set():
    # A list for another prompt is not ours; a list whose responses all tie orders no pair.
    for lists in [anchors("other-prompt", [1, 2, 3]), anchors("a", [1, 1, 1])]:
        per_group = aggregate(THREE, rollouts(a=3), anchors=lists)
        assert np.isnan(row(per_group.rewards)["r_anchor"])
        assert np.isnan(row(per_group.diagnostics)["mean_gap"])
        assert "r_anchor_mean" not in per_group.overall


def test_tie_rate_and_uniformity_on_small_groups():
    data = pd.concat([judged("a", [1], [[1], [1], [0], [0]]), judged("b", [2, 3], [[1, 0]] * 4)])
    result = aggregate(data, rollouts(a=4, b=4))
    per_group, overall = result.diagnostics, result.overall
    assert row(per_group, "a")["tie_rate"] == pytest.approx(2 / 6)  # scores 1, 1, 0, 0
    assert not row(per_group, "a")["uniform"]
    assert row(per_group, "b")["tie_rate"] == 1.0  # all four score 0.4
    assert row(per_group, "b")["uniform"]
    assert overall["tie_rate"] == pytest.approx((2 + 6) / 12)
    assert overall["uniformity_rate"] == 0.5
    assert overall["nondiscriminative_item_rate"] == pytest.approx(2 / 3)  # b's items pass 4/4 and 0/4


def test_mean_gap_follows_the_reference_order():
    both = pd.concat([THREE, THREE.assign(prompt_id="b"), THREE.assign(prompt_id="c")])
    lists = pd.concat([anchors("a", [1, 2, 3]), anchors("b", [3, 2, 1])])
    result = aggregate(both, rollouts(a=3, b=3, c=3), anchors=lists)
    per_group, overall = result.diagnostics, result.overall
    assert row(per_group, "a")["mean_gap"] == pytest.approx((0.5 + 1.0 + 0.5) / 3)
    assert row(per_group, "b")["mean_gap"] == pytest.approx(-(0.5 + 1.0 + 0.5) / 3)
    assert np.isnan(row(per_group, "c")["mean_gap"])  # no reference ordering
    assert overall["mean_gap"] == pytest.approx(0.0)  # pooled over the six pairs of a and b
    assert "mean_gap" not in aggregate(THREE, rollouts(a=3)).overall


def test_empty_rubric_scores_zero_and_is_counted(caplog):
    rubrics = pd.DataFrame(
        {
            "prompt_id": ["a", "b"],
            "rubric_idx": [0, 0],
            "items": [[{"text": "x", "weight": 1}, {"text": "y", "weight": 1}], []],
        }
    )
    with caplog.at_level(logging.WARNING, logger="dynamicrubric.scoring.aggregate"):
        result = aggregate(THREE, rollouts(a=3, b=2), rubrics)
    assert "1 of 2 rubrics are empty" in caplog.text
    assert scores_of(result, "b") == [0.0, 0.0]
    assert result.scores[result.scores.prompt_id == "b"]["num_items"].tolist() == [0, 0]
    assert row(result.rewards, "b")["r_disc"] == 0.0
    assert np.isnan(row(result.diagnostics, "b")["mean_pass_rate"])
    assert row(result.diagnostics, "b")["uniform"]
    assert result.overall["empty_rubrics"] == 1.0
    # Without the rubrics table, a prompt with no judgments cannot be scored: an error, not a silent gap.
    with pytest.raises(AggregateError, match="prompt_id='b' has rollouts but no rubric"):
        aggregate(THREE, rollouts(a=3, b=2))


def test_only_empty_rubrics_and_no_judgments_at_all():
    rubrics = pd.DataFrame({"prompt_id": ["a"], "rubric_idx": [0], "items": [[]]})
    result = aggregate(empty_table("judgments"), rollouts(a=3), rubrics)
    assert scores_of(result) == [0.0, 0.0, 0.0]
    assert result.overall["empty_rubrics"] == 1.0 and result.overall["num_judgments"] == 0.0
    assert "mean_pass_rate" not in result.overall


def test_pointwise_baseline_takes_the_same_path():
    # One weight-1 item per response: the score is the verdict.
    pointwise = judged("a", [1], [[1], [0], [1]])
    assert scores_of(aggregate(pointwise, rollouts(a=3))) == [1.0, 0.0, 1.0]


def test_soft_scores_use_p_yes():
    data = judged("a", [5, 3, 2], [[1, 0, 1]], p_yes=[[0.9, 0.2, 0.6]])
    assert scores_of(aggregate(data, rollouts(a=1))) == [pytest.approx(0.7)]
    soft = aggregate(data, rollouts(a=1), soft=True)
    assert scores_of(soft) == [pytest.approx((5 * 0.9 + 3 * 0.2 + 2 * 0.6) / 10, abs=1e-6)]
    assert row(soft.diagnostics)["mean_pass_rate"] == pytest.approx((0.9 + 0.2 + 0.6) / 3, abs=1e-6)


def test_soft_r_disc_is_the_variance_over_responses_not_the_verifiers_doubt():
    # Item 0: the verifier is unsure of every response alike (p = 0.5): it splits nothing, R_disc 0,
    # although v̄(1 − v̄) would be 0.25. Item 1: p 0.9 vs 0.1 splits the two responses: variance 0.16.
    data = judged("a", [1, 3], [[1, 1], [1, 0]], p_yes=[[0.5, 0.9], [0.5, 0.1]])
    soft = aggregate(data, rollouts(a=2), soft=True)
    assert row(soft.rewards)["r_disc"] == pytest.approx((1 * 0.0 + 3 * 0.16) / 4, abs=1e-9)
    # Hard verdicts of the same rows: item 0 passes both (0), item 1 splits them (0.25), as in the paper.
    assert row(aggregate(data, rollouts(a=2)).rewards)["r_disc"] == pytest.approx(3 * 0.25 / 4)


def test_incomplete_judging_names_the_missing_judgment():
    data = judged("a", [5, 3, 2], [[1, 0, 1], [1, 1, 1]])
    missing = data[~((data.sample_idx == 1) & (data.item_idx == 2))]
    with pytest.raises(
        AggregateError, match=r"\(prompt_id='a', rubric_idx=0, item_idx=2, sample_idx=1\) is missing"
    ):
        aggregate(missing, rollouts(a=2))
    # A response of the candidate set with no judgments at all is incomplete judging too.
    with pytest.raises(AggregateError, match=r"item_idx=0, sample_idx=2\) is missing"):
        aggregate(data, rollouts(a=3))
    with pytest.raises(AggregateError, match="appears 2 times"):
        aggregate(pd.concat([data, data.iloc[:1]]), rollouts(a=2))


def test_inconsistent_inputs_are_errors_naming_the_key():
    data = judged("a", [5, 3], [[1, 0], [1, 1]])
    with pytest.raises(AggregateError, match=r"sample_idx=7\): sample_idx is not a rollout"):
        aggregate(pd.concat([data, data.iloc[:1].assign(sample_idx=7)]), rollouts(a=2))
    with pytest.raises(AggregateError, match=r"prompt_id='zz'.*prompt_id has no rollouts"):
        aggregate(pd.concat([data, data.iloc[:1].assign(prompt_id="zz")]), rollouts(a=2))
    with pytest.raises(AggregateError, match="weight differs from the same item's weight"):
        aggregate(data.assign(weight=[5, 3, 4, 3]), rollouts(a=2))
    rubric = pd.DataFrame(
        {
            "prompt_id": ["a"],
            "rubric_idx": [0],
            "items": [[{"text": t, "weight": w} for t, w in zip("xyz", [5, 3, 2], strict=True)]],
        }
    )
    with pytest.raises(AggregateError, match="has 3 item\\(s\\) but judgments cover 2"):
        aggregate(data, rollouts(a=2), rubric)
    with pytest.raises(AggregateError, match="rubric is not in the rubrics table"):
        aggregate(data.assign(rubric_idx=1), rollouts(a=2), rubric)
    with pytest.raises(AggregateError, match="weight differs from the rubric's item weight"):
        aggregate(
            data,
            rollouts(a=2),
            rubric.assign(items=[[{"text": "x", "weight": 5}, {"text": "y", "weight": 1}]]),
        )
    with pytest.raises(AggregateError, match="sample_idx=5\\): sample_idx is not a rollout"):
        aggregate(data, rollouts(a=2), anchors=anchors("a", [1, 2]).assign(sample_idx=[0, 5]))


def test_row_order_does_not_matter():
    data = pd.concat(
        [judged("a", [5, 3, 2], [[1, 0, 1], [0, 1, 1], [1, 1, 0]]), judged("b", [1], [[1], [0]])]
    )
    lists = anchors("a", [2, 1, 3])
    first = aggregate(data, rollouts(a=3, b=2), anchors=lists)
    shuffled = aggregate(
        data.sample(frac=1, random_state=0), rollouts(b=2, a=3).iloc[::-1], anchors=lists[::-1]
    )
    pd.testing.assert_frame_equal(first.scores, shuffled.scores)
    pd.testing.assert_frame_equal(first.rewards, shuffled.rewards)
    pd.testing.assert_frame_equal(first.diagnostics, shuffled.diagnostics)


def test_matches_a_plain_python_reference_on_random_data():
    """Many groups of varying K, M and G with anchor lists with ties, against loops written from the definitions."""
    rng = np.random.default_rng(7)
    frames, roll, lists, sets = [], [], [], {}
    for p in range(30):
        prompt, k = f"p{p}", int(rng.integers(1, 7))
        samples = rng.choice(50, size=k, replace=False).tolist()  # sparse, unsorted sample_idx
        roll += [(prompt, s) for s in samples]
        for r in rng.choice(5, size=int(rng.integers(1, 3)), replace=False).tolist():
            weights = rng.integers(1, 6, size=int(rng.integers(1, 6))).tolist()
            verdicts = {s: rng.integers(0, 2, size=len(weights)).tolist() for s in samples}
            sets[(prompt, r)] = (weights, verdicts)
            frames += [
                (prompt, r, i, s, w, bool(v[i]), 0.5)
                for s, v in verdicts.items()
                for i, w in enumerate(weights)
            ]
        if p % 3:
            lists += [(prompt, s, int(rng.integers(1, 4))) for s in samples]
    data = pd.DataFrame(
        frames, columns=["prompt_id", "rubric_idx", "item_idx", "sample_idx", "weight", "verdict", "p_yes"]
    )
    result = aggregate(
        data,
        pd.DataFrame(roll, columns=["prompt_id", "sample_idx"]),
        anchors=pd.DataFrame(lists, columns=["list_id", "sample_idx", "rank"]),
    )
    ranks = {}
    for prompt, s, rank in lists:
        ranks.setdefault(prompt, {})[s] = rank

    for (prompt, r), (weights, verdicts) in sets.items():
        score = {
            s: sum(w * x for w, x in zip(weights, v, strict=True)) / sum(weights) for s, v in verdicts.items()
        }
        got = result.scores[(result.scores.prompt_id == prompt) & (result.scores.rubric_idx == r)]
        assert dict(zip(got.sample_idx, got.score, strict=True)) == pytest.approx(score)
        rates = [sum(v[i] for v in verdicts.values()) / len(verdicts) for i in range(len(weights))]
        r_disc = sum(w * x * (1 - x) for w, x in zip(weights, rates, strict=True)) / sum(weights)
        assert row(result.rewards, prompt, r)["r_disc"] == pytest.approx(r_disc)
        pairs = [(a, b) for a, b in itertools.combinations(score, 2)]
        ties = sum(score[a] == score[b] for a, b in pairs)
        diag = row(result.diagnostics, prompt, r)
        assert diag["tie_rate"] == pytest.approx(ties / len(pairs) if pairs else 0.0)
        assert diag["uniform"] == (len(set(score.values())) == 1)
        ordered = [
            (a, b)
            for a in ranks.get(prompt, {})
            for b in ranks.get(prompt, {})
            if ranks[prompt][a] < ranks[prompt][b]
        ]
        if ordered:
            rank = ranks[prompt]
            r_anchor = sum(
                log_sigmoid(score[a] - score[b]) / ((rank[b] - rank[a]) * 2 ** (rank[a] - 1))
                for a, b in ordered
            )
            assert row(result.rewards, prompt, r)["r_anchor"] == pytest.approx(r_anchor)
            assert diag["mean_gap"] == pytest.approx(np.mean([score[a] - score[b] for a, b in ordered]))
        else:
            assert np.isnan(row(result.rewards, prompt, r)["r_anchor"])
            assert np.isnan(diag["mean_gap"])


def test_run_aggregate_round_trip(tmp_path):
    roll = rollouts(a=3, b=2).assign(
        prompt="q", response="r", num_tokens=5, finish_reason="stop", policy="tiny", seed=0
    )
    rubric_rows = pd.DataFrame(
        {
            "prompt_id": ["a", "b"],
            "rubric_idx": [0, 0],
            "variant": "dynamic",
            "generator": "tiny",
            "generator_prompt": "g",
            "completion": ["1. x (1)\n2. y (1)", "???"],
            "parse_status": ["lines", "empty"],
            "finish_reason": ["stop", "length"],
            "items": [[{"text": "x", "weight": 1}, {"text": "y", "weight": 1}], []],
        }
    )
    lists = anchors("a", [1, 2, 3]).assign(prompt="q", response="r", source="outcomes")
    paths = {
        name: str(tmp_path / f"{name}.parquet") for name in ["judgments", "rollouts", "rubrics", "anchors"]
    }
    write_artifact(paths["judgments"], "judgments", THREE)
    write_artifact(paths["rollouts"], "rollouts", roll)
    write_artifact(paths["rubrics"], "rubrics", rubric_rows)
    write_artifact(paths["anchors"], "anchors", lists)
    outs = {
        name: str(tmp_path / "out" / f"{name}.parquet")
        for name in ["scores", "rewards", "diagnostics", "metrics"]
    }

    overall = run_aggregate(
        paths["judgments"],
        paths["rollouts"],
        outs["scores"],
        outs["rewards"],
        outs["diagnostics"],
        outs["metrics"],
        rubrics_uri=paths["rubrics"],
        anchors_uri=paths["anchors"],
        round_idx=2,
        variant="static",
    )

    scores = read_artifact(outs["scores"], "scores").to_pandas()
    assert scores["score"].tolist() == pytest.approx([1.0, 0.5, 0.0, 0.0, 0.0])
    rewards = read_artifact(outs["rewards"], "rewards").to_pandas()
    assert rewards["r_anchor"].isna().tolist() == [False, True]
    assert read_artifact(outs["diagnostics"], "diagnostics").num_rows == 2
    metrics = read_artifact(outs["metrics"], "metrics").to_pandas()
    assert set(metrics["stage"]) == {"aggregate"} and set(metrics["variant"]) == {"static"}
    assert set(metrics["round"]) == {2} and set(metrics["step"]) == {0}
    values = dict(zip(metrics["name"], metrics["value"], strict=True))
    assert values == pytest.approx(overall)
    assert values["empty_rubrics"] == 1.0 and values["num_groups"] == 2.0 and values["num_judgments"] == 6.0
    assert values["mean_score"] == pytest.approx(1.5 / 5)


def test_a_rubric_with_judged_items_is_scored_on_those_items_alone():
    """Item dropout: the rubric keeps its three items, judged_items names the two the verifier judged
    (item 0 and item 2, their own weights); the score is Σ w·v / Σ w over those two, and a judgment of
    a left-out item, or a judged item missing, is refused by name."""
    items = [{"text": t, "weight": w} for t, w in zip("xyz", [5, 3, 2], strict=True)]
    rubric = pd.DataFrame({"prompt_id": ["a"], "rubric_idx": [0], "items": [items], "judged_items": [[0, 2]]})
    data = judged("a", [5, 2], [[1, 0], [0, 1], [1, 1]]).assign(item_idx=lambda d: d["item_idx"] * 2)
    result = aggregate(data, rollouts(a=3), rubric)
    assert scores_of(result) == pytest.approx([5 / 7, 2 / 7, 1.0])
    assert row(result.rewards)["num_items"] == 2
    with pytest.raises(AggregateError, match="not among the rubric's judged_items"):
        aggregate(data, rollouts(a=3), rubric.assign(judged_items=[[0, 1]]))
    with pytest.raises(AggregateError, match="has 3 item\\(s\\) but judgments cover 2"):
        aggregate(data, rollouts(a=3), rubric.drop(columns="judged_items"))
    with pytest.raises(AggregateError, match="judged_items names item 7"):
        aggregate(data, rollouts(a=3), rubric.assign(judged_items=[[0, 7]]))
