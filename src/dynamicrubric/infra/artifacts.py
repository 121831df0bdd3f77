"""Reading and writing artifacts, each validated against its kind's contract (`artifact_kinds`).

Each artifact is one zstd Parquet file whose footer metadata carries its kind and schema version.
`read_artifact` validates a file against its kind and raises `ArtifactError` naming the file, the
column and what was expected vs found; `write_artifact` validates too, then writes atomically
through `dynamicrubric.store`, so a reader never sees a half-written or malformed artifact.
"""

from __future__ import annotations

import io
import json

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dynamicrubric import store
from dynamicrubric.infra.artifact_kinds import (
    KIND_KEY,
    KINDS,
    SCHEMA_VERSION,
    VERSION_KEY,
    ArtifactError,
    Kind,
    kind,
)


def to_table(kind_name: str, data: pd.DataFrame | list[dict] | pa.Table) -> pa.Table:
    """Build a table of the kind's exact schema from a DataFrame, records, or a compatible table."""
    k = kind(kind_name)
    if isinstance(data, pa.Table):
        table = data
    elif isinstance(data, pd.DataFrame):
        table = pa.Table.from_pandas(data, preserve_index=False)
        # from_pandas reads a float NaN as null; where the contract gives NaN a meaning, it stays NaN.
        for name in (c for k, c in NAN_ALLOWED if k == kind_name and c in table.schema.names):
            if data[name].dtype.kind == "f":
                column = pa.array(data[name].to_numpy(), from_pandas=False)
                table = table.set_column(table.schema.get_field_index(name), name, column)
    else:
        # Infer types first (not from the schema, which would fill a missing key with nulls).
        table = pa.Table.from_pylist(list(data)) if data else k.schema.empty_table()
    where = f"<in-memory {kind_name}>"
    _check_columns(table, k, where)
    schema = k.schema_of(table)
    for fld in schema:
        if not fld.nullable and table.column(fld.name).null_count:
            raise ArtifactError(
                f"{where}: column {fld.name!r} has {table.column(fld.name).null_count} null(s)"
            )
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError) as e:
        raise ArtifactError(f"{where}: cannot convert to the {kind_name!r} schema: {e}") from e


def write_artifact(uri: str, kind_name: str, data: pd.DataFrame | list[dict] | pa.Table) -> pa.Table:
    """Validate `data` as `kind_name` and write it atomically to `uri` (local path or s3://)."""
    k = kind(kind_name)
    table = to_table(kind_name, data)
    validate_table(table, k, uri)
    meta = dict(table.schema.metadata or {})
    meta[KIND_KEY] = k.name.encode()
    meta[VERSION_KEY] = SCHEMA_VERSION.encode()
    table = table.replace_schema_metadata(meta)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    store.write_bytes(uri, buf.getvalue())
    return table


def read_artifact(uri: str, expected_kind: str | None = None) -> pa.Table:
    """Read and validate an artifact; `expected_kind` (if given) must match the file's kind."""
    data = store.read_bytes(uri)
    try:
        pf = pq.ParquetFile(io.BytesIO(data))
        table = pf.read()
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{uri}: not a readable Parquet file ({e})") from e
    meta = table.schema.metadata or {}
    if KIND_KEY not in meta:
        raise ArtifactError(
            f"{uri}: Parquet metadata has no {KIND_KEY.decode()!r}; not a dynamicrubric artifact"
        )
    found_kind = meta[KIND_KEY].decode()
    if found_kind not in KINDS:
        raise ArtifactError(f"{uri}: unknown artifact kind {found_kind!r}; expected one of {sorted(KINDS)}")
    if expected_kind is not None and found_kind != expected_kind:
        raise ArtifactError(f"{uri}: expected a {expected_kind!r} artifact, found {found_kind!r}")
    version = meta.get(VERSION_KEY, b"<none>").decode()
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{uri}: schema version {version!r} of {found_kind!r}, expected {SCHEMA_VERSION!r}"
        )
    k = KINDS[found_kind]
    validate_table(table, k, uri)
    schema = k.schema_of(table)
    return (
        table.replace_schema_metadata(None)
        .select(schema.names)
        .cast(schema)
        .replace_schema_metadata({KIND_KEY: k.name.encode(), VERSION_KEY: SCHEMA_VERSION.encode()})
    )


def read_frame(uri: str, expected_kind: str) -> pd.DataFrame:
    return read_artifact(uri, expected_kind).to_pandas()


def read_frames(uris: list[str], kind_name: str) -> pd.DataFrame:
    """Several artifacts of one kind (e.g. the shards of a fan-out) as one validated frame."""
    tables = [read_artifact(uri, kind_name) for uri in uris]
    if not tables:
        raise ArtifactError(f"no {kind_name!r} artifacts given")
    merged = pa.concat_tables(tables)
    validate_table(merged, kind(kind_name), " + ".join(uris))  # keys must stay unique across shards
    return merged.to_pandas()


def _check_columns(table: pa.Table, k: Kind, where: str) -> None:
    expected, found = k.schema.names, table.schema.names
    missing = [c for c in expected if c not in found]
    extra = [c for c in found if c not in expected and c not in {f.name for f in k.optional}]
    if missing:
        raise ArtifactError(
            f"{where}: {k.name!r} artifact is missing column {missing[0]!r}"
            + (f" (and {missing[1:]})" if missing[1:] else "")
            + f"; expected columns {expected}"
        )
    if extra:
        raise ArtifactError(
            f"{where}: {k.name!r} artifact has unexpected column {extra[0]!r}; expected columns {expected}"
        )


def validate_table(table: pa.Table, k: Kind, where: str) -> None:
    """Raise ArtifactError on any breach of the kind's contract; `where` names the file in messages."""
    _check_columns(table, k, where)
    schema = k.schema_of(table)
    for fld in schema:
        col = table.column(fld.name)
        if not col.type.equals(fld.type) and not _compatible(col.type, fld.type):
            raise ArtifactError(f"{where}: column {fld.name!r} has type {col.type}, expected {fld.type}")
        if not fld.nullable and col.null_count:
            raise ArtifactError(
                f"{where}: column {fld.name!r} has {col.null_count} null(s); nulls are not allowed"
            )
    table = table.select(schema.names).cast(schema)
    _check_text_and_numbers(table, k, where)
    if table.num_rows < k.min_rows:
        raise ArtifactError(f"{where}: {k.name!r} artifact is empty; expected at least {k.min_rows} row(s)")
    for col_name, (low, high) in k.ranges.items():
        if col_name == "items.weight":
            items = pc.list_flatten(table.column("items"))
            values = pc.struct_field(items, "weight")
            null_items = pc.sum(pc.is_null(pc.struct_field(items, "text"))).as_py() or 0
            if null_items:
                raise ArtifactError(f"{where}: column 'items' has {null_items} item(s) with null text")
        else:
            values = table.column(col_name)
        if len(values) == 0:
            continue
        lo, hi = pc.min_max(values).values()
        if lo.as_py() is not None and (lo.as_py() < low or hi.as_py() > high):
            bad = lo.as_py() if lo.as_py() < low else hi.as_py()
            raise ArtifactError(f"{where}: column {col_name!r} has value {bad}, expected {low}..{high}")
    if k.name == "prompts":
        _check_meta_is_json(table, where)
    if k.name == "rubrics" and "judged_items" in table.schema.names:
        _check_judged_items(table, where)
    if table.num_rows:
        keys = table.select(list(k.keys)).group_by(list(k.keys)).aggregate([([], "count_all")])
        dup = keys.filter(pc.greater(keys.column("count_all"), 1))
        if dup.num_rows:
            first = {c: dup.column(c)[0].as_py() for c in k.keys}
            raise ArtifactError(
                f"{where}: duplicate key {first} in columns {list(k.keys)} ({dup.num_rows} duplicated key(s))"
            )


def _check_meta_is_json(table: pa.Table, where: str) -> None:
    """A prompt's meta is JSON its task's scorer parses (a generator's config, HumanEval's tests): other
    text would only fail once the scorer reads it, in the middle of a stage."""
    for row, meta in enumerate(table.column("meta").to_pylist()):
        if meta is None:
            continue
        try:
            json.loads(meta)
        except ValueError:
            raise ArtifactError(f"{where}: column 'meta' of row {row} is not JSON") from None


def _check_judged_items(table: pa.Table, where: str) -> None:
    """A rubric's judged_items name its own items, each once, ascending: anything else would have the
    judge and aggregation disagree on which verdicts a score is made of."""
    for row, (items, judged) in enumerate(
        zip(table.column("items").to_pylist(), table.column("judged_items").to_pylist(), strict=True)
    ):
        if any(not 0 <= m < len(items) for m in judged) or judged != sorted(set(judged)):
            raise ArtifactError(
                f"{where}: column 'judged_items' of row {row} is {judged}; expected distinct ascending item "
                f"indices below the rubric's {len(items)} item(s)"
            )


# Columns where NaN is a value, not an error: a metric that is undefined for a round (no pairs to rank),
# and a verdict the verifier could not score (judge counts them; aggregation refuses them by name).
NAN_ALLOWED = {("metrics", "value"), ("judgments", "p_yes")}


def _check_text_and_numbers(table: pa.Table, k: Kind, where: str) -> None:
    """Text must be valid UTF-8 (Parquet readers do not check it) and numbers must be finite: a NaN
    reward or score would pass every range check and then poison training."""
    for fld in k.schema:
        col = table.column(fld.name)
        texts = col
        if fld.name == "items":
            texts = pc.struct_field(pc.list_flatten(col), "text")
        if pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type):
            try:
                for chunk in texts.chunks if isinstance(texts, pa.ChunkedArray) else [texts]:
                    chunk.validate(full=True)
            except pa.ArrowInvalid:
                raise ArtifactError(
                    f"{where}: column {fld.name!r} has text that is not valid UTF-8"
                ) from None
        if pa.types.is_floating(col.type) and (k.name, fld.name) not in NAN_ALLOWED:
            finite = pc.is_finite(col)  # null stays null: nulls are checked separately
            bad = len(col) - col.null_count - (pc.sum(finite).as_py() or 0)
            if bad:
                row = pc.index(finite, False).as_py()
                raise ArtifactError(
                    f"{where}: column {fld.name!r} has {bad} NaN or infinite value(s), the first in row {row}"
                )


def _compatible(found: pa.DataType, expected: pa.DataType) -> bool:
    # Parquet round-trips large_string as string and vice versa; anything else must match exactly.
    pairs = {(pa.large_string(), pa.string()), (pa.string(), pa.large_string())}
    if (found, expected) in pairs:
        return True
    if pa.types.is_list(found) or pa.types.is_large_list(found):
        return pa.types.is_list(expected) and found.value_type.equals(expected.value_type)
    return False


def artifact_kind(uri: str) -> str:
    """The kind recorded in a file's footer, without validating its rows."""
    data = store.read_bytes(uri)
    try:
        meta = pq.read_schema(io.BytesIO(data)).metadata or {}
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{uri}: not a readable Parquet file ({e})") from e
    return meta.get(KIND_KEY, b"<none>").decode()
