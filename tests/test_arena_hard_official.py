"""Arena-Hard v2.0's official scores (issue 49, item 3): per category, from both games' five-level labels,
strong verdicts weighing 3, with and without style control, as arena-hard-auto's show_result computes them.
The numbers upstream's own code gave on the synthetic set are in tests/fixtures/arena_hard/expected.json
(README.md there has the command)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dynamicrubric.evaluation.arena_hard_scores import (
    BASELINES,
    ArenaHardError,
    answer_style,
    arena_hard_baseline_style,
    arena_hard_scores,
    gpt4o_token_counter,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "arena_hard"


def _synthetic_module():
    spec = importlib.util.spec_from_file_location("arena_hard_synthetic", FIXTURES / "make_expected.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def synthetic_scores() -> pd.DataFrame:
    judgments, policy_style, baseline_style = _synthetic_module().synthetic_judgments()
    return arena_hard_scores(judgments, policy_style, baseline_style, seed=0)


def test_scores_per_category_equal_upstreams_show_result(synthetic_scores):
    """Each category on its own, with and without style control: the point estimate to 0.1 (on 0-100) of
    show_result's score column. That column is itself a draw (the mean, or with style control the median,
    of 100 unseeded bootstraps; here the statistic on all battles, which it estimates), so the fixture holds
    five seeded runs of upstream's code: the point estimate is within 0.1 of their mean and of each run
    within 0.15. The 5%/95% bounds, quantiles of 100 bootstraps drawn differently here and there, to 0.3."""
    expected = json.loads((FIXTURES / "expected.json").read_text())
    assert sorted(expected) == sorted(synthetic_scores.category.unique())
    for row in synthetic_scores.itertuples():
        upstream = expected[row.category][row.model]
        where = (row.category, row.model)
        assert row.baseline == BASELINES[row.category]
        for key in ("score", "style_controlled"):
            ours = getattr(row, key)
            assert ours == pytest.approx(upstream[key]["mean"], abs=0.1), (*where, key)
            for run in upstream[key]["runs"]:
                assert ours == pytest.approx(run, abs=0.15), (*where, key, run)
            for bound in ("lo", "hi"):
                ours, theirs = getattr(row, f"{key}_{bound}"), upstream[f"{key}_{bound}"]["mean"]
                assert ours == pytest.approx(theirs, abs=0.3), (*where, key, bound)
    # style control moves the number (the synthetic judge likes length and bold) by more than the tolerance
    moved = (synthetic_scores.style_controlled - synthetic_scores.score).abs()
    assert (moved > 0.15).all()


def test_the_same_seed_gives_the_same_numbers():
    judgments = _handmade([("A>B", "A>>B"), ("B>A", "A=B"), ("A=B", "B>>A")] * 4)
    style = _flat_style(judgments)
    first = arena_hard_scores(judgments, style, style, seed=3)
    again = arena_hard_scores(judgments, style, style, seed=3)
    pd.testing.assert_frame_equal(first, again)


def _handmade(games: list[tuple[str | None, str | None]], category: str = "hard_prompt") -> pd.DataFrame:
    """Judgments from (game 1 label [baseline as A], game 2 label [policy as A]) pairs."""
    return pd.DataFrame(
        {
            "uid": [f"{category}-{i}" for i in range(len(games))],
            "category": category,
            "game1": [g[0] for g in games],
            "game2": [g[1] for g in games],
        }
    )


def _flat_style(judgments: pd.DataFrame) -> pd.DataFrame:
    n = len(judgments)
    rng = np.random.default_rng(0)
    return pd.DataFrame(
        {
            "uid": judgments.uid,
            "token_len": rng.integers(50, 500, n),
            "header_count": rng.integers(0, 4, n),
            "list_count": rng.integers(0, 9, n),
            "bold_count": rng.integers(0, 6, n),
        }
    )


def test_strong_verdicts_weigh_three():
    """The policy strongly better in both games of one question, slightly worse in both of another: six
    winning battle rows against two losing ones, 75%, where unweighted verdicts would say 50%."""
    scores = arena_hard_scores(_handmade([("B>>A", "A>>B"), ("A>B", "B>A")]))
    row = scores.iloc[0]
    assert row.score == pytest.approx(75.0)
    assert row.battles == 8 and row.questions == 2 and row.failed == 0


def test_game_order_game1_has_the_baseline_as_a():
    # game 1 "A>B" is the baseline winning, game 2 "A>B" the policy winning: one loss, one win
    assert arena_hard_scores(_handmade([("A>B", "A>B")])).iloc[0].score == pytest.approx(50.0)
    assert arena_hard_scores(_handmade([("B>A", "A>B")])).iloc[0].score == pytest.approx(100.0)
    assert arena_hard_scores(_handmade([("A>B", "B>A")])).iloc[0].score == pytest.approx(0.0)


def test_categories_are_scored_apart_never_pooled():
    judgments = pd.concat(
        [
            _handmade([("B>A", "A>B")] * 3, "hard_prompt"),  # the policy always wins hard prompts
            _handmade([("A>>B", "B>>A")] * 5, "creative_writing"),  # and always loses creative writing
        ]
    )
    scores = arena_hard_scores(judgments).set_index("category")
    assert scores.loc["hard_prompt", "score"] == pytest.approx(100.0)
    assert scores.loc["creative_writing", "score"] == pytest.approx(0.0)
    assert scores.loc["hard_prompt", "baseline"] == "o3-mini-2025-01-31"
    assert scores.loc["creative_writing", "baseline"] == "gemini-2.0-flash-001"


def test_a_game_without_a_label_drops_its_question_and_is_counted():
    scores = arena_hard_scores(_handmade([("B>A", "A>B"), (None, "B>>A"), ("A>B", "[[garbled]]")]))
    row = scores.iloc[0]
    assert row.failed == 2 and row.questions == 1
    assert row.score == pytest.approx(100.0)  # the failed questions' other games are not losses


def test_an_unknown_category_is_refused():
    with pytest.raises(ArenaHardError, match="no baseline"):
        arena_hard_scores(_handmade([("A>B", "B>A")], "math_olympiad"))


def test_style_control_needs_every_answers_features():
    judgments = _handmade([("A>B", "B>A"), ("B>A", "A>B")])
    style = _flat_style(judgments)
    with pytest.raises(ArenaHardError, match="no style features for the policy's answer"):
        arena_hard_scores(judgments, style.iloc[:1], style)


def test_answer_style_counts_as_upstream():
    """upstream's add_markdown_info.count_markdown_elements: headers #..######, numbered and -*+ list
    items, **bold** and __bold__, all outside fenced code blocks; the token count of the whole answer."""
    answer = (
        "# Title\n## Part\nText with **bold** and __also__ and **two** words.\n"
        "1. first\n2. second\n- dash\n  * nested star\n+ plus\n"
        "####### seven hashes is not a header\n#no space is not one\n"
        "```python\n# a comment, not a header\n- not a list\n**not bold**\n```\n"
    )
    style = answer_style(answer, count_tokens=lambda text: len(text.split()))
    assert style == {
        "token_len": len(answer.split()),
        "header_count": 2,
        "list_count": 5,
        "bold_count": 3,
    }


def test_baseline_style_is_upstreams_metadata():
    style = arena_hard_baseline_style()
    assert set(style.model) == set(BASELINES.values())
    o3 = style[style.model == "o3-mini-2025-01-31"].set_index("uid")
    assert len(o3) == 750
    # the first answer of upstream's o3-mini file: 179 tokens, no markdown
    assert o3.loc["0253f09025cc40cd"].tolist() == ["o3-mini-2025-01-31", 179, 0, 0, 0]
    gemini = style[style.model == "gemini-2.0-flash-001"]
    assert len(gemini) == 748 and (gemini.bold_count > 0).any()


def test_without_tiktoken_the_gpt4o_counter_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken raises ImportError
    with pytest.raises(ArenaHardError, match="tiktoken's gpt-4o encoding"):
        gpt4o_token_counter()
