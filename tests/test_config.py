from __future__ import annotations

import pytest
import yaml

from dynamicrubric.infra.config import GIB, PRESETS, Config, ConfigError, disk_plan
from dynamicrubric.infra.config_loading import config_from_yaml, load_config
from dynamicrubric.infra.config_sections import quantity_bytes


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
    from dynamicrubric.infra.config import STAGE_FACTS
    from dynamicrubric.stages.kfp_source import ON_NODES, TRAINED_ON_NODES

    # every stage's component, and the training stages' for several nodes beside them
    names = {f.__name__ for f in STAGES}
    assert set(STAGE_FACTS) == {n for n in names if not n.endswith(ON_NODES)}
    assert {n.removesuffix(ON_NODES) for n in names if n.endswith(ON_NODES)} == set(TRAINED_ON_NODES)
    cfg = load_config(preset="paper")
    assert cfg.pipeline.stage_resources("rollout").gpus == 1  # the preset's entry wins
    assert cfg.pipeline.stage_resources("candidates") == STAGE_FACTS["candidates"].resources
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"pipeline": {"resources": {"rollouts": {"gpus": 1}}}}))
    with pytest.raises(ConfigError, match=r"pipeline\.resources: .*unknown stage 'rollouts'"):
        load_config(path)


def test_tensor_parallelism_follows_the_task_gpus(monkeypatch):
    from dynamicrubric.infra.config import TENSOR_PARALLEL_ENV

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


def test_a_key_that_would_reach_no_trainer_setting_is_refused():
    """The generator's two rewards are normalised by TRL's normalize_then_sum, which never reads
    scale_rewards: the key is the policy's alone, and the generator's is refused, naming it."""
    assert load_config(preset="tiny", overrides={"train_policy": {"scale_rewards": "batch"}})
    with pytest.raises(ConfigError, match=r"train_evaluator\.scale_rewards"):
        load_config(preset="tiny", overrides={"train_evaluator": {"scale_rewards": "batch"}})


def test_the_train_sections_use_trl_names_and_say_so_to_an_old_config():
    cfg = load_config(preset="tiny", overrides={"train_policy": {"max_steps": 5, "epsilon": 0.3}})
    assert (cfg.train_policy.max_steps, cfg.train_policy.epsilon) == (5, 0.3)
    with pytest.raises(ConfigError, match="'micro_batch_size' is now 'per_device_train_batch_size'"):
        load_config(preset="tiny", overrides={"train_evaluator": {"micro_batch_size": 2}})


def test_policy_thinking_is_off_by_default_and_configurable():
    assert Config().models.enable_thinking.policy is False
    assert load_config(preset="paper").models.enable_thinking.policy is False
    on = load_config(preset="tiny", overrides={"models": {"enable_thinking": {"policy": None}}})
    assert on.models.enable_thinking.policy is None  # the template's own default


def test_paper_preset_gpu_plan_fits_one_8_gpu_node():
    cfg = load_config(preset="paper")
    for stage in ("train_policy", "train_evaluator"):
        tcfg = getattr(cfg, stage)
        assert (tcfg.world_size, tcfg.reward_gpus) == (6, 2), stage
        assert cfg.pipeline.resources[stage].gpus == 8, stage
        # the global batch splits over the 6 training processes in whole micro-batches
        per_process, rest = divmod(tcfg.prompts_per_step * 8, tcfg.world_size)
        assert rest == 0 and per_process % tcfg.per_device_train_batch_size == 0, stage
    # the one-GPU inference stages take most of their GPU; the trainers' colocated vLLM its own share
    assert cfg.engine.gpu_memory_utilization >= 0.85 and cfg.engine.max_model_len == 20480
    assert cfg.train_policy.vllm_gpu_memory_utilization == 0.3


def test_the_verifiable_code_reward_is_refused_in_gpu_training():
    """The checker of HumanEval runs the policy's code; on GPUs that would be the training pod."""
    message = r"judge.variant verifiable .* \(pipeline.resources.train_policy.gpus is 8\)"
    with pytest.raises(ConfigError, match=message):
        load_config(preset="paper", overrides={"judge": {"variant": "verifiable"}})
    arithmetic = {"sources": ["reasoning_gym:basic_arithmetic"]}
    load_config(preset="paper", overrides={"judge": {"variant": "verifiable"}, "data": arithmetic})
    load_config(
        preset="tiny", overrides={"judge": {"variant": "verifiable"}, "data": {"sources": ["humaneval"]}}
    )


def test_a_training_plan_that_cannot_fit_is_refused_naming_the_numbers():
    # 80 GiB GPUs: 8.2B x 16 B = 122.2 GiB / 2 = 61.1 GiB + 16 GiB activations + 0.3 x 80 = 24 GiB colocated vLLM
    over = {
        "train_policy": {"world_size": 2},
        "pipeline": {"gpu_memory_gib": 80, "resources": {"train_policy": {"gpus": 4}}},
    }
    with pytest.raises(ConfigError) as err:
        load_config(preset="paper", overrides=over)
    message = str(err.value)
    assert message.count("\n") == 0 and "(got" not in message  # one line, without the whole config
    assert (
        "train_policy: each of 2 training GPUs needs 101.1 GiB > pipeline.gpu_memory_gib 80: policy weights, "
        "gradients and Adam state 8.2B params x 16 B / 2 = 61.1 GiB + activation_memory_gib 16 + colocated vLLM "
        "0.3 x 80 = 24.0 GiB"
    ) in message
    # the same on 6 GPUs fits: 20.4 + 16 + 24.0 = 60.4 GiB
    load_config(preset="paper", overrides={"pipeline": {"gpu_memory_gib": 80}})


def test_a_served_model_without_room_for_its_kv_cache_is_refused():
    # a 24 GiB GPU: Qwen3-8B's bf16 weights 16.4e9 B = 15.3 GiB > half of 0.9 x 24 = 21.6 GiB
    small = {"pipeline": {"gpu_memory_gib": 24}}
    with pytest.raises(
        ConfigError,
        match=(
            r"served generator \(1 GPU\(s\), a whole copy on each\): bf16 weights 8.2B params x 2 B = "
            r"15.3 GiB exceed half of a GPU's serving budget serving.gpu_memory_utilization 0.9 x 24 = 21.6 GiB"
        ),
    ):
        load_config(preset="paper", overrides=small)


def test_training_gpus_must_be_world_size_plus_reward_gpus():
    with pytest.raises(
        ConfigError,
        match=r"train_evaluator.gpus is 8 but \(train_evaluator.world_size 6 \+ reward_gpus 1\) = 7",
    ):
        load_config(preset="paper", overrides={"train_evaluator": {"reward_gpus": 1}})
    # the policy's reward serves G and V: two reward GPUs at least, unless one has a URL
    two = {"train_policy": {"world_size": 7, "reward_gpus": 1}}
    with pytest.raises(ConfigError, match=r"train_policy.reward_gpus is 1 but the task serves 2 model\(s\)"):
        load_config(preset="paper", overrides=two)
    # on 2 nodes of 8: each node serves its own G and V, so reward_gpus 2 is one a node
    nodes = {"train_policy": {"world_size": 14, "reward_gpus": 2, "num_nodes": 2, "prompts_per_step": 35}}
    with pytest.raises(ConfigError, match=r"reward_gpus is 2 but each of its 2 nodes serves 2 model\(s\)"):
        load_config(preset="paper", overrides=nodes)
    served_elsewhere = {**two, "models": {"generator_url": "http://g.team:8000/v1"}}
    assert load_config(preset="paper", overrides=served_elsewhere).train_policy.world_size == 7
    # no served role at all: every reward GPU can train
    urls = {"generator_url": "http://g:8000/v1", "verifier_url": "http://v:8000/v1"}
    none = {"train_policy": {"world_size": 8, "reward_gpus": 0}, "models": urls}
    assert load_config(preset="paper", overrides=none).train_policy.reward_gpus == 0


def test_the_plan_needs_the_model_sizes_and_skips_cpu_and_hf_configs():
    with pytest.raises(ConfigError, match=r"models.params_b.policy is not set"):
        load_config(preset="paper", overrides={"models": {"params_b": {"policy": None}}})
    # hf engine or no training GPUs: nothing to plan (the small presets have neither vLLM nor GPUs)
    hf = load_config(
        preset="paper", overrides={"engine": {"engine": "hf"}, "models": {"params_b": {"policy": None}}}
    )
    assert hf.models.params_b.policy is None
    assert load_config(preset="local").models.params_b.policy is None


def _alias_bomb() -> str:
    """A 0.5 KB billion-laughs file: nine levels of nine aliases each, the last under a known key."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(["lol:", *("  " + line for line in lines), "rollout:", "  k: *l8"]) + "\n"


@pytest.mark.parametrize(
    "text,message",
    [
        (_alias_bomb(), "line 3: YAML aliases (*name) are not allowed in a config"),
        ("rollout:\n  k: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 32 levels deep"),
        ("rollout:\n  k: &k 4\nrubrics:\n  num_items: *k\n", "line 4: YAML aliases"),
    ],
    ids=["alias-bomb", "5000-deep", "one-alias"],
)
def test_hostile_yaml_is_refused_quickly_in_one_line(tmp_path, text, message):
    import time
    import tracemalloc

    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    assert len(text) < 11_000
    started = time.process_time()  # CPU time: the cores are shared with other runs
    with pytest.raises(ConfigError) as err:
        load_config(path)
    seconds = time.process_time() - started
    tracemalloc.start()  # a second run for the memory: tracing slows the first one's clock
    try:
        with pytest.raises(ConfigError):
            load_config(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message_only = str(err.value).removeprefix(f"{path}: ")
    assert message in message_only and message_only != str(err.value)
    assert "\n" not in message_only and len(message_only) < 200
    assert seconds < 1 and peak < 100 << 20, (seconds, peak)


def test_a_huge_bad_value_is_not_printed_whole(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"k": ["x" * 1000] * 1000}}))
    with pytest.raises(ConfigError, match="rollout.k") as err:
        load_config(path)
    assert len(str(err.value).removeprefix(f"{path}: ")) < 400  # not the 1 MB value


@pytest.mark.parametrize(
    "text,key",
    [
        ("rollout:\n  temperature: .inf\n", "rollout.temperature"),
        ("train_policy:\n  learning_rate: -.inf\n", "train_policy.learning_rate"),
        ("train_evaluator:\n  beta: .nan\n", "train_evaluator.beta"),
    ],
)
def test_float_fields_must_be_finite(tmp_path, text, key):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{key}: Input should be a finite number"):
        load_config(path)


def test_prompt_counts_are_bounded(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  num_prompts: 100000000\n")
    with pytest.raises(ConfigError, match="data.num_prompts: Input should be less than or equal to 100000"):
        load_config(path)


def test_paper_preset_disk_plan_fits_its_model_cache():
    # Qwen3-8B, 8.2e9 params: staged bf16 15.27 GiB a model; a trainer checkpoint 8.2e9 x 12 B = 91.64 GiB
    cfg = load_config(preset="paper")
    policy, evaluator = disk_plan(cfg, "train_policy"), disk_plan(cfg, "train_evaluator")
    assert list(policy.staged) == ["policy", "generator", "verifier"] and list(evaluator.staged) == [
        "generator",
        "verifier",
    ]
    assert (
        round(policy.checkpoint_gib, 2) == 91.64
        and policy.copies == 2
        and round(policy.export_gib, 2) == 15.27
    )
    assert round(policy.need_gib, 1) == 268.8 and round(evaluator.need_gib, 1) == 252.0
    assert policy.need_gib < 300 == quantity_bytes(cfg.pipeline.model_cache_size) / GIB


def test_a_model_cache_too_small_for_the_trainer_checkpoints_is_refused_with_the_size_needed():
    with pytest.raises(ConfigError) as err:
        load_config(preset="paper", overrides={"pipeline": {"model_cache_size": "100Gi"}})
    message = str(err.value)
    assert message.count("\n") == 0 and "(got" not in message
    assert (
        "the disk plan does not fit: train_policy: its pod's /model-cache needs 268.8 GiB > "
        "pipeline.model_cache_size 100Gi (100.0 GiB): staged policy, generator, verifier 45.8 GiB (2 B/param) "
        "+ 2 trainer checkpoints (fp32 weights + Adam, 12 B/trained param) 2 x 91.6 GiB + the export 15.3 GiB "
        "+ 10% margin; set model_cache_size to 269Gi or more"
    ) in message
    assert "train_evaluator: its pod's /model-cache needs 252.0 GiB" in message
    with pytest.raises(
        ConfigError, match=r"pipeline.model_cache_size: Value error, '100 GB' is not a Kubernetes"
    ):
        load_config(preset="paper", overrides={"pipeline": {"model_cache_size": "100 GB"}})


def test_lora_checkpoints_need_far_less_disk():
    lora = {"lora_rank": 16}
    cfg = load_config(
        preset="paper",
        overrides={"train_policy": lora, "train_evaluator": lora, "pipeline": {"model_cache_size": "100Gi"}},
    )
    plan = disk_plan(cfg, "train_policy")
    # at most 2 x 16 / 1,024 of the parameters train: 8.2e9 x 3.125% x 12 B = 2.86 GiB a checkpoint
    assert round(plan.checkpoint_gib, 2) == 2.86 and plan.need_gib < 75
    assert disk_plan(load_config(preset="paper"), "train_policy").checkpoint_gib / plan.checkpoint_gib == 32


def test_two_nodes_need_each_node_its_share_of_the_checkpoints():
    # a node holds its ranks' DCP shards, 1/2 of a checkpoint; after a resume a second node keeps the first
    # node's part beside its own, and the next save: 3 halves. The staged models and the export are whole.
    nodes = {"world_size": 12, "reward_gpus": 4, "num_nodes": 2}
    over = {"train_policy": nodes, "train_evaluator": nodes, "pipeline": {"model_cache_size": "230Gi"}}
    cfg = load_config(preset="paper", overrides=over)
    plan = disk_plan(cfg, "train_policy")
    assert round(plan.checkpoint_gib, 2) == 45.82 and plan.copies == 3 and plan.nodes == 2
    assert round(sum(plan.staged.values()), 2) == 45.82 and round(plan.export_gib, 2) == 15.27
    assert round(plan.need_gib, 1) == 218.4  # (45.82 + 3 x 45.82 + 15.27) x 1.1
    with pytest.raises(ConfigError, match=r"train_policy: its pod's /model-cache needs 268.8 GiB > .* 230Gi"):
        load_config(preset="paper", overrides={"pipeline": {"model_cache_size": "230Gi"}})
    over["pipeline"]["model_cache_size"] = "200Gi"
    with pytest.raises(ConfigError, match=r"each of its 2 nodes' /model-cache needs 218.4 GiB > .* 200Gi"):
        load_config(preset="paper", overrides=over)


def test_guard_sets_the_generator_cannot_label_are_refused() -> None:
    """The generator labels a set's responses A..Z: the probe holds 2k, a canary set k plus canaries."""
    load_config(preset="tiny", overrides={"evaluate": {"samples": 13}})  # 26 in the probe: the limit
    with pytest.raises(ConfigError, match=r"evaluate.samples is 14: .* at most 26"):
        load_config(preset="tiny", overrides={"evaluate": {"samples": 14}})
    kinds = ["padded", "master_key", "format_only", "empty", "restated"]
    load_config(preset="tiny", overrides={"evaluate": {"samples": 13}, "guard": {"canary_kinds": kinds * 2}})
    with pytest.raises(ConfigError, match=r"evaluate.samples 13 plus 15 canaries"):
        load_config(
            preset="tiny", overrides={"evaluate": {"samples": 13}, "guard": {"canary_kinds": kinds * 3}}
        )
    # no canaries, or a baseline whose generator does not read the responses: no limit from them
    load_config(preset="tiny", overrides={"evaluate": {"samples": 12}, "guard": {"canary_sets": 0}})
    load_config(preset="tiny", overrides={"evaluate": {"samples": 20}, "judge": {"variant": "pointwise"}})
