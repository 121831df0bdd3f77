"""The S3 side of the store: one cached client configured from the AWS_* variables, the budgeted
retry around every call, error messages that name the URI, uploads (one PUT, or above
MULTIPART_THRESHOLD a multipart upload whose parts go up PART_CONCURRENCY at a time, aborted when it
fails), downloads of large files in ranged parts as many at a time, the process's bound on transfers
in flight (STREAMS), and listing and bulk deletion under a prefix.

Transient S3 failures (connection refused or reset, timeouts, 5xx, throttling) are retried with
exponential backoff for up to `DYNRUBRIC_S3_RETRY_BUDGET_S` seconds (default 120) per operation, so a
store that restarts during a stage's write does not throw away the stage's compute. A wrong credential,
a missing bucket or an endpoint still unreachable when the budget is spent raises `StoreError` with a
one-line message naming the URI.

The names with a leading underscore belong to the package: `files` and `folders` call them as
`s3._upload(...)`, looked up on this module at each call, so that a test replacing one here reaches
every caller.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dynamicrubric.store.uris import StoreError, is_s3, split_s3

# Named after the package, as the logger was before the store became one, so log lines read the same.
log = logging.getLogger(__package__)

MULTIPART_THRESHOLD = 64 * 1024 * 1024
PART_SIZE = 16 * 1024 * 1024
# Parts of one multipart upload in flight at once: one connection rarely fills a node's link to the
# store (a checkpoint's ~100 GB at 100-230 MB/s is minutes). A file's parts stream from the file;
# botocore's connection pool (10) has room for them.
PART_CONCURRENCY = 8
# Transfers (a PUT, a part, a GET's stream) in flight at once in this process, whatever mix of files and
# parts they belong to: the client's connection pool holds that many. A node's link to the store carries
# more streams than one process opens, so a checkpoint goes up faster when each rank sends its own files
# (training/checkpoints.py) than when one process sends them all.
STREAMS = 8
_streams = threading.BoundedSemaphore(STREAMS)
RETRY_BUDGET_ENV = "DYNRUBRIC_S3_RETRY_BUDGET_S"
DEFAULT_RETRY_BUDGET_S = 120.0
STALE_UPLOAD_ENV = "DYNRUBRIC_S3_STALE_UPLOAD_S"
DEFAULT_STALE_UPLOAD_S = 3600.0  # an unfinished multipart upload this old belongs to a dead writer

_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "OperationAborted",
}


@functools.cache
def _client():
    import boto3
    from botocore.config import Config

    # The endpoint is read from AWS_ENDPOINT_URL by botocore itself; region defaults for S3-compatibles.
    # botocore retries a few times quickly; `_s3_call` adds the long, budgeted backoff around that.
    config = Config(
        retries={"max_attempts": int(os.environ.get("DYNRUBRIC_S3_MAX_ATTEMPTS", "3")), "mode": "standard"},
        connect_timeout=float(os.environ.get("DYNRUBRIC_S3_CONNECT_TIMEOUT", "5")),
        read_timeout=60,
        s3={"addressing_style": "path"},
        signature_version="s3v4",
        max_pool_connections=STREAMS + 2,  # the transfers, and a listing or a marker beside them
    )
    return boto3.session.Session().client(
        "s3", region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), config=config
    )


def reset_client() -> None:
    """Forget the cached S3 client (after changing AWS_* variables)."""
    _client.cache_clear()


def retry_budget_s() -> float:
    """Seconds one S3 operation keeps retrying transient failures before it gives up."""
    raw = os.environ.get(RETRY_BUDGET_ENV, "")
    try:
        budget = float(raw) if raw else DEFAULT_RETRY_BUDGET_S
    except ValueError:
        raise StoreError(f"{RETRY_BUDGET_ENV}={raw!r}: expected a number of seconds") from None
    return max(budget, 0.0)


def _error_code(err: Exception) -> str:
    from botocore.exceptions import ClientError

    if isinstance(err, ClientError):
        return str(err.response.get("Error", {}).get("Code", ""))
    return ""


def _transient(err: Exception) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectionError,
        HTTPClientError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    if isinstance(err, ClientError):
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or _error_code(err) in _TRANSIENT_CODES
    return isinstance(
        err,
        ConnectionError
        | ConnectionClosedError
        | HTTPClientError
        | ReadTimeoutError
        | IncompleteReadError
        | ResponseStreamingError,
    )


def _s3_error(uri: str, err: Exception) -> StoreError:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(err, ClientError):
        code = _error_code(err)
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        reason = {
            "InvalidAccessKeyId": "the access key is not known to the store (check AWS_ACCESS_KEY_ID)",
            "SignatureDoesNotMatch": "the secret key is wrong (check AWS_SECRET_ACCESS_KEY)",
            "AccessDenied": "access denied for these credentials",
            "NoSuchBucket": "the bucket does not exist",
            "NoSuchKey": "no such object",
            "404": "no such object",
            "403": "access denied (check the AWS_* credentials)",
        }.get(code, f"{code or status}: {err.response.get('Error', {}).get('Message', '')}".strip())
        return StoreError(f"{uri}: {reason}")
    if isinstance(err, EndpointConnectionError):
        return StoreError(
            f"{uri}: cannot reach the S3 endpoint {err.kwargs.get('endpoint_url', '')} (check AWS_ENDPOINT_URL)"
        )
    if isinstance(err, NoCredentialsError):
        return StoreError(f"{uri}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
    return StoreError(f"{uri}: {type(err).__name__}: {err}".splitlines()[0])


@contextlib.contextmanager
def _stream():
    """Hold one of the process's STREAMS transfer slots (around one attempt: a retry's wait holds none)."""
    with _streams:
        yield


def _s3_call(
    uri: str, fn: Callable[..., Any], *args: Any, budget_s: float | None = None, **kwargs: Any
) -> Any:
    """Call `fn`, retrying transient failures with exponential backoff (0.5 s doubling to 8 s) until
    the retry budget is spent. A permanent failure (credentials, missing bucket) raises at once."""
    from botocore.exceptions import BotoCoreError, ClientError

    budget = retry_budget_s() if budget_s is None else budget_s
    deadline = time.monotonic() + budget
    delay, attempt = 0.5, 1
    while True:
        try:
            return fn(*args, **kwargs)
        except (ClientError, BotoCoreError) as e:
            left = deadline - time.monotonic()
            if not _transient(e) or left <= 0:
                err = _s3_error(uri, e)
                if attempt > 1:
                    err = StoreError(f"{err} (gave up after {attempt} attempts over {budget:.0f} s)")
                raise err from e
            log.warning(
                "%s: %s; retrying in %.1f s (attempt %d)", uri, _s3_error(uri, e), min(delay, left), attempt
            )
            time.sleep(min(delay, left))
            delay, attempt = min(delay * 2, 8.0), attempt + 1


def _upload(uri: str, bucket: str, key: str, source: bytes | Path) -> None:
    """One object from bytes or a local file: a PUT, or above MULTIPART_THRESHOLD a multipart upload."""
    size = len(source) if isinstance(source, bytes) else source.stat().st_size
    if size < MULTIPART_THRESHOLD:
        body = source if isinstance(source, bytes) else source.read_bytes()

        def put() -> None:
            with _stream():
                _client().put_object(Bucket=bucket, Key=key, Body=body)

        _s3_call(uri, put)
        return
    upload_id = _s3_call(uri, _client().create_multipart_upload, Bucket=bucket, Key=key)["UploadId"]

    def send_part(number: int, offset: int) -> dict:
        def attempt() -> dict:
            part = dict(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number)
            if isinstance(source, bytes):
                with _stream():
                    return _client().upload_part(**part, Body=source[offset : offset + PART_SIZE])
            # The part streamed from its window of the file (s3transfer's reader, as boto3's transfer
            # manager sends it): PART_CONCURRENCY parts in flight hold no part whole in memory.
            from s3transfer.utils import ReadFileChunk

            with _stream(), ReadFileChunk.from_filename(str(source), offset, PART_SIZE) as body:
                return _client().upload_part(**part, Body=body)

        resp = _s3_call(uri, attempt)  # each part retried on its own, within its budget
        return {"ETag": resp["ETag"], "PartNumber": number}

    try:
        pool = ThreadPoolExecutor(PART_CONCURRENCY, thread_name_prefix="s3-part")
        try:
            sent = [pool.submit(send_part, n, o) for n, o in enumerate(range(0, size, PART_SIZE), start=1)]
            parts = [future.result() for future in sent]  # the first failure raises here ...
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # ... and no part starts after it
        _s3_call(
            uri,
            _client().complete_multipart_upload,
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
    except BaseException:
        # Parts of an unfinished upload are stored (and billed) until aborted. If the store is down
        # this fails too; `abort_stale_uploads` (run by `check_writable`) collects those later.
        try:
            _s3_call(
                uri,
                _client().abort_multipart_upload,
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                budget_s=min(retry_budget_s(), 10.0),
            )
        except StoreError as e:
            log.warning("%s: could not abort the failed multipart upload %s: %s", uri, upload_id, e)
        raise


def _download_parts(uri: str, bucket: str, key: str, size: int, fd: int, chunk: int) -> None:
    """The object's bytes into the open file `fd` (`size` of them) by ranged GETs of PART_SIZE, up to
    PART_CONCURRENCY at a time, each written at its offset as it streams (`chunk` bytes in memory at a
    time) and retried on its own; the first failure stops further parts. The caller checks the whole."""

    def fetch_part(offset: int) -> None:
        end = min(offset + PART_SIZE, size) - 1

        def attempt() -> None:
            with _stream():
                body = _client().get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{end}")["Body"]
                try:
                    at = offset
                    for block in body.iter_chunks(chunk):  # botocore checks the part's length at the end
                        at += os.pwrite(fd, block, at)
                finally:
                    body.close()

        _s3_call(uri, attempt)

    pool = ThreadPoolExecutor(PART_CONCURRENCY, thread_name_prefix="s3-part")
    try:
        for future in [pool.submit(fetch_part, offset) for offset in range(0, size, PART_SIZE)]:
            future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def abort_stale_uploads(uri: str, older_than_s: float | None = None) -> int:
    """Abort unfinished multipart uploads under `uri` started more than `older_than_s` ago (default
    DYNRUBRIC_S3_STALE_UPLOAD_S, 1 hour: younger ones may belong to a live writer). Returns how many."""
    if not is_s3(uri):
        return 0
    from datetime import UTC, datetime

    if older_than_s is None:
        older_than_s = float(os.environ.get(STALE_UPLOAD_ENV, DEFAULT_STALE_UPLOAD_S))
    bucket, prefix = split_s3(uri)
    resp = _s3_call(uri, _client().list_multipart_uploads, Bucket=bucket, Prefix=prefix)
    now = datetime.now(UTC)
    aborted = 0
    for up in resp.get("Uploads", []):
        if (now - up["Initiated"]).total_seconds() >= older_than_s:
            _s3_call(
                uri, _client().abort_multipart_upload, Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"]
            )
            aborted += 1
    if aborted:
        log.info("%s: aborted %d interrupted multipart upload(s)", uri, aborted)
    return aborted


def _list_keys(uri: str, bucket: str, prefix: str) -> list[str]:
    def pages() -> list[str]:
        paginator = _client().get_paginator("list_objects_v2")
        return [
            obj["Key"]
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
            for obj in page.get("Contents", [])
        ]

    return _s3_call(uri, pages)


def _delete_keys(uri: str, bucket: str, keys: list[str]) -> None:
    for start in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[start : start + 1000]]
        _s3_call(uri, _client().delete_objects, Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
