"""The benchmark judge and what its judging collects: `Judge` (who answers the benchmarks' questions, an
in-process model or a chat endpoint), the answers it compares (`WHO`, `COMPARISONS`) and `BenchmarkResults`
(every metric row, per-prompt unit and question asked), shared by the quick protocol (benchmark_runs.py) and
the benchmarks' own (official_protocols.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pandas as pd

from dynamicrubric.engines import Engine, load_judge
from dynamicrubric.engines.chat_judge import ChatJudge
from dynamicrubric.evaluation.alpaca_eval_judging import engine_label_logprobs
from dynamicrubric.infra.config import Config
from dynamicrubric.scoring.prompts import split_chat_prompt

WHO = ("policy", "base")  # P_t's answers, P_0's

# The pairwise comparisons: (measure, the answer judged, the answer it is judged against). P_0 against the
# baseline is judged in a run's first round only: P_0 is the same every round.
COMPARISONS = (
    ("vs_baseline", "policy", "baseline"),
    ("vs_p0", "policy", "base"),
    ("p0_vs_baseline", "base", "baseline"),
)
SUFFIX = {"vs_baseline": "", "vs_p0": "_vs_p0", "p0_vs_baseline": "_p0"}


@dataclass
class Judge:
    """Who judges the benchmarks: `label` for every table, and the engine that answers the yes/no
    questions (an in-process model, or a `ChatJudge` client of an endpoint, whose ledger counts its calls)."""

    label: str
    engine: Engine
    own: bool  # the judge's engine was made for the benchmarks (close it after), not taken from the pool
    independent: bool = False  # another model than V, whose verdicts trained the policy (judge_independent)

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
        the same seed and conversation order in process (an endpoint is asked unseeded)."""
        if isinstance(self.engine, ChatJudge):  # unseeded: ChatJudge.chat_replies says why
            return self.engine.chat_replies(
                conversations, max_tokens=max_tokens, desc="benchmark judge", **sampling
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


def judge_independent(cfg: Config) -> bool:
    """Whether the benchmark judge is another model than V, the verifier whose verdicts trained the policy:
    only then are its numbers independent of training."""
    jc = cfg.evaluate.benchmark_judge
    if jc.url:
        return jc.url.rstrip("/") != (cfg.models.verifier_url or "").rstrip("/")
    return bool(jc.model) and jc.model != cfg.models.verifier


def judge_label(cfg: Config, verifier: str = "") -> str:
    """How every table names the benchmark judge (`evaluate.benchmark_judge`), saying so where it is V."""
    jc = cfg.evaluate.benchmark_judge
    label = f"{jc.served_model or 'the model served'} at {jc.url}" if jc.url else jc.model
    if judge_independent(cfg):
        return label
    return f"V ({label or verifier or cfg.models.verifier}, the verifier the policy trained against: not independent)"


def benchmark_judge(cfg: Config, get_engine: Callable[[str], Engine], verifier: str) -> Judge:
    """The configured benchmark judge; the frozen verifier `verifier`, taken from the stage's pool, when
    `evaluate.benchmark_judge` names none."""
    jc = cfg.evaluate.benchmark_judge
    label, independent = judge_label(cfg, verifier), judge_independent(cfg)
    if jc.url:
        return Judge(label, load_judge(jc, cfg, role="benchmark judge"), own=True, independent=independent)
    return Judge(label, get_engine(jc.model or verifier), own=False, independent=independent)


@dataclass
class BenchmarkResults:
    """The benchmarks' metric rows, units (per prompt, for intervals) and every question asked."""

    questions: pd.DataFrame  # benchmark, id, measure, order, criterion, context, question, p_yes
    answers: dict[tuple[str, str, str], str]  # (benchmark, id, who) -> the answer; who "baseline" too
    judge: str
    protocols: dict[str, str] = field(default_factory=dict)  # benchmark -> quick | official
    judge_independent: bool = False  # Judge.independent
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
            "judge_independent": self.judge_independent,
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


def units_frame(variant: str, measure: str, unit_ids, values) -> pd.DataFrame:
    """Per-unit values of one measure (variant, measure, unit_id, value): what the intervals resample."""
    return pd.DataFrame(
        {
            "variant": variant,
            "measure": measure,
            "unit_id": pd.Index(unit_ids).astype(str),
            "value": np.asarray(values, float),
        }
    )
