"""The signal guard's actions in a whole pipeline under kfp.local: a planted policy games its reward from
a given round on (its trained checkpoints answer with a phrase a planted verifier likes, and the wrong
word), the round's guard fires, and with `guard.action` rollback the next round's trainers start from
the last healthy round's checkpoints (as MLflow's lineage shows), with `stop` no later round runs.

The policy, generator and verifier are stand-in engines in every task and training process
(tests/planted_engines.py, through DYNRUBRIC_TEST_ENGINES); the trainers still train the real
tiny-random model (TRL), and every other part of the run is the real one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dynamicrubric.engines import TEST_ENGINES_ENV
from dynamicrubric.infra import tracking
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.infra.models import resolve_model

PLANTED = Path(__file__).with_name("planted_engines.py")


def _scenario(tmp_path: Path, monkeypatch, hacked_from: int, **overrides) -> object:
    monkeypatch.chdir(tmp_path)
    for role in ("policy", "generator", "verifier"):
        shutil.copytree(resolve_model("tiny-random"), tmp_path / f"{role}-model")
    source = tmp_path / "codewords.jsonl"
    rows = [
        {
            "id": f"{split}{i}",
            "prompt": f"Say the code word {split}-word-{i}.",
            "reference": f"{split}-word-{i}",
            "split": split,
        }
        for split, n in (("train", 2), ("eval", 2))
        for i in range(n)
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv(TEST_ENGINES_ENV, str(PLANTED))
    monkeypatch.setenv(
        "DYNRUBRIC_TEST_SCENARIO",
        json.dumps(
            {
                "policy": "policy-model",
                "generator": "generator-model",
                "verifier": "verifier-model",
                "hacked_from": hacked_from,
            }
        ),
    )
    return load_config(
        preset="tiny",
        overrides={
            "models": {role: str(tmp_path / f"{role}-model") for role in ("policy", "generator", "verifier")},
            "data": {"sources": [str(source)], "num_prompts": 2, "eval_prompts": 2},
            "rollout": {"k": 2},
            "evaluate": {"samples": 2, "variants": ["dynamic"]},
            "train_evaluator": {"max_steps": 1, "prompts_per_step": 1, "per_device_train_batch_size": 2},
            "train_policy": {"max_steps": 1, "prompts_per_step": 1, "per_device_train_batch_size": 2},
            # canaries tie under this verifier, which likes only the policy's phrase: leave them out
            "guard": {"canary_max": 1.0, "bootstrap": 200, **overrides},
            "pipeline": {
                "shards": 1,
                "pipeline_root": str(tmp_path / "runs"),
                "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            },
        },
    )


def _stage_runs(cfg, parent: str) -> dict[tuple[int, str], object]:
    runs = tracking.stage_runs_by_round(cfg, parent)
    return {(t, r.data.tags[tracking.STAGE_TAG]): r for t, stages in runs.items() for r in stages}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_hacked_round_is_rolled_back_and_the_next_round_starts_from_the_last_healthy_one(
    tmp_path, monkeypatch
):
    from dynamicrubric.localrun.launch import run_local

    cfg = _scenario(tmp_path, monkeypatch, hacked_from=2, action="rollback")
    cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"rounds": 3})})
    result = run_local(cfg)
    runs = _stage_runs(cfg, result.parent_run_id)

    alarms = {t: runs[(t, "evaluate")].data.metrics["guard/alarm"] for t in (1, 2, 3)}
    assert alarms == {1: 0.0, 2: 1.0, 3: 1.0}  # P_2 and P_3 game the reward: their rounds fire
    assert runs[(2, "evaluate")].data.metrics["guard/alarm_hacking"] == 1
    assert (
        runs[(2, "evaluate")].data.tags["guard.alarm"].startswith("fired (hacking): the training score rose")
    )
    parent = tracking.configured_mlflow(cfg).MlflowClient().get_run(result.parent_run_id)
    assert parent.data.tags["guard.round-1"] == "quiet" and parent.data.tags["guard.round-2"].startswith(
        "fired"
    )
    assert (
        runs[(1, "rollback")].data.metrics["healthy"] == 1
        and runs[(2, "rollback")].data.metrics["healthy"] == 0
    )

    # Round 2 started from round 1's checkpoints (healthy); round 3 too (round 2's were rolled back).
    def trained(t: int, stage: str, out: str) -> str:
        return runs[(t, stage)].data.params[out]

    p1, g1 = trained(1, "train-policy", "out_policy"), trained(1, "train-evaluator", "out_generator")
    p2, g2 = trained(2, "train-policy", "out_policy"), trained(2, "train-evaluator", "out_generator")
    assert len({p1, p2, g1, g2}) == 4
    for t in (2, 3):
        assert runs[(t, "train-policy")].data.params["policy"] == p1, t
        assert runs[(t, "train-evaluator")].data.params["generator"] == g1, t
        assert runs[(t, "evaluate")].data.params["previous_policy"] == p1, t
    assert runs[(3, "train-policy")].data.params["policy"] != p2
    # the chain of models MLflow records: the start of round 3 is round 1's policy
    assert tracking.find_model_uri(cfg, result.run_name, "policy-start-round-3") == p1
    assert tracking.find_model_uri(cfg, result.run_name, "generator-start-round-2") == g1


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_stop_action_runs_no_round_after_a_fired_guard(tmp_path, monkeypatch):
    from dynamicrubric.localrun.launch import run_local

    cfg = _scenario(tmp_path, monkeypatch, hacked_from=1, action="stop")
    result = run_local(cfg)
    runs = _stage_runs(cfg, result.parent_run_id)
    assert runs[(1, "evaluate")].data.metrics["guard/alarm_hacking"] == 1
    assert {t for t, _ in runs} == {0, 1}, sorted(runs)  # round 2 never started
