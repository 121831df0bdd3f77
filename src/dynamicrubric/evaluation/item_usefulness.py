"""Per-item usefulness: which rubric items of a round tell its responses apart, and agree with gold.

For diagnosis and export only, never to reweight a rubric: reweighting items by a usefulness score
did worse than leaving them alone (Rubric Dropout, arXiv 2608.11669).

One row per rubric item (prompt_id, rubric_idx, item_idx) of one round. A rubric is written for one
candidate set, the K rollouts of its prompt, and every item is judged on each of them. With v_mk the
item's verdict on response k (p_yes when soft, else the hard verdict) and w_m its weight:

    pass_rate       mean_k v_mk over the responses whose verdict did not fail
    splits          some response gets a yes and another a no (the hard verdict, also when soft)
    variance_share  w_m·Cov_k(v_m, S) / Var_k(S), with S_k = Σ_m' w_m'·v_m'k
                    = Σ_m' w_m w_m' Cov(v_m, v_m') / (W² Var(s)) for the score s = S / W;
                    sums to 1 over a rubric's items; NaN when the score does not vary
    gold_pairs      response pairs (k, l) of the set whose gold differs (both verdicts valid)
    gold_agreement  mean over those pairs of 1 when v_mk − v_ml has the sign of gold_k − gold_l,
                    0.5 when the item ties them, 0 when it is opposite; NaN without gold pairs
    recurrence      how many rubrics of the round hold an item with the same normalised text
    useful          splits, and gold_agreement > 0.5 where there are gold pairs (without gold,
                    splitting is enough)

A verdict the verifier could not score (p_yes NaN in the judgments, whatever `verdict` says) is a
failed verdict, never a no: it is left out of every measure and counted in `num_failed`. The score
variance is taken over the responses with no failed verdict on any item of the rubric, since a score
with a missing verdict is undefined. An item's share is negative when it pulls against the rest of
its rubric (its verdicts anti-correlate with the score).

`splits` uses the hard verdicts because soft ones (p_yes) almost always differ a little between
responses: a soft pass rate strictly between 0 and 1 would call nearly every item splitting. With
hard verdicts `splits` is exactly 0 < pass_rate < 1.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dynamicrubric import store
from dynamicrubric.infra import tracking
from dynamicrubric.infra.artifacts import read_artifact, write_artifact
from dynamicrubric.scoring.aggregate import TIE_TOLERANCE

__all__ = [
    "ITEMS_OUTPUT",
    "ItemUsefulnessError",
    "export_items",
    "find_items_artifact",
    "item_usefulness",
    "normalise_text",
    "summarise",
]

KEYS = ["prompt_id", "rubric_idx", "item_idx"]
# The name the evaluate stage gives its item_usefulness output: the export finds the artifact by it.
ITEMS_OUTPUT = "items"
# A score variance at or below this is none: scores closer than TIE_TOLERANCE tie (aggregate.py), and
# soft scores that are equal in exact arithmetic leave ~1e-32 of rounding after centring.
VARIANCE_TOLERANCE = TIE_TOLERANCE**2

COLUMNS = {
    "round": "int32",
    "prompt_id": "object",
    "rubric_idx": "int32",
    "item_idx": "int32",
    "text": "object",
    "weight": "int8",
    "num_responses": "int32",
    "num_failed": "int32",
    "pass_rate": "float64",
    "splits": "bool",
    "variance_share": "float64",
    "gold_pairs": "int32",
    "gold_agreement": "float64",
    "recurrence": "int32",
    "useful": "bool",
}


class ItemUsefulnessError(ValueError):
    """Inputs that would give a wrong number, or an export that cannot be made; names the key or run."""


# --------------------------------------------------------------------------------------------------
# The measures
# --------------------------------------------------------------------------------------------------


def item_usefulness(
    rubrics: pd.DataFrame,
    judgments: pd.DataFrame,
    rollouts: pd.DataFrame,
    gold: pd.DataFrame | None,
    *,
    soft: bool,
    round_idx: int,
) -> pd.DataFrame:
    """The `item_usefulness` table of one round: one row per rubric item (see the module's docstring).

    Frames need only the columns used: rubrics (prompt_id, rubric_idx, items=[{text, weight}]),
    judgments (prompt_id, rubric_idx, item_idx, sample_idx, weight, verdict, p_yes), rollouts
    (prompt_id, sample_idx): the candidate sets, and gold (prompt_id, sample_idx, gold) where a higher
    gold is better (a checker's score; a NaN gold is no gold). Every item must be judged on every
    rollout of its prompt, once, with its rubric's weight: anything else raises ItemUsefulnessError
    naming the key.

    `useful` is splitting and gold_agreement > 0.5 where the item has gold pairs; where it has none
    (no gold, or gold that ties every pair) splitting is enough.
    """
    items = _rubric_items(rubrics)
    if items.empty:
        return _empty()
    verdicts = _verdicts(items, judgments, rollouts, soft)
    per_item = verdicts.groupby(KEYS, sort=False)
    measures = pd.DataFrame(
        {
            "num_responses": per_item.size(),
            "num_failed": per_item["failed"].sum(),
            "pass_rate": per_item["v"].mean(),  # NaN verdicts are skipped: a failed verdict is no 0
            "splits": (per_item["hard"].max() == 1) & (per_item["hard"].min() == 0),
        }
    )
    frame = items.join(measures, on=KEYS)
    frame = frame.join(_variance_shares(verdicts), on=KEYS)
    frame = frame.join(_gold_agreement(verdicts, gold), on=KEYS)
    frame["gold_pairs"] = frame["gold_pairs"].fillna(0)
    frame["recurrence"] = _recurrence(frame)
    frame["useful"] = frame["splits"] & ((frame["gold_pairs"] == 0) | (frame["gold_agreement"] > 0.5))
    frame["round"] = round_idx
    return frame[list(COLUMNS)].astype(COLUMNS).reset_index(drop=True)


def normalise_text(text: str) -> str:
    """An item's text as recurrence compares it: lower case, runs of whitespace as one space, and
    punctuation stripped from both ends ("- Cites a source." and "cites a  source" are one item)."""
    text = re.sub(r"\s+", " ", text.lower()).strip()
    start, end = 0, len(text)
    while start < end and _strippable(text[start]):
        start += 1
    while end > start and _strippable(text[end - 1]):
        end -= 1
    return text[start:end]


def summarise(frame: pd.DataFrame) -> dict[str, float]:
    """The round's numbers for MLflow: items, useful_share, mean_pass_rate, non_splitting_share,
    mean_gold_agreement (over items with gold pairs) and mean_recurrence. A number with nothing to
    average over (no items, no gold pairs) is left out rather than logged as NaN."""
    summary: dict[str, float] = {"items": float(len(frame))}
    if frame.empty:
        return summary
    summary["useful_share"] = float(frame["useful"].mean())
    summary["non_splitting_share"] = float((~frame["splits"]).mean())
    summary["mean_recurrence"] = float(frame["recurrence"].mean())
    for name, column in (("mean_pass_rate", "pass_rate"), ("mean_gold_agreement", "gold_agreement")):
        values = frame[column].dropna()
        if len(values):
            summary[name] = float(values.mean())
    return summary


def _strippable(char: str) -> bool:
    return char.isspace() or unicodedata.category(char).startswith("P")


def _empty() -> pd.DataFrame:
    return pd.DataFrame({name: pd.Series(dtype=dtype) for name, dtype in COLUMNS.items()})


def _rubric_items(rubrics: pd.DataFrame) -> pd.DataFrame:
    """One row per item: prompt_id, rubric_idx, item_idx (its place in the rubric), text, weight."""
    duplicated = rubrics.duplicated(["prompt_id", "rubric_idx"])
    if duplicated.any():
        row = rubrics[duplicated].iloc[0]
        raise ItemUsefulnessError(
            f"rubrics: (prompt_id={row['prompt_id']!r}, rubric_idx={row['rubric_idx']}) appears twice"
        )
    rows = [
        (prompt_id, int(rubric_idx), item_idx, item["text"], int(item["weight"]))
        for prompt_id, rubric_idx, rubric_items in zip(
            rubrics["prompt_id"], rubrics["rubric_idx"], rubrics["items"], strict=True
        )
        for item_idx, item in enumerate(rubric_items)
    ]
    return pd.DataFrame(rows, columns=[*KEYS, "text", "weight"])


def _verdicts(
    items: pd.DataFrame, judgments: pd.DataFrame, rollouts: pd.DataFrame, soft: bool
) -> pd.DataFrame:
    """One row per (item, response of its set) with its weight, v (NaN when failed), the hard verdict
    (NaN when failed) and `failed`; refuses judging that is incomplete, duplicated or for unknown keys."""
    sets = rollouts[["prompt_id", "sample_idx"]]
    if sets.duplicated().any():
        row = sets[sets.duplicated()].iloc[0]
        raise ItemUsefulnessError(
            f"rollouts: (prompt_id={row['prompt_id']!r}, sample_idx={row['sample_idx']}) appears twice"
        )
    unset = ~items["prompt_id"].isin(sets["prompt_id"])
    if unset.any():
        raise ItemUsefulnessError(
            f"rubrics: prompt_id={items.loc[unset, 'prompt_id'].iloc[0]!r} has no rollouts to judge"
        )
    keys = [*KEYS, "sample_idx"]
    judged = judgments[[*keys, "weight", "verdict", "p_yes"]]
    if judged.duplicated(keys).any():
        row = judged[judged.duplicated(keys)].iloc[0]
        raise ItemUsefulnessError(f"judgments: {_key(row, keys)} is judged twice")
    grid = items[[*KEYS, "weight"]].merge(sets, on="prompt_id")
    merged = grid.merge(judged, on=keys, how="outer", suffixes=("", "_judged"), indicator=True)
    for side, problem in (
        ("left_only", "has no judgment: every item is judged on every rollout of its prompt"),
        ("right_only", "is judged but is not an item of the rubrics and a rollout of its prompt"),
    ):
        stray = merged[merged["_merge"] == side]
        if len(stray):
            raise ItemUsefulnessError(f"judgments: {_key(stray.iloc[0], keys)} {problem}")
    differs = merged["weight"] != merged["weight_judged"]
    if differs.any():
        row = merged[differs].iloc[0]
        raise ItemUsefulnessError(
            f"judgments: {_key(row, keys)} has weight {int(row['weight_judged'])}, "
            f"its rubric says {int(row['weight'])}"
        )
    p_yes = merged["p_yes"].astype(np.float64)
    failed = np.isnan(p_yes)  # the judge's mark of a verdict it could not score
    hard = merged["verdict"].astype(np.float64).where(~failed)
    return pd.DataFrame(
        {
            **{k: merged[k] for k in keys},
            "weight": merged["weight"].astype(np.float64),
            "v": p_yes if soft else hard,
            "hard": hard,
            "failed": failed,
        }
    )


def _key(row: pd.Series, keys: list[str]) -> str:
    # numpy scalars repr as np.int64(0): name the key as a reader would write it
    plain = {k: row[k].item() if isinstance(row[k], np.generic) else row[k] for k in keys}
    return "(" + ", ".join(f"{k}={v!r}" for k, v in plain.items()) + ")"


def _variance_shares(verdicts: pd.DataFrame) -> pd.Series:
    """Each item's share of its rubric's score variance, over the responses with no failed verdict
    in the rubric: w_m·Cov(v_m, S) / Var(S), population moments (the normalisation cancels)."""
    rubric, response = ["prompt_id", "rubric_idx"], ["prompt_id", "rubric_idx", "sample_idx"]
    complete = ~verdicts.groupby(response)["failed"].transform("any")
    v = verdicts[complete].copy()
    if v.empty:
        return pd.Series(
            dtype="float64", index=pd.MultiIndex.from_tuples([], names=KEYS), name="variance_share"
        )
    v["wv"] = v["weight"] * v["v"]
    v["S"] = v.groupby(response)["wv"].transform("sum")
    v["dS"] = v["S"] - v.groupby(KEYS)["S"].transform("mean")
    v["dv"] = v["v"] - v.groupby(KEYS)["v"].transform("mean")
    v["cov"] = v["dv"] * v["dS"]
    v["var"] = v["dS"] * v["dS"]
    per_item = v.groupby(KEYS).agg(cov=("cov", "mean"), var=("var", "mean"), weight=("weight", "first"))
    weight_total = verdicts.drop_duplicates(KEYS).groupby(rubric)["weight"].sum().rename("weight_total")
    per_item = per_item.join(weight_total, on=rubric)
    # Var(s) = Var(S) / W²: the tolerance is on the score, which lies in 0..1
    varies = per_item["var"] / per_item["weight_total"] ** 2 > VARIANCE_TOLERANCE
    share = (per_item["weight"] * per_item["cov"] / per_item["var"]).where(varies)
    return share.rename("variance_share")


def _gold_agreement(verdicts: pd.DataFrame, gold: pd.DataFrame | None) -> pd.DataFrame:
    """Per item: gold_pairs (pairs of its set with different gold and valid verdicts) and
    gold_agreement (1 / 0.5 / 0 per pair as the verdict difference has the gold's sign, ties, or not)."""
    empty = pd.DataFrame(
        {"gold_pairs": pd.Series(dtype="int64"), "gold_agreement": pd.Series(dtype="float64")},
        index=pd.MultiIndex.from_tuples([], names=KEYS),
    )
    if gold is None or gold.empty:
        return empty
    scored = gold[["prompt_id", "sample_idx", "gold"]].dropna(subset=["gold"])
    if scored.duplicated(["prompt_id", "sample_idx"]).any():
        row = scored[scored.duplicated(["prompt_id", "sample_idx"])].iloc[0]
        raise ItemUsefulnessError(
            f"gold: (prompt_id={row['prompt_id']!r}, sample_idx={row['sample_idx']}) appears twice"
        )
    valid = verdicts[~verdicts["failed"]].merge(scored, on=["prompt_id", "sample_idx"])
    side = valid[[*KEYS, "sample_idx", "v", "gold"]]
    pairs = side.merge(side, on=KEYS, suffixes=("_a", "_b"))
    pairs = pairs[pairs["sample_idx_a"] < pairs["sample_idx_b"]]
    gold_diff = pairs["gold_a"] - pairs["gold_b"]
    pairs = pairs[gold_diff.abs() > TIE_TOLERANCE]
    if pairs.empty:
        return empty
    gold_diff = pairs["gold_a"] - pairs["gold_b"]
    verdict_diff = pairs["v_a"] - pairs["v_b"]
    agreement = np.where(
        verdict_diff.abs() <= TIE_TOLERANCE, 0.5, (np.sign(verdict_diff) == np.sign(gold_diff)).astype(float)
    )
    per_item = pairs[KEYS].assign(agreement=agreement).groupby(KEYS)["agreement"]
    return pd.DataFrame({"gold_pairs": per_item.size(), "gold_agreement": per_item.mean()})


def _recurrence(frame: pd.DataFrame) -> pd.Series:
    """How many rubrics (prompt_id, rubric_idx) of the frame hold an item of the row's normalised text."""
    normalised = frame["text"].map(normalise_text)
    rubric = frame["prompt_id"].astype(str) + "\0" + frame["rubric_idx"].astype(str)
    return rubric.groupby(normalised).transform("nunique")


# --------------------------------------------------------------------------------------------------
# The export: a round's useful items, found through MLflow
# --------------------------------------------------------------------------------------------------

EXPORT_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True)
class ItemsArtifact:
    """A round's item_usefulness artifact as its evaluate run logged it."""

    uri: str
    pipeline_run_id: str
    evaluate_run_id: str


def export_format(out: str) -> str:
    """The export's format by the file's extension, "jsonl" or "parquet"; any other is refused before
    MLflow is opened."""
    suffix = "." + out.rsplit(".", 1)[-1].lower() if "." in out.rsplit("/", 1)[-1] else ""
    if suffix not in EXPORT_FORMATS:
        raise ItemUsefulnessError(
            f"--out {out}: expected a .jsonl or .parquet file, found {suffix or 'no extension'}"
        )
    return EXPORT_FORMATS[suffix]


def find_items_artifact(tracking_uri: str, run: str, round_idx: int) -> ItemsArtifact:
    """The `items` output of round `round_idx`'s evaluate run under the pipeline run `run` (its parent
    run's id, or its run name: the newest parent run of that name). The newest finished evaluate run
    of the round counts: an earlier attempt's outputs were replaced by it."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    pipeline = _pipeline_run(client, run, tracking_uri)
    pipeline_id, experiment = pipeline.info.run_id, pipeline.info.experiment_id

    def children(parent: str, extra: str = "") -> list:
        return client.search_runs(
            [experiment], f"tags.mlflow.parentRunId = '{parent}'{extra}", max_results=5000
        )

    direct = children(pipeline_id)
    round_runs = {
        r.info.run_id: int(r.data.tags[tracking.ROUND_TAG])
        for r in direct
        if tracking.STAGE_TAG not in r.data.tags and tracking.ROUND_TAG in r.data.tags
    }
    rounds = set(round_runs.values()) | {
        int(r.data.tags.get(tracking.ROUND_TAG, 0)) for r in direct if tracking.STAGE_TAG in r.data.tags
    }
    if round_idx not in rounds:
        listed = ", ".join(map(str, sorted(rounds))) or "none"
        raise ItemUsefulnessError(f"run {pipeline_id} has no round {round_idx} (its rounds: {listed})")
    parents = [pipeline_id, *(rid for rid, t in round_runs.items() if t == round_idx)]
    evaluate_filter = (
        f" and tags.`{tracking.STAGE_TAG}` = 'evaluate' and tags.`{tracking.ROUND_TAG}` = '{round_idx}'"
    )
    runs = [r for parent in parents for r in children(parent, evaluate_filter)]
    finished = sorted(
        (r for r in runs if r.info.status == "FINISHED"), key=lambda r: r.info.start_time, reverse=True
    )
    if not finished:
        state = "'s evaluate run did not finish" if runs else " has no evaluate run"
        raise ItemUsefulnessError(f"round {round_idx}{state} in run {pipeline_id}")
    evaluate = client.get_run(finished[0].info.run_id)  # search results may leave out the datasets
    for d in evaluate.inputs.dataset_inputs:
        tags = {t.key: t.value for t in d.tags}
        if tags.get("mlflow.data.context") == "output" and tags.get(tracking.NAME_TAG) == ITEMS_OUTPUT:
            return ItemsArtifact(tags["uri"], pipeline_id, evaluate.info.run_id)
    raise ItemUsefulnessError(
        f"round {round_idx}'s evaluate run {evaluate.info.run_id} logged no {ITEMS_OUTPUT!r} output "
        "(a run from before per-item usefulness)"
    )


def _pipeline_run(client, run: str, tracking_uri: str):
    """The pipeline's parent run named by its id or, failing that, by its run name."""
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_run(run)
    except MlflowException:
        found = None
    if found is not None:
        if found.data.tags.get(tracking.STAGE_TAG) != "pipeline":
            raise ItemUsefulnessError(f"{run} is not a pipeline's parent run (MLflow shows it under one)")
        return found
    if "'" not in run and "\\" not in run:  # a quote would end the filter's string
        experiments = [e.experiment_id for e in client.search_experiments()]
        named = client.search_runs(
            experiments,
            f"tags.`{tracking.PIPELINE_TAG}` = '{run}' and tags.`{tracking.STAGE_TAG}` = 'pipeline'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if named:
            return named[0]
    raise ItemUsefulnessError(f"{run}: no pipeline run with this id or run name in {tracking_uri}")


def export_items(items_uri: str, out: str, *, everything: bool = False) -> tuple[int, int]:
    """Write the useful items of an item_usefulness artifact (all of them with `everything`) to `out`,
    atomically: JSONL (one item a line, every column, an undefined measure as null) or, for .parquet,
    an item_usefulness artifact. An export with no item is an empty file. Returns (written, items).
    The caller checks that `out` may be written (stages.runner.preflight: not an input, not a folder)."""
    how = export_format(out)
    table = read_artifact(items_uri, "item_usefulness")
    kept = table if everything else table.filter(table.column("useful"))
    if how == "parquet":
        write_artifact(out, "item_usefulness", kept)
    else:
        lines = [json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in kept.to_pylist()]
        store.write_bytes(out, "".join(lines).encode())
    return kept.num_rows, table.num_rows
