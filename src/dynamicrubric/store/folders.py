"""Folders (model checkpoints, plots) published whole, so a reader sees exactly one writer's complete
folder, or none; and `outputs_as_a_set`, which publishes a stage's outputs all together or not at all.

Every folder carries a `_COMPLETE` marker, written last: a JSON manifest of the writer's token, the
folder's `layout` (where its files are) and every file with its size and SHA-256. Readers read only
the files the marker lists; `download_dir` streams each to disk (never whole in memory, several at a
time) and checks it against its checksum before it appears.

- On S3 each writer uploads its files under its own sub-prefix `<folder>/_versions/<token>/` (layout
  "versioned"), then writes the marker. Two concurrent writers never mix (the last marker wins, and it
  names one writer's complete set) and a rewrite with fewer files never shows the old ones. The writer
  then deletes the version the marker named before its own. Several processes may fill one version
  (upload_version, each its own files: the ranks of a training job, each with the checkpoint shards it
  wrote) and one of them publishes it (publish_version) once all are done.
- Locally a writer fills a temp folder beside the destination (marker included, layout "flat": the
  files lie beside the marker) and swaps it in with one atomic rename (`renameat2(RENAME_EXCHANGE)`
  where the filesystem has it). A reader that opens its files by path reads a pinned version
  (`pinned_folder`). A downloaded copy is written flat too.
- A local folder whose marker says "versioned" is a mirror of an S3 folder that KFP's launcher made in
  a task's pod: it downloads every key under the artifact's prefix to the same relative path
  (launcher_v2.go `downloadArtifacts`, object_store.go `DownloadBlob`), so the marker lies at the top
  and the files under `_versions/<token>/` (the version the marker names; an older version a writer
  had not yet deleted may lie beside it). Every reader here reads it from that version, as on S3
  (`file_key` is the one rule for both), and `pinned_folder` (`resolve_model`'s folder) and
  `download_dir` give the folder flat, as hard links of the version's files beside it.
- A local folder copied to S3 file by file under the same relative keys, as KFP's launcher uploads a
  task's output artifact, keeps its flat marker, so a reader of that `s3://` URI finds its files
  beside the marker (the launcher is that copy's one writer; a later `upload_dir` to the URI writes a
  version and deletes the flat files).

Older markers are still read: an empty one (every file under the folder is its content), and the
manifests without a layout (format 1): flat locally; on S3 versioned where `_versions/<token>/` holds
files, else flat (a local folder a launcher copied).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dynamicrubric.store.s3 as s3
import dynamicrubric.store.unpublished as unpublished
from dynamicrubric.store.files import (
    delete,
    dir_mode,
    download_file,
    exists,
    file_digest,
    file_mode,
    list_files,
    read_if_exists,
    upload_file,
    write_bytes,
)
from dynamicrubric.store.unpublished import COMPLETE_MARKER, VERSIONS_DIR
from dynamicrubric.store.uris import StoreError, is_s3, join, local_path, short_name, split_s3

# Named after the package, as the logger was before the store became one, so log lines read the same.
log = logging.getLogger(__package__)

FLAT, VERSIONED = "flat", "versioned"  # a manifest's layouts: files beside the marker, or in its version


def _digest(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        return os.fstat(f.fileno()).st_size, file_digest(f.fileno())


def _manifest_bytes(token: str, layout: str, entries: dict[str, dict]) -> bytes:
    doc = {"format": 2, "token": token, "layout": layout, "files": entries}
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def _manifest(token: str, files: dict[str, Path], layout: str) -> bytes:
    entries = {}
    for rel, p in files.items():
        size, sha = _digest(p)
        entries[rel] = {"size": size, "sha256": sha}
    return _manifest_bytes(token, layout, entries)


def read_manifest(uri: str) -> dict | None:
    """The completion marker of a folder: {"token", "layout", "files": {rel: {size, sha256}}}, or None
    when the folder is absent or incomplete. `layout` is "flat" (the files lie beside the marker) or
    "versioned" (under `_versions/<token>/`). An empty marker (written before manifests existed) gives
    {"token": None, "layout": "flat", "files": None}: every file under the folder is its content."""
    marker = join(uri, COMPLETE_MARKER)
    data = read_if_exists(marker)
    if data is None:
        return None
    if not data.strip():
        return {"token": None, "layout": FLAT, "files": None}
    try:
        manifest = json.loads(data)
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no file list")
        if not isinstance(manifest.get("token"), str) or not manifest["token"]:
            raise ValueError("no writer token")
    except (ValueError, AttributeError) as e:
        raise StoreError(f"{marker}: unreadable completion marker ({e})") from None
    if "layout" not in manifest:  # format 1: the layout follows from where it was written, or copied
        manifest["layout"] = _format1_layout(uri, manifest["token"])
    if manifest["layout"] not in (FLAT, VERSIONED):
        raise StoreError(f"{marker}: unreadable completion marker (unknown layout {manifest['layout']!r})")
    return manifest


def _format1_layout(uri: str, token: str) -> str:
    """Where a format-1 manifest's files are. Local writers wrote them flat, S3 writers under their
    version; a local folder that a launcher copied to S3 key by key is flat there too, and has no
    `_versions/<token>/`, and an S3 folder a launcher mirrored into a pod keeps that version."""
    if not is_s3(uri):
        return VERSIONED if (local_path(uri) / VERSIONS_DIR / token).is_dir() else FLAT
    bucket, prefix = split_s3(uri.rstrip("/") + "/")
    version = f"{prefix}{VERSIONS_DIR}/{token}/"
    resp = s3.s3_call(uri, s3.s3_client().list_objects_v2, Bucket=bucket, Prefix=version, MaxKeys=1)
    return VERSIONED if resp.get("KeyCount", len(resp.get("Contents", []))) else FLAT


def file_key(prefix: str, manifest: dict, rel: str) -> str:
    """Where file `rel` of the folder `manifest` describes lies, under the folder's key prefix (on S3)
    or its path (a local folder: "" for the prefix). The one place that knows the layouts."""
    if manifest["layout"] == FLAT:
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
        return join(uri, file_key("", manifest, rel))  # flat, or a launcher's mirror of a version
    bucket, prefix = split_s3(uri.rstrip("/") + "/")
    return f"s3://{bucket}/{file_key(prefix, manifest, rel)}"


def folder_files(local_dir: Path) -> dict[str, Path]:
    """The files of a local folder by relative path (its marker aside), in sorted order."""
    return {
        p.relative_to(local_dir).as_posix(): p
        for p in sorted(local_dir.rglob("*"))
        if p.is_file() and p.name != COMPLETE_MARKER
    }


def upload_dir(local_dir: str | Path, uri: str) -> None:
    """Publish a local folder at `uri` whole, its completion marker (the manifest) last. An interrupted
    copy stays invisible; concurrent writers never mix (see the module docstring). A failed write
    removes its files (or, where the store does not answer, the next write of the folder does); one
    whose marker may have been stored keeps them (MarkerOutcomeUnknown)."""
    local_dir = Path(local_dir)
    files = folder_files(local_dir)
    token = new_token()
    if not is_s3(uri):
        dest = local_path(uri)
        if dest.exists() and dest.resolve() == local_dir.resolve():
            write_bytes(str(dest / COMPLETE_MARKER), _manifest(token, files, FLAT))
            return
    try:
        entries = upload_version(files, uri, token)
    except BaseException:
        unpublished.abandon_version(uri, token)
        raise
    publish_or_abandon(uri, token, entries)


def publish_or_abandon(uri: str, token: str, entries: dict[str, dict]) -> None:
    """publish_version; if it fails before its marker could be stored, the version is abandoned."""
    try:
        publish_version(uri, token, entries)
    except unpublished.MarkerOutcomeUnknown:
        raise  # the marker may name it: never deleted here
    except StoreError:
        unpublished.abandon_version(uri, token)
        raise


def new_token() -> str:
    """A new writer's token: the name of the version of a folder it fills (upload_version)."""
    return f"{time.time_ns():x}-{uuid.uuid4().hex[:12]}"  # time-ordered, then random: unique per writer


def upload_version(files: dict[str, Path], uri: str, token: str) -> dict[str, dict]:
    """Copy `files` (relative path -> local file) into version `token` of folder `uri`, several at a time
    (on S3 at most s3.STREAMS transfers in flight in this process), each hashed as it goes; returns their
    manifest entries. Nothing shows until the version is published (publish_version), so several
    processes may fill one version, each with its own files, and one publishes it with all their entries."""
    if is_s3(uri):
        bucket, prefix = split_s3(uri.rstrip("/") + "/")
        mine = f"{prefix}{VERSIONS_DIR}/{token}/"

        def send_file(stop: threading.Event, rel: str, path: Path) -> dict:
            # The file's hash is taken while it goes up (hashlib frees the GIL), not before.
            with ThreadPoolExecutor(1, thread_name_prefix="store-hash") as hasher:
                entry = hasher.submit(_entry, path)
                s3.upload_object(uri, bucket, mine + rel, path, stop)
                return entry.result()

        # One stop for the whole write: once a file fails no other file or part starts (s3.in_parts),
        # so a failure ends within the budget and its slack however many files the folder has.
        sent = s3.in_parts(send_file, list(files.items()), workers=min(s3.STREAMS, len(files) or 1))
        return dict(zip(files, sent, strict=True))
    else:
        version = unpublished.local_version(uri, token)

        def send(rel: str, path: Path) -> dict:
            target = version / rel
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
                os.chmod(target, file_mode())
            except OSError as e:
                raise StoreError(f"{uri}: cannot write: {e.strerror}") from None
            return _entry(path)

    return dict(zip(files, _in_parallel(send, list(files.items())), strict=True))


def publish_version(uri: str, token: str, entries: dict[str, dict]) -> None:
    """Make version `token` (filled by upload_version, `entries` its files) the folder at `uri`: the
    marker naming it is written last; the version the marker named before is deleted (on S3), or
    swapped out (locally), and so are the versions of this process's failed writes of the folder and
    those older than the stale age that no marker names (store/unpublished.py). On S3 a marker write
    that got no answer is read back: stored, the publish goes on; not shown stored,
    MarkerOutcomeUnknown (the version stays: the marker may yet name it)."""
    if is_s3(uri):
        previous = read_manifest(uri)
        try:
            write_bytes(join(uri, COMPLETE_MARKER), _manifest_bytes(token, VERSIONED, entries))
        except StoreError as e:
            if not s3.may_have_landed(e):
                raise  # refused: never stored
            named = unpublished.marker_token(uri)
            if named != token:
                said = "could not be read back" if named is None else f"names version {named}"
                raise unpublished.MarkerOutcomeUnknown(
                    f"{e}; the marker {said}, so whether it was stored is unknown: version {token} is kept"
                ) from e
            log.info("%s: the marker's write got no answer but it is stored", uri)
        _delete_previous(uri, previous, token)
        unpublished.remove_failed(uri, token)
        with contextlib.suppress(StoreError):  # and what dead writers of the folder left, once old
            unpublished.clean_unpublished(uri)
        return
    version = unpublished.local_version(uri, token)
    try:
        version.mkdir(parents=True, exist_ok=True)  # a folder of no files has no version yet
        (version / COMPLETE_MARKER).write_bytes(_manifest_bytes(token, FLAT, entries))
        os.chmod(version / COMPLETE_MARKER, file_mode())
        for d in [version, *(p for p in version.rglob("*") if p.is_dir())]:
            os.chmod(d, dir_mode())
    except OSError as e:
        raise StoreError(f"{uri}: cannot write: {e.strerror}") from None
    try:
        _swap_in(version, local_path(uri), uri)
    finally:
        shutil.rmtree(version, ignore_errors=True)  # after a swap, this is the folder it replaced


def _entry(path: Path) -> dict:
    size, sha = _digest(path)
    return {"size": size, "sha256": sha}


def _in_parallel(fn: Callable[..., Any], items: list[tuple]) -> list[Any]:
    """fn(*item) for every item, up to s3.STREAMS at a time (the store's calls inside bound what is in
    flight); the results in order. The first failure stops what has not started and is raised."""
    if len(items) <= 1:
        return [fn(*item) for item in items]
    pool = ThreadPoolExecutor(min(s3.STREAMS, len(items)), thread_name_prefix="store-file")
    try:
        futures = [pool.submit(fn, *item) for item in items]
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _delete_previous(uri: str, previous: dict | None, token: str) -> None:
    """Delete the files of the version the marker named before `token`'s. That version is finished (its
    writer wrote the marker), so no writer still adds to it; a reader still fetching it sees a file vanish
    and starts over from the marker. A version no marker ever named (a writer that lost the race) stays
    until a later cleanup."""
    if previous is None or previous["token"] == token:
        return
    bucket, prefix = split_s3(uri.rstrip("/") + "/")
    with contextlib.suppress(StoreError):
        if previous["files"] is None:  # an empty marker: everything but the versions and marker
            old = [
                k
                for k in s3.list_keys(uri, bucket, prefix)
                if not k.startswith(f"{prefix}{VERSIONS_DIR}/") and k != prefix + COMPLETE_MARKER
            ]
        elif previous["layout"] == FLAT:  # a local folder copied here flat: exactly its files
            old = [prefix + rel for rel in previous["files"]]
        else:
            old = s3.list_keys(uri, bucket, f"{prefix}{VERSIONS_DIR}/{previous['token']}/")
        s3.delete_keys(uri, bucket, old)


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
            aside = dest.parent / f".{short_name(dest.name)}.{uuid.uuid4().hex[:12]}.old"
            with contextlib.suppress(FileNotFoundError):
                os.rename(dest, aside)
                shutil.rmtree(aside, ignore_errors=True)
    raise StoreError(f"{uri}: could not swap the folder in (other writers kept replacing it)")


def pinned_folder(folder: Path) -> Path:
    """`folder` as one writer left it, for a reader that opens its files one by one by path (as
    `from_pretrained` does). A rewrite swaps a whole new folder in at any moment, so such a reader could
    take some files from the old folder and some from the new. The files of one version (the marker's
    token, read before and after, and no token ever comes back) are hard-linked into a sibling
    `.<name>.v-<token>` that no writer touches again, flat: a launcher's mirror of a versioned folder
    (see the module docstring) is pinned from its version, with a flat marker of the same files. A
    folder without a manifest (not written by upload_dir) is returned as it is."""
    for _ in range(100):
        manifest = read_manifest(str(folder))
        if manifest is None or manifest["token"] is None or folder.name.endswith(f".v-{manifest['token']}"):
            return folder  # not ours, or already a pinned version
        pinned = folder.parent / f".{short_name(folder.name)}.v-{manifest['token']}"
        if (pinned / COMPLETE_MARKER).is_file():
            return pinned
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{short_name(folder.name)}.", suffix=".tmp"))
        try:
            missing = _link_version(folder, manifest, tmp)
            again = read_manifest(str(folder))
            if again is not None and again["token"] == manifest["token"]:
                if missing is not None:  # the same version, short of a file: no writer will bring it
                    raise StoreError(f"{folder}: {missing} is missing, though {COMPLETE_MARKER} lists it")
                os.chmod(tmp, dir_mode())
                with contextlib.suppress(OSError):  # another reader pinned this version first
                    os.rename(tmp, pinned)
                return pinned
        except OSError as e:
            raise StoreError(f"{folder}: cannot pin a version to read: {e.strerror}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise StoreError(f"{folder}: kept being rewritten while it was read")


def _link_version(folder: Path, manifest: dict, tmp: Path) -> str | None:
    """Hard-link the files of the local folder `manifest` describes into `tmp`, flat, and its marker
    last (a versioned mirror's as a flat one); the first file found missing (None: none)."""
    for rel in manifest["files"]:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(folder / file_key("", manifest, rel), tmp / rel)
        except FileNotFoundError:
            return rel  # swapped out under us (the caller's token check starts over), or never there
    if manifest["layout"] == FLAT:
        try:
            os.link(folder / COMPLETE_MARKER, tmp / COMPLETE_MARKER)
        except FileNotFoundError:
            return COMPLETE_MARKER
    else:
        (tmp / COMPLETE_MARKER).write_bytes(_manifest_bytes(manifest["token"], FLAT, manifest["files"]))
        os.chmod(tmp / COMPLETE_MARKER, file_mode())
    return None


def download_dir(uri: str, local_dir: str | Path, only: Callable[[str], bool] | None = None) -> Path:
    """Fetch a complete folder (exactly the files its marker lists, each checked against its checksum
    and streamed to disk: no file is ever whole in memory); refuses one without its marker. With
    `only`, just the files whose relative path it accepts (the local copy's marker lists those). A
    local folder is returned where it is (a launcher's mirror of a versioned folder: its pinned version,
    flat)."""
    local_dir = Path(local_dir)
    if not is_s3(uri):
        manifest = read_manifest(uri)
        if manifest is None:
            raise StoreError(f"{uri}: folder is absent or incomplete (no {COMPLETE_MARKER} marker)")
        return pinned_folder(local_path(uri)) if manifest["layout"] == VERSIONED else local_path(uri)
    for _ in range(5):
        manifest = read_manifest(uri)
        if manifest is None:
            raise StoreError(f"{uri}: folder is absent or incomplete (no {COMPLETE_MARKER} marker)")
        if manifest["files"] is None:  # an empty marker: every file under the folder
            rels = [
                r for r in list_files(uri) if r != COMPLETE_MARKER and not r.startswith(f"{VERSIONS_DIR}/")
            ]
        else:
            rels = sorted(manifest["files"])
        written: list[Path] = []
        try:
            _fetch(uri, manifest, [rel for rel in rels if only is None or only(rel)], local_dir, written)
        except StoreError as e:
            # A newer writer replaced the folder and deleted (or, in a flat copy, overwrote) the version
            # we were reading: start over.
            if (str(e).endswith("no such object") or "does not match its checksum" in str(e)) and (
                read_manifest(uri) or {}
            ).get("token") != manifest["token"]:
                log.info("%s: replaced while downloading; fetching the new version", uri)
                for p in written:  # none of the replaced version may stay beside the new one
                    p.unlink(missing_ok=True)
                continue
            raise
        # The local copy is flat whatever layout it came from, and lists what it holds (with `only`,
        # a part); an empty marker stays empty.
        if manifest["files"] is None:
            marker = b""
        else:
            fetched = {p.relative_to(local_dir).as_posix() for p in written}
            entries = {rel: e for rel, e in manifest["files"].items() if rel in fetched}
            marker = _manifest_bytes(manifest["token"], FLAT, entries)
        local_dir.mkdir(parents=True, exist_ok=True)
        (local_dir / COMPLETE_MARKER).write_bytes(marker)
        return local_dir
    raise StoreError(f"{uri}: the folder kept being replaced while it was downloaded")


def _fetch(uri: str, manifest: dict, rels: list[str], local_dir: Path, written: list[Path]) -> None:
    """Download files `rels` of the folder `manifest` describes, several at a time (up to s3.STREAMS in
    flight), each checked against its checksum; `written` gets each one that arrived."""
    bucket, prefix = split_s3(uri.rstrip("/") + "/")

    def fetch(rel: str) -> None:
        source = f"s3://{bucket}/{file_key(prefix, manifest, rel)}"
        try:
            download_file(source, local_dir / rel, (manifest["files"] or {}).get(rel))
        except StoreError as e:
            if "does not match its checksum" in str(e):
                raise StoreError(f"{uri}: {rel} does not match its checksum in {COMPLETE_MARKER}") from e
            raise
        written.append(local_dir / rel)

    _in_parallel(fetch, [(rel,) for rel in rels])


def delete_dir(uri: str) -> None:
    """Remove a folder and everything under it (missing is fine)."""
    if is_s3(uri):
        bucket, prefix = split_s3(uri.rstrip("/") + "/")
        keys = s3.list_keys(uri, bucket, prefix)
        marker = prefix + COMPLETE_MARKER
        # The marker first, so that readers see the folder as absent, never as a part.
        if marker in keys:
            delete(join(uri, COMPLETE_MARKER))
        s3.delete_keys(uri, bucket, [k for k in keys if k != marker])
    else:
        path = local_path(uri)
        shutil.rmtree(path, ignore_errors=True)
        for pinned in path.parent.glob(
            f".{glob.escape(short_name(path.name))}.v-*"
        ):  # versions readers pinned (pinned_folder)
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
                    upload_file(p, uri)
                published.append((uri, p.is_dir()))
        except BaseException:
            for uri, is_dir in published:
                try:
                    delete_dir(uri) if is_dir else delete(uri)
                except Exception as e:  # the store may be why publishing failed
                    log.warning("%s: could not remove a partly published output: %s", uri, e)
            raise
