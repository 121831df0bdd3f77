"""One file at a URI, local or on S3: read it, write it atomically, test and delete it, list the files
under a folder (raw), and `check_writable`, the check made before a stage computes anything.

A write is seen whole or not at all: locally a temp file in the target folder, then `os.replace`; on
S3 one PUT, or a multipart upload that only becomes visible once completed (`s3.upload_object`). Local
files get the mode a plain `open` would give them, not mkstemp's private 0600.

`read_bytes`/`write_bytes` hold the whole file in memory: for small files (configs, results, tables).
`download_file`/`upload_file` copy between a URI and a local file in chunks, so a model shard of any
size needs a few MiB of memory; a download is hashed as it streams and checked before it appears.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

import dynamicrubric.store.s3 as s3
from dynamicrubric.store.uris import StoreError, is_s3, local_path, short_name, split_s3


def _umask() -> int:
    # Read without changing it (os.umask can only be read by setting it, which races other threads).
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def file_mode() -> int:
    """The mode a plain `open(path, "w")` would give: group- and world-readable unless the umask says not."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    return 0o777 & ~_umask()


def read_bytes(uri: str) -> bytes:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        # The GET and the body's read are one operation: a stream cut off mid-way is retried whole.
        return s3.s3_call(uri, lambda: s3.s3_client().get_object(Bucket=bucket, Key=key)["Body"].read())
    path = local_path(uri)
    try:
        check_regular_file(uri, path)
        return path.read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{uri}: no such file") from None
    except IsADirectoryError:
        raise StoreError(f"{uri}: is a folder, expected a file") from None
    except OSError as e:
        raise StoreError(f"{uri}: cannot read: {e.strerror}") from None


def check_regular_file(uri: str, path: Path) -> None:
    """Refuse, before opening it, a path that is not a regular file: opening a FIFO blocks until a
    writer comes (forever, for a stage), and a device reads without end."""
    mode = path.stat().st_mode  # FileNotFoundError and other OSErrors: the caller names them
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a folder")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise StoreError(f"{uri}: {kind}, not a regular file; give a file")


CHUNK = 1 << 20  # what a streamed copy holds in memory at a time


@contextlib.contextmanager
def _local_temp(uri: str, path: Path):
    """A temp file beside `path`, open for writing, moved to `path` (with a plain file's mode) when the
    block succeeds and removed when it fails: `path` holds the old file or the whole new one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{short_name(path.name)}.", suffix=".tmp")
    except OSError as e:
        raise StoreError(f"{uri}: cannot write: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())  # mkstemp makes 0600; artifacts are shared like any other file
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):  # named by the user's path: the temp file is ours, and it is gone
            raise StoreError(f"{uri}: cannot write: {e.strerror}") from None
        raise


def file_digest(fd: int) -> str:
    h = hashlib.sha256()
    at = 0
    while block := os.pread(fd, CHUNK, at):
        h.update(block)
        at += len(block)
    return h.hexdigest()


def download_file(uri: str, dest: str | Path, expected: dict | None = None) -> tuple[int, str]:
    """Copy the file at `uri` to the local file `dest` in chunks, atomically; returns its (size,
    sha256). With `expected` ({"size", "sha256"}) a copy that differs is refused and `dest` is left as
    it was. On S3 a transient failure mid-stream (a reset connection, a store restart) starts the file
    over from its first byte, within the retry budget of `s3.s3_call`; a file of a known size (from
    `expected`) above MULTIPART_THRESHOLD comes down in ranged parts, each started over on its own."""
    dest = Path(dest)
    with _local_temp(str(dest), dest) as f:

        def copy(chunks) -> tuple[int, str]:
            f.seek(0)
            f.truncate()  # a retried stream starts clean
            h = hashlib.sha256()
            for chunk in chunks:
                f.write(chunk)
                h.update(chunk)
            return f.tell(), h.hexdigest()  # the size on disk: what the check below compares

        if is_s3(uri) and expected is not None and expected["size"] >= s3.MULTIPART_THRESHOLD:
            # A large file of a folder (its size known from the manifest) comes down in concurrent parts;
            # its hash is taken from the disk once all are in.
            f.truncate(expected["size"])
            s3.download_parts(uri, *split_s3(uri), expected["size"], f.fileno(), CHUNK)
            size, sha = expected["size"], file_digest(f.fileno())
        elif is_s3(uri):
            bucket, key = split_s3(uri)

            def stream() -> tuple[int, str]:
                with s3.transfer_slot():
                    body = s3.s3_client().get_object(Bucket=bucket, Key=key)["Body"]
                    try:
                        return copy(body.iter_chunks(CHUNK))  # botocore checks the length at the end
                    finally:
                        body.close()

            size, sha = s3.s3_call(uri, stream)
        else:
            try:
                with open(local_path(uri), "rb") as src:
                    size, sha = copy(iter(lambda: src.read(CHUNK), b""))
            except FileNotFoundError:
                raise StoreError(f"{uri}: no such file") from None
            except IsADirectoryError:
                raise StoreError(f"{uri}: is a folder, expected a file") from None
        if expected is not None and (size, sha) != (expected["size"], expected["sha256"]):
            raise StoreError(
                f"{uri}: does not match its checksum ({size} bytes, sha256 {sha[:12]}…; expected "
                f"{expected['size']} bytes, {expected['sha256'][:12]}…)"
            )
    return size, sha


def upload_file(path: str | Path, uri: str) -> None:
    """Copy the local file `path` to `uri` atomically without holding it in memory (on S3 in parts
    above MULTIPART_THRESHOLD, each part retried on its own)."""
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: no such file")
    if is_s3(uri):
        bucket, key = split_s3(uri)
        s3.upload_object(uri, bucket, key, path)
        return
    target = local_path(uri)
    with _local_temp(uri, target) as f, open(path, "rb") as src:
        shutil.copyfileobj(src, f, CHUNK)


def copy_file(src_uri: str, dst_uri: str) -> None:
    """Copy one file between URIs (either kind) through a local temp file, in chunks, never whole in
    memory; the destination is written atomically."""
    with tempfile.TemporaryDirectory(prefix="dynrubric-copy-") as tmp:
        local = Path(tmp) / "file"
        download_file(src_uri, local)
        upload_file(local, dst_uri)


def read_if_exists(uri: str) -> bytes | None:
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
        s3.upload_object(uri, bucket, key, data)
        return
    with _local_temp(uri, local_path(uri)) as f:
        f.write(data)


def exists(uri: str) -> bool:
    if is_s3(uri):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        try:
            s3.s3_call(uri, s3.s3_client().head_object, Bucket=bucket, Key=key)
            return True
        except StoreError as e:
            if isinstance(e.__cause__, ClientError) and s3.error_code(e.__cause__) in (
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
        s3.s3_call(uri, s3.s3_client().delete_object, Bucket=bucket, Key=key)
    else:
        local_path(uri).unlink(missing_ok=True)


def list_files(uri: str) -> list[str]:
    """Relative paths of all files under a folder URI, sorted (raw: on S3 this includes `_versions/`)."""
    if is_s3(uri):
        bucket, prefix = split_s3(uri.rstrip("/") + "/")
        return sorted(k[len(prefix) :] for k in s3.list_keys(uri, bucket, prefix))
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
            s3.s3_call(uri, s3.s3_client().put_object, Bucket=bucket, Key=probe, Body=b"")
        finally:
            with contextlib.suppress(StoreError):
                s3.s3_call(uri, s3.s3_client().delete_object, Bucket=bucket, Key=probe, budget_s=5.0)
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
