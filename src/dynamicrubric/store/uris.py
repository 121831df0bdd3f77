"""The kinds of URI the store takes (a plain path, `file://...`, `s3://bucket/key`): telling them
apart, parsing and joining them, and `StoreError`, the one error the store raises for a reason the
user must fix. Nothing here touches the filesystem or the network."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse


class StoreError(RuntimeError):
    """A store operation failed for a reason the user must fix; the message is one line naming the URI."""


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise StoreError(f"{uri}: not an s3://bucket/key URI")
    return parsed.netloc, parsed.path.lstrip("/")


def local_path(uri: str) -> Path:
    uri = str(uri)
    if uri.startswith("file://"):
        return Path(urlparse(uri).path)
    if "://" in uri:
        raise StoreError(f"{uri}: unsupported URI scheme; use a path, file:// or s3://")
    return Path(uri)


def join(base: str, *parts: str) -> str:
    base = str(base)
    if is_s3(base) or base.startswith("file://"):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return str(Path(base, *parts))
