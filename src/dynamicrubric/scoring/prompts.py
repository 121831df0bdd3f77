"""Every text a model is given, and the parser for what the rubric generator writes.

Kept in one module so a reader sees all templates at once: the policy's task prompt, the dynamic
generator's prompt (task + all K responses), the static generator's prompt (task alone), the
verifier's per-item question and the pointwise judge's question.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------
# Rubric generation

DYNAMIC_RUBRIC_TEMPLATE = """\
You are writing a grading rubric. Below is a task and {k} candidate responses to it.

Write at most {m} yes/no criteria that tell these particular responses apart: each criterion should \
be met by some of the responses and failed by others. Leave out criteria that every response meets \
and criteria that every response fails. Give each criterion a weight from 1 (minor) to 5 (essential).

Reply with JSON only, in this form:
{{"items": [{{"text": "The final answer is 12.", "weight": 5}}, {{"text": "The response shows the steps.", "weight": 2}}]}}

Task:
{task}

{responses}"""

STATIC_RUBRIC_TEMPLATE = """\
You are writing a grading rubric for the task below, before seeing any response.

Write at most {m} yes/no criteria that a good response to this task must meet. Give each criterion \
a weight from 1 (minor) to 5 (essential).

Reply with JSON only, in this form:
{{"items": [{{"text": "The final answer is 12.", "weight": 5}}, {{"text": "The response shows the steps.", "weight": 2}}]}}

Task:
{task}"""


def _clip(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + " […]"


def response_order(prompt_id: str, num_responses: int, seed: int, sample: int = 0) -> list[int]:
    """The seeded order in which the generator sees a candidate set (hides the sampling order).

    `sample` > 0 gives rubric sample `sample` an order of its own (rubrics.shuffle); sample 0 reads the
    set's one order, so a single sample is shown the responses as it always was."""
    order = list(range(num_responses))
    random.Random(f"{seed}:{prompt_id}" if sample == 0 else f"{seed}:{prompt_id}:{sample}").shuffle(order)
    return order


def dynamic_rubric_prompt(task: str, responses: list[str], num_items: int, max_response_chars: int) -> str:
    """The generator's prompt: the task and the responses (already in display order), labelled A, B, ..."""
    labels = string.ascii_uppercase
    if len(responses) > len(labels):
        raise ValueError(f"at most {len(labels)} responses can be labelled, got {len(responses)}")
    blocks = "\n\n".join(
        f"Response {labels[i]}:\n{_clip(r.strip(), max_response_chars)}" for i, r in enumerate(responses)
    )
    return DYNAMIC_RUBRIC_TEMPLATE.format(k=len(responses), m=num_items, task=task.strip(), responses=blocks)


def static_rubric_prompt(task: str, num_items: int) -> str:
    return STATIC_RUBRIC_TEMPLATE.format(m=num_items, task=task.strip())


# ---------------------------------------------------------------------------------------------
# Verification (the frozen verifier answers with one token: yes or no)

JUDGE_CONTEXT = "Task:\n{task}\n\nResponse:\n{response}\n\n"
JUDGE_ITEM_QUESTION = "Criterion: {item}\nDoes the response meet the criterion? Answer yes or no."
POINTWISE_QUESTION = "Is this a good and correct response to the task? Answer yes or no."

# Splits a rendered chat prompt into the part shared by all questions about one response and the
# part that differs; chosen so that no tokenizer merges it with its neighbours.
_SPLIT = "\x00SPLIT\x00"


def judge_context(task: str, response: str, max_response_chars: int) -> str:
    return JUDGE_CONTEXT.format(task=task.strip(), response=_clip(response.strip(), max_response_chars))


# The open-ended benchmarks (evaluation/benchmark_runs.py), asked of the benchmark judge as yes/no
# questions: a pair of answers in both orders, or a checklist's criteria one at a time (the context is
# then JUDGE_CONTEXT, shared by the criteria about one answer).
PAIRWISE_CONTEXT = "Instruction:\n{task}\n\nResponse A:\n{a}\n\nResponse B:\n{b}\n\n"
PAIRWISE_QUESTION = (
    "Is response A better than response B: more helpful, correct, complete and clearly written? "
    "Answer yes or no."
)
CHECKLIST_QUESTION = (
    "Criterion: {name}. {description}\nDoes the response meet the criterion? Answer yes or no."
)


def benchmark_task(task: str, max_chars: int) -> str:
    """A benchmark prompt as the policy reads it: clipped at `max_chars` (evaluate.benchmark_max_chars),
    so that it fits a small model's context (WritingBench's queries run to 10,000+ characters)."""
    return _clip(task.strip(), max_chars)


def pairwise_context(task: str, a: str, b: str, max_chars: int) -> str:
    """The instruction and two answers, each clipped at `max_chars`, labelled A and B in this order."""
    return PAIRWISE_CONTEXT.format(
        task=_clip(task.strip(), max_chars), a=_clip(a.strip(), max_chars), b=_clip(b.strip(), max_chars)
    )


def checklist_question(name: str, description: str) -> str:
    return CHECKLIST_QUESTION.format(name=name.strip().rstrip("."), description=description.strip())


def split_chat_prompt(render, context: str, question: str) -> tuple[str, str]:
    """(prefix, suffix) of the chat-rendered user message `context + question`.

    `render` maps a message list to the templated prompt string (Engine.chat_prompt). The prefix holds
    everything up to the question, so every question about the same response shares it exactly.
    """
    rendered = render([{"role": "user", "content": context + _SPLIT + question}])
    prefix, sep, suffix = rendered.partition(_SPLIT)
    if not sep:
        raise ValueError("the chat template dropped part of the message; cannot split prefix and question")
    return prefix, suffix


# ---------------------------------------------------------------------------------------------
# Rubric parsing: never raises; an unusable text gives an empty rubric with status "empty".


@dataclass(frozen=True)
class ParsedRubric:
    items: list[dict]  # [{"text": str, "weight": int 1..5}]
    status: str  # "json" | "lines" | "empty"


_TEXT_KEYS = ("criterion", "text", "item", "rubric", "description", "requirement", "question")
_WEIGHT_KEYS = ("weight", "points", "score", "importance")
_DEFAULT_WEIGHT = 3
_LIST_MARKER = re.compile(r"^\s*(?:\d{1,3}[.):]|[-*•]|\(\d{1,3}\))\s+(.*\S)\s*$")
_BRACKET_WEIGHT = re.compile(
    r"^[\[(]\s*(?:w(?:eight)?\s*[:=]?\s*)?(\d+(?:\.\d+)?)\s*[\])]\s*[:\-–]?\s*(.+)$", re.I
)
_TRAILING_WEIGHT = re.compile(
    r"^(.+?)\s*(?:[-–—:|]\s*)?[\[(]?\s*(?:w(?:eight)?|points?)\s*[:=]?\s*(\d+(?:\.\d+)?)\s*[\])]?\s*\.?$",
    re.I,
)


def _clamp_weight(value: object) -> int:
    try:
        w = round(float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return _DEFAULT_WEIGHT
    return min(5, max(1, w))


def _clean_text(text: object) -> str:
    """One line of printable text: control characters become spaces, whitespace runs one space, and
    lone surrogates (which a JSON escape can produce and UTF-8 cannot store) are dropped."""
    chars = (ch if ch.isprintable() else " " for ch in str(text) if not "\ud800" <= ch <= "\udfff")
    return " ".join("".join(chars).split()).strip(" \"'`")


_JSON_OBJECT = re.compile(r"\{[^{}]*\}")


def _from_json(text: str) -> list[dict] | None:
    start, end = text.find("["), text.rfind("]")
    data = None
    if 0 <= start < end:
        try:
            data = json.loads(text[start : end + 1], strict=False)  # raw control chars
        except (json.JSONDecodeError, RecursionError):
            data = None
    if not isinstance(data, list):
        # A list cut off by the token limit, or wrapped in prose: keep every whole {...} object in it.
        data = []
        for match in _JSON_OBJECT.finditer(text):
            try:
                data.append(json.loads(match.group(0), strict=False))
            except json.JSONDecodeError:
                continue
    if not data:
        return None
    items = []
    for entry in data:
        if isinstance(entry, str):
            items.append({"text": _clean_text(entry), "weight": _DEFAULT_WEIGHT})
        elif isinstance(entry, dict):
            text_value = next((entry[k] for k in _TEXT_KEYS if k in entry), None)
            if text_value is None:
                continue
            weight = next((entry[k] for k in _WEIGHT_KEYS if k in entry), _DEFAULT_WEIGHT)
            items.append({"text": _clean_text(text_value), "weight": _clamp_weight(weight)})
    return items


def _from_lines(text: str) -> list[dict]:
    items = []
    for line in text.splitlines():
        marked = _LIST_MARKER.match(line)
        if not marked:
            continue
        body = marked.group(1).strip()
        weight: object = _DEFAULT_WEIGHT
        if m := _BRACKET_WEIGHT.match(body):
            weight, body = m.group(1), m.group(2)
        elif m := _TRAILING_WEIGHT.match(body):
            body, weight = m.group(1), m.group(2)
        items.append({"text": _clean_text(body), "weight": _clamp_weight(weight)})
    return items


def parse_rubric(text: str, max_items: int) -> ParsedRubric:
    """JSON list or numbered/bulleted lines → at most `max_items` distinct items with weights 1–5."""
    items = _from_json(text)
    status = "json"
    if not items:
        items, status = _from_lines(text), "lines"
    kept, seen = [], set()
    for item in items:
        key = item["text"].lower().rstrip(".")
        if len(key) < 3 or key in seen:  # too short to be a criterion, or a duplicate
            continue
        seen.add(key)
        kept.append(item)
        if len(kept) == max_items:
            break
    return ParsedRubric(kept, status if kept else "empty")
