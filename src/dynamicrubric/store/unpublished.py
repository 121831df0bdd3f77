"""Versions of a folder that no marker names (store/folders.py): a failed write's, removed at once where
the store lets it, else by the next write of the folder in this process (`remove_failed`) or, for a
process that died, once they are older than the stale age (DYNRUBRIC_S3_STALE_UPLOAD_S) by
`clean_unpublished`, which the next write of the folder runs on it, and a node on its stage's work prefix.

A version whose marker's write got no answer is none of these: the store may have stored that marker,
or may yet store it (a frozen server holds the request), so its writer keeps it
(`MarkerOutcomeUnknown`); only the age-based cleanup removes it, once no marker names it.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path

import dynamicrubric.store.s3 as s3
from dynamicrubric.store.uris import StoreError, is_s3, join, local_path, short_name, split_s3

# Named after the package, as the logger was before the store became one, so log lines read the same.
log = logging.getLogger(__package__)

COMPLETE_MARKER = "_COMPLETE"
VERSIONS_DIR = "_versions"  # on S3, each writer's files of a folder live under _versions/<token>/


class MarkerOutcomeUnknown(StoreError):
    """The completion marker's write got no answer and reading it back did not show it stored: it may
    yet be (a frozen store may still write it), so its version's files are kept."""


# This process's failed writes whose files the store did not let it remove: folder URI -> tokens. The
# next write of the folder removes them once its own marker is stored (folders.publish_version).
_failed: dict[str, set[str]] = {}
_failed_lock = threading.Lock()


def local_version(uri: str, token: str) -> Path:
    """Where a local writer fills version `token` of folder `uri` before swapping it in."""
    dest = local_path(uri)
    return dest.parent / f".{short_name(dest.name)}.{token}.tmp"


def discard_version(uri: str, token: str, budget_s: float | None = None) -> None:
    """Delete the files of a version that will never be published (its writer failed), and abort its
    unfinished multipart uploads; each store call within `budget_s` (default: the retry budget)."""
    if is_s3(uri):
        bucket, prefix = split_s3(uri.rstrip("/") + "/")
        version = f"{prefix}{VERSIONS_DIR}/{token}/"
        s3.delete_keys(uri, bucket, s3.list_keys(uri, bucket, version, budget_s), budget_s)
        s3.abort_stale_uploads(f"s3://{bucket}/{version}", older_than_s=0, budget_s=budget_s)
    else:
        shutil.rmtree(local_version(uri, token), ignore_errors=True)


def abandon_version(uri: str, token: str) -> None:
    """A write of version `token` failed before its marker was sent: remove its files and its open
    multipart uploads now, within the cleanup budget (s3.CLEANUP_BUDGET_S a step); what the store does
    not let it remove, the next write of the folder in this process does."""
    try:
        discard_version(uri, token, budget_s=s3.CLEANUP_BUDGET_S)
    except Exception as e:  # the store may be why the write failed
        log.warning("%s: could not remove the failed write's files (the next write of it will): %s", uri, e)
        with _failed_lock:
            _failed.setdefault(uri.rstrip("/"), set()).add(token)


def remove_failed(uri: str, token: str) -> None:
    """Once `token`'s marker is stored, the versions of this process's earlier failed writes of the
    folder go: no marker names them (their writes failed before sending one), and none ever will."""
    with _failed_lock:
        tokens = _failed.pop(uri.rstrip("/"), set()) - {token}
    for old in sorted(tokens):
        try:
            discard_version(uri, old)
        except StoreError as e:
            log.warning("%s: could not remove a failed write's files: %s", uri, e)
            with _failed_lock:
                _failed.setdefault(uri.rstrip("/"), set()).add(old)


def marker_token(uri: str) -> str | None:
    """The token the folder's stored marker names, read within the cleanup budget; None when there is
    none or it cannot be read."""
    try:
        return _named(uri, s3.CLEANUP_BUDGET_S)
    except StoreError:
        return None


def _named(uri: str, budget_s: float | None = None) -> str | None:
    """The token the folder's marker names; None when it has no marker, or one that names no version."""
    bucket, key = split_s3(join(uri, COMPLETE_MARKER))
    try:
        data = s3.s3_call(
            uri,
            lambda: s3.s3_client().get_object(Bucket=bucket, Key=key)["Body"].read(),
            budget_s=budget_s,
            timeout_s=budget_s,
        )
    except StoreError as e:
        if str(e).endswith("no such object"):
            return None
        raise
    try:
        token = json.loads(data).get("token") if data.strip() else None
    except (ValueError, AttributeError):
        raise StoreError(f"{uri}/{COMPLETE_MARKER}: unreadable completion marker") from None
    return token if isinstance(token, str) else None


def _age_s(token: str) -> float | None:
    """Seconds since the writer of `token` began (folders.new_token starts it with time_ns in hex)."""
    try:
        return (time.time_ns() - int(token.split("-", 1)[0], 16)) / 1e9
    except ValueError:
        return None


def clean_unpublished(prefix: str, older_than_s: float | None = None) -> tuple[int, int]:
    """Under `prefix` (a stage's work prefix `<out>.work` as a node starts; a folder its writer has just
    published): delete every version of a folder that its marker does not name and that is older than `older_than_s` (default
    DYNRUBRIC_S3_STALE_UPLOAD_S, 1 hour: a younger one may belong to a live writer) or of one of this
    process's failed writes, and abort the unfinished multipart uploads as old. Returns (versions
    removed, uploads aborted); a local prefix has neither (a local writer's version is a temp folder
    it removes itself)."""
    if not is_s3(prefix):
        return 0, 0
    age = s3.stale_age_s() if older_than_s is None else older_than_s
    bucket, root = split_s3(prefix.rstrip("/") + "/")
    versions: dict[tuple[str, str], list[str]] = {}
    for key in s3.list_keys(prefix, bucket, root):
        folder, sep, rest = key.partition(f"{VERSIONS_DIR}/")
        if sep and (not folder or folder.endswith("/")) and "/" in rest:
            versions.setdefault((folder, rest.split("/", 1)[0]), []).append(key)
    removed = 0
    for (folder, token), keys in sorted(versions.items()):
        uri = f"s3://{bucket}/{folder}".rstrip("/")
        with _failed_lock:
            failed = token in _failed.get(uri, set())
        old = (_age_s(token) or 0.0) >= age
        if not (failed or old):
            continue
        try:
            if _named(uri) == token:
                continue  # the folder's published version
            s3.delete_keys(uri, bucket, keys)
            removed += 1
            with _failed_lock:
                _failed.get(uri, set()).discard(token)
        except StoreError as e:
            log.warning("%s: could not remove unpublished version %s: %s", uri, token, e)
    aborted = s3.abort_stale_uploads(prefix, older_than_s=age)
    if removed:
        log.info("%s: removed %d unpublished version(s) of failed or dead writers", prefix, removed)
    return removed, aborted
