"""Read and write URIs: a plain path, `file://...`, or `s3://bucket/key`.

S3 endpoint and credentials come from the standard AWS variables (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`), so MinIO, SeaweedFS and AWS all
work. Writes are atomic: locally a temp file in the target folder then `os.replace`; on S3 one PUT, or
a multipart upload that only becomes visible once completed. Transient S3 errors are retried with
backoff by botocore ("standard" retry mode); a wrong credential, a missing bucket or an unreachable
endpoint raises `StoreError` with a one-line message naming the URI.

Folders (model checkpoints) are uploaded file by file and marked complete last with a `_COMPLETE`
object, so a folder is either complete or treated as absent.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlparse

COMPLETE_MARKER = "_COMPLETE"
MULTIPART_THRESHOLD = 64 * 1024 * 1024


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


@functools.cache
def _client():
    import boto3
    from botocore.config import Config

    # The endpoint is read from AWS_ENDPOINT_URL by botocore itself; region defaults for S3-compatibles.
    config = Config(
        retries={"max_attempts": int(os.environ.get("DYNRUBRIC_S3_MAX_ATTEMPTS", "5")), "mode": "standard"},
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


def _s3_error(uri: str, err: Exception) -> StoreError:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "")
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


def _s3_call(uri: str, fn, *args, **kwargs):
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(*args, **kwargs)
    except (ClientError, BotoCoreError) as e:
        raise _s3_error(uri, e) from e


def read_bytes(uri: str) -> bytes:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        resp = _s3_call(uri, _client().get_object, Bucket=bucket, Key=key)
        return _s3_call(uri, resp["Body"].read)
    path = local_path(uri)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{uri}: no such file") from None
    except IsADirectoryError:
        raise StoreError(f"{uri}: is a folder, expected a file") from None


def write_bytes(uri: str, data: bytes) -> None:
    """Write atomically: readers see the old object or the whole new one, never a part."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        if len(data) < MULTIPART_THRESHOLD:
            _s3_call(uri, _client().put_object, Bucket=bucket, Key=key, Body=data)
        else:
            import io

            _s3_call(uri, _client().upload_fileobj, io.BytesIO(data), bucket, key, Config=_transfer_config())
        return
    path = local_path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def exists(uri: str) -> bool:
    if is_s3(uri):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        try:
            _client().head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise _s3_error(uri, e) from e
        except Exception as e:  # connection errors
            raise _s3_error(uri, e) from e
    return local_path(uri).exists()


def delete(uri: str) -> None:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        _s3_call(uri, _client().delete_object, Bucket=bucket, Key=key)
    else:
        local_path(uri).unlink(missing_ok=True)


def _transfer_config():
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=16 * 1024 * 1024)


def list_files(uri: str) -> list[str]:
    """Relative paths of all files under a folder URI, sorted."""
    if is_s3(uri):
        bucket, prefix = split_s3(uri.rstrip("/") + "/")
        paginator = _client().get_paginator("list_objects_v2")
        out: list[str] = []
        try:
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                out += [obj["Key"][len(prefix) :] for obj in page.get("Contents", [])]
        except Exception as e:
            raise _s3_error(uri, e) from e
        return sorted(out)
    root = local_path(uri)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def is_complete(uri: str) -> bool:
    """True when a folder was fully written (its completion marker exists)."""
    return exists(join(uri, COMPLETE_MARKER))


def upload_dir(local_dir: str | Path, uri: str) -> None:
    """Copy a local folder to `uri` and mark it complete last; an interrupted copy stays incomplete."""
    local_dir = Path(local_dir)
    files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)
    if is_s3(uri):
        bucket, prefix = split_s3(uri.rstrip("/") + "/")
        if exists(join(uri, COMPLETE_MARKER)):
            delete(join(uri, COMPLETE_MARKER))
        for p in files:
            key = prefix + str(p.relative_to(local_dir))
            _s3_call(uri, _client().upload_file, str(p), bucket, key, Config=_transfer_config())
        write_bytes(join(uri, COMPLETE_MARKER), b"")
        return
    dest = local_path(uri)
    if dest.resolve() == local_dir.resolve():
        write_bytes(str(dest / COMPLETE_MARKER), b"")
        return
    # Copy beside the destination, then swap it in with one rename.
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp"))
    try:
        for p in files:
            target = tmp / p.relative_to(local_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, target)
        (tmp / COMPLETE_MARKER).write_bytes(b"")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def download_dir(uri: str, local_dir: str | Path) -> Path:
    """Fetch a complete folder; refuses one without its completion marker."""
    if not is_complete(uri):
        raise StoreError(f"{uri}: folder is absent or incomplete (no {COMPLETE_MARKER} marker)")
    local_dir = Path(local_dir)
    if not is_s3(uri):
        return local_path(uri)
    bucket, prefix = split_s3(uri.rstrip("/") + "/")
    for rel in list_files(uri):
        target = local_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        _s3_call(uri, _client().download_file, bucket, prefix + rel, str(target), Config=_transfer_config())
    return local_dir
