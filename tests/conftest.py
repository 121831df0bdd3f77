from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from services import SeaweedS3  # noqa: E402

from dynamicrubric import store  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory):
    """Keep built models out of the user's cache unless DYNRUBRIC_CACHE is set (CI shares one per run)."""
    if "DYNRUBRIC_CACHE" not in os.environ:
        os.environ["DYNRUBRIC_CACHE"] = str(tmp_path_factory.mktemp("model-cache"))
    yield


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
    store.reset_client()
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    seaweed.client().create_bucket(Bucket=bucket)
    yield bucket
    store.reset_client()
