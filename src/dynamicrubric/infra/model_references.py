"""Model references as stages hand them on: written down the same however they were typed
(`model_reference`), and folders that name a model instead of holding one (`write_reference`,
`follow_reference`), how a rollback hands the next round a checkpoint without copying it.

Kept apart from `models`, which turns a reference into a local folder to load: this is what a
reference says, not how its weights are fetched.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from dynamicrubric import store
from dynamicrubric.infra.models import BUILTIN_MODELS, ModelError

# A folder that names a model instead of holding one (`write_reference`): how a rollback hands the next
# round the checkpoint it chose, which stays where it is (no copy of a 16 GB checkpoint per round).
REFERENCE_FILE = "reference.json"


def write_reference(uri: str, target: str) -> None:
    """Publish at `uri` a folder whose one file names the model reference `target`."""
    with tempfile.TemporaryDirectory(prefix="dynrubric-reference-") as tmp:
        (Path(tmp) / REFERENCE_FILE).write_text(json.dumps({"model": target}, sort_keys=True) + "\n")
        store.upload_dir(tmp, uri)


def follow_reference(ref: str) -> str:
    """The model reference a reference folder (`write_reference`) names; any other `ref` as it is."""
    if not ref or ref in BUILTIN_MODELS:
        return ref
    if not (store.is_s3(ref) or ref.startswith("file://") or Path(ref).expanduser().is_dir()):
        return ref  # a hub id, or a name the model loader will explain
    manifest = store.read_manifest(ref)
    if manifest is None or manifest["files"] is None or REFERENCE_FILE not in manifest["files"]:
        return ref
    try:
        target = json.loads(store.read_bytes(store.folder_file(ref, REFERENCE_FILE)))["model"]
    except (ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{ref}: unreadable {REFERENCE_FILE} ({e})") from None
    if not isinstance(target, str) or not target:
        raise ModelError(f"{ref}: {REFERENCE_FILE} names no model")
    return target


def model_reference(ref: str) -> str:
    """The reference an artifact stores for the model it came from, the same however it was typed: a
    local folder as its absolute path (a pod's mounted /s3/b/k as s3://b/k, the URI a rerun would
    name), a built-in name or hub id as it is."""
    from dynamicrubric.infra.tracking import POD_PREFIXES, artifact_uri

    if ref in BUILTIN_MODELS:  # resolve_model reads these as built-in names, whatever folders exist here
        return ref
    if ref.startswith(tuple(POD_PREFIXES)) or "://" in ref:
        return artifact_uri(ref)
    path = Path(ref).expanduser()
    return str(path.resolve()) if path.exists() else ref
