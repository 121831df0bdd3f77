"""One file at a URI, local or on S3: read it, write it atomically, test and delete it, list the files
under a folder (raw), and `check_writable`, the check made before a stage computes anything.

A write is seen whole or not at all: locally a temp file in the target folder, then `os.replace`; on
S3 one PUT, or a multipart upload that only becomes visible once completed (`s3._upload`). Local
files get the mode a plain `open` would give them, not mkstemp's private 0600.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from pathlib import Path

import dynamicrubric.store.s3 as s3
from dynamicrubric.store.uris import StoreError, is_s3, local_path, split_s3


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
        return s3._s3_call(uri, lambda: s3._client().get_object(Bucket=bucket, Key=key)["Body"].read())
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
        s3._upload(uri, bucket, key, data)
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


def exists(uri: str) -> bool:
    if is_s3(uri):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        try:
            s3._s3_call(uri, s3._client().head_object, Bucket=bucket, Key=key)
            return True
        except StoreError as e:
            if isinstance(e.__cause__, ClientError) and s3._error_code(e.__cause__) in (
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
        s3._s3_call(uri, s3._client().delete_object, Bucket=bucket, Key=key)
    else:
        local_path(uri).unlink(missing_ok=True)


def list_files(uri: str) -> list[str]:
    """Relative paths of all files under a folder URI, sorted (raw: on S3 this includes `_versions/`)."""
    if is_s3(uri):
        bucket, prefix = split_s3(uri.rstrip("/") + "/")
        return sorted(k[len(prefix) :] for k in s3._list_keys(uri, bucket, prefix))
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
            s3._s3_call(uri, s3._client().put_object, Bucket=bucket, Key=probe, Body=b"")
        finally:
            with contextlib.suppress(StoreError):
                s3._s3_call(uri, s3._client().delete_object, Bucket=bucket, Key=probe, budget_s=5.0)
        s3.abort_stale_uploads(uri)
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
