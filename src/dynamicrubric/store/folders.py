"""Folders (model checkpoints, plots) published whole, so a reader sees exactly one writer's complete
folder, or none; and `outputs_as_a_set`, which publishes a stage's outputs all together or not at all.

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
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import dynamicrubric.store.s3 as s3
from dynamicrubric.store.files import (
    _dir_mode,
    _file_mode,
    _read_if_exists,
    delete,
    exists,
    list_files,
    read_bytes,
    write_bytes,
)
from dynamicrubric.store.uris import StoreError, is_s3, join, local_path, split_s3

# Named after the package, as the logger was before the store became one, so log lines read the same.
log = logging.getLogger(__package__)

COMPLETE_MARKER = "_COMPLETE"
VERSIONS_DIR = "_versions"  # on S3, each writer's files of a folder live under _versions/<token>/


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
            s3._upload(uri, bucket, mine + rel, p)
        previous = read_manifest(uri)
        write_bytes(join(uri, COMPLETE_MARKER), _manifest(token, files))
    except BaseException:
        with contextlib.suppress(Exception):
            s3._delete_keys(uri, bucket, s3._list_keys(uri, bucket, mine))
        raise
    # The version the marker named before ours is finished (its writer wrote the marker), so no writer
    # still adds to it; a reader still fetching it sees a file vanish and starts over from the marker.
    # A version no marker ever named (a writer that lost the race) stays until a later cleanup.
    with contextlib.suppress(StoreError):
        if previous is not None and previous["token"] != token:
            if previous["token"] is None:  # the old flat layout: everything but the versions and marker
                old = [
                    k
                    for k in s3._list_keys(uri, bucket, prefix)
                    if not k.startswith(f"{prefix}{VERSIONS_DIR}/") and k != prefix + COMPLETE_MARKER
                ]
            else:
                old = s3._list_keys(uri, bucket, f"{prefix}{VERSIONS_DIR}/{previous['token']}/")
            s3._delete_keys(uri, bucket, old)


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
        keys = s3._list_keys(uri, bucket, prefix)
        marker = prefix + COMPLETE_MARKER
        # The marker first, so that readers see the folder as absent, never as a part.
        if marker in keys:
            delete(join(uri, COMPLETE_MARKER))
        s3._delete_keys(uri, bucket, [k for k in keys if k != marker])
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
