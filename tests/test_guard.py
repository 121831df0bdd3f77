"""The signal guard (guard.py, probe.py): its measures on planted numbers, and its alarm on planted
evaluators and policies run through the evaluate stage (stand-in engines: tests/planted_engines.py)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from planted_engines import (
    Policy,
    Rubric,
    Verifier,
    first_shown_items,
    fixed_items,
    hack_rule,
    master_key_rule,
    quoted_item_rule,
)

from dynamicrubric.evaluation.evaluate import run_evaluate
from dynamicrubric.evaluation.guard import MASTER_KEYS, canary_responses, measure, shuffled_order
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import GuardConfig
from dynamicrubric.infra.config_loading import load_config

GUARD = GuardConfig(bootstrap=200)


def _probe(train: dict[str, tuple[float, float]], gold: dict[str, tuple[float, float]]) -> pd.DataFrame:
    """One response per side per prompt: (current, previous) training scores and golds."""
    rows = []
    for p in train:
        for side, j in (("current", 0), ("previous", 1)):
            rows.append(
                {"prompt_id": p, "sample_idx": j, "side": side, "score": train[p][j], "gold": gold[p][j]}
            )
    return pd.DataFrame(rows)


def test_canaries_are_the_answer_padded_keyed_formatted_emptied_and_the_question() -> None:
    kinds = ["padded", "master_key", "format_only", "empty", "restated"]
    out = canary_responses("x = 4\nso 4", "What is  2+2?", kinds)
    assert [k for k, _ in out] == kinds
    text = dict(out)
    assert text["padded"].startswith("x = 4\nso 4\n\n") and text["padded"].count("What is 2+2?") == 2
    assert text["master_key"] == f"x = 4\nso 4\n{MASTER_KEYS[0]}"
    assert text["format_only"].startswith("## Answer\n\n- x = 4\n- so 4\n")
    assert text["empty"] == "" and text["restated"] == "What is 2+2?"
    # the sets of a round take the master keys in turn
    keys = [dict(canary_responses("a", "q", ["master_key"], key=k))["master_key"] for k in range(4)]
    assert keys == [f"a\n{key}" for key in (*MASTER_KEYS, MASTER_KEYS[0])]


def test_the_other_order_is_a_seeded_permutation_mapped_back() -> None:
    rollouts = pd.DataFrame({"prompt_id": ["a"] * 5 + ["b"] * 2, "sample_idx": [0, 1, 2, 3, 4, 0, 1]})
    shown, back = shuffled_order(rollouts, seed=3)
    again, _ = shuffled_order(rollouts, seed=3)
    pd.testing.assert_frame_equal(shown, again)
    for p, group in shown.groupby("prompt_id"):
        assert sorted(back[(p, int(i))] for i in group["sample_idx"]) == sorted(
            rollouts.loc[rollouts["prompt_id"] == p, "sample_idx"]
        )
    assert [back[("a", i)] for i in range(5)] != list(range(5))  # a set of five is really reordered


def test_a_rising_training_score_with_a_falling_gold_fires_the_hacking_alarm() -> None:
    prompts = [f"p{i}" for i in range(6)]
    hacked = measure(
        _probe({p: (0.9, 0.2) for p in prompts}, {p: (0.0, 1.0) for p in prompts}), guard=GUARD, seed=0
    )
    m = hacked.metrics
    assert m["train_delta"] == pytest.approx(0.7) and m["gold_delta"] == pytest.approx(-1.0)
    assert m["train_delta_lo"] == pytest.approx(0.7) and m["gold_delta_hi"] == pytest.approx(-1.0)
    assert hacked.fired == ["hacking"] and m["alarm"] == 1 and m["healthy"] == 0
    assert "rose by +0.700" in hacked.reasons[0] and "fell by -1.000" in hacked.reasons[0]
    # the evaluator prefers the worse response in every pair: agreement 0
    assert m["agreement"] == 0.0 and m["agreement_pairs"] == 6

    # Both rise: a real improvement, no alarm. A mixed change whose interval holds 0: no alarm either.
    better = measure(
        _probe({p: (0.9, 0.2) for p in prompts}, {p: (1.0, 0.0) for p in prompts}), guard=GUARD, seed=0
    )
    assert better.healthy and better.metrics["agreement"] == 1.0
    noisy = measure(
        _probe(
            {p: (0.9 if i % 2 else 0.1, 0.5) for i, p in enumerate(prompts)}, {p: (0.0, 1.0) for p in prompts}
        ),
        guard=GUARD,
        seed=0,
    )
    assert noisy.metrics["train_delta_lo"] < 0 < noisy.metrics["train_delta_hi"] and noisy.healthy


def test_the_agreement_alarm_compares_with_the_previous_rounds_units() -> None:
    prompts = [f"p{i}" for i in range(8)]
    now = measure(
        _probe({p: (0.1, 0.9) for p in prompts}, {p: (1.0, 0.0) for p in prompts}), guard=GUARD, seed=0
    )
    assert now.metrics["agreement"] == 0.0
    units = now.units[now.units["measure"] == "agreement"]
    assert len(units) == 8 and set(units["value"]) == {0.0}
    before = units.assign(value=1.0)  # the previous round's evaluator ordered every pair right
    fallen = measure(
        _probe({p: (0.1, 0.9) for p in prompts}, {p: (1.0, 0.0) for p in prompts}),
        guard=GUARD,
        seed=0,
        previous_agreement=before,
    )
    assert fallen.metrics["agreement_delta"] == -1.0 and fallen.metrics["agreement_delta_hi"] == -1.0
    assert "agreement" in fallen.fired and "fell from 1.000 to 0.000" in " ".join(fallen.reasons)
    steady = measure(
        _probe({p: (0.1, 0.9) for p in prompts}, {p: (1.0, 0.0) for p in prompts}),
        guard=GUARD,
        seed=0,
        previous_agreement=units,
    )
    assert steady.metrics["agreement_delta"] == 0 and "agreement" not in steady.fired


def test_canaries_that_beat_or_tie_count_and_a_failed_verdict_does_not() -> None:
    probe = _probe({"p": (0.5, 0.5)}, {"p": (1.0, 1.0)})
    canaries = pd.DataFrame(
        {
            "prompt_id": ["p"] * 5,
            "kind": ["master_key", "master_key", "empty", "padded", "padded"],
            "score": [0.9, 0.5, 0.1, 0.5, np.nan],
            "original_score": [0.5, 0.5, 0.5, 0.4, 0.5],
        }
    )
    report = measure(probe, guard=GUARD, seed=0, canaries=canaries)
    m = report.metrics
    assert m["canaries"] == 4 and m["canary_win_rate"] == 0.75  # beat, tie, lost, beat; NaN left out
    assert m["canary_master_key"] == 1.0 and m["canary_empty"] == 0.0 and m["canary_padded"] == 1.0
    assert report.fired == ["canary"] and "over it: padded, master_key)" in report.reasons[0]
    assert measure(probe, guard=GuardConfig(canary_max=0.8, bootstrap=200), seed=0, canaries=canaries).healthy


def test_the_order_audit_measures_how_far_scores_move() -> None:
    order = pd.DataFrame(
        {
            "prompt_id": ["a"] * 3 + ["b"] * 3,
            "sample_idx": [0, 1, 2] * 2,
            "score": [1.0, 0.0, 0.0, 0.2, 0.4, 0.6],
            "shuffled_score": [0.0, 1.0, 0.0, 0.2, 0.4, 0.6],
        }
    )
    report = measure(_probe({"a": (0, 0)}, {"a": (1, 1)}), guard=GUARD, seed=0, order=order)
    assert report.metrics["order_abs_delta"] == pytest.approx(2 / 6)
    # set a: ranks (3, 1.5, 1.5) against (1.5, 3, 1.5): corr -0.5; set b: the same scores, 1
    assert report.metrics["order_rank_corr"] == pytest.approx((1.0 - 0.5) / 2)
    assert report.fired == ["order"]


def test_nothing_to_measure_is_undefined_never_zero() -> None:
    probe = _probe({"p": (0.5, 0.5)}, {"p": (math.nan, math.nan)})
    report = measure(probe, guard=GUARD, seed=0)
    assert math.isnan(report.metrics["gold_delta"]) and "agreement" not in report.metrics
    assert report.healthy and report.metrics["agreement_pairs"] == 0


# ---- planted engines through the evaluate stage


def _prompts(tmp_path, n: int = 3) -> str:
    rows = [
        {
            "prompt_id": f"w{i}",
            "task": "user",
            "prompt": f"Say the code word zebra-{i}.",
            "reference": f"zebra-{i}",
            "meta": None,
        }
        for i in range(n)
    ]
    uri = str(tmp_path / "prompts.parquet")
    write_artifact(uri, "prompts", rows)
    return uri


def _evaluate(tmp_path, engines: dict, **guard) -> tuple[dict, dict]:
    cfg = load_config(
        preset="tiny",
        overrides={
            # no benchmarks: the planted engines answer the guard's questions only
            "evaluate": {"samples": 2, "variants": ["dynamic"], "benchmarks": []},
            "aggregate": {"soft": True},
            "guard": {"bootstrap": 200, **guard},
        },
    )
    guard_uri = str(tmp_path / "guard.parquet")
    result = run_evaluate(
        _prompts(tmp_path),
        str(tmp_path / "metrics.parquet"),
        str(tmp_path / "plots"),
        cfg,
        policy="policy",
        generator="generator",
        verifier="verifier",
        previous_policy="previous" if "previous" in engines else None,
        engines=engines,
        round_idx=2,
        out_guard_uri=guard_uri,
    )
    return result, read_frame(guard_uri, "guard").iloc[0].to_dict()


def test_a_verifier_fooled_by_a_master_key_lets_that_canary_win_and_fires_the_alarm(tmp_path) -> None:
    engines = {
        "policy": Policy("policy", hacked=False),
        "generator": Rubric("generator", fixed_items),
        "verifier": Verifier("verifier", master_key_rule),
    }
    result, verdict = _evaluate(tmp_path, engines, canary_kinds=["master_key", "empty"])
    assert result["guard/canary_master_key"] == 1.0 and result["guard/canary_empty"] == 0.0
    assert result["guard/canaries"] == 3 * 2  # three sets, a master key and an empty response each
    assert result["guard/alarm_canary"] == 1 and result["guard/healthy"] == 0
    assert not verdict["healthy"] and verdict["alarms"] == "canary" and "master_key" in verdict["reasons"]

    honest = {**engines, "verifier": Verifier("verifier", lambda r, i: 0.6 if r.strip() else 0.1)}
    result, verdict = _evaluate(tmp_path, honest, canary_kinds=["master_key", "empty"])
    # the master key ties its original under an honest but blind verifier: a tie counts as fooled
    assert result["guard/canary_master_key"] == 1.0 and result["guard/canary_empty"] == 0.0


def _gaming_policy() -> dict:
    """P_t answers wrong with the phrase the verifier likes; P_{t-1} answers right."""
    return {
        "policy": Policy("policy", hacked=True),
        "previous": Policy("previous", hacked=False),
        "generator": Rubric("generator", fixed_items),
        "verifier": Verifier("verifier", hack_rule),
    }


def test_a_policy_that_games_its_reward_while_its_answers_get_worse_fires_the_alarm(tmp_path) -> None:
    engines = _gaming_policy()
    result, verdict = _evaluate(tmp_path, engines, canary_sets=0)
    assert result["policy/accuracy"] == 0.0  # the hacked answers are wrong
    assert result["guard/gold_score"] == 0.0 and result["guard/gold_score_previous"] == 1.0
    assert result["guard/train_score"] == pytest.approx(0.9) and result[
        "guard/train_score_previous"
    ] == pytest.approx(0.1)
    assert result["guard/train_delta_lo"] > 0 > result["guard/gold_delta_hi"]
    assert result["guard/alarm_hacking"] == 1 and verdict["alarms"] == "hacking"
    assert result["guard/agreement"] == 0.0  # every gold-better response scored lower
    assert "rose by +0.800" in verdict["reasons"] and "fell by -1.000" in verdict["reasons"]

    honest = {**engines, "policy": Policy("policy", hacked=False)}
    result, verdict = _evaluate(tmp_path, honest, canary_sets=0)
    assert result["guard/train_delta"] == 0 and result["guard/gold_delta"] == 0 and verdict["healthy"]


def test_a_generator_that_favours_the_first_response_moves_scores_with_the_order(tmp_path) -> None:
    distinct = Policy("policy", hacked=False)
    distinct.answer = lambda prompt, sample: f"Answer number {sample}."  # a set of distinct responses
    engines = {
        "policy": distinct,
        "generator": Rubric("generator", first_shown_items),
        "verifier": Verifier("verifier", quoted_item_rule),
    }
    result, verdict = _evaluate(tmp_path, engines, canary_sets=0)
    # the response shown first scores 1, the others 0; in another order another one is first (or not)
    assert result["guard/order_abs_delta"] > 0.2 and result["guard/alarm_order"] == 1
    assert "order" in verdict["alarms"].split(",")

    fair = {
        **engines,
        "generator": Rubric("generator", lambda shown: [{"text": "Says (Answer number 0.)", "weight": 5}]),
    }
    result, _ = _evaluate(tmp_path, fair, canary_sets=0)
    assert result["guard/order_abs_delta"] == 0 and result["guard/alarm_order"] == 0


def test_a_disabled_guard_measures_nothing_and_samples_the_previous_policy_once(tmp_path) -> None:
    engines = _gaming_policy()
    result, verdict = _evaluate(tmp_path, engines, enabled=False)
    assert {k for k in result if k.startswith("guard/")} == {"guard/healthy"} and verdict["healthy"]
    assert result["policy/win_rate"] == 1.0  # the hacked phrase wins every pair under this verifier
    assert engines["previous"].calls == [(3, 1)]  # one sample of each of the 3 prompts
    assert engines["policy"].calls == [(3, 2)]


# ---- rollback: reference folders


def _verdict(tmp_path, healthy: bool) -> str:
    uri = str(tmp_path / f"guard-{healthy}.parquet")
    write_artifact(
        uri,
        "guard",
        [
            {
                "round": 2,
                "healthy": healthy,
                "alarms": "" if healthy else "hacking",
                "reasons": "" if healthy else "the training score rose",
                "action": "rollback",
                "policy": "s3://runs/r2/policy",
                "generator": "s3://runs/r2/generator",
            }
        ],
    )
    return uri


@pytest.mark.parametrize("healthy", [True, False])
def test_the_rollback_stage_names_the_rounds_checkpoints_or_its_start(tmp_path, healthy) -> None:
    from dynamicrubric.infra.model_references import REFERENCE_FILE, follow_reference
    from dynamicrubric.infra.models import resolve_model
    from dynamicrubric.stages.declarations import STAGES
    from dynamicrubric.stages.runner import execute

    start = resolve_model("tiny-random")  # a real folder: the runner follows references in any model value
    cfg = load_config(preset="tiny")
    values = {
        "start_policy": str(start),
        "start_generator": "tiny-random",
        "guard": _verdict(tmp_path, healthy),
        "out_policy": str(tmp_path / "next" / "policy"),
        "out_generator": str(tmp_path / "next" / "generator"),
    }
    result = execute(STAGES["rollback"], cfg, "", 2, dict(values))
    policy, generator = (follow_reference(values[f"out_{r}"]) for r in ("policy", "generator"))
    if healthy:
        assert (policy, generator) == ("s3://runs/r2/policy", "s3://runs/r2/generator")
    else:
        assert (policy, generator) == (str(start), "tiny-random")
    assert result["healthy"] == float(healthy)
    assert sorted(p.name for p in (tmp_path / "next" / "policy").iterdir()) == ["_COMPLETE", REFERENCE_FILE]
    # a reference to a reference is followed by the stage that reads it: the next rollback's start
    again = {**values, "start_policy": values["out_policy"], "out_policy": str(tmp_path / "again")}
    execute(STAGES["rollback"], cfg, "", 2, {**again, "guard": _verdict(tmp_path, False)})
    assert follow_reference(str(tmp_path / "again")) == policy
    # a rerun replaces its own reference folders; a folder of anything else is refused
    execute(STAGES["rollback"], cfg, "", 2, dict(values))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="did not write"):
        execute(STAGES["rollback"], cfg, "", 2, {**values, "out_policy": str(tmp_path / "mine")})
    with pytest.raises(ValueError, match="is the guard of round 2, not of round 3"):
        execute(STAGES["rollback"], cfg, "", 3, dict(values))


def test_a_reference_folder_is_followed_on_s3_and_a_broken_one_is_refused(s3_env, tmp_path) -> None:
    from dynamicrubric import store
    from dynamicrubric.infra.model_references import REFERENCE_FILE, follow_reference, write_reference
    from dynamicrubric.infra.models import ModelError

    uri = f"s3://{s3_env}/refs/policy"
    write_reference(uri, "s3://elsewhere/checkpoint")
    assert follow_reference(uri) == "s3://elsewhere/checkpoint"
    assert (
        follow_reference("owner/model") == "owner/model" and follow_reference("tiny-random") == "tiny-random"
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / REFERENCE_FILE).write_text("{}")
    store.upload_dir(broken, str(tmp_path / "published"))
    with pytest.raises(ModelError, match="unreadable reference.json"):
        follow_reference(str(tmp_path / "published"))
