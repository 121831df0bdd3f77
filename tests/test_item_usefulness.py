"""Per-item usefulness: measures checked by hand on a planted round, the artifact's contract, and
`dynrubric items export` against a real MLflow store written the way the pipeline's runner writes it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_bad_inputs import run_cli

from dynamicrubric.evaluation.item_usefulness import (
    ItemUsefulnessError,
    item_usefulness,
    normalise_text,
    summarise,
)
from dynamicrubric.infra.artifact_kinds import ArtifactError
from dynamicrubric.infra.artifacts import read_artifact, read_frame, to_table, write_artifact
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.stages.runner import execute, start_tracking
from dynamicrubric.stages.spec import Data, Stage

NAN = math.nan

# The planted round. p0: four responses, gold says 0 and 2 are the better ones.
#   item 0 (weight 2) passes exactly the gold-better responses: splits, agrees with gold on every pair
#   item 1 passes every response: splits nothing
#   item 2 passes only response 1, a gold-worse one: splits, but against gold
# p1: three responses, no gold. Item 0 says the same thing as p0's item 0 in other words; item 1's
# verdict on response 1 failed (p_yes NaN, verdict False as the judge writes it).
RUBRICS = [
    {
        "prompt_id": "p0",
        "rubric_idx": 0,
        "items": [
            {"text": "Gives the right answer.", "weight": 2},
            {"text": "Is polite", "weight": 1},
            {"text": "Cites a source", "weight": 1},
        ],
    },
    {
        "prompt_id": "p1",
        "rubric_idx": 0,
        "items": [
            {"text": "- gives the RIGHT   answer", "weight": 1},
            {"text": "Mentions units", "weight": 3},
        ],
    },
]
VERDICTS = {  # (prompt_id, item_idx) -> verdict per sample_idx; NaN: failed
    ("p0", 0): [1, 0, 1, 0],
    ("p0", 1): [1, 1, 1, 1],
    ("p0", 2): [0, 1, 0, 0],
    ("p1", 0): [1, 0, 0],
    ("p1", 1): [1, NAN, 1],
}
GOLD = [{"prompt_id": "p0", "sample_idx": s, "gold": g} for s, g in enumerate([1.0, 0.0, 1.0, 0.0])]


def _judgments(verdicts: dict, rubrics: list[dict], p_yes=None) -> pd.DataFrame:
    weights = {(r["prompt_id"], i): it["weight"] for r in rubrics for i, it in enumerate(r["items"])}
    rows = []
    for (prompt_id, item_idx), values in verdicts.items():
        for sample_idx, v in enumerate(values):
            p = p_yes[(prompt_id, item_idx)][sample_idx] if p_yes else v
            rows.append(
                {
                    "prompt_id": prompt_id,
                    "rubric_idx": 0,
                    "item_idx": item_idx,
                    "sample_idx": sample_idx,
                    "weight": weights[(prompt_id, item_idx)],
                    "verdict": v == 1,  # a failed verdict is False in the judgments, never a NaN
                    "p_yes": float(p),
                }
            )
    return pd.DataFrame(rows)


def _rollouts(sizes: dict[str, int]) -> pd.DataFrame:
    return pd.DataFrame([{"prompt_id": p, "sample_idx": s} for p, k in sizes.items() for s in range(k)])


def planted(round_idx: int = 1) -> pd.DataFrame:
    return item_usefulness(
        pd.DataFrame(RUBRICS),
        _judgments(VERDICTS, RUBRICS),
        _rollouts({"p0": 4, "p1": 3}),
        pd.DataFrame(GOLD),
        soft=False,
        round_idx=round_idx,
    )


def _row(frame: pd.DataFrame, prompt_id: str, item_idx: int) -> pd.Series:
    (row,) = frame[(frame["prompt_id"] == prompt_id) & (frame["item_idx"] == item_idx)].to_dict("records")
    return pd.Series(row)


# ---- the measures, by hand


def test_an_item_that_passes_exactly_the_gold_better_responses_is_useful():
    row = _row(planted(), "p0", 0)
    assert row["pass_rate"] == 0.5 and row["splits"]
    assert row["gold_pairs"] == 4  # (0,1) (0,3) (2,1) (2,3): the pairs whose gold differs
    assert row["gold_agreement"] == 1.0
    assert row["useful"]
    assert row["num_responses"] == 4 and row["num_failed"] == 0 and row["weight"] == 2


def test_an_item_every_response_passes_is_not_useful():
    row = _row(planted(), "p0", 1)
    assert row["pass_rate"] == 1.0 and not row["splits"] and not row["useful"]
    assert row["gold_agreement"] == 0.5  # it ties every gold pair
    assert row["variance_share"] == 0.0


def test_an_item_that_splits_against_gold_is_not_useful():
    row = _row(planted(), "p0", 2)
    assert row["pass_rate"] == 0.25 and row["splits"]
    # (0,1): it prefers 1, gold 0 → 0; (0,3) tie → 0.5; (2,1) → 0; (2,3) tie → 0.5
    assert row["gold_agreement"] == pytest.approx(0.25)
    assert not row["useful"]


def test_variance_shares_by_hand_and_summing_to_one():
    """p0: S = 2·v0 + v1 + v2 = (3, 2, 3, 1), Var(S) = 0.6875; Cov(v0, S) = 0.375, Cov(v2, S) = −0.0625."""
    frame = planted()
    p0 = frame[frame["prompt_id"] == "p0"].set_index("item_idx")["variance_share"]
    assert p0.to_list() == pytest.approx([2 * 0.375 / 0.6875, 0.0, -0.0625 / 0.6875])
    assert p0.sum() == pytest.approx(1.0)
    p1 = frame[frame["prompt_id"] == "p1"]["variance_share"]
    assert p1.sum() == pytest.approx(1.0)


def test_variance_shares_match_the_covariance_formula_on_random_rubrics():
    """share_m = Σ_m' w_m w_m' Cov(v_m, v_m') / (W² Var(s)), from np.cov of each set's verdict matrix."""
    rng = np.random.default_rng(3)
    rubrics, hard, soft, expected, sizes = [], {}, {}, {}, {}
    for p in range(6):
        prompt_id, m, k = f"q{p}", int(rng.integers(2, 6)), int(rng.integers(3, 9))
        weights, v = rng.integers(1, 6, size=m), rng.random((m, k))
        items = [{"text": f"item {p}.{i}", "weight": int(w)} for i, w in enumerate(weights)]
        rubrics.append({"prompt_id": prompt_id, "rubric_idx": 0, "items": items})
        sizes[prompt_id] = k
        weighted = np.cov(v, bias=True) * np.outer(weights, weights)  # W² cancels in the ratio
        for i in range(m):
            hard[(prompt_id, i)], soft[(prompt_id, i)] = list((v[i] >= 0.5).astype(float)), list(v[i])
            expected[(prompt_id, i)] = weighted[i].sum() / weighted.sum()
    frame = item_usefulness(
        pd.DataFrame(rubrics), _judgments(hard, rubrics, p_yes=soft), _rollouts(sizes), None,
        soft=True, round_idx=0,
    )  # fmt: skip
    got = {(r.prompt_id, r.item_idx): r.variance_share for r in frame.itertuples()}
    assert got == pytest.approx(expected)
    assert frame.groupby("prompt_id")["variance_share"].sum().to_list() == pytest.approx([1.0] * 6)


def test_a_failed_verdict_is_left_out_and_counted_never_a_zero():
    row = _row(planted(), "p1", 1)
    assert row["num_failed"] == 1 and row["num_responses"] == 3
    assert row["pass_rate"] == 1.0  # 2 of 2 scored verdicts; a NaN read as "no" would give 2/3
    assert not row["splits"] and not row["useful"]
    # the score variance is over responses 0 and 2 (response 1 has no score): item 1 passes both
    assert row["variance_share"] == 0.0
    assert _row(planted(), "p1", 0)["variance_share"] == 1.0


def test_without_gold_splitting_is_enough():
    row = _row(planted(), "p1", 0)
    assert row["gold_pairs"] == 0 and math.isnan(row["gold_agreement"])
    assert row["splits"] and row["useful"]


def test_recurrence_counts_rubrics_holding_the_same_normalised_text():
    frame = planted()
    assert _row(frame, "p0", 0)["recurrence"] == 2 and _row(frame, "p1", 0)["recurrence"] == 2
    assert _row(frame, "p0", 1)["recurrence"] == 1
    assert normalise_text("  - Gives the RIGHT\n answer!! ") == "gives the right answer"
    assert normalise_text("«Cites a source»") == "cites a source"


def test_an_item_twice_in_one_rubric_recurs_in_one_rubric():
    rubrics = [
        {
            "prompt_id": "p0",
            "rubric_idx": 0,
            "items": [{"text": "A", "weight": 1}, {"text": "a.", "weight": 1}],
        }
    ]
    frame = item_usefulness(
        pd.DataFrame(rubrics),
        _judgments({("p0", 0): [1, 0], ("p0", 1): [1, 0]}, rubrics),
        _rollouts({"p0": 2}),
        None,
        soft=False,
        round_idx=0,
    )
    assert frame["recurrence"].to_list() == [1, 1]


def test_a_score_that_does_not_vary_has_no_variance_shares():
    rubrics = [
        {
            "prompt_id": "p0",
            "rubric_idx": 0,
            "items": [{"text": "A", "weight": 2}, {"text": "B", "weight": 1}],
        }
    ]
    frame = item_usefulness(
        pd.DataFrame(rubrics),
        _judgments({("p0", 0): [1, 1, 1], ("p0", 1): [0, 0, 0]}, rubrics),
        _rollouts({"p0": 3}),
        None,
        soft=False,
        round_idx=0,
    )
    assert frame["variance_share"].isna().all()
    assert not frame["useful"].any()


def test_soft_verdicts_give_the_pass_rate_and_hard_ones_say_what_splits():
    """Soft p_yes almost always differ a little: an item at 0.8/0.7/0.9 passes every response."""
    rubrics = [
        {
            "prompt_id": "p0",
            "rubric_idx": 0,
            "items": [{"text": "A", "weight": 1}, {"text": "B", "weight": 1}],
        }
    ]
    hard = {("p0", 0): [1, 1, 1], ("p0", 1): [1, 0, 0]}
    soft = {("p0", 0): [0.8, 0.7, 0.9], ("p0", 1): [0.9, 0.2, 0.4]}
    gold = pd.DataFrame(
        [{"prompt_id": "p0", "sample_idx": s, "gold": g} for s, g in enumerate([1.0, 0.0, 0.5])]
    )
    frame = item_usefulness(
        pd.DataFrame(rubrics), _judgments(hard, rubrics, p_yes=soft), _rollouts({"p0": 3}), gold,
        soft=True, round_idx=0,
    )  # fmt: skip
    a, b = _row(frame, "p0", 0), _row(frame, "p0", 1)
    assert a["pass_rate"] == pytest.approx(0.8) and not a["splits"] and not a["useful"]
    assert b["pass_rate"] == pytest.approx(0.5) and b["splits"]
    # B orders 0 > 2 > 1 and so does gold: every pair agrees; A orders 2 > 0 > 1: (0,2) disagrees
    assert b["gold_agreement"] == 1.0 and b["useful"]
    assert a["gold_agreement"] == pytest.approx(2 / 3)


def test_a_nan_gold_is_no_gold():
    gold = pd.DataFrame(GOLD).assign(gold=[1.0, 0.0, NAN, 0.0])
    frame = item_usefulness(
        pd.DataFrame(RUBRICS), _judgments(VERDICTS, RUBRICS), _rollouts({"p0": 4, "p1": 3}), gold,
        soft=False, round_idx=1,
    )  # fmt: skip
    assert _row(frame, "p0", 0)["gold_pairs"] == 2  # (0,1), (0,3)


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda j: j.iloc[1:], r"\(prompt_id='p0', rubric_idx=0, item_idx=0, sample_idx=0\) has no judgment"),
        (lambda j: pd.concat([j, j.iloc[:1]]), "is judged twice"),
        (lambda j: j.assign(weight=j["weight"].where(j.index != 0, 5)), "has weight 5, its rubric says 2"),
        (
            lambda j: pd.concat([j, j.iloc[:1].assign(sample_idx=9)]),
            "sample_idx=9.* is judged but is not an item of the rubrics and a rollout",
        ),
    ],
    ids=["missing", "twice", "weight", "stray"],
)
def test_judging_that_does_not_fit_the_rubrics_is_refused_by_key(change, expected):
    with pytest.raises(ItemUsefulnessError, match=expected):
        item_usefulness(
            pd.DataFrame(RUBRICS), change(_judgments(VERDICTS, RUBRICS)), _rollouts({"p0": 4, "p1": 3}),
            None, soft=False, round_idx=1,
        )  # fmt: skip


def test_summary():
    summary = summarise(planted())
    assert summary == pytest.approx(
        {
            "items": 5,
            "useful_share": 2 / 5,
            "non_splitting_share": 2 / 5,
            "mean_pass_rate": (0.5 + 1.0 + 0.25 + 1 / 3 + 1.0) / 5,
            "mean_gold_agreement": (1.0 + 0.5 + 0.25) / 3,  # the items with gold pairs
            "mean_recurrence": (2 + 1 + 1 + 2 + 1) / 5,
        }
    )
    assert summarise(planted().iloc[:0]) == {"items": 0.0}


def test_a_round_of_empty_rubrics_has_no_rows_and_a_valid_artifact(tmp_path):
    rubrics = pd.DataFrame([{"prompt_id": "p0", "rubric_idx": 0, "items": []}])
    frame = item_usefulness(rubrics, _judgments({}, []), _rollouts({"p0": 2}), None, soft=True, round_idx=0)
    assert frame.empty and list(frame.columns) == list(planted().columns)
    write_artifact(str(tmp_path / "empty.parquet"), "item_usefulness", frame)
    assert read_artifact(str(tmp_path / "empty.parquet")).num_rows == 0


def test_the_same_measures_from_frames_read_back_from_artifacts(tmp_path):
    """The stage reads its inputs as artifacts: nested items as arrays, p_yes as float32 with NaN kept."""
    rubric_columns = {"variant": "dynamic", "generator": "g", "generator_prompt": "", "completion": "",
                      "finish_reason": "stop", "parse_status": "json"}  # fmt: skip
    rollout_columns = {"prompt": "q", "response": "a", "num_tokens": 1, "finish_reason": "stop",
                       "policy": "p", "seed": 0}  # fmt: skip
    uris = {name: str(tmp_path / f"{name}.parquet") for name in ("rubrics", "judgments", "rollouts")}
    write_artifact(uris["rubrics"], "rubrics", [{**r, **rubric_columns} for r in RUBRICS])
    write_artifact(uris["judgments"], "judgments", _judgments(VERDICTS, RUBRICS))
    write_artifact(uris["rollouts"], "rollouts", _rollouts({"p0": 4, "p1": 3}).assign(**rollout_columns))
    frame = item_usefulness(
        read_frame(uris["rubrics"], "rubrics"), read_frame(uris["judgments"], "judgments"),
        read_frame(uris["rollouts"], "rollouts"), pd.DataFrame(GOLD), soft=False, round_idx=1,
    )  # fmt: skip
    pd.testing.assert_frame_equal(frame, planted())


# ---- the artifact


def test_the_artifact_round_trips_and_keeps_undefined_measures_as_nulls(tmp_path):
    uri = str(tmp_path / "items.parquet")
    frame = planted()
    write_artifact(uri, "item_usefulness", frame)
    table = read_artifact(uri, "item_usefulness")
    assert table.column("gold_agreement").null_count == 2  # p1 has no gold
    back = read_frame(uri, "item_usefulness")
    pd.testing.assert_frame_equal(back, frame, check_dtype=False)


def _raw(path: Path, table: pa.Table) -> str:
    """A file with the kind's footer but rows the contract refuses, written past write_artifact."""
    meta = {b"dynamicrubric.kind": b"item_usefulness", b"dynamicrubric.schema_version": b"1"}
    pq.write_table(table.replace_schema_metadata(meta), path)
    return str(path)


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda t: t.drop_columns(["useful"]), "missing column 'useful'"),
        (lambda t: _set(t, "pass_rate", pa.array([1.5] * t.num_rows)), "'pass_rate' has value 1.5"),
        (
            lambda t: _set(t, "variance_share", pa.array([NAN] * t.num_rows), nullable=True),
            "'variance_share' has 5 NaN",  # undefined is a null: a NaN would pass the range checks
        ),
        (lambda t: pa.concat_tables([t, t.slice(0, 1)]), "duplicate key"),
        (lambda t: _set(t, "recurrence", pa.array([0] * t.num_rows, pa.int32())), "'recurrence' has value 0"),
    ],
    ids=["column", "range", "nan", "duplicate", "recurrence"],
)
def test_validate_refuses_a_broken_artifact(tmp_path, capsys, breakage, expected):
    good = str(tmp_path / "good.parquet")
    write_artifact(good, "item_usefulness", planted())
    bad = _raw(tmp_path / "bad.parquet", breakage(to_table("item_usefulness", planted())))
    with pytest.raises(ArtifactError, match=expected):
        read_artifact(bad)
    code, output = run_cli(["validate", good, bad], capsys)
    assert code == 1
    assert f"OK   {good}: kind=item_usefulness rows=5" in output
    (failed,) = [line for line in output.splitlines() if line.startswith("FAIL")]
    assert bad in failed and re.search(expected, failed), failed


def _set(table: pa.Table, name: str, column: pa.Array, nullable: bool = False) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, pa.field(name, column.type, nullable=nullable), column)


# ---- `dynrubric items export` against a real MLflow store


def _evaluate_stage(frame: pd.DataFrame | None) -> Stage:
    """A stand-in for the evaluate stage, declared and run like it: its MLflow run is named `evaluate`
    and the runner logs its Parquet outputs as datasets, the item_usefulness one named `items`. Without
    a frame it is an evaluate from before per-item usefulness (metrics only)."""

    def work(cfg, round_idx: int, **values) -> dict:
        metrics = [
            {"round": round_idx, "stage": "evaluate", "variant": "", "name": "x", "step": 0, "value": 1.0}
        ]
        write_artifact(values["out_metrics"], "metrics", metrics)
        if frame is not None:
            write_artifact(values["out_items"], "item_usefulness", frame.assign(round=round_idx))
        return {"x": 1.0}

    outputs = [Data("metrics", "metrics", "metrics artifact to write")]
    if frame is not None:
        outputs.append(Data("items", "item_usefulness", "per-item usefulness artifact to write"))
    return Stage("evaluate", "a stand-in", work, lambda v: "evaluate", outputs=tuple(outputs))


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory) -> dict:
    """A pipeline run in a sqlite MLflow store: round 1's evaluate wrote the planted items, round 2's
    items none of which is useful, round 3's evaluate is from before per-item usefulness, and round
    4's failed while logging (its MLflow run ends FAILED)."""
    import dataclasses

    root = tmp_path_factory.mktemp("items-run")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    cfg = load_config(None, preset="tiny", overrides={"pipeline": {"mlflow_tracking_uri": uri, "rounds": 4}})
    parent = start_tracking(cfg.to_yaml(), "items-run")
    useless = planted().assign(useful=False)
    for round_idx, frame in ((1, planted()), (2, useless), (3, None), (4, planted())):
        values = {"out_metrics": str(root / f"metrics-{round_idx}.parquet")}
        if frame is not None:
            values["out_items"] = str(root / f"items-{round_idx}.parquet")
        stage = _evaluate_stage(frame)
        if round_idx == 4:
            stage = dataclasses.replace(stage, lineage=_fail)
            with pytest.raises(RuntimeError, match="lost the store"):
                execute(stage, cfg, "items-run", round_idx, values)
            continue
        execute(stage, cfg, "items-run", round_idx, values)
    return {"uri": uri, "parent": parent, "root": root}


def _fail(*args) -> None:
    raise RuntimeError("lost the store")


def _export(logged_run, run: str, round_idx: int, out: Path, *extra: str) -> list[str]:
    return ["items", "export", run, "--round", str(round_idx), "--out", str(out),
            "--tracking-uri", logged_run["uri"], *extra]  # fmt: skip


def test_export_writes_the_useful_items_of_a_round(logged_run, tmp_path, capsys):
    out = tmp_path / "useful.jsonl"
    code, output = run_cli(_export(logged_run, logged_run["parent"], 1, out), capsys)
    assert code == 0, output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_id"], r["item_idx"]) for r in rows] == [("p0", 0), ("p1", 0)]
    first = rows[0]
    assert first["text"] == "Gives the right answer." and first["weight"] == 2
    assert (first["pass_rate"], first["gold_agreement"], first["round"]) == (0.5, 1.0, 1)
    assert rows[1]["gold_agreement"] is None  # undefined is null, not NaN (which JSON does not have)
    assert f"wrote 2 of 5 items of round 1 of run {logged_run['parent']}" in output


def test_export_all_as_parquet_by_run_name(logged_run, tmp_path, capsys):
    out = tmp_path / "all.parquet"
    code, output = run_cli(_export(logged_run, "items-run", 1, out, "--all"), capsys)
    assert code == 0, output
    pd.testing.assert_frame_equal(read_frame(str(out), "item_usefulness"), planted(), check_dtype=False)


def test_a_round_with_nothing_useful_writes_an_empty_file_and_says_so(logged_run, tmp_path, capsys):
    out = tmp_path / "none.jsonl"
    code, output = run_cli(_export(logged_run, logged_run["parent"], 2, out), capsys)
    assert code == 0, output
    assert out.read_text() == ""
    assert "none of round 2's 5 items is useful" in output


def _error(code: int, output: str) -> str:
    assert code not in (0, None), output
    assert "Traceback" not in output, output
    (line,) = [line for line in output.splitlines() if line.startswith("error: ")]
    return line


@pytest.mark.parametrize(
    "run, round_idx, expected",
    [
        ("no-such-run", 1, "error: no-such-run: no pipeline run with this id or run name in sqlite:///"),
        ("PARENT", 7, r"^error: run [0-9a-f]+ has no round 7 \(its rounds: 1, 2, 3, 4\)$"),
        ("PARENT", 4, r"^error: round 4's evaluate run did not finish in run [0-9a-f]+$"),
        (
            "PARENT",
            3,
            "round 3's evaluate run .* logged no 'items' output \\(a run from before per-item usefulness\\)",
        ),
    ],
    ids=["no-run", "no-round", "unfinished", "older-run"],
)
def test_export_errors_are_one_line(logged_run, tmp_path, capsys, run, round_idx, expected):
    out = tmp_path / "x.jsonl"
    run = logged_run["parent"] if run == "PARENT" else run
    line = _error(*run_cli(_export(logged_run, run, round_idx, out), capsys))
    assert re.search(expected, line), line
    assert not out.exists()


def test_export_refuses_a_stage_run_in_place_of_the_pipeline_run(logged_run, tmp_path, capsys):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=logged_run["uri"])
    experiment = client.get_run(logged_run["parent"]).info.experiment_id
    stage_run = client.search_runs([experiment], "tags.`dynrubric.stage` = 'evaluate'")[0].info.run_id
    line = _error(*run_cli(_export(logged_run, stage_run, 1, tmp_path / "x.jsonl"), capsys))
    assert line == f"error: {stage_run} is not a pipeline's parent run (MLflow shows it under one)"


def test_export_never_overwrites_its_input_or_a_folder(logged_run, tmp_path, capsys):
    artifact = logged_run["root"] / "items-1.parquet"
    before = artifact.read_bytes()
    line = _error(*run_cli(_export(logged_run, logged_run["parent"], 1, artifact), capsys))
    assert "an output cannot be written where the input" in line
    assert artifact.read_bytes() == before
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    line = _error(*run_cli(_export(logged_run, logged_run["parent"], 1, folder), capsys))
    assert line.endswith("exists and is a folder, not a file")


def test_export_refuses_an_unknown_format_and_a_missing_store(logged_run, tmp_path, capsys):
    line = _error(*run_cli(_export(logged_run, logged_run["parent"], 1, tmp_path / "x.csv"), capsys))
    assert line.endswith("expected a .jsonl or .parquet file, found .csv")
    argv = ["items", "export", "r", "--round", "1", "--out", str(tmp_path / "x.jsonl"),
            "--tracking-uri", f"sqlite:///{tmp_path}/none.db"]  # fmt: skip
    line = _error(*run_cli(argv, capsys))
    assert line == f"error: --tracking-uri sqlite:///{tmp_path}/none.db: no such database file"
    assert not (tmp_path / "none.db").exists()
