from __future__ import annotations

import pytest
import yaml

from dynamicrubric.config import PRESETS, Config, ConfigError, config_from_yaml, load_config


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_load_and_round_trip(preset):
    cfg = load_config(preset=preset)
    assert cfg.preset == preset
    assert config_from_yaml(cfg.to_yaml()) == cfg


def test_default_is_the_local_preset():
    cfg = load_config()
    assert cfg.preset == "local" and cfg.models.policy == "smollm2-135m-instruct" and cfg.rollout.k == 4


def test_paper_preset_carries_the_paper_settings():
    cfg = load_config(preset="paper")
    assert (cfg.rollout.k, cfg.train_policy.beta, cfg.train_evaluator.beta) == (8, 0.01, 0.01)
    assert (cfg.train_evaluator.learning_rate, cfg.train_policy.learning_rate) == (5e-6, 1e-6)
    assert cfg.engine.engine == "vllm" and cfg.models.generator == "Qwen/Qwen3-8B"


def test_user_file_is_laid_over_the_preset(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"preset": "tiny", "rollout": {"k": 6}, "pipeline": {"rounds": 3}}))
    cfg = load_config(path)
    assert (cfg.preset, cfg.rollout.k, cfg.pipeline.rounds) == ("tiny", 6, 3)
    assert (
        cfg.rollout.max_new_tokens == load_config(preset="tiny").rollout.max_new_tokens
    )  # kept from the preset


@pytest.mark.parametrize(
    "content,message",
    [
        ({"rollout": {"kk": 3}}, "unknown key 'rollout.kk'"),
        ({"bogus": 1}, "unknown key 'bogus'"),
        ({"rollout": {"k": 1}}, "rollout.k: Input should be greater than or equal to 2"),
        ({"engine": {"engine": "tgi"}}, "engine.engine: Input should be 'hf' or 'vllm'"),
        ({"rubrics": {"variant": "magic"}}, "rubrics.variant"),
        ({"pipeline": {"tolerations": [{"effect": "Sometimes"}]}}, "pipeline.tolerations.0.effect"),
        ({"preset": "huge"}, "preset: unknown preset 'huge'"),
    ],
)
def test_bad_config_names_the_key(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(content))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("rollout: {k: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_flat_params_have_no_secrets():
    flat = Config().flat()
    assert flat["rollout.k"] == 8 and "pipeline.s3_secret" in flat
    assert not any("secret_key" in k or "password" in k for k in flat)


def test_every_stage_has_requests_and_unknown_stages_are_errors(tmp_path):
    from dynamicrubric.components.stages import STAGES
    from dynamicrubric.config import DEFAULT_STAGE_RESOURCES

    assert set(DEFAULT_STAGE_RESOURCES) == {f.__name__ for f in STAGES}
    cfg = load_config(preset="paper")
    assert cfg.pipeline.stage_resources("rollout").gpus == 1  # the preset's entry wins
    assert cfg.pipeline.stage_resources("candidates") == DEFAULT_STAGE_RESOURCES["candidates"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"pipeline": {"resources": {"rollouts": {"gpus": 1}}}}))
    with pytest.raises(ConfigError, match=r"pipeline\.resources: .*unknown stage 'rollouts'"):
        load_config(path)


def test_tensor_parallelism_follows_the_task_gpus(monkeypatch):
    from dynamicrubric.config import TENSOR_PARALLEL_ENV

    cfg = load_config(preset="paper")
    monkeypatch.setenv(TENSOR_PARALLEL_ENV, "4")  # what the pipeline sets on a 4-GPU task's pod
    assert config_from_yaml(cfg.to_yaml()).engine.tensor_parallel_size == 4
    monkeypatch.setenv(TENSOR_PARALLEL_ENV, "four")
    with pytest.raises(ConfigError, match=f"{TENSOR_PARALLEL_ENV}='four': expected a positive integer"):
        config_from_yaml(cfg.to_yaml())
    monkeypatch.delenv(TENSOR_PARALLEL_ENV)
    assert config_from_yaml(cfg.to_yaml()).engine.tensor_parallel_size == 1


def test_a_second_tensor_parallel_setting_is_refused():
    message = r"engine.tensor_parallel_size is 2 but pipeline.resources.rollout.gpus is 1"
    with pytest.raises(ConfigError, match=message):
        load_config(preset="paper", overrides={"engine": {"tensor_parallel_size": 2}})
    # consistent with every inference stage's GPUs: accepted
    gpus = {s: {"gpus": 2} for s in ("rollout", "rubrics", "judge", "evaluate")}
    cfg = load_config(
        preset="paper", overrides={"engine": {"tensor_parallel_size": 2}, "pipeline": {"resources": gpus}}
    )
    assert cfg.engine.tensor_parallel_size == 2
