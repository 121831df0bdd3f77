"""The study script of docs/results.md: its configs stay valid, its intervals are computed from the
units the stages wrote, and a (tiny) variant runs end to end through the real pipeline."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from bench import study
from dynamicrubric import tasks
from dynamicrubric.infra.artifacts import write_artifact
from dynamicrubric.infra.config_loading import preset_dict
from dynamicrubric.pipelines.run_plan import pipeline_variant


@pytest.mark.parametrize("variant", sorted(study.VARIANTS))
def test_study_config_runs_the_variant_it_names(variant, tmp_path):
    cfg = study.study_config(variant, tmp_path)
    assert pipeline_variant(cfg) == variant
    assert cfg.evaluate.variants == ([] if variant == "verifiable" else [variant])
    assert cfg.rollout.k == 8 and cfg.pipeline.rounds >= 2 and cfg.aggregate.soft
    assert cfg.models.policy == cfg.models.generator == cfg.models.verifier == "smollm2-135m-instruct"
    assert cfg.pipeline.mlflow_tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert cfg.data.eval_prompts * len(cfg.data.sources) >= 64  # held-out prompts for avg@k
    # the committed pairs are a labelled set the evaluate stage reads, and none is a held-out prompt
    pairs = tasks.load_pairs(cfg.data.labelled[0])
    assert pairs["list_id"].nunique() == sum(1 for _ in study.PAIRS.open()) >= study.MIN_PAIRS
    held_out = set(tasks.configured_prompts(cfg.data, "eval")["prompt"])
    assert not held_out & set(pairs["prompt"])


def _units(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["round", "variant", "measure", "unit_id", "value"])


def test_round_intervals_pair_rounds_on_the_same_units():
    units = _units(
        [(0, "policy", "avg_at_k", p, v) for p, v in [("a", 0.0), ("b", 0.25), ("c", 0.5)]]
        + [(1, "policy", "avg_at_k", p, v) for p, v in [("a", 0.25), ("b", 0.5), ("c", 0.5)]]
        + [(1, "policy", "win", "a", 1.0)]
        + [(0, "dynamic", "pair_soft", u, v) for u, v in [("file0:x|0>1", 0.0), ("outcomes:a|0>1", 1.0)]]
        + [(1, "dynamic", "pair_soft", u, v) for u, v in [("file0:x|0>1", 1.0), ("outcomes:b|1>0", 0.0)]]
    )
    out = study.round_intervals(units)
    assert set(out) == {"0", "1"}
    assert out["0"]["policy/avg_at_k"]["mean"] == 0.25 and out["1"]["policy/avg_at_k"]["n"] == 3
    assert out["1"]["Δr0/policy/avg_at_k"]["mean"] == pytest.approx(0.5 / 3)
    assert "Δr0/policy/win" not in out["1"]  # the win rate is against the previous round already
    # outcome-list pairs come from each round's own samples: accuracy and its change from round 0 are
    # over the labelled (file) pairs, the own-sample pairs are a measure of their own
    assert out["0"]["dynamic/pair_soft"] == {"mean": 0.0, "low": 0.0, "high": 0.0, "n": 1}
    assert out["1"]["dynamic/pair_soft_own"] == {"mean": 0.0, "low": 0.0, "high": 0.0, "n": 1}
    assert out["1"]["Δr0/dynamic/pair_soft"] == {"mean": 1.0, "low": 1.0, "high": 1.0, "n": 1}
    assert "Δr0/dynamic/pair_soft_own" not in out["1"]


def _diagnostics(path, rows: list[tuple]) -> str:
    frame = pd.DataFrame(
        [
            {
                "prompt_id": p,
                "rubric_idx": r,
                "num_responses": 4,
                "num_items": 2,
                "mean_score": 0.5,
                "mean_gap": gap,
                "tie_rate": tie,
                "uniform": uni,
                "mean_pass_rate": 0.5,
            }
            for p, r, gap, tie, uni in rows
        ]
    )
    write_artifact(str(path), "diagnostics", frame)
    return str(path)


def test_audit_intervals_per_label_and_the_paired_change(tmp_path):
    before = _diagnostics(tmp_path / "b.parquet", [("a", 0, 0.1, 0.5, False), ("b", 0, None, 1.0, True)])
    after = _diagnostics(
        tmp_path / "a.parquet",
        [("a", 0, 0.3, 0.25, False), ("a", 1, 0.1, 0.25, False), ("b", 0, 0.2, 0.5, False)],
    )
    index = [
        {"stage": "aggregate", "role": "audit-before", "round": 1, "outputs": {"diagnostics": [before]}},
        {"stage": "aggregate", "role": "audit-after", "round": 1, "outputs": {"diagnostics": [after]}},
        {"stage": "aggregate", "role": "policy", "round": 1, "outputs": {"diagnostics": ["/not/read"]}},
        {"stage": "evaluate", "role": "", "round": 1, "outputs": {"units": ["u1"], "metrics": ["m1"]}},
    ]
    outputs = study.task_outputs(index)
    assert outputs == {
        ("aggregate", "audit-before"): {1: before},
        ("aggregate", "audit-after"): {1: after},
        ("evaluate", ""): {1: "u1"},
    }
    out = study.audit_intervals(outputs)["1"]
    assert out["audit-before/tie_rate"]["mean"] == 0.75 and out["audit-before/uniform"]["mean"] == 0.5
    assert out["audit-before/mean_gap"]["n"] == 1  # a set without a reference ordering has no gap
    # per set, rubric samples are averaged: set a's gap is 0.2 after
    assert out["audit-after/mean_gap"]["mean"] == pytest.approx((0.2 + 0.2) / 2)
    assert out["after−before/tie_rate"]["mean"] == pytest.approx(((0.25 - 0.5) + (0.5 - 1.0)) / 2)
    assert out["after−before/mean_gap"]["n"] == 1


def test_step_curves_read_each_trainer_and_round(tmp_path):
    def metrics(path, values):
        frame = pd.DataFrame(
            [{"round": 1, "stage": "train-policy", "variant": "policy", "name": n, "step": s, "value": v}
             for n, s, v in values]
        )  # fmt: skip
        write_artifact(str(path), "metrics", frame)
        return str(path)

    uri = metrics(
        tmp_path / "m.parquet", [("reward_mean", 2, 0.5), ("reward_mean", 1, 0.25), ("loss", 1, 3.0)]
    )
    curves = study.step_curves({("train-policy", ""): {1: uri}})
    assert curves == {"train-policy": {"1": {"reward_mean": [0.25, 0.5]}}}
    # the time measurements come from the trainer's MLflow run (trainer_timings), not the artifact
    timed = study.step_curves(
        {("train-policy", ""): {1: uri}}, {("train-policy", 1): {"time/step_s": [9.0, 8.0]}}
    )
    assert timed == {"train-policy": {"1": {"reward_mean": [0.25, 0.5], "time/step_s": [9.0, 8.0]}}}


def _result(variant: str, avg: list[float], pairs: list[float]) -> dict:
    units = [[0, "policy", "avg_at_k", f"p{i}", 0.0] for i in range(len(avg))]
    units += [[1, "policy", "avg_at_k", f"p{i}", v] for i, v in enumerate(avg)]
    if variant != "verifiable":
        units += [[1, variant, "pair_soft", f"file0:l{i}|0>1", v] for i, v in enumerate(pairs)]
        units += [[1, variant, "pair_hard", f"file0:l{i}|0>1", 0.5] for i in range(len(pairs))]
        # a pair from the policy's own samples: not part of the labelled set's accuracy
        units += [
            [1, variant, "pair_soft", "outcomes:p0|1>0", 0.0],
            [1, variant, "pair_hard", "outcomes:p0|1>0", 0.0],
        ]
    frame = _units([tuple(u) for u in units])
    return {
        "variant": variant,
        "command": f"python -m bench.study run --variant {variant}",
        "config": {
            "rollout": {"k": 8},
            "pipeline": {"rounds": 1},
            "seed": 0,
            "train_evaluator": {"max_steps": 2},
            "train_policy": {"max_steps": 3},
        },
        "machine": {"cpu": "cpu", "cores": 2, "torch": "2.13.0"},
        "prompts": {"train_pool": 16, "held_out": len(avg), "labelled_pairs": len(pairs)},
        "round0": {"metrics": {"policy/accuracy": 0.0}, "wall_s": 60.0},
        "pipeline_wall_s": 600.0,
        "stages": [
            {
                "round": 1,
                "stage": "train-policy",
                "task": "train-policy",
                "seconds": 100.0,
                "metrics": {"kl": 0.1},
            }
        ],
        "evaluate": {"intervals": study.round_intervals(frame), "units": units},
        "audit": {"1": {"audit/tie_rate": {"mean": 0.5, "low": 0.25, "high": 0.75, "n": 4}}},
        "steps": {
            "train-policy": {
                "1": {
                    "reward_mean": [0.1, 0.2, 0.3],
                    "time/step_s": [10.0, 20.0, 30.0],
                    "time/generation_s": [1.0, 2.0, 3.0],
                    "time/update_s": [5.0, 5.0, 5.0],
                }
            }
        },
    }


def test_report_tables_carry_intervals_and_paired_differences(tmp_path):
    results = [_result("dynamic", [0.5, 1.0], [1.0, 0.0]), _result("verifiable", [0.25, 0.5], [])]
    text = study.report(results)
    assert "| dynamic | 1 | 0.750 [0.500, 1.000] (n=2) | 0.750 [0.500, 1.000] (n=2) |" in text
    assert "| 0.500 [0.000, 1.000] (n=2) | 0.500 [0.500, 0.500] (n=2) | – | – |" in text  # soft, hard
    # the fixture's audit is labelled "audit": a fixed evaluator's, shown for the non-dynamic variant
    assert (
        "| verifiable | 1 | 0.375 [0.250, 0.500] (n=2) |" in text and "| 0.500 [0.250, 0.750] (n=4) |" in text
    )
    # same prompts, so the policy difference is paired: 0.25 and 0.5 -> mean 0.375
    assert "| dynamic − verifiable | 1 | 0.375 [0.250, 0.500] (n=2) | – |" in text
    assert "| train-policy | – | 100 |" in text and "| evaluate | 60 | – |" in text
    # the per-step split: means over the round's steps, "–" for a part the trainer does not log
    assert "| train-policy | 1 | 3 | 20.0 | 2.0 | – | – | 5.0 |" in text
    [png] = study.write_step_plots(results, tmp_path)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plan_is_the_arithmetic_of_the_measured_costs():
    cfg = study.study_config("dynamic", study.HERE)
    costs = {
        "per_step_s": {
            "train-evaluator": {"time/step_s": 60.0},
            "train-policy": {"time/step_s": 100.0, "time/rubrics_s": 8.0, "time/judge_s": 8.0},
        },
        "once_per_round_s": {"generator_candidates": 30.0, "evaluate": 120.0},
    }
    p = study.plan(cfg, costs)
    t, d = cfg.train_policy, cfg.data
    audit = 2 * d.eval_prompts * len(d.sources) * 16.0 / t.prompts_per_step
    one_round = 30 + cfg.train_evaluator.max_steps * 60 + audit + t.max_steps * 100 + 120
    assert p["audit_s_estimate"] == pytest.approx(audit)
    assert p["total_min"] == pytest.approx(round((cfg.pipeline.rounds * one_round + 120) / 60, 1))


def test_differences_ignore_wall_times_only():
    a, b = _result("dynamic", [0.5, 1.0], [1.0, 0.0]), _result("dynamic", [0.5, 1.0], [1.0, 0.0])
    b["pipeline_wall_s"] += 30
    b["stages"][0]["seconds"] += 1.0
    a["steps"]["train-policy"]["1"]["time/step_s"] = [1.0]
    b["steps"]["train-policy"]["1"]["time/step_s"] = [2.0]
    assert study.differences(a, b) == []
    b["evaluate"]["units"][3][4] = 0.75
    b["stages"][0]["metrics"]["kl"] = 0.2
    assert study.differences(a, b) == [
        "round1/train-policy/kl: 0.1 != 0.2",
        "units/1/policy/avg_at_k/p1: 1.0 != 0.75",
    ]


def test_plot_differences_name_every_changed_or_missing_plot(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "same.png").write_bytes(b"\x89PNG same")
    assert study.plot_differences(a, b) == []
    (a / "changed.png").write_bytes(b"\x89PNG one")
    (b / "changed.png").write_bytes(b"\x89PNG two")
    (a / "gone.png").write_bytes(b"\x89PNG")
    assert [d.split(":")[0] for d in study.plot_differences(a, b)] == ["plot changed.png", "plot gone.png"]


@pytest.mark.slow
def test_a_tiny_dynamic_variant_runs_end_to_end(tmp_path):
    """The whole study path on tiny random models: round 0, the pipeline under kfp.local (one round:
    a second runs the same code and costs CI three minutes), and the units, audit sets, step curves
    and stage times it reads back."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": "0"})
            + "\n"
            for i in range(3)
        )
    )
    tiny = preset_dict("tiny")
    extra = {
        **{k: v for k, v in tiny.items() if k != "pipeline"},
        "data": {**tiny["data"], "labelled": [str(pairs)]},
        "pipeline": {"rounds": 1},
    }
    result = study.run_variant("dynamic", tmp_path / "study", tmp_path / "plots", extra=extra)
    assert (
        result["config"]["models"]["policy"] == "tiny-random" and result["config"]["pipeline"]["rounds"] == 1
    )
    ev = result["evaluate"]["intervals"]
    assert set(ev) == {"0", "1"}
    for t in ("0", "1"):
        assert ev[t]["policy/avg_at_k"]["n"] == result["prompts"]["held_out"]
        # 3 file pairs (plus outcome pairs, if the policy's samples split)
        assert ev[t]["dynamic/pair_soft"]["n"] == ev[t]["dynamic/pair_hard"]["n"] >= 3
    assert ev["1"]["policy/win"]["n"] == result["prompts"]["held_out"]  # over the base policy
    assert ev["1"]["Δr0/dynamic/pair_soft"]["n"] == 3
    assert {"audit-before/tie_rate", "audit-after/tie_rate", "after−before/tie_rate"} <= set(
        result["audit"]["1"]
    )
    for trainer in ("train-evaluator", "train-policy"):
        assert set(result["steps"][trainer]) == {"1"}
        assert (
            len(result["steps"][trainer]["1"]["time/step_s"]) == tiny[trainer.replace("-", "_")]["max_steps"]
        )
    assert {s["stage"] for s in result["stages"]} >= {"train-evaluator", "train-policy", "evaluate"}
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.png"))  # the last round's evaluate plots
    assert "| dynamic | 1 |" in study.report([result])
