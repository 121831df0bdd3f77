"""A training stage on several nodes, as a Kubeflow Trainer TrainJob (`train_*.num_nodes` > 1).

Kubeflow Trainer is the engine Kubeflow has for multi-node training: a TrainJob on its torch runtime
(a ClusterTrainingRuntime) starts `numNodes` pods from one image and sets, on each, the rendezvous of
the whole job in the variables torchrun reads (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR,
PET_MASTER_PORT). Each node runs this project's own launch: `accelerate launch` with the FSDP config
shipped in the package, over all nodes, of `dynamicrubric.training.process --config --job`, so a
TrainJob trains exactly as the one-node task does, and the process refuses a world size other than
the configured one.

The object is built from the SDK's own models (kubeflow-trainer-api), so it is validated against them
as it is made. Submitting it, waiting, and resuming a retried task are not here yet (issue #27).
"""

from __future__ import annotations

import shlex

from kubeflow_trainer_api import models as k8s

from dynamicrubric.config import S3_ENV, Config
from dynamicrubric.training.data import TrainingJob
from dynamicrubric.training.launcher import launch_command

API_VERSION = "trainer.kubeflow.org/v1alpha1"
# The torch ClusterTrainingRuntime that Kubeflow Trainer's manifests install (how to install them is not
# in docs/deploy.md yet: issue #27).
TORCH_RUNTIME = "torch-distributed"
# What the torch runtime sets on every node: where the job's rank 0 listens, and this node's rank.
RENDEZVOUS = {
    "machine_rank": "PET_NODE_RANK",
    "main_process_ip": "PET_MASTER_ADDR",
    "main_process_port": "PET_MASTER_PORT",
}


def node_command(world_size: int, num_nodes: int, config_uri: str, job_uri: str) -> list[str]:
    """The command of every node: the training launch over `num_nodes` machines, this node's rank and the
    rendezvous address read from the runtime's variables (the shell expands them; the rest is quoted)."""
    # GPU nodes, whatever machine builds the command (the KFP task that submits may have no GPU)
    launch = launch_command(
        world_size, ["--config", config_uri, "--job", job_uri], num_nodes=num_nodes, cuda=True
    )
    flags = " ".join(f'--{flag} "${env}"' for flag, env in RENDEZVOUS.items())
    program = launch.index("-m", launch.index("--num_processes"))  # where the launched module starts
    return ["sh", "-c", f"{shlex.join(launch[:program])} {flags} {shlex.join(launch[program:])}"]


def train_job(
    cfg: Config, job: TrainingJob, *, name: str, namespace: str, config_uri: str, job_uri: str
) -> k8s.TrainerV1alpha1TrainJob:
    """The TrainJob of `job` on the stage's `num_nodes` nodes: the pipeline's image, world_size /
    num_nodes GPUs and processes per node with the stage's CPU and memory, the S3 credentials from the
    pipeline's secret, and the stage's timeout as its deadline. `config_uri` and `job_uri` are where every
    node reads the run's config and the job (the store, not the task's local disk)."""
    stage = job.stage.replace("-", "_")
    tcfg, p = getattr(cfg, stage), cfg.pipeline
    resources = p.stage_resources(stage)
    per_node = {
        p.accelerator_type: str(tcfg.world_size // tcfg.num_nodes),
        "cpu": resources.cpu,
        "memory": resources.memory,
    }
    quantities = {k: k8s.IoK8sApimachineryPkgApiResourceQuantity(v) for k, v in per_node.items()}
    env = [
        k8s.IoK8sApiCoreV1EnvVar(
            name=key,
            value_from=k8s.IoK8sApiCoreV1EnvVarSource(
                secret_key_ref=k8s.IoK8sApiCoreV1SecretKeySelector(name=p.s3_secret, key=key, optional=True)
            ),
        )
        for key in (S3_ENV if p.s3_secret else ())
    ]
    trainer = k8s.TrainerV1alpha1Trainer(
        image=p.image,
        command=node_command(tcfg.world_size, tcfg.num_nodes, config_uri, job_uri),
        env=env or None,
        num_nodes=tcfg.num_nodes,
        resources_per_node=k8s.IoK8sApiCoreV1ResourceRequirements(limits=quantities, requests=quantities),
    )
    spec = k8s.TrainerV1alpha1TrainJobSpec(
        runtime_ref=k8s.TrainerV1alpha1RuntimeRef(name=TORCH_RUNTIME),
        trainer=trainer,
        active_deadline_seconds=resources.timeout_s or None,
    )
    labels = {"app.kubernetes.io/part-of": "dynamicrubric", "dynamicrubric/stage": job.stage}
    metadata = k8s.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=name, namespace=namespace, labels=labels)
    return k8s.TrainerV1alpha1TrainJob(api_version=API_VERSION, kind="TrainJob", metadata=metadata, spec=spec)
