"""Read and write URIs: a plain path, `file://...`, or `s3://bucket/key`.

S3 endpoint and credentials come from the standard AWS variables (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`), so MinIO, SeaweedFS and AWS all
work. Writes are atomic: locally a temp file in the target folder then `os.replace`; on S3 one PUT, or
a multipart upload that only becomes visible once completed (and is aborted when it fails).

Transient S3 failures (connection refused or reset, timeouts, 5xx, throttling) are retried with
exponential backoff for up to `DYNRUBRIC_S3_RETRY_BUDGET_S` seconds (default 120) per operation, so a
store that restarts during a stage's write does not throw away the stage's compute. A wrong credential,
a missing bucket or an endpoint still unreachable when the budget is spent raises `StoreError` with a
one-line message naming the URI.

Folders (model checkpoints, plots) are published whole, so a reader sees exactly one writer's complete
folder, or none:
- On S3 each writer uploads its files under its own sub-prefix `<folder>/_versions/<token>/`, then
  writes the `_COMPLETE` marker: a JSON manifest of the token and of every file with its size and
  SHA-256. Readers read only the files the marker lists, so two concurrent writers never mix (the last
  marker wins, and it names one writer's complete set) and a rewrite with fewer files never shows the
  old ones. The writer then deletes the version the marker named before its own.
- Locally a writer fills a temp folder beside the destination (marker included) and swaps it in with
  one atomic rename (`renameat2(RENAME_EXCHANGE)` where the filesystem has it). A reader that opens
  its files by path reads a pinned version (`pinned_folder`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

COMPLETE_MARKER = "_COMPLETE"
VERSIONS_DIR = "_versions"  # on S3, each writer's files of a folder live under _versions/<token>/
MULTIPART_THRESHOLD = 64 * 1024 * 1024
PART_SIZE = 16 * 1024 * 1024
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


# --------------------------------------------------------------------------------------------------
# S3 client, errors and retries


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


# --------------------------------------------------------------------------------------------------
# Files


def _umask() -> int:
    # Read without changing it (os.umask can only be read by setting it, which races other threads).
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _file_mode() -> int:
    """The mode a plain `open(path, "w")` would give: group- and world-readable unless the umask says not."""
    return 0o666 & ~_umask()


def _dir_mode() -> int:
    return 0o777 & ~_umask()


def read_bytes(uri: str) -> bytes:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        # The GET and the body's read are one operation: a stream cut off mid-way is retried whole.
        return _s3_call(uri, lambda: _client().get_object(Bucket=bucket, Key=key)["Body"].read())
    path = local_path(uri)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{uri}: no such file") from None
    except IsADirectoryError:
        raise StoreError(f"{uri}: is a folder, expected a file") from None
    except OSError as e:
        raise StoreError(f"{uri}: cannot read: {e.strerror}") from None


def _read_if_exists(uri: str) -> bytes | None:
    try:
        return read_bytes(uri)
    except StoreError as e:
        if str(e).endswith(("no such object", "no such file")):
            return None
        raise


def write_bytes(uri: str, data: bytes) -> None:
    """Write atomically: readers see the old object or the whole new one, never a part."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        _upload(uri, bucket, key, data)
        return
    path = local_path(uri)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise StoreError(f"{uri}: cannot write: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _file_mode())  # mkstemp makes 0600; artifacts are shared like any other file
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):  # named by the user's path: the temp file is ours, and it is gone
            raise StoreError(f"{uri}: cannot write: {e.strerror}") from None
        raise


def _upload(uri: str, bucket: str, key: str, source: bytes | Path) -> None:
    """One object from bytes or a local file: a PUT, or above MULTIPART_THRESHOLD a multipart upload."""
    size = len(source) if isinstance(source, bytes) else source.stat().st_size
    if size < MULTIPART_THRESHOLD:
        body = source if isinstance(source, bytes) else source.read_bytes()
        _s3_call(uri, _client().put_object, Bucket=bucket, Key=key, Body=body)
        return
    upload_id = _s3_call(uri, _client().create_multipart_upload, Bucket=bucket, Key=key)["UploadId"]
    try:
        parts = []
        with contextlib.ExitStack() as stack:
            f = None if isinstance(source, bytes) else stack.enter_context(open(source, "rb"))  # noqa: SIM115
            for number, offset in enumerate(range(0, size, PART_SIZE), start=1):
                if f is None:
                    chunk = source[offset : offset + PART_SIZE]
                else:
                    f.seek(offset)
                    chunk = f.read(PART_SIZE)
                resp = _s3_call(
                    uri,
                    _client().upload_part,
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=chunk,
                )
                parts.append({"ETag": resp["ETag"], "PartNumber": number})
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


def exists(uri: str) -> bool:
    if is_s3(uri):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        try:
            _s3_call(uri, _client().head_object, Bucket=bucket, Key=key)
            return True
        except StoreError as e:
            if isinstance(e.__cause__, ClientError) and _error_code(e.__cause__) in (
                "404",
                "NoSuchKey",
                "NotFound",
            ):
                return False
            raise
    return local_path(uri).exists()


def delete(uri: str) -> None:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        _s3_call(uri, _client().delete_object, Bucket=bucket, Key=key)
    else:
        local_path(uri).unlink(missing_ok=True)


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


def list_files(uri: str) -> list[str]:
    """Relative paths of all files under a folder URI, sorted (raw: on S3 this includes `_versions/`)."""
    if is_s3(uri):
        bucket, prefix = split_s3(uri.rstrip("/") + "/")
        return sorted(k[len(prefix) :] for k in _list_keys(uri, bucket, prefix))
    root = local_path(uri)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def check_writable(uri: str) -> None:
    """Fail fast, before any compute, when `uri` cannot be written: a missing bucket, an unreachable
    endpoint, wrong credentials, a read-only or non-folder local parent. Writes nothing that stays;
    on S3 it also aborts interrupted multipart uploads left under `uri` by dead writers."""
    if not uri:
        return
    if is_s3(uri):
        bucket, key = split_s3(uri)
        if not key:
            raise StoreError(f"{uri}: no object key after the bucket")
        probe = f"{key.rstrip('/')}.write-check-{uuid.uuid4().hex[:12]}"
        try:
            _s3_call(uri, _client().put_object, Bucket=bucket, Key=probe, Body=b"")
        finally:
            with contextlib.suppress(StoreError):
                _s3_call(uri, _client().delete_object, Bucket=bucket, Key=probe, budget_s=5.0)
        abort_stale_uploads(uri)
        return
    path = local_path(uri)
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        raise StoreError(f"{uri}: folder is not writable")
    # Create nothing: find the nearest existing ancestor and check that folders can be made in it.
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise StoreError(f"{uri}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise StoreError(f"{uri}: cannot write into {ancestor} (permission denied)")


# --------------------------------------------------------------------------------------------------
# Folders


def _new_token() -> str:
    # Time-ordered, then random: unique per writer, and sorts by when the writer started.
    return f"{time.time_ns():x}-{uuid.uuid4().hex[:12]}"


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return path.stat().st_size, h.hexdigest()


def _manifest(token: str, files: dict[str, Path]) -> bytes:
    entries = {}
    for rel, p in files.items():
        size, sha = _digest(p)
        entries[rel] = {"size": size, "sha256": sha}
    return json.dumps({"format": 1, "token": token, "files": entries}, indent=1, sort_keys=True).encode()


def read_manifest(uri: str) -> dict | None:
    """The completion marker of a folder: {"token", "files": {rel: {size, sha256}}}, or None when the
    folder is absent or incomplete. An empty marker (written before manifests existed) gives
    {"token": None, "files": None}: every file under the folder is its content."""
    data = _read_if_exists(join(uri, COMPLETE_MARKER))
    if data is None:
        return None
    if not data.strip():
        return {"token": None, "files": None}
    try:
        manifest = json.loads(data)
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no file list")
    except (ValueError, AttributeError) as e:
        raise StoreError(f"{join(uri, COMPLETE_MARKER)}: unreadable completion marker ({e})") from None
    return manifest


def _file_key(prefix: str, manifest: dict, rel: str) -> str:
    if manifest["token"] is None:
        return prefix + rel
    return f"{prefix}{VERSIONS_DIR}/{manifest['token']}/{rel}"


def is_complete(uri: str) -> bool:
    """True when a folder was fully written (its completion marker exists)."""
    return exists(join(uri, COMPLETE_MARKER))


def folder_file(uri: str, rel: str) -> str:
    """The URI to read file `rel` of the complete folder `uri` from (on S3: the current writer's copy)."""
    manifest = read_manifest(uri)
    if manifest is None:
        raise StoreError(f"{uri}: folder is absent or incomplete (no {COMPLETE_MARKER} marker)")
    if manifest["files"] is not None and rel not in manifest["files"]:
        raise StoreError(f"{uri}: the folder has no file {rel!r}")
    if not is_s3(uri):
        return join(uri, rel)
    bucket, prefix = split_s3(uri.rstrip("/") + "/")
    return f"s3://{bucket}/{_file_key(prefix, manifest, rel)}"


def _folder_files(local_dir: Path) -> dict[str, Path]:
    return {
        p.relative_to(local_dir).as_posix(): p
        for p in sorted(local_dir.rglob("*"))
        if p.is_file() and p.name != COMPLETE_MARKER
    }


def upload_dir(local_dir: str | Path, uri: str) -> None:
    """Publish a local folder at `uri` whole, its completion marker (the manifest) last. An interrupted
    copy stays invisible; concurrent writers never mix (see the module docstring)."""
    local_dir = Path(local_dir)
    files = _folder_files(local_dir)
    token = _new_token()
    if is_s3(uri):
        _upload_dir_s3(files, uri, token)
        return
    dest = local_path(uri)
    if dest.exists() and dest.resolve() == local_dir.resolve():
        write_bytes(str(dest / COMPLETE_MARKER), _manifest(token, files))
        return
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp"))
    except OSError as e:
        raise StoreError(f"{uri}: cannot write: {e.strerror}") from None
    try:
        for rel, p in files.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, target)
            os.chmod(target, _file_mode())
        (tmp / COMPLETE_MARKER).write_bytes(_manifest(token, files))
        os.chmod(tmp / COMPLETE_MARKER, _file_mode())
        for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
            os.chmod(d, _dir_mode())  # mkdtemp makes 0700
        _swap_in(tmp, dest, uri)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after a swap, this is the folder it replaced


def _upload_dir_s3(files: dict[str, Path], uri: str, token: str) -> None:
    bucket, prefix = split_s3(uri.rstrip("/") + "/")
    mine = f"{prefix}{VERSIONS_DIR}/{token}/"
    try:
        for rel, p in files.items():
            _upload(uri, bucket, mine + rel, p)
        previous = read_manifest(uri)
        write_bytes(join(uri, COMPLETE_MARKER), _manifest(token, files))
    except BaseException:
        with contextlib.suppress(Exception):
            _delete_keys(uri, bucket, _list_keys(uri, bucket, mine))
        raise
    # The version the marker named before ours is finished (its writer wrote the marker), so no writer
    # still adds to it; a reader still fetching it sees a file vanish and starts over from the marker.
    # A version no marker ever named (a writer that lost the race) stays until a later cleanup.
    with contextlib.suppress(StoreError):
        if previous is not None and previous["token"] != token:
            if previous["token"] is None:  # the old flat layout: everything but the versions and marker
                old = [
                    k
                    for k in _list_keys(uri, bucket, prefix)
                    if not k.startswith(f"{prefix}{VERSIONS_DIR}/") and k != prefix + COMPLETE_MARKER
                ]
            else:
                old = _list_keys(uri, bucket, f"{prefix}{VERSIONS_DIR}/{previous['token']}/")
            _delete_keys(uri, bucket, old)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool | None:
    """Atomically swap two paths (Linux renameat2). True: swapped; False: `b` is gone; None: the
    system or filesystem cannot exchange."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        return None
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        return False
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return None
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(tmp: Path, dest: Path, uri: str) -> None:
    """Make the finished folder `tmp` appear at `dest`, replacing what is there, with no moment at which
    `dest` holds a mix. Another writer may swap in its own folder at any time; the last one stays."""
    for _ in range(1000):
        try:
            os.rename(tmp, dest)  # dest absent (or an empty folder): done
            return
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                raise StoreError(f"{uri}: exists and is not a folder") from None
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise StoreError(f"{uri}: cannot write: {e.strerror}") from None
        swapped = _exchange(tmp, dest)
        if swapped:
            return  # `tmp` now holds the folder that was replaced; the caller deletes it
        if swapped is None:
            # No atomic exchange here: move the old folder aside, then rename ours in. Readers may see
            # no folder for that moment (absent, never mixed).
            aside = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:12]}.old"
            with contextlib.suppress(FileNotFoundError):
                os.rename(dest, aside)
                shutil.rmtree(aside, ignore_errors=True)
    raise StoreError(f"{uri}: could not swap the folder in (other writers kept replacing it)")


def pinned_folder(folder: Path) -> Path:
    """`folder` as one writer left it, for a reader that opens its files one by one by path (as
    `from_pretrained` does). A rewrite swaps a whole new folder in at any moment, so such a reader could
    take some files from the old folder and some from the new. The files of one version (the marker's
    token, read before and after, and no token ever comes back) are hard-linked into a sibling
    `.<name>.v-<token>` that no writer touches again. A folder without a manifest (not written by
    upload_dir) is returned as it is."""
    for _ in range(100):
        manifest = read_manifest(str(folder))
        if manifest is None or manifest["token"] is None or folder.name.endswith(f".v-{manifest['token']}"):
            return folder  # not ours, or already a pinned version
        pinned = folder.parent / f".{folder.name}.v-{manifest['token']}"
        if (pinned / COMPLETE_MARKER).is_file():
            return pinned
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
        try:
            for rel in [*manifest["files"], COMPLETE_MARKER]:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(folder / rel, tmp / rel)
                except FileNotFoundError:
                    break  # swapped out under us: the token check below starts over
            again = read_manifest(str(folder))
            if again is not None and again["token"] == manifest["token"]:
                os.chmod(tmp, _dir_mode())
                with contextlib.suppress(OSError):  # another reader pinned this version first
                    os.rename(tmp, pinned)
                return pinned
        except OSError as e:
            raise StoreError(f"{folder}: cannot pin a version to read: {e.strerror}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise StoreError(f"{folder}: kept being rewritten while it was read")


def download_dir(uri: str, local_dir: str | Path) -> Path:
    """Fetch a complete folder (exactly the files its marker lists); refuses one without its marker.
    A local folder is returned where it is."""
    local_dir = Path(local_dir)
    if not is_s3(uri):
        if read_manifest(uri) is None:
            raise StoreError(f"{uri}: folder is absent or incomplete (no {COMPLETE_MARKER} marker)")
        return local_path(uri)
    bucket, prefix = split_s3(uri.rstrip("/") + "/")
    for _ in range(5):
        manifest = read_manifest(uri)
        if manifest is None:
            raise StoreError(f"{uri}: folder is absent or incomplete (no {COMPLETE_MARKER} marker)")
        if manifest["files"] is None:  # old flat layout
            rels = [
                r for r in list_files(uri) if r != COMPLETE_MARKER and not r.startswith(f"{VERSIONS_DIR}/")
            ]
        else:
            rels = sorted(manifest["files"])
        written: list[Path] = []
        try:
            for rel in rels:
                data = read_bytes(f"s3://{bucket}/{_file_key(prefix, manifest, rel)}")
                expected = (manifest["files"] or {}).get(rel)
                if expected and (
                    len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]
                ):
                    raise StoreError(f"{uri}: {rel} does not match its checksum in {COMPLETE_MARKER}")
                write_bytes(str(local_dir / rel), data)
                written.append(local_dir / rel)
        except StoreError as e:
            # A newer writer replaced the folder and deleted the version we were reading: start over.
            if (
                str(e).endswith("no such object")
                and (read_manifest(uri) or {}).get("token") != manifest["token"]
            ):
                log.info("%s: replaced while downloading; fetching the new version", uri)
                for p in written:  # none of the replaced version may stay beside the new one
                    p.unlink(missing_ok=True)
                continue
            raise
        (local_dir / COMPLETE_MARKER).write_bytes(json.dumps(manifest).encode())
        return local_dir
    raise StoreError(f"{uri}: the folder kept being replaced while it was downloaded")


def delete_dir(uri: str) -> None:
    """Remove a folder and everything under it (missing is fine)."""
    if is_s3(uri):
        bucket, prefix = split_s3(uri.rstrip("/") + "/")
        keys = _list_keys(uri, bucket, prefix)
        marker = prefix + COMPLETE_MARKER
        # The marker first, so that readers see the folder as absent, never as a part.
        if marker in keys:
            delete(join(uri, COMPLETE_MARKER))
        _delete_keys(uri, bucket, [k for k in keys if k != marker])
    else:
        path = local_path(uri)
        shutil.rmtree(path, ignore_errors=True)
        for pinned in path.parent.glob(f".{path.name}.v-*"):  # versions readers pinned (pinned_folder)
            shutil.rmtree(pinned, ignore_errors=True)


@contextlib.contextmanager
def outputs_as_a_set(*uris: str) -> Iterator[list[str]]:
    """Local stand-ins for a stage's outputs, published together when the block succeeds.

    Inside the block the stage writes to the yielded paths (files or folders). If the block raises,
    nothing is published. If publishing fails part-way, the outputs already published are deleted, so
    a stage leaves all of its outputs or none (empty URIs pass through as "")."""
    with tempfile.TemporaryDirectory(prefix="dynrubric-outputs-") as tmp:
        paths = [
            str(Path(tmp, f"{i}-{Path(u.rstrip('/')).name or 'out'}")) if u else ""
            for i, u in enumerate(uris)
        ]
        yield paths
        published: list[tuple[str, bool]] = []
        try:
            for path, uri in zip(paths, uris, strict=True):
                p = Path(path)
                if not uri or not p.exists():
                    continue
                if p.is_dir():
                    upload_dir(p, uri)
                else:
                    write_bytes(uri, p.read_bytes())
                published.append((uri, p.is_dir()))
        except BaseException:
            for uri, is_dir in published:
                try:
                    delete_dir(uri) if is_dir else delete(uri)
                except Exception as e:  # the store may be why publishing failed
                    log.warning("%s: could not remove a partly published output: %s", uri, e)
            raise
