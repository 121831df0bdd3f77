"""The benchmarks judged by their own protocols (`evaluate.benchmarks[].protocol: official`), each writing its
numbers into the round's BenchmarkResults under the quick protocol's metric names where they mean the same:

- AlpacaEval 2: alpaca_eval's annotator (alpaca_eval_judging.py) and metrics (one seeded order per
  instruction, a continuous preference from the judge's m/M log-probabilities, the LC where df_gamed.csv is
  at hand);
- Arena-Hard v2.0: its judge's both games and five-level verdicts (arena_hard_judging.py), each category
  scored on its own as show_result scores it (arena_hard_scores.py);
- WritingBench: its strict critic's 1–10 score per criterion (writingbench_scores.py), the mean over every
  scored criterion.

Win rates and scores are stored as fractions: ×100 they are the leaderboards' numbers. A judge call that
failed, or a reply without a verdict, is counted and left out, never a loss or a score.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pandas as pd

from dynamicrubric.evaluation.alpaca_eval_judging import ANNOTATOR, annotate
from dynamicrubric.evaluation.arena_hard_judging import JUDGE_SAMPLING, judge_games
from dynamicrubric.evaluation.arena_hard_scores import (
    BASELINES,
    ArenaHardError,
    answer_style,
    arena_hard_scores,
    gpt4o_token_counter,
    label_outcome,
)
from dynamicrubric.evaluation.benchmark_judge import SUFFIX, WHO, BenchmarkResults, Judge, units_frame
from dynamicrubric.evaluation.benchmark_scores import alpaca_eval_scores, bootstrap_interval
from dynamicrubric.evaluation.benchmarks import BenchmarkError
from dynamicrubric.evaluation.writingbench_scores import CRITIC_SAMPLING, ask_critic, writingbench_scores

log = logging.getLogger(__name__)


ALPACA_EVAL_ID = re.compile(r"alpaca_eval-(\d+)")
WRITINGBENCH_BANDS = ("1-2", "3-4", "5-6", "7-8", "9-10")


def check_prompts(name: str, frame: pd.DataFrame) -> None:
    """Refuse, in one line and before any answer is generated, prompts a benchmark's own protocol cannot
    judge: AlpacaEval 2 looks each instruction's difficulty up by its place among its 805 (ids
    alpaca_eval-NNN); Arena-Hard v2.0 scores its two categories against their own baselines; WritingBench's
    critic reads each criterion's five score bands."""
    if name == "alpaca_eval":
        bad = [i for i in frame["id"] if not ALPACA_EVAL_ID.fullmatch(str(i))]
        if bad:
            raise BenchmarkError(
                f"alpaca_eval: the official protocol looks each instruction's difficulty up by its place in "
                f"AlpacaEval's 805 (ids alpaca_eval-NNN); got id {bad[0]!r}. Use protocol: quick for other prompts"
            )
    elif name == "arena_hard_v2":
        unknown = sorted(set(frame["category"]) - set(BASELINES))
        if unknown:
            raise BenchmarkError(
                f"arena_hard_v2: the official protocol scores the categories {sorted(BASELINES)} against their "
                f"own baselines; got category {unknown[0]!r}. Use protocol: quick for other prompts"
            )
    elif name == "writingbench":
        for row in frame.itertuples(index=False):
            for c in row.checklist:
                lacking = [b for b in WRITINGBENCH_BANDS if b not in c.get("item", {})]
                if lacking:
                    raise BenchmarkError(
                        f"writingbench: the official critic reads each criterion's score bands; criterion "
                        f"{c['name']!r} of {row.id} lacks {lacking}. Use protocol: quick for other checklists"
                    )


def alpaca_eval_official(
    results: BenchmarkResults,
    frame: pd.DataFrame,
    comparisons: list[tuple[str, str, str]],
    judge: Judge,
    df_gamed: str,
    seed: int,
) -> None:
    """AlpacaEval 2 by its own protocol (alpaca_eval_judging.py, benchmark_scores.alpaca_eval_scores), per
    comparison: the judged answer as alpaca_eval's output_2 against the other as output_1. Rows as the quick
    protocol's (win rates as fractions, ×100 on the leaderboard) plus the discrete win rate; the LC only
    where df_gamed.csv was at hand (else lc_minimal) and at least ALPACA_EVAL_MIN_N prompts were judged. The
    questions table gets one row per prompt and comparison: the annotator's question, the preference for
    the judged answer (preference - 1) as its p_yes."""
    name = "alpaca_eval"
    check_prompts(name, frame)
    ids = list(frame["id"])
    positions = [ALPACA_EVAL_ID.fullmatch(str(i)) for i in ids]
    rows = []
    for measure, who, against in comparisons:
        annotations = annotate(
            list(frame["prompt"]),
            [results.answers[(name, i, against)] for i in ids],
            [results.answers[(name, i, who)] for i in ids],
            judge.label_logprobs,
        )
        annotations.index = pd.Index([int(p.group(1)) for p in positions])
        path = None if df_gamed in ("", "hub") else df_gamed  # "": the HF cache; "hub": fetched there
        scores = alpaca_eval_scores(annotations, path, download=df_gamed == "hub")
        preferred = annotations["preference"].to_numpy() - 1  # P(the judged answer is the better)
        low, high = bootstrap_interval(preferred, seed)
        suffix = SUFFIX[measure]
        numbers = {
            "win_rate": scores.win_rate / 100,
            "win_rate_lo": low,
            "win_rate_hi": high,
            "discrete_win_rate": scores.discrete_win_rate / 100,
            "n": scores.n,
            "failed": scores.failed,
            "lc_win_rate": None
            if scores.length_controlled_winrate is None
            else scores.length_controlled_winrate / 100,
            "lc_minimal": None if scores.lc_minimal is None else scores.lc_minimal / 100,
        }
        for key, value in numbers.items():
            if value is not None:
                base, bound = (key[:-3], key[-3:]) if key.endswith(("_lo", "_hi")) else (key, "")
                results.rows.append((name, f"{base}{suffix}{bound}", float(value)))
        if scores.lc_note:
            log.info("AlpacaEval 2 (%s): no LC: %s", measure, scores.lc_note)
        results.units.append(units_frame(name, f"win{suffix}", ids, preferred))
        rows += [(name, i, measure, 0, "", "", ANNOTATOR, p) for i, p in zip(ids, preferred, strict=True)]
    asked = pd.DataFrame(rows, columns=[*results.questions.columns[:7], "p_yes"])
    results.questions = pd.concat([results.questions, asked], ignore_index=True)


ARENA_HARD_JUDGE = "Arena-Hard v2.0's judge (both games, five-level verdicts)"


def arena_hard_official(
    results: BenchmarkResults,
    frame: pd.DataFrame,
    judge: Judge,
    max_tokens: int,
    seed: int,
    first_round: bool,
) -> None:
    """Arena-Hard v2.0 by its own protocol (arena_hard_judging.py, arena_hard_scores.py): P_t's answer (and
    in a run's first round P_0's) against the category's baseline, both games, each category scored on its
    own. Rows per category c: score_c with its 5%/95% interval (as upstream prints it, here a fraction: ×100
    the leaderboard's), n_c and failed_c (questions scored, and left out for a game without a verdict), and
    style_controlled_c where the answers' tokens can be counted as upstream counts them (tiktoken's gpt-4o
    encoding; without it the log says why); P_0's with the suffix _p0. The questions table gets one row per
    game, the judged answer's outcome (1 win, 0.5 tie, 0 loss) as its p_yes (NaN: no verdict)."""
    name = "arena_hard_v2"
    whos = ("policy", "base") if first_round else ("policy",)
    questions = pd.DataFrame(
        [
            (row.id, row.category, row.prompt, row.baseline, results.answers[(name, row.id, who)], who)
            for who in whos
            for row in frame.itertuples(index=False)
        ],
        columns=["uid", "category", "prompt", "baseline", "answer", "model"],
    )

    def ask(conversations: list[list[dict[str, str]]]) -> list[str | None]:
        return judge.chat_replies(conversations, max_tokens=max_tokens, seed=seed, **JUDGE_SAMPLING)

    judged = judge_games(questions, ask)
    style = None
    try:
        count = gpt4o_token_counter()
        style = pd.DataFrame(
            [
                {"model": m, "uid": u, **answer_style(a, count)}
                for m, u, a in questions[["model", "uid", "answer"]].itertuples(index=False)
            ]
        )
    except ArenaHardError as error:
        log.info("Arena-Hard v2.0: no style-controlled score: %s", error)
    scores = arena_hard_scores(judged[["uid", "category", "model", "game1", "game2"]], style, seed=seed)
    for score in scores.itertuples(index=False):
        suffix, c = ("" if score.model == "policy" else "_p0"), score.category
        numbers = {"score": (score.score, score.score_lo, score.score_hi)}
        if score.style_controlled == score.style_controlled:  # NaN: not counted (no tokenizer)
            numbers["style_controlled"] = (
                score.style_controlled,
                score.style_controlled_lo,
                score.style_controlled_hi,
            )
        for metric, (value, low, high) in numbers.items():
            for bound, number in (("", value), ("_lo", low), ("_hi", high)):
                results.rows.append((name, f"{metric}_{c}{suffix}{bound}", float(number) / 100))
        results.rows += [(name, f"n_{c}{suffix}", float(score.questions))]
        results.rows += [(name, f"failed_{c}{suffix}", float(score.failed))]
    mine = scores[scores.model == "policy"]
    results.rows += [(name, "n", float(mine.questions.sum())), (name, "failed", float(mine.failed.sum()))]
    # the judged answer's outcome in each game: B in game 1, A in game 2
    first = [1 - label_outcome(label) for label in judged["game1"]]
    second = [label_outcome(label) for label in judged["game2"]]
    asked = pd.DataFrame(
        {
            "benchmark": name,
            "id": np.repeat(judged["uid"].to_numpy(), 2),
            "measure": np.repeat(np.where(judged["model"] == "policy", "vs_baseline", "p0_vs_baseline"), 2),
            "order": np.tile(
                [1, 0], len(judged)
            ),  # the judged answer as B, then as A (the quick protocol's order)
            "criterion": "",
            "context": "",
            "question": ARENA_HARD_JUDGE,
            "p_yes": np.ravel(np.column_stack([first, second])) if len(judged) else [],
        }
    )
    results.questions = pd.concat([results.questions, asked], ignore_index=True)


WRITINGBENCH_CRITIC = "WritingBench's critic (1-10 per criterion)"


def writingbench_official(
    results: BenchmarkResults, frame: pd.DataFrame, judge: Judge, max_tokens: int, seed: int
) -> None:
    """WritingBench by its own protocol (writingbench_scores.py): every criterion of each query's checklist
    scored 1–10 by the critic for P_t's answer and for P_0's. Rows as the quick protocol's names, the score
    as a fraction (the 1–10 mean ÷ 10: ×100 is the leaderboard's number), intervals over queries. The questions table gets one row per criterion, the
    score ÷ 10 as its p_yes (NaN: failed)."""
    name = "writingbench"
    items = pd.DataFrame(
        [
            (row.id, who, c["name"], c.get("item", c), row.prompt, results.answers[(name, row.id, who)])
            for who in WHO
            for row in frame.itertuples(index=False)
            for c in row.checklist
        ],
        columns=["index", "who", "name", "criterion", "query", "response"],
    )

    def ask(conversations: list[list[dict[str, str]]], attempt: int) -> list[str | None]:
        return judge.chat_replies(
            conversations, max_tokens=max_tokens, seed=seed + attempt, **CRITIC_SAMPLING
        )

    judged = ask_critic(items, ask) if len(items) else items.assign(reply=[], score=[], tries=[])
    per_query = {}
    for who, suffix in (("policy", ""), ("base", "_p0")):
        mine = judged[judged["who"] == who].drop(columns="criterion").rename(columns={"name": "criterion"})
        scores = writingbench_scores(mine)
        per_query[who] = pd.Series(scores.per_query, dtype=float).reindex(frame["id"]) / 10
        low, high = bootstrap_interval(per_query[who].dropna().to_numpy(), seed)
        results.rows += [
            (name, f"score{suffix}", scores.score / 10),
            (name, f"score{suffix}_lo", low),
            (name, f"score{suffix}_hi", high),
        ]
        if who == "policy":  # failed: queries left without any score; failed_criteria: every unscored one
            results.rows += [
                (name, "n", float(scores.queries)),
                (name, "failed", float(len(frame) - scores.queries)),
                (name, "failed_criteria", float(scores.failed)),
            ]
    diff = (per_query["policy"] - per_query["base"]).dropna()
    low, high = bootstrap_interval(diff.to_numpy(), seed)
    results.rows += [
        (name, "score_vs_p0", float(diff.mean()) if len(diff) else float("nan")),
        (name, "score_vs_p0_lo", low),
        (name, "score_vs_p0_hi", high),
    ]
    results.units.append(
        units_frame(name, "score", per_query["policy"].index, per_query["policy"].to_numpy())
    )
    asked = pd.DataFrame(
        {
            "benchmark": name,
            "id": judged["index"],
            "measure": judged["who"],
            "order": 0,
            "criterion": judged["name"],
            "context": "",
            "question": WRITINGBENCH_CRITIC,
            "p_yes": pd.to_numeric(judged["score"], errors="coerce").astype(float) / 10,
        }
    )
    results.questions = pd.concat([results.questions, asked], ignore_index=True)
