"""AlpacaEval 2, official: `benchmark_scores.alpaca_eval_scores` against upstream's published annotations and
leaderboard, and against alpaca_eval 0.6.6's own `get_length_controlled_winrate` on a df_gamed.csv-shaped
fixture (tests/fixtures/alpaca_eval/README.md says where each file comes from)."""

from __future__ import annotations

import importlib.resources
import re
import sys
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import sklearn

from dynamicrubric.evaluation.benchmark_scores import (
    AlpacaEvalError,
    alpaca_eval_metrics,
    alpaca_eval_scores,
    find_df_gamed,
    length_controlled_win_rate,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "alpaca_eval"
DF_GAMED = FIXTURES / "df_gamed_synthetic.csv"
UPSTREAM_MODELS = ["claude-2.1", "gpt-3.5-turbo-1106", "gemma-7b-it", "alpaca-7b"]


@pytest.fixture
def glm(monkeypatch, tmp_path):
    """alpaca_eval's metrics module, with its HF cache pointed at an empty folder: no test reads a
    df_gamed.csv it did not pass in, whatever this machine's cache holds."""
    module = alpaca_eval_metrics()
    monkeypatch.setattr(module.constants, "DEFAULT_CACHE_DIR", str(tmp_path / "hf-cache"))
    return module


def leaderboard() -> pd.DataFrame:
    """The leaderboard CSV of the installed alpaca_eval wheel, read at test time."""
    data = importlib.resources.files("alpaca_eval") / "leaderboards" / "data_AlpacaEval_2"
    return pd.read_csv(data / "weighted_alpaca_eval_gpt4_turbo_leaderboard.csv", index_col=0)


def upstream_table(model: str) -> pd.DataFrame:
    """One model's published annotations (index, baseline and model lengths, preference)."""
    fixture = pd.read_csv(FIXTURES / "upstream_annotations.csv")
    return pd.DataFrame(
        {
            "index": fixture["index"],
            "len_1": fixture["len_1"],
            "len_2": fixture[f"{model}:len_2"],
            "preference": fixture[f"{model}:preference"],
        }
    )


def synthetic_table(n: int = 200, seed: int = 0, pad: int | None = None) -> pd.DataFrame:
    """Annotations of n of the fixture's instructions. Without `pad`, the policy's answers are as long as
    chance makes them and it wins about 90% (a Beta(9, 1) preference); with `pad`, its answers are the
    baseline's plus `pad` characters and the judge prefers them for that alone, with the strength the
    fixture's gamed baselines show (make_df_gamed.LENGTH_EFFECT, 2 logits at full tanh)."""
    rng = np.random.default_rng(seed)
    baseline = rng.integers(500, 3000, n)
    if pad is None:
        policy = rng.integers(500, 3000, n)
        preference = 1 + rng.beta(9, 1, n)
    else:
        policy = baseline + pad
        logit = 2.0 * np.tanh(pad / 500) + rng.normal(0, 0.3, n)
        preference = 1 + 1 / (1 + np.exp(-logit))
    return pd.DataFrame({"index": np.arange(n), "len_1": baseline, "len_2": policy, "preference": preference})


def alpaca_eval_direct(glm, monkeypatch, table: pd.DataFrame, df_gamed: Path) -> dict:
    """alpaca_eval's own get_length_controlled_winrate on the table's rows, as its docs call it: a table
    with the two outputs as text, indexed by instruction, its hub download answered with `df_gamed`."""
    frame = pd.DataFrame(
        {
            "preference": table["preference"].to_numpy(),
            "output_1": ["a" * k for k in table["len_1"]],
            "output_2": ["b" * k for k in table["len_2"]],
            "generator_1": "gpt4_1106_preview",
            "generator_2": "my_model",
        },
        index=table["index"].to_numpy(),
    )
    monkeypatch.setattr(glm, "hf_hub_download", lambda **kwargs: str(df_gamed))
    # Its fit turns sklearn's metadata routing on for the whole process; sklearn 1.9 warns on every fit.
    with sklearn.config_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return glm.get_length_controlled_winrate(frame, save_weights_dir=None)


# --------------------------------------------------------------------------------------------------
# Against upstream's published annotations and leaderboard.


@pytest.mark.parametrize("model", UPSTREAM_MODELS)
def test_upstream_annotations_give_the_leaderboards_win_rates(glm, model):
    expected = leaderboard().loc[model]
    scores = alpaca_eval_scores(upstream_table(model))
    assert scores.n == expected["n_total"] == 805 and scores.failed == 0
    assert scores.win_rate == pytest.approx(expected["win_rate"], abs=0.01)
    assert scores.discrete_win_rate == pytest.approx(expected["discrete_win_rate"], abs=0.01)
    assert scores.standard_error == pytest.approx(expected["standard_error"], abs=0.01)
    # No df_gamed.csv here: the regression is reported as lc_minimal, and never as the LC.
    assert scores.length_controlled_winrate is None and scores.lc_standard_error is None
    assert scores.lc_minimal is not None
    assert (
        scores.lc_note.startswith("lc_minimal, not AlpacaEval 2's LC")
        and "not in the HF cache" in scores.lc_note
    )


def test_the_minimal_formula_is_not_the_leaderboards_lc(glm):
    """Why lc_minimal must never be shown as the LC: on gpt-3.5-turbo-1106 it is twice the leaderboard's
    LC. The quick protocol's length_controlled_win_rate is that same minimal formula."""
    table = upstream_table("gpt-3.5-turbo-1106")
    scores = alpaca_eval_scores(table)
    assert scores.lc_minimal == pytest.approx(37.77, abs=0.05)
    assert leaderboard().loc["gpt-3.5-turbo-1106", "length_controlled_winrate"] == pytest.approx(
        19.3, abs=0.05
    )
    quick = length_controlled_win_rate(table["preference"] - 1, table["len_2"], table["len_1"])
    assert 100 * quick == pytest.approx(scores.lc_minimal, abs=0.1)


def test_upstreams_annotation_table_is_taken_as_it_is(glm):
    """The shape of annotations.json (the outputs as text, no `index`: the row is the instruction) gives
    the same numbers as the lengths."""
    table = upstream_table("alpaca-7b")
    as_stored = pd.DataFrame(
        {
            "instruction": [f"instruction {i}" for i in table["index"]],
            "output_1": ["o" * k for k in table["len_1"]],
            "output_2": ["p" * k for k in table["len_2"]],
            "generator_1": "gpt4_1106_preview",
            "generator_2": "alpaca-7b",
            "preference": table["preference"],
        }
    )
    assert alpaca_eval_scores(as_stored) == alpaca_eval_scores(table)


# --------------------------------------------------------------------------------------------------
# The LC by length_controlled_v1, with a df_gamed.csv-shaped fixture.


def test_lc_equals_alpaca_evals_own_call(glm, monkeypatch):
    """Rows in any order, three failed judge calls: the LC is alpaca_eval's on the judged rows."""
    table = synthetic_table(n=200, seed=1).sample(frac=1.0, random_state=2)
    failed = table.index[:3]
    table.loc[failed, "preference"] = np.nan
    scores = alpaca_eval_scores(table, DF_GAMED)
    assert (scores.n, scores.failed, scores.df_gamed, scores.lc_note) == (197, 3, str(DF_GAMED), "")
    assert scores.lc_minimal is None

    direct = alpaca_eval_direct(glm, monkeypatch, table.drop(failed), DF_GAMED)
    assert scores.length_controlled_winrate == pytest.approx(direct["length_controlled_winrate"], abs=0.01)
    assert scores.lc_standard_error == pytest.approx(direct["lc_standard_error"], abs=0.01)
    assert scores.win_rate == pytest.approx(direct["win_rate"], abs=0.01)
    assert scores.discrete_win_rate == pytest.approx(direct["discrete_win_rate"], abs=0.01)
    # The gamed baselines do weigh in: without them (lc_minimal) the number is another.
    minimal = alpaca_eval_scores(table).lc_minimal
    assert abs(minimal - scores.length_controlled_winrate) > 0.1


def test_a_genuine_win_keeps_its_lc(glm):
    """Raw about 0.9 and no length effect: the LC stays above 0.8, with and without df_gamed.csv."""
    scores = alpaca_eval_scores(synthetic_table(), DF_GAMED)
    assert scores.win_rate == pytest.approx(90, abs=2)
    assert scores.length_controlled_winrate > 80
    assert alpaca_eval_scores(synthetic_table()).lc_minimal > 80


def test_the_genuine_win_check_fails_if_the_cv_scorer_loses_its_weights(glm, monkeypatch):
    """What test_a_genuine_win_keeps_its_lc guards against: a cross-validation scorer that scores the
    duplicated 0/1 rows without the preferences as weights (as a scikit-learn that does not route them
    would) sees every row both won and lost, so every fold prefers the strongest penalty, the weights go
    to 0 and the LC to 0.5 for any policy."""
    monkeypatch.setattr(
        glm,
        "logloss_continuous",
        lambda y_true, y_pred, true_prob, true_sample_weight=None: glm.logloss(y_true, y_pred),
    )
    scores = alpaca_eval_scores(synthetic_table(), DF_GAMED)
    assert scores.win_rate > 85
    assert scores.length_controlled_winrate == pytest.approx(50, abs=1)
    assert alpaca_eval_scores(synthetic_table()).lc_minimal == pytest.approx(50, abs=1)


def test_an_always_longer_policy_under_a_length_preferring_judge_loses_its_lead(glm):
    """Always 800 characters longer, preferred for that alone as much as the gamed baselines' length is:
    the LC, regularised to the gamed baselines, falls well below the raw win rate. The minimal formula
    cannot tell the policy's term from its length term (the length difference never changes) and keeps
    the raw win rate: the issue's "a length-only win survives the LC"."""
    table = synthetic_table(pad=800)
    scores = alpaca_eval_scores(table, DF_GAMED)
    assert scores.win_rate > 80
    assert scores.length_controlled_winrate < scores.win_rate - 20
    assert alpaca_eval_scores(table).lc_minimal > scores.win_rate - 10


# --------------------------------------------------------------------------------------------------
# Too few prompts, where df_gamed.csv is found, bad input, side effects, pins.


def test_too_few_prompts_give_no_lc(glm):
    few = synthetic_table(n=10)
    scores = alpaca_eval_scores(few, DF_GAMED)
    assert scores.n == 10 and scores.win_rate > 0
    assert scores.length_controlled_winrate is None and scores.lc_minimal is None
    assert scores.lc_note == "too few prompts: n=10, the LC needs at least 50"
    assert alpaca_eval_scores(few, DF_GAMED, min_n=10).length_controlled_winrate is not None
    with pytest.raises(AlpacaEvalError, match="at least 5 prompts"):
        alpaca_eval_scores(few, min_n=4)


def test_df_gamed_is_found_in_the_hf_cache(glm, tmp_path):
    """Where a cluster's hf_hub_download put it: the hub cache's layout under alpaca_eval's cache folder."""
    repo = Path(glm.constants.DEFAULT_CACHE_DIR) / "datasets--tatsu-lab--alpaca_eval"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "df_gamed.csv").write_bytes(DF_GAMED.read_bytes())
    assert find_df_gamed() == (str(snapshot / "df_gamed.csv"), "")
    table = synthetic_table(n=60)
    from_cache = alpaca_eval_scores(table)
    assert from_cache.df_gamed == str(snapshot / "df_gamed.csv")
    assert (
        from_cache.length_controlled_winrate == alpaca_eval_scores(table, DF_GAMED).length_controlled_winrate
    )


def test_a_failed_download_falls_back_to_lc_minimal_and_says_why(glm, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    scores = alpaca_eval_scores(synthetic_table(n=60), download=True)
    assert scores.length_controlled_winrate is None and scores.lc_minimal is not None
    assert "could not be downloaded" in scores.lc_note


def test_bad_input_fails_in_one_line(glm, tmp_path):
    table = synthetic_table(n=60)
    cases = [
        (table.drop(columns="preference"), r"no `preference` column"),
        (table.assign(preference=3.0), r"60 preferences outside \[1, 2\]"),
        (table.assign(preference="yes"), r"not numbers"),
        (table.drop(columns="len_2"), r"needs `output_1` and `output_2`, or `len_1` and `len_2`"),
        (table.assign(len_2=np.nan), r"character counts"),
        (table.assign(index=0), r"an instruction twice"),
    ]
    for bad, message in cases:
        with pytest.raises(AlpacaEvalError, match=message) as caught:
            alpaca_eval_scores(bad, DF_GAMED)
        assert "\n" not in str(caught.value)
    with pytest.raises(AlpacaEvalError, match="df_gamed.csv not found at"):
        alpaca_eval_scores(table, tmp_path / "absent.csv")
    pd.read_csv(DF_GAMED).drop(columns="std_delta_len").to_csv(tmp_path / "short.csv", index=False)
    with pytest.raises(AlpacaEvalError, match=r"lacks the columns \['std_delta_len'\]"):
        alpaca_eval_scores(table, tmp_path / "short.csv")
    with pytest.raises(AlpacaEvalError, match=r"1 instructions have no difficulty .*index 200"):
        alpaca_eval_scores(table.assign(index=np.arange(141, 201)), DF_GAMED)


def test_a_call_leaves_sklearn_and_the_imports_as_they_were(glm):
    """alpaca_eval's fit turns sklearn's metadata routing on globally, and the pkg_resources stand-in that
    lets it import under setuptools without pkg_resources is not left for other imports to find."""
    assert not sklearn.get_config()["enable_metadata_routing"]
    table = synthetic_table(n=60)
    alpaca_eval_scores(table, DF_GAMED)
    assert not sklearn.get_config()["enable_metadata_routing"]
    # With routing left on, the quick protocol's LC would raise UnsetMetadataPassedError.
    assert 0 < length_controlled_win_rate(table["preference"] - 1, table["len_2"], table["len_1"]) < 1
    stand_in = sys.modules.get("pkg_resources")
    assert stand_in is None or hasattr(stand_in, "working_set"), "the pkg_resources stand-in leaked"


def test_the_pins_agree():
    """alpaca-eval as images/benchmarks.txt pins it, scikit-learn and patsy as pyproject.toml and the GPU
    image pin them, and those are what this venv runs."""
    from importlib.metadata import version

    benchmarks = (ROOT / "images" / "benchmarks.txt").read_text()
    assert re.search(r"^alpaca-eval==0\.6\.6 --hash=sha256:[0-9a-f]{64}$", benchmarks, re.M)
    assert version("alpaca-eval") == "0.6.6"
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    gpu = (ROOT / "images" / "gpu-constraints.txt").read_text().splitlines()
    for name in ("scikit-learn", "patsy"):
        (pin,) = [d for d in dependencies if re.match(rf"{name}\b", d)]
        assert pin.startswith(f"{name}=="), f"pyproject.toml: {pin} is not an exact pin"
        assert pin in gpu, f"pyproject.toml's {pin} is not the GPU image's"
        assert pin == f"{name}=={version(name)}", f"the venv runs {name} {version(name)}: run `make setup`"
