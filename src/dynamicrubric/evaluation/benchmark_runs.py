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
are shown. A benchmark configured with `protocol: official` is judged by its own protocol instead:
AlpacaEval 2 by alpaca_eval's annotator (alpaca_eval_judging.py) and metrics (one seeded order per
instruction, a continuous preference from the judge's m/M log-probabilities, the LC where df_gamed.csv is at
hand); WritingBench by its strict critic (writingbench_scores.py: each criterion's whole item with its five
score bands, a sampled JSON reply with a 1–10 score, asked again while it does not parse, and the mean over
every scored criterion, shown as a fraction: ×100 is the leaderboard's 0–100).

The judge is `evaluate.benchmark_judge`: a model run in this process, or an OpenAI-compatible chat
endpoint (`url`, `served_model`, `api_key_env`: GPT-4.1 for the paper's re-judging). By default it is the
frozen verifier V, never the generator being trained, and every table says which judge it was. A failed
judge call (NaN) leaves its prompt out, counted as failed, never a loss or a win.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pandas as pd

from dynamicrubric.engines import Engine, load_judge
from dynamicrubric.engines.chat_judge import ChatJudge
from dynamicrubric.evaluation.alpaca_eval_judging import ANNOTATOR, annotate, engine_label_logprobs
from dynamicrubric.evaluation.benchmark_scores import (
    alpaca_eval_scores,
    bootstrap_interval,
    checklist_scores,
    length_controlled_win_rate,
    pairwise_outcomes,
    pairwise_summary,
)
from dynamicrubric.evaluation.benchmarks import BENCHMARKS, BenchmarkError, benchmark_subset, load_benchmark
from dynamicrubric.evaluation.writingbench_scores import CRITIC_SAMPLING, ask_critic, writingbench_scores
from dynamicrubric.infra.config import Config
from dynamicrubric.scoring.prompts import (
    PAIRWISE_QUESTION,
    benchmark_task,
    checklist_question,
    judge_context,
    pairwise_context,
    split_chat_prompt,
)
from dynamicrubric.scoring.rollout import policy_prompt

log = logging.getLogger(__name__)

# How a benchmark's protocol (evaluate.benchmarks[].protocol) is named beside its numbers: the round table's
# legend, the page, and the evaluate run's MLflow tags (benchmark_protocol/<name>).
PROTOCOL_LABELS = {
    "quick": "quick protocol (yes/no per order, P(yes) thresholded): not comparable with the benchmark's leaderboard",
    "official": "official protocol: the benchmark's own annotator, prompt and scoring",
}

WHO = ("policy", "base")  # P_t's answers, P_0's


@dataclass
class Judge:
    """Who judges the benchmarks: `label` for every table, and the engine that answers the yes/no
    questions (an in-process model, or a `ChatJudge` client of an endpoint, whose ledger counts its calls)."""

    label: str
    engine: Engine
    own: bool  # the judge's engine was made for the benchmarks (close it after), not taken from the pool

    def ask(self, pairs: list[tuple[str, str]]) -> list[float]:
        """P(yes) per (context, question), NaN where the call failed."""
        render = partial(self.engine.chat_prompt, enable_thinking=False)
        split = [split_chat_prompt(render, context, question) for context, question in pairs]
        return self.engine.yes_probability(split, desc="benchmark judge")

    def label_logprobs(
        self, conversations: list[list[dict[str, str]]], labels: Sequence[str]
    ) -> list[dict[str, float] | None]:
        """Each label's log-probability as the first answer token of each conversation, None where the call
        failed: what a benchmark's own annotator reads (the official protocol)."""
        if isinstance(self.engine, ChatJudge):
            return self.engine.label_logprobs(conversations, labels, desc="benchmark judge")
        return engine_label_logprobs(self.engine)(conversations, labels)

    def chat_replies(
        self, conversations: list[list[dict[str, str]]], *, max_tokens: int, seed: int, **sampling: float
    ) -> list[str | None]:
        """Each conversation's reply, sampled (`temperature`, `top_p`), None where the call failed: what a
        benchmark's own critic writes (the official protocol). Seeded per conversation: the same reply for
        the same seed and conversation order."""
        if isinstance(self.engine, ChatJudge):
            return self.engine.chat_replies(
                conversations, max_tokens=max_tokens, seed=seed, desc="benchmark judge", **sampling
            )
        prompts = [self.engine.chat_prompt(c, enable_thinking=False) for c in conversations]
        generations = self.engine.generate(
            prompts, max_new_tokens=max_tokens, seed=seed, desc="benchmark judge", **sampling
        )
        return [g.texts[0] for g in generations]

    def calls(self) -> dict[str, int]:
        ledger = getattr(self.engine, "ledger", None)
        return dict(vars(ledger)) if ledger is not None else {}

    def close(self) -> None:
        if self.own:
            self.engine.close()


def judge_label(cfg: Config, verifier: str = "") -> str:
    """How every table names the benchmark judge (`evaluate.benchmark_judge`)."""
    jc = cfg.evaluate.benchmark_judge
    if jc.url:
        return f"{jc.served_model or 'the model served'} at {jc.url}"
    return jc.model or f"V ({verifier or cfg.models.verifier}, the frozen verifier)"


def benchmark_judge(cfg: Config, get_engine: Callable[[str], Engine], verifier: str) -> Judge:
    """The configured benchmark judge; the frozen verifier `verifier`, taken from the stage's pool, when
    `evaluate.benchmark_judge` names none."""
    jc = cfg.evaluate.benchmark_judge
    label = judge_label(cfg, verifier)
    if jc.url:
        return Judge(label, load_judge(jc, cfg, role="benchmark judge"), own=True)
    return Judge(label, get_engine(jc.model or verifier), own=False)


def benchmark_prompts(cfg: Config) -> dict[str, pd.DataFrame]:
    """Each configured benchmark's seeded subset (the same prompts every round)."""
    return {
        b.name: benchmark_subset(load_benchmark(b.name, b.file), b.prompts, cfg.seed)
        for b in cfg.evaluate.benchmarks
    }


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


# The pairwise comparisons: (measure, the answer judged, the answer it is judged against). P_0 against the
# baseline is judged in a run's first round only: P_0 is the same every round.
COMPARISONS = (
    ("vs_baseline", "policy", "baseline"),
    ("vs_p0", "policy", "base"),
    ("p0_vs_baseline", "base", "baseline"),
)
SUFFIX = {"vs_baseline": "", "vs_p0": "_vs_p0", "p0_vs_baseline": "_p0"}


@dataclass
class BenchmarkResults:
    """The benchmarks' metric rows, units (per prompt, for intervals) and every question asked."""

    questions: pd.DataFrame  # benchmark, id, measure, order, criterion, context, question, p_yes
    answers: dict[tuple[str, str, str], str]  # (benchmark, id, who) -> the answer; who "baseline" too
    judge: str
    protocols: dict[str, str] = field(default_factory=dict)  # benchmark -> quick | official
    rows: list[tuple[str, str, float]] = field(default_factory=list)  # (benchmark, metric, value)
    units: list[pd.DataFrame] = field(default_factory=list)  # variant, measure, unit_id, value

    def traced(self, limit: int) -> list[dict]:
        """Up to `limit` judged prompts, taken in turn from each benchmark, as the MLflow traces and the run
        report show them: the prompt, the answers, and the judge's P(yes) on each question (None: failed)."""
        by_prompt = {
            key: group for key, group in self.questions.groupby(["benchmark", "id"], sort=False) if len(group)
        }
        names = list(dict.fromkeys(name for name, _ in by_prompt))
        queues = {name: [k for k in by_prompt if k[0] == name] for name in names}
        picked: list[tuple[str, str]] = []
        while len(picked) < limit and any(queues.values()):
            for name in names:
                if queues[name] and len(picked) < limit:
                    picked.append(queues[name].pop(0))
        return [self._pair(name, i, by_prompt[(name, i)]) for name, i in picked]

    def _pair(self, name: str, prompt_id: str, asked: pd.DataFrame) -> dict:
        def number(value: float) -> float | None:
            return None if value != value else float(value)

        return {
            "benchmark": name,
            "id": prompt_id,
            "judge": self.judge,
            "protocol": self.protocols.get(name, "quick"),
            "answers": {
                w: self.answers[(name, prompt_id, w)]
                for w in ("policy", "base", "baseline")
                if (name, prompt_id, w) in self.answers
            },
            "questions": [
                {"measure": m, "order": int(o), "criterion": c, "question": q, "p_yes": number(v)}
                for m, o, c, q, v in asked[["measure", "order", "criterion", "question", "p_yes"]].itertuples(
                    index=False
                )
            ],
        }


def judge_benchmarks(
    cfg: Config,
    prompts: dict[str, pd.DataFrame],
    answers: pd.DataFrame,
    judge: Judge,
    seed: int,
    *,
    first_round: bool = False,
) -> BenchmarkResults:
    """Every benchmark's questions in one call to the judge, then its numbers (module docstring)."""
    by = {
        (b, i, w): text
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
    results = BenchmarkResults(questions, by, judge.label, protocols)
    for name, frame in prompts.items():
        mine = questions[questions["benchmark"] == name]
        if name == "alpaca_eval" and name in official:
            _alpaca_eval_official(results, frame, comparisons, judge, specs[name].df_gamed, seed)
        elif name == "writingbench" and name in official:
            _writingbench_official(results, frame, judge, specs[name].judge_max_tokens, seed)
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
    results.units.append(_units(name, f"win{suffix}", frame["id"], outcomes))
    if name == "alpaca_eval" and measure != "vs_p0":  # AlpacaEval 2's headline: against its baseline
        chars = np.array([len(results.answers[(name, i, who)]) for i in frame["id"]])
        baseline_chars = frame["baseline"].str.len().to_numpy()
        results.rows.append(
            (name, f"lc_win_rate{suffix}", length_controlled_win_rate(outcomes, chars, baseline_chars))
        )


ALPACA_EVAL_ID = re.compile(r"alpaca_eval-(\d+)")


def _alpaca_eval_official(
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
    ids = list(frame["id"])
    positions = [ALPACA_EVAL_ID.fullmatch(str(i)) for i in ids]
    if not all(positions):
        bad = next(i for i, p in zip(ids, positions, strict=True) if not p)
        raise BenchmarkError(
            f"alpaca_eval: the official protocol looks each instruction's difficulty up by its place in "
            f"AlpacaEval's 805 (ids alpaca_eval-NNN); got id {bad!r}. Use protocol: quick for other prompts"
        )
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
        results.units.append(_units(name, f"win{suffix}", ids, preferred))
        rows += [(name, i, measure, 0, "", "", ANNOTATOR, p) for i, p in zip(ids, preferred, strict=True)]
    asked = pd.DataFrame(rows, columns=[*results.questions.columns[:7], "p_yes"])
    results.questions = pd.concat([results.questions, asked], ignore_index=True)


WRITINGBENCH_CRITIC = "WritingBench's critic (1-10 per criterion)"


def _writingbench_official(
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
    results.units.append(_units(name, "score", per_query["policy"].index, per_query["policy"].to_numpy()))
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
    results.units.append(_units(name, "score", policy.index, policy.to_numpy()))


def _units(variant: str, measure: str, unit_ids, values) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "variant": variant,
            "measure": measure,
            "unit_id": pd.Index(unit_ids).astype(str),
            "value": np.asarray(values, float),
        }
    )
