"""Base models staged once into the object store (models.staging_plan / stage_models), and tasks
reading them from there (models.resolve_model on an s3:// URI), against a real SeaweedFS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamicrubric import store
from dynamicrubric.infra.config import EngineConfig
from dynamicrubric.infra.models import (
    STAGED_INFO,
    ModelError,
    prepare_model,
    resolve_model,
    stage_models,
    staged_uri,
    staging_plan,
)


def test_plan_stages_each_reference_once_under_an_s3_root():
    plan = staging_plan(["Qwen/Qwen3-8B", "Qwen/Qwen3-8B", "tiny-random"], "s3://b/runs")
    assert list(plan) == ["Qwen/Qwen3-8B", "tiny-random"]  # roles sharing a reference share one copy
    assert plan["Qwen/Qwen3-8B"].startswith("s3://b/runs/models/Qwen--Qwen3-8B-")
    assert plan["tiny-random"].startswith("s3://b/runs/models/tiny-random-")
    # two references that slug alike still get distinct copies
    assert staged_uri("s3://b/r", "a/b") != staged_uri("s3://b/r", "a--b")
    # an already staged URI is used as it is; so is everything under a local root (nothing copied)
    assert staging_plan(["s3://b/m/x"], "s3://b/runs") == {"s3://b/m/x": "s3://b/m/x"}
    assert staging_plan(["tiny-random", "/models/x"], "./runs") == {
        "tiny-random": "tiny-random",
        "/models/x": "/models/x",
    }


def test_stage_then_read_from_the_store(s3_env, tmp_path, monkeypatch):
    root = f"s3://{s3_env}/runs"
    source = prepare_model("tiny-random")
    plan = staging_plan(["tiny-random"], root)
    target = plan["tiny-random"]

    assert stage_models(plan) == {"tiny-random": "staged"}
    assert store.is_complete(target)
    info = json.loads(store.read_bytes(store.join(target, STAGED_INFO)))  # beside the model's files
    assert info["ref"] == "tiny-random" and info["source"] == str(source)
    files = set(store.read_manifest(target)["files"])  # what the folder's _COMPLETE marker lists
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files

    # a second run under the same root keeps the copy: nothing is written again
    store.write_bytes(store.join(target, STAGED_INFO), b"sentinel")
    assert stage_models(plan) == {"tiny-random": "already staged"}
    assert store.read_bytes(store.join(target, STAGED_INFO)) == b"sentinel"

    # a task with an empty cache reads the staged copy: same bytes, and a real forward pass
    monkeypatch.setenv("DYNRUBRIC_CACHE", str(tmp_path / "task-cache"))
    folder = resolve_model(target)
    assert folder.is_relative_to(tmp_path / "task-cache")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).read_bytes() == (source / name).read_bytes(), name
    from dynamicrubric.engines import load_engine

    engine = load_engine(target, EngineConfig(engine="hf", device="cpu"))
    (generation,) = engine.generate(["hello"], n=2, max_new_tokens=4, seed=0)
    assert len(generation.texts) == 2 and all(1 <= n <= 4 for n in generation.num_tokens)

    # fetched once: later loads in the pod come from the cache, even with the store gone
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    store.reset_client()
    assert resolve_model(target) == folder


def test_incomplete_staged_copy_is_refused(s3_env, tmp_path, monkeypatch):
    monkeypatch.setenv("DYNRUBRIC_CACHE", str(tmp_path))
    uri = f"s3://{s3_env}/runs/models/half"
    store.write_bytes(store.join(uri, "config.json"), b"{}")  # an interrupted upload: no _COMPLETE
    with pytest.raises(ModelError, match=r"staged model s3://.*/runs/models/half: .*incomplete"):
        resolve_model(uri)
    assert not any(Path(tmp_path).rglob("config.json"))  # nothing half-downloaded is left as a model


def test_the_context_check_of_a_staged_model_fetches_no_weights(s3_env, tmp_path, monkeypatch):
    """A training task checks its prompts against the model's context before it launches: from the
    config and tokenizer alone, not a download of the whole staged model into the task's pod."""
    from dynamicrubric.infra.config_loading import load_config
    from dynamicrubric.training.data import check_context

    uri = f"s3://{s3_env}/models/tiny"
    store.upload_dir(prepare_model("tiny-random"), uri)
    monkeypatch.setenv("DYNRUBRIC_CACHE", str(tmp_path / "task-cache"))
    cfg = load_config(preset="tiny")
    fits = {"prompt_id": ["a"], "prompt": [[{"role": "user", "content": "1 + 1 = ?"}]]}
    check_context("policy", cfg, uri, fits, 16, None)
    too_long = {"prompt_id": ["b"], "prompt": [[{"role": "user", "content": "1 + " * 3000}]]}
    with pytest.raises(
        ValueError, match=rf"prompt 'b' has \d+ tokens; .* exceeds the context length 2048 of '{uri}'"
    ):
        check_context("policy", cfg, uri, too_long, 16, None)
    fetched = sorted(p.name for p in (tmp_path / "task-cache").rglob("*") if p.is_file())
    assert "tokenizer.json" in fetched and "config.json" in fetched
    assert not [name for name in fetched if name.endswith(".safetensors")], fetched
    # the whole model, fetched later for training, is a folder of its own with its weights
    assert (resolve_model(uri) / "model.safetensors").is_file()
