"""One typed configuration for every stage and command, loaded from YAML.

A configuration is a named preset (`tiny`, `local`, `paper`, shipped in `presets/`) with a user's
YAML file laid over it (nested keys replace the preset's). Unknown keys and bad values are errors
that name the key. Secrets never live here: S3 and MLflow credentials come from the environment.

This module is the typed model (`Config`), its seeds, and the GPU memory and disk plans every config
must fit however it was made; reading one from presets and YAML (`load_config`, `config_from_yaml`)
is `config_loading`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import yaml
from pydantic import Field, model_validator

from dynamicrubric.infra.config_evaluation import BenchmarkConfig, EvaluateConfig, GuardConfig, JudgeSpec
from dynamicrubric.infra.config_sections import (
    CACHE_MOUNT,
    DEFAULT_PRESET,
    GIB,
    MAX_SAMPLES,
    MAX_SEED,
    PRESETS,
    S3_ENV,
    STAGE_FACTS,
    TENSOR_PARALLEL_ENV,
    AggregateConfig,
    ConfigError,
    DataConfig,
    EngineConfig,
    EvaluatorTrainConfig,
    JudgeConfig,
    ModelsConfig,
    ModelSizes,
    PipelineConfig,
    PolicyTrainConfig,
    RolloutConfig,
    RubricsConfig,
    Section,
    ServingConfig,
    StageFacts,
    StageResources,
    ThinkingConfig,
    Toleration,
    TrainConfig,
    quantity_bytes,
)

# The sections are part of this module's interface: `from dynamicrubric.infra.config import TrainConfig`.
__all__ = [
    "AggregateConfig",
    "BenchmarkConfig",
    "Config",
    "ConfigError",
    "DiskPlan",
    "DEFAULT_PRESET",
    "DataConfig",
    "EngineConfig",
    "EvaluateConfig",
    "EvaluatorTrainConfig",
    "GuardConfig",
    "GIB",
    "JudgeConfig",
    "JudgeSpec",
    "MAX_SAMPLES",
    "MAX_SEED",
    "ModelSizes",
    "ModelsConfig",
    "PRESETS",
    "CACHE_MOUNT",
    "S3_ENV",
    "PipelineConfig",
    "RolloutConfig",
    "RubricsConfig",
    "STAGE_FACTS",
    "Section",
    "SeedPurpose",
    "ServingConfig",
    "StageFacts",
    "StageResources",
    "TENSOR_PARALLEL_ENV",
    "ThinkingConfig",
    "Toleration",
    "PolicyTrainConfig",
    "TrainConfig",
    "check_disk_plan",
    "check_gpu_memory_plan",
    "disk_plan",
    "policy_variant",
    "reward_roles",
    "round_seed",
    "served_roles",
    "step_seed",
    "training_state_gib",
]


class Config(Section):
    preset: str = DEFAULT_PRESET
    seed: int = Field(0, ge=0, le=MAX_SEED)
    models: ModelsConfig = ModelsConfig()
    engine: EngineConfig = EngineConfig()
    serving: ServingConfig = ServingConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    rubrics: RubricsConfig = RubricsConfig()
    judge: JudgeConfig = JudgeConfig()
    aggregate: AggregateConfig = AggregateConfig()
    train_evaluator: EvaluatorTrainConfig = EvaluatorTrainConfig(learning_rate=5e-6)
    train_policy: PolicyTrainConfig = PolicyTrainConfig(learning_rate=1e-6)
    evaluate: EvaluateConfig = EvaluateConfig()
    guard: GuardConfig = GuardConfig()
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
    def _probe_sets_can_be_labelled(self) -> Config:
        # The generator reads a candidate set's responses labelled A..Z: the guard's probe holds both
        # policies' evaluate.samples, its canary sets one policy's plus the canaries.
        if policy_variant(self) != "dynamic" or not self.guard.enabled:
            return self
        k = self.evaluate.samples
        canaries = len(self.guard.canary_kinds)
        if 2 * k > 26:
            raise ValueError(
                f"evaluate.samples is {k}: the signal guard's probe shows the generator both policies' "
                "samples in one set, at most 26 (A..Z); set evaluate.samples to 13 or less"
            )
        if self.guard.canary_sets and k + canaries > 26:
            raise ValueError(
                f"evaluate.samples {k} plus {canaries} canaries (guard.canary_kinds) make sets of more than "
                "26 responses (A..Z); use fewer samples or canary kinds, or guard.canary_sets: 0"
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

    @model_validator(mode="after")
    def _disk_plan_fits(self) -> Config:
        check_disk_plan(self)  # the stages whose model sizes are known (models.params_b)
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
    GUARD = 8  # the signal guard's choices: which sets get canaries, the audit's other order, resamples


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


def reward_roles(stage: str) -> tuple[str, ...]:
    """The models a training stage's reward calls: the policy's needs G_t's rubrics and V's verdicts, the
    generator's (whose own samples are the rubrics) only V's."""
    if stage not in ("train_policy", "train_evaluator"):
        raise ConfigError(f"reward_roles: {stage!r} is not a training stage")
    return ("generator", "verifier") if stage == "train_policy" else ("verifier",)


def served_roles(cfg: Config, stage: str) -> tuple[str, ...]:
    """The reward models a training task serves itself on its `reward_gpus`: those without a URL."""
    return tuple(r for r in reward_roles(stage) if not getattr(cfg.models, f"{r}_url"))


def gpu_count_mismatch(stage: str, tcfg: TrainConfig, gpus: int) -> str | None:
    """Why `pipeline.resources.<stage>.gpus` (one pod's: the task's, or each TrainJob node's) does not
    match the stage's world_size + reward_gpus over its num_nodes; None when it does."""
    per_node = (tcfg.world_size + tcfg.reward_gpus) // tcfg.num_nodes
    if gpus == per_node:
        return None
    nodes = f" / num_nodes {tcfg.num_nodes}" if tcfg.num_nodes > 1 else ""
    return (
        f"pipeline.resources.{stage}.gpus is {gpus} but ({stage}.world_size {tcfg.world_size} + reward_gpus "
        f"{tcfg.reward_gpus}){nodes} = {per_node}: each pod trains with one process per training GPU and "
        "serves the reward's models on the others"
    )


# fp32 weights, gradients and Adam's two moments (4 + 4 + 4 + 4 B) of every trained parameter: a full
# finetune (FSDP keeps fp32 master weights under bf16 mixed precision, accelerate upcasts them).
TRAINING_STATE_BYTES_PER_PARAM = 16


def training_state_gib(params: float, world_size: int) -> float:
    """One training GPU's share of a full finetune's state, the GPU memory plan's first term: params x 16 B
    sharded over world_size (bench/gpu_full.py measures a one-GPU step against it)."""
    return params * TRAINING_STATE_BYTES_PER_PARAM / GIB / world_size


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
        mismatch = gpu_count_mismatch(stage, tcfg, gpus)
        if mismatch:
            problems.append(mismatch)
            continue
        who = f"each of its {tcfg.num_nodes} nodes" if tcfg.num_nodes > 1 else "the task"
        if reward // tcfg.num_nodes < len(served):
            problems.append(
                f"{stage}.reward_gpus is {reward} but {who} serves {len(served)} model(s) ({', '.join(served)}), "
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
        state = training_state_gib(sizes[trained] * 1e9, world)
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


def trained_role(stage: str) -> str:
    """The model a training stage trains: the policy's stage the policy, the evaluator's the generator."""
    reward_roles(stage)  # refuses a stage that does not train
    return "policy" if stage == "train_policy" else "generator"


# The disk plan's bytes a parameter takes (docs/training.md, "Disk plan").
STORED_BYTES_PER_PARAM = 2  # a staged or exported model: bf16, as every model of the plans is stored
# A trainer checkpoint: fp32 weights (accelerate's FSDP2 upcasts the trained parameters to fp32 masters
# under bf16 mixed precision; without FSDP the weights and Adam state are bf16, 6 B: this bounds it) and
# AdamW's two fp32 moments, 4 + 4 + 4.
CHECKPOINT_BYTES_PER_PARAM = 12
# A LoRA adapter of rank r on an in x out linear layer has r(in + out) parameters, at most 2r / 1,024 of
# the layer's in x out when both sides are 1,024 wide or more (the narrowest layers of Qwen3 and Llama 3
# are the KV projections, 8 heads x 128); embeddings get no adapter. So r=16 trains at most 3.1%.
LORA_MIN_WIDTH = 1024
DISK_MARGIN = 0.10  # on top of the sum: the tokenizer files, vLLM's and torch's scratch, rounding


@dataclass(frozen=True)
class DiskPlan:
    """What the model-cache volume of one training pod (the task, or each TrainJob node) must hold at most,
    in GiB: the staged models, the trainer checkpoints on its disk at once (each its node's share of the
    DCP shards), the exported model, and a margin."""

    stage: str
    staged: dict[str, float]  # role -> its staged bf16 weights
    checkpoint_gib: float  # one trainer checkpoint's share on one node
    copies: int  # how many of them can be on the node's disk at once
    export_gib: float
    nodes: int

    @property
    def total_gib(self) -> float:
        return sum(self.staged.values()) + self.copies * self.checkpoint_gib + self.export_gib

    @property
    def need_gib(self) -> float:
        return self.total_gib * (1 + DISK_MARGIN)

    def describe(self) -> str:
        share = f" / {self.nodes} nodes" if self.nodes > 1 else ""
        return (
            f"staged {', '.join(self.staged)} {sum(self.staged.values()):.1f} GiB (2 B/param) + {self.copies} "
            f"trainer checkpoints{share} (fp32 weights + Adam, 12 B/trained param) {self.copies} x "
            f"{self.checkpoint_gib:.1f} GiB + the export {self.export_gib:.1f} GiB + {DISK_MARGIN:.0%} margin"
        )


def disk_plan(cfg: Config, stage: str) -> DiskPlan | None:
    """The disk plan of a training stage's pod; None where a model's size (models.params_b) is unknown.

    - staged: the trained model and the reward models the pod serves (`served_roles`), each in bf16, on
      every node (each serves its own copies). The reference model is the starting model's own folder
      (with LoRA the adapter switched off), so it adds nothing.
    - trainer checkpoints: TRL writes one every save_steps into the scratch folder inside the model
      cache; the callback uploads it and deletes it before the next (training/checkpoints.py). A resumed
      pod keeps the checkpoint it resumed from beside the next one until the stage ends: 2 at once. On
      several nodes each node writes its ranks' DCP shards, 1 / num_nodes of the checkpoint, but a node
      other than the first resumes from the first node's part and its own: 3 shares at once there.
      Full finetune: every parameter is trained; LoRA: at most 2 x lora_rank / LORA_MIN_WIDTH of them.
    - the export: the trained model in bf16, written by the first node (counted on every node).
    """
    trained = trained_role(stage)
    roles = (trained, *(r for r in served_roles(cfg, stage) if r != trained))
    sizes = {role: getattr(cfg.models.params_b, role) for role in roles}
    if any(size is None for size in sizes.values()):
        return None
    tcfg: TrainConfig = getattr(cfg, stage)
    params = sizes[trained] * 1e9
    trained_params = (
        params if not tcfg.lora_rank else min(params, params * 2 * tcfg.lora_rank / LORA_MIN_WIDTH)
    )
    staged = {role: size * 1e9 * STORED_BYTES_PER_PARAM / GIB for role, size in sizes.items()}
    return DiskPlan(
        stage=stage,
        staged=staged,
        checkpoint_gib=trained_params * CHECKPOINT_BYTES_PER_PARAM / GIB / tcfg.num_nodes,
        copies=2 if tcfg.num_nodes == 1 else 3,
        export_gib=staged[trained],
        nodes=tcfg.num_nodes,
    )


def check_disk_plan(cfg: Config) -> None:
    """Refuse a config whose training pods' model-cache volume (`pipeline.model_cache_size`, which holds
    the trainer's scratch folder too) cannot hold its disk plan, with one error naming the numbers."""
    size = quantity_bytes(cfg.pipeline.model_cache_size) / GIB
    problems = []
    for stage in ("train_policy", "train_evaluator"):
        plan = disk_plan(cfg, stage)
        if plan is None or plan.need_gib <= size:
            continue
        pod = f"each of its {plan.nodes} nodes'" if plan.nodes > 1 else "its pod's"
        problems.append(
            f"{stage}: {pod} {CACHE_MOUNT} needs {plan.need_gib:.1f} GiB > pipeline.model_cache_size "
            f"{cfg.pipeline.model_cache_size} ({size:.1f} GiB): {plan.describe()}; set model_cache_size to "
            f"{math.ceil(plan.need_gib)}Gi or more"
        )
    if problems:
        raise ValueError("the disk plan does not fit: " + "; ".join(problems))
