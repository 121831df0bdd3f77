"""Prompt data, outcome scoring and anchor lists, on real reasoning-gym/HumanEval data and small files."""

from __future__ import annotations

import json
import re
import socket

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynamicrubric.infra.artifacts import read_frame, to_table, write_artifact
from dynamicrubric.infra.config import DataConfig
from dynamicrubric.tasks import (
    TaskError,
    anchors_from_outcomes,
    configured_prompts,
    extract_answer,
    load_nectar,
    load_pairs,
    load_prompts,
    score_response,
)

ARITH = "reasoning_gym:basic_arithmetic"


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def arith() -> pd.DataFrame:
    return load_prompts([ARITH], 20, "train", seed=0)


@pytest.fixture(scope="module")
def humaneval_eval() -> pd.DataFrame:
    return load_prompts(["humaneval"], 5, "eval", seed=0)


# --- prompts ------------------------------------------------------------------------------------


def test_prompts_are_deterministic_per_seed(arith):
    again = load_prompts([ARITH], 20, "train", seed=0)
    pd.testing.assert_frame_equal(arith, again)
    other = load_prompts([ARITH], 20, "train", seed=1)
    assert set(other["prompt"]) != set(arith["prompt"])


def test_prompts_match_the_artifact_contract(tmp_path, arith, humaneval_eval):
    df = pd.concat([arith, humaneval_eval], ignore_index=True)
    assert to_table("prompts", df).num_rows == 25
    write_artifact(str(tmp_path / "prompts.parquet"), "prompts", df)
    pd.testing.assert_frame_equal(read_frame(str(tmp_path / "prompts.parquet"), "prompts"), df)


def test_arithmetic_prompts_are_easy_and_their_references_right(arith):
    for row in arith.to_dict("records"):
        assert row["prompt"].endswith("Give only the final answer.")
        expression = json.loads(row["meta"])["entry"]["metadata"]["expression"]
        assert len(re.findall(r"\d+", expression)) == 2  # two terms
        assert eval(expression) == int(row["reference"]), row  # trusted generator text, not model output


@pytest.mark.parametrize("source", [ARITH, "reasoning_gym:chain_sum", "humaneval"])
def test_train_and_eval_are_disjoint(source):
    train = load_prompts([source], 150, "train", seed=3)
    held_out = load_prompts([source], 150, "eval", seed=3)
    assert not set(train["prompt"]) & set(held_out["prompt"])
    assert not set(train["prompt_id"]) & set(held_out["prompt_id"])
    assert train["prompt"].is_unique and held_out["prompt"].is_unique
    if source == "humaneval":  # every problem lands in exactly one split
        assert len(train) + len(held_out) == 164


def test_configured_prompts_follow_the_data_section():
    data = DataConfig(sources=[ARITH, "humaneval"], num_prompts=2, eval_prompts=0, seed=5)
    train = configured_prompts(data, "train")
    pd.testing.assert_frame_equal(train, load_prompts([ARITH, "humaneval"], 2, "train", seed=5))
    held_out = configured_prompts(data, "eval")  # eval_prompts 0 still gives evaluate one per source
    pd.testing.assert_frame_equal(held_out, load_prompts([ARITH, "humaneval"], 1, "eval", seed=5))
    assert not set(train["prompt_id"]) & set(held_out["prompt_id"])


def test_humaneval_loads_offline(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    df = load_prompts(["humaneval"], 200, "train", seed=0)
    assert 100 < len(df) < 164 and df["task"].eq("humaneval").all()
    meta = json.loads(df["meta"].iloc[0])
    assert {"task_id", "test", "entry_point", "prompt"} <= set(meta)
    assert df["prompt_id"].iloc[0] == meta["task_id"]


def test_several_sources_and_reasoning_gym_overrides():
    df = load_prompts([ARITH, "reasoning_gym:chain_sum?max_digits=1"], 4, "eval", seed=0)
    assert df["task"].tolist() == ["basic_arithmetic"] * 4 + ["chain_sum"] * 4
    chain = df[df["task"] == "chain_sum"]
    assert all(max(map(len, re.findall(r"\d+", p.split(":")[1]))) == 1 for p in chain["prompt"])


def test_user_file_prompts(tmp_path):
    rows = [
        {"id": f"q{i}", "prompt": f"What is the capital of country {i}?", "answer": f"City{i}"}
        for i in range(40)
    ]
    uri = write_jsonl(tmp_path / "mine.jsonl", rows)
    train = load_prompts([uri], 100, "train", seed=0)
    held_out = load_prompts([uri], 100, "eval", seed=0)
    assert len(train) + len(held_out) == 40 and not set(train["prompt_id"]) & set(held_out["prompt_id"])
    row = train.iloc[0]
    assert row["task"] == "user" and row["reference"] == f"City{row['prompt_id'][1:]}"
    to_table("prompts", train)

    # Parquet, no id or reference, explicit split column
    pq.write_table(
        pa.table({"prompt": ["a?", "b?", "c?"], "split": ["train", "eval", "train"]}), tmp_path / "p.parquet"
    )
    df = load_prompts([str(tmp_path / "p.parquet")], 10, "train", seed=0)
    assert sorted(df["prompt"]) == ["a?", "c?"] and df["reference"].isna().all()
    assert sorted(df["prompt_id"]) == ["p/0", "p/2"]


def test_prompt_errors_are_clear(tmp_path):
    with pytest.raises(TaskError, match="unknown prompt source 'gsm8k'"):
        load_prompts(["gsm8k"], 2)
    with pytest.raises(TaskError, match="unknown reasoning-gym task 'no_such_task'"):
        load_prompts(["reasoning_gym:no_such_task"], 2)
    with pytest.raises(TaskError, match="bad generator settings"):
        load_prompts(["reasoning_gym:basic_arithmetic?colour=red"], 2)
    no_prompt = write_jsonl(tmp_path / "no_prompt.jsonl", [{"question": "x"}])
    with pytest.raises(TaskError, match="no 'prompt' column"):
        load_prompts([no_prompt], 2)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TaskError, match="empty"):
        load_prompts([str(tmp_path / "empty.jsonl")], 2)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(TaskError, match="line 2 is not valid JSON"):
        load_prompts([str(tmp_path / "bad.jsonl")], 2)
    with pytest.raises(TaskError, match="split"):
        load_prompts([ARITH], 2, split="test")
    with pytest.raises(TaskError, match="listed twice"):
        load_prompts([ARITH, ARITH], 2)


# --- scoring ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("42", 1.0),
        ("The answer is 42.", 1.0),
        ("6 * 7 = 42", 1.0),
        ("<answer>42</answer>", 1.0),
        ("42.0", 1.0),
        ("41", 0.0),
        ("It is 42? No: 41", 0.0),  # the last number is the answer
        ("", 0.0),
        ("I don't know", 0.0),
    ],
)
def test_reasoning_gym_scoring(arith, response, expected):
    row = arith.iloc[0].to_dict()
    ref = row["reference"]
    assert score_response(row, response.replace("42", ref).replace("41", str(int(ref) + 1))) == expected


def test_chain_sum_scoring_uses_the_tasks_own_scorer():
    row = load_prompts(["reasoning_gym:chain_sum"], 1, "train", seed=0).iloc[0].to_dict()
    ref = int(row["reference"])
    assert score_response(row, f"= {ref}") == 1.0
    assert score_response(row, f"{ref + 10}") == 0.0


def test_humaneval_scoring_runs_the_tests(humaneval_eval):
    row = humaneval_eval.iloc[0].to_dict()
    meta = json.loads(row["meta"])
    solution = row["reference"]  # the full canonical function
    assert score_response(row, f"Here you go:\n```python\n{solution}```\nDone.") == 1.0
    body = solution[len(meta["prompt"]) :]
    assert score_response(row, body) == 1.0  # a bare body that continues the prompt
    wrong = f"```python\ndef {meta['entry_point']}(*args):\n    return None\n```"
    assert score_response(row, wrong) == 0.0
    hang = f"```python\ndef {meta['entry_point']}(*args):\n    while True:\n        pass\n```"
    assert score_response(row, hang, timeout_s=1.5) == 0.0


def test_user_reference_scoring_and_missing_reference():
    row = {
        "prompt_id": "u1",
        "task": "user",
        "prompt": "Capital of France?",
        "reference": "Paris",
        "meta": None,
    }
    assert score_response(row, "The capital of France is Paris.") == 1.0
    assert score_response(row, "Answer: paris") == 1.0
    assert score_response(row, "Lyon") == 0.0
    assert score_response(row, "Parisian food") == 0.0  # whole words only
    numeric = {**row, "reference": "4"}
    assert score_response(numeric, "2 + 2 = 4") == 1.0
    assert score_response(numeric, "14") == 0.0
    with pytest.raises(TaskError, match="no reference answer"):
        score_response({**row, "reference": None}, "Paris")


def test_extract_answer():
    assert extract_answer("first 1,000 then 2,500", "2500") == "2500"
    assert extract_answer("Final answer: Blue.\n", "blue") == "Blue"
    assert extract_answer("<answer> x </answer> and <answer>y</answer>") == "y"


# --- anchor lists ---------------------------------------------------------------------------------


def nectar_rows() -> list[dict]:
    return [
        {
            "prompt": "\n\nHuman: Name a colour.\n\nAssistant:",
            "answers": [
                {"answer": "Blue.", "model": "a", "rank": 2},
                {"answer": "Red, a warm colour.", "model": "b", "rank": 1},
                {"answer": "Green.", "model": "c", "rank": 2},
                {"answer": "Dunno", "model": "d", "rank": 5},
            ],
        },
        {"prompt": "All the same", "answers": [{"answer": "x", "rank": 1}, {"answer": "y", "rank": 1}]},
        {"prompt": "One answer", "answers": [{"answer": "x", "rank": 1}]},
    ]


def test_load_nectar(tmp_path):
    df = load_nectar(write_jsonl(tmp_path / "nectar.jsonl", nectar_rows()))
    to_table("anchors", df)
    assert df["list_id"].unique().tolist() == ["nectar/0"]  # no-order lists dropped
    assert df["rank"].tolist() == [2, 1, 2, 3]  # dense: ties share a rank, 5 becomes 3
    assert df["response"].tolist()[1] == "Red, a warm colour."
    assert (df["prompt"] == "Name a colour.").all() and (df["source"] == "nectar").all()
    # Parquet holds the same data
    pq.write_table(pa.Table.from_pylist(nectar_rows()[:1]), tmp_path / "nectar.parquet")
    from_parquet = load_nectar(str(tmp_path / "nectar.parquet"))
    assert from_parquet["rank"].tolist() == [2, 1, 2, 3]


def test_load_nectar_rejects_malformed(tmp_path):
    bad_rank = [{"prompt": "p", "answers": [{"answer": "a", "rank": "first"}, {"answer": "b", "rank": 2}]}]
    with pytest.raises(TaskError, match="row 0, answer 0: 'rank' must be a number"):
        load_nectar(write_jsonl(tmp_path / "a.jsonl", bad_rank))
    with pytest.raises(TaskError, match="'answers' must be a list"):
        load_nectar(write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "answers": "a"}]))
    with pytest.raises(TaskError, match="no ranked list"):
        load_nectar(write_jsonl(tmp_path / "c.jsonl", nectar_rows()[1:]))


def test_load_pairs(tmp_path):
    rows = [
        {"id": "p1", "prompt": "2+2?", "chosen": "4", "rejected": "5"},
        {"prompt": "Hi", "chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
         "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away."}]},
        {"prompt": "same", "chosen": "x", "rejected": "x"},
    ]  # fmt: skip
    df = load_pairs(write_jsonl(tmp_path / "pairs.jsonl", rows))
    to_table("anchors", df)
    assert df[["list_id", "sample_idx", "rank", "response"]].values.tolist() == [
        ["p1", 0, 1, "4"],
        ["p1", 1, 2, "5"],
        ["pairs/1", 0, 1, "Hello!"],
        ["pairs/1", 1, 2, "Go away."],
    ]
    with pytest.raises(TaskError, match=r"row 0 lacks \['rejected'\]"):
        load_pairs(write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "c"}]))


def test_anchors_from_outcomes(arith, humaneval_eval):
    a, b, c = (arith.iloc[i].to_dict() for i in range(3))
    he = humaneval_eval.iloc[0].to_dict()
    entry = json.loads(he["meta"])["entry_point"]
    user = {"prompt_id": "u", "task": "user", "prompt": "Say hi", "reference": None, "meta": None}
    prompts = pd.DataFrame([a, b, c, he, user])

    def wrong(row):
        return str(int(row["reference"]) + 1)

    responses = {
        a["prompt_id"]: [a["reference"], wrong(a), f"It is {a['reference']}", "no idea"],  # mixed
        b["prompt_id"]: [wrong(b), wrong(b)],  # all wrong: no order
        c["prompt_id"]: [c["reference"], c["reference"]],  # all right: no order
        he["prompt_id"]: [
            f"```python\ndef {entry}(*a):\n    return None\n```",
            f"```python\n{he['reference']}```",
        ],
        "u": ["hi", "hello"],  # not verifiable: skipped
    }
    rollouts = pd.DataFrame(
        [
            {"prompt_id": pid, "sample_idx": i, "response": r}
            for pid, rs in responses.items()
            for i, r in enumerate(rs)
        ]
    )
    df = anchors_from_outcomes(rollouts, prompts, timeout_s=10, workers=2)
    to_table("anchors", df)
    assert sorted(df["list_id"].unique()) == sorted([a["prompt_id"], he["prompt_id"]])
    ranks = df.set_index(["list_id", "sample_idx"])["rank"]
    assert [ranks[(a["prompt_id"], i)] for i in range(4)] == [1, 2, 1, 2]
    assert [ranks[(he["prompt_id"], i)] for i in range(2)] == [2, 1]
    assert (df.loc[df["list_id"] == a["prompt_id"], "prompt"] == a["prompt"]).all()
    assert (df["source"] == "outcomes").all()

    with pytest.raises(TaskError, match="not in the prompts"):
        anchors_from_outcomes(rollouts, prompts.iloc[:2], timeout_s=10)


def test_a_broken_sandbox_leaves_code_unscored_not_wrong(arith, humaneval_eval, monkeypatch, caplog):
    """A sandbox that cannot start (here: its interpreter is missing) is the machine's fault: the
    canonical solution gets NaN, not 0, its list leaves it out, and the verifiable reward's judgment
    carries NaN, which sets the group aside (no reward) instead of teaching that correct code fails."""
    from dynamicrubric.infra import sandbox
    from dynamicrubric.training.reward_common import checker_judgments as _checker_judgments

    monkeypatch.setattr(sandbox, "_base_python", lambda: "/nonexistent/python3")
    monkeypatch.setattr(sandbox, "_fallback_python", lambda user: "/nonexistent/python3")
    he, a = humaneval_eval.iloc[0].to_dict(), arith.iloc[0].to_dict()
    solution = f"```python\n{he['reference']}```"
    with caplog.at_level("WARNING"):
        score = score_response(he, solution)
    assert score != score, f"a sandbox error scored {score}"  # NaN
    assert "left unscored" in caplog.text

    rollouts = pd.DataFrame(
        [
            {"prompt_id": he["prompt_id"], "sample_idx": i, "response": r}
            for i, r in enumerate([solution, "no"])
        ]
        + [
            {"prompt_id": a["prompt_id"], "sample_idx": i, "response": r}
            for i, r in enumerate([a["reference"], "x"])
        ]
    )
    df = anchors_from_outcomes(rollouts, pd.DataFrame([he, a]), timeout_s=10, workers=1)
    assert list(df["list_id"].unique()) == [a["prompt_id"]]  # the arithmetic list still ranks
    judgments = _checker_judgments(rollouts, [score_response(he, solution), 0.0, 1.0, 0.0])
    assert judgments["p_yes"].isna().tolist() == [True, False, False, False]


def test_a_non_utf8_file_is_refused_not_decoded_with_replacements(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9?", "answer": "x"}\n')
    with pytest.raises(TaskError, match=r"not UTF-8 text \(invalid byte at offset 32, line 2\)"):
        load_prompts([str(path)], 2)


@pytest.mark.parametrize("several", [False, True])
def test_humaneval_meta_without_its_tests_is_named(several):
    from dynamicrubric.tasks import score_group

    row = {"prompt_id": "mine/0", "meta": json.dumps({"source": "humaneval", "prompt": "def f():\n"})}
    with pytest.raises(TaskError, match=r"prompt 'mine/0': its HumanEval meta lacks test, entry_point"):
        score_group(row, ["    return 1"]) if several else score_response(row, "    return 1")
