"""The artifact contract: every table the pipeline stages exchange, as Arrow schemas (`KINDS`).

Each kind names its columns and types, its key columns (unique in a file), the rows it must have
and the ranges its numbers must fall in. Reading, writing and validating files against these is
`artifacts`; the contract itself is kept here apart, a table of data with no I/O, so that what each
artifact holds can be read in one place.

Kinds (keys in brackets):
- prompts      [prompt_id]                            tasks for the policy, optional reference answer
- rollouts     [prompt_id, sample_idx]                K policy responses per prompt
- rubrics      [prompt_id, rubric_idx]                one rubric sample (M weighted items) per row
- judgments    [prompt_id, rubric_idx, item_idx, sample_idx]   verifier yes/no per item and response
- scores       [prompt_id, rubric_idx, sample_idx]    aggregated score per response
- rewards      [prompt_id, rubric_idx]                generator rewards R_disc, R_anchor per rubric
- diagnostics  [prompt_id, rubric_idx]                signal diagnostics per candidate set and rubric
- anchors      [list_id, sample_idx]                  ranked response lists (rank 1 = best)
- outcomes     [prompt_id, sample_idx]                the task checker's score of a held-out sample
- units        [round, variant, measure, unit_id]     what the evaluate stage's metrics average over
- item_usefulness [round, prompt_id, rubric_idx, item_idx]  how each rubric item splits and ranks responses
- metrics      [round, stage, variant, name, step]    numbers for MLflow and reports
- guard        [round]                                the signal guard's verdict on a round (guard.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

SCHEMA_VERSION = "1"
KIND_KEY = b"dynamicrubric.kind"
VERSION_KEY = b"dynamicrubric.schema_version"

RUBRIC_ITEM = pa.struct(
    [pa.field("text", pa.string(), nullable=False), pa.field("weight", pa.int8(), nullable=False)]
)


class ArtifactError(ValueError):
    """An artifact that does not match its contract; the message names file, column, expected vs found."""


@dataclass(frozen=True)
class Kind:
    name: str
    schema: pa.Schema
    keys: tuple[str, ...]
    min_rows: int = 0
    # column -> (low, high) inclusive bounds checked on every read and write
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    # columns a file of this kind may carry or not (kept when present): the online trainers write
    # each step's artifacts with a `step` column, which the standalone stages' outputs do not have
    optional: tuple[pa.Field, ...] = ()

    def schema_of(self, table: pa.Table) -> pa.Schema:
        """The kind's schema plus the optional columns `table` has."""
        present = [f for f in self.optional if f.name in table.schema.names]
        return pa.schema(list(self.schema) + present) if present else self.schema


def _f(name: str, type_: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=nullable)


INDEX = (0, 2**31 - 1)  # the range of an index or count column: never negative
STEP = _f("step", pa.int32())  # the trainer's step that wrote a per-step artifact
# The item_idx values of a rubric that the verifier judged, ascending (the policy's reward with
# `judge.item_dropout`); without the column every item was judged. The items stay as written.
JUDGED_ITEMS = _f("judged_items", pa.list_(pa.field("item_idx", pa.int32(), nullable=False)))


KINDS: dict[str, Kind] = {
    k.name: k
    for k in [
        Kind(
            "prompts",
            pa.schema(
                [
                    _f("prompt_id", pa.string()),
                    _f("task", pa.string()),  # e.g. "basic_arithmetic", "humaneval", "user"
                    _f("prompt", pa.string()),
                    _f("reference", pa.string(), nullable=True),  # reference answer, if any
                    _f("meta", pa.string(), nullable=True),  # JSON the task's scorer needs
                ]
            ),
            keys=("prompt_id",),
            min_rows=1,
        ),
        Kind(
            "rollouts",
            pa.schema(
                [
                    _f("prompt_id", pa.string()),
                    _f("sample_idx", pa.int32()),
                    _f("prompt", pa.string()),
                    _f("response", pa.string()),
                    _f("num_tokens", pa.int32()),
                    _f("finish_reason", pa.string()),  # "stop" | "length"
                    _f("policy", pa.string()),
                    _f("seed", pa.int64()),
                ]
            ),
            keys=("prompt_id", "sample_idx"),
            optional=(STEP,),
            min_rows=1,
            ranges={"sample_idx": (0, 2**31 - 1), "num_tokens": (0, 2**31 - 1)},
        ),
        Kind(
            "rubrics",
            pa.schema(
                [
                    _f("prompt_id", pa.string()),
                    _f("rubric_idx", pa.int32()),
                    _f("variant", pa.string()),  # "dynamic" | "static"
                    _f("generator", pa.string()),
                    _f("generator_prompt", pa.string()),  # the exact text the generator was given
                    _f("completion", pa.string()),  # the raw text it wrote (trained on by GRPO)
                    _f("finish_reason", pa.string()),  # "stop" | "length": train appends eos on "stop"
                    _f("parse_status", pa.string()),  # "json" | "lines" | "empty"
                    _f("items", pa.list_(pa.field("item", RUBRIC_ITEM, nullable=False))),
                ]
            ),
            keys=("prompt_id", "rubric_idx"),
            optional=(STEP, JUDGED_ITEMS),
            min_rows=1,
            ranges={"items.weight": (1, 5), "rubric_idx": (0, 2**31 - 1)},
        ),
        Kind(
            "judgments",
            pa.schema(
                [
                    _f("prompt_id", pa.string()),
                    _f("rubric_idx", pa.int32()),
                    _f("item_idx", pa.int32()),
                    _f("sample_idx", pa.int32()),
                    _f("weight", pa.int8()),
                    _f("verdict", pa.bool_()),
                    _f("p_yes", pa.float32()),
                ]
            ),
            keys=("prompt_id", "rubric_idx", "item_idx", "sample_idx"),
            optional=(STEP,),
            ranges={
                "weight": (1, 5),
                "p_yes": (0.0, 1.0),
                **dict.fromkeys(("rubric_idx", "item_idx", "sample_idx"), INDEX),
            },
        ),
        Kind(
            "scores",
            pa.schema(
                [
                    _f("prompt_id", pa.string()),
                    _f("rubric_idx", pa.int32()),
                    _f("sample_idx", pa.int32()),
                    _f("score", pa.float64()),
                    _f("num_items", pa.int32()),
                ]
            ),
            keys=("prompt_id", "rubric_idx", "sample_idx"),
            optional=(STEP,),
            ranges={"score": (0.0, 1.0), "rubric_idx": INDEX, "sample_idx": INDEX, "num_items": INDEX},
        ),
        Kind(
            "rewards",
            pa.schema(
                [
                    _f("prompt_id", pa.string()),
                    _f("rubric_idx", pa.int32()),
                    _f("r_disc", pa.float64()),
                    _f("r_anchor", pa.float64(), nullable=True),  # null: no anchor ranking for this set
                    _f("num_items", pa.int32()),
                ]
            ),
            keys=("prompt_id", "rubric_idx"),
            optional=(STEP,),
            ranges={"r_disc": (0.0, 0.25), "rubric_idx": INDEX, "num_items": INDEX},
        ),
        Kind(
            "diagnostics",
            pa.schema(
                [
                    _f("prompt_id", pa.string()),
                    _f("rubric_idx", pa.int32()),
                    _f("num_responses", pa.int32()),
                    _f("num_items", pa.int32()),
                    _f("mean_score", pa.float64()),
                    _f("mean_gap", pa.float64(), nullable=True),  # null: no reference ordering
                    _f("tie_rate", pa.float64()),
                    _f("uniform", pa.bool_()),
                    _f("mean_pass_rate", pa.float64(), nullable=True),  # null: empty rubric
                ]
            ),
            keys=("prompt_id", "rubric_idx"),
            optional=(STEP,),
            ranges={"tie_rate": (0.0, 1.0), "mean_score": (0.0, 1.0), "rubric_idx": INDEX},
        ),
        Kind(
            "anchors",
            pa.schema(
                [
                    _f("list_id", pa.string()),
                    _f("sample_idx", pa.int32()),
                    _f("rank", pa.int32()),  # 1 = best; equal ranks are ties
                    _f("prompt", pa.string()),
                    _f("response", pa.string()),
                    _f("source", pa.string()),
                ]
            ),
            keys=("list_id", "sample_idx"),
            ranges={"rank": (1, 2**31 - 1), "sample_idx": INDEX},
        ),
        Kind(
            "outcomes",  # the held-out samples' checker scores (evaluate's check-samples task)
            pa.schema(
                [
                    _f("prompt_id", pa.string()),
                    _f("sample_idx", pa.int32()),
                    _f("task", pa.string()),
                    _f("score", pa.float64(), nullable=True),  # null: unscored (the sandbox failed)
                ]
            ),
            keys=("prompt_id", "sample_idx"),
            ranges={"score": (0.0, 1.0), "sample_idx": INDEX},
        ),
        Kind(
            "units",  # the evaluate stage's per-unit values, which its metrics average over
            pa.schema(
                [
                    _f("round", pa.int32()),
                    _f("variant", pa.string()),  # "policy" or an evaluator variant
                    _f("measure", pa.string()),  # avg_at_k | win | pair_soft | pair_hard
                    _f("unit_id", pa.string()),  # a prompt_id, or "<list_id>|<better>><worse>" for a pair
                    _f("value", pa.float64()),
                ]
            ),
            keys=("round", "variant", "measure", "unit_id"),
            ranges={"value": (0.0, 1.0)},
        ),
        Kind(
            "guard",  # the signal guard's verdict on one round, and the models it is about
            pa.schema(
                [
                    _f("round", pa.int32()),
                    _f("healthy", pa.bool_()),
                    _f("alarms", pa.string()),  # the alarms that fired, comma-separated (guard.ALARMS)
                    _f("reasons", pa.string()),  # why, in words
                    _f("action", pa.string()),  # guard.action: warn | stop | rollback
                    _f("policy", pa.string()),  # P_t and G_t (model references): what a rollback leaves
                    _f("generator", pa.string()),
                ]
            ),
            keys=("round",),
            min_rows=1,
        ),
        Kind(
            "item_usefulness",  # per rubric item of a round (item_usefulness.py); diagnosis and export only
            pa.schema(
                [
                    _f("round", pa.int32()),
                    _f("prompt_id", pa.string()),
                    _f("rubric_idx", pa.int32()),
                    _f("item_idx", pa.int32()),
                    _f("text", pa.string()),
                    _f("weight", pa.int8()),
                    _f("num_responses", pa.int32()),  # the candidate set's K
                    _f("num_failed", pa.int32()),  # verdicts the verifier could not score (left out)
                    _f("pass_rate", pa.float64(), nullable=True),  # null: every verdict failed
                    _f("splits", pa.bool_()),
                    # null: the rubric's score does not vary; an item pulling against the rest is < 0
                    _f("variance_share", pa.float64(), nullable=True),
                    _f("gold_pairs", pa.int32()),
                    _f("gold_agreement", pa.float64(), nullable=True),  # null: no gold pairs
                    _f("recurrence", pa.int32()),
                    _f("useful", pa.bool_()),
                ]
            ),
            keys=("round", "prompt_id", "rubric_idx", "item_idx"),
            ranges={
                "weight": (1, 5),
                "pass_rate": (0.0, 1.0),
                "gold_agreement": (0.0, 1.0),
                "recurrence": (1, 2**31 - 1),
                **dict.fromkeys(
                    ("round", "rubric_idx", "item_idx", "num_responses", "num_failed", "gold_pairs"), INDEX
                ),
            },
        ),
        Kind(
            "metrics",
            pa.schema(
                [
                    _f("round", pa.int32()),
                    _f("stage", pa.string()),
                    _f("variant", pa.string()),
                    _f("name", pa.string()),
                    _f("step", pa.int32()),
                    _f("value", pa.float64()),
                ]
            ),
            keys=("round", "stage", "variant", "name", "step"),
        ),
    ]
}


def is_timing(metric_name: object) -> bool:
    """A metric that measures time (the trainers' time/* split, train_wall_s): it differs from run
    to run by nature, where every other number of a seeded run is reproduced exactly."""
    return isinstance(metric_name, str) and (metric_name.startswith("time/") or metric_name == "train_wall_s")


def kind(name: str) -> Kind:
    try:
        return KINDS[name]
    except KeyError:
        raise ArtifactError(f"unknown artifact kind {name!r}; expected one of {sorted(KINDS)}") from None


def empty_table(kind_name: str) -> pa.Table:
    return kind(kind_name).schema.empty_table()
