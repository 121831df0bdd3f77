"""The evaluate stage's measurements, as pure functions over frames.

The metric functions are pure and take a "lists" frame with columns list_id, sample_idx, rank
(1 = best, equal ranks are ties) and score (the evaluator's score, higher = better). Scores closer
than `aggregate.TIE_TOLERANCE` count as tied, as they do in aggregation. A reference pair is two
responses of one list with rank_a < rank_b ("a is better"); lists with fewer than two distinct ranks
hold no information about order and are left out of the accuracy metrics.

Policy metrics: avg@k, pass@k (the unbiased estimator) and the win rate over the previous policy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from dynamicrubric.scoring.aggregate import TIE_TOLERANCE
from dynamicrubric.tasks import CODE_TASKS

log = logging.getLogger(__name__)


LIST_COLUMNS = ("list_id", "sample_idx", "rank", "score")


# --------------------------------------------------------------------------------------------------
# Evaluator metrics on labelled lists
# --------------------------------------------------------------------------------------------------


def check_lists(lists: pd.DataFrame) -> pd.DataFrame:
    """Validate a lists frame (columns, nulls, rank >= 1, scores finite, unique keys); return it."""
    missing = [c for c in LIST_COLUMNS if c not in lists.columns]
    if missing:
        raise ValueError(f"lists frame is missing column(s) {missing}; expected {list(LIST_COLUMNS)}")
    for col in LIST_COLUMNS:
        nulls = int(lists[col].isna().sum())
        if nulls:
            raise ValueError(f"lists frame: column {col!r} has {nulls} null(s)")
    if len(lists) and (lists["rank"] < 1).any():
        raise ValueError(f"lists frame: rank must be >= 1 (1 = best), found {int(lists['rank'].min())}")
    if not np.isfinite(lists["score"].to_numpy(dtype=np.float64)).all():
        raise ValueError("lists frame: column 'score' has a non-finite value")
    dup = lists.duplicated(["list_id", "sample_idx"])
    if dup.any():
        first = lists.loc[dup, ["list_id", "sample_idx"]].iloc[0].to_dict()
        raise ValueError(f"lists frame: duplicate (list_id, sample_idx) {first}")
    return lists


def rankable(lists: pd.DataFrame) -> pd.DataFrame:
    """The lists with at least two distinct ranks (the only ones that say anything about order)."""
    distinct = lists.groupby("list_id")["rank"].transform("nunique")
    return lists[distinct >= 2]


def _pairs(lists: pd.DataFrame, ordered: bool) -> pd.DataFrame:
    """Within-list response pairs: (better, worse) with rank_a < rank_b if `ordered`, else every pair once."""
    cols = ["list_id", "sample_idx", "rank", "score"]
    both = lists[cols].merge(lists[cols], on="list_id", suffixes=("_a", "_b"))
    keep = both["rank_a"] < both["rank_b"] if ordered else both["sample_idx_a"] < both["sample_idx_b"]
    both = both[keep]
    return both.assign(diff=both["score_a"] - both["score_b"])


def _pair_credit(diff: pd.Series) -> np.ndarray:
    """1 if the better response scored higher, 0.5 for a tie, 0 if it scored lower."""
    return np.where(diff > TIE_TOLERANCE, 1.0, np.where(diff >= -TIE_TOLERANCE, 0.5, 0.0))


def pair_credits(lists: pd.DataFrame) -> pd.DataFrame:
    """One row per reference pair (rank_a < rank_b, same list): list_id, sample_idx_a (the better
    response), sample_idx_b and credit (1 scored a > b, 0.5 tied, 0 scored a < b)."""
    pairs = _pairs(check_lists(lists), ordered=True)
    return pd.DataFrame(
        {
            "list_id": pairs["list_id"].to_numpy(),
            "sample_idx_a": pairs["sample_idx_a"].to_numpy(),
            "sample_idx_b": pairs["sample_idx_b"].to_numpy(),
            "credit": _pair_credit(pairs["diff"]),
        }
    )


def pairwise_accuracy(lists: pd.DataFrame) -> float:
    """Share of reference pairs (rank_a < rank_b, same list) scored a > b; a tied score counts half.

    Pooled over all pairs of all lists (a list of n distinct ranks contributes n(n-1)/2 pairs).
    NaN when there is no reference pair.
    """
    credits = pair_credits(lists)["credit"]
    return float(credits.mean()) if len(credits) else math.nan


def listwise_accuracy(lists: pd.DataFrame) -> float:
    """Share of lists whose highest-scored response is a best one (the list's smallest rank).

    When several responses tie for the top score, the list gets the share of them that are best
    (the chance that a random pick among the tied top is right). Mean over rankable lists; NaN if none.
    """
    df = rankable(check_lists(lists))
    if df.empty:
        return math.nan
    by_list = df.groupby("list_id")
    top = df["score"] >= by_list["score"].transform("max") - TIE_TOLERANCE
    best = df["rank"] == by_list["rank"].transform("min")
    credit = (top & best).groupby(df["list_id"]).sum() / top.groupby(df["list_id"]).sum()
    return float(credit.mean())


def ndcg(lists: pd.DataFrame) -> float:
    """Mean nDCG over rankable lists, with linear gains from the known ranks and tie-aware ordering.

    gain(y) = max_rank − rank(y) in its list (the worst responses gain 0; for a correct/incorrect list
    this is binary relevance). Responses are ordered by score, descending; position p has discount
    1/log2(p + 1). Responses with tied scores share the mean discount of the positions they occupy
    (the expected DCG under a random tie break), so a constant scorer is not rewarded for the input
    order. nDCG = DCG / ideal DCG, where the ideal orders by rank. NaN when no list is rankable.
    """
    df = rankable(check_lists(lists))
    if df.empty:
        return math.nan
    df = df.assign(gain=df.groupby("list_id")["rank"].transform("max") - df["rank"])

    by_score = df.sort_values(["list_id", "score"], ascending=[True, False], kind="stable")
    discount = 1.0 / np.log2(by_score.groupby("list_id").cumcount().to_numpy() + 2.0)
    same_list = by_score["list_id"].to_numpy()[1:] == by_score["list_id"].to_numpy()[:-1]
    drop = by_score["score"].to_numpy()[:-1] - by_score["score"].to_numpy()[1:]
    run = np.concatenate(([0], np.cumsum(~same_list | (drop > TIE_TOLERANCE))))
    tied_discount = pd.Series(discount).groupby(run).transform("mean").to_numpy()
    dcg = pd.Series(by_score["gain"].to_numpy() * tied_discount).groupby(by_score["list_id"].to_numpy()).sum()

    by_rank = df.sort_values(["list_id", "rank"], kind="stable")
    ideal_discount = 1.0 / np.log2(by_rank.groupby("list_id").cumcount().to_numpy() + 2.0)
    idcg = pd.Series(by_rank["gain"].to_numpy() * ideal_discount).groupby(by_rank["list_id"].to_numpy()).sum()
    return float((dcg / idcg).mean())


def mean_gap(lists: pd.DataFrame) -> float:
    """Δgap: mean of score(better) − score(worse) over all reference pairs (signed). NaN without pairs."""
    pairs = _pairs(check_lists(lists), ordered=True)
    return float(pairs["diff"].mean()) if len(pairs) else math.nan


def mean_gap_correct(lists: pd.DataFrame) -> float:
    """Mean of score(better) − score(worse) over the reference pairs the evaluator orders correctly.

    The margin by which a right call is made (always > 0). NaN when no pair is ordered correctly.
    """
    pairs = _pairs(check_lists(lists), ordered=True)
    right = pairs["diff"] > TIE_TOLERANCE
    return float(pairs.loc[right, "diff"].mean()) if right.any() else math.nan


def tie_rate(lists: pd.DataFrame) -> float:
    """Share of all within-list response pairs (whatever their ranks) with equal scores; NaN if none.

    The same definition as the aggregation diagnostics: pooled over lists.
    """
    pairs = _pairs(check_lists(lists), ordered=False)
    return float((pairs["diff"].abs() <= TIE_TOLERANCE).mean()) if len(pairs) else math.nan


def uniformity_rate(lists: pd.DataFrame) -> float:
    """Share of lists (of two or more responses) whose responses all got the same score; NaN if none."""
    df = check_lists(lists)
    by_list = df.groupby("list_id")["score"]
    size = by_list.size()
    spread = (by_list.max() - by_list.min())[size >= 2]
    return float((spread <= TIE_TOLERANCE).mean()) if len(spread) else math.nan


def evaluator_metrics(lists: pd.DataFrame) -> dict[str, float]:
    """Every evaluator metric of one variant on rankable lists, plus the counts they rest on."""
    df = rankable(check_lists(lists))
    ordered = _pairs(df, ordered=True)
    return {
        "labelled_lists": float(df["list_id"].nunique()),
        "labelled_pairs": float(len(ordered)),
        "pairwise_accuracy": pairwise_accuracy(df),
        "listwise_accuracy": listwise_accuracy(df),
        "ndcg": ndcg(df),
        "mean_gap": mean_gap(df),
        "mean_gap_correct": mean_gap_correct(df),
        "tie_rate": tie_rate(df),
        "uniformity_rate": uniformity_rate(df),
        "mean_score": float(df["score"].mean()) if len(df) else math.nan,
    }


# --------------------------------------------------------------------------------------------------
# Policy metrics
# --------------------------------------------------------------------------------------------------


def pass_at_k(n: Sequence[int] | np.ndarray, c: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
    """Unbiased pass@k per problem: 1 − C(n−c, k) / C(n, k), from n samples of which c are correct.

    Exact integer binomials (Python ints), so large n does not lose precision. Requires 1 <= k <= n.
    """
    n_arr, c_arr = np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64)
    if n_arr.shape != c_arr.shape:
        raise ValueError(f"pass_at_k: n and c differ in shape ({n_arr.shape} vs {c_arr.shape})")
    if ((c_arr < 0) | (c_arr > n_arr)).any():
        raise ValueError("pass_at_k: every c must be within 0..n")
    if k < 1 or (n_arr < k).any():
        raise ValueError(f"pass_at_k: k={k} must be >= 1 and <= every n (smallest n: {n_arr.min(initial=0)})")
    return np.array(
        [
            1.0 - math.comb(int(ni - ci), k) / math.comb(int(ni), k)
            for ni, ci in zip(n_arr, c_arr, strict=True)
        ],
        dtype=np.float64,
    )


def avg_at_k(scored: pd.DataFrame) -> float:
    """avg@k: the mean score over each prompt's samples, averaged over prompts (columns prompt_id, score)."""
    if scored.empty:
        return math.nan
    return float(scored.groupby("prompt_id")["score"].mean().mean())


def policy_metrics(scored: pd.DataFrame, k: int) -> dict[str, float]:
    """Per task: `<task>/avg_at_<k>`; for code tasks also pass_at_1 and pass_at_<k> (k > 1).

    `scored` has columns prompt_id, task, sample_idx, score (the task checker's score in 0..1); a code
    sample is correct when its score is 1 (every test passed). Names avoid '@' (MLflow rejects it).
    """
    out: dict[str, float] = {}
    for task, group in scored.groupby("task", sort=True):
        out[f"{task}/avg_at_{k}"] = avg_at_k(group)
        if task in CODE_TASKS:
            per_prompt = group.groupby("prompt_id")["score"]
            n = per_prompt.size().to_numpy()
            c = per_prompt.apply(lambda s: int((s >= 1.0).sum())).to_numpy()
            out[f"{task}/pass_at_1"] = float(pass_at_k(n, c, 1).mean())
            full = n >= k  # a prompt whose unscored samples leave fewer than k has no pass@k estimate
            if k > 1 and full.any():
                out[f"{task}/pass_at_{k}"] = float(pass_at_k(n[full], c[full], k).mean())
    out["accuracy"] = avg_at_k(scored)  # every prompt of every task, for one headline number
    return out


def win_credits(current: pd.Series, previous: pd.Series) -> pd.Series:
    """Per prompt (the index both series share): 1 if the current response scored higher than the
    previous one, 0.5 for a tie, 0 if lower."""
    if not current.index.equals(previous.index):
        current, previous = current.align(previous, join="inner")
    return pd.Series(_pair_credit(current - previous), index=current.index, dtype=np.float64)


def win_rate(current: pd.Series, previous: pd.Series) -> float:
    """Share of prompts where the current response scored higher than the previous one; ties count half.

    Both series are indexed by prompt_id (the same prompts). NaN when empty.
    """
    credits = win_credits(current, previous)
    return float(credits.mean()) if len(credits) else math.nan
