"""AlpacaEval 2's own annotation, run by alpaca_eval's own annotator with a judge of this project's.

AlpacaEval 2 asks its annotator (`weighted_alpaca_eval_gpt4_turbo`) one question per instruction: which of
two outputs, labelled m and M, is the better. Everything here but the judge is the installed alpaca-eval
package's (pinned in images/benchmarks.txt), taken from its annotator config: the prompt template file,
the order of the two outputs (its RandomSwitchTwoColumnsProcessor, seeded by the instruction, so one order
per instruction and the same one every run), and the preference (its `logprob_parser`: 2 - P(m) /
(P(m) + P(M)) from the first answer token's log-probabilities, continuous in [1, 2], unswitched back so
that 2 means the policy's output, `output_2`, is preferred). A position bias of the judge therefore
averages out over the instructions instead of turning every prompt into a tie, as the quick protocol's
both-orders threshold does.

The judge supplies only the log-probabilities of the two labels as the first answer token
(`LabelLogprobs`): `engine_label_logprobs` reads them from an in-process engine's next-token
distribution. A judge call that fails gives no log-probabilities: alpaca_eval's parser then returns NaN,
and `benchmark_scores.alpaca_eval_scores` counts the prompt as failed, never as a loss.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from dynamicrubric.engines import Engine
from dynamicrubric.evaluation.benchmark_scores import alpaca_eval_metrics

log = logging.getLogger(__name__)

ANNOTATOR = "weighted_alpaca_eval_gpt4_turbo"  # AlpacaEval 2's annotator (its leaderboard's)

# One judge call per conversation (chat messages): each label's log-probability as the first answer
# token, or None where the call failed.
LabelLogprobs = Callable[[list[list[dict[str, str]]], Sequence[str]], list[dict[str, float] | None]]


def annotator_config() -> dict[str, Any]:
    """The annotator's config as alpaca_eval ships it (its configs.yaml), and the folder it is relative to."""
    alpaca_eval_metrics()  # imports alpaca_eval the one way it imports here (pkg_resources shim)
    from alpaca_eval import constants

    path = Path(constants.EVALUATORS_CONFIG_DIR) / ANNOTATOR / "configs.yaml"
    return yaml.safe_load(path.read_text())[ANNOTATOR]


def labels() -> list[str]:
    """The output labels whose log-probabilities the annotator reads ("m", "M")."""
    return list(annotator_config()["completion_parser_kwargs"]["denominator_tokens"])


def annotate(
    instructions: Sequence[str],
    baseline_outputs: Sequence[str],
    policy_outputs: Sequence[str],
    judge: LabelLogprobs,
) -> pd.DataFrame:
    """AlpacaEval 2's annotations of the policy's outputs against the baseline's, by alpaca_eval's annotator
    with `judge` answering: a table in the shape alpaca_eval stores (instruction, output_1 the baseline's,
    output_2 the policy's, preference in [1, 2] or NaN for a failed call), in the order given, ready for
    `benchmark_scores.alpaca_eval_scores`."""
    if not len(instructions) == len(baseline_outputs) == len(policy_outputs):
        raise ValueError(
            f"annotate: {len(instructions)} instructions, {len(baseline_outputs)} baseline outputs and "
            f"{len(policy_outputs)} policy outputs"
        )
    frame = pd.DataFrame(
        {
            "instruction": list(instructions),
            "output_1": list(baseline_outputs),
            "output_2": list(policy_outputs),
        }
    )
    if frame.empty:
        return frame.assign(preference=pd.Series(dtype=float))
    config = annotator_config()  # first: it imports alpaca_eval as benchmark_scores does
    from alpaca_eval import constants
    from alpaca_eval.annotators.pairwise_evaluator import SinglePairwiseAnnotator

    config["fn_completions"] = _completions(judge, config["completion_parser_kwargs"]["denominator_tokens"])
    annotator = SinglePairwiseAnnotator(base_dir=constants.EVALUATORS_CONFIG_DIR, **config)
    # The annotator shuffles the rows and drops those without a preference: back in order, NaN for those.
    annotated = annotator(frame).reindex(frame.index)
    out = frame.assign(preference=pd.to_numeric(annotated["preference"], errors="coerce").astype(float))
    failed = int(out["preference"].isna().sum())
    if failed:
        log.warning(
            "AlpacaEval 2: %d of %d judge calls gave no preference (left out, never a loss)", failed, len(out)
        )
    return out


def _completions(judge: LabelLogprobs, label_tokens: Sequence[str]) -> Callable[..., dict[str, list]]:
    """alpaca_eval's `fn_completions` for `judge`: each prompt (alpaca_eval's ChatML text) as chat messages,
    the answer as an OpenAI chat completion's first-token `top_logprobs`, the shape its parser reads. The
    config's own completion settings (GPT-4's model name, max_tokens 1, top_logprobs 5) describe the
    endpoint alpaca_eval calls and are not used."""
    from alpaca_eval import utils

    def completions(prompts: list[str], **_settings: Any) -> dict[str, list]:
        conversations = [utils.prompt_to_chatml(prompt) for prompt in prompts]
        answers = judge(conversations, label_tokens)
        if len(answers) != len(prompts):
            raise ValueError(f"the AlpacaEval judge answered {len(answers)} of {len(prompts)} prompts")
        replies = []
        for answer in answers:
            top = [
                {"token": token, "logprob": value}
                for token, value in (answer or {}).items()
                if not math.isnan(value)
            ]
            # No entries: alpaca_eval's parser logs that none of the labels came back and returns NaN.
            replies.append({"logprobs": {"content": [{"top_logprobs": top}]}})
        return {"completions_all": replies}

    return completions


def engine_label_logprobs(engine: Engine) -> LabelLogprobs:
    """A `LabelLogprobs` judge from an in-process engine: the conversation rendered by the engine's chat
    template (no thinking), each label's log-probability as the text that follows (its tokens' sum; one
    token for m and M in the tokenizers at hand). A label with a non-finite log-probability (a broken
    checkpoint) fails the call."""

    def judge(
        conversations: list[list[dict[str, str]]], label_tokens: Sequence[str]
    ) -> list[dict[str, float] | None]:
        prompts = [engine.chat_prompt(messages, enable_thinking=False) for messages in conversations]
        asked = [(prompt, label) for prompt in prompts for label in label_tokens]
        values = engine.logprobs([p for p, _ in asked], [label for _, label in asked])
        out: list[dict[str, float] | None] = []
        for i in range(len(prompts)):
            row = values[i * len(label_tokens) : (i + 1) * len(label_tokens)]
            answer = {label: float(sum(v)) for label, v in zip(label_tokens, row, strict=True)}
            out.append(answer if all(math.isfinite(v) for v in answer.values()) else None)
        return out

    return judge
