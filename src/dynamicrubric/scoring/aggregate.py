"""Aggregation stage: verifier judgments -> response scores, generator rewards and signal diagnostics.

One rubric is written per candidate set (the K responses to one prompt), so scores are only compared
within a set. With w_m the item weights and v_m the verdicts (hard by default, p_yes with soft=True):

    score(y)  = Σ_m w_m·v_m / Σ_m w_m                      an empty rubric scores every response 0.0
    v̄_m       = mean of v_m over the K responses            the item's pass rate
    R_disc    = Σ_m w_m·Var_k(v_m) / Σ_m w_m                0 for an empty rubric
    R_anchor  = Σ_{rank_i < rank_j} log σ(S_i − S_j) / ((rank_j − rank_i)·2^(rank_i − 1))
    Δgap      = mean of S(y+) − S(y−) over reference pairs with rank(y+) < rank(y−)

R_anchor and Δgap use the `anchors` list whose list_id equals the prompt_id (rank 1 = best, equal
ranks are ties and form no pair); both are null for a set without such a pair. soft=True uses p_yes
wherever a verdict is used (scores, pass rates, R_disc). A set of one response has no pairs: tie rate
0, uniform. The pointwise baseline is a rubric of one weight-1 item per response and takes the same path.

R_disc is the variance of an item's verdicts over the K responses. With hard verdicts (0/1) that is
the paper's v̄(1 − v̄) exactly. With soft verdicts v̄(1 − v̄) would also count the verifier's doubt
about each response (law of total variance: v̄(1 − v̄) = Var_k(p) + mean_k p(1 − p)), and it rewards
items the verifier cannot answer: with SmolLM2-135M as verifier the doubt term was 0.23 and the
variance 0.002 (bench/results/evaluator_learns_vbar.json), so a generator trained on it learned
nothing about telling responses apart. Var_k(p) keeps only what splits the responses.

Everything runs on integer codes, without a Python loop over groups: prompts, rubrics, items and
responses become dense codes, every (item, response) judgment owns exactly one "slot" in a ragged
layout (an item of a set of K responses owns K consecutive slots), and sums are `np.bincount` over
those codes. The same slot layout proves judging complete: each slot must be filled exactly once.
Inputs that would give a silently wrong number (a judged response that is not a rollout, an item
judged for some responses but not others, a weight that differs between responses) raise
`AggregateError` naming the key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from dynamicrubric.infra.artifacts import read_artifact, write_artifact
from dynamicrubric.scoring.aggregate_codes import (
    AggregateError,
    CandidateSets,
    Frame,
    Judgments,
    candidate_sets,
    floats,
    index_codes,
    index_judgments,
    ints,
    kind_frame,
    log_sigmoid,
    ragged_arange,
    refuse_unscored,
    required_column,
    safe_divide,
    starts,
    strings,
)

log = logging.getLogger(__name__)

__all__ = [
    "AggregateError",
    "Aggregation",
    "aggregate",
    "run_aggregate",
    "score_responses",
    "write_aggregation",
]

# Scores closer than this count as tied: soft scores summed in a different order may differ in the
# last bits. Hard scores are integer sums divided by the same weight total, so they tie exactly.
TIE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Aggregation:
    scores: pd.DataFrame  # the `scores` artifact: one row per (prompt, rubric, response)
    rewards: pd.DataFrame  # the `rewards` artifact: one row per (prompt, rubric)
    diagnostics: pd.DataFrame  # the `diagnostics` artifact: one row per (prompt, rubric)
    overall: dict[str, float]  # run-level numbers, written as `metrics` rows


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def aggregate(
    judgments: Frame,
    rollouts: Frame,
    rubrics: Frame | None = None,
    anchors: Frame | None = None,
    *,
    soft: bool = False,
) -> Aggregation:
    """Scores, generator rewards and diagnostics in one pass over the judgments.

    `rollouts` is the full candidate set: every (prompt_id, sample_idx) gets a score under every rubric
    of its prompt. `rubrics` (optional) says which rubrics exist, including empty ones that have no
    judgments; without it a prompt with no judgments is an error. Frames need only the columns used:
    judgments (prompt_id, rubric_idx, item_idx, sample_idx, weight, verdict, p_yes), rollouts
    (prompt_id, sample_idx), rubrics (prompt_id, rubric_idx, items), anchors (list_id, sample_idx, rank).
    """
    sets = candidate_sets(rollouts)
    refuse_unscored(judgments)
    j = index_judgments(judgments, sets, rubrics)
    v = (
        floats(judgments, "p_yes")
        if soft
        else required_column(judgments, "verdict", "judgments").astype(np.float64)
    )

    # Slot layouts: group g owns K_g consecutive score slots, item i owns K_i consecutive verdict slots.
    group_k = sets.size[j.group_prompt]
    group_start = starts(group_k)
    item_k = group_k[j.item_group]
    item_weight = j.item_weight.astype(np.float64)

    weight_total = np.bincount(j.item_group, weights=item_weight, minlength=j.num_groups)
    weighted_passes = np.bincount(
        group_start[j.group] + j.local, weights=j.weight * v, minlength=int(group_k.sum())
    )
    row_group = np.repeat(np.arange(j.num_groups), group_k)
    score = safe_divide(weighted_passes, weight_total[row_group])

    pass_rate = np.bincount(j.item, weights=v, minlength=len(j.item_group)) / item_k
    second_moment = np.bincount(j.item, weights=v * v, minlength=len(j.item_group)) / item_k
    # Var_k(v) = E[v²] − E[v]²: v̄(1 − v̄) for 0/1 verdicts; clipped at 0 against rounding when all agree
    item_variance = np.maximum(second_moment - pass_rate * pass_rate, 0.0)
    r_disc = safe_divide(
        np.bincount(j.item_group, weights=item_weight * item_variance, minlength=j.num_groups), weight_total
    )

    pairs = _reference_pairs(anchors, sets, j, group_start, score)
    ties, runs = _ties(score, row_group, j.num_groups)
    response_pairs = group_k * (group_k - 1) / 2

    num_items = np.bincount(j.item_group, minlength=j.num_groups)
    empty = num_items == 0
    if empty.any():
        first = int(np.flatnonzero(empty)[0])
        log.warning(
            "%d of %d rubrics are empty (e.g. prompt_id=%r rubric_idx=%d): their responses all score 0.0",
            int(empty.sum()),
            j.num_groups,
            sets.prompt_ids[int(j.group_prompt[first])].as_py(),
            int(j.group_rubric[first]),
        )

    group_prompt_ids = sets.prompt_ids.take(pa.array(j.group_prompt))
    scores = kind_frame(
        "scores",
        prompt_id=group_prompt_ids.take(pa.array(row_group)),
        rubric_idx=j.group_rubric[row_group],
        sample_idx=sets.sample_idx[sets.start[j.group_prompt][row_group] + ragged_arange(group_k)],
        score=score,
        num_items=num_items[row_group],
    )
    rewards = kind_frame(
        "rewards",
        prompt_id=group_prompt_ids,
        rubric_idx=j.group_rubric,
        r_disc=r_disc,
        r_anchor=pairs.r_anchor,
        num_items=num_items,
    )
    diagnostics = kind_frame(
        "diagnostics",
        prompt_id=group_prompt_ids,
        rubric_idx=j.group_rubric,
        num_responses=group_k,
        num_items=num_items,
        mean_score=np.bincount(row_group, weights=score, minlength=j.num_groups) / group_k,
        mean_gap=pairs.mean_gap,
        tie_rate=safe_divide(ties, response_pairs),
        uniform=runs == 1,
        mean_pass_rate=np.where(
            empty,
            np.nan,
            np.bincount(j.item_group, weights=pass_rate, minlength=j.num_groups) / np.maximum(num_items, 1),
        ),
    )

    overall: dict[str, float] = {
        "num_groups": float(j.num_groups),
        "num_judgments": float(len(j.item)),
        "empty_rubrics": float(empty.sum()),
        "mean_score": float(score.mean()),
        "tie_rate": float(ties.sum() / response_pairs.sum()) if response_pairs.sum() else 0.0,
        "uniformity_rate": float((runs == 1).mean()),
        "r_disc_mean": float(r_disc.mean()),
    }
    if len(pass_rate):
        overall["mean_pass_rate"] = float(pass_rate.mean())
        overall["nondiscriminative_item_rate"] = float(((pass_rate == 0) | (pass_rate == 1)).mean())
    if pairs.num_pairs:
        overall["mean_gap"] = pairs.gap_sum / pairs.num_pairs
        overall["r_anchor_mean"] = float(np.nanmean(pairs.r_anchor))
    return Aggregation(scores=scores, rewards=rewards, diagnostics=diagnostics, overall=overall)


def score_responses(
    judgments: Frame, rollouts: Frame, rubrics: Frame | None = None, soft: bool = False
) -> pd.DataFrame:
    """The `scores` table: score(y) = Σ w·v / Σ w for every rollout under every rubric of its prompt."""
    return aggregate(judgments, rollouts, rubrics, soft=soft).scores


def run_aggregate(
    judgments_uri: str,
    rollouts_uri: str,
    out_scores: str,
    out_rewards: str,
    out_diagnostics: str,
    out_metrics: str,
    *,
    rubrics_uri: str | None = None,
    anchors_uri: str | None = None,
    soft: bool = False,
    round_idx: int = 0,
    variant: str = "dynamic",
    step: int | None = None,
) -> dict[str, float]:
    """The stage: read validated artifacts, aggregate, write scores/rewards/diagnostics/metrics.

    `step` (an online trainer's step) goes into every output as its `step` column.

    Inputs are read as Arrow tables (`read_artifact`), not DataFrames: the rubrics' nested `items`
    column stays columnar instead of becoming one Python list per row.
    """
    inputs = {
        "judgments": read_artifact(judgments_uri, "judgments"),
        "rollouts": read_artifact(rollouts_uri, "rollouts"),
        "rubrics": read_artifact(rubrics_uri, "rubrics") if rubrics_uri else None,
        "anchors": read_artifact(anchors_uri, "anchors") if anchors_uri else None,
    }
    outputs = {
        "scores": out_scores,
        "rewards": out_rewards,
        "diagnostics": out_diagnostics,
        "metrics": out_metrics,
    }
    _, overall = write_aggregation(
        inputs, outputs, judgments_uri, soft=soft, round_idx=round_idx, variant=variant, step=step
    )
    return overall


def write_aggregation(
    inputs: dict[str, Frame | None],
    outputs: dict[str, str],
    where: str,
    *,
    soft: bool,
    round_idx: int,
    variant: str,
    step: int | None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """`aggregate` over `inputs` (judgments, rollouts, rubrics, anchors), its four outputs (scores,
    rewards, diagnostics, metrics) written to the URIs `outputs` names for them, labelled with the round
    and variant, and with `step` (an online trainer's step) as every output's `step` column. Returns
    the outputs by kind and the run-level numbers; `where` names the inputs in an error."""
    try:
        result = aggregate(
            inputs["judgments"], inputs["rollouts"], inputs["rubrics"], inputs["anchors"], soft=soft
        )
    except AggregateError as e:  # the inputs are valid artifacts that do not fit together: name them
        raise AggregateError(f"{where}: {e}") from None
    stamp = {} if step is None else {"step": np.int32(step)}
    metrics = [
        {
            "round": round_idx,
            "stage": "aggregate",
            "variant": variant,
            "name": name,
            "step": step or 0,
            "value": value,
        }
        for name, value in result.overall.items()
    ]
    frames = {
        "scores": result.scores.assign(**stamp),
        "rewards": result.rewards.assign(**stamp),
        "diagnostics": result.diagnostics.assign(**stamp),
        "metrics": metrics,
    }
    for kind_name, data in frames.items():
        write_artifact(outputs[kind_name], kind_name, data)
    log.info("aggregate: %s", ", ".join(f"{k}={v:g}" for k, v in result.overall.items()))
    return frames, result.overall


# --------------------------------------------------------------------------------------------------
# Reference pairs (anchor lists): R_anchor and Δgap
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PairStats:
    r_anchor: np.ndarray  # (G,) NaN where the set has no reference pair
    mean_gap: np.ndarray  # (G,) NaN likewise
    gap_sum: float  # Σ S(y+) − S(y−) over all (group, pair)
    num_pairs: int


def _reference_pairs(
    anchors: Frame | None, sets: CandidateSets, j: Judgments, group_start: np.ndarray, score: np.ndarray
) -> _PairStats:
    """Every (group, y+, y−) with rank(y+) < rank(y−) in the anchor list of the group's prompt."""
    no_pairs = np.full(j.num_groups, np.nan)
    if anchors is None:
        return _PairStats(no_pairs, no_pairs, 0.0, 0)
    list_col = strings(anchors, "list_id", "anchors")
    prompt = index_codes(list_col, sets.prompt_ids)
    matched = prompt >= 0  # lists for other candidate sets are not ours
    if not matched.any():
        return _PairStats(no_pairs, no_pairs, 0.0, 0)
    prompt = prompt[matched]
    sample = ints(anchors, "sample_idx", "anchors")[matched]
    rank = ints(anchors, "rank", "anchors")[matched]
    response = sets.response_codes(prompt, sample)
    bad = (response < 0) | (rank < 1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        problem = "rank must be ≥ 1" if rank[row] < 1 else "sample_idx is not a rollout of this prompt"
        raise AggregateError(
            f"anchors (list_id={sets.prompt_ids[int(prompt[row])].as_py()!r}, sample_idx={int(sample[row])}): {problem}"
        )
    if len(np.unique(response)) != len(response):
        raise AggregateError(
            "anchors: a response appears twice in one list (duplicate (list_id, sample_idx))"
        )

    # Sort each list by rank; pair every row with every later row of its list, keep strict rank order.
    order = np.lexsort((rank, prompt))
    prompt, rank, response = prompt[order], rank[order], response[order]
    list_size = np.bincount(prompt, minlength=len(sets.size))
    position = np.arange(len(prompt)) - starts(list_size)[prompt]
    later = list_size[prompt] - 1 - position
    first = np.repeat(np.arange(len(prompt)), later)
    second = first + 1 + ragged_arange(later)
    strict = rank[first] < rank[second]
    first, second = first[strict], second[strict]

    # Every rubric of a prompt is scored on that prompt's pairs.
    pairs_per_prompt = np.bincount(prompt[first], minlength=len(sets.size))
    group_pairs = pairs_per_prompt[j.group_prompt]
    pair_group = np.repeat(np.arange(j.num_groups), group_pairs)
    pair = np.repeat(starts(pairs_per_prompt)[j.group_prompt], group_pairs) + ragged_arange(group_pairs)
    better, worse = first[pair], second[pair]
    local = response - sets.start[prompt]
    gap = score[group_start[pair_group] + local[better]] - score[group_start[pair_group] + local[worse]]
    term = log_sigmoid(gap) / ((rank[worse] - rank[better]) * np.exp2(rank[better] - 1.0))

    has_pairs = group_pairs > 0
    r_anchor = np.where(has_pairs, np.bincount(pair_group, weights=term, minlength=j.num_groups), np.nan)
    gap_sum = np.bincount(pair_group, weights=gap, minlength=j.num_groups)
    mean_gap = np.where(has_pairs, gap_sum / np.maximum(group_pairs, 1), np.nan)
    return _PairStats(r_anchor, mean_gap, float(gap.sum()), len(gap))


def _ties(score: np.ndarray, row_group: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group: tied response pairs, and runs of equal scores (1 run = all scores equal)."""
    order = np.lexsort((score, row_group))
    s, g = score[order], row_group[order]
    new_run = np.ones(len(s), dtype=bool)
    new_run[1:] = (g[1:] != g[:-1]) | (s[1:] - s[:-1] > TIE_TOLERANCE)
    run_length = np.diff(np.append(np.flatnonzero(new_run), len(s)))
    run_group = g[new_run]
    ties = np.bincount(run_group, weights=run_length * (run_length - 1) / 2, minlength=num_groups)
    runs = np.bincount(run_group, minlength=num_groups)
    return ties, runs
