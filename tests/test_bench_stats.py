import numpy as np
import pytest

from bench.stats import bootstrap_mean, paired_difference


def test_interval_contains_the_mean_and_narrows_with_n():
    rng = np.random.default_rng(1)
    small = bootstrap_mean(rng.binomial(1, 0.3, size=20))
    large = bootstrap_mean(rng.binomial(1, 0.3, size=2000))
    for r in (small, large):
        assert r["low"] <= r["mean"] <= r["high"]
    assert (large["high"] - large["low"]) < (small["high"] - small["low"]) / 5
    assert large["low"] < 0.3 < large["high"]


def test_constant_values_have_a_zero_width_interval():
    r = bootstrap_mean([0.5] * 10)
    assert r == {"mean": 0.5, "low": 0.5, "high": 0.5, "n": 10}


def test_nan_units_are_dropped_and_empty_is_nan():
    assert bootstrap_mean([1.0, float("nan"), 0.0])["n"] == 2
    assert np.isnan(bootstrap_mean([float("nan")])["mean"])


def test_paired_difference_keeps_the_pairing():
    # Large unit-to-unit spread, constant +0.1 improvement: pairing makes the interval exact.
    before = np.linspace(0, 0.8, 50)
    r = paired_difference(before + 0.1, before)
    assert r["low"] == pytest.approx(0.1) and r["high"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="same units"):
        paired_difference([1, 2], [1])


def test_seeded():
    x = np.random.default_rng(3).random(30)
    assert bootstrap_mean(x, seed=5) == bootstrap_mean(x, seed=5)
