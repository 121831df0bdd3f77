"""Checks of a resolved model folder before any process loads it: its config.json names a model type
and each safetensors file is whole, read from the config and the weight files' headers only.

Kept apart from `models`, which resolves and fetches folders: these checks read what a folder holds,
wherever it came from, and answer in one line where transformers would fail in its own errors.
"""

from __future__ import annotations

import json
from pathlib import Path

from dynamicrubric.infra.models import ModelError


def check_model_folder(ref: str, path: Path) -> None:
    """Refuse, in one line and before any process loads it, a model folder (`resolve_model`'s) transformers would
    fail on with its own errors: a config.json that names no model type (`{}` gave a tokenizer error),
    or a safetensors file cut short (a copy that stopped: the training processes failed with two
    tracebacks and left their scratch folders). Only the config and each weight file's header are
    read, a few KB for any model size."""
    try:
        config = json.loads((path / "config.json").read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise ModelError(f"model folder {ref!r}: config.json is not readable JSON ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelError(
            f"model folder {ref!r}: config.json names no model_type; not a Hugging Face model's config"
        )
    for weights in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(weights)
        if problem:
            raise ModelError(f"model folder {ref!r}: {weights.name} {problem}")


def _safetensors_problem(file: Path) -> str | None:
    """Why `file` is not a whole safetensors file (None when it is): an 8-byte little-endian header
    length, a JSON header of each tensor's byte range, then exactly the bytes those ranges cover."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes, not even a header)"
        length = int.from_bytes(head, "little")
        if 8 + length > size:
            return f"is truncated ({size} bytes; its header alone says {8 + length})"
        try:
            header = json.loads(f.read(length))
            ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
            return "has an unreadable header: not a safetensors file"
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"is truncated ({size} bytes; its header says {expected})"
    return None
