"""Both trainers' reward functions called directly on literal rows, as TRL calls them (tiny-random, CPU)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dynamicrubric import sandbox, store
from dynamicrubric.artifacts import read_frame
from dynamicrubric.config import load_config
from dynamicrubric.engines import load_engine
from dynamicrubric.tasks import load_prompts
from dynamicrubric.training.generator_rewards import GeneratorRewards
from dynamicrubric.training.policy_reward import PolicyReward


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
    _, metrics = _reward(tmp_path, gpus=0).score(rows, step=1)
    assert "rewards/unchecked_code_groups" not in metrics and runs  # the code ran, in the sandbox

    def no_code(*args, **kwargs):
        raise AssertionError("policy code ran in a GPU training pod")

    monkeypatch.setattr(sandbox, "_run", no_code)  # a tripwire: any sandbox run fails the test
    scores, metrics = _reward(tmp_path, gpus=1).score(rows, step=1)
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
