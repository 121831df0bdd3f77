"""A training stage on several nodes, as a Kubeflow Trainer TrainJob (`train_*.num_nodes` > 1): the
object, and where its nodes and the KFP task meet in the store. Submitting and following it is
training/on_nodes.py.

Kubeflow Trainer is the engine Kubeflow has for multi-node training: a TrainJob on its torch runtime
(a ClusterTrainingRuntime) starts `numNodes` pods from one image and sets, on each, the rendezvous of
the whole job in the variables torchrun reads (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR,
PET_MASTER_PORT). Each node runs `dynamicrubric.training.node`: the same `launcher.run_node` as a
one-node task (its own reward servers, then `accelerate launch` over all nodes), so a TrainJob trains
exactly as the one-node task does. The object is built from kubeflow-trainer-api's own models, so it is
validated against them as it is made.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

from kubeflow_trainer_api import models as k8s

from dynamicrubric import store
from dynamicrubric.infra.config import CACHE_MOUNT, S3_ENV, Config
from dynamicrubric.training.checkpoints import work_prefix
from dynamicrubric.training.data import TrainingJob

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
API_VERSION = f"{GROUP}/{VERSION}"
# The torch ClusterTrainingRuntime that Kubeflow Trainer's manifests install (docs/deploy.md).
TORCH_RUNTIME = "torch-distributed"
# The runtime's replicated job of the nodes, and its container (the Kubeflow SDK's constants:
# kubeflow.trainer.constants).
NODE = "node"
# Who owns the runtime patch (the API asks every patch to say; Kueue, for one, writes its own beside it).
PATCH_MANAGER = "dynamicrubric.io/training"
# The pod label manifests/base/networkpolicies.yaml admits to the object store.
S3_CLIENT_LABEL = "dynamicrubric.io/s3-client"


def node_command(config_uri: str, job_uri: str, result_uri: str) -> list[str]:
    """The command of every node: the project's node entry point with the URIs it reads and writes."""
    args = ["--config", config_uri, "--job", job_uri, "--result", result_uri]
    return [sys.executable, "-m", "dynamicrubric.training.node", *args]


def train_job(
    cfg: Config,
    job: TrainingJob,
    *,
    name: str,
    namespace: str,
    config_uri: str,
    job_uri: str,
    result_uri: str,
) -> k8s.TrainerV1alpha1TrainJob:
    """The TrainJob of `job` on the stage's `num_nodes` nodes: the pipeline's image, the stage's
    `pipeline.resources` on each node ((world_size + reward_gpus) / num_nodes GPUs) and the model cache's
    size as its ephemeral storage request, the S3 credentials
    from the pipeline's secret, and the stage's timeout as its deadline. `config_uri` and `job_uri` are
    where every node reads the run's config and the job, `result_uri` where rank 0 writes its result."""
    stage = job.stage.replace("-", "_")
    tcfg, p = getattr(cfg, stage), cfg.pipeline
    resources = p.stage_resources(stage)
    per_node = {
        p.accelerator_type: str((tcfg.world_size + tcfg.reward_gpus) // tcfg.num_nodes),
        "cpu": resources.cpu,
        "memory": resources.memory,
        **p.node_network.resources,  # e.g. the RDMA device plugin's
    }
    quantities = {k: k8s.IoK8sApimachineryPkgApiResourceQuantity(v) for k, v in per_node.items()}
    # The node's scratch (the model cache: staged models, its share of each trainer checkpoint, the export)
    # is an emptyDir on the node's disk: requested, so that the scheduler places the pod where the disk
    # holds it, rather than the kubelet evicting it there once it fills. Not a limit: logs and the
    # container's own layer count against one too.
    requests = {
        **quantities,
        "ephemeral-storage": k8s.IoK8sApimachineryPkgApiResourceQuantity(p.model_cache_size),
    }
    cache = {"DYNRUBRIC_CACHE": f"{CACHE_MOUNT}/dynamicrubric", "HF_HOME": f"{CACHE_MOUNT}/huggingface"}
    env = [k8s.IoK8sApiCoreV1EnvVar(name=key, value=value) for key, value in cache.items()]
    env += [
        k8s.IoK8sApiCoreV1EnvVar(
            name=key,
            value_from=k8s.IoK8sApiCoreV1EnvVarSource(
                secret_key_ref=k8s.IoK8sApiCoreV1SecretKeySelector(name=p.s3_secret, key=key, optional=True)
            ),
        )
        for key in (S3_ENV if p.s3_secret else ())
    ]
    env += [k8s.IoK8sApiCoreV1EnvVar(name=key, value=value) for key, value in p.node_network.env.items()]
    trainer = k8s.TrainerV1alpha1Trainer(
        image=p.image,
        command=node_command(config_uri, job_uri, result_uri),
        env=env,
        num_nodes=tcfg.num_nodes,
        resources_per_node=k8s.IoK8sApiCoreV1ResourceRequirements(limits=quantities, requests=requests),
    )
    spec = k8s.TrainerV1alpha1TrainJobSpec(
        runtime_ref=k8s.TrainerV1alpha1RuntimeRef(name=TORCH_RUNTIME),
        trainer=trainer,
        active_deadline_seconds=resources.timeout_s or None,
        runtime_patches=[node_pod_patch(cfg)],
    )
    labels = {"app.kubernetes.io/part-of": "dynamicrubric", "dynamicrubric/stage": job.stage}
    metadata = k8s.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=name, namespace=namespace, labels=labels)
    return k8s.TrainerV1alpha1TrainJob(api_version=API_VERSION, kind="TrainJob", metadata=metadata, spec=spec)


def node_pod_patch(cfg: Config) -> k8s.TrainerV1alpha1RuntimePatch:
    """What a node pod needs beyond the runtime's template, as a GPU task of the pipeline gets it: the
    pipeline's node selector, tolerations and pull secrets, a /dev/shm in memory (NCCL, vLLM) and a
    sized scratch volume for the model cache; the label that admits it to the object store through the
    NetworkPolicies (manifests/base), and no Istio sidecar, which would stand between the nodes'
    rendezvous connections (see docs/deploy.md); `pipeline.node_network`'s annotations and IPC_LOCK."""
    p = cfg.pipeline
    volumes = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": p.shm_size}},
        {"name": "model-cache", "emptyDir": {"sizeLimit": p.model_cache_size}},
    ]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "model-cache", "mountPath": CACHE_MOUNT}]
    tolerations = [k8s.IoK8sApiCoreV1Toleration(**t.model_dump(exclude_none=True)) for t in p.tolerations]
    # RDMA pins (registers) the memory NCCL sends from, which needs IPC_LOCK beyond the default memlock limit
    locked_memory = k8s.IoK8sApiCoreV1SecurityContext.from_dict({"capabilities": {"add": ["IPC_LOCK"]}})
    pod = k8s.TrainerV1alpha1PodSpecPatch(
        node_selector=dict(p.node_selector) or None,
        tolerations=tolerations or None,
        image_pull_secrets=[k8s.IoK8sApiCoreV1LocalObjectReference(name=n) for n in p.image_pull_secrets]
        or None,
        volumes=[k8s.IoK8sApiCoreV1Volume.from_dict(v) for v in volumes],
        containers=[
            k8s.TrainerV1alpha1ContainerPatch(
                name=NODE,
                volume_mounts=[k8s.IoK8sApiCoreV1VolumeMount.from_dict(m) for m in mounts],
                security_context=locked_memory if p.node_network.ipc_lock else None,
            )
        ],
    )
    # Istio's label (its annotation of the same name is the older form) rather than the namespace's default
    metadata: dict = {"labels": {S3_CLIENT_LABEL: "true", "sidecar.istio.io/inject": "false"}}
    if p.node_network.annotations:  # a pod template patch may set labels and annotations only
        metadata["annotations"] = dict(p.node_network.annotations)
    template = k8s.TrainerV1alpha1PodTemplatePatch(metadata=metadata, spec=pod)
    node = k8s.TrainerV1alpha1ReplicatedJobPatch(
        name=NODE,
        template=k8s.TrainerV1alpha1JobTemplatePatch(spec=k8s.TrainerV1alpha1JobSpecPatch(template=template)),
    )
    jobset = k8s.TrainerV1alpha1JobSetTemplatePatch(
        spec=k8s.TrainerV1alpha1JobSetSpecPatch(replicated_jobs=[node])
    )
    return k8s.TrainerV1alpha1RuntimePatch(
        manager=PATCH_MANAGER,
        training_runtime_spec=k8s.TrainerV1alpha1TrainingRuntimeSpecPatch(template=jobset),
    )


def trainjob_name(job: TrainingJob) -> str:
    """The same name for every attempt of one task (a retry finds its predecessor's TrainJob), and a
    DNS label short enough for the pod names the runtime derives from it."""
    digest = hashlib.sha256(job.out_uri.encode()).hexdigest()[:10]
    return f"dr-{job.stage}-r{job.round_idx}-{digest}"


@dataclasses.dataclass(frozen=True)
class NodeFiles:
    """What the task and the nodes share in the store, all under `work_uri` (`<out>.work/trainjob`): the
    config, the job the nodes run (its outputs there too), and rank 0's result."""

    config_uri: str
    job_uri: str
    result_uri: str
    job: TrainingJob
    work_uri: str

    @classmethod
    def of(cls, cfg: Config, job: TrainingJob) -> NodeFiles:
        """The files of `job`'s TrainJob; its inputs as the nodes can read them (`node_inputs`)."""
        job = node_inputs(cfg, job)
        work = work_prefix(job.out_uri) + "/trainjob"
        metrics = store.join(work, Path(job.metrics_uri).name) if job.metrics_uri else None
        outputs = {
            "out_uri": store.join(work, "out"),
            "steps_uri": store.join(work, "steps"),
            "metrics_uri": metrics,
        }
        files = cls(
            store.join(work, "config.yaml"),
            store.join(work, "job.json"),
            store.join(work, "result.json"),
            dataclasses.replace(job, **outputs),
            work,
        )
        if not store.is_s3(work):  # a local pipeline root: the nodes would write where the task never looks
            raise _unreadable(job.stage, "job.out_uri", job.out_uri)
        return files


def node_inputs(cfg: Config, job: TrainingJob) -> TrainingJob:
    """`job` with every input as a node pod reads it. The KFP task sees its input artifacts as its pod's
    local paths (/s3/b/k, /minio/b/k: kfp's artifact_types), which exist on no node's pod: each maps
    back to its s3:// URI (tracking.artifact_uri). A model named by a built-in name or a hub id stays as
    it is. Any other local path, in the job or in the config's `models` a node falls back to, is refused
    in one line naming the field, before anything is submitted."""
    from dynamicrubric.infra.model_references import model_reference
    from dynamicrubric.infra.models import BUILTIN_MODELS
    from dynamicrubric.infra.tracking import artifact_uri

    def data(name: str, uri: str) -> str:
        mapped = artifact_uri(uri) if uri else uri
        if mapped and not store.is_s3(mapped):
            raise _unreadable(job.stage, f"job.{name}", uri)
        return mapped

    def model(name: str, ref: str) -> str:
        mapped = model_reference(ref) if ref else ref
        hub_id = "://" not in mapped and not mapped.startswith(("/", ".", "~")) and not Path(mapped).exists()
        if mapped and not (mapped in BUILTIN_MODELS or store.is_s3(mapped) or hub_id):
            raise _unreadable(job.stage, name, ref)
        return mapped

    models = {}
    for role in ("policy", "generator", "verifier"):
        models[role] = model(f"job.{role}", getattr(job, role))
        if not models[role] and not getattr(cfg.models, f"{role}_url", ""):  # the node loads the config's
            model(f"models.{role}", getattr(cfg.models, role))
    return dataclasses.replace(
        job,
        **models,
        prompts_uri=data("prompts_uri", job.prompts_uri),
        candidates=tuple(data("candidates", uri) for uri in job.candidates),
        anchors=tuple(data("anchors", uri) for uri in job.anchors),
    )


def _unreadable(stage: str, field: str, value: str) -> Exception:
    from dynamicrubric.training.launcher import TrainingError  # not at import: it loads torch

    return TrainingError(
        f"{stage}: {field} is {value!r}, a path the TrainJob's nodes cannot reach (each is another pod, "
        "with its own filesystem): give it as an s3:// URI"
    )
