"""Verifiable outcomes: a response checked against its task's own notion of correct (reasoning-gym's
`score_answer`, HumanEval's tests in the sandbox, or a reference answer)."""

from __future__ import annotations

import json
import logging
import math
import re
from typing import TYPE_CHECKING

from dynamicrubric.infra.sandbox import SandboxResult, check_humaneval, check_humaneval_many

if TYPE_CHECKING:
    pass

from dynamicrubric.tasks.sources import TaskError, is_present, reasoning_gym_dataset

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# Scoring


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_ANSWER_PREFIX = re.compile(
    r"^(?:so,?\s*)?(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*[:=]?\s*", re.IGNORECASE
)


def extract_answer(response: str, reference: str | None = None) -> str:
    """The final answer in a response: an <answer> tag if any; else, for a numeric reference, the last
    number (thousands separators dropped, 8.0 -> 8 when the reference is an integer); else the last
    non-empty line without an "Answer:" prefix or a trailing full stop."""
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        return tagged[-1].strip()
    ref = (reference or "").strip()
    if ref and _NUMBER.fullmatch(ref.replace(",", "")):
        numbers = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", response))
        if not numbers:
            return ""
        last = numbers[-1]
        if "." not in ref and "." in last and float(last).is_integer():
            last = str(int(float(last)))
        return last
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    last_line = lines[-1] if lines else ""
    return _ANSWER_PREFIX.sub("", last_line).strip().rstrip(".").strip()


def _normalise(text: str) -> str:
    text = re.sub(r"\s+", " ", text.strip().lower())
    return text.strip(" .,;:!?\"'`*")


def is_verifiable(prompt_row: dict) -> bool:
    """True if `score_response` can score responses to this prompt."""
    source = _meta(prompt_row).get("source")
    return source in ("reasoning_gym", "humaneval") or is_present(prompt_row.get("reference"))


def score_response(prompt_row: dict, response: str, *, timeout_s: float = 10) -> float:
    """Score in [0, 1] of a response by the prompt's verifiable outcome.

    reasoning-gym: the task's own `score_answer` on the extracted answer; HumanEval: 1.0 if the
    problem's tests pass in the sandbox (NaN if the sandbox itself failed: unscored, not wrong); other
    prompts: 1.0 on a normalised exact match of the extracted answer, or the reference occurring as a
    whole word/number in the response.
    """
    meta = _meta(prompt_row)
    source = meta.get("source")
    if source == "reasoning_gym":
        dataset = reasoning_gym_dataset(meta["task"], json.dumps(meta["config"], sort_keys=True), 0, 1)
        entry = meta["entry"]
        score = dataset.score_answer(extract_answer(response, entry.get("answer")), entry)
        return min(1.0, max(0.0, float(score)))
    if source == "humaneval":
        _check_humaneval_meta(meta, prompt_row)
        completion = humaneval_completion(meta, response)
        return _code_score(check_humaneval(meta, completion, timeout_s=timeout_s), prompt_row)
    reference = prompt_row.get("reference")
    if not is_present(reference):
        raise TaskError(
            f"prompt {prompt_row.get('prompt_id')!r} has no reference answer and no verifiable task; "
            "it cannot be scored by outcome"
        )
    ref = _normalise(str(reference))
    if _normalise(extract_answer(response, str(reference))) == ref:
        return 1.0
    numeric = _NUMBER.fullmatch(ref.replace(",", "")) is not None
    if not numeric and re.search(rf"(?<!\w){re.escape(ref)}(?!\w)", _normalise(response)):
        return 1.0
    return 0.0


def score_group(prompt_row: dict, responses: list[str], *, timeout_s: float = 10) -> list[float]:
    """`score_response` for several responses to one prompt (a policy's K samples). HumanEval
    responses are judged in one sandbox batch (one launcher and judge, each response still isolated
    from the others), which costs a fraction of K separate runs."""
    if _meta(prompt_row).get("source") != "humaneval":
        return [score_response(prompt_row, r, timeout_s=timeout_s) for r in responses]
    meta = _meta(prompt_row)
    _check_humaneval_meta(meta, prompt_row)
    completions = [humaneval_completion(meta, r) for r in responses]
    return [_code_score(r, prompt_row) for r in check_humaneval_many(meta, completions, timeout_s=timeout_s)]


def _check_humaneval_meta(meta: dict, prompt_row: dict) -> None:
    """A user's HumanEval row must carry the problem's code, tests and function name (it gave a bare
    KeyError: 'entry_point')."""
    missing = [k for k in ("prompt", "test", "entry_point") if not isinstance(meta.get(k), str)]
    if missing:
        raise TaskError(
            f"prompt {prompt_row.get('prompt_id')!r}: its HumanEval meta lacks {', '.join(missing)} "
            "(a string each: the problem's code, its tests, the function they check)"
        )


def _code_score(result: SandboxResult, prompt_row: dict) -> float:
    """1.0 for a pass, 0.0 for a fail, NaN (unscored) when the sandbox failed to set up: that is the
    machine's doing, not the code's, and a 0 would tell the policy that correct code is wrong. Callers
    leave NaN scores out and count them; the cause is logged here."""
    if result.status == "error":
        log.warning(
            "sandbox error scoring %s (left unscored): %s",
            prompt_row.get("prompt_id"),
            result.stderr.strip()[-500:],
        )
        return math.nan
    return 1.0 if result.passed else 0.0


def _meta(prompt_row: dict) -> dict:
    meta = prompt_row.get("meta")
    if not is_present(meta):
        return {}
    if isinstance(meta, dict):
        return meta
    try:
        return json.loads(meta)
    except json.JSONDecodeError as e:
        raise TaskError(f"prompt {prompt_row.get('prompt_id')!r}: 'meta' is not valid JSON ({e})") from e


_CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def humaneval_completion(problem: dict, response: str) -> str:
    """What to append to the problem's prompt to run a chat response against the tests.

    A response holding the whole function (usual for chat models) is appended after a `pass` body
    that closes the prompt's stub, so it redefines the function while keeping the prompt's imports
    and helpers; anything else is taken as the body that continues the prompt.
    """
    blocks = _CODE_BLOCK.findall(response)
    defines = re.compile(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", re.MULTILINE)
    if blocks:
        with_def = [b for b in blocks if defines.search(b)]
        code = with_def[-1] if with_def else blocks[-1]
    else:
        code = response
    if defines.search(code):
        return "    pass\n\n" + code
    return code
