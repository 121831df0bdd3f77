"""The policy's reward function called directly on literal rows, as TRL calls it (tiny-random, CPU)."""

from __future__ import annotations

import json

import pytest

from dynamicrubric import sandbox
from dynamicrubric.config import load_config
from dynamicrubric.engines import load_engine
from dynamicrubric.tasks import load_prompts
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
