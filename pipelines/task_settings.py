"""What each KFP task of the pipeline gets: its resources (a multi-node training stage's task only
submits its TrainJob), retries, deadline, mounts, accelerators, node placement, secrets and the gVisor
label of tasks that run policy code (`_configure`), and which staged copy of each base model tasks
load. Apart from co_evolution.py, which wires the rounds' tasks together: this is the settings of one
task, the same in every round."""

import warnings
from collections.abc import Callable

from kfp import dsl, kubernetes

from dynamicrubric import store
from dynamicrubric.infra.config import (
    CACHE_MOUNT,
    S3_ENV,
    STAGE_FACTS,
    TENSOR_PARALLEL_ENV,
    Config,
    ModelsConfig,
    StageResources,
)
from dynamicrubric.infra.models import staging_plan

RETRY_BACKOFF = {"backoff_duration": "60s", "backoff_factor": 2.0, "backoff_max_duration": "1800s"}
# The pod label of tasks that run policy-generated code (config.STAGE_FACTS runs_code), which the
# cluster's policies in manifests/cluster/gvisor use to run them under gVisor. A GPU task is never
# labelled (gVisor would pin it to gVisor nodes, which a normal GPU pool has none of) and runs no
# policy code: where evaluate gets GPUs its checks move to a CPU task of their own (check-samples, see
# `split_evaluate`), and train-policy on GPUs leaves code out of its outcome monitoring (config refuses
# the verifiable reward on code prompts there).
RUNS_CODE_LABEL = ("dynamicrubric.io/runs-code", "true")


def task_resources(cfg: Config, stage: str) -> StageResources:
    """What a stage's KFP task requests: its `pipeline.resources`, except a training stage on several
    nodes, whose task only submits and follows a TrainJob; the TrainJob's nodes get the stage's resources
    (training/trainjob.py)."""
    res = cfg.pipeline.stage_resources(stage)
    if stage in ("train_policy", "train_evaluator") and getattr(cfg, stage).num_nodes > 1:
        # Its pod's disk holds megabytes: the config, the prompts or candidate shards the launcher delivers,
        # the trained model's tokenizer files (check_context), the per-step files and metrics it copies.
        # The checkpoints it trains from reach the nodes as URIs (kfp_source's on-nodes component) and the
        # export goes to its output server-side (on_nodes.copy_outputs): before, it held ~66 GB of them.
        # It requests no ephemeral storage: kfp 2.17 cannot ask for it (the container's ResourceSpec has
        # CPU, memory and accelerators; kfp-kubernetes has emptyDir size limits and PVC-backed generic
        # ephemeral volumes, no `ephemeral-storage` request), and megabytes fit any node's default.
        return res.model_copy(update={"gpus": 0, "cpu": "1", "memory": "4Gi"})
    return res


def runs_in_gvisor(cfg: Config, stage: str) -> bool:
    """Whether the stage's tasks carry RUNS_CODE_LABEL: they run code and request no GPU."""
    return STAGE_FACTS[stage].runs_code and not cfg.pipeline.stage_resources(stage).gpus


def for_cluster(cfg: Config) -> bool:
    """A package for a KFP cluster (an object-store pipeline root) rather than for kfp.local."""
    return cfg.pipeline.pipeline_root.startswith(("s3://", "minio://", "gs://"))


def model_plan(cfg: Config) -> dict[str, str]:
    """Each distinct base-model reference -> what tasks load (a staged s3:// copy on a cluster)."""
    m = cfg.models
    if for_cluster(cfg) and not store.is_s3(cfg.pipeline.pipeline_root):
        warnings.warn(
            f"pipeline.pipeline_root {cfg.pipeline.pipeline_root!r}: base models are staged only under an "
            "s3:// root; every task will fetch them itself",
            stacklevel=2,
        )
    return staging_plan([m.policy, m.generator, m.verifier], cfg.pipeline.pipeline_root)


def staged_models(cfg: Config) -> ModelsConfig:
    """The config's model references with each replaced by what `model_plan` says tasks load."""
    plan = model_plan(cfg)
    roles = ("policy", "generator", "verifier")
    return cfg.models.model_copy(update={role: plan[getattr(cfg.models, role)] for role in roles})


def judge_key_envs(cfg: Config) -> list[str]:
    """The environment variables the config's judges read their endpoint keys from."""
    judges = (cfg.evaluate.benchmark_judge, cfg.guard.gold_judge)
    return sorted({j.api_key_env for j in judges if j.api_key_env})


def _configure(cfg: Config, stage: str) -> Callable[[dsl.PipelineTask, str], dsl.PipelineTask]:
    """Cluster settings for one stage's tasks (pipeline.resources, else config.STAGE_FACTS).

    Every task requests what it may use (CPU and memory requests equal to the limits), has a deadline,
    and pulls with the configured secrets; GPUs, /dev/shm, node selectors and tolerations go on GPU
    tasks only. kfp.local ignores the Kubernetes settings but honours environment variables and
    retries, and warns task by task about CPU and memory settings, so the pod-only environment (cache
    paths, tensor parallelism), the retries and the requests are set only when the package is for a
    cluster (an object-store pipeline root; `dynrubric submit` refuses any other).
    """
    p = cfg.pipeline
    res = task_resources(cfg, stage)
    facts = STAGE_FACTS[stage]
    cluster = for_cluster(cfg)

    def apply(task: dsl.PipelineTask, name: str) -> dsl.PipelineTask:
        task.set_display_name(name)
        task.set_caching_options(p.caching)
        if cluster:  # kfp.local would warn, task by task, that it ignores them
            task.set_cpu_request(res.cpu).set_cpu_limit(res.cpu)
            task.set_memory_request(res.memory).set_memory_limit(res.memory)
        if res.timeout_s:
            kubernetes.set_timeout(task, res.timeout_s)
        if res.retries and cluster:
            task.set_retry(num_retries=res.retries, **RETRY_BACKOFF)
        if facts.model_cache:
            # Staged weights and the hub cache on a sized scratch volume, not the container's layer.
            kubernetes.empty_dir_mount(
                task, volume_name="model-cache", mount_path=CACHE_MOUNT, size_limit=p.model_cache_size
            )
            if cluster:
                task.set_env_variable("DYNRUBRIC_CACHE", f"{CACHE_MOUNT}/dynamicrubric")
                task.set_env_variable("HF_HOME", f"{CACHE_MOUNT}/huggingface")
        if res.gpus:
            task.set_accelerator_type(p.accelerator_type).set_accelerator_limit(res.gpus)
            # vLLM and NCCL need a large shared-memory segment
            kubernetes.empty_dir_mount(
                task, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit=p.shm_size
            )
            for key, value in p.node_selector.items():
                kubernetes.add_node_selector(task, key, value)
            for tol in p.tolerations:
                kubernetes.add_toleration(task, **tol.model_dump(exclude_none=True))
            if facts.inference and cluster:
                task.set_env_variable(TENSOR_PARALLEL_ENV, str(res.gpus))
        if p.s3_secret:
            kubernetes.use_secret_as_env(task, p.s3_secret, {k: k for k in S3_ENV}, optional=True)
        if p.image_pull_secrets:
            kubernetes.set_image_pull_secrets(task, list(p.image_pull_secrets))
        keys = judge_key_envs(cfg)
        if p.judge_secret and keys and stage == "evaluate":  # the stage that asks the judges
            kubernetes.use_secret_as_env(task, p.judge_secret, {k: k for k in keys})
        if runs_in_gvisor(cfg, stage):
            kubernetes.add_pod_label(task, *RUNS_CODE_LABEL)
        return task

    return apply
