"""The object store against a real SeaweedFS S3 server on loopback."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from services import SeaweedS3, TcpProxy

from dynamicrubric import store
from dynamicrubric.store import StoreError, folders, s3


def test_local_write_is_atomic_and_leaves_no_temp(tmp_path):
    uri = str(tmp_path / "a" / "b.bin")
    store.write_bytes(uri, b"one")
    store.write_bytes(uri, b"two")
    assert store.read_bytes(uri) == b"two"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]


def test_a_failed_local_write_names_the_users_path_not_the_temp_file(tmp_path):
    """A folder where the file goes: os.replace fails naming both paths; the error names the user's."""
    (tmp_path / "out.parquet").mkdir()
    with pytest.raises(StoreError) as failure:
        store.write_bytes(str(tmp_path / "out.parquet"), b"x")
    assert str(failure.value) == f"{tmp_path / 'out.parquet'}: cannot write: Is a directory"
    assert [p.name for p in tmp_path.iterdir()] == ["out.parquet"]  # the temp file is gone


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
    monkeypatch.setenv(store.RETRY_BUDGET_ENV, "0")
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
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    monkeypatch.setattr(s3, "PART_SIZE", 5 * 1024 * 1024)
    data = os.urandom(11 * 1024 * 1024)  # three parts at the 5 MiB minimum
    uri = f"s3://{s3_env}/big.bin"
    store.write_bytes(uri, data)
    assert store.read_bytes(uri) == data


def test_the_parts_of_a_multipart_upload_go_up_together(s3_env, monkeypatch):
    """Parts are sent PART_CONCURRENCY at a time, not one after another: the first two parts each wait
    at a barrier for the other, which only parts in flight together pass (one at a time, the first
    would wait out the barrier's timeout and the upload fail)."""
    import threading

    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    monkeypatch.setattr(s3, "PART_SIZE", 5 * 1024 * 1024)
    client = s3.s3_client()
    real_upload_part, together = client.upload_part, threading.Barrier(2, timeout=60)
    numbers = []

    def upload_part(**kwargs):
        numbers.append(kwargs["PartNumber"])
        if kwargs["PartNumber"] <= 2:
            together.wait()
        return real_upload_part(**kwargs)

    monkeypatch.setattr(client, "upload_part", upload_part)
    data = os.urandom(16 * 1024 * 1024)  # four parts
    uri = f"s3://{s3_env}/parts.bin"
    store.write_bytes(uri, data)
    assert sorted(numbers) == [1, 2, 3, 4]
    assert store.read_bytes(uri) == data


def test_a_large_file_of_a_folder_comes_down_in_parts_together(s3_env, tmp_path, monkeypatch):
    """A folder's file above MULTIPART_THRESHOLD (its size known from the manifest) is fetched by ranged
    GETs in flight together: the first two parts each wait at a barrier only concurrent parts pass. A
    part whose store call fails once is fetched again on its own, and the file is checked whole."""
    from botocore.exceptions import ConnectionClosedError

    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    monkeypatch.setattr(s3, "PART_SIZE", 5 * 1024 * 1024)
    src = tmp_path / "model"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(18 * 1024 * 1024))  # four parts, the last short
    uri = f"s3://{s3_env}/ranged"
    store.upload_dir(src, uri)
    client = s3.s3_client()
    real_get, together, ranges = client.get_object, threading.Barrier(2, timeout=60), []

    def get_object(**kwargs):
        ranges.append(kwargs.get("Range"))
        if (
            kwargs.get("Range") in ("bytes=0-5242879", "bytes=5242880-10485759")
            and ranges.count(kwargs["Range"]) == 1
        ):
            together.wait()
        if kwargs.get("Range") == "bytes=15728640-18874367" and ranges.count(kwargs["Range"]) == 1:
            raise ConnectionClosedError(endpoint_url="test")  # transient: retried
        return real_get(**kwargs)

    monkeypatch.setattr(client, "get_object", get_object)
    monkeypatch.setenv(store.RETRY_BUDGET_ENV, "30")
    dl = store.download_dir(uri, tmp_path / "dl")
    assert (dl / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert sorted({r for r in ranges if r}) == [  # (the marker comes in one GET)
        "bytes=0-5242879", "bytes=10485760-15728639", "bytes=15728640-18874367", "bytes=5242880-10485759"
    ]  # fmt: skip
    assert ranges.count("bytes=15728640-18874367") == 2


def test_the_session_server_has_a_volume_for_every_test_bucket(request, tmp_path):
    """SeaweedFS gives each bucket a volume and caps volumes (by default at free disk / 1 GiB): a server
    capped at 2 takes the third bucket's bucket but not its writes. The session's server, which every
    `s3_env` test gives a fresh bucket, must allow more volumes than the suite makes buckets: the CI
    run at 4353471 ran out after ~25 and failed every later S3 test."""
    server = SeaweedS3(tmp_path / "weed", max_volumes=2).start()
    try:
        client = server.client()
        for name in ["one", "two", "three"]:
            client.create_bucket(Bucket=f"bucket-{name}")
        client.put_object(Bucket="bucket-one", Key="k", Body=b"x")
        client.put_object(Bucket="bucket-two", Key="k", Body=b"x")
        with pytest.raises(Exception, match="InternalError"):
            client.put_object(Bucket="bucket-three", Key="k", Body=b"x")
    finally:
        server.stop()
    buckets = sum("s3_env" in getattr(item, "fixturenames", ()) for item in request.session.items)
    assert SeaweedS3(tmp_path).max_volumes > 2 * buckets, f"{buckets} tests make a bucket each"


def test_server_killed_mid_write_leaves_no_partial_object(tmp_path, monkeypatch):
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
            from dynamicrubric.store import s3
            s3.MULTIPART_THRESHOLD = s3.PART_SIZE = 5 * 1024 * 1024
            print("start", flush=True)
            store.write_bytes("s3://crash/big.bin", os.urandom(60 * 1024 * 1024))
            print("finished", flush=True)
            """
        )
        # A budget of seconds, not 0: with none, one part slower than the first attempt's 2 s (a loaded
        # machine) failed the upload before any part landed; once the server is dead it ends in 10 s.
        env = {**os.environ, **server.env(), store.RETRY_BUDGET_ENV: "10"}
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
        # The writer could not abort its upload (the server was dead); the next pre-flight check of
        # that output does, once the upload is older than the stale age.
        assert server.client().list_multipart_uploads(Bucket="crash").get("Uploads")
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv(store.STALE_UPLOAD_ENV, "0")
        store.reset_client()
        store.check_writable("s3://crash/big.bin")
        assert not server.client().list_multipart_uploads(Bucket="crash").get("Uploads")
    finally:
        store.reset_client()
        server.stop()


# --------------------------------------------------------------------------------------------------
# Retries


def test_retry_budget_is_spent_before_giving_up(monkeypatch):
    """Against a dead endpoint the store keeps retrying for the whole budget, then says so in one line."""
    from services import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv(store.RETRY_BUDGET_ENV, "3")
    store.reset_client()
    started = time.monotonic()
    try:
        with pytest.raises(
            StoreError, match=r"cannot reach the S3 endpoint .* \(gave up after \d+ attempts over 3 s\)$"
        ):
            store.write_bytes("s3://b/k", b"x")
    finally:
        store.reset_client()
    assert 3 <= time.monotonic() - started < 15


def test_default_retry_budget_is_at_least_a_minute(monkeypatch):
    monkeypatch.delenv(store.RETRY_BUDGET_ENV, raising=False)
    assert store.retry_budget_s() >= 60
    monkeypatch.setenv(store.RETRY_BUDGET_ENV, "soon")
    with pytest.raises(StoreError, match="DYNRUBRIC_S3_RETRY_BUDGET_S='soon': expected a number"):
        store.retry_budget_s()


def test_stage_survives_a_store_restart_during_its_write(tmp_path, monkeypatch):
    """The server is killed as the stage starts writing its outputs and comes back 3 s later, on the same
    ports and data: the write waits it out within the retry budget and the stage finishes."""
    from dynamicrubric.infra.artifacts import read_frame
    from dynamicrubric.infra.config_loading import load_config
    from dynamicrubric.stages.runner import run_stage

    server = SeaweedS3(tmp_path / "weed").start()
    try:
        server.client().create_bucket(Bucket="outage")
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv(store.RETRY_BUDGET_ENV, "60")
        store.reset_client()
        real_upload, outage = s3.upload_object, {}

        def upload_during_an_outage(uri, *args, **kwargs):
            if not outage:  # the first write of the stage's outputs: the server dies just before it
                server.kill()
                outage["killed"] = time.monotonic()
                restart = threading.Timer(3.0, server.start)
                restart.start()
                outage["restart"] = restart
            return real_upload(uri, *args, **kwargs)

        cfg = load_config(preset="tiny")
        outs = [f"s3://outage/run/{name}.parquet" for name in ("train", "eval", "anchors")]
        with monkeypatch.context() as m:
            m.setattr(s3, "upload_object", upload_during_an_outage)
            counts = run_stage(
                "prepare_data",
                cfg.to_yaml(),
                "",
                0,
                **dict(zip(("out_train_prompts", "out_eval_prompts", "out_anchor_lists"), outs, strict=True)),
            )
        outage["restart"].join()
        assert time.monotonic() - outage["killed"] >= 3  # the write really waited for the restart
        assert counts["train_prompts"] == len(read_frame(outs[0], "prompts")) > 0
        assert len(read_frame(outs[1], "prompts")) > 0
        read_frame(outs[2], "anchors")
    finally:
        store.reset_client()
        server.stop()


# --------------------------------------------------------------------------------------------------
# Two writers at once: a reader sees one writer's whole output, never a mix


TRIALS = 8


def _folder(root: Path, writer: str, names: list[str]) -> Path:
    root.mkdir(parents=True)
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(f"{writer}:{name}:".encode() * 2000)
    return root


def _race(*writers) -> None:
    """Run the writers in threads released together; re-raise the first failure."""
    start = threading.Barrier(len(writers))
    errors: list[BaseException] = []

    def run(fn):
        try:
            start.wait()
            fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _read_folder(uri: str, dest: Path) -> dict[str, bytes]:
    """A folder as a reader gets it: on S3 through download_dir; locally in place, pinned by a directory
    descriptor so that the whole read sees one folder even if a writer swaps another one in meanwhile."""
    if store.is_s3(uri):
        folder = store.download_dir(uri, dest)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        files.pop(store.COMPLETE_MARKER)
        return files
    try:
        fd = os.open(store.local_path(uri), os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise StoreError(f"{uri}: folder is absent or incomplete") from None
    try:

        def read(rel: str) -> bytes:
            with open(rel, "rb", opener=lambda path, flags: os.open(path, flags, dir_fd=fd)) as f:
                return f.read()

        try:
            manifest = json.loads(read(store.COMPLETE_MARKER))
            files = {rel: read(rel) for rel in manifest["files"]}
        except FileNotFoundError:  # a replaced folder being deleted under us
            raise StoreError(f"{uri}: folder is absent or incomplete (replaced)") from None
        on_disk = {
            os.path.relpath(os.path.join(root, name), ".")
            for root, _, names, _ in os.fwalk(".", dir_fd=fd)
            for name in names
        }
        assert on_disk <= {*manifest["files"], store.COMPLETE_MARKER}, sorted(on_disk)
        return files
    finally:
        os.close(fd)


def _writer_of(files: dict[str, bytes]) -> str:
    writers = {data.split(b":", 1)[0].decode() for data in files.values()}
    assert len(writers) == 1, f"a mix of writers {sorted(writers)}: {sorted(files)}"
    return writers.pop()


FOLDERS = {
    "A": ["config.json", "model-0.bin", "model-1.bin", "model-2.bin", "sub/x.txt"],
    "B": ["config.json", "model.bin"],
}


@pytest.mark.parametrize("where", ["local", "local-without-exchange", "s3"])
def test_two_folder_writers_never_mix(where, tmp_path, request, monkeypatch):
    if where == "local-without-exchange":  # a filesystem without renameat2(RENAME_EXCHANGE), e.g. NFS
        monkeypatch.setattr(folders, "_exchange", lambda a, b: None)
    base = (
        str(tmp_path / "out")
        if where.startswith("local")
        else f"s3://{request.getfixturevalue('s3_env')}/out"
    )
    sources = {w: _folder(tmp_path / f"src-{w}", w, names) for w, names in FOLDERS.items()}
    winners, reads = set(), 0
    for trial in range(TRIALS):
        uri = store.join(base, f"ckpt-{trial % 2}")  # odd trials rewrite an existing folder
        seen: list[str] = []
        reader_errors: list[BaseException] = []
        stop = threading.Event()

        def reader(uri=uri, trial=trial, seen=seen, stop=stop, reader_errors=reader_errors):
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    files = _read_folder(uri, tmp_path / f"read-{trial}-{n}")
                    seen.append(_writer_of(files))
                except StoreError as e:
                    if "absent or incomplete" not in str(e):
                        reader_errors.append(e)
                except BaseException as e:
                    reader_errors.append(e)

        watcher = threading.Thread(target=reader)
        watcher.start()
        try:
            _race(
                lambda uri=uri: store.upload_dir(sources["A"], uri),
                lambda uri=uri: store.upload_dir(sources["B"], uri),
            )
        finally:
            stop.set()
            watcher.join()
        assert not reader_errors, reader_errors[0]
        reads += len(seen)
        files = _read_folder(uri, tmp_path / f"final-{trial}")
        winner = _writer_of(files)
        assert sorted(files) == FOLDERS[winner]  # the whole folder of one writer, nothing of the other
        winners.add(winner)
    assert reads > 0  # the reader did read while the writers raced
    if where.startswith("local"):  # no temp or set-aside folders are left behind
        assert sorted(p.name for p in Path(base).iterdir()) == ["ckpt-0", "ckpt-1"]


def test_a_path_opening_reader_of_a_local_rewrite_sees_one_folder(tmp_path):
    """A model loader opens file after file by path (`from_pretrained`); while two writers keep swapping
    their folders in, the folder `resolve_model` hands it always holds one writer's files."""
    from dynamicrubric.infra.models import resolve_model

    dest = tmp_path / "ckpt"
    sources = {w: _folder(tmp_path / f"src-{w}", w, names) for w, names in FOLDERS.items()}
    store.upload_dir(sources["A"], str(dest))
    stop = threading.Event()
    reads: list[str] = []

    errors: list[BaseException] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                folder = resolve_model(str(dest))
                files = {
                    p.relative_to(folder).as_posix(): p.read_bytes()
                    for p in sorted(folder.rglob("*"))
                    if p.is_file() and p.name != store.COMPLETE_MARKER
                }
                writer = _writer_of(files)
                assert sorted(files) == FOLDERS[writer], sorted(files)
                reads.append(writer)
            except BaseException as e:  # a mix, or a file gone mid-read
                errors.append(e)

    watcher = threading.Thread(target=reader)
    watcher.start()
    try:
        for _ in range(60):
            _race(*(lambda w=w: store.upload_dir(sources[w], str(dest)) for w in "AB"))
    finally:
        stop.set()
        watcher.join()
    assert not errors, f"{len(errors)} bad reads of {len(errors) + len(reads)}: {errors[0]!r}"
    assert len(reads) >= 50 and set(reads) == {"A", "B"}, (len(reads), set(reads))
    pinned = resolve_model(str(dest))
    assert pinned != dest and resolve_model(str(pinned)) == pinned  # a pinned version is not pinned again
    store.delete_dir(str(dest))  # takes the pinned versions with it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src-A", "src-B"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_rewrite_with_fewer_files_shows_only_the_new_ones(where, tmp_path, request):
    base = str(tmp_path / "out") if where == "local" else f"s3://{request.getfixturevalue('s3_env')}/out"
    uri = store.join(base, "ckpt")
    store.upload_dir(_folder(tmp_path / "big", "A", FOLDERS["A"]), uri)
    store.upload_dir(_folder(tmp_path / "small", "B", FOLDERS["B"]), uri)
    files = _read_folder(uri, tmp_path / "dl")
    assert sorted(files) == FOLDERS["B"] and _writer_of(files) == "B"
    assert store.read_bytes(store.folder_file(uri, "model.bin")).startswith(b"B:model.bin:")
    with pytest.raises(StoreError, match="the folder has no file 'model-0.bin'"):
        store.folder_file(uri, "model-0.bin")
    if where == "s3":  # the replaced version is deleted, not just hidden
        token = store.read_manifest(uri)["token"]
        assert {f.split("/")[1] for f in store.list_files(uri) if f.startswith("_versions/")} == {token}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_file_writers_never_mix(where, tmp_path, request, monkeypatch):
    if where == "s3":  # big enough for a multipart upload, where a mix of parts would be possible
        monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
        monkeypatch.setattr(s3, "PART_SIZE", 5 * 1024 * 1024)
    base = str(tmp_path) if where == "local" else f"s3://{request.getfixturevalue('s3_env')}"
    payload = {w: w.encode() * (11 * 1024 * 1024) for w in "AB"}
    for trial in range(TRIALS):
        uri = store.join(base, f"file-{trial % 2}.bin")
        _race(*(lambda w=w, uri=uri: store.write_bytes(uri, payload[w]) for w in "AB"))
        data = store.read_bytes(uri)
        assert data in (payload["A"], payload["B"])
    if where == "local":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["file-0.bin", "file-1.bin"]


def test_local_outputs_are_group_readable(tmp_path):
    old = os.umask(0o022)
    try:
        store.write_bytes(str(tmp_path / "a.bin"), b"x")
        store.upload_dir(_folder(tmp_path / "src", "A", ["f.bin"]), str(tmp_path / "ckpt"))
    finally:
        os.umask(old)
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "ckpt" / "f.bin").stat().st_mode & 0o777 == 0o644


def test_check_writable_fails_fast_and_writes_nothing(tmp_path, s3_env):
    with pytest.raises(StoreError, match="^s3://no-such-bucket-x/out.parquet: the bucket does not exist$"):
        store.check_writable("s3://no-such-bucket-x/out.parquet")
    store.check_writable(f"s3://{s3_env}/round/out.parquet")
    assert store.list_files(f"s3://{s3_env}") == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="is not a folder"):
        store.check_writable(str(tmp_path / "file" / "sub" / "out.parquet"))
    store.check_writable(str(tmp_path / "new" / "deeper" / "out.parquet"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_outputs_as_a_set_publish_all_or_none(tmp_path, s3_env):
    outs = [str(tmp_path / "a.bin"), f"s3://{s3_env}/b.bin", str(tmp_path / "plots")]
    with pytest.raises(RuntimeError, match="later output failed"), store.outputs_as_a_set(*outs) as paths:
        Path(paths[0]).write_bytes(b"a")
        raise RuntimeError("later output failed")
    assert not Path(outs[0]).exists() and not store.exists(outs[1]) and not Path(outs[2]).exists()

    # Publishing itself fails at the last output: the ones already published are removed again.
    blocker = tmp_path / "plots"
    blocker.write_text("a file where the folder should go")
    with (
        pytest.raises(StoreError, match="exists and is not a folder"),
        store.outputs_as_a_set(*outs) as paths,
    ):
        Path(paths[0]).write_bytes(b"a")
        Path(paths[1]).write_bytes(b"b")
        Path(paths[2]).mkdir()
        (Path(paths[2]) / "p.png").write_bytes(b"png")
    assert not Path(outs[0]).exists() and not store.exists(outs[1])
    blocker.unlink()

    with store.outputs_as_a_set(*outs) as paths:
        Path(paths[0]).write_bytes(b"a")
        Path(paths[1]).write_bytes(b"b")
        Path(paths[2]).mkdir()
        (Path(paths[2]) / "p.png").write_bytes(b"png")
    assert store.read_bytes(outs[0]) == b"a" and store.read_bytes(outs[1]) == b"b"
    assert store.is_complete(outs[2]) and (Path(outs[2]) / "p.png").read_bytes() == b"png"


# --------------------------------------------------------------------------------------------------
# A local folder copied to S3 flat, as KFP's launcher uploads a task's output artifact


def _model_folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "model.safetensors").write_bytes(os.urandom(300_000))
    (root / "sub" / "x.bin").write_bytes(os.urandom(1000))
    return root


def _launcher_upload(seaweed: SeaweedS3, local: Path, uri: str) -> None:
    """KFP's v2 launcher: every file under the task's output path, `_COMPLETE` included, put under the
    artifact's URI with the same relative key (plain boto3, nothing of the store)."""
    bucket, prefix = store.split_s3(uri.rstrip("/") + "/")
    client = seaweed.client()
    for p in sorted(local.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), bucket, prefix + p.relative_to(local).as_posix())


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and p.name != store.COMPLETE_MARKER
    }


def test_a_local_folder_uploaded_flat_by_the_launcher_reads_by_its_s3_uri(s3_env, seaweed, tmp_path):
    from dynamicrubric.infra.models import resolve_model

    local = tmp_path / "pod" / "s3" / s3_env / "run" / "task" / "out"
    store.upload_dir(_model_folder(tmp_path / "trained"), str(local))  # the task writes its output path
    uri = f"s3://{s3_env}/run/task/out"
    _launcher_upload(seaweed, local, uri)
    assert store.read_manifest(uri)["layout"] == "flat"
    want = _files(local)
    assert _files(store.download_dir(uri, tmp_path / "dl")) == want
    assert store.read_bytes(store.folder_file(uri, "sub/x.bin")) == want["sub/x.bin"]
    assert _files(resolve_model(uri)) == want
    # A file changed after the marker was written is refused, not read.
    bucket, prefix = store.split_s3(uri + "/")
    seaweed.client().put_object(Bucket=bucket, Key=prefix + "sub/x.bin", Body=b"tampered")
    with pytest.raises(StoreError, match=r"sub/x\.bin does not match its checksum in _COMPLETE"):
        store.download_dir(uri, tmp_path / "dl2")
    assert not (tmp_path / "dl2" / "sub" / "x.bin").exists()  # a refused file never appears


def test_an_s3_rewrite_of_a_flat_copied_folder_replaces_its_files(s3_env, seaweed, tmp_path):
    local = tmp_path / "out"
    store.upload_dir(_model_folder(tmp_path / "a"), str(local))
    uri = f"s3://{s3_env}/ckpt"
    _launcher_upload(seaweed, local, uri)
    store.upload_dir(_folder(tmp_path / "b", "B", FOLDERS["B"]), uri)  # an S3 writer rewrites it
    manifest = store.read_manifest(uri)
    assert manifest["layout"] == "versioned"
    files = _read_folder(uri, tmp_path / "dl")
    assert sorted(files) == FOLDERS["B"] and _writer_of(files) == "B"
    # the flat copy's files are gone, only the new version and its marker are left
    assert sorted(store.list_files(uri)) == sorted(
        [store.COMPLETE_MARKER, *(f"_versions/{manifest['token']}/{rel}" for rel in FOLDERS["B"])]
    )


@pytest.mark.parametrize("writer", ["local-then-flat-copy", "s3"])
def test_format1_manifests_are_still_read(writer, s3_env, seaweed, tmp_path):
    """Markers written before they named a layout: an S3 writer's (files under _versions/<token>/) and a
    local writer's copied flat by the launcher."""
    src = _model_folder(tmp_path / "src")
    uri = f"s3://{s3_env}/old"
    bucket, prefix = store.split_s3(uri + "/")
    token = "18f0000000000000-0123456789ab"
    entries = {
        rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for rel, data in _files(src).items()
    }
    marker = json.dumps({"format": 1, "token": token, "files": entries}).encode()
    under = prefix if writer != "s3" else f"{prefix}_versions/{token}/"
    client = seaweed.client()
    for rel in entries:
        client.upload_file(str(src / rel), bucket, under + rel)
    client.put_object(Bucket=bucket, Key=prefix + store.COMPLETE_MARKER, Body=marker)
    assert store.read_manifest(uri)["layout"] == ("versioned" if writer == "s3" else "flat")
    assert _files(store.download_dir(uri, tmp_path / "dl")) == _files(src)
    assert store.read_bytes(store.folder_file(uri, "config.json")) == (src / "config.json").read_bytes()


# --------------------------------------------------------------------------------------------------
# Memory: a model folder's files are streamed, never whole in memory (a pod has a memory limit)

BIG_FILE_MB = 300  # larger than the limit below: a whole-object read cannot fit
MEMORY_LIMIT_MB = 160  # a bare python + boto3 + the store measured ≈51 MB peak here


@pytest.mark.slow  # 300 MB up and down: ≈35 s on a loaded 2-core machine
def test_a_folder_larger_than_the_memory_limit_is_uploaded_and_downloaded(s3_env, seaweed, tmp_path):
    from pod_limits import memory_limit_mechanism, run_with_memory_limit

    if memory_limit_mechanism() is None:
        pytest.skip("no memory cgroup (v1 or v2) is writable here and RLIMIT_AS is unavailable")
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    digest = hashlib.sha256()
    with open(src / "model.safetensors", "wb") as f:
        for _ in range(BIG_FILE_MB):
            block = os.urandom(1 << 20)
            f.write(block)
            digest.update(block)
    uri = f"s3://{s3_env}/big-model"
    script = textwrap.dedent(f"""
        from dynamicrubric import store
        store.upload_dir({str(src)!r}, {uri!r})
        store.download_dir({uri!r}, {str(tmp_path / "dl")!r})
    """)
    env = {**os.environ, **seaweed.env(), store.RETRY_BUDGET_ENV: "20"}
    proc = run_with_memory_limit(
        [sys.executable, "-c", script], MEMORY_LIMIT_MB << 20, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode} under {MEMORY_LIMIT_MB} MiB ({memory_limit_mechanism()}): {proc.stderr[-2000:]}"
    )
    got = hashlib.sha256()
    with open(tmp_path / "dl" / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            got.update(block)
    assert got.hexdigest() == digest.hexdigest()


def test_a_download_cut_off_mid_stream_starts_that_file_over(s3_env, seaweed, tmp_path, monkeypatch, caplog):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(os.urandom(12 << 20))
    uri = f"s3://{s3_env}/cut"
    store.upload_dir(src, uri)
    proxy = TcpProxy(seaweed.port, cut_after=5 << 20)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        store.reset_client()
        with caplog.at_level("WARNING", logger="dynamicrubric.store"):
            dl = store.download_dir(uri, tmp_path / "dl")
    finally:
        proxy.close()
        store.reset_client()
    assert proxy.cuts == 1
    assert "retrying" in caplog.text  # the store's budgeted retry took it, not a silent short file
    assert (dl / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert sorted(p.name for p in dl.iterdir()) == [
        "_COMPLETE",
        "config.json",
        "model.safetensors",
    ]  # no temp


def test_copy_file_streams_between_any_two_uris(s3_env, tmp_path):
    data = os.urandom(3 << 20)
    (tmp_path / "a.bin").write_bytes(data)
    store.copy_file(str(tmp_path / "a.bin"), f"s3://{s3_env}/b.bin")
    store.copy_file(f"s3://{s3_env}/b.bin", str(tmp_path / "sub" / "c.bin"))
    assert (tmp_path / "sub" / "c.bin").read_bytes() == data
    with pytest.raises(StoreError, match=rf"^s3://{s3_env}/missing\.bin: no such object$"):
        store.copy_file(f"s3://{s3_env}/missing.bin", str(tmp_path / "d.bin"))
    assert not (tmp_path / "d.bin").exists()
