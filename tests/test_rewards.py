"""Both trainers' reward functions called directly on literal rows, as TRL calls them (tiny-random, CPU)."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pandas as pd
import pytest

from dynamicrubric import store
from dynamicrubric.engines import load_engine
from dynamicrubric.infra import sandbox
from dynamicrubric.infra.artifacts import read_frame
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.scoring.aggregate import AggregateError
from dynamicrubric.tasks import load_prompts
from dynamicrubric.training.generator_rewards import GeneratorRewards
from dynamicrubric.training.monitoring import metric_rows
from dynamicrubric.training.policy_reward import PolicyReward, drop_items, kept_items, length_correlation


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """K=4 completions each of one HumanEval and one arithmetic prompt (one right answer in each)."""
    he, arith = (
        load_prompts(["humaneval"], 1, "eval", 0).iloc[0],
        load_prompts(["reasoning_gym:basic_arithmetic"], 1, "eval", 0).iloc[0],
    )
    entry = json.loads(he["meta"])["entry_point"]
    responses = {
        he["prompt_id"]: [f"```python\n{he['reference']}```"] + [f"def {entry}(*a):\n    return None"] * 3,
        arith["prompt_id"]: [arith["reference"], "0", "no idea", "-1"],
    }
    return [
        {
            "prompt_id": row["prompt_id"], "prompt": row["prompt"], "response": text, "num_tokens": 8,
            "finish_reason": "stop", "task": row["task"], "reference": row["reference"], "meta": row["meta"],
        }
        for row in (he, arith)
        for text in responses[row["prompt_id"]]
    ]  # fmt: skip


def _reward(tmp_path, gpus: int) -> PolicyReward:
    cfg = load_config(
        preset="tiny",
        overrides={
            "judge": {"variant": "pointwise"},
            "pipeline": {"resources": {"train_policy": {"gpus": gpus}}},
        },
    )
    engine = load_engine("tiny-random", cfg.engine)
    return PolicyReward(
        cfg, steps_uri=str(tmp_path / f"steps-{gpus}"), round_idx=1, engines=lambda role, ref: engine
    )


def test_a_gpu_training_pod_runs_no_policy_code(tmp_path, rows, monkeypatch):
    """On GPUs train-policy leaves code prompts out of its outcome monitoring (counted), so no policy
    code runs in the training pod; on CPU the same call checks the code in the sandbox."""
    real_run, runs = sandbox._run, []
    monkeypatch.setattr(sandbox, "_run", lambda *a, **kw: runs.append(1) or real_run(*a, **kw))
    metrics = _reward(tmp_path, gpus=0).score(rows, step=1).metrics
    assert "rewards/unchecked_code_groups" not in metrics and runs  # the code ran, in the sandbox

    def no_code(*args, **kwargs):
        raise AssertionError("policy code ran in a GPU training pod")

    monkeypatch.setattr(sandbox, "_run", no_code)  # a tripwire: any sandbox run fails the test
    scores, metrics, _ = _reward(tmp_path, gpus=1).score(rows, step=1)
    assert metrics["rewards/unchecked_code_groups"] == 1
    assert len(scores) == len(rows) and all(s == s for s in scores)  # the rubric reward is unchanged


# --------------------------------------------------------------------------------------------------
# Called exactly as TRL's GRPOTrainer calls a reward function: the batch's prompts, completions and
# completion ids, every other dataset column as a keyword list, and the trainer's state.


def _as_trl_batch(rows: list[dict]) -> dict:
    return {
        "prompts": [[{"role": "user", "content": r["prompt"]}] for r in rows],
        "completions": [[{"role": "assistant", "content": r["response"]}] for r in rows],
        "completion_ids": [[7] * r["num_tokens"] for r in rows],
        "prompt_id": [r["prompt_id"] for r in rows],
        "prompt_text": [r["prompt"] for r in rows],
        "task": [r["task"] for r in rows],
        "reference": [r["reference"] for r in rows],
        "meta": [r["meta"] for r in rows],
        "trainer_state": SimpleNamespace(global_step=0),  # TRL's state before its first update
    }


def _counted_writes(monkeypatch) -> dict[str, int]:
    """How many times each file is written (the store's real write, counted)."""
    writes: dict[str, int] = {}
    real = store.write_bytes

    def counted(uri, data):
        writes[uri] = writes.get(uri, 0) + 1
        return real(uri, data)

    monkeypatch.setattr(store, "write_bytes", counted)
    return writes


def test_the_verifiable_reward_is_the_checker_outcome_and_each_artifact_is_written_once(
    tmp_path, rows, monkeypatch
):
    """judge.variant verifiable: each completion's reward is its checker outcome, exactly (the right
    HumanEval body and the reference answer 1, the others 0); the step's artifacts are written once
    each, every row stamped with the step."""
    cfg = load_config(preset="tiny", overrides={"judge": {"variant": "verifiable"}})
    writes = _counted_writes(monkeypatch)
    logged: dict[str, float] = {}
    reward = PolicyReward(cfg, steps_uri=str(tmp_path / "steps"), round_idx=1)
    scores = reward(**_as_trl_batch(rows), log_metric=lambda name, value: logged.update({name: value}))
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert reward.__name__ == "verifiable_score"  # TRL names the reward's metrics after it
    assert logged["rewards/failed_groups"] == 0 and logged["signal/tie_rate"] > 0
    step = tmp_path / "steps" / "step-00001"
    kinds = ("rollouts", "judgments", "scores", "rewards", "diagnostics", "metrics", "anchors")
    assert sorted(writes) == sorted([str(step / "calls.json")] + [str(step / f"{k}.parquet") for k in kinds])
    assert set(writes.values()) == {1}
    for kind in kinds[:-1]:  # anchors are the reference lists, no step of their own
        assert set(read_frame(str(step / f"{kind}.parquet"), kind)["step"]) == {1}, kind
    judgments = read_frame(str(step / "judgments.parquet"), "judgments")
    assert judgments["p_yes"].tolist() == scores  # the checker as a one-item judge


def test_the_generator_rewards_score_literal_rubrics(tmp_path, monkeypatch):
    """Two rubric samples for one candidate set, as TRL hands them to r_disc and r_anchor: a rubric
    that does not parse splits nothing (R_disc exactly 0); R_anchor is None for a set without a
    reference ranking and a number for one with it; r_anchor reuses r_disc's judging of the batch."""
    cfg = load_config(preset="tiny", overrides={"rubrics": {"constrained": False}})
    engine = load_engine("tiny-random", cfg.engine)
    judged = []
    real_judge = engine.yes_probability
    monkeypatch.setattr(engine, "yes_probability", lambda *a, **kw: judged.append(1) or real_judge(*a, **kw))
    rewards = GeneratorRewards(
        cfg, steps_uri=str(tmp_path / "steps"), round_idx=1, engines=lambda r, ref: engine
    )
    r_disc, r_anchor = rewards.functions
    rubric = json.dumps([{"criterion": "States the final number", "weight": 5},
                         {"criterion": "Shows the working", "weight": 2}])  # fmt: skip
    responses = ["12", "The sum is 12 because 5 + 7 = 12.", "13", "I do not know"]
    batch = {
        "prompts": [[{"role": "user", "content": "write a rubric"}]] * 4,
        "completions": [[{"role": "assistant", "content": c}] for c in (rubric, "no rubric here") * 2],
        "completion_ids": [[7] * 10] * 4,
        "prompt_id": ["ranked", "ranked", "unranked", "unranked"],
        "generator_prompt": ["write a rubric"] * 4,
        "set_prompt": ["What is 5 + 7?"] * 4,
        "responses": [responses] * 4,
        "sample_idx": [[0, 1, 2, 3]] * 4,
        "anchor_ranks": [[1, 1, 2, 2]] * 2 + [[]] * 2,
        "trainer_state": SimpleNamespace(global_step=0),
    }
    disc = r_disc(**batch)
    anchor = r_anchor(**batch)
    assert len(judged) == 1  # one judging pass for both rewards
    assert disc[1] == disc[3] == 0.0  # the unparsed samples have no items to split the responses
    assert anchor[2] is None and anchor[3] is None  # the unranked set
    assert anchor[0] is not None
    step = tmp_path / "steps" / "step-00001"
    rubrics = read_frame(str(step / "rubrics.parquet"), "rubrics")
    assert rubrics["parse_status"].tolist() == ["json", "empty", "json", "empty"]
    stored = read_frame(str(step / "rewards.parquet"), "rewards").sort_values(["prompt_id", "rubric_idx"])
    assert stored["r_disc"].tolist() == [disc[0], disc[1], disc[2], disc[3]]


# --------------------------------------------------------------------------------------------------
# Rubric item dropout (judge.item_dropout) and length bias (rewards/length_corr)


def _literal_rubrics(items_per_rubric: list[int], prompt_ids: list[str], samples: int) -> pd.DataFrame:
    """Rubrics of the given sizes (cycled), `samples` per prompt, weights 1..5 in turn."""
    sizes = iter(items_per_rubric * len(prompt_ids) * samples)
    return pd.DataFrame(
        [
            {"prompt_id": pid, "rubric_idx": g, "variant": "dynamic", "generator": "tiny-random",
             "generator_prompt": "write a rubric", "completion": "{}", "finish_reason": "stop",
             "parse_status": "json",
             "items": [{"text": f"Criterion {m} of {pid}/{g}", "weight": 1 + (m + g) % 5} for m in range(next(sizes))]}
            for pid in prompt_ids
            for g in range(samples)
        ]
    )  # fmt: skip


def test_item_dropout_keeps_a_seeded_share_of_each_rubric():
    """Half of each 4-item rubric is kept; the subset is drawn per (seed, round, step, prompt, rubric
    sample): the same when the step is scored again, another at the next step. A rubric of one item
    keeps it, an empty one stays empty, and an odd size keeps the share on average."""
    rubrics = _literal_rubrics([4], ["p0", "p1", "p2"], samples=3)
    kept, counts = drop_items(rubrics, 0.5, (0, 1, 1))
    assert [len(k) for k in kept["judged_items"]] == [2] * 9
    assert counts == {"judge/items_kept": 18, "judge/items_dropped": 18}
    assert kept["items"].tolist() == rubrics["items"].tolist()  # the items stay as written
    again, _ = drop_items(rubrics, 0.5, (0, 1, 1))
    assert again["judged_items"].tolist() == kept["judged_items"].tolist()  # a resumed run draws the same
    for other in ((0, 1, 2), (0, 2, 1), (1, 1, 1)):  # the next step, another round, another seed
        assert drop_items(rubrics, 0.5, other)[0]["judged_items"].tolist() != kept["judged_items"].tolist()
    assert len({tuple(k) for k in kept["judged_items"]}) > 1  # each rubric sample draws its own subset
    same, counts = drop_items(rubrics, 0.0, (0, 1, 1))
    assert same is rubrics and counts == {"judge/items_kept": 36, "judge/items_dropped": 0}

    small = drop_items(_literal_rubrics([1, 0, 2], ["p0"], samples=3), 0.9, (0, 1, 1))[0]
    assert small["judged_items"].map(len).tolist() == [1, 0, 1]  # never the last item of a rubric
    odd = [len(kept_items(3, 0.5, random.Random(i))) for i in range(2000)]
    assert set(odd) == {1, 2} and abs(sum(odd) / len(odd) - 1.5) < 0.05
    assert abs(sum(len(kept_items(3, 0.3, random.Random(i))) for i in range(2000)) / 2000 - 2.1) < 0.05


def test_the_verifier_judges_only_the_kept_items_and_its_calls_halve(tmp_path):
    """V (tiny-random, its questions counted as it answers them) is asked half as many questions at
    item_dropout 0.5, the same kept items for every response of a group; the score is Σ w·v / Σ w over
    the kept items with their weights as written, and the artifacts validate and aggregate again."""
    from dynamicrubric.infra.artifact_kinds import ArtifactError
    from dynamicrubric.infra.artifacts import write_artifact
    from dynamicrubric.scoring.aggregate import aggregate
    from dynamicrubric.scoring.judge import judge_rollouts

    cfg = load_config(preset="tiny")
    engine = load_engine("tiny-random", cfg.engine)
    asked: list[int] = []
    real = engine.yes_probability

    def counted(pairs, *args, **kwargs):
        asked.append(len(pairs))
        return real(pairs, *args, **kwargs)

    engine.yes_probability = counted
    rollouts = pd.DataFrame(
        [{"prompt_id": p, "sample_idx": i, "prompt": f"Task {p}", "response": f"response {i} to {p}",
          "num_tokens": 3, "finish_reason": "stop", "policy": "tiny-random", "seed": 0}
         for p in ("p0", "p1") for i in range(4)]
    )  # fmt: skip
    rubrics = _literal_rubrics([4, 6], ["p0", "p1"], samples=2)
    full, _ = judge_rollouts(rollouts, rubrics, cfg, engine=engine)
    kept, _ = drop_items(rubrics, 0.5, (0, 1, 1))
    dropped, counts = judge_rollouts(rollouts, kept, cfg, engine=engine)
    assert asked[0] == full.num_rows == 4 * 2 * (4 + 6) and asked[1] == dropped.num_rows == asked[0] // 2
    judged = dropped.to_pandas()
    for row in kept.itertuples():
        mine = judged[(judged["prompt_id"] == row.prompt_id) & (judged["rubric_idx"] == row.rubric_idx)]
        for _, per_response in mine.groupby("sample_idx"):  # every response: exactly the kept items
            assert per_response["item_idx"].tolist() == list(row.judged_items)
            assert per_response["weight"].tolist() == [row.items[m]["weight"] for m in row.judged_items]

    scores = aggregate(judged, rollouts, kept).scores
    by_hand = (
        judged.assign(wv=judged["weight"] * judged["verdict"])
        .groupby(["prompt_id", "rubric_idx", "sample_idx"])[["wv", "weight"]]
        .sum()
    )
    merged = scores.set_index(["prompt_id", "rubric_idx", "sample_idx"]).join(by_hand)
    assert (merged["score"] - merged["wv"] / merged["weight"]).abs().max() < 1e-12
    # Without its judged_items the rubrics table says every item should have been judged.
    with pytest.raises(AggregateError, match="judgments cover"):
        aggregate(judged, rollouts, rubrics)
    write_artifact(str(tmp_path / "rubrics.parquet"), "rubrics", kept)  # valid under the contract
    bad = kept.assign(judged_items=[[5, 1]] + list(kept["judged_items"][1:]))
    with pytest.raises(ArtifactError, match="judged_items"):
        write_artifact(str(tmp_path / "bad.parquet"), "rubrics", bad)


def test_the_policy_reward_judges_a_seeded_subset_and_scores_the_same_on_a_rerun(tmp_path):
    """The policy's reward as TRL calls it (G and V tiny-random, two rubric samples a group): the step's
    rubrics keep every item and name the judged ones; the judgments hold exactly those, for every
    response; V's questions and the step's judgments fall to the kept items (its metrics say how many);
    each rubric sample read its own order; a fresh reward function scores the step identically."""
    from dynamicrubric.scoring.aggregate import run_aggregate

    cfg = load_config(
        preset="tiny", overrides={"judge": {"item_dropout": 0.5}, "rubrics": {"samples": 2}, "seed": 3}
    )
    prompts = load_prompts(["reasoning_gym:basic_arithmetic"], 2, "eval", 0)
    rows = [
        {"prompt_id": p.prompt_id, "prompt": p.prompt, "response": text, "num_tokens": 4, "finish_reason": "stop",
         "task": p.task, "reference": p.reference, "meta": p.meta}
        for p in prompts.itertuples()
        for text in (p.reference, "0", "I think it is 12", "-1")
    ]  # fmt: skip

    def score(steps: str) -> tuple[list, dict, list[int]]:
        engine = load_engine("tiny-random", cfg.engine)
        asked: list[int] = []
        real = engine.yes_probability
        engine.yes_probability = lambda pairs, *a, **kw: asked.append(len(pairs)) or real(pairs, *a, **kw)
        reward = PolicyReward(
            cfg, steps_uri=str(tmp_path / steps), round_idx=1, engines=lambda r, ref: engine
        )
        logged: dict[str, float] = {}
        values = reward(**_as_trl_batch(rows), log_metric=lambda name, value: logged.update({name: value}))
        return values, logged, asked

    values, logged, asked = score("steps")
    step = tmp_path / "steps" / "step-00001"
    rubrics = read_frame(str(step / "rubrics.parquet"), "rubrics")
    judgments = read_frame(str(step / "judgments.parquet"), "judgments")
    sizes = rubrics["items"].map(len)
    assert sizes.max() >= 2 and logged["judge/items_dropped"] > 0  # this seed's rubrics have items to drop
    kept = rubrics["judged_items"].map(len)
    for n, m in zip(sizes, kept, strict=True):  # half of each rubric left out, rounded either way; never all
        assert n - m in {min(n // 2, max(n - 1, 0)), min((n + 1) // 2, max(n - 1, 0))}, (n, m)
    assert logged["judge/items_kept"] == kept.sum() and logged["judge/items_dropped"] == (sizes - kept).sum()
    k = cfg.rollout.k
    assert sum(asked) == len(judgments) == k * kept.sum() == logged["signal/num_judgments"]
    for row in rubrics.itertuples():
        mine = judgments[
            (judgments["prompt_id"] == row.prompt_id) & (judgments["rubric_idx"] == row.rubric_idx)
        ]
        assert len(mine) == k * len(row.judged_items)
        assert all(sorted(g["item_idx"]) == list(row.judged_items) for _, g in mine.groupby("sample_idx"))
    # rubrics.shuffle: the two samples of a group read the responses in two orders
    assert rubrics.groupby("prompt_id")["generator_prompt"].nunique().tolist() == [2, 2]
    # `dynrubric stage aggregate` on the step's artifacts gives the step's scores
    out = {
        n: str(tmp_path / "again" / f"{n}.parquet") for n in ("scores", "rewards", "diagnostics", "metrics")
    }
    run_aggregate(str(step / "judgments.parquet"), str(step / "rollouts.parquet"), *out.values(),
                  rubrics_uri=str(step / "rubrics.parquet"))  # fmt: skip
    pd.testing.assert_frame_equal(
        read_frame(out["scores"], "scores"),
        read_frame(str(step / "scores.parquet"), "scores").drop(columns="step"),
    )

    again, logged_again, asked_again = score("rerun")
    assert (
        again == values
        and asked_again == asked
        and logged_again["judge/items_kept"] == logged["judge/items_kept"]
    )
    rerun = read_frame(str(tmp_path / "rerun" / "step-00001" / "rubrics.parquet"), "rubrics")
    assert rerun["judged_items"].map(list).tolist() == rubrics["judged_items"].map(list).tolist()


def test_length_correlation_per_step(tmp_path):
    """The step's length bias on a planted batch (the checker's exact 0/1 rewards, planted lengths):
    the mean over groups of corr(reward, length), groups with constant reward or length left out."""
    prompts = load_prompts(["reasoning_gym:basic_arithmetic"], 4, "eval", 0)
    planted = [  # (responses, lengths): right answer = reference
        (lambda p: [p.reference, "0", "no", "-1"], [10, 4, 6, 8]),  # rewards 1 0 0 0
        (lambda p: ["0", p.reference, "no", "-1"], [1, 2, 3, 4]),  # rewards 0 1 0 0
        (lambda p: ["0", "no", "-1", "x"], [1, 5, 9, 13]),  # constant reward: left out
        (lambda p: [p.reference, p.reference, "0", "no"], [7, 7, 7, 7]),  # constant length: left out
    ]
    rows = [
        {"prompt_id": p.prompt_id, "prompt": p.prompt, "response": text, "num_tokens": n, "finish_reason": "stop",
         "task": p.task, "reference": p.reference, "meta": p.meta}
        for p, (responses, lengths) in zip(prompts.itertuples(), planted, strict=True)
        for text, n in zip(responses(p), lengths, strict=True)
    ]  # fmt: skip
    cfg = load_config(preset="tiny", overrides={"judge": {"variant": "verifiable"}})
    reward = PolicyReward(cfg, steps_uri=str(tmp_path / "steps"), round_idx=1)
    logged: dict[str, float] = {}
    scores = reward(**_as_trl_batch(rows), log_metric=lambda name, value: logged.update({name: value}))
    assert scores[:8] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    # corr([1,0,0,0], [10,4,6,8]) = 3/√15 and corr([0,1,0,0], [1,2,3,4]) = −0.5/√3.75, by hand
    expected = (3 / 15**0.5 - 0.5 / 3.75**0.5) / 2
    assert logged["rewards/length_corr"] == pytest.approx(expected, abs=1e-12)
    assert logged["rewards/length_corr_groups"] == 2
    # TRL's log row keeps it under its own name, the way to the step's metrics artifact and MLflow
    entry = {"step": 1, "loss": 0.0, **logged}
    names = {r["name"]: r["value"] for r in metric_rows([entry], "train-policy", 1, "verifiable")}
    assert names["rewards/length_corr"] == logged["rewards/length_corr"]

    flat = [dict(r, num_tokens=5) for r in rows]  # every length equal: no group has a correlation
    logged.clear()
    reward(**_as_trl_batch(flat), log_metric=lambda name, value: logged.update({name: value}))
    assert logged["rewards/length_corr_groups"] == 0 and "rewards/length_corr" not in logged  # NaN, not 0
    # a group without rewards (its scoring failed) is left out too
    corr, groups = length_correlation([1.0, None, 0.5, 0.5, 0.0, 1.0], [1, 2, 3, 4, 5, 6], 2)
    assert (corr, groups) == (pytest.approx(1.0), 1)
    assert math.isnan(length_correlation([1.0, None, 0.5, 0.5], [1, 2, 3, 4], 2)[0])
