"""The evaluator-side stages end to end from the CLI on tiny-random, on local paths and on S3."""

from __future__ import annotations

import pandas as pd
import pytest

from dynamicrubric import cli
from dynamicrubric.engines import load_engine
from dynamicrubric.infra.artifacts import read_artifact, read_frame, write_artifact
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.scoring.judge import run_judge
from dynamicrubric.scoring.rubrics import run_rubrics

PROMPTS = [
    {
        "prompt_id": f"p{i}",
        "task": "basic_arithmetic",
        "prompt": f"What is {i} + {i + 2}? Give only the final answer.",
        "reference": str(2 * i + 2),
        "meta": None,
    }
    for i in range(3)
]


@pytest.fixture(scope="module")
def tiny_engine():
    cfg = load_config(preset="tiny")
    return load_engine("tiny-random", cfg.engine)


def _run(*argv: str) -> None:
    assert cli.main(list(argv)) == 0


def _stages(base: str, join) -> dict[str, str]:
    uris = {
        name: join(base, f"{name}.parquet") for name in ["prompts", "rollouts", "rubrics", "judgments", "pw"]
    }
    write_artifact(uris["prompts"], "prompts", PROMPTS)
    common = ["--preset", "tiny"]
    _run("stage", "rollout", *common, "--prompts", uris["prompts"], "--out", uris["rollouts"])
    _run(
        "stage",
        "rubrics",
        *common,
        "--candidate-sets",
        uris["rollouts"],
        "--out",
        uris["rubrics"],
        "--samples",
        "2",
    )
    _run(
        "stage",
        "judge",
        *common,
        "--candidate-sets",
        uris["rollouts"],
        "--rubrics",
        uris["rubrics"],
        "--out",
        uris["judgments"],
    )
    _run("stage", "judge", *common, "--candidate-sets", uris["rollouts"], "--out", uris["pw"])
    for variant, judgments, rubrics in [
        ("agg", "judgments", ["--rubrics", uris["rubrics"]]),
        ("pwagg", "pw", []),
    ]:
        outs = {
            k: join(base, f"{variant}-{k}.parquet") for k in ["scores", "rewards", "diagnostics", "metrics"]
        }
        _run(
            "stage",
            "aggregate",
            *common,
            "--judgments",
            uris[judgments],
            "--candidate-sets",
            uris["rollouts"],
            *rubrics,
            *[a for k, u in outs.items() for a in (f"--out-{k}", u)],
        )
        uris.update({f"{variant}-{k}": u for k, u in outs.items()})
    return uris


def _check_outputs(uris: dict[str, str]) -> None:
    rollouts = read_frame(uris["rollouts"], "rollouts")
    assert len(rollouts) == 3 * 4  # tiny preset: K = 4
    assert sorted(rollouts.groupby("prompt_id")["sample_idx"].apply(list).iloc[0]) == [0, 1, 2, 3]
    rubrics = read_frame(uris["rubrics"], "rubrics")
    assert len(rubrics) == 3 * 2 and set(rubrics["variant"]) == {"dynamic"}
    assert all("Response A:" in p and "Response D:" in p for p in rubrics["generator_prompt"])
    read_artifact(uris["judgments"], "judgments")  # random-weight rubrics may all be empty: validity only
    pointwise = read_frame(uris["pw"], "judgments")
    assert len(pointwise) == 12 and set(pointwise["item_idx"]) == {0} and set(pointwise["weight"]) == {1}
    assert ((pointwise["p_yes"] >= 0.5) == pointwise["verdict"]).all()
    for variant in ("agg", "pwagg"):  # every response gets a score, in both variants
        scores = read_frame(uris[f"{variant}-scores"], "scores")
        assert len(scores) == (len(rubrics) * 4 if variant == "agg" else 12)
    pw_scores = read_frame(uris["pwagg-scores"], "scores").set_index("sample_idx")
    assert set(pw_scores["score"]) <= {0.0, 1.0}  # pointwise, hard verdicts: the verdict itself
    assert cli.main(["validate", *uris.values()]) == 0


def test_stages_local(tmp_path):
    uris = _stages(str(tmp_path), lambda b, n: f"{b}/{n}")
    _check_outputs(uris)


def test_stages_s3(s3_env):
    uris = _stages(f"s3://{s3_env}/run1", lambda b, n: f"{b}/{n}")
    _check_outputs(uris)


def test_rollouts_are_reproducible(tmp_path):
    write_artifact(str(tmp_path / "p.parquet"), "prompts", PROMPTS)
    for name in ["a", "b"]:
        _run(
            "stage",
            "rollout",
            "--preset",
            "tiny",
            "--prompts",
            str(tmp_path / "p.parquet"),
            "--out",
            str(tmp_path / f"{name}.parquet"),
            "--seed",
            "5",
        )
    a = read_frame(str(tmp_path / "a.parquet"), "rollouts")
    b = read_frame(str(tmp_path / "b.parquet"), "rollouts")
    pd.testing.assert_frame_equal(a, b)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()


# A hand-written rubric row; tests add prompt_id, rubric_idx and items.
HAND_RUBRIC = {
    "variant": "dynamic",
    "generator": "hand",
    "generator_prompt": "",
    "completion": "",
    "parse_status": "json",
    "finish_reason": "stop",
}


def _rollouts() -> list[dict]:
    responses = {"p0": ["2", "It is 2.", "3", "two"], "p1": ["4", "4", "5", "four"]}
    return [
        {
            "prompt_id": pid,
            "sample_idx": j,
            "prompt": f"What is {pid}?",
            "response": r,
            "num_tokens": 1,
            "finish_reason": "stop",
            "policy": "hand",
            "seed": 0,
        }
        for pid, rs in responses.items()
        for j, r in enumerate(rs)
    ]


def test_judge_covers_every_item_and_response(tmp_path, tiny_engine):
    cfg = load_config(preset="tiny")
    write_artifact(str(tmp_path / "r.parquet"), "rollouts", _rollouts())
    items = [{"text": "The answer is a digit", "weight": 5}, {"text": "It is short", "weight": 2}]
    write_artifact(
        str(tmp_path / "rub.parquet"),
        "rubrics",
        [
            {**HAND_RUBRIC, "prompt_id": "p0", "rubric_idx": 0, "items": items},
            {**HAND_RUBRIC, "prompt_id": "p0", "rubric_idx": 1, "items": items[:1]},
            {**HAND_RUBRIC, "prompt_id": "p1", "rubric_idx": 0, "items": [], "parse_status": "empty"},
        ],
    )
    counts = run_judge(
        str(tmp_path / "r.parquet"),
        str(tmp_path / "j.parquet"),
        cfg,
        rubrics_uri=str(tmp_path / "rub.parquet"),
        engine=tiny_engine,
    )
    judgments = read_frame(str(tmp_path / "j.parquet"), "judgments")
    assert counts["judgments"] == len(judgments) == 4 * 2 + 4 * 1  # the empty rubric has nothing to judge
    assert set(judgments.loc[judgments.rubric_idx == 0, "weight"]) == {5, 2}
    # the same (item, response) question gets the same answer in any rubric
    a = judgments.query("rubric_idx == 0 and item_idx == 0").set_index("sample_idx")["p_yes"]
    b = judgments.query("rubric_idx == 1 and item_idx == 0").set_index("sample_idx")["p_yes"]
    pd.testing.assert_series_equal(a, b)


def test_variants_selected_by_config(tmp_path, tiny_engine):
    write_artifact(str(tmp_path / "r.parquet"), "rollouts", _rollouts())
    static = load_config(preset="tiny", overrides={"rubrics": {"variant": "static"}})
    run_rubrics(str(tmp_path / "r.parquet"), str(tmp_path / "s.parquet"), static, engine=tiny_engine)
    rubrics = read_frame(str(tmp_path / "s.parquet"), "rubrics")
    assert set(rubrics["variant"]) == {"static"}
    assert not any("Response A" in p for p in rubrics["generator_prompt"])  # written from the prompt alone
    pointwise = load_config(preset="tiny", overrides={"judge": {"variant": "pointwise"}})
    counts = run_judge(
        str(tmp_path / "r.parquet"),
        str(tmp_path / "j.parquet"),
        pointwise,
        rubrics_uri=str(tmp_path / "s.parquet"),
        engine=tiny_engine,
    )
    assert counts["variant"] == "pointwise" and counts["judgments"] == 8


def test_rubrics_for_missing_responses_is_an_error(tmp_path, tiny_engine):
    cfg = load_config(preset="tiny")
    write_artifact(str(tmp_path / "r.parquet"), "rollouts", _rollouts()[:4])
    write_artifact(
        str(tmp_path / "rub.parquet"),
        "rubrics",
        [{**HAND_RUBRIC, "prompt_id": "p9", "rubric_idx": 0, "items": [{"text": "abc", "weight": 1}]}],
    )
    with pytest.raises(ValueError, match=r"prompt\(s\) \['p9'\] have no responses"):
        run_judge(
            str(tmp_path / "r.parquet"),
            str(tmp_path / "j.parquet"),
            cfg,
            rubrics_uri=str(tmp_path / "rub.parquet"),
            engine=tiny_engine,
        )


def test_evaluate_from_the_cli(tmp_path):
    from dynamicrubric.tasks import load_prompts

    prompts = str(tmp_path / "eval.parquet")
    write_artifact(prompts, "prompts", load_prompts(["reasoning_gym:basic_arithmetic"], 2, "eval", 0))
    out, plots = str(tmp_path / "metrics.parquet"), tmp_path / "plots"
    _run(
        "stage",
        "evaluate",
        "--preset",
        "tiny",
        "--eval-prompts",
        prompts,
        "--policy",
        "tiny-random",
        "--previous-policy",
        "tiny-random",
        "--out-metrics",
        out,
        "--out-plots",
        str(plots),
        "--round",
        "1",
    )
    metrics = read_frame(out, "metrics")
    assert set(metrics["round"]) == {1} and set(metrics["stage"]) == {"evaluate"}
    policy = metrics[metrics["variant"] == "policy"].set_index("name")["value"]
    assert 0.0 <= policy["accuracy"] <= 1.0
    assert policy["win_rate"] == 0.5  # the same weights on both sides: every comparison ties
    pngs = sorted(plots.glob("*.png"))
    assert pngs and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_evaluate_split_into_three_tasks_gives_the_one_task_result(tmp_path):
    """On GPUs evaluate runs as evaluate-samples → check-samples (the code runs in a CPU task) →
    evaluate; chained through their artifacts the three give the one task's metrics and units."""
    from dynamicrubric.tasks import load_prompts

    prompts = str(tmp_path / "eval.parquet")
    held_out = pd.concat(
        [
            load_prompts(["reasoning_gym:basic_arithmetic"], 2, "eval", 0),
            load_prompts(["humaneval"], 1, "eval", 0),
        ]
    )
    write_artifact(prompts, "prompts", held_out)
    pairs = tmp_path / "pairs.jsonl"  # labelled pairs, so the evaluator phase scores lists too
    pairs.write_text('{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}\n')
    config = tmp_path / "config.yaml"
    config.write_text(
        f"data: {{labelled: [{str(pairs)!r}]}}\nevaluate: {{variants: [dynamic, pointwise]}}\n"
        "rubrics: {max_new_tokens: 60}\n"  # short rubrics (cut off ones score empty): a fast test
    )
    common = ["--preset", "tiny", "--config", str(config), "--eval-prompts", prompts, "--round", "1"]
    models = ["--generator", "tiny-random", "--verifier", "tiny-random"]
    one = {name: str(tmp_path / f"one-{name}.parquet") for name in ("metrics", "units")}
    _run(
        "stage", "evaluate", *common, *models, "--policy", "tiny-random", "--previous-policy", "tiny-random",
        "--out-metrics", one["metrics"], "--out-units", one["units"], "--out-plots", str(tmp_path / "one-plots"),
    )  # fmt: skip
    split = {
        name: str(tmp_path / f"split-{name}.parquet") for name in ("samples", "outcomes", "metrics", "units")
    }
    _run(
        "stage", "evaluate-samples", *common, "--policy", "tiny-random", "--previous-policy", "tiny-random",
        "--out", split["samples"],
    )  # fmt: skip
    _run("stage", "check-samples", *common, "--samples", split["samples"], "--out", split["outcomes"])
    _run(
        "stage", "evaluate", *common, *models, "--samples", split["samples"], "--outcomes", split["outcomes"],
        "--out-metrics", split["metrics"], "--out-units", split["units"],
        "--out-plots", str(tmp_path / "split-plots"),
    )  # fmt: skip

    outcomes = read_frame(split["outcomes"], "outcomes")
    assert set(outcomes["task"]) == {"basic_arithmetic", "humaneval"}  # the code was checked there
    assert len(read_frame(split["samples"], "rollouts")) == 3 * (1 + 1)  # 1 sample each, +1 previous
    for name in ("metrics", "units"):
        kind = name
        pd.testing.assert_frame_equal(read_frame(split[name], kind), read_frame(one[name], kind))
    metrics = read_frame(split["metrics"], "metrics").set_index(["variant", "name"])["value"]
    assert metrics["policy", "win_rate"] == 0.5 and metrics["policy", "unscored"] == 0
    assert metrics["dynamic", "labelled_pairs"] >= 1 and metrics["pointwise", "labelled_pairs"] >= 1
    # one of the two phases alone is refused, in one line
    refused = [
        "stage",
        "evaluate",
        *common,
        "--samples",
        split["samples"],
        "--out-metrics",
        "x",
        "--out-plots",
        "y",
    ]
    assert cli.main(refused) == 1
