"""The evaluate stage's probe: what its evaluator scores besides the labelled lists.

Every held-out prompt's samples of both policies (P_t's k at sample_idx 0..k-1, P_{t-1}'s k at
k..2k-1) form one candidate set, the "probe" job: the win rate reads its sample 0 of each policy, and
the signal guard (guard.py) its scores against the gold. The guard adds the "canaries" job (sets with
canaries among P_t's samples), the "order" job (the probe's sets shown in another order) and, for
prompts without a checker, the "reference" job (the gold: the round-0 evaluator, or a judge endpoint).
`guard_report` turns their scores into the round's guard numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dynamicrubric import tasks
from dynamicrubric.evaluation.guard import GUARD, GuardReport, canary_sets, guarded, measure, shuffled_order
from dynamicrubric.infra.artifacts import read_frame
from dynamicrubric.infra.config import Config, JudgeSpec, SeedPurpose, policy_variant, round_seed
from dynamicrubric.infra.model_references import model_reference

# What each guard.action does once the alarm fires, in the words of the log line.
ACTION_WORDS = {
    "warn": "the next round runs as planned",
    "stop": "no later round runs",
    "rollback": "the next round starts from the last healthy round's policy and generator",
}


@dataclass
class EvalJob:
    """One set of responses scored by one evaluator variant, through temporary artifacts."""

    name: str
    rollouts: pd.DataFrame
    variant: str
    rollouts_uri: str = ""
    rubrics_uri: str | None = None
    judged: tuple | None = None  # (rubrics, judgments, scores) frames, for the traced sets and the guard
    gold: dict | None = None  # (list id, sample_idx) -> rank in its labelled list (1 = best)
    checker: dict | None = None  # (prompt_id, sample_idx) -> the checker's score of a policy sample
    generator: str | None = None  # another generator than the stage's (the guard's round-0 gold)
    judge: JudgeSpec | None = None  # another judge than the stage's verifier (guard.gold_judge)


def probe_variant(cfg: Config) -> str:
    """The evaluator that scores the probe: the one that rewards this run's policy; for the verifiable
    baseline (the checker is its reward) a dynamic rubric, for the win rate alone."""
    variant = policy_variant(cfg)
    return "dynamic" if variant == "verifiable" else variant


def _checker(outcomes: pd.DataFrame) -> dict[tuple[str, int], float]:
    known = outcomes[outcomes["score"].notna()]
    return {
        (str(p), int(i)): float(v)
        for p, i, v in known[["prompt_id", "sample_idx", "score"]].itertuples(index=False)
    }


def _gold(outcomes: pd.DataFrame, scores: dict[str, pd.DataFrame]) -> dict[tuple[str, int], float]:
    """(prompt_id, sample_idx) -> the gold of a probe response: its checker score, else (prompts without
    a checker) the reference judge's score."""
    gold = _checker(outcomes)
    if "reference" in scores:
        ref = scores["reference"]
        gold.update(
            {
                (str(p), int(i)): float(v)
                for p, i, v in ref[["prompt_id", "sample_idx", "score"]].itertuples(index=False)
            }
        )
    return gold


def probe_items(
    cfg: Config, jobs: list[EvalJob], scores: dict[str, pd.DataFrame], outcomes: pd.DataFrame, round_idx: int
) -> pd.DataFrame:
    """The `item_usefulness` of the probe's rubric items (G_t's, over both policies' samples) against
    the gold; empty where the probe has no rubric (the pointwise judge) or did not run."""
    from dynamicrubric.evaluation.item_usefulness import item_usefulness

    probe = next((j for j in jobs if j.name == "probe"), None)
    if probe is None or probe.judged is None:
        return item_usefulness(*_no_items(), None, soft=cfg.aggregate.soft, round_idx=round_idx)
    rubrics, judgments, _ = probe.judged
    gold = pd.DataFrame(
        [{"prompt_id": p, "sample_idx": i, "gold": v} for (p, i), v in _gold(outcomes, scores).items()],
        columns=["prompt_id", "sample_idx", "gold"],
    )
    return item_usefulness(
        rubrics, judgments, probe.rollouts, gold, soft=cfg.aggregate.soft, round_idx=round_idx
    )


def _no_items() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    from dynamicrubric.infra.artifact_kinds import empty_table

    return tuple(empty_table(kind).to_pandas() for kind in ("rubrics", "judgments", "rollouts"))


def guard_jobs(
    cfg: Config,
    samples: pd.DataFrame,
    prompts: pd.DataFrame,
    outcomes: pd.DataFrame,
    reference_generator: str,
    round_idx: int,
) -> list[EvalJob]:
    """The probe job, and where the guard measures this run (every variant but verifiable) its
    canary, order and reference jobs."""
    variant = probe_variant(cfg)
    checker = _checker(outcomes)
    probe = samples.sort_values(["prompt_id", "sample_idx"], kind="stable", ignore_index=True)
    jobs = [EvalJob("probe", probe, variant, checker=checker)]
    if not guarded(cfg):
        return jobs
    seed = round_seed(cfg, round_idx, SeedPurpose.GUARD)
    current = probe[probe["sample_idx"] < cfg.evaluate.samples]
    if cfg.guard.canary_sets and cfg.guard.canary_kinds:
        text = dict(zip(prompts["prompt_id"].astype(str), prompts["prompt"].astype(str), strict=True))
        sets, _ = canary_sets(current, text, cfg.guard, seed)
        jobs.append(EvalJob("canaries", sets, variant, checker=checker))
    if cfg.guard.order_audit and variant == "dynamic":
        jobs.append(EvalJob("order", shuffled_order(probe, seed)[0], variant))
    by_id = tasks.prompt_rows(probe, prompts, "samples")
    unchecked = [pid for pid in probe["prompt_id"].unique() if not tasks.is_verifiable(by_id[pid])]
    if unchecked:
        rest = probe[probe["prompt_id"].isin(unchecked)]
        gold = cfg.guard.gold_judge
        if gold.url or gold.model:
            jobs.append(EvalJob("reference", rest, "pointwise", judge=gold))
        else:  # the round-0 evaluator: the base generator's rubric over the set, judged by V
            jobs.append(EvalJob("reference", rest, "dynamic", generator=reference_generator))
    return jobs


def guard_report(
    cfg: Config,
    samples: pd.DataFrame,
    prompts: pd.DataFrame,
    scores: dict[str, pd.DataFrame],
    outcomes: pd.DataFrame,
    previous_units_uri: str | None,
    round_idx: int,
) -> GuardReport:
    """The guard's numbers from the jobs' scores (job name -> prompt_id, sample_idx, score)."""
    k = cfg.evaluate.samples
    seed = round_seed(cfg, round_idx, SeedPurpose.GUARD)
    probe = scores["probe"][["prompt_id", "sample_idx", "score"]].copy()
    probe["side"] = np.where(probe["sample_idx"] < k, "current", "previous")
    gold = _gold(outcomes, scores)
    probe["gold"] = [
        gold.get((str(p), int(i)), np.nan)
        for p, i in zip(probe["prompt_id"], probe["sample_idx"], strict=True)
    ]

    canaries = None
    if "canaries" in scores:
        current = samples[samples["sample_idx"] < k]
        text = dict(zip(prompts["prompt_id"].astype(str), prompts["prompt"].astype(str), strict=True))
        _, chosen = canary_sets(current, text, cfg.guard, seed)
        by_key = scores["canaries"].set_index(["prompt_id", "sample_idx"])["score"]
        canaries = chosen.assign(
            score=[
                by_key.get((p, i), np.nan)
                for p, i in zip(chosen["prompt_id"], chosen["sample_idx"], strict=True)
            ],
            original_score=[
                by_key.get((p, i), np.nan)
                for p, i in zip(chosen["prompt_id"], chosen["original"], strict=True)
            ],
        )
    order = None
    if "order" in scores:
        _, back = shuffled_order(samples.sort_values(["prompt_id", "sample_idx"], kind="stable"), seed)
        shown = scores["order"]
        shuffled = {
            (str(p), back[(str(p), int(i))]): float(v)
            for p, i, v in shown[["prompt_id", "sample_idx", "score"]].itertuples(index=False)
        }
        order = probe[["prompt_id", "sample_idx", "score"]].assign(
            shuffled_score=[
                shuffled.get((str(p), int(i)), np.nan)
                for p, i in zip(probe["prompt_id"], probe["sample_idx"], strict=True)
            ]
        )
    previous_agreement = None
    if previous_units_uri:
        units = read_frame(previous_units_uri, "units")
        previous_agreement = units[(units["variant"] == GUARD) & (units["measure"] == "agreement")]
    return measure(
        probe,
        guard=cfg.guard,
        seed=seed,
        canaries=canaries,
        order=order,
        previous_agreement=previous_agreement,
    )


def guard_record(
    cfg: Config, report: GuardReport | None, round_idx: int, *, policy: str, generator: str
) -> dict:
    """The `guard` artifact's row: the round's verdict and the models it is about (what a rollback
    chooses between). A round the guard did not measure is healthy."""
    return {
        "round": round_idx,
        "healthy": report is None or report.healthy,
        "alarms": "" if report is None else ",".join(report.fired),
        "reasons": "" if report is None else "; ".join(report.reasons),
        "action": cfg.guard.action,
        "policy": model_reference(policy),
        "generator": model_reference(generator),
    }
