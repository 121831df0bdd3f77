"""Evaluate stage: metric functions on lists whose answer is known by hand, and the stage end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamicrubric import store, tasks
from dynamicrubric.evaluation.evaluate import run_evaluate
from dynamicrubric.evaluation.labelled import accuracy_by_origin, load_labelled, outcome_lists
from dynamicrubric.evaluation.metrics import (
    evaluator_metrics,
    listwise_accuracy,
    mean_gap,
    mean_gap_correct,
    ndcg,
    pairwise_accuracy,
    pass_at_k,
    policy_metrics,
    tie_rate,
    uniformity_rate,
    win_rate,
)
from dynamicrubric.evaluation.plots import PLOT_NAMES, write_plots
from dynamicrubric.infra.artifacts import read_artifact, read_frame, write_artifact
from dynamicrubric.infra.config_loading import load_config

D2, D3 = 1 / math.log2(3), 1 / math.log2(4)  # discounts of positions 2 and 3 (position 1: 1.0)


def lists(*groups: tuple[str, list[int], list[float]]) -> pd.DataFrame:
    """A lists frame from (list_id, ranks, scores) triples."""
    return pd.DataFrame(
        [
            {"list_id": lid, "sample_idx": j, "rank": r, "score": s}
            for lid, ranks, scores in groups
            for j, (r, s) in enumerate(zip(ranks, scores, strict=True))
        ]
    )


PERFECT = ("a", [1, 2, 3], [0.9, 0.5, 0.1])
REVERSED = ("b", [1, 2, 3], [0.1, 0.5, 0.9])
TIED_TOP = ("c", [1, 2, 2], [0.5, 0.5, 0.0])  # the best ties a worse one at the top
UNIFORM = ("d", [1, 2], [0.3, 0.3])
NO_ORDER = ("e", [1, 1, 1], [0.2, 0.9, 0.9])  # all ranks equal: nothing to be right or wrong about


def test_perfect_scorer():
    df = lists(PERFECT)
    assert pairwise_accuracy(df) == 1.0
    assert listwise_accuracy(df) == 1.0
    assert ndcg(df) == pytest.approx(1.0)
    assert mean_gap(df) == pytest.approx((0.4 + 0.8 + 0.4) / 3)
    assert mean_gap_correct(df) == pytest.approx((0.4 + 0.8 + 0.4) / 3)
    assert tie_rate(df) == 0.0
    assert uniformity_rate(df) == 0.0


def test_reversed_scorer():
    df = lists(REVERSED)
    assert pairwise_accuracy(df) == 0.0
    assert listwise_accuracy(df) == 0.0
    # gains (max rank − rank) 2, 1, 0; the scorer puts them in order 0, 1, 2
    assert ndcg(df) == pytest.approx((0 * 1 + 1 * D2 + 2 * D3) / (2 * 1 + 1 * D2 + 0 * D3))
    assert mean_gap(df) == pytest.approx(-(0.4 + 0.8 + 0.4) / 3)
    assert math.isnan(mean_gap_correct(df))  # no pair is ordered correctly


def test_ties_count_half():
    df = lists(TIED_TOP)
    # pairs (best, worse1): tie -> 0.5; (best, worse2): right -> 1
    assert pairwise_accuracy(df) == pytest.approx(0.75)
    # two responses share the top score, one of them is best
    assert listwise_accuracy(df) == pytest.approx(0.5)
    # gains 1, 0, 0; the tied top two share the mean discount of positions 1 and 2
    assert ndcg(df) == pytest.approx((1 + D2) / 2)
    assert tie_rate(df) == pytest.approx(1 / 3)  # one of three response pairs is tied
    assert mean_gap(df) == pytest.approx(0.25)
    assert mean_gap_correct(df) == pytest.approx(0.5)
    assert uniformity_rate(df) == 0.0


def test_uniform_list():
    df = lists(UNIFORM)
    assert pairwise_accuracy(df) == 0.5
    assert listwise_accuracy(df) == 0.5
    assert ndcg(df) == pytest.approx((1 + D2) / 2)  # a constant scorer earns the expected DCG, not 1
    assert tie_rate(df) == 1.0
    assert uniformity_rate(df) == 1.0


def test_several_lists_pool_pairs_and_average_lists():
    df = lists(TIED_TOP, UNIFORM, NO_ORDER)
    metrics = evaluator_metrics(df)
    assert metrics["labelled_lists"] == 2  # NO_ORDER is not rankable
    assert metrics["labelled_pairs"] == 3
    assert metrics["pairwise_accuracy"] == pytest.approx((0.5 + 1 + 0.5) / 3)  # pooled over pairs
    assert metrics["listwise_accuracy"] == pytest.approx(0.5)  # mean over lists
    assert metrics["ndcg"] == pytest.approx((1 + D2) / 2)
    assert metrics["tie_rate"] == pytest.approx((1 + 1) / (3 + 1))
    assert metrics["uniformity_rate"] == pytest.approx(0.5)
    # The unrankable list changes nothing in the order metrics when passed directly.
    assert ndcg(df) == pytest.approx(ndcg(lists(TIED_TOP, UNIFORM)))
    assert listwise_accuracy(df) == pytest.approx(listwise_accuracy(lists(TIED_TOP, UNIFORM)))


def test_ranks_need_not_start_at_one_and_list_order_is_irrelevant():
    df = lists(("x", [2, 5, 3], [0.2, 0.0, 0.9]))  # the best (rank 2) is scored second
    assert listwise_accuracy(df) == 0.0
    assert pairwise_accuracy(df) == pytest.approx(2 / 3)  # (2,5) right, (2,3) wrong, (3,5) right
    # gains: 5−2=3, 0, 5−3=2; scorer order: rank 3 (gain 2), rank 2 (3), rank 5 (0)
    assert ndcg(df) == pytest.approx((2 + 3 * D2) / (3 + 2 * D2))
    shuffled = df.sample(frac=1.0, random_state=3)
    assert ndcg(shuffled) == pytest.approx(ndcg(df))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=2, max_size=7), st.lists(st.floats(0, 1), min_size=7, max_size=7))
def test_ordering_by_rank_is_perfect_and_ndcg_is_bounded(ranks, scores):
    df = pd.DataFrame(
        {"list_id": "l", "sample_idx": range(len(ranks)), "rank": ranks, "score": scores[: len(ranks)]}
    )
    if len(set(ranks)) < 2:
        assert math.isnan(ndcg(df)) and math.isnan(pairwise_accuracy(df))
        return
    assert 0.0 <= ndcg(df) <= 1.0 + 1e-12
    perfect = df.assign(score=-df["rank"].astype(float))
    assert pairwise_accuracy(perfect) == 1.0 and ndcg(perfect) == pytest.approx(1.0)


def test_bad_lists_are_named_errors():
    with pytest.raises(ValueError, match="missing column"):
        pairwise_accuracy(pd.DataFrame({"list_id": ["a"], "rank": [1]}))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        ndcg(lists(("a", [0, 1], [0.1, 0.2])))
    with pytest.raises(ValueError, match="duplicate"):
        tie_rate(pd.concat([lists(PERFECT), lists(PERFECT)]))


def test_pass_at_k_hand_values():
    n, c = [5, 5, 4, 3, 5], [2, 2, 0, 3, 4]
    np.testing.assert_allclose(pass_at_k(n, c, 1), [0.4, 0.4, 0.0, 1.0, 0.8])
    # 1 − C(3,2)/C(5,2) = 0.7; C(1,2) = 0 so one failure among five cannot fill two draws
    np.testing.assert_allclose(pass_at_k(n, c, 2), [0.7, 0.7, 0.0, 1.0, 1.0])
    assert pass_at_k([200], [1], 100)[0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k=4"):
        pass_at_k([3], [1], 4)
    with pytest.raises(ValueError, match="within 0..n"):
        pass_at_k([3], [4], 1)


def test_policy_metrics_and_win_rate():
    scored = pd.DataFrame(
        {
            "prompt_id": ["m0", "m0", "m1", "m1", "h0", "h0", "h1", "h1"],
            "task": ["basic_arithmetic"] * 4 + ["humaneval"] * 4,
            "sample_idx": [0, 1] * 4,
            "score": [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0],
        }
    )
    m = policy_metrics(scored, k=2)
    assert m["basic_arithmetic/avg_at_2"] == pytest.approx(0.25)
    assert m["humaneval/pass_at_1"] == pytest.approx(0.75)
    assert m["humaneval/pass_at_2"] == pytest.approx(1.0)
    assert m["accuracy"] == pytest.approx((0.5 + 0 + 0.5 + 1) / 4)
    assert "basic_arithmetic/pass_at_1" not in m
    current = pd.Series([0.9, 0.2, 0.5], index=["p0", "p1", "p2"])
    previous = pd.Series([0.5, 0.1, 0.8], index=["p2", "p0", "p1"])
    assert win_rate(current, previous) == pytest.approx((1 + 0 + 0.5) / 3)


def test_outcome_lists_rank_by_score():
    prompts = pd.DataFrame({"prompt_id": ["p", "q"], "prompt": ["P?", "Q?"]})
    scored = pd.DataFrame(
        {
            "prompt_id": ["p", "p", "p", "q", "q"],
            "sample_idx": [0, 1, 2, 0, 1],
            "response": ["a", "b", "c", "d", "e"],
            "score": [0.0, 1.0, 0.0, 0.0, 0.0],
        }
    )
    out = outcome_lists(scored, prompts)
    assert out["list_id"].tolist() == ["p", "p", "p", "q", "q"]
    assert out["rank"].tolist() == [2, 1, 2, 1, 1]  # q: all wrong, no order (skipped by the stage)
    assert out["prompt"].tolist() == ["P?"] * 3 + ["Q?"] * 2


# --------------------------------------------------------------------------------------------------
# Labelled files and the stage end to end on tiny-random
# --------------------------------------------------------------------------------------------------


def _write_labelled(tmp_path) -> list[str]:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"},
                {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."},
            ]
        )
    )
    nectar = tmp_path / "nectar.parquet"
    answers = [{"answer": "9", "model": "m", "rank": 1}, {"answer": "nine-ish", "model": "m", "rank": 2}]
    pd.DataFrame({"prompt": ["\n\nHuman: What is 3 * 3?\n\nAssistant:"], "answers": [answers]}).to_parquet(
        nectar
    )
    anchors = str(tmp_path / "anchors.parquet")
    write_artifact(
        anchors,
        "anchors",
        [
            {
                "list_id": "L",
                "sample_idx": i,
                "rank": r,
                "prompt": "Name a prime.",
                "response": t,
                "source": "hand",
            }
            for i, (r, t) in enumerate([(1, "7"), (2, "9"), (2, "10")])
        ],
    )
    return [str(pairs), str(nectar), anchors]


def test_accuracy_by_origin_splits_files_from_outcomes():
    lists = pd.DataFrame(
        {
            "list_id": ["file0:a", "file0:a", "file1:b", "file1:b", "outcomes:p", "outcomes:p"],
            "sample_idx": [0, 1, 0, 1, 0, 1],
            "rank": [1, 2, 1, 2, 1, 2],
            "score": [0.9, 0.1, 0.5, 0.5, 0.0, 1.0],  # right, tie, wrong
        }
    )
    tied_discount = (1 + 1 / math.log2(3)) / 2  # a tie shares the mean discount of its positions
    assert accuracy_by_origin(lists) == pytest.approx(
        {
            "pairwise_accuracy_labelled": 0.75,
            "pairwise_accuracy_outcomes": 0.0,
            "top1_accuracy_labelled": 0.75,  # the right list 1, the tied one half
            "ndcg_labelled": (1 + tied_discount) / 2,
        }
    )
    assert math.isnan(accuracy_by_origin(lists.iloc[:4])["pairwise_accuracy_outcomes"])


def test_load_labelled_detects_formats(tmp_path):
    pairs, nectar, anchors = _write_labelled(tmp_path)
    p = load_labelled(pairs)
    assert p["list_id"].nunique() == 2 and sorted(p["rank"]) == [1, 1, 2, 2]
    n = load_labelled(nectar)
    assert n["prompt"].iloc[0] == "What is 3 * 3?" and n["rank"].tolist() == [1, 2]
    a = load_labelled(anchors)
    assert a["rank"].tolist() == [1, 2, 2]
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": "x", "response": "y"}))
    with pytest.raises(ValueError, match="cannot tell the labelled-set format"):
        load_labelled(str(other))


def test_a_packaged_labelled_set_loads_by_name():
    """The local preset's labelled pairs ship with the package, so a run from any folder finds them."""
    pairs = load_labelled("dynamicrubric:local_pairs.jsonl")
    assert pairs["list_id"].nunique() == 16 and sorted(set(pairs["rank"])) == [1, 2]
    with pytest.raises(ValueError, match="no such labelled set"):
        load_labelled("dynamicrubric:nothing.jsonl")


def _eval_prompts(tmp_path) -> str:
    rg = tasks.load_prompts(["reasoning_gym:basic_arithmetic"], 2, split="eval", seed=0)
    he = tasks.load_prompts(["humaneval"], 1, split="eval", seed=0)
    uri = str(tmp_path / "eval_prompts.parquet")
    write_artifact(uri, "prompts", pd.concat([rg, he], ignore_index=True))
    return uri


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_evaluate_end_to_end(tmp_path):
    cfg = load_config(
        preset="tiny",
        overrides={
            "rollout": {"max_new_tokens": 8},
            "rubrics": {"max_new_tokens": 24},
            "evaluate": {"samples": 2, "sandbox_timeout_s": 5},
        },
    )
    labelled = _write_labelled(tmp_path)
    out = str(tmp_path / "metrics.parquet")
    plots = tmp_path / "plots"
    units_uri = str(tmp_path / "units.parquet")
    guard_uri, items_uri = str(tmp_path / "guard.parquet"), str(tmp_path / "items.parquet")
    result = run_evaluate(
        _eval_prompts(tmp_path),
        out,
        str(plots),
        cfg,
        policy="tiny-random",
        generator="tiny-random",
        verifier="tiny-random",
        previous_policy="tiny-random",
        labelled_uris=labelled,
        round_idx=1,
        out_units_uri=units_uri,
        out_guard_uri=guard_uri,
        out_items_uri=items_uri,
    )
    metrics = read_artifact(out, "metrics").to_pandas()
    assert set(metrics["stage"]) == {"evaluate"} and set(metrics["round"]) == {1}
    benchmarks = {"alpaca_eval", "arena_hard_v2", "writingbench"}  # the tiny preset's
    assert set(metrics["variant"]) == {
        "policy",
        "dynamic",
        "static",
        "pointwise",
        "guard",
        "items",
        *benchmarks,
    }
    (verdict,) = read_frame(guard_uri, "guard").to_dict("records")
    assert verdict["round"] == 1 and verdict["healthy"] == bool(result["guard/healthy"])
    assert verdict["policy"] == verdict["generator"] == "tiny-random"
    items = read_frame(items_uri, "item_usefulness")
    assert result["items/items"] == len(items) and set(items["round"]) <= {1}
    assert result == {
        f"{v}/{n}": x for v, n, x in metrics[["variant", "name", "value"]].itertuples(index=False)
    }

    assert result["policy/samples"] == 3 * 2
    for name in ["basic_arithmetic/avg_at_2", "humaneval/pass_at_1", "humaneval/pass_at_2", "accuracy"]:
        assert 0.0 <= result[f"policy/{name}"] <= 1.0
    # The previous policy is the same model with the same seed: identical responses, all ties.
    assert result["policy/win_rate"] == 0.5 and result["policy/win_rate_prompts"] == 3

    for variant in ["dynamic", "static", "pointwise"]:
        # 2 pairs + 1 Nectar list + 1 anchors list from the files, plus any list the outcomes gave
        assert result[f"{variant}/labelled_lists"] == 4 + result[f"{variant}/labelled_lists_outcomes"]
        assert result[f"{variant}/labelled_pairs"] >= 2 + 1 + 2
        for name in ["pairwise_accuracy", "listwise_accuracy", "ndcg", "tie_rate", "uniformity_rate"]:
            assert 0.0 <= result[f"{variant}/{name}"] <= 1.0
        assert 0.0 <= result[f"{variant}/pairwise_accuracy_labelled"] <= 1.0
    assert sorted(p.name for p in plots.glob("*.png")) == sorted(PLOT_NAMES)
    assert all(_is_png(plots / name) for name in PLOT_NAMES)

    # Every headline metric is the mean of its units: a study's intervals resample exactly these.
    units = read_artifact(units_uri, "units").to_pandas()
    assert set(units["round"]) == {1}
    mean = units.groupby(["variant", "measure"])["value"].mean()
    count = units.groupby(["variant", "measure"]).size()
    assert mean["policy", "avg_at_k"] == pytest.approx(result["policy/accuracy"])
    assert count["policy", "avg_at_k"] == 3
    assert mean["policy", "win"] == result["policy/win_rate"] and count["policy", "win"] == 3
    # The guard's numbers are the means of its units too; the same model on both sides changes nothing.
    for name in ("train", "gold"):
        assert mean["guard", f"{name}_current"] == pytest.approx(result[f"guard/{name}_score"])
        assert mean["guard", f"{name}_previous"] == pytest.approx(result[f"guard/{name}_score_previous"])
        assert result[f"guard/{name}_delta"] == 0.0
    assert mean["guard", "canary"] == pytest.approx(result["guard/canary_win_rate"])
    assert count["guard", "canary"] == result["guard/canaries"] > 0
    assert result["guard/healthy"] == 1.0 - result["guard/alarm"]
    configured = "pair_soft" if cfg.aggregate.soft else "pair_hard"
    for variant in ["dynamic", "static", "pointwise"]:
        assert mean[variant, configured] == pytest.approx(result[f"{variant}/pairwise_accuracy"])
        assert (
            count[variant, "pair_soft"] == count[variant, "pair_hard"] == result[f"{variant}/labelled_pairs"]
        )


def test_run_evaluate_without_labelled_lists_is_a_counted_skip(tmp_path, caplog):
    prompts = [
        {
            "prompt_id": f"u{i}",
            "task": "user",
            "prompt": f"Say the code word {i}.",
            "reference": f"zebra-quartz-{i}-unguessable",
            "meta": None,
        }
        for i in range(2)
    ]
    write_artifact(str(tmp_path / "p.parquet"), "prompts", prompts)
    cfg = load_config(
        preset="tiny",
        overrides={
            "rollout": {"max_new_tokens": 6},
            "evaluate": {"samples": 2, "variants": ["pointwise", "static"]},
        },
    )
    with caplog.at_level("WARNING", logger="dynamicrubric.evaluation.evaluate"):
        result = run_evaluate(
            str(tmp_path / "p.parquet"), str(tmp_path / "m.parquet"), str(tmp_path / "plots"), cfg
        )
    assert "no labelled list" in caplog.text
    assert result["policy/user/avg_at_2"] == 0.0
    assert "policy/win_rate" not in result  # no previous policy given
    for variant in ["pointwise", "static"]:
        assert result[f"{variant}/labelled_lists"] == 0
        assert result[f"{variant}/labelled_lists_skipped"] == 2  # both prompts: every sample wrong
        assert f"{variant}/pairwise_accuracy" not in result  # undefined, not a made-up number
    assert "dynamic/labelled_lists" not in result
    assert all(_is_png(tmp_path / "plots" / name) for name in PLOT_NAMES)


def test_plots_go_to_s3(s3_env):
    evaluated = {"pointwise": lists(PERFECT, TIED_TOP).assign(prompt="p", response="r", source="hand")}
    rows = [("pointwise", k, v) for k, v in evaluator_metrics(evaluated["pointwise"]).items()]
    metrics = pd.DataFrame(rows, columns=["variant", "name", "value"])
    uri = f"s3://{s3_env}/round1/plots"
    assert write_plots(uri, metrics, evaluated) == list(PLOT_NAMES)
    assert store.is_complete(uri)
    for name in PLOT_NAMES:
        assert store.read_bytes(store.folder_file(uri, name))[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_evaluate_holds_one_engine_at_a_time(tmp_path, monkeypatch):
    """Four roles on four model references: each is loaded once, and a model is freed before the next
    loads (at paper scale two vLLM engines cannot share a GPU)."""
    import shutil

    from dynamicrubric.evaluation import evaluate
    from dynamicrubric.infra.models import resolve_model

    refs = {}
    for role in ("previous", "generator"):
        refs[role] = str(tmp_path / role)
        shutil.copytree(resolve_model("tiny-random"), refs[role])
    live: list[str] = []
    events: list[tuple[str, int]] = []
    real_load = evaluate.load_engine

    def load(ref, cfg):  # the real engine, with its lifetime recorded
        engine = real_load(ref, cfg)
        close = engine.close

        def recorded_close() -> None:
            live.remove(ref)
            close()

        engine.close = recorded_close
        live.append(ref)
        events.append((ref, len(live)))
        return engine

    monkeypatch.setattr(evaluate, "load_engine", load)
    cfg = load_config(
        preset="tiny",
        overrides={
            "rollout": {"max_new_tokens": 8},
            "rubrics": {"max_new_tokens": 24},
            "evaluate": {"samples": 2, "sandbox_timeout_s": 5},
        },
    )
    result = run_evaluate(
        _eval_prompts(tmp_path),
        str(tmp_path / "metrics.parquet"),
        str(tmp_path / "plots"),
        cfg,
        policy="tiny-random",
        generator=refs["generator"],
        verifier="tiny-random",
        previous_policy=refs["previous"],
        labelled_uris=_write_labelled(tmp_path),
    )
    # the policy's and the previous policy's samples, P_0's and P_t's benchmark answers (both tiny-random
    # here: one load), the generator's rubrics, the verifier's judgments and the benchmarks' questions
    assert [ref for ref, _ in events] == [
        "tiny-random",
        refs["previous"],
        "tiny-random",
        refs["generator"],
        "tiny-random",
    ]
    assert max(n for _, n in events) == 1 and live == []  # never two at once, none left behind
    assert result["policy/win_rate_prompts"] == 3 and "dynamic/pairwise_accuracy" in result
