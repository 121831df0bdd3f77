"""Small-sample statistics for the numbers `dynrubric run` prints."""

from __future__ import annotations

import math


def wilson_interval(p: float, n: int | float, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of a proportion `p` observed on `n` trials.

    Unlike the normal approximation it stays inside [0, 1] and is defined at p = 0 or 1, which is
    where small evaluation sets land. `p` may be a mean of 0/1 outcomes with half credit for ties
    (the pairwise accuracy, the win rate); it is treated as p·n successes. n = 0 gives (0, 1).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"wilson_interval: p={p} is not a proportion in [0, 1]")
    if n < 0:
        raise ValueError(f"wilson_interval: n={n} is negative")
    if n == 0:
        return 0.0, 1.0
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)
