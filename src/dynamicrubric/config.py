"""One typed configuration for every stage and command, loaded from YAML.

A configuration is a named preset (`tiny`, `local`, `paper`, shipped in `presets/`) with a user's
YAML file laid over it (nested keys replace the preset's). Unknown keys and bad values are errors
that name the key. Secrets never live here: S3 and MLflow credentials come from the environment.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_PRESET = "local"
PRESETS = ("tiny", "local", "paper")


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message names the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelsConfig(Section):
    # A model reference: a local Hugging Face folder, a hub id, or a built-in name
    # ("smollm2-135m-instruct", "tiny-random"). Each role loads its own copy.
    policy: str = "smollm2-135m-instruct"
    generator: str = "smollm2-135m-instruct"
    verifier: str = "smollm2-135m-instruct"


class EngineConfig(Section):
    engine: Literal["hf", "vllm"] = "hf"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    batch_size: int = Field(16, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)  # vLLM only
    tensor_parallel_size: int = Field(1, ge=1)  # vLLM only
    # A prompt longer than the model's context: "error" stops the stage naming the prompt; "truncate"
    # keeps its last tokens (the end of a chat prompt, where the question and the answer cue are) and
    # logs how many prompts were cut.
    long_prompts: Literal["error", "truncate"] = "error"


class DataConfig(Section):
    # Built-in sources: "reasoning_gym:<task>" (e.g. reasoning_gym:basic_arithmetic), "humaneval";
    # or a path/URI to a JSONL or Parquet file with a `prompt` column.
    sources: list[str] = ["reasoning_gym:basic_arithmetic"]
    num_prompts: int = Field(8, ge=1)  # per source, per split
    eval_prompts: int = Field(8, ge=0)  # held-out prompts per source for evaluation
    anchors: list[str] = []  # Nectar-format or anchors-artifact files used for R_anchor
    anchors_from_outcomes: bool = True  # also rank rollouts by verifiable correctness for R_anchor
    labelled: list[str] = []  # held-out pairs / ranked lists for evaluator accuracy
    seed: int = 0


class RolloutConfig(Section):
    k: int = Field(8, ge=2)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(128, ge=1)


class RubricsConfig(Section):
    variant: Literal["dynamic", "static"] = "dynamic"
    num_items: int = Field(6, ge=1, le=32)  # M: the most items kept from one rubric
    samples: int = Field(1, ge=1)  # G rubric samples per candidate set when scoring the policy
    train_samples: int = Field(4, ge=2)  # G when the samples feed the generator's GRPO
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(256, ge=16)
    max_response_chars: int = Field(1200, ge=50)  # each response is cut to this in the generator prompt


class JudgeConfig(Section):
    variant: Literal["rubric", "pointwise"] = "rubric"
    batch_size: int = Field(32, ge=1)
    max_response_chars: int = Field(2000, ge=50)


class AggregateConfig(Section):
    soft: bool = False  # use p_yes instead of hard verdicts in the score


class TrainConfig(Section):
    learning_rate: float = Field(1e-5, gt=0)
    epochs: int = Field(1, ge=1)  # passes over the round's samples (ratio != 1 after the first)
    micro_batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    beta: float = Field(0.01, ge=0)  # KL coefficient (k3 estimator) to the frozen reference
    clip_eps: float = Field(0.2, gt=0)
    scale_rewards: bool = True  # False: Dr. GRPO, no std division
    loss_averaging: Literal["token", "sequence"] = "token"
    lora_rank: int = Field(0, ge=0)  # 0: full finetune; >0: LoRA merged into the saved checkpoint
    lora_alpha: int = Field(32, ge=1)
    gradient_checkpointing: bool = False
    max_grad_norm: float = Field(1.0, gt=0)
    save_every: int = Field(1, ge=1)  # optimiser steps between resumable checkpoints
    world_size: int = Field(1, ge=1)  # processes under torchrun on a GPU node (FSDP when > 1)
    seed: int = 0


class EvaluatorTrainConfig(TrainConfig):
    anchor_weight: float = Field(1.0, ge=0)  # lambda: weight of the anchor advantage


class EvaluateConfig(Section):
    variants: list[Literal["dynamic", "static", "pointwise"]] = ["dynamic", "static", "pointwise"]
    samples: int = Field(4, ge=1)  # k for avg@k / pass@k
    sandbox_timeout_s: float = Field(10.0, gt=0)
    win_rate: bool = True


class Toleration(Section):
    """A Kubernetes toleration (kfp.kubernetes.add_toleration's arguments)."""

    key: str | None = None
    operator: Literal["Equal", "Exists"] | None = None
    value: str | None = None
    effect: Literal["NoExecute", "NoSchedule", "PreferNoSchedule"] | None = None
    toleration_seconds: int | None = None


class StageResources(Section):
    gpus: int = Field(0, ge=0)
    cpu: str = "1"
    memory: str = "4Gi"


class PipelineConfig(Section):
    rounds: int = Field(2, ge=1, le=20)
    shards: int = Field(2, ge=1)  # rollout/rubrics/judge fan out over prompt shards
    image: str = "ghcr.io/dynamicrubric/dynamicrubric-gpu:0.1.0"
    cpu_image: str = "ghcr.io/dynamicrubric/dynamicrubric-cpu:0.1.0"  # stages that load no model
    pipeline_root: str = "./runs"
    mlflow_tracking_uri: str = "sqlite:///mlflow.db"
    experiment: str = "dynamicrubric"
    caching: bool = True
    # Stop before the next round once the policy's scores tie this often (the signal has collapsed);
    # None compiles no condition.
    early_stop_tie_rate: float | None = Field(None, gt=0, le=1)
    accelerator_type: str = "nvidia.com/gpu"
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    s3_secret: str = "dynamicrubric-s3"  # Kubernetes Secret holding AWS_* keys, mounted as env
    service_account: str = "dynamicrubric-runner"  # Kubernetes ServiceAccount the run's pods use
    shm_size: str = "16Gi"
    resources: dict[str, StageResources] = {}


class Config(Section):
    preset: str = DEFAULT_PRESET
    seed: int = 0
    models: ModelsConfig = ModelsConfig()
    engine: EngineConfig = EngineConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    rubrics: RubricsConfig = RubricsConfig()
    judge: JudgeConfig = JudgeConfig()
    aggregate: AggregateConfig = AggregateConfig()
    train_evaluator: EvaluatorTrainConfig = EvaluatorTrainConfig(learning_rate=5e-6)
    train_policy: TrainConfig = TrainConfig(learning_rate=1e-6)
    evaluate: EvaluateConfig = EvaluateConfig()
    pipeline: PipelineConfig = PipelineConfig()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values, for MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and value:
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.model_dump(mode="json"))
        return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def preset_dict(name: str) -> dict:
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; expected one of {list(PRESETS)}")
    text = resources.files("dynamicrubric").joinpath("presets", f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


def _format_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key {key!r}")
        else:
            lines.append(f"{source}: {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def load_config(
    path: str | Path | None = None, preset: str | None = None, overrides: dict | None = None
) -> Config:
    """Load a preset, lay a YAML file and then `overrides` over it, and validate the result."""
    user: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            user = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}".splitlines()[0]) from None
        if not isinstance(user, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    name = preset or user.get("preset") or DEFAULT_PRESET
    data = _merge(preset_dict(name), user)
    data = _merge(data, overrides or {})
    data["preset"] = name
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None


def config_from_yaml(text: str) -> Config:
    """Rebuild a config from `Config.to_yaml()` output (how pipeline components receive it)."""
    try:
        return Config.model_validate(yaml.safe_load(text))
    except ValidationError as e:
        raise ConfigError(_format_error(e, "<config yaml>")) from None
