import math

import pytest

from dynamicrubric.evaluation.stats import wilson_interval


def test_wilson_matches_published_values():
    # Newcombe (1998), Table I: 81/263 → 0.2553–0.3662; 15/148 → 0.0624–0.1605 (95%, no continuity correction)
    lo, hi = wilson_interval(81 / 263, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    lo, hi = wilson_interval(15 / 148, 148)
    assert (round(lo, 4), round(hi, 4)) == (0.0624, 0.1605)


def test_wilson_small_samples_stay_in_range_and_are_wide():
    lo, hi = wilson_interval(0.5, 1)
    assert 0.0 < lo < 0.5 < hi < 1.0 and hi - lo > 0.8
    lo, hi = wilson_interval(1.0, 3)
    assert hi == 1.0 and 0.0 < lo < 0.5
    lo, hi = wilson_interval(0.0, 3)
    assert lo == 0.0 and 0.5 < hi < 1.0
    assert wilson_interval(0.3, 0) == (0.0, 1.0)
    narrow = wilson_interval(0.5, 10_000)
    assert math.isclose(narrow[1] - narrow[0], 2 * 1.96 * 0.005, rel_tol=0.01)


@pytest.mark.parametrize("p, n", [(-0.1, 5), (1.5, 5), (0.5, -1)])
def test_wilson_rejects_bad_input(p, n):
    with pytest.raises(ValueError):
        wilson_interval(p, n)
