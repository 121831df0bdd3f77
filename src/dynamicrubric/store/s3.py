"""The S3 side of the store: one cached client configured from the AWS_* variables, the budgeted
retry around every call, error messages that name the URI, uploads (one PUT, or above
MULTIPART_THRESHOLD a multipart upload whose parts go up PART_CONCURRENCY at a time, aborted when it
fails), downloads of large files in ranged parts as many at a time, the process's bound on transfers
in flight (STREAMS), and listing and bulk deletion under a prefix.

Transient S3 failures (connection refused or reset, timeouts, 5xx, throttling) are retried with
exponential backoff for up to `DYNRUBRIC_S3_RETRY_BUDGET_S` seconds (default 120) per call (a PUT, a
part, a listing), so a store that restarts during a stage's write does not throw away the stage's
compute. A wrong credential, a missing bucket or an endpoint still unreachable when the budget is spent
raises `StoreError` with a one-line message naming the user's URI (never a request's URL).

The budget bounds each call, a frozen server included (one that accepts connections and never answers):
the store makes every attempt itself (botocore's own retries are off: they waited out the read timeout
up to three times inside one attempt of ours) and gives each attempt the time left as its read timeout
(`DYNRUBRIC_S3_READ_TIMEOUT_S`, default 60 s, at most; botocore's per-request `read_timeout` context,
botocore/httpsession.py `_get_request_timeout`). What a call may take beyond its budget, the slack:
- a call's first attempt waits at least MIN_ATTEMPT_S (2 s) for an answer, whatever its budget;
- a request body that stops moving (the server's buffers full) fails after the connect timeout
  (`DYNRUBRIC_S3_CONNECT_TIMEOUT`, 2 s), the socket timeout urllib3 sends under (urllib3/connectionpool.py
  `_make_request`), whatever is left of the budget;
- a write that failed then cleans up after itself (aborts its multipart upload, deletes its unpublished
  files) with CLEANUP_BUDGET_S (1 s) for each of those two steps; what that cannot remove is removed by
  the next write of the folder (store/folders.py), or by `store.clean_unpublished` on the work prefix.
So a write that fails ends within its budget plus FAILURE_SLACK_S (7 s: those, and 3 s for the retry
loop's own waits on a loaded machine) after the call that failed began. Server-side copies answer only
when they are done, so they wait and retry longer (store/copies.py `copy_timeout_s`, `copy_budget_s`).

The names with a leading underscore belong to the package: `files` and `folders` call them as
`s3.upload_object(...)`, looked up on this module at each call, so that a test replacing one here reaches
every caller.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
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
READ_TIMEOUT_ENV = "DYNRUBRIC_S3_READ_TIMEOUT_S"
DEFAULT_READ_TIMEOUT_S = 60.0  # the longest an attempt waits for an answer (less when less budget is left)
CONNECT_TIMEOUT_ENV = "DYNRUBRIC_S3_CONNECT_TIMEOUT"
# Also how long a request's body may stall (urllib3 sends under it): a slow connect is retried anyway.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
MIN_ATTEMPT_S = 2.0  # the least a call's first attempt waits for an answer, whatever its budget
CLEANUP_BUDGET_S = 1.0  # each cleanup step of a failed write (an abort; the unpublished files' deletion)
# See the module docstring: the first attempt's floor or a stalled send, the two cleanup steps, and 3 s
# for the retry loop's own waits and a loaded machine's scheduling.
FAILURE_SLACK_S = max(MIN_ATTEMPT_S, DEFAULT_CONNECT_TIMEOUT_S) + 2 * CLEANUP_BUDGET_S + 3.0

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


# The read timeout of the attempt this thread is making (`s3_call` sets it around each attempt).
_attempt = threading.local()


def _attempt_timeout(context: dict, **kwargs: Any) -> None:
    """botocore's before-call hook: the attempt's read timeout into the request's context, which the
    HTTP session reads for that one request (botocore/httpsession.py `_get_request_timeout`)."""
    timeout = getattr(_attempt, "read_timeout", None)
    if timeout is not None:
        context["read_timeout"] = timeout


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise StoreError(f"{env}={raw!r}: expected a number of seconds") from None


@functools.cache
def s3_client():
    import boto3
    from botocore.config import Config

    # The endpoint is read from AWS_ENDPOINT_URL by botocore itself; region defaults for S3-compatibles.
    # One attempt per call: `s3_call` makes the retries, each with the time its budget has left.
    config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=_seconds(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S),
        read_timeout=read_timeout_s(),
        s3={"addressing_style": "path"},
        signature_version="s3v4",
        max_pool_connections=STREAMS + 2,  # the transfers, and a listing or a marker beside them
    )
    client = boto3.session.Session().client(
        "s3", region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), config=config
    )
    client.meta.events.register("before-call.s3", _attempt_timeout)
    return client


def read_timeout_s() -> float:
    """The longest one attempt of an S3 call waits for an answer (DYNRUBRIC_S3_READ_TIMEOUT_S)."""
    return max(_seconds(READ_TIMEOUT_ENV, DEFAULT_READ_TIMEOUT_S), MIN_ATTEMPT_S)


def reset_client() -> None:
    """Forget the cached S3 client (after changing AWS_* variables)."""
    s3_client.cache_clear()


def retry_budget_s() -> float:
    """Seconds one S3 operation keeps retrying transient failures before it gives up."""
    return max(_seconds(RETRY_BUDGET_ENV, DEFAULT_RETRY_BUDGET_S), 0.0)


def error_code(err: Exception) -> str:
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
        return status >= 500 or error_code(err) in _TRANSIENT_CODES
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
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(err, ClientError):
        code = error_code(err)
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
    # botocore's messages for these name the request's URL (a part's carries its uploadId): the user's
    # URI says which object, the endpoint (without the request's path) where.
    if isinstance(err, EndpointConnectionError | ConnectTimeoutError):
        return StoreError(f"{uri}: cannot reach the S3 endpoint {_endpoint(err)} (check AWS_ENDPOINT_URL)")
    if isinstance(err, ReadTimeoutError):
        return StoreError(f"{uri}: no answer from the S3 endpoint {_endpoint(err)} in time (read timeout)")
    if isinstance(err, ConnectionClosedError):
        return StoreError(f"{uri}: the S3 endpoint {_endpoint(err)} closed the connection before answering")
    if isinstance(err, NoCredentialsError):
        return StoreError(f"{uri}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
    text = re.sub(r"\w+://\S+", lambda m: _endpoint_of(m.group(0)), str(err))  # no request URL
    return StoreError(f"{uri}: {type(err).__name__}: {text}".splitlines()[0])


def _endpoint(err: Exception) -> str:
    return _endpoint_of(getattr(err, "kwargs", {}).get("endpoint_url") or "")


def _endpoint_of(url: str) -> str:
    """scheme://host:port of a request URL, without its path and query."""
    from urllib.parse import urlsplit

    parts = urlsplit(url.strip("\"'"))
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else ""


def may_have_landed(err: StoreError) -> bool:
    """Whether the write that raised `err` may have been stored all the same: it ended without an answer
    (a timeout, a dropped connection, a 5xx), not with the store's refusal."""
    cause = err.__cause__
    return cause is not None and _transient(cause)


@contextlib.contextmanager
def transfer_slot(stop: threading.Event | None = None):
    """Hold one of the process's STREAMS transfer slots (around one attempt: a retry's wait holds none).
    A part whose sibling failed while it waited for its slot does not start (`in_parts`)."""
    with _streams:
        if stop is not None and stop.is_set():
            raise _Stopped("a sibling part failed")
        yield


def s3_call(
    uri: str,
    fn: Callable[..., Any],
    *args: Any,
    budget_s: float | None = None,
    timeout_s: float | None = None,
    stop: threading.Event | None = None,
    **kwargs: Any,
) -> Any:
    """Call `fn`, retrying transient failures with exponential backoff (0.5 s doubling to 8 s) until
    the retry budget is spent; each attempt waits for an answer at most the time left (at most
    `timeout_s`, by default the read timeout, and an explicit `budget_s`; the first attempt at least
    MIN_ATTEMPT_S within those). A permanent failure (credentials, missing bucket) raises at once, and
    so does a transient one once `stop` is set (a sibling part failed: the whole write is over)."""
    from botocore.exceptions import BotoCoreError, ClientError

    budget = retry_budget_s() if budget_s is None else budget_s
    longest = read_timeout_s() if timeout_s is None else timeout_s
    if budget_s is not None:  # a caller's own short budget (a cleanup step) bounds its attempts too
        longest = min(longest, max(budget_s, 0.5))
    deadline = time.monotonic() + budget
    delay, attempt, outer = 0.5, 1, getattr(_attempt, "read_timeout", None)
    while True:
        left = deadline - time.monotonic()
        # The first attempt gets a fair chance however small the budget; a retry only what is left.
        floor = min(MIN_ATTEMPT_S, longest) if attempt == 1 else 0.1
        _attempt.read_timeout = max(floor, min(longest, left))
        try:
            return fn(*args, **kwargs)
        except (ClientError, BotoCoreError) as e:
            left = deadline - time.monotonic()
            if not _transient(e) or left <= 0 or (stop is not None and stop.is_set()):
                err = _s3_error(uri, e)
                if attempt > 1 or left <= 0:
                    plural = "s" if attempt > 1 else ""
                    err = StoreError(f"{err} (gave up after {attempt} attempt{plural} over {budget:.0f} s)")
                raise err from e
            log.warning("%s; retrying in %.1f s (attempt %d)", _s3_error(uri, e), min(delay, left), attempt)
            time.sleep(min(delay, left))
            delay, attempt = min(delay * 2, 8.0), attempt + 1
        finally:
            _attempt.read_timeout = outer


def upload_object(
    uri: str, bucket: str, key: str, source: bytes | Path, stop: threading.Event | None = None
) -> None:
    """One object from bytes or a local file: a PUT, or above MULTIPART_THRESHOLD a multipart upload.
    With `stop` (the write's, see `in_parts`) it ends once another file of the same write failed."""
    size = len(source) if isinstance(source, bytes) else source.stat().st_size
    if size < MULTIPART_THRESHOLD:
        body = source if isinstance(source, bytes) else source.read_bytes()

        def put() -> None:
            with transfer_slot(stop):
                s3_client().put_object(Bucket=bucket, Key=key, Body=body)

        s3_call(uri, put, stop=stop)
        return
    create = s3_client().create_multipart_upload
    upload_id = s3_call(uri, create, Bucket=bucket, Key=key, stop=stop)["UploadId"]

    def send_part(stop: threading.Event, number: int, offset: int) -> dict:
        def attempt() -> dict:
            part = dict(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number)
            if isinstance(source, bytes):
                with transfer_slot(stop):
                    return s3_client().upload_part(**part, Body=source[offset : offset + PART_SIZE])
            # The part streamed from its window of the file (s3transfer's reader, as boto3's transfer
            # manager sends it): PART_CONCURRENCY parts in flight hold no part whole in memory.
            from s3transfer.utils import ReadFileChunk

            with transfer_slot(stop), ReadFileChunk.from_filename(str(source), offset, PART_SIZE) as body:
                return s3_client().upload_part(**part, Body=body)

        resp = s3_call(uri, attempt, stop=stop)  # each part retried on its own, within its budget
        return {"ETag": resp["ETag"], "PartNumber": number}

    try:
        parts = in_parts(send_part, list(enumerate(range(0, size, PART_SIZE), start=1)), stop)
        s3_call(
            uri,
            s3_client().complete_multipart_upload,
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
    except BaseException:
        abort_upload(uri, bucket, key, upload_id)
        raise


class _Stopped(StoreError):
    """A part that did not start because a sibling part had failed (never raised to a caller)."""


def in_parts(
    fn: Callable[..., Any], items: list[tuple], stop: threading.Event | None = None, workers: int = 0
) -> list[Any]:
    """fn(stop, *item) for every item, `workers` (default PART_CONCURRENCY) at a time; the results in
    order. The first failure sets `stop`: each part's retries end (`s3_call`), no part starts after it
    (a pool thread freed by it would otherwise take the next part, with a budget of its own), nor does
    a part that was waiting for a transfer slot (`transfer_slot`); that first failure is what is raised. A
    caller's `stop` is shared: the files of one write and their parts all end when one fails."""
    stop = threading.Event() if stop is None else stop
    first, lock = [], threading.Lock()

    def part(*item: Any) -> Any:
        if stop.is_set():
            raise _Stopped("a sibling part failed")
        try:
            return fn(stop, *item)
        except BaseException as e:
            with lock:
                if not first and not isinstance(e, _Stopped):
                    first.append(e)
            stop.set()
            raise

    pool = ThreadPoolExecutor(workers or PART_CONCURRENCY, thread_name_prefix="s3-part")
    try:
        futures = [pool.submit(part, *item) for item in items]
        results, failed = [], None
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as e:
                failed = e
                break
        if failed is None:
            return results
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)  # the parts in flight end first
        raise first[0] if first else failed  # the first failure, its __cause__ (botocore's error) kept
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def abort_upload(uri: str, bucket: str, key: str, upload_id: str) -> None:
    """Abort a failed multipart upload (its parts are stored, and billed, until then), within the
    cleanup budget: one the store does not answer is aborted by the next write of its folder or by
    `abort_stale_uploads`."""
    try:
        s3_call(uri, s3_client().abort_multipart_upload, Bucket=bucket, Key=key, UploadId=upload_id,
                 budget_s=CLEANUP_BUDGET_S, timeout_s=CLEANUP_BUDGET_S)  # fmt: skip
    except StoreError as e:
        log.warning("%s: could not abort its failed multipart upload: %s", uri, e)


def download_parts(uri: str, bucket: str, key: str, size: int, fd: int, chunk: int) -> None:
    """The object's bytes into the open file `fd` (`size` of them) by ranged GETs of PART_SIZE, up to
    PART_CONCURRENCY at a time, each written at its offset as it streams (`chunk` bytes in memory at a
    time) and retried on its own; the first failure stops further parts. The caller checks the whole."""

    def fetch_part(stop: threading.Event, offset: int) -> None:
        end = min(offset + PART_SIZE, size) - 1

        def attempt() -> None:
            with transfer_slot(stop):
                body = s3_client().get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{end}")["Body"]
                try:
                    at = offset
                    for block in body.iter_chunks(chunk):  # botocore checks the part's length at the end
                        at += os.pwrite(fd, block, at)
                finally:
                    body.close()

        s3_call(uri, attempt, stop=stop)

    in_parts(fetch_part, [(offset,) for offset in range(0, size, PART_SIZE)])


def stale_age_s() -> float:
    """How old an unfinished multipart upload or an unpublished version must be before a cleanup
    takes it for a dead writer's (DYNRUBRIC_S3_STALE_UPLOAD_S, default 1 hour)."""
    return max(_seconds(STALE_UPLOAD_ENV, DEFAULT_STALE_UPLOAD_S), 0.0)


def abort_stale_uploads(uri: str, older_than_s: float | None = None, budget_s: float | None = None) -> int:
    """Abort unfinished multipart uploads under `uri` started more than `older_than_s` ago (default
    `stale_age_s()`: younger ones may belong to a live writer). Returns how many. Each store call
    within `budget_s` (default: the retry budget)."""
    if not is_s3(uri):
        return 0
    from datetime import UTC, datetime

    if older_than_s is None:
        older_than_s = stale_age_s()
    bucket, prefix = split_s3(uri)
    uploads = []
    pages = {"Bucket": bucket, "Prefix": prefix}
    while True:  # a listing answers at most 1000
        resp = s3_call(uri, s3_client().list_multipart_uploads, **pages, budget_s=budget_s)
        uploads += resp.get("Uploads", [])
        if not (resp.get("IsTruncated") and resp.get("NextKeyMarker")):
            break
        pages.update(KeyMarker=resp["NextKeyMarker"], UploadIdMarker=resp.get("NextUploadIdMarker", ""))
    now = datetime.now(UTC)
    aborted = 0
    for up in uploads:
        if (now - up["Initiated"]).total_seconds() >= older_than_s:
            s3_call(uri, s3_client().abort_multipart_upload, Bucket=bucket, Key=up["Key"],
                     UploadId=up["UploadId"], budget_s=budget_s)  # fmt: skip
            aborted += 1
    if aborted:
        log.info("%s: aborted %d interrupted multipart upload(s)", uri, aborted)
    return aborted


def list_keys(uri: str, bucket: str, prefix: str, budget_s: float | None = None) -> list[str]:
    def pages() -> list[str]:
        paginator = s3_client().get_paginator("list_objects_v2")
        return [
            obj["Key"]
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
            for obj in page.get("Contents", [])
        ]

    return s3_call(uri, pages, budget_s=budget_s)


def delete_keys(uri: str, bucket: str, keys: list[str], budget_s: float | None = None) -> None:
    for start in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[start : start + 1000]]
        s3_call(uri, s3_client().delete_objects, Bucket=bucket, Delete={"Objects": batch, "Quiet": True},
                 budget_s=budget_s)  # fmt: skip
