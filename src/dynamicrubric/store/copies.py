"""A complete folder copied to another URI: on S3 by server-side copies, so no byte of it crosses the
copying process (a multi-node training task with 4Gi of memory and no disk to speak of publishes a
16 GB checkpoint this way); anywhere else through a local temp folder.

The copy is a folder of the folder protocol (store/folders.py) like any `upload_dir`: the files go
under the destination's own version `_versions/<token>/`, the marker (the source's manifest entries,
sizes and SHA-256 unchanged: a server-side copy is the same bytes, and each copy's size is checked
against its entry) is written last, and the version the destination's marker named before is deleted.
A copy that fails leaves the destination as it was (complete or absent) and deletes what it copied.

A file up to COPY_PART_SIZE is one CopyObject (S3 copies at most 5 GB in one); a larger one is a
multipart upload whose parts are UploadPartCopy ranges of the source, PART_CONCURRENCY at a time, as
s3transfer's managed copy does. Every call goes through the store's budgeted retries (`s3._s3_call`),
each part on its own; a failed multipart copy is aborted.
"""

from __future__ import annotations

import contextlib
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dynamicrubric.store.s3 as s3
from dynamicrubric.store.folders import (
    COMPLETE_MARKER,
    VERSIONS_DIR,
    _file_key,
    discard_version,
    download_dir,
    new_token,
    publish_version,
    read_manifest,
    upload_dir,
)
from dynamicrubric.store.uris import StoreError, is_s3, split_s3

# Above this a file is copied in parts. S3 allows 5 MiB to 5 GiB a part and 10,000 parts: 1 GiB parts
# copy a 16 GB shard in 16 requests, well inside both bounds.
COPY_PART_SIZE = 1 << 30


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
            source = (src_bucket, _file_key(src_prefix, manifest, rel))
            _copy_object(dst_uri, source, bucket, f"{prefix}{VERSIONS_DIR}/{token}/{rel}", entry["size"])
        # the marker last, then the version it named before goes, as for any writer of the folder
        publish_version(dst_uri, token, manifest["files"])
    except BaseException:
        with contextlib.suppress(Exception):
            discard_version(dst_uri, token)
        raise


def _copy_object(uri: str, source: tuple[str, str], bucket: str, key: str, size: int) -> None:
    """One object copied server-side to bucket/key, checked to have `size` bytes once there."""
    client = s3._client()
    copy_source = {"Bucket": source[0], "Key": source[1]}
    if size <= COPY_PART_SIZE:
        s3._s3_call(uri, client.copy_object, CopySource=copy_source, Bucket=bucket, Key=key)
    else:
        _copy_in_parts(uri, copy_source, bucket, key, size)
    copied = s3._s3_call(uri, client.head_object, Bucket=bucket, Key=key)["ContentLength"]
    if copied != size:
        raise StoreError(f"{uri}: {key} is {copied} bytes once copied, its manifest says {size}")


def _copy_in_parts(uri: str, copy_source: dict, bucket: str, key: str, size: int) -> None:
    client = s3._client()
    upload_id = s3._s3_call(uri, client.create_multipart_upload, Bucket=bucket, Key=key)["UploadId"]

    def copy_part(number: int, start: int) -> dict:
        end = min(start + COPY_PART_SIZE, size) - 1
        part = {"Bucket": bucket, "Key": key, "UploadId": upload_id, "PartNumber": number}
        window = {"CopySource": copy_source, "CopySourceRange": f"bytes={start}-{end}"}
        resp = s3._s3_call(uri, client.upload_part_copy, **part, **window)  # each part retried on its own
        return {"ETag": resp["CopyPartResult"]["ETag"], "PartNumber": number}

    try:
        pool = ThreadPoolExecutor(s3.PART_CONCURRENCY, thread_name_prefix="s3-copy-part")
        try:
            sent = [
                pool.submit(copy_part, n, o) for n, o in enumerate(range(0, size, COPY_PART_SIZE), start=1)
            ]
            parts = [future.result() for future in sent]  # the first failure raises here ...
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # ... and no part starts after it
        s3._s3_call(uri, client.complete_multipart_upload, Bucket=bucket, Key=key, UploadId=upload_id,
                    MultipartUpload={"Parts": parts})  # fmt: skip
    except BaseException:
        try:  # stored (and billed) until aborted; abort_stale_uploads collects one this cannot abort
            s3._s3_call(uri, client.abort_multipart_upload, Bucket=bucket, Key=key, UploadId=upload_id,
                        budget_s=min(s3.retry_budget_s(), 10.0))  # fmt: skip
        except StoreError as e:
            s3.log.warning("%s: could not abort the failed multipart copy %s: %s", uri, upload_id, e)
        raise
