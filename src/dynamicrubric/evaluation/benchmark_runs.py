"""The open-ended benchmarks in the evaluate stage: the round's policy P_t and the starting policy P_0
answer each configured benchmark's prompts, and the benchmark judge compares them.

Per round and benchmark (evaluate.benchmarks; the data is in evaluation/benchmarks.py, the numbers in
benchmark_scores.py):
- pairwise (AlpacaEval 2, Arena-Hard v2.0): P_t's answer against the benchmark's baseline answer, and
  P_t's against P_0's (the paper's comparison), each judged in both orders; win rate with its 95%
  bootstrap interval, and for AlpacaEval the length-controlled win rate;
- checklist (WritingBench): every criterion of a query's checklist asked of P_t's answer and of P_0's as a
  yes/no question; the score is the mean P(yes) per criterion (0–1), not WritingBench's 1–10 critic score.

That is the quick protocol, named as "not comparable with the benchmark's leaderboard" wherever its numbers
are shown. A benchmark configured with `protocol: official` is judged by its own protocol instead
(official_protocols.py: AlpacaEval 2, Arena-Hard v2.0 and WritingBench as their own code judges and scores).

The judge (benchmark_judge.py) is `evaluate.benchmark_judge`: a model run in this process, or an OpenAI-compatible chat
endpoint (`url`, `served_model`, `api_key_env`: GPT-4.1 for the paper's re-judging). By default it is the
frozen verifier V, never the generator being trained, and every table says which judge it was. A failed
judge call (NaN) leaves its prompt out, counted as failed, never a loss or a win.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pandas as pd

from dynamicrubric.engines import Engine
from dynamicrubric.evaluation.arena_hard_judging import JUDGE_MAX_TOKENS
from dynamicrubric.evaluation.benchmark_judge import (
    COMPARISONS,
    SUFFIX,
    WHO,
    BenchmarkResults,
    Judge,
    units_frame,
)
from dynamicrubric.evaluation.benchmark_scores import (
    bootstrap_interval,
    checklist_scores,
    length_controlled_win_rate,
    pairwise_outcomes,
    pairwise_summary,
)
from dynamicrubric.evaluation.benchmarks import BENCHMARKS, benchmark_subset, load_benchmark
from dynamicrubric.evaluation.official_protocols import (
    alpaca_eval_official,
    arena_hard_official,
    check_prompts,
    writingbench_official,
)
from dynamicrubric.evaluation.writingbench_scores import (
    CRITIC_MAX_TOKENS,
)
from dynamicrubric.infra.config import Config
from dynamicrubric.scoring.prompts import (
    PAIRWISE_QUESTION,
    benchmark_task,
    checklist_question,
    judge_context,
    pairwise_context,
)
from dynamicrubric.scoring.rollout import policy_prompt

log = logging.getLogger(__name__)

# How a benchmark's protocol (evaluate.benchmarks[].protocol) is named beside its numbers: the round table's
# legend, the page, and the evaluate run's MLflow tags (benchmark_protocol/<name>).
PROTOCOL_LABELS = {
    "quick": "quick protocol (yes/no per order, P(yes) thresholded): not comparable with the benchmark's leaderboard",
    "official": "official protocol: the benchmark's own annotator, prompt and scoring",
}


def benchmark_prompts(cfg: Config) -> dict[str, pd.DataFrame]:
    """Each configured benchmark's seeded subset (the same prompts every round), checked for its protocol."""
    prompts = {
        b.name: benchmark_subset(load_benchmark(b.name, b.file), b.prompts, cfg.seed)
        for b in cfg.evaluate.benchmarks
    }
    for b in cfg.evaluate.benchmarks:
        if b.protocol == "official":
            check_prompts(b.name, prompts[b.name])  # before any answer is generated
    return prompts


def benchmark_answers(
    cfg: Config,
    prompts: dict[str, pd.DataFrame],
    get_engine: Callable[[str], Engine],
    *,
    policy: str,
    base: str,
    seed: int,
) -> pd.DataFrame:
    """One answer of P_0 (`base`) and one of P_t (`policy`) to every benchmark prompt, in that order (the
    stage's pool then holds P_t's engine no longer than it must): columns benchmark, id, who, response."""
    ev, r = cfg.evaluate, cfg.rollout
    everything = pd.concat([p.assign(benchmark=name) for name, p in prompts.items()], ignore_index=True)
    frames = []
    for who, ref in (("base", base), ("policy", policy)):
        engine = get_engine(ref)
        generations = engine.generate(
            [
                policy_prompt(
                    engine, benchmark_task(p, ev.benchmark_max_chars), cfg.models.enable_thinking.policy
                )
                for p in everything["prompt"]
            ],
            n=1,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=ev.benchmark_max_new_tokens,
            seed=seed,
            desc=f"benchmark answers ({who})",
        )
        responses = [g.texts[0] for g in generations]
        frames.append(everything[["benchmark", "id"]].assign(who=who, response=responses))
    return pd.concat(frames, ignore_index=True)


def judge_benchmarks(
    cfg: Config,
    prompts: dict[str, pd.DataFrame],
    answers: pd.DataFrame,
    judge: Judge,
    seed: int,
    *,
    first_round: bool = False,
) -> BenchmarkResults:
    """Every benchmark's questions in one call to the judge, then its numbers (module docstring). The judge
    never sees a policy's thinking: a `<think>…</think>` block is dropped from each answer first, as the
    benchmarks' own code drops it (eval_framework's strip_think_tags); the answers table keeps it."""
    from eval_framework.utils import strip_think_tags  # eval_framework/utils.py imports only tqdm

    by = {
        (b, i, w): strip_think_tags(text) if "<think>" in text else text
        for b, i, w, text in answers[["benchmark", "id", "who", "response"]].itertuples(index=False)
    }
    for name, frame in prompts.items():
        if BENCHMARKS[name].kind == "pairwise":
            by.update(
                {(name, i, "baseline"): text for i, text in zip(frame["id"], frame["baseline"], strict=True)}
            )
    comparisons = [c for c in COMPARISONS if first_round or c[0] != "p0_vs_baseline"]
    specs = {b.name: b for b in cfg.evaluate.benchmarks if b.name in prompts}
    official = {name for name, spec in specs.items() if spec.protocol == "official"}
    asked = []
    for name, frame in prompts.items():
        if name in official:
            continue  # judged by its own annotator below
        pairwise = BENCHMARKS[name].kind == "pairwise"
        for row in frame.itertuples(index=False):
            asked += (
                _pairwise_questions(cfg, name, row, by, comparisons)
                if pairwise
                else _checklist_questions(cfg, name, row, by)
            )
    columns = ["benchmark", "id", "measure", "order", "criterion", "context", "question"]
    questions = pd.DataFrame(asked, columns=columns)
    verdicts = judge.ask(list(zip(questions["context"], questions["question"], strict=True))) if asked else []
    questions["p_yes"] = np.asarray(verdicts, float)
    protocols = {name: spec.protocol for name, spec in specs.items()}
    results = BenchmarkResults(questions, by, judge.label, protocols, judge_independent=judge.independent)
    for name, frame in prompts.items():
        mine = questions[questions["benchmark"] == name]
        if name == "alpaca_eval" and name in official:
            alpaca_eval_official(results, frame, comparisons, judge, specs[name].df_gamed, seed)
        elif name == "arena_hard_v2" and name in official:
            max_tokens = specs[name].judge_max_tokens or JUDGE_MAX_TOKENS
            arena_hard_official(results, frame, judge, max_tokens, seed, first_round)
        elif name == "writingbench" and name in official:
            writingbench_official(
                results, frame, judge, specs[name].judge_max_tokens or CRITIC_MAX_TOKENS, seed
            )
        elif BENCHMARKS[name].kind == "pairwise":
            for measure, who, _ in comparisons:
                _pairwise(results, name, frame, mine[mine["measure"] == measure], measure, who, seed)
        else:
            _checklist(results, name, mine, seed)
        results.rows.append((name, "prompts", float(len(frame))))
    results.rows += [
        ("benchmark_judge", f"calls_{key}", float(value)) for key, value in judge.calls().items()
    ]
    return results


def _pairwise_questions(cfg: Config, name: str, row, by: dict, comparisons) -> list[tuple]:
    """Each comparison's question in both orders: the judged answer as A (order 0), then as B (order 1)."""
    out = []
    for measure, who, against in comparisons:
        mine, other = by[(name, row.id, who)], by[(name, row.id, against)]
        for order, (a, b) in enumerate(((mine, other), (other, mine))):
            context = pairwise_context(row.prompt, a, b, cfg.evaluate.benchmark_max_chars)
            out.append((name, row.id, measure, order, "", context, PAIRWISE_QUESTION))
    return out


def _checklist_questions(cfg: Config, name: str, row, by: dict) -> list[tuple]:
    """Every criterion of the prompt's checklist, asked of P_t's answer and of P_0's."""
    out = []
    for who in WHO:
        max_chars = cfg.evaluate.benchmark_max_chars
        context = judge_context(benchmark_task(row.prompt, max_chars), by[(name, row.id, who)], max_chars)
        for item in row.checklist:
            out.append(
                (
                    name,
                    row.id,
                    who,
                    0,
                    item["name"],
                    context,
                    checklist_question(item["name"], item["description"]),
                )
            )
    return out


def _pairwise(
    results: BenchmarkResults,
    name: str,
    frame: pd.DataFrame,
    asked: pd.DataFrame,
    measure: str,
    who: str,
    seed: int,
) -> None:
    judged = asked.pivot(index="id", columns="order", values="p_yes").reindex(frame["id"])
    outcomes = pairwise_outcomes(judged[0].to_numpy(), judged[1].to_numpy())
    suffix = SUFFIX[measure]  # win_rate_vs_p0, its interval win_rate_vs_p0_lo and _hi, n_vs_p0, ...
    for key, value in pairwise_summary(outcomes, seed).items():
        base, bound = (key[:-3], key[-3:]) if key.endswith(("_lo", "_hi")) else (key, "")
        results.rows.append((name, f"{base}{suffix}{bound}", value))
    results.units.append(units_frame(name, f"win{suffix}", frame["id"], outcomes))
    if name == "alpaca_eval" and measure != "vs_p0":  # AlpacaEval 2's headline: against its baseline
        chars = np.array([len(results.answers[(name, i, who)]) for i in frame["id"]])
        baseline_chars = frame["baseline"].str.len().to_numpy()
        results.rows.append(
            (name, f"lc_win_rate{suffix}", length_controlled_win_rate(outcomes, chars, baseline_chars))
        )


def _checklist(results: BenchmarkResults, name: str, asked: pd.DataFrame, seed: int) -> None:
    scores = {who: checklist_scores(asked[asked["measure"] == who]) for who in WHO}
    for who, suffix in (("policy", ""), ("base", "_p0")):
        low, high = bootstrap_interval(scores[who].to_numpy(), seed)
        results.rows += [
            (name, f"score{suffix}", float(scores[who].mean())),
            (name, f"score{suffix}_lo", low),
            (name, f"score{suffix}_hi", high),
        ]
    policy = scores["policy"]
    results.rows += [(name, "n", float(policy.notna().sum())), (name, "failed", float(policy.isna().sum()))]
    diff = (policy - scores["base"]).dropna()
    low, high = bootstrap_interval(diff.to_numpy(), seed)
    mean = float(diff.mean()) if len(diff) else float("nan")
    results.rows += [
        (name, "score_vs_p0", mean),
        (name, "score_vs_p0_lo", low),
        (name, "score_vs_p0_hi", high),
    ]
    results.units.append(units_frame(name, "score", policy.index, policy.to_numpy()))
