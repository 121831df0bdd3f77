"""A pipeline run's artifacts, digested, to show that a change of code leaves them the same.

    python -m bench.artifact_digest RUN_FOLDER --out A.json      digest one run folder
    python -m bench.artifact_digest --compare A.json B.json      which artifacts differ

Each task's outputs (from the run's `index.json`) are keyed by what they are — round, role, stage,
shard, output name, file — not by kfp.local's DAG folder names, so a pipeline whose DAG is declared
differently still compares. Two runs of one seed differ in one thing only: the run folder's path
(kfp.local names it after the start time), which artifacts hold where they name a checkpoint, and
the trainers' timings (`time/*` metrics, `train_wall_s`), which are measurements (runs before
2026-12-02 kept them in the trainers' metrics and checkpoint summary; they are in MLflow only now).
So a digest is taken after replacing that path with `<run>` and leaving any timings out: Parquet files by their
decoded content (schema with its metadata, then every column; the bytes are compressed, so the path
cannot be replaced in them), JSON by its parsed content, every other file by its bytes. `raw_sha256` is kept beside it: files that name no
path (weights, tokenizers, plots, most tables) must be byte-identical too. Bookkeeping that is new in
every run is left out: task logs, kfp's executor_output.json, the store's completion markers and the
hard-linked version folders a reader pins (`.name.v-token`).

A chained run (`pipeline.rounds_per_run`) writes one pipeline-run folder per segment, and each
folder's index lists every task of the chain: any of them digests the whole chain. Every
pipeline-run folder the index's tasks wrote to counts as the run's folder (`<run>`), and where the
same artifact was written by two segments (prepare-data runs in each) both must agree. A task's
folder name is kfp.local's, so where one long run has `train-policy-2` a chain's second segment has
`train-policy`: a path to an output of the run is replaced by the output's key (its round, role,
stage, shard and output name), which is the same in both.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

from dynamicrubric.infra.artifact_kinds import is_timing

SKIPPED_FILES = {"task.log", "executor_output.json", "_COMPLETE"}
PARQUET_MAGIC = b"PAR1"


def _normalised(value: object, run_folder: str | dict[str, str]) -> object:
    """`value` with the run folder's path replaced and timings left out (a key, or a metric row
    {"name": "time/...", ...}): older runs kept the trainers' timings in their artifacts.
    `run_folder` is one folder, or {path: replacement} (longest first; see `replacements`)."""
    if isinstance(value, str):
        return _replace(value, run_folder)
    if isinstance(value, list):
        return [
            _normalised(v, run_folder)
            for v in value
            if not (isinstance(v, dict) and is_timing(v.get("name")))
        ]
    if isinstance(value, dict):
        return {k: _normalised(v, run_folder) for k, v in value.items() if not is_timing(k)}
    return value


def _replace(text: str, run_folder: str | dict[str, str]) -> str:
    pairs = {run_folder: "<run>"} if isinstance(run_folder, str) else run_folder
    for path, replacement in pairs.items():
        text = text.replace(path, replacement)
    return text


def replacements(index: dict, run_folder: Path) -> dict[str, str]:
    """{path: replacement} for a run's artifact contents: each task output's URI by its key (see
    `output_key`), then each pipeline-run folder under the run's root by `<run>`; longest first, so
    that an output's path is replaced before the folder it lies in."""
    root = run_folder.parent
    pairs: dict[str, str] = {}
    for task in index["tasks"]:
        for output, uris in task["outputs"].items():
            for uri in uris:
                pairs[uri] = f"<{output_key(task, output)}>"
                rel = Path(uri).relative_to(root) if Path(uri).is_relative_to(root) else None
                if rel is not None and rel.parts:
                    pairs.setdefault(str(root / rel.parts[0]), "<run>")
    pairs.setdefault(str(run_folder), "<run>")
    return dict(sorted(pairs.items(), key=lambda kv: -len(kv[0])))


def output_key(task: dict, output: str) -> str:
    shard = "" if task["shard"] is None else f" shard {task['shard']}"
    return f"r{task['round']} {task['role'] or '-'} {task['stage']}{shard} {output}"


def content_digest(path: Path, run_folder: str | dict[str, str]) -> str:
    """sha256 of the file's content, normalised as the module says."""
    data = path.read_bytes()
    if path.suffix == ".json":
        content = _normalised(json.loads(data), run_folder)
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    if not data.startswith(PARQUET_MAGIC):
        return hashlib.sha256(_replace(data.decode("latin-1"), run_folder).encode("latin-1")).hexdigest()
    table = pq.read_table(io.BytesIO(data))
    digest = hashlib.sha256(table.schema.to_string(show_schema_metadata=True).encode())
    rows = _normalised(table.to_pylist(), run_folder)
    digest.update(json.dumps(rows, sort_keys=True, default=repr).encode())
    digest.update(str(pq.ParquetFile(io.BytesIO(data)).metadata.num_row_groups).encode())
    return digest.hexdigest()


def digest_run(run_folder: Path) -> dict[str, dict[str, str]]:
    """{artifact key: {"content_sha256", "raw_sha256"}} for every output file of every task."""
    index = json.loads((run_folder / "index.json").read_text())
    paths = replacements(index, run_folder)
    out: dict[str, dict[str, str]] = {}
    for task in index["tasks"]:
        for output, uris in sorted(task["outputs"].items()):
            for uri in uris:
                root = Path(uri)
                files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
                for f in files:
                    rel = f.relative_to(root)
                    if f.name in SKIPPED_FILES or any(".v-" in part for part in rel.parts):
                        continue
                    key = output_key(task, output) + (f"/{rel}" if str(rel) != "." else "")
                    entry = {
                        "content_sha256": content_digest(f, paths),
                        "raw_sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                    }
                    # a chain writes some outputs once per segment (prepare-data): they must agree
                    if out.get(key, entry)["content_sha256"] != entry["content_sha256"]:
                        raise ValueError(f"{key}: two tasks wrote different contents")
                    out[key] = entry
    return out


def compare(a: dict, b: dict) -> dict:
    """What differs between two digests (the artifacts' keys and their hashes)."""
    a_files, b_files = a["artifacts"], b["artifacts"]
    common = sorted(set(a_files) & set(b_files))
    return {
        "artifacts": len(common),
        "only_in_first": sorted(set(a_files) - set(b_files)),
        "only_in_second": sorted(set(b_files) - set(a_files)),
        "content_differs": [
            k for k in common if a_files[k]["content_sha256"] != b_files[k]["content_sha256"]
        ],
        "bytes_identical": sum(a_files[k]["raw_sha256"] == b_files[k]["raw_sha256"] for k in common),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_folder", nargs="?", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = parser.parse_args(argv)
    if args.compare:
        first, second = (json.loads(p.read_text()) for p in args.compare)
        result = compare(first, second)
        print(json.dumps(result, indent=1))
        same = not (result["only_in_first"] or result["only_in_second"] or result["content_differs"])
        return 0 if same else 1
    if args.run_folder is None:
        parser.error("give a run folder, or --compare A B")
    digest = {"run_folder": str(args.run_folder), "artifacts": digest_run(args.run_folder.resolve())}
    text = json.dumps(digest, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
