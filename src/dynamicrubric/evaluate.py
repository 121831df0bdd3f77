"""Evaluate stage: is the evaluator ranking responses correctly, and is the policy getting better?

Three measurements per round, written as one `metrics` artifact (stage="evaluate") plus PNG plots,
and the units each metric averages over as a `units` artifact (one row per held-out prompt, labelled
pair or win-rate prompt), from which a study computes confidence intervals and paired differences:

1. Policy quality on held-out verifiable prompts (variant "policy"): the policy samples k responses
   per prompt, each is scored by its task's own checker (`tasks.score_response`: reasoning-gym's
   `score_answer`, HumanEval's tests in the sandbox). avg@k is the mean score over the k samples;
   for code, pass@1 and pass@k use the unbiased estimator over the k samples.
2. Evaluator quality on labelled lists (variants "dynamic", "static", "pointwise"): ranked lists
   whose order is known (the policy's own samples ranked by verifiable correctness, plus the user's
   anchors / Nectar / chosen-rejected files). Each evaluator scores every response of a list, and
   the scores are compared with the known ranks by the metric functions below.
3. Win rate of the policy over the previous round's policy (variant "policy"), judged by the current
   evaluator: per held-out prompt one response from each, a dynamic rubric written over the two as
   the candidate set, scores compared; ties count half.

The metric functions are pure and take a "lists" frame with columns list_id, sample_idx, rank
(1 = best, equal ranks are ties) and score (the evaluator's score, higher = better). Scores closer
than `aggregate.TIE_TOLERANCE` count as tied, as they do in aggregation. A reference pair is two
responses of one list with rank_a < rank_b ("a is better"); lists with fewer than two distinct ranks
hold no information about order and are left out of the accuracy metrics.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from dynamicrubric import store, tasks
from dynamicrubric.aggregate import TIE_TOLERANCE, score_responses
from dynamicrubric.artifacts import ArtifactError, artifact_kind, read_artifact, read_frame, write_artifact
from dynamicrubric.config import Config
from dynamicrubric.engines import Engine, load_engine
from dynamicrubric.judge import run_judge
from dynamicrubric.rollout import sample_rollouts
from dynamicrubric.rubrics import run_rubrics
from dynamicrubric.tasks import CODE_TASKS

log = logging.getLogger(__name__)

LIST_COLUMNS = ("list_id", "sample_idx", "rank", "score")
EVALUATOR_VARIANTS = ("dynamic", "static", "pointwise")
MAX_LIST_SIZE = 26  # the dynamic generator labels responses A..Z
OUTCOMES_PREFIX = "outcomes:"  # list ids of the policy's outcome lists; a user's file i gives "file<i>:"
PLOT_NAMES = ("scores.png", "gap_tie.png", "accuracy.png", "policy.png")


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


# --------------------------------------------------------------------------------------------------
# Labelled lists: verifiable outcomes and user files
# --------------------------------------------------------------------------------------------------


# `data.labelled: ["dynamicrubric:NAME"]` names a labelled set shipped in the package's presets/ folder:
# a preset cannot name a path, since a run may start in any folder.
PACKAGED_PREFIX = "dynamicrubric:"


def packaged_path(uri: str) -> str:
    """The file behind a `dynamicrubric:NAME` labelled set; any other URI as it is."""
    if not uri.startswith(PACKAGED_PREFIX):
        return uri
    path = resources.files("dynamicrubric").joinpath("presets", uri.removeprefix(PACKAGED_PREFIX))
    if not path.is_file():
        raise ValueError(f"{uri}: no such labelled set in the package (looked for {path})")
    return str(path)


def load_labelled(uri: str) -> pd.DataFrame:
    """An anchors frame from a user file: an `anchors` artifact, Nectar answers, or chosen/rejected pairs.

    The format is detected: a dynamicrubric artifact by its footer, otherwise by columns (`chosen` and
    `rejected`: pairs; `answers`: Nectar). `dynamicrubric:NAME` is a set shipped with the package.
    """
    uri = packaged_path(uri)
    try:
        found = artifact_kind(uri)
    except ArtifactError:
        found = "<none>"
    if found == "anchors":
        return read_frame(uri, "anchors")
    if found != "<none>":
        raise ValueError(f"{uri}: a {found!r} artifact is not a labelled set; expected an 'anchors' artifact")
    records = tasks.read_records(uri)
    columns = set(records[0])
    if {"chosen", "rejected"} <= columns:
        return tasks.load_pairs(uri)
    if "answers" in columns:
        return tasks.load_nectar(uri)
    raise ValueError(
        f"{uri}: cannot tell the labelled-set format from columns {sorted(columns)}; expected an anchors "
        "artifact, chosen/rejected pairs (columns prompt, chosen, rejected) or Nectar (prompt, answers)"
    )


def outcome_lists(scored: pd.DataFrame, prompts: pd.DataFrame) -> pd.DataFrame:
    """Anchors from verifiable outcomes: each prompt's samples ranked by checker score (dense, 1 = best).

    The ranking rule of `tasks.anchors_from_outcomes` (score descending → dense rank, list_id =
    prompt_id), applied to scores already computed, so code is not run in the sandbox a second time.
    Unlike there, lists whose samples all score the same are kept (all rank 1): the caller counts
    them as skipped.
    """
    ranked = scored.assign(rank=scored.groupby("prompt_id")["score"].rank(method="dense", ascending=False))
    prompt_text = prompts.set_index("prompt_id")["prompt"]
    return pd.DataFrame(
        {
            "list_id": ranked["prompt_id"].astype(str),
            "sample_idx": ranked["sample_idx"].astype(np.int32),
            "rank": ranked["rank"].astype(np.int32),
            "prompt": ranked["prompt_id"].map(prompt_text),
            "response": ranked["response"],
            "source": "outcomes",
        }
    ).reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------


class _Engines:
    """Holds at most one engine that it loaded itself: asking for another model frees the current one.

    One at a time rather than sized together: at paper scale every role is an 8B model and a vLLM
    engine claims `gpu_memory_utilization` (0.85) of its GPU, so two engines cannot share one GPU, and
    splitting the memory between them would halve each one's KV cache (batch size) for the whole
    stage. The stage is ordered so that each model is needed in one phase only (policy, previous
    policy, generator, verifier), so at most four loads happen per evaluate call; a model given by
    the caller (`preloaded`) is used as is and never freed here."""

    def __init__(self, cfg: Config, preloaded: dict[str, Engine] | None) -> None:
        self.cfg = cfg
        self.preloaded: dict[str, Engine] = dict(preloaded or {})
        self.ref: str | None = None
        self.engine: Engine | None = None
        self.loads = 0

    def get(self, ref: str) -> Engine:
        if ref in self.preloaded:
            return self.preloaded[ref]
        if self.ref != ref:
            self.release()
            self.engine = load_engine(ref, self.cfg.engine)
            self.ref = ref
            self.loads += 1
        assert self.engine is not None
        return self.engine

    def release(self) -> None:
        """Free the engine this pool loaded (engine.close(): del, gc, CUDA cache / vLLM shutdown)."""
        if self.engine is not None:
            self.engine.close()
        self.engine, self.ref = None, None


def sample_held_out(
    cfg: Config,
    prompts: pd.DataFrame,
    pool: _Engines,
    *,
    policy: str,
    previous_policy: str | None,
    seed: int,
) -> pd.DataFrame:
    """The policy's `evaluate.samples` responses per held-out prompt (sample_idx 0..k-1) and, for the
    win rate, sample 0 of the same seed from the previous policy, stored at sample_idx k (with
    identical weights both policies give identical responses): one rollouts frame, so one artifact
    carries the stage's samples from the GPU task that makes them to the tasks that check and score."""
    ev = cfg.evaluate
    sample_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"k": ev.samples})})
    samples = sample_rollouts(pool.get(policy), prompts, sample_cfg, seed=seed, policy=policy)
    if previous_policy is None or not ev.win_rate:
        return samples
    prev_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"k": 1})})
    previous = sample_rollouts(
        pool.get(previous_policy), prompts, prev_cfg, seed=seed, policy=previous_policy
    )
    return pd.concat([samples, previous.assign(sample_idx=np.int32(ev.samples))], ignore_index=True)


def split_samples(samples: pd.DataFrame, cfg: Config) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`sample_held_out`'s frame as (the policy's samples, the previous policy's at sample_idx 1)."""
    current = samples["sample_idx"] < cfg.evaluate.samples
    return samples[current], samples[~current].assign(sample_idx=np.int32(1))


def check_samples(samples: pd.DataFrame, prompts: pd.DataFrame, timeout_s: float) -> pd.DataFrame:
    """The outcomes frame (prompt_id, sample_idx, task, score): each sample scored by its task's
    checker; code runs in the sandbox, a few runs at a time. Score NaN: unscored (the sandbox failed;
    logged and counted). Prompts without a verifiable outcome (no task checker, no reference) are left
    out and counted."""
    by_id = tasks.prompt_rows(samples, prompts, "samples")
    verifiable = samples["prompt_id"].map(lambda pid: tasks.is_verifiable(by_id[pid]))
    if not verifiable.all():
        log.warning(
            "evaluate: %d of %d held-out prompts have no verifiable outcome and are not scored",
            samples.loc[~verifiable, "prompt_id"].nunique(),
            samples["prompt_id"].nunique(),
        )
    todo = samples[verifiable]
    jobs = [(by_id[pid], response) for pid, response in zip(todo["prompt_id"], todo["response"], strict=True)]
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        scores = list(pool.map(lambda job: tasks.score_response(job[0], job[1], timeout_s=timeout_s), jobs))
    outcomes = pd.DataFrame(
        {
            "prompt_id": todo["prompt_id"].to_numpy(),
            "sample_idx": todo["sample_idx"].to_numpy(dtype=np.int32),
            "task": [job[0]["task"] for job in jobs],
            "score": np.asarray(scores, dtype=np.float64),
        }
    )
    unscored = outcomes["score"].isna()
    if unscored.any():  # the sandbox failed on them (logged by tasks): unknown, not wrong
        log.warning(
            "evaluate: %d of %d samples left unscored (sandbox errors)", int(unscored.sum()), len(outcomes)
        )
    return outcomes


def _as_rollouts(anchors: pd.DataFrame) -> pd.DataFrame:
    """A rollouts-shaped frame of labelled lists (prompt_id = list_id), for the rubric and judge stages."""
    return pd.DataFrame(
        {
            "prompt_id": anchors["list_id"].astype(str),
            "sample_idx": anchors["sample_idx"].astype(np.int32),
            "prompt": anchors["prompt"],
            "response": anchors["response"],
            "num_tokens": np.zeros(len(anchors), dtype=np.int32),
            "finish_reason": "stop",
            "policy": anchors["source"],
            "seed": 0,
        }
    )


def _labelled_lists(
    scored: pd.DataFrame, prompts: pd.DataFrame, labelled_uris: Sequence[str]
) -> tuple[pd.DataFrame, dict[str, float]]:
    """Every labelled list usable for accuracy, and counts of what was kept and skipped.

    List ids are prefixed by where they come from ("outcomes:", "file<i>:") so that a user's list id
    cannot collide with a prompt id. Lists with fewer than two distinct ranks, or more responses than
    the generator can label, are skipped and counted.
    """
    parts = [
        outcome_lists(scored, prompts).pipe(lambda df: df.assign(list_id=OUTCOMES_PREFIX + df["list_id"]))
    ]
    for i, uri in enumerate(labelled_uris):
        user = load_labelled(uri)
        log.info("evaluate: %d labelled list(s) from %s", user["list_id"].nunique(), uri)
        parts.append(user.assign(list_id=f"file{i}:" + user["list_id"].astype(str)))
    lists = pd.concat([p[list(tasks.ANCHOR_COLUMNS)] for p in parts], ignore_index=True)
    total = lists["list_id"].nunique()
    too_big = lists.groupby("list_id")["sample_idx"].transform("size") > MAX_LIST_SIZE
    if too_big.any():
        log.warning(
            "evaluate: skipping %d labelled list(s) of more than %d responses",
            lists.loc[too_big, "list_id"].nunique(),
            MAX_LIST_SIZE,
        )
    kept = rankable(lists[~too_big]).reset_index(drop=True)
    num_kept = kept["list_id"].nunique()
    counts = {
        "labelled_lists": float(num_kept),
        "labelled_lists_skipped": float(total - num_kept),
        "labelled_lists_outcomes": float(
            kept["list_id"].str.startswith(OUTCOMES_PREFIX).groupby(kept["list_id"]).any().sum()
        ),
    }
    return kept, counts


def _accuracy_by_origin(lists: pd.DataFrame) -> dict[str, float]:
    """Pairwise accuracy on the user's files alone and on the policy's outcome lists alone.

    The files are a fixed held-out set, comparable from round to round; the outcome lists are the
    current policy's own samples and change with it. NaN (later dropped) when one side has no pair.
    """
    from_outcomes = lists["list_id"].str.startswith(OUTCOMES_PREFIX)
    return {
        "pairwise_accuracy_labelled": pairwise_accuracy(lists[~from_outcomes]),
        "pairwise_accuracy_outcomes": pairwise_accuracy(lists[from_outcomes]),
    }


@dataclass
class _EvalJob:
    """One set of responses scored by one evaluator variant, through temporary artifacts."""

    name: str
    rollouts: pd.DataFrame
    variant: str
    rollouts_uri: str = ""
    rubrics_uri: str | None = None


def _evaluator_scores(
    jobs: list[_EvalJob],
    cfg: Config,
    workdir: Path,
    engines: _Engines,
    *,
    generator: str,
    verifier: str,
    seed: int,
) -> dict[str, pd.DataFrame]:
    """Score every response of every job: job name -> (prompt_id, sample_idx, score, score_soft,
    score_hard); `score` is the configured verdicts' (aggregate.soft), the other two both kinds.

    Runs the rubric and judge stages in process on temporary artifacts (so the evaluate stage measures
    exactly what the training rounds use): first every job's rubrics with the generator, then every
    job's judgments with the verifier, so each model is loaded once. Scores of several rubric samples
    are averaged."""
    for job in jobs:
        job.rollouts_uri = str(workdir / f"{job.name}.rollouts.parquet")
        write_artifact(job.rollouts_uri, "rollouts", job.rollouts)
    for job in jobs:
        if job.variant != "pointwise":
            job.rubrics_uri = str(workdir / f"{job.name}.rubrics.parquet")
            run_rubrics(
                job.rollouts_uri,
                job.rubrics_uri,
                cfg,
                generator=generator,
                variant=job.variant,
                seed=seed,
                engine=engines.get(generator),
            )
    out = {}
    for job in jobs:
        judgments_uri = str(workdir / f"{job.name}.judgments.parquet")
        variant = "pointwise" if job.rubrics_uri is None else "rubric"
        judge_cfg = cfg.model_copy(update={"judge": cfg.judge.model_copy(update={"variant": variant})})
        run_judge(
            job.rollouts_uri,
            judgments_uri,
            judge_cfg,
            rubrics_uri=job.rubrics_uri,
            verifier=verifier,
            engine=engines.get(verifier),
        )
        inputs = (
            read_artifact(judgments_uri, "judgments"),
            read_artifact(job.rollouts_uri, "rollouts"),
            read_artifact(job.rubrics_uri, "rubrics") if job.rubrics_uri else None,
        )
        by_kind = {
            f"score_{name}": score_responses(*inputs, soft=soft)
            .groupby(["prompt_id", "sample_idx"], as_index=False)["score"]
            .mean()
            .rename(columns={"score": f"score_{name}"})
            for name, soft in (("soft", True), ("hard", False))
        }
        scores = by_kind["score_soft"].merge(by_kind["score_hard"], on=["prompt_id", "sample_idx"])
        out[job.name] = scores.assign(score=scores["score_soft" if cfg.aggregate.soft else "score_hard"])
    return out


def run_evaluate(
    eval_prompts_uri: str,
    out_metrics_uri: str,
    out_plots_dir: str,
    cfg: Config,
    *,
    policy: str | None = None,
    generator: str | None = None,
    verifier: str | None = None,
    previous_policy: str | None = None,
    labelled_uris: Sequence[str] = (),
    round_idx: int = 0,
    seed: int | None = None,
    engines: dict[str, Engine] | None = None,
    out_units_uri: str | None = None,
    samples_uri: str | None = None,
    outcomes_uri: str | None = None,
) -> dict[str, float]:
    """The evaluate stage; returns every metric as a flat dict "<variant>/<name>" -> value.

    `out_units_uri` (optional) gets the units artifact: ("policy", "avg_at_k") per held-out prompt,
    ("policy", "win") per win-rate prompt, and per evaluator variant ("pair_soft" and "pair_hard") the
    credit of every reference pair under soft and hard verdicts (the metrics use `aggregate.soft`'s).

    Model references (local folders, hub ids or built-in names) default to cfg.models; `engines`
    (model ref -> Engine) lets a caller reuse engines it already holds. The stage holds one model at a
    time (see `_Engines`): the policy samples, then the previous policy, then the generator writes
    every rubric (all variants and the win rate), then the verifier judges them all. `labelled_uris`
    are user files of anchors artifacts, Nectar answers or chosen/rejected pairs (JSONL or Parquet).
    `samples_uri` (a rollouts artifact of `sample_held_out`) and `outcomes_uri` (of `check_samples`)
    are the first two phases done by earlier tasks; without them they run here.
    """
    ev = cfg.evaluate
    variants = list(dict.fromkeys(ev.variants))  # each once, in the configured order
    if isinstance(labelled_uris, str):  # one file given where a list is expected
        labelled_uris = [labelled_uris]
    policy = policy or cfg.models.policy
    generator = generator or cfg.models.generator
    verifier = verifier or cfg.models.verifier
    seed = cfg.seed if seed is None else seed
    prompts = read_frame(eval_prompts_uri, "prompts")
    pool = _Engines(cfg, engines)
    roles = {"generator": generator, "verifier": verifier, "seed": seed}
    rows: list[tuple[str, str, float]] = []  # (variant, name, value)
    units: list[pd.DataFrame] = []  # (variant, measure, unit_id, value)

    # (1) The policy samples k responses per held-out prompt; each is scored by its task's checker.
    # On GPUs these are tasks of their own (evaluate-samples, check-samples: code runs in a CPU pod).
    if samples_uri:
        samples = read_frame(samples_uri, "rollouts")
    else:
        samples = sample_held_out(
            cfg, prompts, pool, policy=policy, previous_policy=previous_policy, seed=seed
        )
    rollouts, previous = split_samples(samples, cfg)
    if outcomes_uri:
        outcomes = read_frame(outcomes_uri, "outcomes")
    else:
        outcomes = check_samples(rollouts, prompts, ev.sandbox_timeout_s)
    scored = outcomes[outcomes["score"].notna()].merge(
        rollouts[["prompt_id", "sample_idx", "response"]], on=["prompt_id", "sample_idx"], how="left"
    )
    rows.append(("policy", "unscored", float(len(outcomes) - len(scored))))
    rows += [("policy", name, value) for name, value in policy_metrics(scored, ev.samples).items()]
    per_prompt = scored.groupby("prompt_id", sort=True)["score"].mean()
    units.append(_units("policy", "avg_at_k", per_prompt.index, per_prompt.to_numpy()))
    rows.append(("policy", "samples", float(len(scored))))

    # (2) Labelled lists scored by each evaluator variant, and (3) the win rate over the previous
    # policy, judged by a dynamic rubric over the pair: one generator phase, one verifier phase.
    lists, counts = _labelled_lists(scored, prompts, labelled_uris)
    jobs: list[_EvalJob] = []
    if lists.empty:
        log.warning(
            "evaluate: no labelled list with two distinct outcomes (%d skipped); evaluator metrics "
            "of %s are skipped",
            int(counts["labelled_lists_skipped"]),
            variants,
        )
    else:
        as_rollouts = _as_rollouts(lists)
        jobs += [_EvalJob(f"labelled-{v}", as_rollouts, v) for v in variants]
    if len(previous):
        current = rollouts[rollouts["sample_idx"] == 0]
        pair = pd.concat([current, previous], ignore_index=True).sort_values(
            ["prompt_id", "sample_idx"], kind="stable"
        )
        jobs.append(_EvalJob("win-rate", pair, "dynamic"))
    with tempfile.TemporaryDirectory(prefix="dynrubric-evaluate-") as tmp:
        scores = _evaluator_scores(jobs, cfg, Path(tmp), pool, **roles) if jobs else {}
    pool.release()

    evaluated: dict[str, pd.DataFrame] = {}
    for variant in variants:
        if f"labelled-{variant}" in scores:
            evaluated[variant] = lists.merge(
                scores[f"labelled-{variant}"].rename(columns={"prompt_id": "list_id"}),
                on=["list_id", "sample_idx"],
                how="left",
            )
        values = evaluator_metrics(evaluated[variant]) if variant in evaluated else {}
        for kind in ("soft", "hard") if variant in evaluated else ():
            credits = pair_credits(evaluated[variant].assign(score=evaluated[variant][f"score_{kind}"]))
            pair_ids = (
                credits["list_id"]
                + "|"
                + credits["sample_idx_a"].astype(str)
                + ">"
                + credits["sample_idx_b"].astype(str)
            )
            units.append(_units(variant, f"pair_{kind}", pair_ids, credits["credit"].to_numpy()))
        values.update(counts)
        if variant in evaluated and labelled_uris:
            values.update(_accuracy_by_origin(evaluated[variant]))
        rows += [(variant, name, value) for name, value in values.items()]
    if "win-rate" in scores:
        by_side = scores["win-rate"].pivot(index="prompt_id", columns="sample_idx", values="score")
        rows.append(("policy", "win_rate", win_rate(by_side[0], by_side[1])))
        wins = win_credits(by_side[0], by_side[1])
        units.append(_units("policy", "win", wins.index, wins.to_numpy()))
        rows.append(("policy", "win_rate_prompts", float(len(by_side))))

    metrics = pd.DataFrame(rows, columns=["variant", "name", "value"])
    metrics = metrics.assign(round=round_idx, stage="evaluate", step=0)
    defined = metrics["value"].notna()
    if not defined.all():  # e.g. the gap on correct pairs when no pair is ordered correctly
        undefined = metrics.loc[~defined, "variant"] + "/" + metrics.loc[~defined, "name"]
        log.info("evaluate: undefined metric(s) not written: %s", ", ".join(undefined))
    metrics = metrics[defined]
    write_artifact(out_metrics_uri, "metrics", metrics)
    if out_units_uri:
        write_artifact(out_units_uri, "units", pd.concat(units, ignore_index=True).assign(round=round_idx))
    write_plots(out_plots_dir, metrics, evaluated)
    result = {
        f"{v}/{n}": float(x) for v, n, x in metrics[["variant", "name", "value"]].itertuples(index=False)
    }
    log.info("evaluate: %s", ", ".join(f"{k}={v:.4g}" for k, v in result.items()))
    return result


def _units(variant: str, measure: str, unit_ids: Sequence[str], values: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame(
        {"variant": variant, "measure": measure, "unit_id": pd.Index(unit_ids).astype(str), "value": values}
    )


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------


def write_plots(out_dir: str, metrics: pd.DataFrame, evaluated: dict[str, pd.DataFrame]) -> list[str]:
    """Write the PNG plots into `out_dir` (a path or s3:// prefix); return their file names.

    scores.png: per variant, the score distribution of best vs other responses; gap_tie.png: mean gap,
    gap on correct pairs, tie and uniformity rate per variant; accuracy.png: pairwise / listwise
    accuracy and nDCG per variant; policy.png: avg@k (and pass@k) per task and the win rate.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with tempfile.TemporaryDirectory(prefix="dynrubric-plots-") as tmp:
        variants = list(evaluated)
        fig, axes = plt.subplots(
            1, max(1, len(variants)), figsize=(4 * max(1, len(variants)), 3.2), squeeze=False
        )
        for ax, variant in zip(axes[0], variants, strict=False):
            df = evaluated[variant]
            best = df["rank"] == df.groupby("list_id")["rank"].transform("min")
            bins = np.linspace(0, 1, 21)
            ax.hist([df.loc[best, "score"], df.loc[~best, "score"]], bins=bins, label=["best", "other"])
            ax.set_title(variant)
            ax.set_xlabel("score")
            ax.legend()
        if not variants:
            _no_data(axes[0][0], "no labelled lists")
        axes[0][0].set_ylabel("responses")
        _save(fig, Path(tmp, "scores.png"))

        _bars(
            Path(tmp, "gap_tie.png"),
            metrics,
            variants,
            ["mean_gap", "mean_gap_correct", "tie_rate", "uniformity_rate"],
            "gap and ties",
        )
        _bars(
            Path(tmp, "accuracy.png"),
            metrics,
            variants,
            ["pairwise_accuracy", "listwise_accuracy", "ndcg"],
            "evaluator accuracy",
        )

        per_task = metrics["name"].str.contains("/") | (metrics["name"] == "win_rate")
        pol = metrics[(metrics["variant"] == "policy") & per_task]
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(pol) + 2), 3.2))
        if len(pol):
            ax.bar(pol["name"], pol["value"])
            ax.set_ylim(0, 1)
            ax.tick_params(axis="x", labelrotation=30)
        else:
            _no_data(ax, "no policy scores")
        ax.set_title("policy quality")
        _save(fig, Path(tmp, "policy.png"))
        store.upload_dir(tmp, out_dir)
    return list(PLOT_NAMES)


def _bars(path: Path, metrics: pd.DataFrame, variants: list[str], names: list[str], title: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    table = metrics[metrics["variant"].isin(variants) & metrics["name"].isin(names)].pivot(
        index="name", columns="variant", values="value"
    )
    if table.empty:
        _no_data(ax, "no labelled lists")
    else:
        table = table.reindex(index=[n for n in names if n in table.index], columns=variants)
        width = 0.8 / len(variants)
        x = np.arange(len(table.index))
        for i, variant in enumerate(variants):
            ax.bar(x + i * width, table[variant].fillna(0).to_numpy(), width, label=variant)
        ax.set_xticks(x + width * (len(variants) - 1) / 2, table.index)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.legend()
    ax.set_title(title)
    _save(fig, path)


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
