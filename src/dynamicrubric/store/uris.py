"""The kinds of URI the store takes (a plain path, `file://...`, `s3://bucket/key`): telling them
apart, parsing and joining them, and `StoreError`, the one error the store raises for a reason the
user must fix. Nothing here touches the filesystem or the network."""

from __future__ import annotations

import hashlib
import posixpath
from pathlib import Path, PurePosixPath
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
        parsed = urlparse(uri)
        # file://host/p names a file on another machine: reading /p here would be another file.
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(f"{uri}: a file:// URI with a host ({parsed.netloc}); use file:///path")
        return Path(parsed.path)
    if "://" in uri:
        raise StoreError(f"{uri}: unsupported URI scheme; use a path, file:// or s3://")
    return Path(uri)


def join(base: str, *parts: str) -> str:
    base = str(base)
    if is_s3(base) or base.startswith("file://"):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return str(Path(base, *parts))


def canonical(uri: str) -> str:
    """One spelling per location, to compare outputs with inputs and with each other: a local path
    (or file:// URI) absolute with its symlinks resolved; an S3 URI as its bucket and normalised key
    (`s3://b//x/./p` is `s3://b/x/p`: the store drops a key's leading `/`, and collapsing the other
    empty and dot segments errs toward calling two URIs one, which only refuses more)."""
    uri = str(uri)
    if is_s3(uri):
        bucket, key = split_s3(uri)
        key = posixpath.normpath("/" + key).lstrip("/")
        return f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    path = local_path(uri).expanduser()
    try:
        return str(path.resolve())
    except RuntimeError:  # Python 3.11 raises this for a loop; 3.13 an OSError (ELOOP)
        raise StoreError(f"{uri}: a symlink loop") from None
    except OSError as e:
        raise StoreError(f"{uri}: cannot resolve the path: {e.strerror}") from None


def within(inner: str, outer: str) -> bool:
    """True when canonical location `inner` is `outer` or lies under it (both from `canonical`)."""
    if is_s3(inner) != is_s3(outer):
        return False
    if is_s3(inner):
        return inner == outer or inner.startswith(outer + "/")
    return PurePosixPath(inner).is_relative_to(PurePosixPath(outer))


# What a temp or sibling name built from a file's name may keep of it: NAME_MAX is 255 bytes, and the
# decorations around the name (".", ".tmp", mkstemp's 8 random characters, ".v-<token>") take up to
# ~50 more, so a legal 242-255 character output name made a temp name no filesystem takes.
_KEPT_NAME_BYTES = 180


def short_name(name: str) -> str:
    """`name` itself when short, else its first bytes and a digest of the whole: the same for the same
    name (a pinned folder's versions are found again by it), distinct for distinct names."""
    raw = name.encode()
    if len(raw) <= _KEPT_NAME_BYTES:
        return name
    head = raw[: _KEPT_NAME_BYTES - 17].decode(errors="ignore")
    return f"{head}~{hashlib.sha256(raw).hexdigest()[:16]}"
