"""Confidence intervals for the study numbers: percentile bootstrap over prompts.

Every accuracy, gap and rate in the studies is a mean over units (prompts, pairs, candidate sets) that
were drawn independently, so the interval resamples those units with replacement. A paired difference
(the same prompts before and after training, or under two variants) resamples the per-unit
differences, which keeps the pairing. Seeded, so a rerun gives the same interval.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
