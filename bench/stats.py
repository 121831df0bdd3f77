"""Confidence intervals for the study numbers: percentile bootstrap over prompts.

Every accuracy, gap and rate in the studies is a mean over units (prompts, pairs, candidate sets) that
were drawn independently, so the interval resamples those units with replacement. A paired difference
(the same prompts before and after training, or under two variants) resamples the per-unit
differences, which keeps the pairing. Seeded, so a rerun gives the same interval.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd


def bootstrap_mean(
    values: Sequence[float], *, resamples: int = 10_000, level: float = 0.95, seed: int = 0
) -> dict[str, float]:
    """The mean of `values` and its percentile-bootstrap interval, with n.

    NaNs are dropped (a unit that has no value, e.g. a set without a reference ordering)."""
    x = np.asarray(values, dtype=np.float64)
    x = x[~np.isnan(x)]
    if x.size == 0:
        return {"mean": float("nan"), "low": float("nan"), "high": float("nan"), "n": 0}
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return {"mean": float(x.mean()), "low": float(low), "high": float(high), "n": int(x.size)}


def paired_difference(
    after: Sequence[float],
    before: Sequence[float],
    *,
    resamples: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """Mean of after − before over units measured both ways, with its bootstrap interval."""
    a, b = np.asarray(after, dtype=np.float64), np.asarray(before, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same units: {a.shape} vs {b.shape}")
    return bootstrap_mean(a - b, resamples=resamples, level=level, seed=seed)


def unit_intervals(
    units: pd.DataFrame, by: Sequence[str] = ("variant", "measure")
) -> dict[str, dict[str, float]]:
    """`bootstrap_mean` of `value` per group of a units frame, keyed "<by[0]>/<by[1]>/...".

    A units frame has one row per measured unit (a held-out prompt, a labelled pair, a candidate set)
    with its `value`, as the evaluate stage writes it."""
    return {
        "/".join(str(k) for k in (key if isinstance(key, tuple) else (key,))): bootstrap_mean(group["value"])
        for key, group in units.groupby(list(by), sort=True)
    }


def paired_units(after: pd.DataFrame, before: pd.DataFrame) -> dict[str, float]:
    """`paired_difference` of `value` over the unit_ids both frames hold (after − before).

    For two variants or two rounds measured on the same prompts or pairs: units only one side has
    (e.g. outcome lists built from one policy's own samples) are left out; n says how many were paired."""
    for name, frame in (("after", after), ("before", before)):
        if frame["unit_id"].duplicated().any():
            raise ValueError(
                f"paired_units: {name} has a unit_id twice; select one variant and measure first"
            )
    both = after[["unit_id", "value"]].merge(
        before[["unit_id", "value"]], on="unit_id", suffixes=("_a", "_b")
    )
    return paired_difference(both["value_a"].to_numpy(), both["value_b"].to_numpy())
