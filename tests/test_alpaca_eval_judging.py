"""AlpacaEval 2's own annotation (evaluation/alpaca_eval_judging.py): alpaca_eval's annotator, prompt,
seeded order and log-prob parser, with a judge of the project's. The judges here are planted stand-ins
(a rule the test knows) and the tiny-random model's real forward pass."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from dynamicrubric.engines.transformers_engine import HFEngine
from dynamicrubric.evaluation.alpaca_eval_judging import (
    annotate,
    annotator_config,
    engine_label_logprobs,
    labels,
)
from dynamicrubric.evaluation.benchmark_scores import alpaca_eval_scores, pairwise_outcomes

N = 200
PREFERENCE = 0.60  # the planted judge's preference for the policy, averaged over the two positions
BIAS = 0.25  # its extra preference for whichever output it is shown first: larger than the margin


def _pairs(n: int) -> tuple[list[str], list[str], list[str]]:
    instructions = [f"Instruction number {i}: say something useful." for i in range(n)]
    return instructions, [f"baseline answer {i}" for i in range(n)], [f"policy answer {i}" for i in range(n)]


def _shown_first(messages: list[dict[str, str]]) -> str:
    """Whose output the annotator's prompt shows as the first model (label m)."""
    user = next(m["content"] for m in messages if m["role"] == "user")
    return re.search(r"(policy|baseline) answer \d+", user).group(1)


def _biased_judge(fail: set[int] = frozenset()):
    """P(policy's label) = PREFERENCE + BIAS when the policy is shown first, PREFERENCE - BIAS when second;
    the calls whose instruction number is in `fail` come back without log-probabilities."""
    seen: list[list[dict[str, str]]] = []

    def judge(conversations, label_tokens):
        seen.extend(conversations)
        first, second = label_tokens
        out = []
        for messages in conversations:
            number = int(re.search(r"Instruction number (\d+)", messages[-1]["content"]).group(1))
            if number in fail:
                out.append(None)
                continue
            p_policy = PREFERENCE + (BIAS if _shown_first(messages) == "policy" else -BIAS)
            p_first = p_policy if _shown_first(messages) == "policy" else 1 - p_policy
            out.append({first: math.log(p_first), second: math.log(1 - p_first)})
        return out

    return judge, seen


def test_a_position_biased_judge_keeps_its_real_preference():
    """The issue's planted case: a judge that prefers the policy 60% of the time, with a first-position bias
    larger than that margin. AlpacaEval's protocol (one seeded order per instruction, the continuous
    preference) gives about 0.60; the quick protocol's both-orders threshold calls every prompt a split."""
    judge, seen = _biased_judge()
    annotations = annotate(*_pairs(N), judge)
    scores = alpaca_eval_scores(annotations, min_n=N + 1)
    assert abs(scores.win_rate / 100 - PREFERENCE) <= 0.05, scores
    assert scores.n == N and scores.failed == 0
    # Both orders occur (the seeded switch), each instruction asked once, in its own seeded order.
    first = [_shown_first(m) for m in seen]
    assert len(seen) == N and 0.35 < first.count("policy") / N < 0.65
    # The same judge asked in both orders and thresholded, as the quick protocol does: a tie everywhere.
    quick = pairwise_outcomes(np.full(N, PREFERENCE + BIAS), np.full(N, 1 - (PREFERENCE - BIAS)))
    assert np.all(quick == 0.5)


def test_the_order_is_seeded_by_the_instruction():
    """alpaca_eval seeds each instruction's order by its text: a second run, or the same instruction among
    other ones, is shown in the same order."""
    judge, seen = _biased_judge()
    annotate(*_pairs(40), judge)
    again, seen_again = _biased_judge()
    instructions, baseline, policy = _pairs(40)
    annotate(instructions[::-1][:25], baseline[::-1][:25], policy[::-1][:25], again)

    def orders(conversations):
        return {
            re.search(r"Instruction number \d+", m[-1]["content"]).group(0): _shown_first(m)
            for m in conversations
        }

    first, second = orders(seen), orders(seen_again)
    assert all(first[k] == v for k, v in second.items())


def test_the_prompt_is_alpaca_evals_own():
    """The judge is asked with the annotator's template from the installed package, m and M as labels."""
    from alpaca_eval import constants

    config = annotator_config()
    template = (constants.EVALUATORS_CONFIG_DIR / config["prompt_template"]).read_text()
    judge, seen = _biased_judge()
    annotate(*_pairs(3), judge)
    system, user = seen[0]
    assert system["role"] == "system" and system["content"] in template
    assert "Instruction number" in user["content"] and user["content"].split("## Instruction")[0] in template
    assert labels() == ["m", "M"]


def test_a_failed_judge_call_is_counted_never_a_loss():
    failing = {3, 17, 150}
    judge, _ = _biased_judge(fail=failing)
    annotations = annotate(*_pairs(N), judge)
    assert annotations["preference"].isna().sum() == len(failing)
    assert annotations["preference"].isna().to_numpy()[sorted(failing)].all()
    scores = alpaca_eval_scores(annotations, min_n=N + 1)
    assert scores.failed == len(failing) and scores.n == N - len(failing)
    assert abs(scores.win_rate / 100 - PREFERENCE) <= 0.05


def test_mismatched_inputs_are_refused_in_one_line():
    with pytest.raises(ValueError, match="3 instructions, 2 baseline outputs"):
        annotate(["a", "b", "c"], ["x", "y"], ["p", "q", "r"], _biased_judge()[0])


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return HFEngine("tiny-random", device="cpu", batch_size=4)


def test_an_in_process_engine_judges_through_the_annotator(engine):
    """The tiny-random model's next-token distribution: each preference is 2 - P(m) / (P(m) + P(M)) of the
    prompt the annotator showed, unswitched where it showed the policy first."""
    judge = engine_label_logprobs(engine)
    seen: list = []

    def recording(conversations, label_tokens):
        seen.extend(conversations)
        return judge(conversations, label_tokens)

    instructions, baseline, policy = _pairs(6)
    annotations = annotate(instructions, baseline, policy, recording)
    preference = annotations["preference"].to_numpy()
    assert np.isfinite(preference).all() and ((preference >= 1) & (preference <= 2)).all()
    for messages in seen:
        i = int(re.search(r"Instruction number (\d+)", messages[-1]["content"]).group(1))
        prompt = engine.chat_prompt(messages, enable_thinking=False)
        (m,), (big_m,) = engine.logprobs([prompt, prompt], ["m", "M"])
        p_first = math.exp(m) / (math.exp(m) + math.exp(big_m))
        p_policy = p_first if _shown_first(messages) == "policy" else 1 - p_first
        assert preference[i] == pytest.approx(1 + p_policy, abs=1e-6)


def test_outputs_whose_lengths_never_differ_get_no_lc_and_say_why():
    """Without df_gamed.csv, alpaca_eval divides each length difference by their spread: with every pair
    of the same length (two policies that answer alike) that is 0/0 and its fit fails on NaN; the scores
    say why there is no LC instead."""
    judge, _ = _biased_judge()
    instructions, _, policy = _pairs(60)
    same_length = [text.replace("policy", "common") for text in policy]
    scores = alpaca_eval_scores(annotate(instructions, same_length, policy, judge))
    assert scores.length_controlled_winrate is None and scores.lc_minimal is None
    assert "length term is 0/0" in scores.lc_note and scores.n == 60
