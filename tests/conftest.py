from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import transformers.utils.logging  # noqa: E402

# The MLflow server on PostgreSQL and SeaweedFS, one per session: declared here once, since a fixture
# imported into two test modules is two fixtures (two servers, and the second's bucket exists already).
from mlflow_server import mlflow_server, postgres  # noqa: E402, F401
from services import SeaweedS3  # noqa: E402

from dynamicrubric import store  # noqa: E402

# transformers gives its loggers one StreamHandler, bound to whatever sys.stderr is when transformers is
# first imported. Imported first inside a test that uses capsys, that handler keeps the test's stream,
# which is closed afterwards: every later transformers warning then prints a "--- Logging error ---"
# traceback into the running test's output (test_bad_inputs checks that output has no traceback). Import
# it and let it configure its handler here, before any test, so the handler holds pytest's session-wide
# stream.
transformers.utils.logging.get_logger()


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory):
    """Keep built models out of the user's cache unless DYNRUBRIC_CACHE is set (CI shares one per run)."""
    if "DYNRUBRIC_CACHE" not in os.environ:
        os.environ["DYNRUBRIC_CACHE"] = str(tmp_path_factory.mktemp("model-cache"))
    yield


@pytest.fixture(autouse=True)
def _root_log_handlers():
    """A test that runs `cli.main` in-process may take pytest's handlers off the root logger so the CLI's
    own setup logs to the captured stderr; put the root's handlers back as they were after every test,
    so no handler outlives the capture it writes to (CI: "Logging error ... I/O operation on closed
    file" in later tests when one was left behind)."""
    import logging

    before = logging.root.handlers[:]
    yield
    logging.root.handlers[:] = before


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(seaweed, monkeypatch):
    """AWS_* variables pointing at the test SeaweedFS, and a fresh bucket for this test."""
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    # A loopback server answers in milliseconds: a test whose store fails should fail in seconds, not
    # spend the default 2-minute retry budget on every operation (tests of the budget set their own).
    monkeypatch.setenv(store.RETRY_BUDGET_ENV, "20")
    store.reset_client()
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    seaweed.client().create_bucket(Bucket=bucket)
    yield bucket
    store.reset_client()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One `dynrubric run --preset tiny` (a real process, default log level) shared by the log, lineage and
    rerun tests: each full run costs minutes of CPU. Returns its folder, config, output and index."""
    import json
    import subprocess

    import yaml

    from dynamicrubric.infra.config import load_config

    workdir = tmp_path_factory.mktemp("tiny-run")
    config = workdir / "config.yaml"
    config.write_text(
        yaml.safe_dump({"preset": "tiny", "pipeline": {"pipeline_root": str(workdir / "runs")}})
    )
    proc = subprocess.run(
        [sys.executable, "-m", "dynamicrubric.cli", "run", "--config", str(config)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, f"the tiny run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    indexes = sorted((workdir / "runs").glob("*/index.json"))
    assert len(indexes) == 1, f"expected one run folder with an index, found {indexes}"
    return {
        "workdir": workdir,
        "config": config,
        "cfg": load_config(config),
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "index": json.loads(indexes[0].read_text()),
        "run_folder": indexes[0].parent,
        "tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}",
    }


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Print a failure as it happens, not only in the summary: a CI run cut off by its time limit never
    reaches the summary, and its log would say only that something failed."""
    if report.failed:
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext[-4000:]}\n")
