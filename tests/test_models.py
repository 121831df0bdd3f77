"""Model references: local folders, hub ids (offline here), and the two built-in models.

The model cache lives under pytest's tmp (set by conftest's `_model_cache`) unless DYNRUBRIC_CACHE is set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from dynamicrubric.infra.models import (
    BUILTIN_MODELS,
    ModelError,
    build_tiny_random,
    cache_dir,
    prepare_model,
    resolve_model,
)


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DYNRUBRIC_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DYNRUBRIC_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "dynamicrubric"


def test_tiny_random_builds_deterministically(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    build_tiny_random(a)
    build_tiny_random(b)
    names = sorted(p.name for p in a.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between two builds"


def test_tiny_random_is_a_chatml_llama() -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model("tiny-random")
    assert path == cache_dir() / "tiny-random"
    assert resolve_model("tiny-random") == path  # prepared once, then found
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 2, 256)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token == "<|im_end|>" and cfg.eos_token_id == tok.eos_token_id
    for special in ("<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_concurrent_prepares_agree(tmp_path: Path) -> None:
    """Two processes preparing the same model into an empty cache: both succeed, one folder results."""
    env = {**os.environ, "DYNRUBRIC_CACHE": str(tmp_path)}
    code = "from dynamicrubric.infra.models import prepare_model; print(prepare_model('tiny-random'))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(tmp_path / "tiny-random")}
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-random"], "a temporary build folder was left behind"


def test_local_folder_resolves_to_itself(tmp_path: Path) -> None:
    folder = resolve_model("tiny-random")
    assert resolve_model(str(folder)) == folder.resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="is a file"):
        resolve_model(str(tmp_path / "file.bin"))
    with pytest.raises(ModelError, match="no such folder"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="not a built-in model"):
        resolve_model("not-a-model")
    with pytest.raises(ModelError, match="non-empty string"):
        resolve_model("")


def test_unknown_builtin_is_an_error() -> None:
    with pytest.raises(ModelError, match="unknown built-in model 'gpt-5'"):
        prepare_model("gpt-5")
    assert BUILTIN_MODELS == ("smollm2-135m-instruct", "tiny-random")


def test_hub_id_comes_from_the_local_hf_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A hub model already in huggingface_hub's cache resolves to its snapshot without the network."""
    repo = tmp_path / "models--someorg--cached-model"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("someorg/cached-model") == snapshot.resolve()


def test_hub_id_not_cached_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="'someorg/some-model' is not in the local Hugging Face cache"):
        resolve_model("someorg/some-model")
    # Online mode: the hub is unreachable here (and the repo does not exist anywhere): still a ModelError.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ModelError, match="could not fetch hub model 'someorg/some-model'"):
        resolve_model("someorg/some-model")


@pytest.mark.slow
def test_smollm2_prepares_from_the_wheel_and_answers() -> None:
    from dynamicrubric.engines import HFEngine

    path = prepare_model("smollm2-135m-instruct")
    assert (path / "model.safetensors").stat().st_size > 500e6  # fp32, 134.5M parameters
    engine = HFEngine("smollm2-135m-instruct", device="cpu")
    prompt = engine.chat_prompt([{"role": "user", "content": "What is 2+3?"}])
    gen = engine.generate([prompt], temperature=0.0, max_new_tokens=24)[0]
    assert gen.finish_reasons == ["stop"]
    assert "5" in gen.texts[0]


@pytest.mark.slow
def test_the_built_smollm2_stops_and_pads_with_im_end() -> None:
    """SmolLM2's folder declares <|im_end|> (id 2) as eos and pad, as its chat template and generation
    config use it, and keeps both ChatML tokens special; loaded, generate stops on it."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare_model("smollm2-135m-instruct")
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|im_end|>"
    added = {
        t["content"]: t["special"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    }
    assert added["<|im_start|>"] and added["<|im_end|>"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2
    assert model.generation_config.eos_token_id in (2, [2]) and model.generation_config.pad_token_id == 2


def test_an_older_build_of_a_builtin_model_is_rebuilt_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dynamicrubric.infra import models

    monkeypatch.setenv("DYNRUBRIC_CACHE", str(tmp_path))
    first = prepare_model("tiny-random")
    assert (first / models.BUILD_FILE).read_text() == "1"
    monkeypatch.setitem(models.BUILD_VERSIONS, "tiny-random", 2)  # as a new build of the model would
    (first / "marker").write_text("the old build")
    again = prepare_model("tiny-random")
    assert (
        again == first and not (again / "marker").exists() and (again / models.BUILD_FILE).read_text() == "2"
    )
    assert prepare_model("tiny-random") == first and not list(tmp_path.glob(".tiny-random.*"))
