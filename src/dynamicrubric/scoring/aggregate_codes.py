"""Aggregation's integer codes: candidate sets, rubric items and judgments as dense codes in one
ragged slot layout (see aggregate.py), and the small vectorised helpers they are built with. Internal
to aggregation: aggregate.py is their one user."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dynamicrubric.infra.artifact_kinds import JUDGED_ITEMS, kind

log = logging.getLogger(__name__)

Frame = pd.DataFrame | pa.Table


class AggregateError(ValueError):
    """Inputs that cannot be aggregated without a wrong score; the message names the offending key."""


# --------------------------------------------------------------------------------------------------
# Candidate sets and judgment codes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CandidateSets:
    """The rollouts as P candidate sets; responses sorted by (prompt, sample_idx) get codes 0..N-1."""

    prompt_ids: pa.Array  # sorted unique prompt ids; a prompt's code is its position here
    start: np.ndarray  # (P,) first response code of each prompt
    size: np.ndarray  # (P,) K: responses per prompt
    sample_idx: np.ndarray  # (N,) sample_idx of each response
    keys: np.ndarray  # (N,) sorted response keys prompt * sample_space + sample_idx
    sample_space: int  # max sample_idx + 1

    def response_codes(self, prompt: np.ndarray, sample: np.ndarray) -> np.ndarray:
        """Response code of each (prompt code, sample_idx), -1 where that response is not a rollout."""
        inside = (sample >= 0) & (sample < self.sample_space)
        keys = prompt * self.sample_space + np.where(inside, sample, 0)
        codes = _lookup(self.keys, keys, len(self.size) * self.sample_space)
        return np.where(inside, codes, -1)


@dataclass(frozen=True)
class Judgments:
    """Each judgment row as codes: its rubric (group), item, and position in its candidate set."""

    group: np.ndarray  # (J,) group code; groups are sorted (prompt, rubric_idx)
    item: np.ndarray  # (J,) item code; items are sorted (group, item_idx)
    local: np.ndarray  # (J,) position of the judged response within its candidate set
    weight: np.ndarray  # (J,) float64 item weight
    group_prompt: np.ndarray  # (G,) prompt code of each group
    group_rubric: np.ndarray  # (G,) rubric_idx of each group
    item_group: np.ndarray  # (I,) group code of each item
    item_weight: np.ndarray  # (I,) weight of each item

    @property
    def num_groups(self) -> int:
        return len(self.group_prompt)


def candidate_sets(rollouts: Frame) -> CandidateSets:
    prompt_col = strings(rollouts, "prompt_id", "rollouts")
    if len(prompt_col) == 0:
        raise AggregateError("rollouts is empty: there is no candidate set to score")
    prompt_ids = pc.unique(prompt_col)
    prompt_ids = prompt_ids.take(pc.sort_indices(prompt_ids))
    prompt = index_codes(prompt_col, prompt_ids)
    sample = ints(rollouts, "sample_idx", "rollouts")
    if sample.min() < 0:
        raise AggregateError(f"rollouts: sample_idx {int(sample.min())} is negative")
    sample_space = int(sample.max()) + 1
    keys = prompt * sample_space + sample
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    dup = np.flatnonzero(keys[1:] == keys[:-1])
    if len(dup):
        row = order[dup[0]]
        raise AggregateError(
            f"rollouts: duplicate response (prompt_id={prompt_ids[int(prompt[row])].as_py()!r}, "
            f"sample_idx={int(sample[row])})"
        )
    size = np.bincount(prompt, minlength=len(prompt_ids))
    return CandidateSets(prompt_ids, starts(size), size, sample[order], keys, sample_space)


def index_judgments(judgments: Frame, sets: CandidateSets, rubrics: Frame | None) -> Judgments:
    """Codes for every judgment row, after checking that they describe complete, consistent judging."""
    prompt_col = strings(judgments, "prompt_id", "judgments")
    prompt = index_codes(prompt_col, sets.prompt_ids)
    sample = ints(judgments, "sample_idx", "judgments")
    rubric_idx = ints(judgments, "rubric_idx", "judgments")
    item_idx = ints(judgments, "item_idx", "judgments")
    weight = ints(judgments, "weight", "judgments")

    def key_of(row: int) -> str:
        return (
            f"(prompt_id={prompt_col[row].as_py()!r}, rubric_idx={int(rubric_idx[row])}, "
            f"item_idx={int(item_idx[row])}, sample_idx={int(sample[row])})"
        )

    def fail_at(bad: np.ndarray, problem: str) -> None:
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise AggregateError(f"judgments {key_of(row)}: {problem} ({int(bad.sum())} row(s))")

    fail_at(prompt < 0, "prompt_id has no rollouts")
    fail_at((weight < 1) | (weight > 5), "weight must be 1..5")
    fail_at(rubric_idx < 0, "rubric_idx is negative")
    fail_at(item_idx < 0, "item_idx is negative")
    response = sets.response_codes(prompt, sample)
    fail_at(response < 0, "sample_idx is not a rollout of this prompt (not in the candidate set)")
    local = response - sets.start[prompt]

    # Groups (prompt, rubric): the rubrics table when given (it also holds empty rubrics), else those judged.
    rubric_space = int(rubric_idx.max(initial=-1)) + 1
    if rubrics is not None:
        rub = _rubric_rows(rubrics, sets)
        rubric_space = max(rubric_space, int(rub.rubric_idx.max(initial=-1)) + 1)
        group_keys = np.sort(rub.prompt * rubric_space + rub.rubric_idx)
    judged_keys = prompt * rubric_space + rubric_idx
    if rubrics is None:
        group_keys = _unique(judged_keys, len(sets.size) * rubric_space)
    group = _lookup(group_keys, judged_keys, len(sets.size) * rubric_space)
    fail_at(group < 0, "rubric is not in the rubrics table")
    group_prompt, group_rubric = np.divmod(group_keys, rubric_space)
    unscored = np.bincount(group_prompt, minlength=len(sets.size)) == 0
    if unscored.any():
        raise AggregateError(
            f"prompt_id={sets.prompt_ids[int(np.flatnonzero(unscored)[0])].as_py()!r} has rollouts but no rubric "
            f"({int(unscored.sum())} prompt(s)); pass the rubrics table so empty rubrics are scored"
        )

    # Items (group, item_idx); all rows of one item must carry the same weight.
    item_space = int(item_idx.max(initial=-1)) + 1
    item_keys_all = group * item_space + item_idx
    item_keys = _unique(item_keys_all, len(group_keys) * item_space)
    item = _lookup(item_keys, item_keys_all, len(group_keys) * item_space)
    item_group, item_number = np.divmod(item_keys, max(item_space, 1))
    item_weight = np.zeros(len(item_keys), dtype=np.int64)
    item_weight[item] = weight
    fail_at(weight != item_weight[item], "weight differs from the same item's weight for another response")

    if rubrics is not None:
        order = np.argsort(rub.prompt * rubric_space + rub.rubric_idx)  # rubric rows in group order
        item_row = order[item_group]
        beyond = item_number >= rub.num_items[order][item_group]
        fail_at(beyond[item], "item_idx is beyond the rubric's items")
        fail_at(
            (item_weight != rub.weights[rub.first_item[item_row] + item_number])[item],
            "weight differs from the rubric's item weight",
        )
        fail_at(
            ~rub.judged[rub.first_item[item_row] + item_number][item],
            "item_idx is not among the rubric's judged_items (left out by item dropout)",
        )
        expected = rub.num_judged[order]  # every item, unless item dropout left some out
        judged = np.bincount(item_group, minlength=len(group_keys))
        missing = np.flatnonzero(judged != expected)
        if len(missing):
            g = int(missing[0])
            raise AggregateError(
                f"rubric (prompt_id={sets.prompt_ids[int(group_prompt[g])].as_py()!r}, "
                f"rubric_idx={int(group_rubric[g])}) has {int(expected[g])} item(s) but judgments cover "
                f"{int(judged[g])} ({len(missing)} incompletely judged rubric(s))"
            )

    # Completeness: item i owns K consecutive slots, one per response of its set; each must be filled once.
    item_k = sets.size[group_prompt[item_group]]
    item_start = starts(item_k)
    filled = np.bincount(item_start[item] + local, minlength=int(item_k.sum()))
    bad_slots = np.flatnonzero(filled != 1)
    if len(bad_slots):
        slot = int(bad_slots[0])
        i = int(np.searchsorted(item_start, slot, side="right") - 1)
        g = int(item_group[i])
        sample_of_slot = sets.sample_idx[sets.start[group_prompt[g]] + slot - item_start[i]]
        key = (
            f"(prompt_id={sets.prompt_ids[int(group_prompt[g])].as_py()!r}, rubric_idx={int(group_rubric[g])}, "
            f"item_idx={int(item_number[i])}, sample_idx={int(sample_of_slot)})"
        )
        problem = "is missing (incomplete judging)" if filled[slot] == 0 else f"appears {filled[slot]} times"
        raise AggregateError(f"judgment {key} {problem}; {len(bad_slots)} bad (item, response) slot(s)")

    return Judgments(
        group=group,
        item=item,
        local=local,
        weight=weight.astype(np.float64),
        group_prompt=group_prompt,
        group_rubric=group_rubric,
        item_group=item_group,
        item_weight=item_weight,
    )


@dataclass(frozen=True)
class _RubricRows:
    prompt: np.ndarray  # (R,) prompt code
    rubric_idx: np.ndarray  # (R,)
    num_items: np.ndarray  # (R,) items in the rubric (0: empty rubric)
    first_item: np.ndarray  # (R,) offset of the rubric's first item in `weights`
    weights: np.ndarray  # all item weights, rubric after rubric
    judged: np.ndarray  # (as weights) whether the item was judged: all, unless a judged_items column says
    num_judged: np.ndarray  # (R,) items judged in the rubric


def _rubric_rows(rubrics: Frame, sets: CandidateSets) -> _RubricRows:
    prompt_col = strings(rubrics, "prompt_id", "rubrics")
    prompt = index_codes(prompt_col, sets.prompt_ids)
    rubric_idx = ints(rubrics, "rubric_idx", "rubrics")
    if (prompt < 0).any():
        row = int(np.flatnonzero(prompt < 0)[0])
        raise AggregateError(
            f"rubrics (prompt_id={prompt_col[row].as_py()!r}, rubric_idx={int(rubric_idx[row])}): "
            "prompt_id has no rollouts"
        )
    if (rubric_idx < 0).any():
        raise AggregateError(f"rubrics: rubric_idx {int(rubric_idx.min())} is negative")
    keys = prompt * (int(rubric_idx.max(initial=0)) + 1) + rubric_idx
    if len(np.unique(keys)) != len(keys):
        raise AggregateError("rubrics: duplicate (prompt_id, rubric_idx) rows")
    if isinstance(rubrics, pa.Table):
        items = rubrics.column("items")
    else:
        items = pa.array(rubrics["items"], type=kind("rubrics").schema.field("items").type)
    num_items = pc.fill_null(pc.list_value_length(items), 0).to_numpy().astype(np.int64)
    weights = pc.struct_field(pc.list_flatten(items), "weight").to_numpy().astype(np.int64)
    first_item = starts(num_items)
    judged = np.ones(len(weights), dtype=bool)
    names = rubrics.column_names if isinstance(rubrics, pa.Table) else rubrics.columns
    if "judged_items" in names:  # item dropout: the verifier was asked about these items only
        if isinstance(rubrics, pa.Table):
            kept = rubrics.column("judged_items").combine_chunks()
        else:
            kept = pa.array(rubrics["judged_items"], type=JUDGED_ITEMS.type)
        row = pc.list_parent_indices(kept).to_numpy().astype(np.int64)
        item_idx = pc.list_flatten(kept).to_numpy().astype(np.int64)
        outside = (item_idx < 0) | (item_idx >= num_items[row])
        if outside.any():
            r = int(row[np.flatnonzero(outside)[0]])
            raise AggregateError(
                f"rubrics (prompt_id={prompt_col[r].as_py()!r}, rubric_idx={int(rubric_idx[r])}): judged_items "
                f"names item {int(item_idx[outside][0])} of a rubric of {int(num_items[r])} item(s)"
            )
        judged[:] = False
        judged[first_item[row] + item_idx] = True
    num_judged = np.bincount(
        np.repeat(np.arange(len(num_items)), num_items), weights=judged, minlength=len(num_items)
    )
    return _RubricRows(
        prompt, rubric_idx, num_items, first_item, weights, judged, num_judged.astype(np.int64)
    )


# --------------------------------------------------------------------------------------------------
# Small vectorised helpers
# --------------------------------------------------------------------------------------------------


def starts(counts: np.ndarray) -> np.ndarray:
    """Offsets of consecutive blocks of the given sizes: [0, c0, c0+c1, ...] without the total."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated: the position of each element inside its block."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts(counts), counts)


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    """log σ(x) = min(x, 0) − log(1 + e^−|x|): no overflow for large |x|."""
    return np.minimum(x, 0.0) - np.log1p(np.exp(-np.abs(x)))


def safe_divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den is 0 (an empty rubric, or a set without response pairs)."""
    return np.divide(num, den, out=np.zeros(len(num)), where=den != 0)


# A dense lookup table is one gather per query; beyond this many cells per key a binary search is used.
_DENSE_CELLS_PER_KEY = 16


def _unique(keys: np.ndarray, space: int) -> np.ndarray:
    """Sorted distinct values of non-negative `keys` < `space`."""
    if space <= _DENSE_CELLS_PER_KEY * len(keys) + (1 << 20):
        present = np.zeros(space, dtype=bool)
        present[keys] = True
        return np.flatnonzero(present)
    return np.unique(keys)


def _lookup(sorted_keys: np.ndarray, queries: np.ndarray, space: int) -> np.ndarray:
    """Position of each query (0 <= q < space) in `sorted_keys` (distinct, ascending), -1 where absent."""
    if space <= _DENSE_CELLS_PER_KEY * len(sorted_keys) + (1 << 20):
        table = np.full(space, -1, dtype=np.int64)
        table[sorted_keys] = np.arange(len(sorted_keys))
        return table[queries]
    position = np.minimum(np.searchsorted(sorted_keys, queries), max(len(sorted_keys) - 1, 0))
    found = sorted_keys[position] == queries if len(sorted_keys) else np.zeros(len(queries), dtype=bool)
    return np.where(found, position, -1)


def required_column(frame: Frame, name: str, table: str) -> np.ndarray:
    """A non-null column as a numpy array; missing columns and nulls are errors naming the table."""
    if name not in (frame.column_names if isinstance(frame, pa.Table) else frame.columns):
        raise AggregateError(f"{table}: missing column {name!r}")
    if isinstance(frame, pa.Table):
        col = frame.column(name)
        nulls = col.null_count
    else:
        col = frame[name]
        nulls = int(col.isna().sum())
    if nulls:
        raise AggregateError(f"{table}: column {name!r} has {nulls} null(s)")
    return col.to_numpy()


def ints(frame: Frame, name: str, table: str) -> np.ndarray:
    return required_column(frame, name, table).astype(np.int64, copy=False)


def refuse_unscored(judgments: Frame) -> None:
    """The judge writes p_yes NaN for a verdict it could not score: never count that as a yes or a no."""
    names = judgments.column_names if isinstance(judgments, pa.Table) else judgments.columns
    if "p_yes" not in names:
        return
    # NaN, not null: read the raw values (pandas would call NaN a null, and required_column refuses nulls).
    col = judgments.column("p_yes") if isinstance(judgments, pa.Table) else judgments["p_yes"]
    values = np.asarray(
        col.to_numpy(zero_copy_only=False) if isinstance(col, pa.ChunkedArray) else col, np.float64
    )
    unscored = int(np.isnan(values).sum())
    if unscored:
        raise AggregateError(
            f"judgments: {unscored} verdict(s) could not be scored by the verifier (p_yes NaN); "
            "rerun the judge stage with an engine that returns the label tokens' log-probs"
        )


def floats(frame: Frame, name: str) -> np.ndarray:
    values = required_column(frame, name, "judgments").astype(np.float64)
    if len(values) and (values.min() < 0 or values.max() > 1):
        raise AggregateError(f"judgments: {name} must be within 0..1, found {values.min()}..{values.max()}")
    return values


def strings(frame: Frame, name: str, table: str) -> pa.ChunkedArray | pa.Array:
    if name not in (frame.column_names if isinstance(frame, pa.Table) else frame.columns):
        raise AggregateError(f"{table}: missing column {name!r}")
    col = frame.column(name) if isinstance(frame, pa.Table) else pa.array(frame[name])
    if col.null_count:
        raise AggregateError(f"{table}: column {name!r} has {col.null_count} null(s)")
    return col


def index_codes(values: pa.ChunkedArray | pa.Array, categories: pa.Array) -> np.ndarray:
    """Position of each string in `categories`, -1 where absent (a hash lookup in Arrow)."""
    codes = pc.index_in(values, value_set=categories.cast(values.type))
    return pc.fill_null(codes, -1).to_numpy().astype(np.int64)


def kind_frame(kind_name: str, **columns: np.ndarray | pa.Array | pa.ChunkedArray) -> pd.DataFrame:
    """A DataFrame with exactly the kind's columns and types; NaN in a nullable float column is null."""
    schema = kind(kind_name).schema
    arrays = []
    for fld in schema:
        values = columns[fld.name]
        if isinstance(values, np.ndarray):
            mask = np.isnan(values) if fld.nullable and values.dtype.kind == "f" else None
            values = pa.array(values, type=fld.type, mask=mask)
        arrays.append(values.cast(fld.type))
    return pa.Table.from_arrays(arrays, schema=schema).to_pandas()
