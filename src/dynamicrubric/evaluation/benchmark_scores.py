"""The benchmarks' numbers from the judge's verdicts: pairwise outcomes with the position swap, win rates
with 95% bootstrap intervals, AlpacaEval 2's length-controlled win rate, and checklist scores.

Pairwise judging asks the same question in both orders ("is response A better than response B?", the
policy's answer first, then second). A verdict is the judge's P(yes) > 0.5; the policy wins a prompt when
both orders say so, loses when both say the other answer is better, and a split (a judge that prefers a
position, say) is a tie, counted half. A prompt with a failed judge call has no outcome (NaN): it is
counted as failed and left out, never a loss or a win.

AlpacaEval 2's length-controlled win rate (Dubois et al. 2024, `alpaca_eval.metrics.glm_winrate`) fits a
logistic GLM of the preference on the model's term and tanh of the standardised length difference, and
predicts the preference with the length difference set to 0. Reproduced: that formula, L1-regularised
logistic regression without a separate intercept (liblinear, C chosen by 5-fold grouped cross-validation
on the prompts, or C=100 where there are too few prompts to fold, as AlpacaEval does with n_splits=0),
the continuous preference fitted through a duplicated, weighted sample. Not reproduced: the
instruction-difficulty term and the regularisation towards the gamed baselines, whose data AlpacaEval
downloads from its hub (nothing here is downloaded); with them the number would differ somewhat.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

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
    import warnings

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
