"""Real services for lineage tests: a PostgreSQL 15 cluster and an `mlflow server` process on loopback.

The MLflow server keeps its runs in PostgreSQL and proxies artifacts to the test SeaweedFS
(`--artifacts-destination s3://...`), the way docs/deploy.md runs it on a cluster: clients then
need only MLFLOW_TRACKING_URI, no S3 credentials. Both are started once per test session.

PostgreSQL's `initdb` refuses to run as root, so as root the cluster is created and run as the
`postgres` user (`runuser -u postgres --`) in a directory that user owns. The tests skip, saying
why, when the PostgreSQL binaries or the psycopg2 driver are not installed.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from services import SeaweedS3, free_port

MLFLOW_BUCKET = "mlflow-artifacts"


def postgres_bindir() -> Path | None:
    """Debian's PostgreSQL 15 (or any version found) keeps initdb and pg_ctl off PATH."""
    for candidate in [
        "/usr/lib/postgresql/15/bin",
        *sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True),
    ]:
        if (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


@dataclass
class PostgresCluster:
    """A throwaway cluster: trust auth on 127.0.0.1 only, fsync off (test data is disposable)."""

    bindir: Path
    root: Path | None = None
    port: int = 0
    user: str = "mlflow"

    def _as_owner(self) -> list[str]:
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _run(self, *args: str, timeout: float = 60) -> None:
        done = subprocess.run(
            [*self._as_owner(), *args], capture_output=True, text=True, timeout=timeout, cwd=self.root
        )
        if done.returncode != 0:
            log = self.root / "postgres.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{Path(args[0]).name} failed ({done.returncode}):\n{done.stderr}\n{tail}")

    def start(self) -> PostgresCluster:
        # Not under pytest's tmp dir: that one is mode 0700 for root and the postgres user cannot enter it.
        self.root = Path(tempfile.mkdtemp(prefix="dynrubric-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        data = self.root / "data"
        self._run(
            str(self.bindir / "initdb"),
            f"--pgdata={data}",
            "--auth=trust",
            f"--username={self.user}",
            "--encoding=UTF8",
            "--no-sync",
        )
        self.port = free_port()
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            str(self.bindir / "pg_ctl"),
            f"--pgdata={data}",
            f"--log={self.root / 'postgres.log'}",
            "--wait",
            "--timeout=30",
            "-o",
            options,
            "start",
        )
        return self

    def create_database(self, name: str) -> str:
        """A fresh database; returns its SQLAlchemy URI (psycopg2: SQLAlchemy 2.1's default is psycopg 3)."""
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=self.user, dbname="postgres")
        conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
        try:
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return f"postgresql+psycopg2://{self.user}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.root is None:
            return
        if (self.root / "data" / "postmaster.pid").exists():
            self._run(
                str(self.bindir / "pg_ctl"), f"--pgdata={self.root / 'data'}", "-m", "fast", "--wait", "stop"
            )
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None


@dataclass
class MlflowServer:
    """`mlflow server` with one worker, runs in PostgreSQL, artifacts proxied to SeaweedFS."""

    workdir: Path
    backend_store_uri: str
    s3: SeaweedS3
    bucket: str = MLFLOW_BUCKET
    proc: subprocess.Popen | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> MlflowServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
        env.update(self.s3.env())
        env.update(
            {
                "MLFLOW_S3_ENDPOINT_URL": self.s3.endpoint,
                # Without this the server starts a job runner: ~10 processes and ~2 GB of memory.
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            }
        )
        mlflow = Path(sys.executable).parent / "mlflow"
        args = [
            str(mlflow if mlflow.exists() else "mlflow"),
            "server",
            "--workers",
            "1",
            "--backend-store-uri",
            self.backend_store_uri,
            "--artifacts-destination",
            f"s3://{self.bucket}/",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        log = open(self.workdir / "mlflow.log", "wb")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir, start_new_session=True
        )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited early:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server not ready after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.3)

    def log_tail(self) -> str:
        log = self.workdir / "mlflow.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the CLI and its uvicorn child share the group
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="session")
def postgres():
    bindir = postgres_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) not found: apt-get install postgresql")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.skip("running as root needs `runuser` to start PostgreSQL as the postgres user")
    pytest.importorskip("psycopg2", reason="psycopg2 not installed: install the dev extra (psycopg2-binary)")
    cluster = PostgresCluster(bindir).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def mlflow_server(postgres, seaweed, tmp_path_factory):
    seaweed.client().create_bucket(Bucket=MLFLOW_BUCKET)
    server = MlflowServer(
        workdir=tmp_path_factory.mktemp("mlflow-server"),
        backend_store_uri=postgres.create_database("mlflow"),
        s3=seaweed,
    ).start()
    yield server
    server.stop()
