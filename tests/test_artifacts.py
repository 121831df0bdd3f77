"""The artifact contract: round trips of every kind, and a clear error for each kind of bad input."""

from __future__ import annotations

import math
import subprocess
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from dynamicrubric.infra import artifact_kinds, artifacts
from dynamicrubric.infra.artifact_kinds import ArtifactError
from dynamicrubric.infra.artifacts import read_artifact, write_artifact

SAMPLES: dict[str, list[dict]] = {
    "prompts": [
        {"prompt_id": "p0", "task": "basic_arithmetic", "prompt": "2+3=?", "reference": "5", "meta": "{}"},
        {"prompt_id": "p1", "task": "user", "prompt": "Say hi", "reference": None, "meta": None},
    ],
    "rollouts": [
        {
            "prompt_id": "p0",
            "sample_idx": i,
            "prompt": "2+3=?",
            "response": f"{4 + i}",
            "num_tokens": 1,
            "finish_reason": "stop",
            "policy": "tiny-random",
            "seed": 7,
        }
        for i in range(3)
    ],
    "rubrics": [
        {
            "prompt_id": "p0",
            "rubric_idx": 0,
            "variant": "dynamic",
            "generator": "g",
            "generator_prompt": "...",
            "completion": "1. (5) correct",
            "parse_status": "lines",
            "finish_reason": "stop",
            "items": [{"text": "correct", "weight": 5}],
        },
        {
            "prompt_id": "p0",
            "rubric_idx": 1,
            "variant": "dynamic",
            "generator": "g",
            "generator_prompt": "...",
            "completion": "??",
            "parse_status": "empty",
            "finish_reason": "length",
            "items": [],
        },
    ],
    "judgments": [
        {
            "prompt_id": "p0",
            "rubric_idx": 0,
            "item_idx": 0,
            "sample_idx": s,
            "weight": 5,
            "verdict": s == 1,
            "p_yes": 0.9 if s == 1 else 0.1,
        }
        for s in range(3)
    ],
    "scores": [
        {"prompt_id": "p0", "rubric_idx": 0, "sample_idx": s, "score": float(s == 1), "num_items": 1}
        for s in range(3)
    ],
    "rewards": [
        {"prompt_id": "p0", "rubric_idx": 0, "r_disc": 0.2, "r_anchor": -0.5, "num_items": 1},
        {"prompt_id": "p0", "rubric_idx": 1, "r_disc": 0.0, "r_anchor": None, "num_items": 0},
    ],
    "diagnostics": [
        {
            "prompt_id": "p0",
            "rubric_idx": 0,
            "num_responses": 3,
            "num_items": 1,
            "mean_score": 1 / 3,
            "mean_gap": 1.0,
            "tie_rate": 1 / 3,
            "uniform": False,
            "mean_pass_rate": 1 / 3,
        }
    ],
    "anchors": [
        {
            "list_id": "l0",
            "sample_idx": i,
            "rank": i + 1,
            "prompt": "q",
            "response": f"a{i}",
            "source": "nectar",
        }
        for i in range(3)
    ],
    "metrics": [
        {"round": 1, "stage": "aggregate", "variant": "dynamic", "name": "tie_rate", "step": 0, "value": 0.5}
    ],
    "outcomes": [  # a null score: the sandbox failed, the sample is unscored
        {"prompt_id": "p0", "sample_idx": 0, "task": "humaneval", "score": 1.0},
        {"prompt_id": "p0", "sample_idx": 1, "task": "humaneval", "score": None},
    ],
    "item_usefulness": [  # nulls: measures undefined for the item (no gold pairs, a score that does not vary)
        {
            "round": 1,
            "prompt_id": "p0",
            "rubric_idx": 0,
            "item_idx": i,
            "text": text,
            "weight": 5,
            "num_responses": 3,
            "num_failed": 3 * i,  # item 1: every verdict failed
            "pass_rate": 1 / 3 if i == 0 else None,
            "splits": i == 0,
            "variance_share": 1.0 if i == 0 else None,
            "gold_pairs": 2 if i == 0 else 0,
            "gold_agreement": 1.0 if i == 0 else None,
            "recurrence": 1,
            "useful": i == 0,
        }
        for i, text in enumerate(["correct", "cites a source"])
    ],
    "units": [
        {"round": 1, "variant": "policy", "measure": "avg_at_k", "unit_id": "p1", "value": 0.25},
        {"round": 1, "variant": "dynamic", "measure": "pair_soft", "unit_id": "file0:a|0>1", "value": 0.5},
    ],
    "guard": [
        {
            "round": 2,
            "healthy": False,
            "alarms": "hacking",
            "reasons": "the training score rose by +0.800 [+0.800, +0.800] while the gold fell by -1.000",
            "action": "rollback",
            "policy": "s3://runs/r2/policy",
            "generator": "s3://runs/r2/generator",
        }
    ],
}


def test_every_kind_has_a_sample():
    assert set(SAMPLES) == set(artifact_kinds.KINDS)


@pytest.mark.parametrize("kind", sorted(artifact_kinds.KINDS))
def test_round_trip_local(tmp_path, kind):
    uri = str(tmp_path / f"{kind}.parquet")
    written = write_artifact(uri, kind, SAMPLES[kind])
    back = read_artifact(uri, kind)
    assert back.to_pylist() == written.to_pylist() == artifacts.to_table(kind, SAMPLES[kind]).to_pylist()
    meta = pq.read_metadata(uri)
    assert meta.metadata[b"dynamicrubric.kind"] == kind.encode()
    assert meta.row_group(0).column(0).compression == "ZSTD"
    # file:// URIs are the same file
    assert read_artifact(f"file://{uri}", kind).num_rows == len(SAMPLES[kind])


@pytest.mark.parametrize("kind", sorted(artifact_kinds.KINDS))
def test_round_trip_s3(s3_env, kind):
    uri = f"s3://{s3_env}/run/{kind}.parquet"
    write_artifact(uri, kind, SAMPLES[kind])
    assert read_artifact(uri, kind).to_pylist() == artifacts.to_table(kind, SAMPLES[kind]).to_pylist()


def test_dataframe_input(tmp_path):
    import pandas as pd

    uri = str(tmp_path / "r.parquet")
    write_artifact(uri, "rollouts", pd.DataFrame(SAMPLES["rollouts"]))
    assert artifacts.read_frame(uri, "rollouts")["response"].tolist() == ["4", "5", "6"]


def _raw_parquet(path, table: pa.Table, kind: str | None = "rollouts", version: str = "1") -> str:
    meta = {}
    if kind is not None:
        meta[b"dynamicrubric.kind"] = kind.encode()
        meta[b"dynamicrubric.schema_version"] = version.encode()
    pq.write_table(table.replace_schema_metadata(meta), path)
    return str(path)


def _rollouts(**changes) -> pa.Table:
    table = artifacts.to_table("rollouts", SAMPLES["rollouts"])
    for name, column in changes.items():
        if column is None:
            table = table.drop_columns([name])
        else:
            idx = table.schema.get_field_index(name)
            table = table.set_column(idx, name, column) if idx >= 0 else table.append_column(name, column)
    return table


BAD_INPUTS = {
    "not parquet": (lambda p: _write(p, b"prompt_id,response\np0,hi\n"), "not a readable Parquet file"),
    "truncated parquet": (lambda p: _write(p, _truncated(p)), "not a readable Parquet file"),
    "no kind metadata": (lambda p: _raw_parquet(p, _rollouts(), kind=None), "has no 'dynamicrubric.kind'"),
    "unknown kind": (
        lambda p: _raw_parquet(p, _rollouts(), kind="bananas"),
        "unknown artifact kind 'bananas'",
    ),
    "wrong schema version": (lambda p: _raw_parquet(p, _rollouts(), version="99"), "schema version '99'"),
    "missing column": (lambda p: _raw_parquet(p, _rollouts(response=None)), "missing column 'response'"),
    "extra column": (
        lambda p: _raw_parquet(p, _rollouts(colour=pa.array(["r", "g", "b"]))),
        "unexpected column 'colour'",
    ),
    "wrong type": (
        lambda p: _raw_parquet(p, _rollouts(num_tokens=pa.array(["1", "2", "3"]))),
        "column 'num_tokens' has type string, expected int32",
    ),
    "null not allowed": (
        lambda p: _raw_parquet(p, _rollouts(response=pa.array(["a", None, "c"]))),
        "column 'response' has 1 null(s)",
    ),
    "duplicate keys": (
        lambda p: _raw_parquet(p, _rollouts(sample_idx=pa.array([0, 0, 1], pa.int32()))),
        "duplicate key {'prompt_id': 'p0', 'sample_idx': 0}",
    ),
    "empty where rows required": (
        lambda p: _raw_parquet(p, artifact_kinds.empty_table("rollouts")),
        "'rollouts' artifact is empty",
    ),
    "negative sample index": (
        lambda p: _raw_parquet(p, _rollouts(sample_idx=pa.array([0, -1, 2], pa.int32()))),
        "column 'sample_idx' has value -1",
    ),
    "weight out of range": (
        lambda p: _raw_parquet(
            p,
            artifacts.to_table("judgments", [dict(SAMPLES["judgments"][0], weight=7)]),
            kind="judgments",
        ),
        "column 'weight' has value 7, expected 1..5",
    ),
    "rubric item weight out of range": (
        lambda p: _raw_parquet(
            p,
            artifacts.to_table("rubrics", [dict(SAMPLES["rubrics"][0], items=[{"text": "x", "weight": 0}])]),
            kind="rubrics",
        ),
        "column 'items.weight' has value 0, expected 1..5",
    ),
    "p_yes out of range": (
        lambda p: _raw_parquet(
            p, artifacts.to_table("judgments", [dict(SAMPLES["judgments"][0], p_yes=1.5)]), kind="judgments"
        ),
        "column 'p_yes' has value 1.5",
    ),
    "NaN score": (
        lambda p: _raw_parquet(
            p, artifacts.to_table("scores", [dict(SAMPLES["scores"][0], score=float("nan"))]), kind="scores"
        ),
        "column 'score' has 1 NaN or infinite value(s), the first in row 0",
    ),
    "infinite reward": (
        lambda p: _raw_parquet(
            p,
            artifacts.to_table(
                "rewards", [SAMPLES["rewards"][1], dict(SAMPLES["rewards"][0], r_anchor=-math.inf)]
            ),
            kind="rewards",
        ),
        "column 'r_anchor' has 1 NaN or infinite value(s), the first in row 1",
    ),
    "invalid UTF-8 text": (
        lambda p: _raw_parquet(p, _rollouts(response=_not_utf8(["4", "5", "6"]))),
        "column 'response' has text that is not valid UTF-8",
    ),
    "invalid UTF-8 in a rubric item": (
        lambda p: _raw_parquet(p, _rubric_with_bad_item_text(), kind="rubrics"),
        "column 'items' has text that is not valid UTF-8",
    ),
}


def _not_utf8(strings: list[str]) -> pa.Array:
    """`strings` with the first replaced by bytes that are not UTF-8 (pyarrow does not check on build)."""
    values = [b"\xc3\x28", *(v.encode() for v in strings[1:])]
    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + len(v))
    buffers = [None, pa.array(offsets, pa.int32()).buffers()[1], pa.py_buffer(b"".join(values))]
    return pa.Array.from_buffers(pa.string(), len(values), buffers)


def _rubric_with_bad_item_text() -> pa.Table:
    table = artifacts.to_table("rubrics", SAMPLES["rubrics"][:1])
    items = table.column("items").combine_chunks()
    texts = _not_utf8(pc.struct_field(items.flatten(), "text").to_pylist())
    struct = pa.StructArray.from_arrays(
        [texts, pc.struct_field(items.flatten(), "weight")], fields=list(artifact_kinds.RUBRIC_ITEM)
    )
    rebuilt = pa.ListArray.from_arrays(items.offsets, struct, type=table.schema.field("items").type)
    return table.set_column(table.schema.get_field_index("items"), "items", rebuilt)


def test_nan_is_refused_on_write_too(tmp_path):
    with pytest.raises(ArtifactError, match="column 'score' has 1 NaN or infinite value"):
        write_artifact(str(tmp_path / "s.parquet"), "scores", [dict(SAMPLES["scores"][0], score=math.nan)])
    assert not (tmp_path / "s.parquet").exists()
    # an undefined metric is a NaN value, and allowed; so is a verdict the verifier could not score
    # (the judge counts it, aggregation refuses it by name: tests/test_judge.py)
    write_artifact(str(tmp_path / "m.parquet"), "metrics", [dict(SAMPLES["metrics"][0], value=math.nan)])
    write_artifact(str(tmp_path / "j.parquet"), "judgments", [dict(SAMPLES["judgments"][0], p_yes=math.nan)])


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _truncated(path) -> bytes:
    write_artifact(str(path), "rollouts", SAMPLES["rollouts"])
    data = path.read_bytes()
    return data[: len(data) // 2]


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_a_clear_error(tmp_path, case):
    make, expected = BAD_INPUTS[case]
    path = tmp_path / "bad.parquet"
    uri = make(path)
    with pytest.raises(ArtifactError) as err:
        read_artifact(uri)
    message = str(err.value)
    assert expected in message
    assert str(path) in message  # the error names the file


def test_expected_kind_mismatch(tmp_path):
    uri = str(tmp_path / "x.parquet")
    write_artifact(uri, "scores", SAMPLES["scores"])
    with pytest.raises(ArtifactError, match="expected a 'rollouts' artifact, found 'scores'"):
        read_artifact(uri, "rollouts")


def test_write_refuses_bad_data_and_leaves_nothing(tmp_path):
    uri = tmp_path / "r.parquet"
    with pytest.raises(ArtifactError, match="duplicate key"):
        write_artifact(str(uri), "rollouts", SAMPLES["rollouts"] + SAMPLES["rollouts"][:1])
    with pytest.raises(ArtifactError, match="missing column 'seed'"):
        write_artifact(
            str(uri), "rollouts", [{k: v for k, v in r.items() if k != "seed"} for r in SAMPLES["rollouts"]]
        )
    assert list(tmp_path.iterdir()) == []


def test_cli_validate(tmp_path):
    good = str(tmp_path / "good.parquet")
    write_artifact(good, "rollouts", SAMPLES["rollouts"])
    bad = _raw_parquet(tmp_path / "bad.parquet", _rollouts(finish_reason=None))
    run = [sys.executable, "-m", "dynamicrubric.cli", "validate"]
    ok = subprocess.run([*run, good], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "kind=rollouts rows=3" in ok.stdout
    res = subprocess.run([*run, good, bad], capture_output=True, text=True)
    assert res.returncode == 1
    assert "missing column 'finish_reason'" in res.stdout and bad in res.stdout


def test_a_per_step_artifact_keeps_its_optional_step_column(tmp_path):
    """The online trainers stamp `step` on each step's artifacts; the same kind without it stays valid,
    and any other extra column is still refused."""
    rows = {
        "prompt_id": ["a", "a"],
        "rubric_idx": [0, 0],
        "sample_idx": [0, 1],
        "score": [0.5, 1.0],
        "num_items": [2, 2],
    }
    plain = pa.table(rows)
    stamped = plain.append_column("step", pa.array([3, 3], pa.int32()))
    uri = str(tmp_path / "scores.parquet")
    write_artifact(uri, "scores", stamped)
    back = read_artifact(uri, "scores")
    assert back.schema.names == [*rows, "step"] and back.column("step").to_pylist() == [3, 3]
    write_artifact(uri, "scores", plain)
    assert read_artifact(uri, "scores").schema.names == list(rows)
    with pytest.raises(ArtifactError, match="unexpected column 'round'"):
        write_artifact(uri, "scores", plain.append_column("round", pa.array([1, 1])))
    with pytest.raises(ArtifactError, match="'step' has 1 null"):
        write_artifact(uri, "scores", plain.append_column("step", pa.array([1, None], pa.int32())))
