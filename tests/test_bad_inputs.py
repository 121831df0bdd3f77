"""Every `dynrubric stage ...` command (and `validate`) fed bad inputs.

Each case must end with one short `error:` line (no traceback), a non-zero exit, and no output written.
The commands run in-process through `cli.main`, so a hundred cases take seconds, not the minutes that
a hundred interpreter starts would.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynamicrubric import cli, cli_errors, store
from dynamicrubric.infra import artifact_kinds, artifacts
from dynamicrubric.infra.artifacts import write_artifact

# ---- good inputs: two arithmetic prompts, K=2 responses each, one rubric of two items per prompt

PROMPTS = [
    {
        "prompt_id": f"p{i}",
        "task": "basic_arithmetic",
        "prompt": f"{i} + 2 = ?",
        "reference": str(i + 2),
        "meta": None,
    }
    for i in range(2)
]
ROLLOUTS = [
    {
        "prompt_id": f"p{i}",
        "sample_idx": s,
        "prompt": f"{i} + 2 = ?",
        "response": str(i + 2 + s),
        "num_tokens": 1,
        "finish_reason": "stop",
        "policy": "tiny-random",
        "seed": 0,
    }
    for i in range(2)
    for s in range(2)
]
RUBRICS = [
    {
        "prompt_id": f"p{i}",
        "rubric_idx": 0,
        "variant": "dynamic",
        "generator": "tiny-random",
        "generator_prompt": "...",
        "completion": "1. (5) correct\n2. (2) short",
        "finish_reason": "stop",
        "parse_status": "lines",
        "items": [{"text": "correct", "weight": 5}, {"text": "short", "weight": 2}],
    }
    for i in range(2)
]
JUDGMENTS = [
    {
        "prompt_id": f"p{i}",
        "rubric_idx": 0,
        "item_idx": m,
        "sample_idx": s,
        "weight": (5, 2)[m],
        "verdict": s == 0,
        "p_yes": 0.9 if s == 0 else 0.1,
    }
    for i in range(2)
    for m in range(2)
    for s in range(2)
]
ANCHORS = [
    {"list_id": "l0", "sample_idx": s, "rank": s + 1, "prompt": "q", "response": f"a{s}", "source": "nectar"}
    for s in range(3)
]
SCORES = [
    {"prompt_id": f"p{i}", "rubric_idx": 0, "sample_idx": s, "score": float(s == 0), "num_items": 2}
    for i in range(2)
    for s in range(2)
]
REWARDS = [
    {"prompt_id": f"p{i}", "rubric_idx": 0, "r_disc": 0.1, "r_anchor": None, "num_items": 2} for i in range(2)
]
GOOD = {
    "prompts": PROMPTS,
    "rollouts": ROLLOUTS,
    "rubrics": RUBRICS,
    "judgments": JUDGMENTS,
    "anchors": ANCHORS,
    "scores": SCORES,
    "rewards": REWARDS,
}

# Each stage: its arguments, with {kind} placeholders for inputs and {out} for its output folder.
STAGES: dict[str, list[str]] = {
    "rollout": ["--prompts", "{prompts}", "--out", "{out}/rollouts.parquet"],
    "rubrics": ["--candidate-sets", "{rollouts}", "--out", "{out}/rubrics.parquet"],
    "judge": ["--candidate-sets", "{rollouts}", "--rubrics", "{rubrics}", "--out", "{out}/judgments.parquet"],
    "prepare-data": [
        "--out-train-prompts", "{out}/train.parquet", "--out-eval-prompts", "{out}/eval.parquet",
        "--out-anchor-lists", "{out}/anchors.parquet",
    ],
    "candidates": [
        "--rollouts", "{rollouts}", "--prompts", "{prompts}", "--anchor-lists", "{anchors}",
        "--out-candidate-sets", "{out}/candidates.parquet", "--out-anchors", "{out}/ranked.parquet",
    ],
    "aggregate": [
        "--judgments", "{judgments}", "--candidate-sets", "{rollouts}", "--rubrics", "{rubrics}",
        "--anchors", "{anchors}", "--out-scores", "{out}/scores.parquet", "--out-rewards",
        "{out}/rewards.parquet", "--out-diagnostics", "{out}/diagnostics.parquet",
        "--out-metrics", "{out}/metrics.parquet",
    ],
    "train-evaluator": [
        "--candidate-sets", "{rollouts}", "--anchors", "{anchors}", "--generator", "tiny-random",
        "--out-generator", "{out}/generator", "--out-steps", "{out}/steps", "--out-metrics", "{out}/metrics.parquet",
    ],
    "train-policy": [
        "--prompts", "{prompts}", "--policy", "tiny-random",
        "--out-policy", "{out}/policy", "--out-steps", "{out}/steps", "--out-metrics", "{out}/metrics.parquet",
    ],
    "evaluate": [
        "--eval-prompts", "{prompts}", "--policy", "tiny-random", "--generator", "tiny-random",
        "--verifier", "tiny-random", "--out-metrics", "{out}/metrics.parquet", "--out-plots", "{out}/plots",
    ],
}  # fmt: skip
INPUTS = {stage: [k for k in GOOD if f"{{{k}}}" in args] for stage, args in STAGES.items()}


# ---- bad versions of an artifact


def _write_raw(path: Path, table: pa.Table, kind: str) -> str:
    meta = {
        artifact_kinds.KIND_KEY: kind.encode(),
        artifact_kinds.VERSION_KEY: artifact_kinds.SCHEMA_VERSION.encode(),
    }
    pq.write_table(table.replace_schema_metadata(meta), path)
    return str(path)


def _invalid_utf8(column: pa.ChunkedArray) -> pa.Array:
    """`column` with its first string made invalid UTF-8 (pyarrow builds it without checking, as a
    foreign writer may)."""
    values = [b"\xff\xfe", *(v.encode() for v in column.to_pylist()[1:])]
    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + len(v))
    buffers = [None, pa.array(offsets, pa.int32()).buffers()[1], pa.py_buffer(b"".join(values))]
    return pa.Array.from_buffers(pa.string(), len(values), buffers)


def _first(table: pa.Table, pred) -> str:
    return next(f.name for f in table.schema if pred(f))


def bad_file(kind: str, how: str, folder: Path) -> str:
    """An artifact of `kind` broken in one way: the file a user or a foreign tool might hand us."""
    path = folder / f"{kind}-{how}.parquet"
    table = artifacts.to_table(kind, GOOD[kind])
    if how == "missing-file":
        return str(folder / f"no-such-{kind}.parquet")
    if how == "malformed-parquet":
        path.write_bytes(b"PAR1 this is not a parquet file")
        return str(path)
    if how == "not-a-parquet-at-all":
        path.write_bytes(b"\x00\xff" * 100)
        return str(path)
    if how == "empty-file":
        path.write_bytes(b"")
        return str(path)
    if how == "missing-column":
        return _write_raw(path, table.drop_columns([table.schema.names[-1]]), kind)
    if how == "wrong-type":
        name = _first(table, lambda f: pa.types.is_string(f.type))
        column = pa.array(range(table.num_rows), pa.int64())
        return _write_raw(path, table.set_column(table.schema.get_field_index(name), name, column), kind)
    if how == "invalid-utf8":
        name = _first(table, lambda f: pa.types.is_string(f.type))
        idx = table.schema.get_field_index(name)
        return _write_raw(path, table.set_column(idx, name, _invalid_utf8(table.column(idx))), kind)
    if how == "wrong-kind":
        other = "anchors" if kind != "anchors" else "prompts"
        write_artifact(str(path), other, GOOD[other])
        return str(path)
    if how in ("nan", "inf"):
        name = _first(table, lambda f: pa.types.is_floating(f.type) and not f.nullable)
        values = table.column(name).to_pylist()
        values[0] = math.nan if how == "nan" else math.inf
        column = pa.array(values, table.schema.field(name).type)
        return _write_raw(path, table.set_column(table.schema.get_field_index(name), name, column), kind)
    if how == "huge-id":  # a duplicated 4 MB id: the error names it, and must not echo all of it
        rows = [dict(r) for r in GOOD[kind]]
        key = artifact_kinds.kind(kind).keys[0]
        rows[1] = {**rows[0]}
        rows[0][key] = rows[1][key] = "x" * (4 << 20)
        return _write_raw(path, pa.Table.from_pylist(rows, schema=artifact_kinds.kind(kind).schema), kind)
    raise AssertionError(how)


FILE_PROBLEMS = [
    "missing-file",
    "malformed-parquet",
    "not-a-parquet-at-all",
    "empty-file",
    "missing-column",
    "wrong-type",
    "invalid-utf8",
    "wrong-kind",
]
FLOAT_KINDS = [
    k
    for k in GOOD
    if any(pa.types.is_floating(f.type) and not f.nullable for f in artifact_kinds.kind(k).schema)
]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("good")
    return {kind: _write(folder / f"{kind}.parquet", kind, rows) for kind, rows in GOOD.items()}


def _write(path: Path, kind: str, rows: list[dict]) -> str:
    write_artifact(str(path), kind, rows)
    return str(path)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_clean_failure(code: int, output: str, out: Path | None, prefix: str = "error: ") -> str:
    assert code not in (0, None), output[-2000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith(prefix)]
    assert len(errors) == 1, output[-2000:]
    assert len(errors[0]) <= len(prefix) + cli_errors.MAX_ERROR_CHARS, errors[0][:500]
    if out is not None:
        left = sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []
        assert left == [], f"partial output left behind: {left}"
    return errors[0]


def stage_argv(
    stage: str, good: dict[str, str], out: Path, *, preset: str = "tiny", **replace: str
) -> list[str]:
    paths = {**good, **replace}
    args = [a.format(out=out, **paths) for a in STAGES[stage]]
    return ["stage", stage, "--preset", preset, *args]


# ---- the table


CASES = [(stage, kind, how) for stage, kinds in INPUTS.items() for kind in kinds for how in FILE_PROBLEMS]
CASES += [
    (stage, kind, how)
    for stage, kinds in INPUTS.items()
    for kind in kinds
    if kind in FLOAT_KINDS
    for how in ("nan", "inf")
]


@pytest.mark.parametrize("stage,kind,how", CASES, ids=[f"{s}-{k}-{h}" for s, k, h in CASES])
def test_bad_input_file(stage, kind, how, good, tmp_path, capsys):
    bad = bad_file(kind, how, tmp_path)
    out = tmp_path / "out"
    code, output = run_cli(stage_argv(stage, good, out, **{kind: bad}), capsys)
    line = assert_clean_failure(code, output, out)
    assert (Path(bad).name in line) or (how == "wrong-kind" and kind in line), line  # names the file


NON_UTF8_CONFIG = b"preset: tiny\nseed: 1 # caf\xe9\n"


@pytest.mark.parametrize("stage", list(STAGES))
def test_non_utf8_config(stage, good, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_bytes(NON_UTF8_CONFIG)
    out = tmp_path / "out"
    code, output = run_cli([*stage_argv(stage, good, out), "--config", str(config)], capsys)
    line = assert_clean_failure(code, output, out)
    assert line == f"error: {config}: not UTF-8 text (invalid byte at offset 26)"


@pytest.mark.parametrize("stage", list(STAGES))
def test_unreachable_store(stage, good, tmp_path, capsys, monkeypatch):
    """The output's store cannot be reached: the stage says so before loading any model."""
    from services import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv(store.RETRY_BUDGET_ENV, "0")  # give up at once (the default waits 2 minutes)
    store.reset_client()
    try:
        code, output = run_cli(stage_argv(stage, good, "s3://bucket/run"), capsys)
    finally:
        store.reset_client()
    line = assert_clean_failure(code, output, None)
    assert "cannot reach the S3 endpoint" in line, line
    assert "Loading" not in output and "tiny-random" not in output.replace(line, "")


@pytest.mark.parametrize("stage", list(STAGES))
def test_missing_output_bucket(stage, good, tmp_path, capsys, s3_env):
    code, output = run_cli(stage_argv(stage, good, "s3://no-such-bucket-for-outputs/run"), capsys)
    line = assert_clean_failure(code, output, None)
    assert line.endswith(": the bucket does not exist"), line
    assert store.list_files(f"s3://{s3_env}") == []


@pytest.mark.parametrize("stage", ["rollout", "candidates"])
@pytest.mark.parametrize(
    "shards", [["--num-shards", "0"], ["--num-shards", "-1"], ["--shard", "2", "--num-shards", "2"]]
)
def test_bad_shards(stage, shards, good, tmp_path, capsys):
    out = tmp_path / "out"
    code, output = run_cli([*stage_argv(stage, good, out), *shards], capsys)
    line = assert_clean_failure(code, output, out)
    assert "shard" in line


def test_usage_errors_are_one_line(good, tmp_path, capsys):
    out = tmp_path / "out"
    code, output = run_cli(["stage", "rollout", "--prompts", good["prompts"]], capsys)  # no --out
    line = assert_clean_failure(code, output, out)
    assert "--out" in line and code == 2
    code, output = run_cli([*stage_argv("rollout", good, out), "--num-shards", "many"], capsys)
    assert "invalid int value: 'many'" in assert_clean_failure(code, output, out)


def test_aggregate_error_is_one_line(good, tmp_path, capsys):
    """Judgments of a response that is not among the rollouts: AggregateError, a ValueError, not a crash."""
    rows = [dict(r) for r in JUDGMENTS]
    rows[0]["sample_idx"] = 7
    judgments = _write(tmp_path / "j.parquet", "judgments", rows)
    out = tmp_path / "out"
    code, output = run_cli(stage_argv("aggregate", good, out, judgments=judgments), capsys)
    line = assert_clean_failure(code, output, out)
    assert "judgment" in line


def test_aggregate_leaves_no_output_when_a_later_output_fails(good, tmp_path, capsys):
    """The diagnostics (third output) cannot be published: the first two are not left behind."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "diagnostics.parquet").mkdir()  # a folder where the file should go
    code, output = run_cli(stage_argv("aggregate", good, out), capsys)
    assert_clean_failure(code, output, None)
    assert sorted(p.name for p in out.iterdir()) == ["diagnostics.parquet"]
    (out / "diagnostics.parquet").rmdir()
    code, output = run_cli(stage_argv("aggregate", good, out), capsys)  # the same inputs are fine
    assert code == 0, output[-2000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "diagnostics.parquet",
        "metrics.parquet",
        "rewards.parquet",
        "scores.parquet",
    ]


def test_good_inputs_pass(good, tmp_path, capsys):
    """The table's failures come from the bad input, not from the good ones around it."""
    for stage in ("candidates", "aggregate"):
        out = tmp_path / stage
        code, output = run_cli(stage_argv(stage, good, out), capsys)
        assert code == 0, output[-2000:]
    code, output = run_cli(["validate", *good.values()], capsys)
    assert code == 0, output


# ---- long prompts: checked against the model's context, as configured


def _long_prompts(tmp_path: Path) -> str:
    rows = [dict(r) for r in PROMPTS]
    rows[0]["prompt"] = "1 + " * (1 << 20)  # 4 MB
    return _write(tmp_path / "long.parquet", "prompts", rows)


def test_four_megabyte_prompt_is_rejected(good, tmp_path, capsys):
    out = tmp_path / "out"
    code, output = run_cli(stage_argv("rollout", good, out, prompts=_long_prompts(tmp_path)), capsys)
    line = assert_clean_failure(code, output, out)
    assert "exceeds the context length 2048 of 'tiny-random'" in line, line
    assert "engine.long_prompts: truncate" in line


def test_four_megabyte_prompt_is_truncated_when_configured(good, tmp_path, capsys):
    config = tmp_path / "truncate.yaml"
    config.write_text("engine: {long_prompts: truncate}\n")
    out = tmp_path / "out"
    argv = stage_argv("rollout", good, out, prompts=_long_prompts(tmp_path))
    code, output = run_cli([*argv, "--config", str(config)], capsys)
    assert code == 0, output[-2000:]
    assert "cut to its last" in output and "1 prompt(s) truncated so far" in output
    assert artifacts.read_frame(str(out / "rollouts.parquet"), "rollouts")["prompt_id"].nunique() == 2


# ---- validate


VALIDATE_CASES = [(kind, how) for kind in GOOD for how in FILE_PROBLEMS if how != "wrong-kind"]
# A NaN p_yes is a verdict the verifier could not score: a valid judgments row (the judge counts it and
# aggregation refuses it, naming the file), so validate accepts it.
VALIDATE_CASES += [
    (kind, how) for kind in FLOAT_KINDS for how in ("nan", "inf") if (kind, how) != ("judgments", "nan")
]
VALIDATE_CASES += [("prompts", "huge-id"), ("rollouts", "huge-id")]


@pytest.mark.parametrize("kind,how", VALIDATE_CASES, ids=[f"{k}-{h}" for k, h in VALIDATE_CASES])
def test_validate_rejects(kind, how, good, tmp_path, capsys):
    bad = bad_file(kind, how, tmp_path)
    code, output = run_cli(["validate", good["prompts"], bad], capsys)
    line = assert_clean_failure(code, output, None, prefix="FAIL ")
    assert line.startswith(f"FAIL {bad}"), line[:300]
    assert f"OK   {good['prompts']}" in output  # the other file is still checked


def test_error_messages_are_capped():
    assert cli_errors.one_line("a\nb\t c") == "a b c"
    long = cli_errors.one_line("x" * 10_000 + ": the cause")
    head, more, tail = long.split(" ... ")
    assert len(long) <= cli_errors.MAX_ERROR_CHARS and head == "x" * len(head)
    assert tail.endswith("x: the cause") and set(tail.removesuffix(": the cause")) == {"x"}
    assert more == f"({10_011 - len(head) - len(tail)} more chars)"


@pytest.mark.parametrize("before", ["Loading weights: 100%|##########| 20/20", "a whole line\n", ""])
def test_the_error_line_starts_a_line_of_its_own(before, monkeypatch, capsys):
    """A stop can come inside a progress bar's close, after its last frame and before its newline (CI's
    SIGTERM test saw "...20/20 [00:00]error: stopped by SIGTERM"): the error line still starts a line."""
    stream = cli_errors.LineEnds(sys.stderr)
    monkeypatch.setattr(sys, "stderr", stream)
    stream.write(before)
    cli_errors.error_line("error: stopped by SIGTERM", stream)
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "error: stopped by SIGTERM" and "\n\n" not in err


def test_artifacts_are_group_readable(tmp_path):
    """Not 0600 (what a temp file gets): the usual umask 022 gives 0644, and a stricter umask is obeyed."""
    for umask, mode in ((0o022, 0o644), (0o077, 0o600)):
        old = os.umask(umask)
        try:
            path = _write(tmp_path / f"{umask:o}.parquet", "prompts", PROMPTS)
        finally:
            os.umask(old)
        assert Path(path).stat().st_mode & 0o777 == mode


def test_evaluate_leaves_no_metrics_when_its_plots_cannot_be_published(good, tmp_path, capsys):
    """The whole evaluation runs, then the plots folder cannot be written (a file is in its place): the
    metrics written before are removed again, and no plots folder is left."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "plots").write_text("not a folder")
    code, output = run_cli(stage_argv("evaluate", good, out), capsys)
    line = assert_clean_failure(code, output, None)
    assert line == f"error: {out / 'plots'}: exists and is not a folder"
    assert sorted(p.name for p in out.iterdir()) == ["plots"] and (out / "plots").is_file()


def test_four_megabyte_prompt_is_rejected_by_the_judge(good, tmp_path, capsys):
    """The verifier's prompt holds the task (responses are clipped to judge.max_response_chars): a 4 MB
    task is checked against the context too, in the judge's own code path (yes_probability)."""
    rows = [dict(r) for r in ROLLOUTS]
    for row in rows[:2]:  # both samples of p0 share the prompt
        row["prompt"] = "1 + " * (1 << 20)  # 4 MB
    rollouts = _write(tmp_path / "long.parquet", "rollouts", rows)
    out = tmp_path / "out"
    code, output = run_cli(stage_argv("judge", good, out, rollouts=rollouts), capsys)
    line = assert_clean_failure(code, output, out)
    assert "judge: prompt" in line and "exceeds the context length 2048 of 'tiny-random'" in line, line


# ---- the training stages, as a user runs them: a fresh process, its whole output (both descriptors)


def run_cli_process(argv: list[str]) -> tuple[int, str]:
    """`dynrubric ...` in its own process, stdout and stderr together: the training stages start
    `accelerate launch` children, whose output capsys would not see."""
    proc = subprocess.run(
        [sys.executable, "-m", "dynamicrubric.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
        timeout=600,
    )
    return proc.returncode, proc.stdout


TRAIN_CASES = [("train-policy", "prompts", "missing-column"), ("train-evaluator", "rollouts", "wrong-type")]


@pytest.mark.parametrize("stage,kind,how", TRAIN_CASES, ids=[f"{s}-{k}-{h}" for s, k, h in TRAIN_CASES])
def test_training_refuses_a_bad_input_before_it_launches(stage, kind, how, good, tmp_path):
    """The inputs are read in the launching process: one line, no traceback from a training child."""
    bad = bad_file(kind, how, tmp_path)
    out = tmp_path / "out"
    code, output = run_cli_process(stage_argv(stage, good, out, **{kind: bad}))
    line = assert_clean_failure(code, output, out)
    assert Path(bad).name in line, line
    assert "accelerate" not in output, output[-2000:]  # no training process was started


def test_training_refuses_a_prompt_over_the_context(good, tmp_path):
    out = tmp_path / "out"
    code, output = run_cli_process(stage_argv("train-policy", good, out, prompts=_long_prompts(tmp_path)))
    line = assert_clean_failure(code, output, out)
    assert line.startswith("error: train-policy: prompt 'p0' has "), line
    assert "exceeds the context length 2048 of 'tiny-random'" in line, line
    assert "accelerate" not in output, output[-2000:]


def test_evaluator_training_refuses_a_candidate_set_over_the_context(good, tmp_path):
    """The generator's prompt holds the set's task: a 4 MB one cannot fit."""
    rows = [dict(r) for r in ROLLOUTS]
    for row in rows[:2]:  # both samples of p0 share the prompt
        row["prompt"] = "1 + " * (1 << 20)  # 4 MB
    rollouts = _write(tmp_path / "long.parquet", "rollouts", rows)
    out = tmp_path / "out"
    code, output = run_cli_process(stage_argv("train-evaluator", good, out, rollouts=rollouts))
    line = assert_clean_failure(code, output, out)
    assert line.startswith("error: train-evaluator: prompt 'p0' has "), line
    assert "exceeds the context length 2048 of 'tiny-random'" in line, line


@pytest.mark.parametrize("command", ["run", "compile"])
def test_zero_rounds_is_refused(command, tmp_path):
    """`--rounds 0` ran the config's rounds (0 read as "not given")."""
    argv = [command, "--preset", "tiny", "--rounds", "0"]
    code, output = run_cli_process(argv if command == "run" else [*argv, "--out", str(tmp_path / "p.yaml")])
    line = assert_clean_failure(code, output, None)
    assert line == "error: --rounds: expected at least 1 round, got 0", line
    assert not (tmp_path / "p.yaml").exists()


def _alias_bomb() -> str:
    """A 0.5 KB billion-laughs config: nine levels of nine aliases, the last under a known key."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(["lol:", *("  " + line for line in lines), "rollout:", "  k: *l8"]) + "\n"


HOSTILE_CONFIGS = {
    "alias-bomb": (_alias_bomb(), "line 3: YAML aliases (*name) are not allowed in a config"),
    "5000-deep": ("rollout:\n  k: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 32 levels deep"),
    "infinite-temperature": ("rollout:\n  temperature: .inf\n", "rollout.temperature"),
    "infinite-learning-rate": ("train_policy:\n  learning_rate: -.inf\n", "train_policy.learning_rate"),
    "huge-num-prompts": ("data:\n  num_prompts: 100000000\n", "data.num_prompts"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CONFIGS))
def test_a_hostile_config_is_refused_by_the_cli_in_one_line(case, good, tmp_path):
    """What test_config checks on load_config, here as a user meets it: a stage's whole output, from
    its own process, before any model loads."""
    text, message = HOSTILE_CONFIGS[case]
    config = tmp_path / "c.yaml"
    config.write_text(text)
    out = tmp_path / "out"
    code, output = run_cli_process([*stage_argv("rollout", good, out), "--config", str(config)])
    line = assert_clean_failure(code, output, out)
    assert line.startswith(f"error: {config}: ") and message in line, line
    assert "Loading" not in output, output[-2000:]


def _same_path_case(case: str, good: dict[str, str], tmp_path: Path) -> tuple[list[str], str]:
    """argv of a stage with two of its paths made one, and that path."""
    out = tmp_path / "out"
    if case == "output-is-an-input":
        prompts = tmp_path / "prompts.parquet"
        prompts.write_bytes(Path(good["prompts"]).read_bytes())
        argv = stage_argv("rollout", good, out, prompts=str(prompts))
        argv[argv.index("--out") + 1] = str(prompts)
        return argv, str(prompts)
    stage, first, second = {
        "two-outputs-prepare-data": ("prepare-data", "--out-train-prompts", "--out-eval-prompts"),
        "two-outputs-aggregate": ("aggregate", "--out-scores", "--out-rewards"),
    }[case]
    argv = stage_argv(stage, good, out)
    argv[argv.index(second) + 1] = argv[argv.index(first) + 1]
    return argv, argv[argv.index(first) + 1]


@pytest.mark.parametrize("case", ["output-is-an-input", "two-outputs-prepare-data", "two-outputs-aggregate"])
def test_one_path_for_two_files_is_refused(case, good, tmp_path):
    """These overwrote one file with the other and exited 0."""
    argv, path = _same_path_case(case, good, tmp_path)
    before = Path(path).read_bytes() if Path(path).exists() else None
    code, output = run_cli_process(argv)
    line = assert_clean_failure(code, output, tmp_path / "out")
    assert line.startswith(f"error: {path}: an output cannot be written where the "), line
    assert (Path(path).read_bytes() if Path(path).exists() else None) == before  # untouched


def test_a_non_utf8_prompt_source_is_refused(tmp_path):
    """prepare-data read a Latin-1 JSONL with replacement characters in its prompts, and exited 0."""
    source = tmp_path / "latin1.jsonl"
    source.write_bytes(b'{"prompt": "caf\xe9?"}\n')
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  sources: [{source}]\n")
    out = tmp_path / "out"
    code, output = run_cli_process([*stage_argv("prepare-data", {}, out), "--config", str(config)])
    line = assert_clean_failure(code, output, out)
    assert line == f"error: {source}: not UTF-8 text (invalid byte at offset 15, line 1)", line


@pytest.mark.parametrize(
    "stage,output",
    [
        ("train-policy", "metrics.parquet"),
        ("train-evaluator", "metrics.parquet"),
        ("rollout", "rollouts.parquet"),
    ],
)
def test_a_folder_where_an_output_file_goes_is_refused_before_the_compute(stage, output, good, tmp_path):
    """It passed the pre-compute check: the stage computed everything (train-*: the whole training),
    then failed with a raw [Errno 21] and left its files behind."""
    out = tmp_path / "out"
    (out / output).mkdir(parents=True)
    code, output_text = run_cli_process(stage_argv(stage, good, out))
    line = assert_clean_failure(code, output_text, None)
    assert line == f"error: {out / output}: exists and is a folder, not a file", line
    assert "accelerate" not in output_text and "Loading" not in output_text, output_text[-2000:]
    assert [p.name for p in out.iterdir()] == [output] and not any((out / output).iterdir())


VALUE_CASES = [
    ("prompts", "meta", "not json", "column 'meta' of row 0 is not JSON"),
    ("scores", "sample_idx", -1, "column 'sample_idx' has value -1, expected 0..2147483647"),
    ("scores", "rubric_idx", -3, "column 'rubric_idx' has value -3, expected 0..2147483647"),
    ("rewards", "rubric_idx", -1, "column 'rubric_idx' has value -1, expected 0..2147483647"),
    ("judgments", "item_idx", -1, "column 'item_idx' has value -1, expected 0..2147483647"),
]


@pytest.mark.parametrize(
    "kind,column,value,message", VALUE_CASES, ids=[f"{c[0]}-{c[1]}" for c in VALUE_CASES]
)
def test_validate_rejects_bad_values(kind, column, value, message, good, tmp_path):
    """These passed `validate`: a meta a scorer cannot parse, a negative index."""
    rows = [dict(r) for r in GOOD[kind]]
    rows[0][column] = value
    table = pa.Table.from_pylist(rows, schema=artifact_kinds.kind(kind).schema)
    bad = _write_raw(tmp_path / f"{kind}-{column}.parquet", table, kind)
    code, output = run_cli_process(["validate", good["prompts"], bad])
    line = assert_clean_failure(code, output, None, prefix="FAIL ")
    assert line == f"FAIL {bad}: {message}", line


# ---- `dynrubric run`: what its first tasks would fail on is refused before kfp.local starts


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RUN_CASES = {
    "missing-source": (
        {"data": {"sources": ["{tmp}/nope.jsonl"]}},
        "error: data.sources: {tmp}/nope.jsonl: no such file",
    ),
    "mlflow-server-down": (
        {"pipeline": {"mlflow_tracking_uri": "http://127.0.0.1:{port}"}},
        "error: pipeline.mlflow_tracking_uri: http://127.0.0.1:{port}: no MLflow server answers "
        "(Connection refused)",
    ),
    "sqlite-folder-missing": (
        {"pipeline": {"mlflow_tracking_uri": "sqlite:///{tmp}/no/such/mlflow.db"}},
        "error: pipeline.mlflow_tracking_uri: sqlite:///{tmp}/no/such/mlflow.db: "
        "the database's folder {tmp}/no/such does not exist",
    ),
    "root-is-a-file": (
        {"pipeline": {"pipeline_root": "{tmp}/afile/runs"}},
        "error: pipeline.pipeline_root: {tmp}/afile/runs: Not a directory",
    ),
    # launched, and 20 s later printed 45 lines ending "Inner task failed: 'start-tracking'" (#36 item 8)
    # Path.resolve's RuntimeError, an internal error (#36 item 4)
    "root-through-a-symlink-loop": (
        {"pipeline": {"pipeline_root": "{tmp}/loop/runs"}},
        "error: pipeline.pipeline_root: {tmp}/loop/runs: a symlink loop",
    ),
    "unsupported-tracking-scheme": (
        {"pipeline": {"mlflow_tracking_uri": "foo://bar"}},
        "error: pipeline.mlflow_tracking_uri: foo://bar: unsupported scheme 'foo'; use http(s)://, "
        "sqlite:///, file:// or a database URI (postgresql://, mysql://, mssql://)",
    ),
}


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_run_refuses_before_it_launches(case, tmp_path):
    """These launched the pipeline and failed inside a task (or printed raw errno text)."""
    import yaml

    (tmp_path / "afile").write_text("")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    override, expected = RUN_CASES[case]
    fields = {"tmp": tmp_path, "port": _closed_port()}
    config = {
        "preset": "tiny",
        "pipeline": {
            "pipeline_root": f"{tmp_path}/runs",
            "mlflow_tracking_uri": f"sqlite:///{tmp_path}/m.db",
        },
    }
    for section, values in override.items():
        formatted = {
            k: (v.format(**fields) if isinstance(v, str) else [x.format(**fields) for x in v])
            for k, v in values.items()
        }
        config[section] = {**config.get(section, {}), **formatted}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.monotonic()
    code, output = run_cli_process(["run", "--config", str(path)])
    line = assert_clean_failure(code, output, None)
    assert line == expected.format(**fields), line
    assert time.monotonic() - started < 60, "refused only after a long wait"
    assert "kfp" not in output.lower(), output[-2000:]
    # a refusal writes nothing: an empty runs/ was created before the checks (#36 item 9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "c.yaml", "loop"]


# ---- no output removes what the stage did not write (#36 items 1-3)


def _snapshot(root: Path) -> dict[str, bytes | str | None]:
    """Every file (its bytes), symlink (its target) and folder (None) under `root`: what must be there
    after a refusal."""
    found: dict[str, bytes | str | None] = {}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            p = Path(folder, name)
            found[str(p.relative_to(root))] = (
                os.readlink(p) if p.is_symlink() else None if p.is_dir() else p.read_bytes()
            )
    return found


# Each folder output of each stage: (stage, its flag, a file output of the stage to put inside it).
FOLDER_OUTPUTS = [
    ("evaluate", "--out-plots", "--out-metrics"),
    ("train-evaluator", "--out-generator", "--out-metrics"),
    ("train-evaluator", "--out-steps", "--out-metrics"),
    ("train-policy", "--out-policy", "--out-steps"),
    ("train-policy", "--out-steps", "--out-metrics"),
]
FIRST_INPUT = {"evaluate": "prompts", "train-evaluator": "rollouts", "train-policy": "prompts"}


def _folder_case(stage: str, flag: str, other: str, case: str, good: dict[str, str], tmp: Path) -> list[str]:
    """argv of `stage` with its folder output `flag` pointed at (a) a user's folder, (b) the folder
    holding one of its inputs, or (c) a folder another output (`other`) is inside."""
    kind = FIRST_INPUT[stage]
    data = tmp / "data"
    data.mkdir()
    inputs = {k: str(data / Path(v).name) for k, v in good.items() if k == kind}
    for k, path in inputs.items():
        Path(path).write_bytes(Path(good[k]).read_bytes())
    argv = stage_argv(stage, good, tmp / "out", **inputs)
    target = {"user-folder": tmp / "mine", "holds-an-input": data, "parent-of-an-output": tmp / "out" / "p"}[
        case
    ]
    if case == "user-folder":
        (target / "sub").mkdir(parents=True)
        (target / "notes.txt").write_text("x\n")
        (target / "sub" / "config.json").write_text("{}")
    argv[argv.index(flag) + 1] = str(target)
    if case == "parent-of-an-output":
        argv[argv.index(other) + 1] = str(target / "inside")
    return argv


FOLDER_CASES = [
    (stage, flag, other, case)
    for stage, flag, other in FOLDER_OUTPUTS
    for case in ("user-folder", "holds-an-input", "parent-of-an-output")
]


@pytest.mark.parametrize(
    "stage,flag,other,case",
    FOLDER_CASES,
    ids=[f"{s}{f.removeprefix('--out')}-{c}" for s, f, _, c in FOLDER_CASES],
)
def test_a_folder_output_removes_nothing_it_did_not_write(stage, flag, other, case, good, tmp_path, capsys):
    """Every folder output of every stage pointed at a folder of anything else: a folder output is
    swapped in whole, so the user's files, the inputs or the other output went (exit 0). Refused before
    any model loads, and every byte under the test's folder is as it was."""
    argv = _folder_case(stage, flag, other, case, good, tmp_path)
    before = _snapshot(tmp_path)
    code, output = run_cli(argv, capsys)
    line = assert_clean_failure(code, output, None)
    target = argv[argv.index(flag) + 1]
    expected = {
        "user-folder": f"error: {target}: a folder that dynrubric did not write is there",
        "holds-an-input": f"error: {target}: the folder output would remove the input {target}/",
        "parent-of-an-output": f"error: {target}: the folder output would remove the output {target}/inside,",
    }[case]
    if case == "user-folder" and flag == "--out-steps":
        expected = f"error: {target}: a folder that is not a training run's steps folder is there"
    if case == "parent-of-an-output" and (stage, flag) == ("train-policy", "--out-policy"):
        expected = f"error: {target}/inside: an output cannot be written inside the output {target}"  # order
    assert line.startswith(expected), line
    assert "Loading" not in output and "accelerate" not in output, output[-2000:]
    assert _snapshot(tmp_path) == before


def test_a_folder_output_may_replace_an_earlier_output_of_its_kind(tmp_path):
    """What may be replaced, and what not: a folder this project published (its completion marker) for
    the same kind of output, an empty folder, a training run's steps folder; a published folder of
    another kind, or a marker that is not readable, is refused in one line."""
    from dynamicrubric.evaluation.plots import PLOT_NAMES
    from dynamicrubric.stages.runner import preflight

    def published(name: str, files: list[str]) -> str:
        src = tmp_path / f"src-{name}"
        src.mkdir()
        for rel in files:
            (src / rel).write_bytes(b"x")
        store.upload_dir(src, str(tmp_path / name))
        return str(tmp_path / name)

    plots, model = published("plots", list(PLOT_NAMES)), published("model", ["config.json", "w.bin"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "steps" / "step-00001" / "rank-0").mkdir(parents=True)
    (tmp_path / "steps" / "step-00001" / "rank-0" / "scores.parquet").write_bytes(b"x")
    old = tmp_path / "old-model"  # a marker from before manifests: empty
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / store.COMPLETE_MARKER).write_bytes(b"")
    preflight(folders=[(plots, "plots"), (model, "model"), (str(old), "model")])
    preflight(folders=[(str(tmp_path / "empty"), "plots"), (str(tmp_path / "steps"), "steps")])
    with pytest.raises(ValueError, match=f"^{plots}: holds a dynrubric plots folder, not a model folder; "):
        preflight(folders=[(plots, "model")])
    with pytest.raises(ValueError, match=f"^{model}: holds a dynrubric model folder, not a plots folder; "):
        preflight(folders=[(model, "plots")])
    with pytest.raises(ValueError, match="is not a training run's steps folder"):
        preflight(folders=[(plots, "steps")])
    (Path(model) / store.COMPLETE_MARKER).write_text("{not json")
    with pytest.raises(store.StoreError, match="unreadable completion marker"):
        preflight(folders=[(model, "model")])


def test_evaluate_twice_into_one_plots_folder(good, tmp_path, capsys):
    """The second run replaces the first one's plots (a retried task): the refusals above must not
    stop it."""
    out = tmp_path / "out"
    for _ in range(2):
        code, output = run_cli(stage_argv("evaluate", good, out), capsys)
        assert code == 0, output[-2000:]
    assert store.is_complete(str(out / "plots"))


@pytest.mark.parametrize("case", ["output-loop", "input-loop", "file-uri-with-a-host"])
def test_a_path_that_names_no_place_here_is_refused(case, good, tmp_path, capsys):
    """A symlink loop raised Path.resolve's RuntimeError (an internal error); file://host/p wrote /p
    on this machine."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    out = tmp_path / "out"
    if case == "output-loop":
        argv, bad = stage_argv("evaluate", good, out), f"{loop}/plots"
        argv[argv.index("--out-plots") + 1] = bad
    elif case == "input-loop":
        argv, bad = stage_argv("rollout", good, out, prompts=str(loop)), str(loop)
    else:
        bad = f"file://elsewhere{out}/rollouts.parquet"
        argv = stage_argv("rollout", good, out)
        argv[argv.index("--out") + 1] = bad
    before = _snapshot(tmp_path)
    code, output = run_cli(argv, capsys)
    line = assert_clean_failure(code, output, out)
    reason = "a file:// URI with a host (elsewhere); use file:///path" if "host" in case else "a symlink loop"
    assert line == f"error: {bad}: {reason}", line
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("stage", ["rollout", "aggregate"])
def test_an_s3_uri_spelled_with_two_slashes_is_the_same_object(stage, good, s3_env, capsys):
    """`s3://b//x/p` is the object `s3://b/x/p` to the store (it drops the key's leading `/`): the
    same-path check took them for two, and the output replaced the input (or the other output)."""
    prompts = f"s3://{s3_env}/x/p.parquet"
    store.write_bytes(prompts, Path(good["prompts"]).read_bytes())
    argv = stage_argv(stage, good, f"s3://{s3_env}/out", prompts=prompts)
    if stage == "rollout":
        first, second = prompts, f"s3://{s3_env}//x/p.parquet"
        argv[argv.index("--out") + 1] = second
    else:
        first, second = f"s3://{s3_env}/out/s.parquet", f"s3://{s3_env}//out/s.parquet"
        argv[argv.index("--out-scores") + 1], argv[argv.index("--out-rewards") + 1] = first, second
    code, output = run_cli(argv, capsys)
    line = assert_clean_failure(code, output, None)
    what = "input" if stage == "rollout" else "output"
    assert line == f"error: {second}: an output cannot be written where the {what} {first} is", line
    assert store.list_files(f"s3://{s3_env}") == ["x/p.parquet"]
    assert store.read_bytes(prompts) == Path(good["prompts"]).read_bytes()


@pytest.mark.slow
def test_a_finished_checkpoint_is_reused_only_for_the_same_work(good, tmp_path):
    """train-policy into the complete checkpoint of another config (or other prompts) said "checkpoint
    already complete; nothing to do" and exited 0 with the old run's result. The same work is still
    reused; other work is refused in one line, the checkpoint untouched."""
    config = tmp_path / "c.yaml"
    config.write_text("train_policy: {max_steps: 1}\n")
    out = tmp_path / "out"
    argv = [*stage_argv("train-policy", good, out), "--config", str(config)]
    code, output = run_cli_process(argv)
    assert code == 0, output[-3000:]
    done = _snapshot(out / "policy")
    code, output = run_cli_process(argv)  # the same work: reused
    assert code == 0 and "checkpoint already complete; nothing to do" in output, output[-3000:]
    other = tmp_path / "other.yaml"
    other.write_text("train_policy: {max_steps: 1, learning_rate: 2.0e-4}\n")
    prompts = _write(tmp_path / "more.parquet", "prompts", [*PROMPTS, {**PROMPTS[0], "prompt_id": "p9"}])
    for argv, why in [
        ([*stage_argv("train-policy", good, out), "--config", str(other)], "(config "),
        (
            [*stage_argv("train-policy", good, out, prompts=prompts), "--config", str(config)],
            "(other inputs)",
        ),
    ]:
        (out / "metrics.parquet").unlink(missing_ok=True)
        code, output = run_cli_process(argv)
        line = assert_clean_failure(code, output, None)
        assert line.startswith(
            f"error: train-policy: {out / 'policy'} holds a finished checkpoint of other work "
        ), line
        assert why in line and "nothing to do" not in output, line
        assert not (out / "metrics.parquet").exists()
        assert _snapshot(out / "policy") == done


# ---- #36 items 4-11: what was an uncaught error, silent, unbounded or left files


def _tiny_copy(tmp_path: Path) -> Path:
    """A copy of the built-in tiny-random model's folder, to break."""
    import shutil

    from dynamicrubric.infra.models import prepare_model

    folder = tmp_path / "model"
    shutil.copytree(
        prepare_model("tiny-random"), folder, ignore=shutil.ignore_patterns(store.COMPLETE_MARKER)
    )
    return folder


@pytest.mark.parametrize(
    "stage,case",
    [
        ("train-policy", "truncated-safetensors"),
        ("train-policy", "empty-config"),
        ("rollout", "truncated-safetensors"),
    ],
)
def test_a_broken_model_folder_is_refused_before_training_launches(stage, case, good, tmp_path):
    """A copy that stopped short: train-policy printed 2 tracebacks from its training processes and left
    `.work/scratch`; a config.json of `{}` failed in transformers' tokenizer code."""
    model = _tiny_copy(tmp_path)
    if case == "truncated-safetensors":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        why = "model.safetensors is truncated ("
    else:
        (model / "config.json").write_text("{}")
        why = "config.json names no model_type"
    out = tmp_path / "out"
    argv = stage_argv(stage, good, out)
    if stage == "rollout":
        argv += ["--policy", str(model)]
    else:
        argv[argv.index("--policy") + 1] = str(model)
    before = _snapshot(tmp_path)
    code, output = run_cli_process(argv)
    line = assert_clean_failure(code, output, out)
    assert line.startswith(f"error: model folder {str(model)!r}: {why}"), line
    assert "accelerate" not in output, output[-2000:]
    assert _snapshot(tmp_path) == before


SEED_CASES = {
    "flag-2^64": (["--seed", str(2**64)], None, "error: stage rollout: --seed: expected 0..4294967295, got "),
    "config-2^70": ([], f"seed: {2**70}\n", "seed: Input should be less than or equal to 4294967295"),
    "train-config-2^64": ([], f"train_policy: {{seed: {2**64}}}\n", "train_policy.seed: Input should be"),
    "negative": (["--seed", "-1"], None, "error: stage rollout: --seed: expected 0..4294967295, got -1"),
}


@pytest.mark.parametrize("case", sorted(SEED_CASES))
def test_a_seed_numpy_cannot_take_is_refused_before_any_model_loads(case, good, tmp_path, capsys):
    """`--seed 2^64` / `seed: 2^70` raised an OverflowError once the model had loaded."""
    flags, config_text, expected = SEED_CASES[case]
    out = tmp_path / "out"
    argv = [*stage_argv("rollout", good, out), *flags]
    if config_text:
        (tmp_path / "c.yaml").write_text(config_text)
        argv += ["--config", str(tmp_path / "c.yaml")]
    code, output = run_cli(argv, capsys)
    line = assert_clean_failure(code, output, out)
    assert expected in line, line
    assert "Loading" not in output


def _prepare_data_refusal(source: Path, tmp_path: Path, capsys) -> str:
    """prepare-data (in process) on a config whose one source is `source`: its one-line refusal, checked
    to be clean (a failing exit, no traceback, one error line, no output left)."""
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  sources: [{source}]\n")
    out = tmp_path / "out"
    code, output = run_cli([*stage_argv("prepare-data", {}, out), "--config", str(config)], capsys)
    return assert_clean_failure(code, output, out)


def test_a_source_nested_100000_deep_is_refused(tmp_path, capsys):
    """json.loads raised a RecursionError (an internal error)."""
    source = tmp_path / "deep.jsonl"
    source.write_text('{"prompt": "q", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    line = _prepare_data_refusal(source, tmp_path, capsys)
    assert line == f"error: {source}: line 1 holds a JSON value nested too deep to read", line


def test_a_gzip_bomb_source_is_refused_as_it_inflates(tmp_path, capsys, monkeypatch):
    """gzip.decompress inflated an 11 MB file to 11 GB, then a MemoryError. The limit (1 GiB) is lowered
    to 1 MiB here, so a 64 MiB bomb shows the same refusal in a fraction of a second."""
    import gzip

    from dynamicrubric.tasks import sources

    monkeypatch.setattr(sources, "MAX_SOURCE_BYTES", 1 << 20)
    source = tmp_path / "bomb.jsonl.gz"
    line = b'{"prompt": "' + b" " * 1000 + b'"}\n'
    source.write_bytes(gzip.compress(line * (64 << 10), compresslevel=1))
    line = _prepare_data_refusal(source, tmp_path, capsys)
    assert line == f"error: {source}: inflates to more than 1 MiB, the most a prompt source may hold", line


@pytest.mark.parametrize("case", ["rubrics-samples-0", "aggregate-round-minus-1"])
def test_a_value_read_as_not_given_is_refused(case, good, tmp_path, capsys):
    """`rubrics --samples 0` ran the config's samples (`samples or rc.samples`); `--round -1` wrote
    round -1 into the artifacts."""
    out = tmp_path / "out"
    if case == "rubrics-samples-0":
        argv, expected = (
            [*stage_argv("rubrics", good, out), "--samples", "0"],
            "--samples: expected 1..256, got 0",
        )
    else:
        argv, expected = (
            [*stage_argv("aggregate", good, out), "--round", "-1"],
            "--round: expected 0 or more, got -1",
        )
    code, output = run_cli(argv, capsys)
    line = assert_clean_failure(code, output, out)
    assert line.endswith(expected), line
    assert "Loading" not in output


def test_a_config_key_given_twice_is_refused(good, tmp_path, capsys):
    """PyYAML keeps the last of two equal keys: `k: 4 ... k: 6` ran with 6 and said nothing."""
    config = tmp_path / "c.yaml"
    config.write_text("rollout:\n  k: 4\n  temperature: 1.0\n  k: 6\n")
    out = tmp_path / "out"
    code, output = run_cli([*stage_argv("rollout", good, out), "--config", str(config)], capsys)
    line = assert_clean_failure(code, output, out)
    assert line == f"error: {config}: line 4: key 'k' repeats the one on line 2", line


@pytest.mark.parametrize("where", ["input", "source"])
def test_a_file_uri_with_a_host_is_refused_where_it_is_read(where, good, tmp_path, capsys):
    """file://host/p read /p on this machine."""
    bad = f"file://elsewhere{good['prompts']}"
    out = tmp_path / "out"
    if where == "input":
        argv = stage_argv("rollout", good, out, prompts=bad)
    else:
        (tmp_path / "c.yaml").write_text(f"data:\n  sources: ['{bad}']\n")
        argv = [*stage_argv("prepare-data", {}, out), "--config", str(tmp_path / "c.yaml")]
    code, output = run_cli(argv, capsys)
    line = assert_clean_failure(code, output, out)
    assert line == f"error: {bad}: a file:// URI with a host (elsewhere); use file:///path", line


@pytest.mark.parametrize(
    "text,key",
    [("rollout: {k: 1000000}\n", "rollout.k"), ("evaluate: {samples: 100000}\n", "evaluate.samples")],
)
def test_a_count_in_the_millions_is_refused(text, key, good, tmp_path, capsys):
    """`rollout.k: 1000000` ran (a 2 h ETA on the tiny model)."""
    config = tmp_path / "c.yaml"
    config.write_text(text)
    out = tmp_path / "out"
    code, output = run_cli([*stage_argv("rollout", good, out), "--config", str(config)], capsys)
    line = assert_clean_failure(code, output, out)
    assert line.startswith(f"error: {config}: {key}: Input should be less than or equal to 256"), line


def test_a_fifo_as_input_is_refused_without_blocking(good, tmp_path):
    """Opening a FIFO blocks until a writer comes: the stage hung."""
    fifo = tmp_path / "prompts.parquet"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dynamicrubric.cli", *stage_argv("rollout", good, out, prompts=str(fifo))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    line = assert_clean_failure(proc.returncode, proc.stdout, out)
    assert line == f"error: {fifo}: a FIFO, not a regular file; give a file", line


def _stop_midway(argv: list[str], tmp_path: Path, ready: str, sig: int, group: bool) -> tuple[int, str, list]:
    """`dynrubric ARGV` in a session of its own with a TMPDIR of its own, sent `sig` (to its process, as
    a pod's stop does, or to its whole group, as a terminal's Ctrl-C does) once a line containing
    `ready` is out; returns its exit code, its whole output, and what was left in its TMPDIR."""
    import signal
    import threading
    import uuid

    tmpdir = tmp_path / "TMP"
    tmpdir.mkdir()
    mark = uuid.uuid4().hex
    env = {**os.environ, "TMPDIR": str(tmpdir), "DYNRUBRIC_TEST_MARK": mark}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamicrubric.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if ready in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(300), "".join(lines)[-3000:]
        (os.killpg if group else os.kill)(proc.pid, sig)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    left = []  # any process of the command's still running (the children run in sessions of their own)
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"DYNRUBRIC_TEST_MARK={mark}".encode() in environ.read_bytes():
                left.append(environ.parent.name)
        except OSError:
            pass
    # torch's compile cache (torchinductor_<user>) is a cache the training processes keep, not a temp file
    temps = sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], f"processes left running: {left}"
    return code, "".join(lines), temps


@pytest.mark.parametrize(
    "stage,sig,group,ready",
    [
        # the ready lines are the project's own (its bar's first frame, a task's end), never a library's:
        # off a terminal transformers' "Loading weights" bar is hidden (infra/logs.py)
        ("rollout", "SIGTERM", False, " 0/32 "),
        ("train-policy", "SIGTERM", False, "'loss'"),
        ("train-policy", "SIGINT", True, "'loss'"),
    ],
)
def test_a_stopped_stage_ends_in_one_line_and_leaves_nothing(stage, sig, group, ready, good, tmp_path):
    """SIGTERM (a pod's stop) ended a stage at once and silently: its TMPDIR kept the training launch's
    config.yaml and job.json, and the training processes ran on. A Ctrl-C (SIGINT to the terminal's
    whole group) printed a traceback from each process."""
    import signal

    signum = getattr(signal, sig)
    out = tmp_path / "out"
    argv = stage_argv(stage, good, out)
    if stage == "rollout":
        # seconds of generation after the weights load, so the signal comes mid-stage (CI: with the tiny
        # preset's rollout it came after the stage had written its output)
        (tmp_path / "long.yaml").write_text("rollout: {k: 16, max_new_tokens: 512}\n")
        argv += ["--config", str(tmp_path / "long.yaml")]
    code, output, temps = _stop_midway(argv, tmp_path, ready, signum, group)
    line = assert_clean_failure(code, output, None)
    assert line == f"error: stopped by {sig}" and code == 128 + signum, output[-3000:]
    assert temps == []
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []
    assert not [p for p in left if not p.startswith(("policy.work", "steps"))], left  # resumable work only


@pytest.mark.slow
@pytest.mark.parametrize("sig,group", [("SIGTERM", False), ("SIGINT", True)])
def test_a_stopped_run_ends_in_one_line_and_leaves_nothing(sig, group, tmp_path):
    """`run` stopped as its first model-loading tasks start (once prepare-data has ended): one line, no
    traceback from kfp.local or its tasks, no kfp-workspace-* or pymp-* left in TMPDIR, no task left
    running."""
    import signal

    import yaml

    signum = getattr(signal, sig)
    config = tmp_path / "c.yaml"
    pipeline = {"pipeline_root": str(tmp_path / "runs"), "mlflow_tracking_uri": f"sqlite:///{tmp_path}/m.db"}
    config.write_text(yaml.safe_dump({"preset": "tiny", "pipeline": pipeline}))
    code, output, temps = _stop_midway(
        ["run", "--config", str(config)], tmp_path, "setup prepare-data", signum, group
    )
    line = assert_clean_failure(code, output, None)
    assert line == f"error: stopped by {sig}" and code == 128 + signum, output[-3000:]
    assert temps == []


@pytest.mark.parametrize("case", ["unknown-run-id", "missing-folders"])
def test_a_refused_rerun_writes_no_tracking_store(case, tmp_path, capsys):
    """`--from-run` with an unknown id left an empty mlflow.db; a --tracking-uri whose folders are
    missing got them created. A rerun reads a store that exists: any other is refused, writing nothing."""
    db = tmp_path / "mlflow.db" if case == "unknown-run-id" else tmp_path / "no" / "such" / "mlflow.db"
    out = tmp_path / "out"
    argv = [
        "stage",
        "rollout",
        "--from-run",
        "0" * 32,
        "--tracking-uri",
        f"sqlite:///{db}",
        "--out",
        str(out),
    ]
    code, output = run_cli(argv, capsys)
    line = assert_clean_failure(code, output, out)
    problem = (
        "no such database file"
        if case == "unknown-run-id"
        else f"the database's folder {db.parent} does not exist"
    )
    assert line == f"error: --tracking-uri sqlite:///{db}: {problem}", line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stage", ["rollout", "evaluate"])
def test_an_output_name_near_name_max_is_written(stage, good, tmp_path, capsys):
    """A 250-character name is legal, but the store's temp name beside it (".NAME.XXXXXXXX.tmp") was
    not: the stage computed everything, then failed with "File name too long"."""
    out = tmp_path / "out"
    argv = stage_argv(stage, good, out)
    flag = "--out" if stage == "rollout" else "--out-plots"
    target = out / ("r" * 242 + ".parquet" if stage == "rollout" else "p" * 250)
    argv[argv.index(flag) + 1] = str(target)
    code, output = run_cli(argv, capsys)
    assert code == 0, output[-2000:]
    assert target.is_file() if stage == "rollout" else store.is_complete(str(target))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temp left


def test_a_long_path_does_not_push_the_cause_off_the_line(good, tmp_path, capsys):
    """The 300-character cap kept the start of the line: a long path filled it, and what was wrong
    with it was cut off."""
    missing = tmp_path / ("d" * 200) / ("m" * 200 + ".parquet")
    out = tmp_path / "out"
    code, output = run_cli(stage_argv("rollout", good, out, prompts=str(missing)), capsys)
    line = assert_clean_failure(code, output, out)
    assert line.startswith(f"error: {str(missing)[:100]}") and line.endswith("m.parquet: no such file"), line


@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_source_with_no_rows_of_a_split_is_named(split, tmp_path, capsys):
    """Reported against the temp file it was written to: `TMP/dynrubric-outputs-*/1-eval.parquet:
    'prompts' artifact is empty`."""
    other = "eval" if split == "train" else "train"
    source = tmp_path / "src.jsonl"
    source.write_text(
        "".join(f'{{"prompt": "q{i}?", "reference": "1", "split": "{other}"}}\n' for i in range(3))
    )
    line = _prepare_data_refusal(source, tmp_path, capsys)
    assert line.startswith(f"error: {source}: no {split} prompts "), line


def test_evaluate_samples_of_a_larger_k_are_named(good, tmp_path, capsys):
    """Samples drawn with evaluate.samples 3, evaluated with the tiny preset's 1: every sample past the
    first was taken for the previous policy's, and the stage failed on a "duplicate key" in a temp file."""
    samples = _write(
        tmp_path / "samples.parquet",
        "rollouts",
        [{**r, "sample_idx": s} for r in ROLLOUTS[:1] for s in range(4)],
    )
    outcomes = _write(
        tmp_path / "outcomes.parquet",
        "outcomes",
        [{"prompt_id": "p0", "sample_idx": s, "task": "basic_arithmetic", "score": 1.0} for s in range(3)],
    )
    out = tmp_path / "out"
    argv = stage_argv("evaluate", good, out)
    argv = [
        *argv[: argv.index("--policy")],
        *argv[argv.index("--policy") + 2 :],
        "--samples",
        samples,
        "--outcomes",
        outcomes,
    ]
    code, output = run_cli(argv, capsys)
    line = assert_clean_failure(code, output, out)
    assert line.startswith(f"error: {samples}: sample_idx goes up to 3, but evaluate.samples is 1 "), line


@pytest.mark.parametrize("stage", ["rollout", "rubrics", "judge"])
def test_a_prompt_over_the_context_is_named_by_its_id(stage, good, tmp_path, capsys):
    """The engines' context errors said `prompt 0` (its place in the engine's list), not its id."""
    rows = [dict(r) for r in (PROMPTS if stage == "rollout" else ROLLOUTS)]
    for row in rows:
        if row["prompt_id"] == "p1":
            row["prompt"] = "1 + " * (1 << 12)  # 16 KB: over the tiny model's 2048 tokens
    kind = "prompts" if stage == "rollout" else "rollouts"
    bad = _write(tmp_path / "long.parquet", kind, rows)
    out = tmp_path / "out"
    code, output = run_cli(stage_argv(stage, good, out, **{kind: bad}), capsys)
    line = assert_clean_failure(code, output, out)
    assert "prompt 'p1' has " in line and "exceeds the context length 2048" in line, line


@pytest.mark.slow
def test_a_second_training_into_one_output_is_refused_while_the_first_runs(good, tmp_path):
    """Two train-policy runs into one output: the first to finish removed the work folder under the
    other (FileNotFoundError, 3 tracebacks). The second is refused in one line; the first finishes."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "dynamicrubric.cli", *stage_argv("train-policy", good, out)]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / ".policy.lock").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (out / ".policy.lock").exists(), "the first run never took its output"
        code, output = run_cli_process(stage_argv("train-policy", good, out))
        assert first.poll() is None, "the first run ended before the second was refused: no overlap"
    finally:
        first_output = first.communicate(timeout=600)[0]
    line = assert_clean_failure(code, output, None)
    assert (
        line
        == f"error: {out / 'policy'}: another train-policy is writing this output now; wait for it to end, or write elsewhere"
    ), line
    assert "accelerate" not in output
    assert first.returncode == 0, first_output[-3000:]
    assert store.is_complete(str(out / "policy")) and not (out / ".policy.lock").exists()
