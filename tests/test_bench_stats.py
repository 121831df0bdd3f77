import numpy as np
import pandas as pd
import pytest

from bench.stats import bootstrap_mean, paired_difference, paired_units, unit_intervals


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


def test_unit_intervals_group_by_variant_and_measure():
    units = pd.DataFrame(
        {
            "variant": ["policy"] * 4 + ["dynamic"] * 2,
            "measure": ["avg_at_k"] * 4 + ["pair_soft"] * 2,
            "unit_id": ["p1", "p2", "p3", "p4", "x|0>1", "y|0>1"],
            "value": [0.0, 0.5, 1.0, 0.5, 1.0, 0.0],
        }
    )
    out = unit_intervals(units)
    assert set(out) == {"policy/avg_at_k", "dynamic/pair_soft"}
    assert out["policy/avg_at_k"]["mean"] == 0.5 and out["policy/avg_at_k"]["n"] == 4
    assert out["dynamic/pair_soft"]["low"] == 0.0 and out["dynamic/pair_soft"]["high"] == 1.0


def test_paired_units_pairs_by_unit_id_and_drops_unmatched():
    before = pd.DataFrame({"unit_id": ["a", "b", "c"], "value": [0.0, 0.5, 1.0]})
    after = pd.DataFrame({"unit_id": ["c", "b", "a", "d"], "value": [1.0, 0.75, 0.25, 0.0]})
    r = paired_units(after, before)
    assert r["n"] == 3 and r["mean"] == pytest.approx((0.0 + 0.25 + 0.25) / 3)
    with pytest.raises(ValueError, match="unit_id twice"):
        paired_units(pd.concat([after, after]), before)
