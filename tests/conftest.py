from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Under pytest-xdist each worker, and every process it starts, computes with one thread. On 2 cores, two
# torch processes with 2 threads each ran 5-13x slower than with one each (OpenMP's waiting threads spin);
# two workers keep the two cores busy with one thread each. Set before torch is imported (its OpenMP
# runtime reads it once); local tasks and trainers inherit it (task_monitor.task_threads honours it).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

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
    """Keep built models out of the user's cache unless DYNRUBRIC_CACHE is set. The pytest-xdist workers of
    one run share a cache (beside their own temp folders): a built-in model is built once, by whichever
    worker asks first, under the cache's file lock, and the others wait and find it."""
    if "DYNRUBRIC_CACHE" not in os.environ:
        base = tmp_path_factory.getbasetemp()
        shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
        (shared / "model-cache").mkdir(exist_ok=True)
        os.environ["DYNRUBRIC_CACHE"] = str(shared / "model-cache")
    yield


# Fixtures that cost minutes, each shared by the tests that use it: under pytest-xdist every worker is a
# session of its own, so the tests of one such fixture go to one worker (`--dist loadgroup`), which runs
# it once. A module's fixture (pipeline_run) also needs its tests run one after another: START_FIRST
# moves one of them ahead, and apart from the others it was set up again, minutes each time. A test
# that uses two of them joins the first one's group.
SHARED_FIXTURE_GROUPS = {
    "tiny_run": "tiny-run",
    "mlflow_server": "mlflow-server",
    "pipeline_run": "pipeline-run",
}

# The tests that take longest on the 2-core machine start first, so that the workers finish together
# rather than one running a long test alone at the end (pytest's --durations on CI; ordered longest first).
START_FIRST = (
    "test_pipeline.py::test_default_run_completes",
    "test_pod_runs.py::test_chained_tiny_run_as_pods",
    "test_pipeline.py::test_resume_reuses_round_one",
    "test_guard_pipeline.py::test_a_hacked_round_is_rolled_back",
    "test_train.py::test_ranks_wait_out_a_slow_checkpoint_upload",
    "test_study.py::test_a_tiny_dynamic_variant_runs_end_to_end",
    "test_pipeline.py::test_early_stop_skips_later_rounds",
    "test_trainjob.py::test_two_nodes_train_a_failed_trainjob",
    "test_guard_pipeline.py::test_a_stop_action_runs_no_round",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the groups into the nodes' ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = next((g for f, g in SHARED_FIXTURE_GROUPS.items() if f in item.fixturenames), None)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            # a whole pipeline run or the MLflow server's three processes: never part of `make test-fast`
            item.add_marker(pytest.mark.slow)

    def rank(item: pytest.Item) -> int:
        name = item.nodeid.rsplit("/", 1)[-1]
        return next((i for i, prefix in enumerate(START_FIRST) if name.startswith(prefix)), len(START_FIRST))

    items.sort(key=rank)  # stable: the rest keep pytest's order


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

    from dynamicrubric.infra.config_loading import load_config

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
