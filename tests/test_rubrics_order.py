"""The order in which the generator reads a candidate set's responses, per rubric sample
(`rubrics.shuffle`): several samples each read their own seeded order, one sample reads the set's one
order as it always did, and the generator's own trainer keeps one prompt per set (tiny-random, CPU)."""

from __future__ import annotations

import pandas as pd
import pytest

from dynamicrubric.engines import load_engine
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.scoring.prompts import dynamic_rubric_prompt, response_order
from dynamicrubric.scoring.rubrics import generate_rubrics, generator_messages, rubric_requests
from dynamicrubric.training.data import evaluator_dataset

K = 5
RESPONSES = {
    "p-a": [f"answer a{i}: {i * 11}" for i in range(K)],
    "p-b": [f"answer b{i}: {i * 7}" for i in range(K)],
}


def _cfg(**rubrics):
    # Short unconstrained samples: what the tiny model writes does not matter here, only what it read.
    base = {"constrained": False, "max_new_tokens": 16}
    return load_config(preset="tiny", overrides={"rubrics": {**base, **rubrics}})


@pytest.fixture(scope="module")
def rollouts() -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"prompt_id": pid, "sample_idx": i, "prompt": f"Task {pid}?", "response": r, "num_tokens": 4,
             "finish_reason": "stop", "policy": "p", "seed": 0}
            for pid, responses in RESPONSES.items()
            for i, r in enumerate(responses)
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    return load_engine("tiny-random", load_config(preset="tiny").engine)


def shown_order(prompt: str, pid: str) -> list[int]:
    """The sample_idx of each response in the order a generator prompt shows them."""
    return sorted(range(K), key=lambda i: prompt.index(RESPONSES[pid][i]))


def test_several_samples_each_read_their_own_order(rollouts):
    cfg = _cfg(shuffle=True)
    requests = rubric_requests(rollouts, cfg, "dynamic", seed=11, samples=3)
    assert requests[["prompt_id", "rubric_idx"]].values.tolist() == [
        [pid, g] for pid in RESPONSES for g in range(3)
    ]
    for pid, rows in requests.groupby("prompt_id"):
        orders = [shown_order(text, pid) for text in rows["generator_prompt"]]
        assert orders == [response_order(pid, K, 11, g) for g in range(3)]
        assert len({tuple(o) for o in orders}) == 3, pid  # no two samples read the same order


def test_without_shuffle_or_with_one_sample_every_sample_reads_the_sets_one_order(rollouts):
    single = rubric_requests(rollouts, _cfg(shuffle=True), "dynamic", seed=11, samples=1)
    unshuffled = rubric_requests(rollouts, _cfg(shuffle=False), "dynamic", seed=11, samples=3)
    static = rubric_requests(rollouts, _cfg(shuffle=True), "static", seed=11, samples=3)
    for requests in (single, unshuffled, static):
        assert requests["rubric_idx"].tolist() == [0, 0]  # one prompt per set serves all its samples
    pd.testing.assert_frame_equal(single, unshuffled)
    cfg = _cfg()
    for pid, text in zip(single["prompt_id"], single["generator_prompt"], strict=True):
        shown = [RESPONSES[pid][i] for i in response_order(pid, K, 11)]  # the order a set always had
        assert text == dynamic_rubric_prompt(f"Task {pid}?", shown, cfg.rubrics.num_items, 200)


def _recorded(engine, monkeypatch) -> list[tuple[list[str], int]]:
    """Every `generate` call the engine gets: its prompts and n (the real engine answers)."""
    calls, real = [], engine.generate

    def generate(prompts, n=1, **kwargs):
        calls.append((list(prompts), n))
        return real(prompts, n, **kwargs)

    monkeypatch.setattr(engine, "generate", generate)
    return calls


def test_each_rubric_sample_is_written_from_the_prompt_it_read(rollouts, engine, monkeypatch):
    """With shuffle each sample is a prompt of its own, all of them in one engine call (batched
    together), and each row's generator_prompt is the prompt its sample was generated from."""
    calls = _recorded(engine, monkeypatch)
    rubrics, counts = generate_rubrics(rollouts, _cfg(shuffle=True), samples=3, seed=11, engine=engine)
    assert len(calls) == 1 and calls[0][1] == 1 and len(calls[0][0]) == 6
    assert counts["candidate_sets"] == 2 and counts["rubrics"] == 6
    assert rubrics[["prompt_id", "rubric_idx"]].values.tolist() == [
        [p, g] for p in RESPONSES for g in range(3)
    ]
    read = [
        engine.chat_prompt(generator_messages(t), enable_thinking=False) for t in rubrics["generator_prompt"]
    ]
    assert read == calls[0][0]
    assert rubrics.groupby("prompt_id")["generator_prompt"].nunique().tolist() == [3, 3]

    calls.clear()
    rubrics, _ = generate_rubrics(rollouts, _cfg(shuffle=False), samples=3, seed=11, engine=engine)
    assert len(calls) == 1 and calls[0][1] == 3 and len(calls[0][0]) == 2  # one prompt, n samples a set
    assert rubrics.groupby("prompt_id")["generator_prompt"].nunique().tolist() == [1, 1]


def test_one_sample_is_the_same_with_and_without_shuffle(rollouts, engine):
    """A single sample per set (the default everywhere) writes the same rubrics table either way."""
    on, _ = generate_rubrics(rollouts, _cfg(shuffle=True), samples=1, seed=5, engine=engine)
    off, _ = generate_rubrics(rollouts, _cfg(shuffle=False), samples=1, seed=5, engine=engine)
    pd.testing.assert_frame_equal(on, off)


def test_the_generators_trainer_keeps_one_prompt_per_candidate_set(rollouts):
    """A GRPO group is G samples of one prompt: the generator's dataset has one row per set, in the
    set's one order, whatever rubrics.shuffle and rubrics.samples say."""
    cfg = _cfg(shuffle=True, samples=4, train_samples=4)
    anchors = pd.DataFrame(columns=["list_id", "sample_idx", "rank"])
    data = evaluator_dataset(cfg, rollouts, anchors, round_idx=1)
    assert data["prompt_id"] == list(RESPONSES)
    expected = rubric_requests(rollouts, cfg, "dynamic", seed=_evaluator_seed(cfg), samples=1)
    assert data["generator_prompt"] == expected["generator_prompt"].tolist()
    for pid, text in zip(data["prompt_id"], data["generator_prompt"], strict=True):
        assert shown_order(text, pid) == response_order(pid, K, _evaluator_seed(cfg))


def _evaluator_seed(cfg) -> int:
    from dynamicrubric.infra.config import SeedPurpose, round_seed

    return round_seed(cfg, 1, SeedPurpose.EVALUATOR_RUBRICS)


def _set_of(pid: str, responses: list[str]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"prompt_id": pid, "sample_idx": i, "prompt": f"Task {pid}: describe the sea.", "response": r,
             "num_tokens": 4, "finish_reason": "stop", "policy": "p", "seed": 0}
            for i, r in enumerate(responses)
        ]
    )  # fmt: skip


def test_a_set_too_long_for_the_generators_context_is_clipped_to_fit(engine):
    """A guard-sized set (16 responses of 4,000 characters: far over tiny-random's 2,048 tokens) is
    written with every response clipped at one shorter length so that the prompt and rubrics.max_new_tokens
    fit the context: the engine would otherwise refuse it (engine.long_prompts: error) or cut off the task."""
    cfg = _cfg(max_response_chars=4000, max_new_tokens=16)
    long_set = _set_of("p-long", [f"wave {i} " * 600 for i in range(16)])
    room = engine.context_length - 16

    def tokens(text: str) -> int:
        chat = engine.chat_prompt(generator_messages(text))
        return len(engine.tokenizer.encode(chat, add_special_tokens=False))

    unfitted = rubric_requests(long_set, cfg, "dynamic", seed=3)
    assert not unfitted["clipped_to_fit"].any() and tokens(unfitted["generator_prompt"].iloc[0]) > room
    rubrics, counts = generate_rubrics(long_set, cfg, seed=3, engine=engine)
    assert counts["clipped_to_fit"] == 1
    prompt = rubrics["generator_prompt"].iloc[0]
    assert room / 2 < tokens(prompt) <= room  # fitted, not emptied
    assert "Task p-long: describe the sea." in prompt
    assert all(f"Response {label}:\n" in prompt for label in "ABCDEFGHIJKLMNOP")
    assert prompt.count(" […]") == 16  # every response cut at the one shorter length

    short_set = _set_of("p-short", [f"wave {i}" for i in range(16)])
    rubrics, counts = generate_rubrics(short_set, cfg, seed=3, engine=engine)
    assert counts["clipped_to_fit"] == 0
    assert (
        rubrics["generator_prompt"].tolist()
        == rubric_requests(short_set, cfg, "dynamic", seed=3)["generator_prompt"].tolist()
    )
