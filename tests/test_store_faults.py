"""The store under faults, against a real SeaweedFS (issue 50, item 6): a frozen server (SIGSTOP) ends a
write within its budget plus the stated slack (s3.py's docstring) and a retry after it completes,
leaving no orphan files or open multipart uploads; a marker whose reply is lost never costs the folder
its files; server-side copies wait for a store that answers a copy only when it is done, and a failed
copy says what it was copying; `clean_unpublished` clears a work prefix of dead writers' leftovers."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from services import SeaweedS3, TcpProxy

from dynamicrubric import store
from dynamicrubric.store import copies, s3

MIB = 1 << 20


def _folder(path: Path, big: bytes) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text('{"a": 1}')
    (path / "sub" / "b.txt").write_text("b")
    (path / "model.safetensors").write_bytes(big)
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _leftovers(client, bucket: str, uri: str) -> tuple[set[str], list]:
    """The versions under the folder other than the one its marker names, and its open multipart uploads."""
    prefix = uri.split("/", 3)[3] + "/"
    named = store.read_manifest(uri)["token"]
    versions = {
        rel.split("/")[1] for rel in store.list_files(uri) if rel.startswith(f"{store.VERSIONS_DIR}/")
    }
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return versions - {named}, uploads


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture
def own_server(tmp_path, monkeypatch):
    """A SeaweedFS of this test's own (it is frozen: the session's server must not be), with a bucket."""
    server = SeaweedS3(tmp_path / "weed").start()
    try:
        server.client().create_bucket(Bucket="frozen")
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        store.reset_client()
        yield server
    finally:
        store.reset_client()
        server.kill()  # frozen or not: SIGKILL ends it either way


@pytest.mark.parametrize("freeze_s", [30, 200])
def test_a_frozen_server_ends_the_upload_within_the_budget(
    freeze_s, own_server, tmp_path, monkeypatch, caplog
):
    """The server is frozen (SIGSTOP) for `freeze_s` as the second part of the folder's large file goes up.
    With a 10 s budget the upload fails within budget + s3.FAILURE_SLACK_S, while the server is still
    frozen (on 33cff44 a 30 s freeze failed it at 32.6 s, a 200 s one hung 200.8 s: each attempt waited
    out the 60 s read timeout, three times inside botocore). Since it ends while the server is still
    stopped, how long the freeze lasts beyond that cannot change it: the 200 s freeze is ended as soon as
    the upload has failed, the 30 s one when its 30 s are up. The retry then completes, and the failed
    write's multipart upload and files, which the frozen server kept it from removing, are gone."""
    budget = 10.0
    monkeypatch.setenv(store.RETRY_BUDGET_ENV, str(budget))
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 5 * MIB)
    monkeypatch.setattr(s3, "PART_SIZE", 5 * MIB)
    local = _folder(tmp_path / "model", os.urandom(20 * MIB))  # four parts
    uri = "s3://frozen/run/policy"
    pid, parts, lock = own_server.proc.pid, [], threading.Lock()
    thaw = threading.Timer(freeze_s, os.killpg, (pid, signal.SIGCONT))
    small, stored = threading.Semaphore(0), []

    def small_file_stored(**kwargs):
        stored.append(kwargs["model"].name)
        small.release()

    def freeze_on_the_second_part(**kwargs):
        with lock:
            parts.append(time.monotonic())
            if len(parts) == 2:
                for _ in range(2):  # the two small files are stored first: the failed write leaves them
                    assert small.acquire(timeout=30)
                os.killpg(pid, signal.SIGSTOP)
                thaw.start()

    s3.s3_client().meta.events.register("after-call.s3.PutObject", small_file_stored)
    s3.s3_client().meta.events.register("before-send.s3.UploadPart", freeze_on_the_second_part)
    started = time.monotonic()
    try:
        with pytest.raises(store.StoreError) as failed:
            store.upload_dir(local, uri)
        ended = time.monotonic()
        assert len(parts) >= 2, "the server was never frozen"
        assert _stopped(pid), f"the server was thawed ({freeze_s} s) before the upload ended"
    finally:
        if freeze_s == 30 and thaw.is_alive():
            thaw.join()  # the freeze lasts its 30 s, then the server goes on (SIGCONT)
        else:  # the 200 s freeze: its length past the upload's end cannot matter
            thaw.cancel()
            os.killpg(pid, signal.SIGCONT)
    assert ended - started <= budget + store.FAILURE_SLACK_S, f"failed after {ended - started:.1f} s"
    message = str(failed.value)
    assert message.startswith(f"{uri}: ") and "uploadId" not in message and "\n" not in message, message
    assert "uploadId" not in caplog.text  # the retry lines name the URI too, never a part's URL
    # The failed write could not remove its files (the server was frozen): they are there until the next.
    assert {rel.split("/", 2)[2] for rel in store.list_files(uri)} == {"config.json", "sub/b.txt"}

    s3.s3_client().meta.events.unregister("before-send.s3.UploadPart", freeze_on_the_second_part)
    s3.s3_client().meta.events.unregister("after-call.s3.PutObject", small_file_stored)
    store.upload_dir(local, uri)  # the retry
    back = store.download_dir(uri, tmp_path / "back")
    assert {rel: data for rel, data in _files(back).items() if rel != store.COMPLETE_MARKER} == _files(local)
    orphans, uploads = _leftovers(own_server.client(), "frozen", uri)
    assert orphans == set() and uploads == [], (orphans, uploads)


def test_a_frozen_server_ends_a_many_file_upload_within_the_budget(own_server, tmp_path, monkeypatch):
    """A folder of 40 files, more than the 8 that go up at once, and the server frozen as the third
    starts: once the first file fails no other starts (each would wait a budget of its own on the
    frozen server), so the upload still ends within one budget plus the slack."""
    budget = 5.0
    monkeypatch.setenv(store.RETRY_BUDGET_ENV, str(budget))
    local = tmp_path / "shards"
    local.mkdir()
    for i in range(40):
        (local / f"shard-{i:02d}.bin").write_bytes(os.urandom(1024))
    pid, sent, lock = own_server.proc.pid, [], threading.Lock()

    def freeze_on_the_third_file(**kwargs):
        with lock:
            sent.append(1)
            if len(sent) == 3:
                os.killpg(pid, signal.SIGSTOP)

    s3.s3_client().meta.events.register("before-send.s3.PutObject", freeze_on_the_third_file)
    started = time.monotonic()
    try:
        with pytest.raises(store.StoreError):
            store.upload_dir(local, "s3://frozen/run/shards")
        took = time.monotonic() - started
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert len(sent) >= 3
    assert took <= budget + store.FAILURE_SLACK_S, f"failed after {took:.1f} s"


def test_the_next_write_removes_what_a_killed_writer_left(s3_env, seaweed, tmp_path, monkeypatch):
    """A writer process is killed (SIGKILL) while its folder's large file goes up: its small files and an
    open multipart upload stay under the folder. The next write of the folder, by another process, removes
    both once they are older than the stale age (an hour by default, so that a live writer's are never
    taken; 0 here, where the writer is known dead)."""
    import subprocess
    import sys
    import textwrap

    uri = f"s3://{s3_env}/task/policy"
    local = _folder(tmp_path / "model", os.urandom(40 * MIB))
    script = textwrap.dedent(
        f"""
        from dynamicrubric import store
        from dynamicrubric.store import s3
        s3.MULTIPART_THRESHOLD = s3.PART_SIZE = 5 * 1024 * 1024
        print("start", flush=True)
        store.upload_dir({str(local)!r}, {uri!r})
        print("finished", flush=True)
        """
    )
    proxy = TcpProxy(seaweed.port, request_rate=0.5e6)  # a slow uplink: the parts take seconds each
    endpoint = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    env = {**os.environ, **seaweed.env(), **endpoint, store.RETRY_BUDGET_ENV: "20"}
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    client = seaweed.client()
    try:
        assert child.stdout.readline().strip() == "start"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until its upload is open and its two small files are up
            if (
                client.list_multipart_uploads(Bucket=s3_env).get("Uploads")
                and len(store.list_files(uri)) >= 2
            ):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the upload never got going")
    finally:
        child.kill()
        child.wait()
        proxy.close()
    assert not store.is_complete(uri) and client.list_multipart_uploads(Bucket=s3_env).get("Uploads")
    monkeypatch.setenv(store.STALE_UPLOAD_ENV, "0")
    store.upload_dir(local, uri)
    orphans, uploads = _leftovers(client, s3_env, uri)
    assert orphans == set() and uploads == [], (orphans, uploads)
    back = store.download_dir(uri, tmp_path / "back")
    assert _files(back)["model.safetensors"] == (local / "model.safetensors").read_bytes()


def _marker_put(data: bytes) -> bool:
    line = data.split(b"\r\n", 1)[0]
    return line.startswith(b"PUT ") and f"/{store.COMPLETE_MARKER} ".encode() in line


def test_a_stored_marker_whose_reply_is_lost_keeps_its_folder(s3_env, seaweed, tmp_path, monkeypatch):
    """The marker's PUT reaches the store, which stores it; its answer never comes back (the proxy holds
    every marker PUT's reply until the writer hangs up). The writer reads the marker back, finds its own
    version named, and finishes the publish: the folder reads back whole, the earlier version gone. On
    33cff44 the writer deleted the version the stored marker named: `is_complete` said True and the
    download failed with "no such object"."""
    budget = 3.0
    uri = f"s3://{s3_env}/task/policy"
    store.upload_dir(_folder(tmp_path / "v1", b"old weights"), uri)
    proxy = TcpProxy(seaweed.port, hold=lambda data: math.inf if _marker_put(data) else None)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv(store.RETRY_BUDGET_ENV, str(budget))
        store.reset_client()
        local = _folder(tmp_path / "v2", os.urandom(MIB))
        started = time.monotonic()
        try:
            store.upload_dir(local, uri)
            gave_up = None
        except store.StoreError as e:
            gave_up = e
        took = time.monotonic() - started
        assert proxy.held >= 1  # the reply really was lost
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
        store.reset_client()
    # The store's promise first, whatever the writer said: a folder marked complete reads back whole.
    assert store.is_complete(uri)  # the marker was stored
    back = store.download_dir(uri, tmp_path / "back")  # each file checked against the marker's checksums
    assert _files(back)["model.safetensors"] == (local / "model.safetensors").read_bytes()
    # And the writer found its marker stored, so the publish finished, within its budget and the slack.
    assert gave_up is None, gave_up
    assert took <= budget + store.FAILURE_SLACK_S
    orphans, uploads = _leftovers(seaweed.client(), s3_env, uri)
    assert orphans == set() and uploads == []


def test_a_writer_that_cannot_tell_whether_its_marker_was_stored_keeps_its_version(
    s3_env, seaweed, tmp_path, monkeypatch
):
    """As above, and the marker cannot be read back either (the answers to its GETs after the PUT are
    lost too): the writer gives up with MarkerOutcomeUnknown and keeps its version, so the marker the
    store did keep names a folder that reads back whole."""
    uri = f"s3://{s3_env}/task/policy"
    put = threading.Event()

    def marker_request(data: bytes) -> float | None:
        line = data.split(b"\r\n", 1)[0]
        if f"/{store.COMPLETE_MARKER} ".encode() not in line:
            return None
        if line.startswith(b"PUT "):
            put.set()
        return math.inf if put.is_set() else None

    proxy = TcpProxy(seaweed.port, hold=marker_request)
    local = _folder(tmp_path / "v1", os.urandom(MIB))
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv(store.RETRY_BUDGET_ENV, "2")
        store.reset_client()
        started = time.monotonic()
        with pytest.raises(store.MarkerOutcomeUnknown, match=r"whether it was stored is unknown"):
            store.upload_dir(local, uri)
        assert time.monotonic() - started <= 2 + store.FAILURE_SLACK_S
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
        store.reset_client()
    back = store.download_dir(uri, tmp_path / "back")  # the PUT reached the store: complete, and whole
    assert _files(back)["model.safetensors"] == (local / "model.safetensors").read_bytes()


def _copy_request(data: bytes) -> bool:
    return b"x-amz-copy-source:" in data.lower()


def test_copies_wait_for_a_store_that_answers_when_the_copy_is_done(s3_env, seaweed, tmp_path, monkeypatch):
    """The proxy holds every copy's answer (CopyObject, UploadPartCopy) longer than the shared client's read
    timeout (set to 3 s here; 60 s by default): the copies have their own timeout and budget
    (copies.copy_timeout_s), so the copy completes. On 33cff44 each copy timed out after the read
    timeout, three times inside botocore, and the copy failed."""
    monkeypatch.setattr(copies, "COPY_PART_SIZE", 5 * MIB)
    monkeypatch.setenv(store.READ_TIMEOUT_ENV, "3")
    src, dst = f"s3://{s3_env}/nodes/out", f"s3://{s3_env}/task/policy"
    local = tmp_path / "src"
    local.mkdir()
    (local / "config.json").write_text("{}")
    (local / "model.safetensors").write_bytes(os.urandom(11 * MIB))  # three parts
    store.upload_dir(local, src)
    store.reset_client()
    hold = s3.s3_client().meta.config.read_timeout + 2
    proxy = TcpProxy(seaweed.port, hold=lambda data: hold if _copy_request(data) else None)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        store.reset_client()
        store.copy_dir(src, dst)
        assert proxy.held == 4  # one CopyObject, three part copies
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
        store.reset_client()
    back = store.download_dir(dst, tmp_path / "back")
    assert _files(back)["model.safetensors"] == (local / "model.safetensors").read_bytes()


def test_a_failed_copy_says_what_it_was_copying(s3_env, seaweed, tmp_path, monkeypatch):
    """Part copies that never answer within the copy's timeout and budget: the error names the user's URI,
    the file, its bytes, the part and how long it tried; the destination keeps its earlier folder and no
    multipart upload stays open."""
    monkeypatch.setattr(copies, "COPY_PART_SIZE", 5 * MIB)
    src, dst = f"s3://{s3_env}/nodes/out", f"s3://{s3_env}/task/policy"
    local = tmp_path / "src"
    local.mkdir()
    (local / "model.safetensors").write_bytes(os.urandom(11 * MIB))
    store.upload_dir(local, src)
    store.upload_dir(_folder(tmp_path / "old", b"old weights"), dst)
    before = store.read_manifest(dst)

    def parts(data: bytes) -> float | None:  # a part copy's request line carries its uploadId
        return math.inf if b"uploadid=" in data.split(b"\r\n", 1)[0].lower() and _copy_request(data) else None

    proxy = TcpProxy(seaweed.port, hold=parts)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv(store.READ_TIMEOUT_ENV, "2")
        monkeypatch.setenv(copies.COPY_TIMEOUT_ENV, "2")
        monkeypatch.setenv(store.RETRY_BUDGET_ENV, "3")
        store.reset_client()
        started = time.monotonic()
        with pytest.raises(store.StoreError) as failed:
            store.copy_dir(src, dst)
        assert time.monotonic() - started <= copies.copy_budget_s() + store.FAILURE_SLACK_S
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
        store.reset_client()
    message = str(failed.value)
    assert message.startswith(f"{dst}: copying model.safetensors ({11 * MIB} bytes), part "), message
    assert " of 3 (bytes " in message and " failed after " in message and "uploadId" not in message, message
    assert store.read_manifest(dst) == before
    versions = {
        rel.split("/")[1] for rel in store.list_files(dst) if rel.startswith(f"{store.VERSIONS_DIR}/")
    }
    assert versions == {before["token"]}
    assert seaweed.client().list_multipart_uploads(Bucket=s3_env).get("Uploads", []) == []


def _old_token(age_s: float) -> str:
    return f"{time.time_ns() - int(age_s * 1e9):x}-{os.urandom(6).hex()}"


def test_clean_unpublished_clears_a_work_prefix_of_dead_writers(s3_env, seaweed, tmp_path, caplog):
    """Under a stage's work prefix: a published checkpoint, a version of it no marker names from two hours
    ago (a killed writer's), a young unnamed version (maybe a live writer's) and a multipart upload a
    killed node left. With the default safety age (1 hour) only the old version goes; with age 0 the young
    version and the upload go too. The published version stays whatever its age."""
    work = f"s3://{s3_env}/run/policy.work"
    ckpt = f"{work}/checkpoint-00002"
    store.upload_dir(_folder(tmp_path / "ckpt", b"weights"), ckpt)
    files = store.folder_files(_folder(tmp_path / "junk", b"partial"))
    old, young = _old_token(7200), store.new_token()
    store.upload_version(files, ckpt, old)
    store.upload_version(files, f"{work}/nodes/node-1/checkpoint-00002", young)
    client = seaweed.client()
    client.create_multipart_upload(
        Bucket=s3_env, Key=f"run/policy.work/checkpoint-00004/{store.VERSIONS_DIR}/x/y"
    )

    def versions() -> set[str]:
        return {
            rel.split("/_versions/")[1].split("/")[0]
            for rel in store.list_files(work)
            if "/_versions/" in rel
        }

    published = store.read_manifest(ckpt)["token"]
    assert versions() == {published, old, young}
    assert store.clean_unpublished(work) == (1, 0)
    assert versions() == {published, young}
    assert store.clean_unpublished(work, older_than_s=0) == (1, 1)
    assert versions() == {published}
    assert client.list_multipart_uploads(Bucket=s3_env).get("Uploads", []) == []
    assert store.download_dir(ckpt, tmp_path / "back")
