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

from dynamicrubric import artifacts, cli, store
from dynamicrubric.artifacts import write_artifact

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
    meta = {artifacts.KIND_KEY: kind.encode(), artifacts.VERSION_KEY: artifacts.SCHEMA_VERSION.encode()}
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
        key = artifacts.kind(kind).keys[0]
        rows[1] = {**rows[0]}
        rows[0][key] = rows[1][key] = "x" * (4 << 20)
        return _write_raw(path, pa.Table.from_pylist(rows, schema=artifacts.kind(kind).schema), kind)
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
    k for k in GOOD if any(pa.types.is_floating(f.type) and not f.nullable for f in artifacts.kind(k).schema)
]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("good")
    return {kind: _write(folder / f"{kind}.parquet", kind, rows) for kind, rows in GOOD.items()}


def _write(path: Path, kind: str, rows: list[dict]) -> str:
    write_artifact(str(path), kind, rows)
    return str(path)


@pytest.fixture(autouse=True)
def _fresh_logging():
    """cli.main sets up logging once per process; drop its handler so each case logs to its own stderr."""
    yield
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)


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
    assert len(errors[0]) <= len(prefix) + cli.MAX_ERROR_CHARS, errors[0][:500]
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
    monkeypatch.setenv("DYNRUBRIC_S3_MAX_ATTEMPTS", "1")
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
    assert cli.one_line("a\nb\t c") == "a b c"
    long = cli.one_line("x" * 10_000)
    kept, more = long.rsplit("... (", 1)
    assert len(long) <= cli.MAX_ERROR_CHARS and kept == "x" * len(kept)
    assert more == f"{10_000 - len(kept)} more chars)"


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
    table = pa.Table.from_pylist(rows, schema=artifacts.kind(kind).schema)
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
}


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_run_refuses_before_it_launches(case, tmp_path):
    """These launched the pipeline and failed inside a task (or printed raw errno text)."""
    import yaml

    (tmp_path / "afile").write_text("")
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
