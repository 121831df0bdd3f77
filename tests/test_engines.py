"""HFEngine against plain full forward passes of the same model; VLLMEngine where a GPU and vllm exist
(on CPU the real vLLM engine is tested by `make test-vllm`, tests_vllm/).

The model cache lives under pytest's tmp (set by conftest's `_model_cache`) unless DYNRUBRIC_CACHE is set.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dynamicrubric.engines import (
    NO_SPELLINGS,
    YES_SPELLINGS,
    EngineError,
    Generation,
    HFEngine,
    VLLMEngine,
    load_engine,
)
from dynamicrubric.infra.config import EngineConfig
from dynamicrubric.infra.models import resolve_model

QUESTIONS = ["What is 2+3?", "Name a colour.", "Write a short poem about the sea, please, in four lines."]


@pytest.fixture(scope="session")
def engine() -> HFEngine:
    return HFEngine("tiny-random", device="cpu", batch_size=4)


@pytest.fixture(scope="session")
def prompts(engine: HFEngine) -> list[str]:
    return [engine.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]


def _ids(engine: HFEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _full_logits(engine: HFEngine, ids: list[int]) -> torch.Tensor:
    """Logits of one unpadded sequence, no cache: the reference every engine path is compared with."""
    with torch.no_grad():
        return engine.model(input_ids=torch.tensor([ids])).logits[0].float()


def _reference_p_yes(engine: HFEngine, prefix: str, suffix: str) -> float:
    probs = torch.softmax(_full_logits(engine, _ids(engine, prefix) + _ids(engine, suffix))[-1], dim=-1)

    def mass(spellings: tuple[str, ...]) -> float:
        single = {t[0] for t in (_ids(engine, s) for s in spellings) if len(t) == 1}
        return float(sum(probs[t] for t in single))

    yes, no = mass(YES_SPELLINGS), mass(NO_SPELLINGS)
    return yes / (yes + no)


# ---- generation


def test_same_seed_same_samples_and_other_seed_differs(engine: HFEngine, prompts: list[str]) -> None:
    a = engine.generate(prompts, n=3, max_new_tokens=10, seed=7)
    b = engine.generate(prompts, n=3, max_new_tokens=10, seed=7)
    c = engine.generate(prompts, n=3, max_new_tokens=10, seed=8)
    assert a == b
    assert [g.texts for g in a] != [g.texts for g in c]
    assert all(len(set(g.texts)) > 1 for g in a), "the n samples of one prompt must differ"
    assert all(isinstance(g, Generation) and len(g.texts) == len(g.num_tokens) == 3 for g in a)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_samples_do_not_depend_on_batch_size(engine: HFEngine, prompts: list[str], top_p: float) -> None:
    results = []
    for bs in (1, 3, 16):
        e = HFEngine("tiny-random", model=engine.model, tokenizer=engine.tokenizer, batch_size=bs)
        results.append(e.generate(prompts, n=2, max_new_tokens=8, top_p=top_p, seed=3))
    assert results[0] == results[1] == results[2]
    # A prompt's samples do not depend on which other prompts are in the call either.
    alone = engine.generate(prompts[:1], n=2, max_new_tokens=8, top_p=top_p, seed=3)
    assert alone[0] == results[0][0]


def test_a_part_of_a_batch_samples_as_it_would_in_the_whole(engine: HFEngine, prompts: list[str]) -> None:
    """A training step split over nodes generates each node's groups apart: with their places in the
    whole batch (`prompt_indices`) they get the samples the whole batch's call gives them."""
    whole = engine.generate(prompts, n=2, max_new_tokens=8, seed=3)
    part = engine.generate([prompts[2], prompts[0]], n=2, max_new_tokens=8, seed=3, prompt_indices=[2, 0])
    assert part == [whole[2], whole[0]]
    assert engine.generate(prompts[2:], n=2, max_new_tokens=8, seed=3) != [whole[2]]  # place 0: other samples
    with pytest.raises(EngineError, match="2 prompt_indices for 1 prompts"):
        engine.generate(prompts[:1], n=1, max_new_tokens=2, prompt_indices=[0, 1])


def test_greedy_matches_a_manual_loop_without_cache(engine: HFEngine, prompts: list[str]) -> None:
    gens = engine.generate(prompts, n=1, temperature=0.0, max_new_tokens=6)
    for prompt, gen in zip(prompts, gens, strict=True):
        ids = _ids(engine, prompt)
        new: list[int] = []
        for _ in range(6):
            nxt = int(_full_logits(engine, ids + new)[-1].argmax())
            new.append(nxt)
            if nxt in engine.stop_ids:
                break
        expected = engine.tokenizer.decode(
            [t for t in new if t not in engine.stop_ids], skip_special_tokens=True
        )
        assert gen.texts == [expected]
        assert gen.num_tokens == [len(new)]


def test_tiny_top_p_is_greedy(engine: HFEngine, prompts: list[str]) -> None:
    greedy = engine.generate(prompts, temperature=0.0, max_new_tokens=6)
    nucleus = engine.generate(prompts, n=2, temperature=1.0, top_p=1e-6, max_new_tokens=6, seed=5)
    assert [g.texts[0] for g in greedy] == [g.texts[0] for g in nucleus] == [g.texts[1] for g in nucleus]


def test_finish_reasons_stop_and_length(engine: HFEngine, prompts: list[str]) -> None:
    length = engine.generate(prompts[:1], temperature=0.0, max_new_tokens=5)[0]
    assert length.finish_reasons == ["length"] and length.num_tokens == [5]
    # Make the greedy first token the model's eos: generation must stop right there, with no text.
    first = int(_full_logits(engine, _ids(engine, prompts[0]))[-1].argmax())
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random"))
    model.generation_config.eos_token_id = [first]
    stopping = HFEngine("tiny-random", model=model, tokenizer=engine.tokenizer)
    got = stopping.generate(prompts[:1], temperature=0.0, max_new_tokens=5)[0]
    assert got.finish_reasons == ["stop"] and got.num_tokens == [1] and got.texts == [""]


def test_generate_rejects_bad_arguments(engine: HFEngine, prompts: list[str]) -> None:
    with pytest.raises(EngineError, match="n must be"):
        engine.generate(prompts, n=0)
    with pytest.raises(EngineError, match="top_p"):
        engine.generate(prompts, top_p=0.0)
    with pytest.raises(EngineError, match="temperature"):
        engine.generate(prompts, temperature=-1.0)
    with pytest.raises(EngineError, match="prompt 1 is empty"):
        engine.generate([prompts[0], ""])
    assert engine.generate([]) == []


def test_chat_prompt_uses_chatml(engine: HFEngine) -> None:
    text = engine.chat_prompt([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(EngineError, match="role, content"):
        engine.chat_prompt([{"text": "no role"}])


# ---- judging


def _judge_pairs(engine: HFEngine) -> list[tuple[str, str]]:
    """Three contexts of different lengths, five items each, interleaved so groups are not contiguous."""
    contexts = [
        engine.chat_prompt([{"role": "user", "content": q}]) + f"Response {i}: the answer is {i * 7}."
        for i, q in enumerate(QUESTIONS)
    ]
    items = [
        "Is it correct?",
        "Does it explain the steps?",
        "Is it concise and polite?",
        "Does it mention a number?",
        "Yes or no: is the final answer stated clearly at the end?",
    ]
    return [(c, f"\nQuestion: {item}\nAnswer:") for item in items for c in contexts]


@pytest.mark.parametrize("batch_size", [2, 4, 64])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_yes_probability_equals_a_full_forward_pass(
    engine: HFEngine, batch_size: int, share_prefix: bool
) -> None:
    pairs = _judge_pairs(engine)
    e = HFEngine("tiny-random", model=engine.model, tokenizer=engine.tokenizer, batch_size=batch_size)
    got = e.yes_probability(pairs, share_prefix=share_prefix)
    expected = [_reference_p_yes(engine, p, s) for p, s in pairs]
    assert got == pytest.approx(expected, abs=1e-4)
    # The probabilities must vary, or a wrong implementation could match by accident.
    assert max(expected) - min(expected) > 0.05


def test_yes_probability_counts_every_spelling(engine: HFEngine) -> None:
    yes = {engine.tokenizer.decode([t]) for t in engine.yes_ids}
    no = {engine.tokenizer.decode([t]) for t in engine.no_ids}
    assert {"yes", "Yes", " yes"} <= yes and {"no", " no"} <= no


def test_yes_probability_rejects_bad_pairs(engine: HFEngine) -> None:
    with pytest.raises(EngineError, match="pair 0"):
        engine.yes_probability(["not a pair"])  # type: ignore[list-item]
    with pytest.raises(EngineError, match="empty suffix"):
        engine.yes_probability([("context", "")])
    assert engine.yes_probability([]) == []


# ---- log-probs


def test_logprobs_match_a_manual_forward(engine: HFEngine, prompts: list[str]) -> None:
    completions = ["The answer is 5.", "Blue", ""]
    got = engine.logprobs(prompts, completions)
    for prompt, completion, lps in zip(prompts, completions, got, strict=True):
        p, c = _ids(engine, prompt), _ids(engine, completion)
        logp = torch.log_softmax(_full_logits(engine, p + c), dim=-1)
        expected = [float(logp[len(p) - 1 + k, tok]) for k, tok in enumerate(c)]
        assert len(lps) == len(c)
        assert lps == pytest.approx(expected, abs=1e-4)
    with pytest.raises(EngineError, match="2 prompts but 1 completions"):
        engine.logprobs(prompts[:2], ["x"])


# ---- engine choice


def test_load_engine_chooses_by_config(engine: HFEngine) -> None:
    hf = load_engine("tiny-random", EngineConfig(engine="hf", device="cpu", batch_size=5))
    assert isinstance(hf, HFEngine) and hf.batch_size == 5 and hf.model.dtype == torch.float32
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(EngineError, match="needs the vllm package"):
            load_engine("tiny-random", EngineConfig(engine="vllm"))
    with pytest.raises(EngineError, match="runs on a GPU"):
        load_engine("tiny-random", EngineConfig(engine="vllm", device="cpu"))


def test_engine_wraps_a_loaded_model_only_with_its_tokenizer(engine: HFEngine) -> None:
    with pytest.raises(EngineError, match="tokenizer"):
        HFEngine("x", model=engine.model)
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-random"))
    assert HFEngine("x", model=engine.model, tokenizer=tok).chat_prompt([{"role": "user", "content": "hi"}])


_NO_VLLM = importlib.util.find_spec("vllm") is None or not torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(_NO_VLLM, reason="vLLM needs the vllm package and a CUDA GPU (GPU image only)")
def test_vllm_engine_matches_hf(engine: HFEngine, prompts: list[str]) -> None:
    v = VLLMEngine("tiny-random", dtype="float32", gpu_memory_utilization=0.3)
    a = v.generate(prompts, n=2, max_new_tokens=8, seed=1)
    assert a == v.generate(prompts, n=2, max_new_tokens=8, seed=1)
    greedy_v = v.generate(prompts, temperature=0.0, max_new_tokens=6)
    greedy_h = engine.generate(prompts, temperature=0.0, max_new_tokens=6)
    assert [g.texts for g in greedy_v] == [g.texts for g in greedy_h]
    pairs = _judge_pairs(engine)
    # P(yes) comes from the label tokens' own log-probs (logprob_token_ids): bf16/fp32 kernel noise only.
    assert v.yes_probability(pairs) == pytest.approx(engine.yes_probability(pairs), abs=1e-3)
    completions = ["The answer is 5.", "Blue", "x"]
    assert v.logprobs(prompts, completions)[0] == pytest.approx(
        engine.logprobs(prompts, completions)[0], abs=1e-3
    )


# ---- thinking templates, unscored verdicts, progress


THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}"
)


def test_enable_thinking_is_passed_to_the_template(engine: HFEngine) -> None:
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-random"))
    tok.chat_template = THINKING_TEMPLATE
    thinking = HFEngine("x", model=engine.model, tokenizer=tok)
    msgs = [{"role": "user", "content": "Hi"}]
    assert thinking.chat_prompt(msgs, enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert thinking.chat_prompt(msgs, enable_thinking=True).endswith("assistant\n")
    assert thinking.chat_prompt(msgs) == thinking.chat_prompt(msgs, enable_thinking=True)  # template default
    # A template that does not know the flag ignores it.
    assert engine.chat_prompt(msgs, enable_thinking=False) == engine.chat_prompt(msgs)


def test_a_verdict_without_finite_label_logits_is_nan_not_a_guess(engine: HFEngine) -> None:
    broken = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random"))
    with torch.no_grad():
        broken.get_output_embeddings().weight[engine.yes_ids + engine.no_ids] = float("nan")
    e = HFEngine("broken", model=broken, tokenizer=engine.tokenizer)
    pairs = _judge_pairs(engine)[:3]
    assert all(p != p for p in e.yes_probability(pairs))  # NaN
    assert all(0 < p < 1 for p in engine.yes_probability(pairs))


def test_progress_bar_shows_counts_and_rate_off_a_terminal(
    engine: HFEngine, prompts: list[str], capfd
) -> None:
    engine.generate(prompts, n=2, max_new_tokens=2, desc="rollout")
    err = capfd.readouterr().err
    assert "rollout: 100%" in err and "6/6" in err and "sample/s" in err


def test_progress_reaches_a_kfp_local_log() -> None:
    """kfp.local runs a task with stdout=PIPE, stderr=STDOUT, text=True and prints each line it reads:
    the bar's carriage-return refreshes must arrive there as lines with counts and a rate."""
    import subprocess
    import sys

    code = (
        "import time\nfrom dynamicrubric.engines import progress_bar\n"
        "with progress_bar(3, 'judge', 'judgment') as bar:\n"
        "    for _ in range(3):\n        time.sleep(0.05)\n        bar.update(1)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        lines = list(iter(proc.stdout.readline, ""))
    assert proc.returncode == 0
    assert any(line.startswith("judge: 100%") and "3/3" in line and "judgment/s" in line for line in lines)
