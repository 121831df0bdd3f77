"""Benchmark: aggregate 10 million judgments into scores, generator rewards and diagnostics.

Run: `python -m bench.bench_aggregate [--judgments N] [--naive-fraction F] [--repeats R]`

Synthetic, seeded data shaped like a real round: K=8 responses per prompt, 2 rubric samples per prompt
with 4..12 weighted items (1% empty rubrics, as parse failures give), a quarter of the prompts with an
anchor ranking (with ties). Judgment rows are shuffled, so no code path can rely on their order.

Timed side by side in one process:
- `dynamicrubric.scoring.aggregate.aggregate` on all judgments (best of R runs), from in-memory frames of the
  dtypes `read_frame` gives (the Parquet read is not timed: it is the same for both);
- a naive pandas groupby-apply implementation of the same numbers. It needs minutes on 10M rows, so it
  runs on the judgments of a random subsample of prompts and its time is extrapolated linearly by the
  number of judgments (groupby-apply costs per group, and groups are proportional to judgments here).

Both must agree: the naive outputs on the subsample are compared with the full vectorised run's rows for
the same prompts (each prompt's numbers depend only on its own rows). Writes bench/results/aggregate.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from bench import cpu_model
from dynamicrubric.infra.artifact_kinds import RUBRIC_ITEM
from dynamicrubric.scoring.aggregate import aggregate

K = 8  # responses per prompt
G = 2  # rubric samples per prompt
ITEMS = (4, 12)  # items per rubric, inclusive
EMPTY_SHARE = 0.01
ANCHOR_SHARE = 0.25
SEED = 0
GOAL_SECONDS = 3.0
GOAL_SPEEDUP = 5.0
RESULTS = Path(__file__).parent / "results" / "aggregate.json"


def synthetic(num_judgments: int, seed: int = SEED) -> dict[str, pd.DataFrame]:
    """Judgments, rollouts, rubrics and anchors with exactly `num_judgments` judgment rows."""
    rng = np.random.default_rng(seed)
    if num_judgments % K:
        raise SystemExit(f"--judgments must be a multiple of K={K}")
    num_items_total = num_judgments // K
    # Items per rubric, cut so the total is exact; rubrics are laid out prompt by prompt, G per prompt.
    sizes = rng.integers(ITEMS[0], ITEMS[1] + 1, size=num_items_total // ITEMS[0] + 1)
    sizes[rng.random(len(sizes)) < EMPTY_SHARE] = 0
    cut = int(np.searchsorted(np.cumsum(sizes), num_items_total))
    sizes = sizes[: cut + 1]
    sizes[-1] -= int(sizes.sum()) - num_items_total
    num_rubrics = len(sizes)
    num_prompts = math.ceil(num_rubrics / G)
    rubric_prompt = np.arange(num_rubrics) // G
    rubric_idx = np.arange(num_rubrics) % G
    prompt_ids = pa.array([f"prompt-{p:07d}" for p in range(num_prompts)])

    # Verdicts from a latent response quality against an item difficulty.
    quality = rng.random((num_prompts, K))
    item_rubric = np.repeat(np.arange(num_rubrics), sizes)
    item_idx = np.arange(num_items_total) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    item_weight = rng.integers(1, 6, size=num_items_total).astype(np.int8)
    difficulty = rng.random(num_items_total)
    row_item = np.repeat(np.arange(num_items_total), K)
    row_sample = np.tile(np.arange(K), num_items_total)
    row_prompt = rubric_prompt[item_rubric[row_item]]
    logit = 6 * (quality[row_prompt, row_sample] - difficulty[row_item]) + rng.normal(0, 1, num_judgments)
    p_yes = (1 / (1 + np.exp(-logit))).astype(np.float32)
    shuffle = rng.permutation(num_judgments)

    def strings(codes: np.ndarray) -> pd.Series:
        return pa.chunked_array([prompt_ids.take(pa.array(codes))]).to_pandas()

    judgments = pd.DataFrame(
        {
            "prompt_id": strings(row_prompt[shuffle]),
            "rubric_idx": rubric_idx[item_rubric[row_item]][shuffle].astype(np.int32),
            "item_idx": item_idx[row_item][shuffle].astype(np.int32),
            "sample_idx": row_sample[shuffle].astype(np.int32),
            "weight": item_weight[row_item][shuffle],
            "verdict": (p_yes >= 0.5)[shuffle],
            "p_yes": p_yes[shuffle],
        }
    )
    rollouts = pd.DataFrame(
        {
            "prompt_id": strings(np.repeat(np.arange(num_prompts), K)),
            "sample_idx": np.tile(np.arange(K), num_prompts).astype(np.int32),
        }
    )
    item_structs = pa.StructArray.from_arrays(
        [pa.array(np.full(num_items_total, "item")), pa.array(item_weight)], fields=list(RUBRIC_ITEM)
    )
    items = pa.ListArray.from_arrays(
        pa.array(np.concatenate(([0], np.cumsum(sizes))), pa.int32()), item_structs
    )
    rubrics = pa.table(
        {
            "prompt_id": prompt_ids.take(pa.array(rubric_prompt)),
            "rubric_idx": rubric_idx.astype(np.int32),
            "items": items,
        }
    )
    anchored = np.flatnonzero(rng.random(num_prompts) < ANCHOR_SHARE)
    # Rank by quality rounded to tenths, so some responses tie (competition ranking: 1, 2, 2, 4, ...).
    rounded = np.round(quality[anchored], 1)
    ranks = 1 + (rounded[:, None, :] > rounded[:, :, None]).sum(axis=2)
    anchors = pd.DataFrame(
        {
            "list_id": strings(np.repeat(anchored, K)),
            "sample_idx": np.tile(np.arange(K), len(anchored)).astype(np.int32),
            "rank": ranks.ravel().astype(np.int32),
        }
    )
    return {"judgments": judgments, "rollouts": rollouts, "rubrics": rubrics, "anchors": anchors}


# --------------------------------------------------------------------------------------------------
# The naive reference: one Python call per group, as one would first write it with pandas.
# --------------------------------------------------------------------------------------------------


def naive(data: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    judgments, rollouts, anchors = data["judgments"], data["rollouts"], data["anchors"]
    rubrics = data["rubrics"].to_pandas() if isinstance(data["rubrics"], pa.Table) else data["rubrics"]
    keys = ["prompt_id", "rubric_idx"]

    scores = (
        judgments.groupby([*keys, "sample_idx"])
        .apply(lambda d: (d["weight"] * d["verdict"]).sum() / d["weight"].sum(), include_groups=False)
        .rename("score")
        .reset_index()
    )
    empty = rubrics[rubrics["items"].apply(len) == 0][keys].merge(rollouts[["prompt_id", "sample_idx"]])
    scores = pd.concat([scores, empty.assign(score=0.0)], ignore_index=True)

    def item_stats(d: pd.DataFrame) -> pd.Series:
        items = d.groupby("item_idx").agg(w=("weight", "first"), rate=("verdict", "mean"))
        return pd.Series(
            {
                "r_disc": (items.w * items.rate * (1 - items.rate)).sum() / items.w.sum(),
                "mean_pass_rate": items.rate.mean(),
            }
        )

    per_rubric = judgments.groupby(keys).apply(item_stats, include_groups=False).reset_index()

    ranked = {
        list_id: dict(zip(d["sample_idx"], d["rank"], strict=True))
        for list_id, d in anchors.groupby("list_id")
    }

    def score_stats(d: pd.DataFrame) -> pd.Series:
        counts = d["score"].value_counts()
        k = len(d)
        ties = (counts * (counts - 1) / 2).sum()
        out = {
            "mean_score": d["score"].mean(),
            "tie_rate": ties / (k * (k - 1) / 2),
            "uniform": len(counts) == 1,
        }
        rank = ranked.get(d.name[0])
        r_anchor, gaps = np.nan, []
        if rank:
            s = dict(zip(d["sample_idx"], d["score"], strict=True))
            terms = []
            for a, ra in rank.items():
                for b, rb in rank.items():
                    if ra < rb:
                        gaps.append(s[a] - s[b])
                        terms.append(-math.log1p(math.exp(-(s[a] - s[b]))) / ((rb - ra) * 2 ** (ra - 1)))
            r_anchor = sum(terms) if terms else np.nan
        out["r_anchor"] = r_anchor
        out["mean_gap"] = float(np.mean(gaps)) if gaps else np.nan
        return pd.Series(out)

    per_set = scores.groupby(keys).apply(score_stats, include_groups=False).reset_index()
    per_rubric = per_set.merge(per_rubric, on=keys, how="left")
    per_rubric["r_disc"] = per_rubric["r_disc"].fillna(0.0)
    return {"scores": scores, "per_rubric": per_rubric}


def compare(fast, reference: dict[str, pd.DataFrame]) -> dict[str, float]:
    """Largest absolute difference per number between the vectorised rows and the naive ones."""
    keys = ["prompt_id", "rubric_idx"]
    s = reference["scores"].merge(fast.scores, on=[*keys, "sample_idx"], suffixes=("_naive", ""), how="left")
    naive_rubric = reference["per_rubric"].rename(columns=lambda c: c if c in keys else c + "_naive")
    fast_rubric = fast.rewards.drop(columns="num_items").merge(fast.diagnostics, on=keys)
    r = naive_rubric.merge(fast_rubric, on=keys)
    if (
        len(s) != len(reference["scores"])
        or s["score"].isna().any()
        or len(r) != len(reference["per_rubric"])
    ):
        raise SystemExit("vectorised and naive outputs cover different keys")
    diffs = {"score": float((s["score"] - s["score_naive"]).abs().max())}
    for col in ["r_disc", "r_anchor", "mean_gap", "mean_score", "tie_rate", "mean_pass_rate"]:
        a, b = r[col].astype(float), r[col + "_naive"].astype(float)
        if not (a.isna() == b.isna()).all():
            raise SystemExit(f"{col}: null in one implementation but not the other")
        diffs[col] = float((a - b).abs().max())
    diffs["uniform_mismatches"] = float((r["uniform"] != r["uniform_naive"].astype(bool)).sum())
    return diffs


def subsample(data: dict[str, pd.DataFrame], fraction: float, seed: int = SEED) -> dict[str, pd.DataFrame]:
    prompts = data["rollouts"]["prompt_id"].unique()
    rng = np.random.default_rng(seed + 1)
    keep = set(rng.choice(prompts, size=max(1, int(len(prompts) * fraction)), replace=False).tolist())
    rubrics = data["rubrics"].to_pandas()
    return {
        "judgments": data["judgments"][data["judgments"]["prompt_id"].isin(keep)],
        "rollouts": data["rollouts"][data["rollouts"]["prompt_id"].isin(keep)],
        "rubrics": rubrics[rubrics["prompt_id"].isin(keep)],
        "anchors": data["anchors"][data["anchors"]["list_id"].isin(keep)],
    }


def machine() -> dict[str, object]:
    # Not bench.machine_info(): that one imports torch, which aggregation does not need.
    return {
        "cpu": cpu_model(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pandas": pd.__version__,
        "pyarrow": pa.__version__,
        # The machine is shared: a 1-minute load above the core count explains slow runs.
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--judgments", type=int, default=10_000_000)
    parser.add_argument(
        "--naive-fraction", type=float, default=0.01, help="share of prompts the naive one runs on"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    data = synthetic(args.judgments)
    print(f"generated {len(data['judgments']):,} judgments in {time.perf_counter() - t0:.1f} s")
    frames = (data["judgments"], data["rollouts"], data["rubrics"], data["anchors"])

    # Wall time is what the goal is about; CPU time of this process is shown too because the machine is
    # shared and other processes stretch wall time.
    times, cpu_times = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fast = aggregate(*frames)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    fast_s = min(times)

    sub = subsample(data, args.naive_fraction)
    n_sub = len(sub["judgments"])
    t0 = time.perf_counter()
    fast_sub = aggregate(sub["judgments"], sub["rollouts"], sub["rubrics"], sub["anchors"])
    fast_sub_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    reference = naive(sub)
    naive_sub_s = time.perf_counter() - t0
    naive_s = naive_sub_s * len(data["judgments"]) / n_sub

    diffs = compare(fast, reference)
    diffs_sub = compare(fast_sub, reference)
    worst = max(v for k, v in {**diffs, **diffs_sub}.items() if k != "uniform_mismatches")
    agree = worst <= 1e-9 and diffs["uniform_mismatches"] == 0 and diffs_sub["uniform_mismatches"] == 0

    result = {
        "judgments": len(data["judgments"]),
        "prompts": len(data["rollouts"]) // K,
        "rubrics": len(fast.rewards),
        "scores": len(fast.scores),
        "anchor_lists": int(data["anchors"]["list_id"].nunique()),
        "vectorised_s": round(fast_s, 3),
        "vectorised_runs_s": [round(t, 3) for t in times],
        "vectorised_median_s": round(float(np.median(times)), 3),
        "vectorised_cpu_s": round(min(cpu_times), 3),
        "naive_subsample_judgments": n_sub,
        "naive_subsample_s": round(naive_sub_s, 3),
        "vectorised_subsample_s": round(fast_sub_s, 4),
        "naive_extrapolated_s": round(naive_s, 1),
        "speedup": round(naive_s / fast_s, 1),
        "max_abs_diff": diffs,
        "agree": agree,
        "goal": {"seconds": GOAL_SECONDS, "speedup": GOAL_SPEEDUP},
        "meets_goal": fast_s <= GOAL_SECONDS and naive_s / fast_s >= GOAL_SPEEDUP,
        "machine": machine(),
    }

    print(f"\n{'':40}{'seconds':>12}{'judgments/s':>16}")
    print(
        f"{'vectorised (numpy/pyarrow), all rows':40}{fast_s:>12.2f}{len(data['judgments']) / fast_s:>16,.0f}"
    )
    print(f"{'naive groupby-apply, subsample':40}{naive_sub_s:>12.2f}{n_sub / naive_sub_s:>16,.0f}")
    print(f"{'naive, extrapolated to all rows':40}{naive_s:>12.1f}{'(linear)':>16}")
    print(
        f"\nspeedup {naive_s / fast_s:.0f}x; naive ran on {n_sub:,} judgments ({args.naive_fraction:.0%} of prompts)"
    )
    print(
        f"vectorised runs: {', '.join(f'{t:.2f}' for t in times)} s wall, best {min(cpu_times):.2f} s CPU; "
        f"largest difference vs naive: {worst:.2e}"
    )
    print(f"agree: {agree}; goal <= {GOAL_SECONDS} s and >= {GOAL_SPEEDUP}x: {result['meets_goal']}")
    print(f"machine: {result['machine']}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not agree:
        raise SystemExit("vectorised and naive results disagree")
    return result


if __name__ == "__main__":
    main()
