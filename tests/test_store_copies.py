"""A complete folder copied server-side on S3 (store/copies.py), against the tests' SeaweedFS: the copy is a
folder of the folder protocol (its own version, the source's manifest entries, marker last), a file
above the part size goes in UploadPartCopy parts, and a failed copy leaves the destination as it was."""

from __future__ import annotations

import json
import os

import pytest
from botocore.exceptions import ClientError

from dynamicrubric import store
from dynamicrubric.store import copies, s3


def _folder(path, big: bytes):
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "sub" / "b.txt").write_text("b")
    (path / "model.safetensors").write_bytes(big)
    return path


def _versions(uri: str) -> set[str]:
    return {rel.split("/")[1] for rel in store.list_files(uri) if rel.startswith(f"{store.VERSIONS_DIR}/")}


def test_a_folder_is_copied_server_side_as_a_folder_of_its_own(s3_env, tmp_path, monkeypatch):
    """Three parts for the 11 MiB file (5 MiB parts, S3's smallest); the copy reads back byte for byte
    against the source's checksums; a second copy replaces the first whole (one version left)."""
    monkeypatch.setattr(copies, "COPY_PART_SIZE", 5 << 20)
    big = os.urandom(11 << 20)
    src, dst = f"s3://{s3_env}/nodes/out", f"s3://{s3_env}/task/policy"
    store.upload_dir(_folder(tmp_path / "src", big), src)
    calls: list[tuple[str, str]] = []

    def record(model, params, **kwargs):
        calls.append((model.name, params.get("Key", "")))

    s3.s3_client().meta.events.register("before-parameter-build.s3.*", record)

    store.copy_dir(src, dst)
    source, copied = store.read_manifest(src), store.read_manifest(dst)
    assert copied["files"] == source["files"] and copied["layout"] == "versioned"
    assert copied["token"] != source["token"]
    names = [name for name, _ in calls]
    assert names.count("UploadPartCopy") == 3 and names.count("CopyObject") == 2
    # no file's bytes pass through this process: it reads and writes only the markers
    moved = {
        key.rsplit("/", 1)[-1] for name, key in calls if name in ("GetObject", "PutObject", "UploadPart")
    }
    assert moved == {store.COMPLETE_MARKER}
    local = store.download_dir(dst, tmp_path / "back")  # each file checked against its checksum
    assert (local / "model.safetensors").read_bytes() == big and (local / "sub" / "b.txt").read_text() == "b"

    store.copy_dir(src, dst)
    assert _versions(dst) == {store.read_manifest(dst)["token"]}  # the first copy's version is gone


def test_a_failed_copy_leaves_the_destination_as_it_was(s3_env, tmp_path, monkeypatch):
    """A part refused mid-way: the multipart copy is aborted, the half-copied version deleted, and the
    destination keeps its earlier complete folder."""
    monkeypatch.setattr(copies, "COPY_PART_SIZE", 5 << 20)
    src, dst = f"s3://{s3_env}/nodes/out", f"s3://{s3_env}/task/policy"
    store.upload_dir(_folder(tmp_path / "src", os.urandom(11 << 20)), src)
    store.upload_dir(_folder(tmp_path / "old", b"old weights"), dst)
    before = store.read_manifest(dst)

    def refuse(params, **kwargs):
        if params.get("PartNumber") == 2:
            error = {"Error": {"Code": "AccessDenied", "Message": "refused by the test"}}
            raise ClientError(error, "UploadPartCopy")

    s3.s3_client().meta.events.register("before-parameter-build.s3.UploadPartCopy", refuse)
    with pytest.raises(store.StoreError, match="access denied"):
        store.copy_dir(src, dst)
    assert store.read_manifest(dst) == before and _versions(dst) == {before["token"]}
    uploads = s3.s3_client().list_multipart_uploads(Bucket=s3_env).get("Uploads", [])
    assert uploads == [], uploads
    marker = json.loads(store.read_bytes(store.join(dst, store.COMPLETE_MARKER)))
    assert marker["files"]["model.safetensors"]["size"] == len(b"old weights")
