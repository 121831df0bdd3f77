"""A complete folder copied to another URI: on S3 by server-side copies, so no byte of it crosses the
copying process (a multi-node training task with 4Gi of memory and no disk to speak of publishes a
16 GB checkpoint this way); anywhere else through a local temp folder.

The copy is a folder of the folder protocol (store/folders.py) like any `upload_dir`: the files go
under the destination's own version `_versions/<token>/`, the marker (the source's manifest entries,
sizes and SHA-256 unchanged: a server-side copy is the same bytes, and each copy's size is checked
against its entry) is written last, and the version the destination's marker named before is deleted.
A copy that fails leaves the destination as it was (complete or absent) and deletes what it copied.

A file up to COPY_PART_SIZE is one CopyObject; a larger one is a multipart upload whose parts are
UploadPartCopy ranges of the source, PART_CONCURRENCY at a time, as s3transfer's managed copy does; a
failed multipart copy is aborted. A store answers a copy only once it is done (SeaweedFS; MinIO on slow
disks, eight copies at once), so a copy's attempts do not wait the shared client's read timeout: each
waits up to COPY_TIMEOUT_S (a whole part at COPY_MIN_RATE), and a copy retries for at least two such
attempts (`copy_budget_s`). A failed copy says which file, how many bytes, which part and how long.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dynamicrubric.store.s3 as s3
from dynamicrubric.store.folders import (
    COMPLETE_MARKER,
    VERSIONS_DIR,
    download_dir,
    file_key,
    new_token,
    publish_or_abandon,
    read_manifest,
    upload_dir,
)
from dynamicrubric.store.unpublished import abandon_version
from dynamicrubric.store.uris import StoreError, is_s3, split_s3

# Above this a file is copied in parts. S3 allows 5 MiB to 5 GiB a part and 10,000 parts: 256 MiB parts
# copy a 16 GB shard in 64 requests, and each answers within minutes even on a slow store.
COPY_PART_SIZE = 256 << 20
# The slowest copy rate a part is given time for: a store's disks shared by eight copies at once.
COPY_MIN_RATE = 1 << 20  # bytes a second
# The least a copy is given, whatever its size: a small copy queued behind large ones answers late too.
COPY_MIN_TIMEOUT_S = 120.0
COPY_TIMEOUT_ENV = "DYNRUBRIC_S3_COPY_TIMEOUT_S"


def copy_timeout_s() -> float:
    """How long one attempt of a copy call waits for its answer: a whole COPY_PART_SIZE part at
    COPY_MIN_RATE (256 s), at least COPY_MIN_TIMEOUT_S; or DYNRUBRIC_S3_COPY_TIMEOUT_S. Never less than
    the shared read timeout."""
    raw = os.environ.get(COPY_TIMEOUT_ENV, "")
    try:
        timeout = float(raw) if raw else max(COPY_PART_SIZE / COPY_MIN_RATE, COPY_MIN_TIMEOUT_S)
    except ValueError:
        raise StoreError(f"{COPY_TIMEOUT_ENV}={raw!r}: expected a number of seconds") from None
    return max(timeout, s3.read_timeout_s())


def copy_budget_s() -> float:
    """How long a copy call retries: the store's retry budget, and at least two whole attempts."""
    return max(s3.retry_budget_s(), 2 * copy_timeout_s())


def copy_dir(src_uri: str, dst_uri: str) -> None:
    """Publish the complete folder at `src_uri` at `dst_uri` (see the module docstring); refuses a
    source without its marker. S3 to S3 is server-side; other pairs stream through a temp folder."""
    if not (is_s3(src_uri) and is_s3(dst_uri)):
        with tempfile.TemporaryDirectory(prefix="dynrubric-copy-") as tmp:
            upload_dir(download_dir(src_uri, Path(tmp) / "folder"), dst_uri)
        return
    manifest = read_manifest(src_uri)
    if manifest is None:
        raise StoreError(f"{src_uri}: folder is absent or incomplete (no {COMPLETE_MARKER} marker)")
    if manifest["files"] is None:  # written before manifests existed: no checksums to carry over
        raise StoreError(f"{src_uri}: an empty {COMPLETE_MARKER} marker lists no files to copy")
    src_bucket, src_prefix = split_s3(src_uri.rstrip("/") + "/")
    bucket, prefix = split_s3(dst_uri.rstrip("/") + "/")
    token = new_token()
    try:
        for rel, entry in sorted(manifest["files"].items()):
            source = (src_bucket, file_key(src_prefix, manifest, rel))
            target = f"{prefix}{VERSIONS_DIR}/{token}/{rel}"
            _copy_object(dst_uri, rel, source, bucket, target, entry["size"])
    except BaseException:
        abandon_version(dst_uri, token)
        raise
    # the marker last, then the version it named before goes, as for any writer of the folder
    publish_or_abandon(dst_uri, token, manifest["files"])


def _copy_object(uri: str, rel: str, source: tuple[str, str], bucket: str, key: str, size: int) -> None:
    """File `rel` copied server-side to bucket/key, checked to have `size` bytes once there."""
    client = s3.s3_client()
    copy_source = {"Bucket": source[0], "Key": source[1]}
    if size <= COPY_PART_SIZE:
        _copy_call(uri, f"copying {rel} ({size} bytes)", client.copy_object,
                   CopySource=copy_source, Bucket=bucket, Key=key)  # fmt: skip
    else:
        _copy_in_parts(uri, rel, copy_source, bucket, key, size)
    copied = s3.s3_call(uri, client.head_object, Bucket=bucket, Key=key)["ContentLength"]
    if copied != size:
        raise StoreError(f"{uri}: {rel} is {copied} bytes once copied, its manifest says {size}")


def _copy_call(
    uri: str, what: str, fn: Callable[..., dict], stop: threading.Event | None = None, **kwargs: Any
) -> dict:
    """One copy request, with the copy's own timeout and budget; a failure says what was copied and for
    how long, after the store's reason."""
    started = time.monotonic()
    try:
        return s3.s3_call(uri, fn, budget_s=copy_budget_s(), timeout_s=copy_timeout_s(), stop=stop, **kwargs)
    except StoreError as e:
        reason = str(e).removeprefix(f"{uri}: ")
        raise StoreError(f"{uri}: {what} failed after {time.monotonic() - started:.0f} s: {reason}") from e


def _copy_in_parts(uri: str, rel: str, copy_source: dict, bucket: str, key: str, size: int) -> None:
    client = s3.s3_client()
    upload_id = s3.s3_call(uri, client.create_multipart_upload, Bucket=bucket, Key=key)["UploadId"]
    count = -(-size // COPY_PART_SIZE)

    def copy_part(stop: threading.Event, number: int, start: int) -> dict:
        end = min(start + COPY_PART_SIZE, size) - 1
        what = f"copying {rel} ({size} bytes), part {number} of {count} (bytes {start}-{end})"
        part = {"Bucket": bucket, "Key": key, "UploadId": upload_id, "PartNumber": number}
        window = {"CopySource": copy_source, "CopySourceRange": f"bytes={start}-{end}"}
        resp = _copy_call(uri, what, client.upload_part_copy, stop, **part, **window)
        return {"ETag": resp["CopyPartResult"]["ETag"], "PartNumber": number}

    try:
        parts = s3.in_parts(copy_part, list(enumerate(range(0, size, COPY_PART_SIZE), start=1)))
        s3.s3_call(uri, client.complete_multipart_upload, Bucket=bucket, Key=key, UploadId=upload_id,
                    MultipartUpload={"Parts": parts})  # fmt: skip
    except BaseException:
        s3.abort_upload(uri, bucket, key, upload_id)
        raise
