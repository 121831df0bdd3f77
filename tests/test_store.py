"""The object store against a real SeaweedFS S3 server on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from services import SeaweedS3

from dynamicrubric import store
from dynamicrubric.store import StoreError


def test_local_write_is_atomic_and_leaves_no_temp(tmp_path):
    uri = str(tmp_path / "a" / "b.bin")
    store.write_bytes(uri, b"one")
    store.write_bytes(uri, b"two")
    assert store.read_bytes(uri) == b"two"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]


def test_missing_local_file(tmp_path):
    with pytest.raises(StoreError, match="no such file"):
        store.read_bytes(str(tmp_path / "nope.parquet"))


def test_unsupported_scheme():
    with pytest.raises(StoreError, match="unsupported URI scheme"):
        store.read_bytes("gs://bucket/key")


def test_s3_bytes_and_listing(s3_env):
    base = f"s3://{s3_env}/x"
    store.write_bytes(f"{base}/a.bin", b"a")
    store.write_bytes(f"{base}/sub/b.bin", b"bb")
    assert store.read_bytes(f"{base}/sub/b.bin") == b"bb"
    assert store.list_files(base) == ["a.bin", "sub/b.bin"]
    assert store.exists(f"{base}/a.bin") and not store.exists(f"{base}/zzz")
    with pytest.raises(StoreError, match="no such object"):
        store.read_bytes(f"{base}/zzz")


def test_missing_bucket_is_one_line(s3_env):
    with pytest.raises(StoreError) as err:
        store.write_bytes("s3://no-such-bucket-here/k", b"x")
    assert str(err.value) == "s3://no-such-bucket-here/k: the bucket does not exist"


@pytest.mark.parametrize(
    "key_id,secret,reason",
    [
        ("dynrubric-test-key", "wrong-secret", "the secret key is wrong"),
        ("unknown-key", "whatever", "the access key is not known"),
    ],
)
def test_wrong_credentials_are_one_line(s3_env, monkeypatch, key_id, secret, reason):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    store.reset_client()
    uri = f"s3://{s3_env}/k.parquet"
    with pytest.raises(StoreError) as err:
        store.write_bytes(uri, b"x")
    assert str(err.value).startswith(f"{uri}: {reason}")
    assert "\n" not in str(err.value)


def test_wrong_credentials_cli_is_one_line(s3_env, tmp_path, seaweed):
    uri = f"s3://{s3_env}/r.parquet"
    env = {**os.environ, **seaweed.env(secret_key="wrong")}
    res = subprocess.run(
        [sys.executable, "-m", "dynamicrubric.cli", "validate", uri], capture_output=True, text=True, env=env
    )
    assert res.returncode == 1
    assert res.stdout.strip() == f"FAIL {uri}: the secret key is wrong (check AWS_SECRET_ACCESS_KEY)"
    assert "Traceback" not in res.stderr


def test_unreachable_endpoint_is_one_line(monkeypatch):
    from services import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("DYNRUBRIC_S3_MAX_ATTEMPTS", "2")
    store.reset_client()
    try:
        with pytest.raises(
            StoreError, match=r"^s3://b/k: cannot reach the S3 endpoint http://127\.0\.0\.1:\d+"
        ):
            store.read_bytes("s3://b/k")
    finally:
        store.reset_client()


def test_folder_upload_download_and_completion(s3_env, tmp_path):
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(os.urandom(1000))
    uri = f"s3://{s3_env}/models/ckpt"
    assert not store.is_complete(uri)
    with pytest.raises(StoreError, match="absent or incomplete"):
        store.download_dir(uri, tmp_path / "dl")
    store.upload_dir(src, uri)
    assert store.is_complete(uri)
    dl = store.download_dir(uri, tmp_path / "dl")
    assert (dl / "sub" / "w.bin").read_bytes() == (src / "sub" / "w.bin").read_bytes()
    # a local destination is swapped in whole
    local = tmp_path / "local-ckpt"
    store.upload_dir(src, str(local))
    assert sorted(store.list_files(str(local))) == ["_COMPLETE", "config.json", "sub/w.bin"]


def test_multipart_upload_of_large_file(s3_env, tmp_path, monkeypatch):
    monkeypatch.setattr(store, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    data = os.urandom(11 * 1024 * 1024)  # three parts at the 5 MiB minimum
    uri = f"s3://{s3_env}/big.bin"
    store.write_bytes(uri, data)
    assert store.read_bytes(uri) == data


def test_server_killed_mid_write_leaves_no_partial_object(tmp_path):
    """A multipart upload cut off by a dying server never becomes a visible object."""
    server = SeaweedS3(tmp_path / "weed").start()
    try:
        client = server.client()
        client.create_bucket(Bucket="crash")
        # A child process uploads a 60 MiB object in 5 MiB parts; the server dies while it runs.
        script = textwrap.dedent(
            """
            import os, sys
            from dynamicrubric import store
            store.MULTIPART_THRESHOLD = 5 * 1024 * 1024
            from boto3.s3.transfer import TransferConfig
            store._transfer_config = lambda: TransferConfig(multipart_threshold=5 * 1024 * 1024,
                multipart_chunksize=5 * 1024 * 1024, max_concurrency=1)
            print("start", flush=True)
            store.write_bytes("s3://crash/big.bin", os.urandom(60 * 1024 * 1024))
            print("finished", flush=True)
            """
        )
        env = {**os.environ, **server.env(), "DYNRUBRIC_S3_MAX_ATTEMPTS": "1"}
        child = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "start"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until at least one part has landed
            uploads = client.list_multipart_uploads(Bucket="crash").get("Uploads", [])
            if uploads and client.list_parts(
                Bucket="crash", Key="big.bin", UploadId=uploads[0]["UploadId"]
            ).get("Parts"):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the upload never started")
        server.kill()
        out, _ = child.communicate(timeout=120)
        assert child.returncode != 0 and "finished" not in out
        server.start()  # same data folder: what was stored survives the restart
        objects = server.client().list_objects_v2(Bucket="crash").get("Contents", [])
        assert [o["Key"] for o in objects] == []
    finally:
        server.stop()
