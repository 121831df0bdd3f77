"""The study script of docs/results.md: its configs stay valid, and its tables say what the runs logged."""

from __future__ import annotations

import json

import pytest

from bench import study
from dynamicrubric import tasks
from dynamicrubric.pipelines.co_evolution import pipeline_variant


@pytest.mark.parametrize("variant", sorted(study.VARIANTS))
def test_study_config_runs_the_variant_it_names(variant, tmp_path):
    cfg = study.study_config(variant, tmp_path)
    assert pipeline_variant(cfg) == variant and cfg.evaluate.variants == [variant]
    assert cfg.rollout.k == 8 and cfg.pipeline.rounds >= 2
    assert cfg.models.policy == cfg.models.generator == cfg.models.verifier == "smollm2-135m-instruct"
    assert cfg.pipeline.mlflow_tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    # the committed pairs are a labelled set the evaluate stage reads
    pairs = tasks.load_pairs(cfg.data.labelled[0])
    assert pairs["list_id"].nunique() == sum(1 for _ in study.PAIRS.open()) >= 10


def _result() -> dict:
    def stage(t, name, seconds, **metrics):
        return {"round": t, "stage": name, "task": name, "seconds": seconds, "metrics": metrics}

    return {
        "variant": "dynamic",
        "command": "python -m bench.study run --variant dynamic",
        "config": {"rollout": {"k": 8}, "pipeline": {"rounds": 1}, "seed": 0},
        "machine": {"cpu": "cpu", "cores": 2, "torch": "2.13.0"},
        "prompts": {"train": 9, "held_out": 9, "labelled_pairs": 23},
        "round0": {
            "metrics": {"dynamic/pairwise_accuracy_labelled": 0.5, "policy/accuracy": 0.25},
            "wall_s": 60.0,
        },
        "pipeline_wall_s": 600.0,
        "stages": [
            stage(0, "prepare_data", 2.0),
            stage(1, "policy-rubrics", 10.0, rubrics=3.0, empty_rubrics=1.0),
            stage(1, "policy-rubrics", 12.0, rubrics=1.0, empty_rubrics=1.0),
            stage(1, "policy-judge", 3.0, judgments=30.0, yes_rate=0.2),
            stage(1, "policy-judge", 4.0, judgments=10.0, yes_rate=0.6),
            stage(1, "policy-aggregate", 1.0, mean_gap=0.2, tie_rate=0.4, uniformity_rate=0.1),
            stage(
                1, "evaluate", 30.0, **{"dynamic/pairwise_accuracy_labelled": 0.75, "policy/accuracy": 0.5}
            ),
        ],
    }


def test_round_rows_and_stage_seconds():
    rows = study.round_rows(_result())
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[0]["eval acc (pairs)"] == 0.5 and rows[0]["Δgap"] is None
    assert rows[1]["Δgap"] == 0.2 and rows[1]["tie rate"] == 0.4
    assert rows[1]["rubrics parsed"] == 0.5  # 2 of 4 rubric samples over both shards were empty
    assert rows[1]["yes rate"] == pytest.approx((6 + 6) / 40)  # pooled over the shards' judgments
    assert rows[1]["eval acc (pairs)"] == 0.75 and rows[1]["policy acc"] == 0.5
    seconds = study.stage_seconds(_result())
    assert list(seconds) == ["prepare_data", "policy-rubrics", "policy-judge", "policy-aggregate", "evaluate"]
    assert seconds["policy-rubrics"] == {1: 22.0} and seconds["evaluate"] == {0: 60.0, 1: 30.0}


def test_report_is_markdown_from_the_json(tmp_path):
    path = tmp_path / "study_dynamic.json"
    path.write_text(json.dumps(_result()))
    text = study.report([json.loads(path.read_text())])
    assert "| 1 | 0.200 | 0.400 | 0.100 | 0.500 | 0.300 | 0.750 |" in text
    assert "| sum (tasks overlap) | 62.0 | 60.0 |" in text


def test_differences_ignore_wall_times_only():
    a, b = _result(), _result()
    b["pipeline_wall_s"] += 30
    b["stages"][1]["seconds"] += 1.0
    a["stages"][1]["metrics"]["tokens_per_s"], b["stages"][1]["metrics"]["tokens_per_s"] = 80.0, 30.0
    assert study.differences(a, b) == []
    b["stages"][-1]["metrics"]["policy/accuracy"] = 0.25
    b["round0"]["metrics"]["policy/accuracy"] = 0.5
    assert study.differences(a, b) == [
        "round0/policy/accuracy: 0.25 != 0.5",
        "round1/evaluate/policy/accuracy: 0.5 != 0.25",
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
