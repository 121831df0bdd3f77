"""The served reward path under a misbehaving server: both trainers' rewards through `ServerEngine`
against the vLLM stand-in (tests/vllm_standin.py: a real tiny model behind vLLM 0.31's reply shapes)
with faults injected. Every reward equals the fault-free value or is None, the ledger's counts equal
what the server did, and a step recovers or fails with one line within its bound."""

from __future__ import annotations

import json
import logging
import math
import time
from types import SimpleNamespace

import pytest
from vllm_standin import serving

from dynamicrubric.cli import describe_error
from dynamicrubric.engines import ServedError, ServerEngine
from dynamicrubric.infra.artifacts import read_frame
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.training.generator_rewards import GeneratorRewards
from dynamicrubric.training.launcher import launch_error
from dynamicrubric.training.policy_reward import PolicyReward
from dynamicrubric.training.reward_parts import RewardError
from tests_vllm.vllm_faults import every, first, in_turn, is_generator, is_judge

QUESTIONS = {"q-add": "What is 7 + 5?", "q-sub": "What is 9 - 4?", "q-mul": "What is 3 * 3?"}
RESPONSES = {
    "q-add": ["12", "The answer is 12.", "7 + 5 = 13", "eleven"],
    "q-sub": ["5", "9 - 4 = 5", "4", "six"],
    "q-mul": ["9", "3 * 3 = 9", "6", "nine"],
}
RUBRICS = [
    '{"items": [{"text": "The answer is right", "weight": 5}, {"text": "It shows the sum", "weight": 2}]}',
    '{"items": [{"text": "The response is one number", "weight": 3}]}',
]
# One request a verdict, one at a time: a fault lands on a known verdict, and a lost one costs one group.
# Bounds far above a healthy request's time, even on a loaded CI machine (a 1-second bound timed out
# healthy requests there and changed the counts a test expects); a test of a bound sets its own.
SERVING = {
    "concurrency": 1,
    "request_prompts": 1,
    "request_timeout_s": 30.0,
    "deadline_s": 60.0,
    "max_failed_fraction": 0.5,
}


@pytest.fixture(scope="module")
def server():
    with serving(str(resolve_model("tiny-random"))) as s:
        yield s


@pytest.fixture
def standin(server):
    server.reset()
    server.stall_s, server.trickle_s = 3.0, 0.05
    yield server
    server.reset()


def _cfg(
    server, samples: int = 1, judge: str = "rubric", soft: bool = False, shuffle: bool = True, **serving_over
):
    return load_config(
        preset="tiny",
        overrides={
            "aggregate": {"soft": soft},
            "rubrics": {"variant": "dynamic", "samples": samples, "shuffle": shuffle, "max_new_tokens": 60},
            "judge": {"variant": judge},
            "models": {"generator_url": server.url, "verifier_url": server.url},
            "serving": {**SERVING, **serving_over},
        },
    )


class _Metrics(dict):
    def __call__(self, name: str, value: float) -> None:
        self[name] = value


def _policy_call(reward: PolicyReward, step: int, metrics: _Metrics) -> list:
    ids = [pid for pid in QUESTIONS for _ in RESPONSES[pid]]
    completions = [r for pid in QUESTIONS for r in RESPONSES[pid]]
    return reward(
        [[{"role": "user", "content": QUESTIONS[p]}] for p in ids],
        [[{"role": "assistant", "content": c}] for c in completions],
        [[1] * 5 for _ in completions],
        prompt_id=ids,
        prompt_text=[QUESTIONS[p] for p in ids],
        task=["open"] * len(ids),
        reference=[None] * len(ids),
        meta=[None] * len(ids),
        trainer_state=SimpleNamespace(global_step=step - 1),
        log_metric=metrics,
    )


def _generator_call(rewards: GeneratorRewards, step: int, metrics: _Metrics) -> list:
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
    disc, anchor = r_disc(None, completions, ids, **kwargs), r_anchor(None, completions, ids, **kwargs)
    return list(zip(disc, anchor, strict=True))


def _calls(metrics: dict, prefix: str) -> dict[str, int]:
    return {
        k.split("calls_")[1]: int(v) for k, v in metrics.items() if k.startswith(f"{prefix}/calls_") and v
    }


@pytest.fixture(scope="module")
def clean_generator(server, tmp_path_factory):
    """The fault-free values of the generator's rewards, and the number of judge requests they take."""
    server.reset()
    metrics = _Metrics()
    rewards = GeneratorRewards(_cfg(server), steps_uri=str(tmp_path_factory.mktemp("clean-g")), round_idx=1)
    values = _generator_call(rewards, 1, metrics)
    assert all(v[0] is not None and math.isfinite(v[0]) for v in values)
    assert _calls(metrics, "judge") == {"ok": server.injected()["ok"]}
    return values, server.injected()["ok"]


@pytest.fixture(scope="module")
def clean_policy(server, tmp_path_factory):
    server.reset()
    metrics = _Metrics()
    reward = PolicyReward(_cfg(server), steps_uri=str(tmp_path_factory.mktemp("clean-p")), round_idx=1)
    values = _policy_call(reward, 1, metrics)
    assert all(v is not None and math.isfinite(v) for v in values)
    assert _calls(metrics, "rubrics") == {"ok": len(QUESTIONS)}
    return values


def _set_of(values: list, group: int, size: int) -> list:
    return values[group * size : (group + 1) * size]


# --------------------------------------------------------------------------------------------------
# 1. A lost verdict under the failure budget leaves its group out; it does not end training.


def test_a_lost_verdict_under_the_budget_leaves_its_group_out(standin, clean_generator, tmp_path):
    clean, requests = clean_generator
    standin.reset(first(1, "http_404"))  # final at once: the first set's first verdict is lost
    metrics = _Metrics()
    rewards = GeneratorRewards(_cfg(standin), steps_uri=str(tmp_path), round_idx=1)
    values = _generator_call(rewards, 1, metrics)
    assert _set_of(values, 0, 2) == [(None, None)] * 2
    assert values[2:] == clean[2:]
    assert metrics["rewards/failed_groups"] == 1
    assert _calls(metrics, "judge") == {"ok": requests - 1, "http_error": 1, "lost_prompts": 1}
    assert standin.injected() == {"ok": requests - 1, "http_404": 1}
    lost = read_frame(str(tmp_path / "step-00001" / "failed-judgments.parquet"), "judgments")
    assert set(lost["prompt_id"]) == {"q-add"} and lost["p_yes"].isna().sum() == 1
    assert set(read_frame(str(tmp_path / "step-00001" / "judgments.parquet"), "judgments")["prompt_id"]) == {
        "q-sub",
        "q-mul",
    }


# --------------------------------------------------------------------------------------------------
# 2. A rubric the server aborted is a failed call, never an empty rubric scored 0.


@pytest.mark.parametrize("fault", ["abort", "null_finish"])
def test_an_aborted_rubric_is_a_failed_call(standin, clean_policy, tmp_path, fault):
    # Always aborted for q-add's rubric (retried until the deadline); the others answered.
    standin.reset(every(fault, when=lambda b: is_generator(b) and _asks_about(standin, b, "7 + 5")))
    metrics = _Metrics()
    # All three rubric requests at once: q-add's retries spend the step's budget, not the others' time.
    reward = PolicyReward(_cfg(standin, concurrency=3, deadline_s=6.0), steps_uri=str(tmp_path), round_idx=1)
    values = _policy_call(reward, 1, metrics)
    assert values[:4] == [None] * 4 and values[4:] == clean_policy[4:]
    calls = _calls(metrics, "rubrics")
    assert calls["aborted"] == 1 and calls["ok"] == len(QUESTIONS) - 1 and calls["lost_prompts"] == 1
    assert calls["retries"] == standin.injected()[fault] - 1 > 0
    assert metrics["rewards/failed_groups"] == 1


def _asks_about(standin, body: dict, text: str) -> bool:
    return text in standin.tokenizer.decode(body["prompt"])


# --------------------------------------------------------------------------------------------------
# 3. Malformed 200s: a cut body is retried (also at the engine's start), a reply without choices is a
# lost verdict, a label at vLLM's −9999 floor is P(yes) 0, a generator's missing sample a failed call.


def test_a_truncated_body_is_retried_and_the_step_recovers(standin, clean_generator, tmp_path):
    clean, requests = clean_generator

    def rule(path: str, body: dict):
        return cut_start(path, body) or cut_judge(path, body)

    cut_start = first(1, "truncate", "/v1/models")
    cut_judge = first(1, "truncate", when=is_judge)
    tokenize = first(1, "truncate", "/tokenize")
    standin.reset(lambda p, b: rule(p, b) or tokenize(p, b))
    metrics = _Metrics()
    rewards = GeneratorRewards(_cfg(standin), steps_uri=str(tmp_path), round_idx=1)
    assert _generator_call(rewards, 1, metrics) == clean
    assert _calls(metrics, "judge") == {"ok": requests, "retries": 1}
    ledger = rewards._engines("verifier", "tiny-random").ledger
    assert ledger.retries == 3 and ledger.malformed == 0  # /v1/models and /tokenize retried too


def test_a_reply_without_choices_is_a_malformed_lost_verdict(standin, clean_generator, tmp_path):
    clean, requests = clean_generator
    standin.reset(first(1, "no_choices", when=is_judge))
    metrics = _Metrics()
    values = _generator_call(
        GeneratorRewards(_cfg(standin), steps_uri=str(tmp_path), round_idx=1), 1, metrics
    )
    assert values[:2] == [(None, None)] * 2 and values[2:] == clean[2:]
    assert _calls(metrics, "judge") == {"ok": requests - 1, "malformed": 1, "lost_prompts": 1}


def test_a_yes_label_at_the_floor_is_p_yes_zero(standin, tmp_path):
    standin.reset(every("floor_yes", when=is_judge))
    metrics = _Metrics()
    values = _generator_call(
        GeneratorRewards(_cfg(standin), steps_uri=str(tmp_path), round_idx=1), 1, metrics
    )
    judgments = read_frame(str(tmp_path / "step-00001" / "judgments.parquet"), "judgments")
    assert (judgments["p_yes"] == 0.0).all() and not judgments["verdict"].any()
    assert all(v[0] == 0.0 for v in values)  # nothing passes: no item splits a set
    assert set(_calls(metrics, "judge")) == {"ok"}


@pytest.mark.parametrize("shuffle", [False, True])
def test_fewer_rubric_samples_than_asked_is_a_failed_call(standin, tmp_path, shuffle):
    """Without rubrics.shuffle a set's two samples are one request (n=2), answered here with one choice;
    with it each sample is a request of its own (n=1, its own order), one of them answered with none.
    Either way the set lost a rubric sample: no reward for its group, not the score of half its rubrics."""
    cfg = _cfg(standin, samples=2, shuffle=shuffle)
    clean = _policy_call(PolicyReward(cfg, steps_uri=str(tmp_path / "clean"), round_idx=1), 1, _Metrics())
    standin.reset(first(1, "fewer_choices", when=lambda b: _asks_about(standin, b, "7 + 5")))
    metrics = _Metrics()
    values = _policy_call(PolicyReward(cfg, steps_uri=str(tmp_path), round_idx=1), 1, metrics)
    assert values[:4] == [None] * 4 and values[4:] == clean[4:]  # 1 of 2 rubrics: no reward, not half of one
    requests = len(QUESTIONS) * (2 if shuffle else 1)
    assert _calls(metrics, "rubrics") == {"ok": requests - 1, "malformed": 1, "lost_prompts": 1}


# --------------------------------------------------------------------------------------------------
# 4. A lost verdict is never counted ok: each reply that carries none has its outcome.


@pytest.mark.parametrize(
    ("fault", "outcome"),
    [
        ("empty_choices", "malformed"),
        ("null_logprobs", "malformed"),
        ("nan_logprob", "malformed"),
        ("missing_labels", "missing_label_tokens"),
    ],
)
def test_a_reply_without_a_verdict_has_its_own_outcome(standin, clean_generator, tmp_path, fault, outcome):
    clean, requests = clean_generator
    standin.reset(first(1, fault, when=is_judge))
    metrics = _Metrics()
    values = _generator_call(
        GeneratorRewards(_cfg(standin), steps_uri=str(tmp_path), round_idx=1), 1, metrics
    )
    assert values[:2] == [(None, None)] * 2 and values[2:] == clean[2:]
    assert _calls(metrics, "judge") == {"ok": requests - 1, outcome: 1, "lost_prompts": 1}
    assert standin.injected() == {"ok": requests - 1, fault: 1}


OUTCOME_OF = {  # what the client's ledger must call each fault that is not retried
    "http_404": "http_error",
    "no_choices": "malformed",
    "empty_choices": "malformed",
    "null_logprobs": "malformed",
    "nan_logprob": "malformed",
    "missing_labels": "missing_label_tokens",
}


def test_the_engine_gives_every_request_the_outcome_the_server_caused(standin):
    """Straight through the engine: each request one outcome, the verdicts of a lost one NaN, the others
    exactly the fault-free ones."""
    serving_cfg = _cfg(standin).serving
    engine = ServerEngine("tiny-random", standin.url, serving_cfg, role="verifier")
    pairs = [(f"Is {a} + {a} = {2 * a}? Answer yes or no.", "yes") for a in range(len(OUTCOME_OF) + 2)]
    clean = engine.yes_probability(pairs)
    faults = [None, *OUTCOME_OF, None]
    before = engine.ledger.snapshot()
    standin.reset(in_turn(faults))
    got = engine.yes_probability(pairs)
    for fault, value, expected in zip(faults, got, clean, strict=True):
        assert math.isnan(value) if fault else value == expected
    counts = {k: v for k, v in engine.ledger.since(before).items() if v}
    expected_counts: dict[str, int] = {"ok": 2, "lost_prompts": len(OUTCOME_OF)}
    for outcome in OUTCOME_OF.values():
        expected_counts[outcome] = expected_counts.get(outcome, 0) + 1
    assert counts == expected_counts
    engine.close()


@pytest.mark.parametrize("fault", ["drop", "http_500", "http_429", "stall", "abort", "null_finish"])
def test_a_transient_fault_is_retried_and_the_rewards_are_the_same(standin, clean_generator, tmp_path, fault):
    clean, requests = clean_generator
    standin.stall_s = 12.0  # past the request timeout (8 s: a healthy request's answer is well within it)
    standin.reset(first(1, fault, when=is_judge))
    metrics = _Metrics()
    values = _generator_call(
        GeneratorRewards(_cfg(standin, request_timeout_s=8.0), steps_uri=str(tmp_path), round_idx=1),
        1,
        metrics,
    )
    assert values == clean
    assert _calls(metrics, "judge") == {"ok": requests, "retries": 1}
    assert standin.injected() == {"ok": requests, fault: 1}


# --------------------------------------------------------------------------------------------------
# 5. One bound per request whatever the server does, and one for a step's calls of a role.


def test_a_trickled_reply_is_cut_at_the_request_timeout(standin, clean_generator, tmp_path, caplog):
    clean, requests = clean_generator
    standin.trickle_s = 0.05  # a ~1 KB reply over ~50 s, a byte well within any read timeout
    standin.reset(first(1, "trickle", when=is_judge))
    metrics = _Metrics()
    rewards = GeneratorRewards(_cfg(standin, request_timeout_s=5.0), steps_uri=str(tmp_path), round_idx=1)
    started = time.monotonic()
    assert _generator_call(rewards, 1, metrics) == clean  # retried once, then answered
    assert time.monotonic() - started < 5 + 15  # cut at the request's bound, not after the ~50 s trickle
    assert _calls(metrics, "judge") == {"ok": requests, "retries": 1}


def test_a_stalled_server_ends_the_step_within_its_deadline_in_one_line(standin, tmp_path, caplog):
    standin.stall_s = 30
    standin.reset(every("stall", when=is_judge))
    rewards = GeneratorRewards(
        _cfg(standin, concurrency=4, request_timeout_s=0.5, deadline_s=2.0),
        steps_uri=str(tmp_path),
        round_idx=1,
    )
    rewards._engines("verifier", "tiny-random")  # connected before the clock starts
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(RewardError) as failure:
        _generator_call(rewards, 1, _Metrics())
    assert time.monotonic() - started < 2.0 + 2.0  # the step's budget (2 s), not requests × deadline (~13 s)
    message = str(failure.value)
    calls = json.loads((tmp_path / "step-00001" / "calls.json").read_text())
    assert calls["judge/calls_ok"] == 0 and calls["judge/calls_timeout"] > 0
    assert calls["judge/calls_lost_prompts"] == calls["judge/calls_timeout"]  # one verdict a request
    judge_warning = [r.getMessage() for r in caplog.records if r.getMessage().startswith("judge:")]
    assert judge_warning and "timeout" in judge_warning[0] and "label token" not in judge_warning[0]
    # 6. One line: the role, its server, the counts by outcome, where calls.json is; printed whole.
    assert "\n" not in message and "3 of 3 groups" in message
    assert f"verifier at {standin.url}: timeout {int(calls['judge/calls_timeout'])}," in message
    assert str(tmp_path / "step-00001" / "calls.json") in message
    for printed in (describe_error(failure.value), describe_error(_relayed(failure.value, tmp_path))):
        assert printed == message and "internal" not in printed


def _relayed(error: Exception, tmp_path) -> Exception:
    """The error as a training launch reports it from its process's error file (training/process.py)."""
    from dynamicrubric.engines import ServedError as Served

    result = tmp_path / "result.json"
    (tmp_path / "result.json.error").write_text(
        json.dumps(
            {
                "user": False,
                "served": isinstance(error, Served),
                "type": type(error).__name__,
                "message": str(error),
            }
        )
    )
    return launch_error("train-evaluator", str(result), "failed")


def test_a_server_that_drops_every_connection_fails_the_engine_start_in_one_line(standin):
    standin.reset(every("drop", "/v1/models"))
    started = time.monotonic()
    with pytest.raises(ServedError) as failure:
        ServerEngine("tiny-random", standin.url, _cfg(standin, deadline_s=1.0).serving, role="verifier")
    assert time.monotonic() - started < 2.5
    printed = describe_error(failure.value)
    assert f"the verifier server at {standin.url}" in printed and "unreachable 1" in printed
    assert "internal" not in printed and standin.injected("/v1/models")["drop"] >= 2


@pytest.mark.slow  # two training processes against the stand-in: ~40 s
def test_two_ranks_end_a_served_outage_by_the_ledger_not_by_a_collective_timeout(standin, tmp_path):
    """7. With served models rank 0 asks for a whole step's scores while the other ranks wait for them.
    A verifier that stops answering is bounded by the ledger (serving.deadline_s, 15 s here), which is
    longer than the process group's timeout (10 s, as NCCL's 600 s is shorter than the defaults' 900 s):
    the waiting rank waits on the CPU group (training/cpu_waits.py), and the step ends in the ledger's one
    line naming the role and the counts, not in a collective's "Timed out waiting 10000ms"."""
    from test_train import _prompts

    from dynamicrubric.training import launcher
    from dynamicrubric.training.data import TrainingJob

    standin.stall_s = 120
    standin.reset(every("stall", when=is_judge))
    cfg = load_config(
        preset="tiny",
        overrides={
            "judge": {"variant": "pointwise"},
            "models": {"generator_url": standin.url, "verifier_url": standin.url},
            "serving": {**SERVING, "request_timeout_s": 4.0, "deadline_s": 15.0, "concurrency": 4},
            "train_policy": {"max_steps": 1, "prompts_per_step": 2, "per_device_train_batch_size": 2,
                             "world_size": 2, "process_group_timeout_s": 10, "torch_threads": 1},
        },
    )  # fmt: skip
    job = TrainingJob("train-policy", prompts_uri=_prompts(tmp_path, cfg), policy="tiny-random",
                      generator="tiny-random", out_uri=str(tmp_path / "policy"),
                      steps_uri=str(tmp_path / "steps"), round_idx=1)  # fmt: skip
    with pytest.raises(Exception) as failure:
        launcher.launch(cfg, job)
    message = str(failure.value)
    assert "Timed out waiting" not in message, message
    assert f"verifier at {standin.url}: timeout " in message and "calls.json" in message, message


# --------------------------------------------------------------------------------------------------
# 7. On several nodes every node's servers score its share of the step: two nodes of one process each
# (a real two-machine `accelerate launch` on loopback, the command a TrainJob's node runs), each
# calling the reward as TRL does with its slice of the batch, each with its own stand-in server.

NODE_SCRIPT = """
import json, os, sys, time
from datetime import timedelta
from types import SimpleNamespace
from accelerate import PartialState
from dynamicrubric.infra.config_loading import config_from_yaml
from dynamicrubric.training import cpu_waits
from dynamicrubric.training.policy_reward import PolicyReward
state = PartialState(cpu=True)
cpu_waits.init(timedelta(seconds=120))  # as the trainer does; no wait below may come near it
rank, world, node = state.process_index, state.num_processes, int(os.environ["GROUP_RANK"])
spec = json.loads(open(sys.argv[1]).read())
batch = spec["batch"]
rows = len(batch["completions"])
mine = slice(rank * rows // world, (rank + 1) * rows // world)  # rows 0-5 and 6-11: a group cut in two
out = []
for step, configs in enumerate(spec["calls"], start=1):
    cfg = config_from_yaml(open(configs[node]).read())
    reward = PolicyReward(cfg, steps_uri=spec["steps"], round_idx=1)
    metrics = {}
    started = time.monotonic()
    try:
        values = reward(batch["prompts"][mine], batch["completions"][mine], batch["completion_ids"][mine],
                        **{k: v[mine] for k, v in batch["columns"].items()},
                        trainer_state=SimpleNamespace(global_step=step - 1),
                        log_metric=lambda name, value: metrics.__setitem__(name, value))
        out.append({"values": values, "metrics": metrics, "seconds": time.monotonic() - started})
    except Exception as e:
        out.append({"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - started})
with open(f"{spec['out']}/rank-{rank}.json", "w") as f:
    json.dump({"node": node, "calls": out}, f)
state.wait_for_everyone()
state.destroy_process_group()
"""


@pytest.fixture(scope="module")
def node1_server():
    """Node 1's own server (the module's `server` is node 0's): the same model on another port."""
    with serving(str(resolve_model("tiny-random"))) as s:
        yield s


def _questions_asked(standin, asked: list[tuple[str, str]]):
    """A fault rule that answers honestly and notes (role, question) for every prompt of every
    completion request (a rubric request has one prompt, a judge request `request_prompts`)."""

    def rule(path: str, body: dict) -> None:
        if path == "/v1/completions":
            prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
            for ids in prompts:
                text = standin.tokenizer.decode(ids)
                question = next(q for q, question in QUESTIONS.items() if question in text)
                asked.append(("judge" if is_judge(body) else "rubrics", question))

    return rule


def _batch() -> dict:
    ids = [pid for pid in QUESTIONS for _ in RESPONSES[pid]]
    completions = [r for pid in QUESTIONS for r in RESPONSES[pid]]
    return {
        "prompts": [[{"role": "user", "content": QUESTIONS[p]}] for p in ids],
        "completions": [[{"role": "assistant", "content": c}] for c in completions],
        "completion_ids": [[1] * 5 for _ in completions],
        "columns": {
            "prompt_id": ids,
            "prompt_text": [QUESTIONS[p] for p in ids],
            "task": ["open"] * len(ids),
            "reference": [None] * len(ids),
            "meta": [None] * len(ids),
        },
    }


def _on_two_nodes(tmp_path, calls: list[tuple[str, str]]) -> list[dict]:
    """Each call's (node 0's config, node 1's config) on two nodes of one process each; each rank's
    record of its calls (values and metrics, or the error it raised)."""
    import os
    import subprocess

    from dynamicrubric.infra.serving import free_port
    from dynamicrubric.training.launcher import Rendezvous, launch_command

    script, spec = tmp_path / "node.py", tmp_path / "spec.json"
    script.write_text(NODE_SCRIPT)
    (tmp_path / "out").mkdir()
    spec.write_text(json.dumps({"batch": _batch(), "calls": calls, "steps": str(tmp_path / "steps"),
                                "out": str(tmp_path / "out")}))  # fmt: skip
    port, nodes = free_port(), []
    for node in (0, 1):
        cmd = launch_command(2, [], Rendezvous(2, node, "127.0.0.1", port), rendezvous_timeout_s=120)
        assert cmd[-2:] == ["-m", "dynamicrubric.training.process"]  # the nodes' own launch, our script
        log = open(tmp_path / f"node-{node}.log", "w")  # noqa: SIM115 (closed below)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        nodes.append(
            (subprocess.Popen([*cmd[:-2], str(script), str(spec)], stdout=log, stderr=log, env=env), log)
        )
    for process, log in nodes:
        try:
            process.wait(timeout=300)
        finally:
            process.kill()
            log.close()
    for node, (process, _) in enumerate(nodes):
        assert process.returncode == 0, (tmp_path / f"node-{node}.log").read_text()[-3000:]
    ranks = [json.loads((tmp_path / "out" / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["node"] for r in ranks] == [0, 1]
    return ranks


# Room for a loaded machine: the rewards are compared with the one-node run's, so no request may time out.
PATIENT = {"request_timeout_s": 60.0, "deadline_s": 120.0}
# The tiny model's constrained rubrics are cut off (scored empty): the rubric variant asks G and no
# verdict, the pointwise one a verdict of V for every response, its P(yes) the reward (soft).
VARIANTS = ("rubric", "pointwise")


def _node_config(tmp_path, name: str, url: str, judge: str, **serving_over) -> str:
    path = tmp_path / f"{name}.yaml"
    cfg = _cfg(SimpleNamespace(url=url), judge=judge, soft=True, **{**PATIENT, **serving_over})
    path.write_text(cfg.to_yaml())
    return str(path)


def _one_node(standin, steps, judge: str, asked: list | None = None) -> tuple[list, dict]:
    """The step on one node (one process sends every request): its rewards and metrics."""
    standin.reset(_questions_asked(standin, asked) if asked is not None else None)
    metrics = _Metrics()
    reward = PolicyReward(_cfg(standin, judge=judge, soft=True, **PATIENT), steps_uri=str(steps), round_idx=1)
    values = _policy_call(reward, 1, metrics)
    assert all(v is not None for v in values)
    return values, metrics


@pytest.mark.slow  # two training processes against two stand-ins: ~40 s
def test_on_two_nodes_each_node_s_servers_score_its_share_with_the_one_node_rewards(
    server, node1_server, tmp_path
):
    """Group g goes to node g % 2: node 0's servers get every request about q-add and q-mul, node 1's
    every one about q-sub, as many of each as one node sends; the rewards, the rubrics and the step's
    counts are the one-node run's, and each node's artifacts are in its own folder. Two steps: rubrics
    (G's requests), then pointwise verdicts (V's)."""
    one_node: list[tuple[str, str]] = []
    clean = {v: _one_node(server, tmp_path / "one-node" / v, v, one_node) for v in VARIANTS}
    asked: dict[int, list[tuple[str, str]]] = {0: [], 1: []}
    server.reset(_questions_asked(server, asked[0]))
    node1_server.reset(_questions_asked(node1_server, asked[1]))
    ranks = _on_two_nodes(
        tmp_path, [[_node_config(tmp_path, f"{v}-{n}", s.url, v) for n, s in enumerate((server, node1_server))] for v in VARIANTS]
    )  # fmt: skip
    assert sorted(asked[0]) == sorted(a for a in one_node if a[1] in ("q-add", "q-mul"))
    assert sorted(asked[1]) == sorted(a for a in one_node if a[1] == "q-sub")
    assert {role for role, _ in asked[1]} == {"rubrics", "judge"}
    for call, variant in enumerate(VARIANTS):
        values, metrics = clean[variant]
        assert ranks[0]["calls"][call]["values"] + ranks[1]["calls"][call]["values"] == values
        # The main process logs the step's metrics for both nodes: its counts are the one-node step's.
        combined = ranks[0]["calls"][call]["metrics"]
        assert ranks[1]["calls"][call]["metrics"] == {}
        counted = [name for name in metrics if "/calls_" in name or name.endswith("_groups")]
        assert counted and {n: combined[n] for n in counted} == {n: metrics[n] for n in counted}
    steps = tmp_path / "steps"
    whole = read_frame(str(tmp_path / "one-node" / "rubric" / "step-00001" / "rubrics.parquet"), "rubrics")
    for node, ids in ((0, {"q-add", "q-mul"}), (1, {"q-sub"})):
        part = steps / "step-00001" / f"node-{node}"
        calls = json.loads((part / "calls.json").read_text())
        assert calls["rubrics/calls_ok"] == len(ids)  # one request a group
        # Each group's rubric is the one the one-node step drew: seeded by its place in the whole batch.
        rubrics = read_frame(str(part / "rubrics.parquet"), "rubrics").set_index("prompt_id")["completion"]
        assert rubrics.to_dict() == {
            p: c for p, c in whole.set_index("prompt_id")["completion"].items() if p in ids
        }
        part = steps / "step-00002" / f"node-{node}"
        calls = json.loads((part / "calls.json").read_text())
        assert calls["judge/calls_ok"] == sum(len(RESPONSES[p]) for p in ids)  # one request a verdict
        assert set(read_frame(str(part / "judgments.parquet"), "judgments")["prompt_id"]) == ids
        for name in ("rollouts", "scores", "rewards"):
            assert set(read_frame(str(part / f"{name}.parquet"), name)["prompt_id"]) == ids, name
    assert not any((steps / step / "calls.json").exists() for step in ("step-00001", "step-00002"))


@pytest.mark.slow  # two training processes against two stand-ins: ~40 s
def test_on_two_nodes_the_budget_is_the_whole_step_s_and_a_node_s_failure_ends_it_in_one_line(
    server, node1_server, tmp_path
):
    """Node 1's server loses every verdict (404). Step 1: its one group of three is a third of the step,
    within a budget of 0.5 though node 1 lost all of its own: node 1's group gets no reward, the others
    the one-node values. Step 2, budget 0.25: both processes end with the same line naming node 1's
    server and record. Step 3: nothing listens on node 1's URL; both processes end at once with one line
    naming node 1 and that URL, node 0's not waiting out the CPU group's timeout (120 s)."""
    from dynamicrubric.infra.serving import free_port

    clean, _ = _one_node(server, tmp_path / "one-node", "pointwise")
    server.reset()
    node1_server.reset(every("http_404", when=is_judge))
    dead = f"http://127.0.0.1:{free_port()}"
    nodes = (server, node1_server)
    calls = [
        [_node_config(tmp_path, f"{n}-within", s.url, "pointwise") for n, s in enumerate(nodes)],
        [_node_config(tmp_path, f"{n}-over", s.url, "pointwise", max_failed_fraction=0.25) for n, s in enumerate(nodes)],
        [_node_config(tmp_path, "0-down", server.url, "pointwise"),
         _node_config(tmp_path, "1-down", dead, "pointwise", deadline_s=3.0)],
    ]  # fmt: skip
    ranks = _on_two_nodes(tmp_path, calls)
    within = ranks[0]["calls"][0]["values"] + ranks[1]["calls"][0]["values"]
    assert within[4:8] == [None] * 4 and within[:4] + within[8:] == clean[:4] + clean[8:]
    assert ranks[0]["calls"][0]["metrics"]["rewards/failed_groups"] == 1
    part = tmp_path / "steps" / "step-00001" / "node-1"
    assert set(read_frame(str(part / "failed-judgments.parquet"), "judgments")["prompt_id"]) == {"q-sub"}

    over = [r["calls"][1] for r in ranks]
    record = tmp_path / "steps" / "step-00002" / "node-1" / "calls.json"
    assert over[0]["error"] == over[1]["error"] == "RewardError" and over[0]["message"] == over[1]["message"]
    message = over[0]["message"]
    assert message.startswith("train-policy step 2: 1 of 3 groups lost verdicts or rubrics (33% > ")
    assert (
        f"node 1: requests in {record}; " in message
        and f"verifier at {node1_server.url}: http_error 4" in message
    )
    assert server.url not in message and "\n" not in message

    down = [r["calls"][2] for r in ranks]
    assert down[0]["error"] == down[1]["error"] == "ServedError" and down[0]["message"] == down[1]["message"]
    assert (
        down[0]["message"].startswith(f"node 1: the verifier server at {dead}")
        and "unreachable" in down[0]["message"]
    )
    assert "\n" not in down[0]["message"] and all(d["seconds"] < 60 for d in down)
