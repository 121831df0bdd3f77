"""The benchmarks' numbers from the judge's verdicts: pairwise outcomes with the position swap, win rates
with 95% bootstrap intervals, a length-controlled win rate, checklist scores, and AlpacaEval 2's official
numbers computed by alpaca_eval itself.

Pairwise judging asks the same question in both orders ("is response A better than response B?", the
policy's answer first, then second). A verdict is the judge's P(yes) > 0.5; the policy wins a prompt when
both orders say so, loses when both say the other answer is better, and a split (a judge that prefers a
position, say) is a tie, counted half. A prompt with a failed judge call has no outcome (NaN): it is
counted as failed and left out, never a loss or a win.

`length_controlled_win_rate` (the quick protocol's LC) fits a logistic GLM of the preference on the
model's term and tanh of the standardised length difference, and predicts the preference with the length
difference set to 0: that is alpaca_eval's `length_controlled_minimal` (L1-regularised logistic regression
without a separate intercept, liblinear, C chosen by 5-fold grouped cross-validation on the prompts, or
C=100 where there are too few prompts to fold, the continuous preference fitted through a duplicated,
weighted sample). It is not AlpacaEval 2's LC: that one (`length_controlled_v1`) adds the instruction's
difficulty and regularises towards the gamed baselines, and on upstream's published annotations the two
differ several-fold (gpt-3.5-turbo-1106: 37.8 against the leaderboard's 19.3).

`alpaca_eval_scores` is the official protocol's scorer (AlpacaEval 2, its leaderboard's numbers): from a
table in the shape alpaca_eval stores its annotations, it calls the alpaca-eval package itself (pinned in
images/benchmarks.txt) for the weighted and discrete win rates and for the LC, so none of its formulas is
retyped here.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import io
import logging
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

log = logging.getLogger(__name__)

BOOTSTRAP_RESAMPLES = 1000


def pairwise_outcomes(policy_first: np.ndarray, policy_second: np.ndarray) -> np.ndarray:
    """Per prompt: 1 (win), 0.5 (tie or split), 0 (loss), NaN (a failed call). `policy_first` is P(yes)
    to "is A better than B?" with the policy's answer as A; `policy_second` with the policy's answer as B,
    so a yes there is a vote for the other answer."""
    first, second = np.asarray(policy_first, float), np.asarray(policy_second, float)
    votes_first = np.sign(first - 0.5)  # +1: the policy's answer is better
    votes_second = -np.sign(second - 0.5)
    outcome = (votes_first + votes_second) / 4 + 0.5  # both for: 1, both against: 0, otherwise 0.5
    return np.where(np.isnan(first) | np.isnan(second), np.nan, outcome)


def bootstrap_interval(values: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the mean of `values` (NaN left out), resampling units."""
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return (np.nan, np.nan)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(BOOTSTRAP_RESAMPLES, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def length_controlled_win_rate(
    outcomes: np.ndarray, policy_chars: np.ndarray, baseline_chars: np.ndarray
) -> float:
    """AlpacaEval 2's length-controlled win rate of the policy over the baseline (see the module
    docstring), in [0, 1]; NaN without a judged prompt. Failed prompts (NaN outcome) are left out."""
    outcomes = np.asarray(outcomes, float)
    keep = ~np.isnan(outcomes)
    y = outcomes[keep]
    if len(y) == 0:
        return float("nan")
    delta = (np.asarray(policy_chars, float) - np.asarray(baseline_chars, float))[keep]
    spread = delta.std(ddof=1) if len(delta) > 1 else 0.0
    length_term = np.tanh(delta / spread) if spread > 0 else np.zeros_like(delta)
    features = np.column_stack([np.ones_like(y), length_term])  # the model's term, the length term
    model = _fit_preference(features, y)
    no_length = np.column_stack([np.ones_like(y), np.zeros_like(y)])
    return float(model.predict_proba(no_length)[:, 1].mean())


def _fit_preference(features: np.ndarray, preference: np.ndarray):
    """AlpacaEval's fit of a continuous preference: each prompt twice, labelled 1 with weight p and 0 with
    weight 1 − p; L1 logistic regression without an intercept, C by grouped 5-fold CV where possible."""
    from sklearn.linear_model import LogisticRegression, LogisticRegressionCV
    from sklearn.model_selection import GroupKFold

    n = len(preference)
    x = np.concatenate([features, features])
    y = np.concatenate([np.ones(n), np.zeros(n)])
    weight = np.concatenate([preference, 1 - preference])
    groups = np.concatenate([np.arange(n), np.arange(n)])
    kwargs = dict(penalty="l1", solver="liblinear", fit_intercept=False, random_state=123)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # liblinear's convergence chatter on a handful of prompts
        if n >= 10 and 0 < preference.mean() < 1:
            folds = list(GroupKFold(n_splits=5).split(x, y, groups))
            model = LogisticRegressionCV(cv=folds, scoring="neg_log_loss", **kwargs)
        else:
            model = LogisticRegression(C=100, **kwargs)
        model.fit(x, y, sample_weight=weight)
    return model


def pairwise_summary(outcomes: np.ndarray, seed: int) -> dict[str, float]:
    """win_rate (ties half) with its 95% interval, the counts of wins, ties and losses, judged prompts
    (`n`) and failed ones."""
    outcomes = np.asarray(outcomes, float)
    judged = outcomes[~np.isnan(outcomes)]
    low, high = bootstrap_interval(judged, seed)
    return {
        "win_rate": float(judged.mean()) if len(judged) else float("nan"),
        "win_rate_lo": low,
        "win_rate_hi": high,
        "wins": float((judged == 1).sum()),
        "ties": float((judged == 0.5).sum()),
        "losses": float((judged == 0).sum()),
        "n": float(len(judged)),
        "failed": float(np.isnan(outcomes).sum()),
    }


def checklist_scores(verdicts: pd.DataFrame) -> pd.Series:
    """Per prompt, the mean P(yes) over its criteria (`verdicts`: prompt id, p_yes); a prompt with a
    failed criterion has no score (NaN), never a partial one."""
    grouped = verdicts.groupby("id", sort=False)["p_yes"]
    return grouped.mean().where(~grouped.apply(lambda p: p.isna().any()))


# --------------------------------------------------------------------------------------------------
# AlpacaEval 2, official: alpaca_eval's own metrics on an annotations table.

ALPACA_EVAL_MIN_N = 50  # below this many judged prompts the LC's regression is not a number
GAMED_REPO, GAMED_FILE = "tatsu-lab/alpaca_eval", "df_gamed.csv"
# What alpaca_eval 0.6.6 reads from df_gamed.csv (metrics/glm_winrate.py, _get_featurized_data): it drops
# `model`, takes each instruction's difficulty by `index` and fits the gamed baselines' rows (preference in
# [0, 1], std_delta_len, not_gamed_baseline False) beside the policy's.
GAMED_COLUMNS = (
    "model",
    "index",
    "instruction_difficulty",
    "preference",
    "std_delta_len",
    "not_gamed_baseline",
)
LACKS_GAMED = (
    "lc_minimal, not AlpacaEval 2's LC: without df_gamed.csv (tatsu-lab/alpaca_eval on the HF hub) it lacks "
    "the instruction-difficulty term and the regularisation to the gamed baselines"
)
# alpaca_eval's GLM is fitted under a module-wide patch (_df_gamed_from) and a global sklearn setting.
_GLM_LOCK = threading.Lock()


class AlpacaEvalError(ValueError):
    """An annotations table or a df_gamed.csv that alpaca_eval's metrics cannot score, in one line."""


@dataclasses.dataclass(frozen=True)
class AlpacaEvalScores:
    """AlpacaEval 2's numbers, in percent (0-100) as alpaca_eval and its leaderboard report them.

    `length_controlled_winrate` is AlpacaEval 2's LC (`length_controlled_v1`) and is set only where
    df_gamed.csv was at hand; without it the same regression minus what it lacks is `lc_minimal`, never the
    LC. `lc_note` says why there is no LC ("" when there is one): what lc_minimal lacks, or too few prompts.
    """

    win_rate: float  # mean(preference - 1) x 100
    standard_error: float  # its standard error of the mean
    discrete_win_rate: float  # each preference rounded to a win, a loss or a draw (half)
    n: int  # judged prompts
    failed: int  # prompts without a preference (a failed judge call): left out, never a loss
    length_controlled_winrate: float | None
    lc_standard_error: float | None
    lc_minimal: float | None
    lc_note: str
    df_gamed: str | None  # the df_gamed.csv the LC used

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def alpaca_eval_scores(
    annotations: pd.DataFrame,
    df_gamed: str | Path | None = None,
    *,
    min_n: int = ALPACA_EVAL_MIN_N,
    download: bool = False,
) -> AlpacaEvalScores:
    """AlpacaEval 2's weighted win rate (with its standard error), discrete win rate and LC, computed by
    the installed alpaca-eval package (`metrics.get_winrate`, `metrics.glm_winrate.
    get_length_controlled_winrate`) from `annotations`, a table in the shape alpaca_eval stores
    (upstream's `results/<model>/<annotator>/annotations.json` read into a DataFrame works as it is):

    - `preference`: continuous in [1, 2] (2: the policy's output, `output_2`, is preferred; 0 or 1.5 a
      draw), NaN for a failed judge call (counted in `failed`, left out);
    - the two outputs, `output_1` (the baseline's) and `output_2` (the policy's), or their lengths in
      characters, `len_1` and `len_2`;
    - the instruction's position in AlpacaEval's 805 as `index`, or else the table's own index, as
      alpaca_eval takes it (it looks the instruction's difficulty up by it).

    df_gamed.csv (the gamed baselines and the instructions' difficulty): `df_gamed` if given, else the HF
    cache, else (with `download`) the hub. Without it, `lc_minimal` with `lc_note` saying what it lacks.
    Below `min_n` judged prompts there is no LC of either kind, and `lc_note` says "too few prompts".
    """
    if min_n < 5:
        raise AlpacaEvalError(
            f"min_n={min_n}: the LC's 5-fold grouped cross-validation needs at least 5 prompts"
        )
    frame = _alpaca_eval_frame(annotations)
    judged = frame[frame["preference"].notna()]
    failed = len(frame) - len(judged)
    glm = alpaca_eval_metrics()
    if len(judged) < min_n:
        raw = glm.get_winrate(judged)
        note = f"too few prompts: n={len(judged)}, the LC needs at least {min_n}"
        return _scores(raw, len(judged), failed, lc=None, minimal=None, note=note, gamed=None)

    gamed_path, missing = find_df_gamed(df_gamed, download=download)
    if gamed_path is None and (judged["output_1"].str.len() == judged["output_2"].str.len()).all():
        # The minimal formula divides each length difference by their spread: 0/0, and its fit fails on NaN
        # (with df_gamed.csv the gamed baselines' rows give the spread).
        raw = glm.get_winrate(judged)
        note = "every pair's two outputs have the same length: lc_minimal's length term is 0/0"
        log.warning("AlpacaEval 2: no LC: %s", note)
        return _scores(raw, len(judged), failed, lc=None, minimal=None, note=note, gamed=None)
    if gamed_path is None:
        log.warning("AlpacaEval 2: %s (%s)", LACKS_GAMED, missing)
        # alpaca_eval reads df_gamed.csv even for the minimal formula, which uses none of it but the
        # difficulty lookup (_get_featurized_data, by the row label of each index's first row): a table of
        # zeros, one row per position up to the largest, stands in for that lookup.
        positions = np.arange(judged.index.max() + 1)
        stand_in = pd.DataFrame({"model": "none", "index": positions, "instruction_difficulty": 0.0})
        out = _length_controlled(
            glm, judged, "length_controlled_minimal", io.StringIO(stand_in.to_csv(index=False))
        )
        note = f"{LACKS_GAMED}; {missing}"
        return _scores(out, len(judged), failed, lc=None, minimal=out, note=note, gamed=None)

    _check_df_gamed(gamed_path, judged.index)
    out = _length_controlled(glm, judged, "length_controlled_v1", gamed_path)
    return _scores(out, len(judged), failed, lc=out, minimal=None, note="", gamed=gamed_path)


def find_df_gamed(path: str | Path | None = None, download: bool = False) -> tuple[str | None, str]:
    """Where df_gamed.csv is: `path` (which must exist), else alpaca_eval's HF cache, else (with `download`)
    fetched from the hub as alpaca_eval fetches it. Returns (the path, "") or (None, why there is none)."""
    if path is not None:
        if not Path(path).is_file():
            raise AlpacaEvalError(f"df_gamed.csv not found at {path}")
        return str(path), ""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    constants = alpaca_eval_metrics().constants  # its cache folder, None for the HF default
    cached = try_to_load_from_cache(
        GAMED_REPO, GAMED_FILE, cache_dir=constants.DEFAULT_CACHE_DIR, repo_type="dataset"
    )
    if isinstance(cached, str):  # else None or a "known missing" sentinel
        return cached, ""
    if not download:
        return None, "it is not in the HF cache, and no path was given"
    try:
        return hf_hub_download(
            GAMED_REPO, GAMED_FILE, repo_type="dataset", cache_dir=constants.DEFAULT_CACHE_DIR
        ), ""
    except Exception as exc:  # offline, or the hub refused: the fallback is reported, not raised
        return None, f"it could not be downloaded ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"


def _alpaca_eval_frame(annotations: pd.DataFrame) -> pd.DataFrame:
    """The columns alpaca_eval's GLM reads (preference, output_1, output_2, generator_1, generator_2), one
    row per instruction, indexed by the instruction's position (alpaca_eval's `reset_index` gives `index`)."""
    columns = set(annotations.columns)
    if "preference" not in columns:
        raise AlpacaEvalError("the annotations table has no `preference` column")
    ids = pd.Series(annotations["index"] if "index" in columns else annotations.index)
    odd = ids if not pd.api.types.is_integer_dtype(ids) else ids[ids < 0]
    if len(odd):
        raise AlpacaEvalError(
            "the instruction ids (`index`, or the table's index) must be positions in AlpacaEval's 805, "
            f"integers from 0; got {odd.iloc[0]!r}"
        )
    if ids.duplicated().any():
        raise AlpacaEvalError("the annotations table has an instruction twice (`index` or the table's index)")
    preference = pd.to_numeric(annotations["preference"], errors="coerce").astype(float)
    if preference.isna().sum() != annotations["preference"].isna().sum():
        raise AlpacaEvalError("the annotations' `preference` has values that are not numbers")
    bad = preference.notna() & ~preference.between(1, 2) & (preference != 0)
    if bad.any():
        raise AlpacaEvalError(
            f"{int(bad.sum())} preferences outside [1, 2] (0 is a draw), e.g. {preference[bad].iloc[0]!r}"
        )
    if {"output_1", "output_2"} <= columns:
        outputs = [annotations[c].astype(str).to_numpy() for c in ("output_1", "output_2")]
    elif {"len_1", "len_2"} <= columns:
        lengths = [pd.to_numeric(annotations[c], errors="coerce") for c in ("len_1", "len_2")]
        if any(length.isna().any() or (length < 0).any() for length in lengths):
            raise AlpacaEvalError("the annotations' `len_1`/`len_2` must be character counts, none missing")
        # alpaca_eval measures `output.str.len()`: strings of those lengths give it the same numbers.
        outputs = [np.array(["x" * int(k) for k in length]) for length in lengths]
    else:
        raise AlpacaEvalError("the annotations table needs `output_1` and `output_2`, or `len_1` and `len_2`")
    return pd.DataFrame(
        {
            "preference": preference.to_numpy(),
            "output_1": outputs[0],
            "output_2": outputs[1],
            "generator_1": "baseline",
            "generator_2": "policy",
        },
        index=pd.Index(ids.to_numpy()),
    )


def _check_df_gamed(path: str, ids: pd.Index) -> None:
    """A df_gamed.csv alpaca_eval can read, with a difficulty for every instruction being scored."""
    gamed = pd.read_csv(path)
    lacking = [c for c in GAMED_COLUMNS if c not in gamed.columns]
    if lacking:
        raise AlpacaEvalError(f"{path} is not df_gamed.csv: it lacks the columns {lacking}")
    # alpaca_eval looks each difficulty up by the row label of the first row with that index.
    difficulty = gamed.drop_duplicates("index")["instruction_difficulty"]
    unknown = sorted(set(ids) - set(difficulty.index))
    if unknown:
        raise AlpacaEvalError(
            f"{len(unknown)} instructions have no difficulty in {path} (e.g. index {unknown[0]}): `index` must be "
            "the instruction's position in AlpacaEval's 805"
        )


def _length_controlled(glm: types.ModuleType, judged: pd.DataFrame, glm_name: str, gamed: Any) -> dict:
    """alpaca_eval's get_length_controlled_winrate on `judged`, reading `gamed` as its df_gamed.csv."""
    import sklearn

    # config_context restores the global sklearn config that alpaca_eval's fit_LogisticRegressionCV sets
    # (enable_metadata_routing=True): left on, every later fit with sample weights and a plain scorer in
    # the process, length_controlled_win_rate's included, raises UnsetMetadataPassedError.
    with _GLM_LOCK, sklearn.config_context(), _df_gamed_from(glm, gamed), warnings.catch_warnings():
        # sklearn 1.9 warns on every fit that `penalty` and the CV's fitted attributes change in 1.10
        # (which is why scikit-learn is pinned): noise here, nothing the caller can act on.
        warnings.simplefilter("ignore", FutureWarning)
        return glm.get_length_controlled_winrate(
            judged, glm_name=glm_name, save_weights_dir=None, is_add_glm_preference_inplace=False
        )


@contextmanager
def _df_gamed_from(glm: types.ModuleType, source: Any) -> Iterator[None]:
    """alpaca_eval 0.6.6 takes no path for df_gamed.csv: glm_winrate._get_featurized_data always calls
    `hf_hub_download(repo_id="tatsu-lab/alpaca_eval", filename="df_gamed.csv", ...)` and reads what it
    returns with pd.read_csv. For the call that name answers with `source`; nothing is downloaded."""

    def answer(repo_id: str, filename: str, **_: Any) -> Any:
        if (repo_id, filename) != (GAMED_REPO, GAMED_FILE):
            raise AlpacaEvalError(f"alpaca_eval asked for {repo_id}/{filename}, which is not passed in")
        if isinstance(source, io.StringIO):
            source.seek(0)
        return source

    original = glm.hf_hub_download
    glm.hf_hub_download = answer
    try:
        yield
    finally:
        glm.hf_hub_download = original


def _scores(
    raw: dict, n: int, failed: int, lc: dict | None, minimal: dict | None, note: str, gamed: str | None
) -> AlpacaEvalScores:
    def number(value: Any) -> float:
        return float(value) if value is not None else float("nan")

    return AlpacaEvalScores(
        win_rate=number(raw.get("win_rate")),
        standard_error=number(raw.get("standard_error")),
        discrete_win_rate=number(raw.get("discrete_win_rate")),
        n=n,
        failed=failed,
        length_controlled_winrate=number(lc["length_controlled_winrate"]) if lc else None,
        lc_standard_error=number(lc["lc_standard_error"]) if lc else None,
        lc_minimal=number(minimal["length_controlled_winrate"]) if minimal else None,
        lc_note=note,
        df_gamed=gamed,
    )


def alpaca_eval_metrics() -> types.ModuleType:
    """alpaca_eval.metrics.glm_winrate (which also holds get_winrate and alpaca_eval's constants), imported
    the way this module imports it.

    alpaca_eval 0.6.6's utils.py imports pkg_resources at its top (for parse_version and get_distribution,
    used by functions the metrics never call), and the setuptools of the CPU image and `make setup` (84.2.1)
    no longer ships it. Where it is missing, a module with those two functions stands in while alpaca_eval
    is first imported, and is removed again so that no other import sees it. Importing alpaca_eval also
    runs python-dotenv's load_dotenv() (its __init__.py): a .env file in the working folder is read into
    the environment, without overriding what is set."""
    if "alpaca_eval" not in sys.modules and importlib.util.find_spec("pkg_resources") is None:
        from packaging.version import parse

        shim = types.ModuleType("pkg_resources")
        shim.parse_version = parse  # type: ignore[attr-defined]
        shim.get_distribution = lambda name: types.SimpleNamespace(version=importlib.metadata.version(name))  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = shim
        try:
            _import_glm()
        finally:
            sys.modules.pop("pkg_resources", None)
    return _import_glm()


def _import_glm() -> types.ModuleType:
    try:
        import alpaca_eval.metrics.glm_winrate as glm
    except ModuleNotFoundError as exc:
        raise AlpacaEvalError(
            f"alpaca-eval is not installed ({exc}): pip install --no-deps --require-hashes -r images/benchmarks.txt "
            "(make setup does)"
        ) from None
    return glm
