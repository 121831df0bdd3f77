"""The test suite's own set-up: what `make test` relies on to fit CI's minutes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROBE_CONFTEST = """
import os, pytest

@pytest.fixture(scope="module")
def costly():
    with open(os.environ["SETUPS"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.hookimpl(tryfirst=True)  # as tests/conftest.py marks the tests of its SHARED_FIXTURE_GROUPS
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "costly" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("costly"))
    items.sort(key=lambda item: item.name != "test_3")  # START_FIRST moves one of them ahead
"""
PROBE_TESTS = "".join(f"def test_{i}({'costly' if i % 2 else ''}):\n    pass\n\n\n" for i in range(8))


def test_the_tests_of_a_costly_fixture_share_one_worker_and_one_set_up(tmp_path: Path) -> None:
    """`--dist loadgroup` sends the tests of each xdist_group to one worker, where a fixture they share is
    set up once. With pytest 9.2 and pytest-xdist 3.8 the groups silently vanished (xdist renames each
    item's `_nodeid`, which pytest 9.2 no longer reads), and the tiny run's minutes-long fixtures were set
    up on both workers, over and over: pyproject pins pytest below 9.2 for that."""
    (tmp_path / "conftest.py").write_text(PROBE_CONFTEST)
    (tmp_path / "test_probe.py").write_text(PROBE_TESTS)
    setups = tmp_path / "setups.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
         str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "SETUPS": str(setups)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert setups.read_text().splitlines() in (["gw0"], ["gw1"]), setups.read_text()
