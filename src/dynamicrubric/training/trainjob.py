"""A training stage on several nodes, as a Kubeflow Trainer TrainJob (`train_*.num_nodes` > 1).

Kubeflow Trainer is the engine Kubeflow has for multi-node training: a TrainJob on its torch runtime
(a ClusterTrainingRuntime) starts `numNodes` pods from one image and sets, on each, the rendezvous of
the whole job in the variables torchrun reads (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR,
PET_MASTER_PORT). Each node runs `dynamicrubric.training.node`: the same `launcher.run_node` as a
one-node task (its own reward servers, then `accelerate launch` over all nodes), so a TrainJob trains
exactly as the one-node task does.

The KFP task (`train_on_nodes`) needs no GPU. It writes the config and the job to the stage's work
prefix in the store (what every node reads), submits the TrainJob built from kubeflow-trainer-api's
own models, and follows it through the Kubernetes API (the `kubernetes` client, as the Kubeflow SDK
does): status changes and the nodes' log lines go to the task's log. The nodes write the stage's
outputs under the work prefix (a pod path such as /s3/b/k is the KFP task's own, uploaded only when it
succeeds); the task copies them to its outputs once the TrainJob is complete. A failed TrainJob fails
the task with one line naming it; a cancelled task (SIGTERM) deletes it. A retried task follows the
TrainJob of the same name where it still runs (the attempt before died without deleting it), else
deletes the one that ended and submits again, and the trainer resumes from the newest trainer
checkpoint in the work prefix (training/checkpoints.py). A retry after the TrainJob completed only
copies.

The Kubeflow SDK's TrainerClient builds its own TrainJob from its trainer types, which have no command
for a custom image; the SDK's local-process backend runs one node. So the TrainJob is submitted with
the SDK's models and the Kubernetes client directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubeflow_trainer_api import models as k8s

from dynamicrubric import store
from dynamicrubric.config import CACHE_MOUNT, S3_ENV, Config
from dynamicrubric.training.checkpoints import already_done, work_prefix
from dynamicrubric.training.data import TrainingJob, trainee
from dynamicrubric.training.launcher import check_job, error_uri, launch_error

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
API_VERSION = f"{GROUP}/{VERSION}"
# The torch ClusterTrainingRuntime that Kubeflow Trainer's manifests install (docs/deploy.md).
TORCH_RUNTIME = "torch-distributed"
# How the runtime's JobSet labels a TrainJob's node pods, and their container (the Kubeflow SDK's
# constants: kubeflow.trainer.constants).
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
NODE_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
NODE = "node"
# In-cluster, the namespace of the task's service account, which its Role covers (manifests/base/rbac.yaml).
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# Who owns the runtime patch (the API asks every patch to say; Kueue, for one, writes its own beside it).
PATCH_MANAGER = "dynamicrubric.io/training"
# The pod label manifests/base/networkpolicies.yaml admits to the object store.
S3_CLIENT_LABEL = "dynamicrubric.io/s3-client"
POLL_S = 5.0  # between two reads of the TrainJob's status
GONE_TIMEOUT_S = 600.0  # how long a leftover TrainJob of a failed attempt may take to go
API_PATIENCE_S = 900.0  # how long the API may stay unreachable while the task follows its TrainJob


class TrainJobFailed(RuntimeError):
    """The TrainJob ended Failed, or could not be submitted or followed; one line, naming it."""


class Cancelled(BaseException):  # noqa: N818 (like KeyboardInterrupt: not an error of the task's own)
    """The KFP task was cancelled (its pod got SIGTERM)."""


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
    `pipeline.resources` on each node ((world_size + reward_gpus) / num_nodes GPUs), the S3 credentials
    from the pipeline's secret, and the stage's timeout as its deadline. `config_uri` and `job_uri` are
    where every node reads the run's config and the job, `result_uri` where rank 0 writes its result."""
    stage = job.stage.replace("-", "_")
    tcfg, p = getattr(cfg, stage), cfg.pipeline
    resources = p.stage_resources(stage)
    per_node = {
        p.accelerator_type: str((tcfg.world_size + tcfg.reward_gpus) // tcfg.num_nodes),
        "cpu": resources.cpu,
        "memory": resources.memory,
    }
    quantities = {k: k8s.IoK8sApimachineryPkgApiResourceQuantity(v) for k, v in per_node.items()}
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
    trainer = k8s.TrainerV1alpha1Trainer(
        image=p.image,
        command=node_command(config_uri, job_uri, result_uri),
        env=env,
        num_nodes=tcfg.num_nodes,
        resources_per_node=k8s.IoK8sApiCoreV1ResourceRequirements(limits=quantities, requests=quantities),
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
    rendezvous connections (see docs/deploy.md)."""
    p = cfg.pipeline
    volumes = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": p.shm_size}},
        {"name": "model-cache", "emptyDir": {"sizeLimit": p.model_cache_size}},
    ]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "model-cache", "mountPath": CACHE_MOUNT}]
    tolerations = [k8s.IoK8sApiCoreV1Toleration(**t.model_dump(exclude_none=True)) for t in p.tolerations]
    pod = k8s.TrainerV1alpha1PodSpecPatch(
        node_selector=dict(p.node_selector) or None,
        tolerations=tolerations or None,
        image_pull_secrets=[k8s.IoK8sApiCoreV1LocalObjectReference(name=n) for n in p.image_pull_secrets]
        or None,
        volumes=[k8s.IoK8sApiCoreV1Volume.from_dict(v) for v in volumes],
        containers=[
            k8s.TrainerV1alpha1ContainerPatch(
                name=NODE, volume_mounts=[k8s.IoK8sApiCoreV1VolumeMount.from_dict(m) for m in mounts]
            )
        ],
    )
    # Istio's label (its annotation of the same name is the older form) rather than the namespace's default
    metadata = {"labels": {S3_CLIENT_LABEL: "true", "sidecar.istio.io/inject": "false"}}
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
    """What the task and the nodes share in the store: the config, the job the nodes run (its outputs
    under the work prefix), and rank 0's result."""

    config_uri: str
    job_uri: str
    result_uri: str
    job: TrainingJob

    @classmethod
    def of(cls, job: TrainingJob) -> NodeFiles:
        work = work_prefix(job.out_uri) + "/trainjob"
        metrics = store.join(work, Path(job.metrics_uri).name) if job.metrics_uri else None
        outputs = {
            "out_uri": store.join(work, "out"),
            "steps_uri": store.join(work, "steps"),
            "metrics_uri": metrics,
        }
        return cls(
            store.join(work, "config.yaml"),
            store.join(work, "job.json"),
            store.join(work, "result.json"),
            dataclasses.replace(job, **outputs),
        )


class TrainJobs:
    """The TrainJobs of one namespace and their node pods, through the Kubernetes API."""

    def __init__(self, api_client: Any, namespace: str):
        from kubernetes import client

        self.namespace = namespace
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)

    @classmethod
    def connect(cls) -> TrainJobs:
        """In a pod: its service account and namespace; elsewhere the kubeconfig's current context."""
        from kubernetes import client, config

        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            return cls(client.ApiClient(), SERVICE_ACCOUNT_NAMESPACE.read_text().strip())
        # KUBECONFIG read now: the client reads it once, when it is first imported
        kubeconfig = os.environ.get("KUBECONFIG") or None
        config.load_kube_config(config_file=kubeconfig)
        _, context = config.list_kube_config_contexts(config_file=kubeconfig)
        return cls(client.ApiClient(), context["context"].get("namespace") or "default")

    def create(self, body: dict) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)

    def get(self, name: str) -> dict | None:
        """The TrainJob as the API returns it; None when there is none of that name."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def delete(self, name: str) -> bool:
        """Delete the TrainJob and (foreground) its pods; False when there was none."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        body = client.V1DeleteOptions(propagation_policy="Foreground")
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name, body=body
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    def node_pods(self, name: str) -> list[Any]:
        """The TrainJob's node pods (V1Pod), by node index."""
        selector = f"{JOBSET_NAME_LABEL}={name},{REPLICATED_JOB_LABEL}={NODE}"
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return sorted(pods, key=node_index)

    def log_lines(self, pod: str) -> Iterator[str]:
        """A node pod's log, followed until its container ends (the client's own log watch, as the
        Kubeflow SDK follows a TrainJob's logs)."""
        from kubernetes import watch

        yield from watch.Watch().stream(
            self.core.read_namespaced_pod_log, name=pod, namespace=self.namespace, container=NODE, follow=True
        )


def node_index(pod: Any) -> int:
    return int((pod.metadata.labels or {}).get(NODE_INDEX_LABEL, 0))


def outcome(trainjob: dict) -> tuple[str, str] | None:
    """("Complete" | "Failed", why) once the TrainJob has ended, else None."""
    for condition in (trainjob.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            why = ": ".join(filter(None, (condition.get("reason"), condition.get("message"))))
            return condition["type"], why or "no reason given"
    return None


def train_on_nodes(cfg: Config, job: TrainingJob, jobs: TrainJobs | None = None) -> dict:
    """Run a training job as a TrainJob and return its final metrics, as `launcher.launch` does on one
    node (see the module docstring)."""
    if store.is_complete(job.out_uri):
        return already_done(job.out_uri, job.metrics_uri)
    check_job(cfg, job)
    files = NodeFiles.of(job)
    if not store.is_complete(files.job.out_uri):  # else: done by an earlier attempt; collect it
        _run(cfg, job, files, jobs or TrainJobs.connect())
    result = json.loads(store.read_bytes(files.result_uri))
    copy_outputs(files.job, job)
    return result


def _run(cfg: Config, job: TrainingJob, files: NodeFiles, jobs: TrainJobs) -> None:
    name = trainjob_name(job)
    where = f"TrainJob {jobs.namespace}/{name}"
    with _api_errors(where):
        earlier = jobs.get(name)
    if earlier is not None and outcome(earlier) is None:
        # An attempt that died without deleting it (its pod killed outright): its nodes train on.
        print(f"{where}: still running from an earlier attempt of this task; following it", flush=True)
    else:
        _submit(cfg, files, jobs, name, where, leftover=earlier is not None)
    with _deleted_when_cancelled(jobs, name, where):
        ended, why = _follow(jobs, name, where)
    if ended == "Failed":
        raise _failure(job.stage, files.result_uri, where, why)
    print(f"{where}: complete", flush=True)


def _submit(cfg: Config, files: NodeFiles, jobs: TrainJobs, name: str, where: str, *, leftover: bool) -> None:
    """Write what the nodes read, then create the TrainJob, after deleting an earlier attempt's that
    ended (a name is one TrainJob at a time)."""
    store.write_bytes(files.config_uri, cfg.to_yaml().encode())
    store.write_bytes(files.job_uri, files.job.to_json().encode())
    for stale in (files.result_uri, error_uri(files.result_uri)):  # a failed attempt's
        store.delete(stale)
    with _api_errors(where):
        if leftover and jobs.delete(name):
            print(f"{where}: deleting the one a failed attempt left", flush=True)
            _wait_gone(jobs, name)
        body = train_job(cfg, files.job, name=name, namespace=jobs.namespace, config_uri=files.config_uri,
                         job_uri=files.job_uri, result_uri=files.result_uri)  # fmt: skip
        jobs.create(body.to_dict())
    tcfg = trainee(cfg, files.job.stage).tcfg
    per_node = (tcfg.world_size + tcfg.reward_gpus) // tcfg.num_nodes
    print(f"{where}: submitted, {tcfg.num_nodes} nodes x {per_node} GPUs, {tcfg.world_size} training processes",
          flush=True)  # fmt: skip


def _follow(jobs: TrainJobs, name: str, where: str) -> tuple[str, str]:
    """Wait for the TrainJob to end, printing its node pods' phases as they change and every node's log
    lines (prefixed with the node) as they come."""
    followed: dict[str, threading.Thread] = {}
    phases: list[str] = []
    unreachable_since: float | None = None
    while True:
        try:
            trainjob, pods = jobs.get(name), jobs.node_pods(name)
        except Exception as e:
            if not _transient(e):
                with _api_errors(where):
                    raise
            # the API server restarting, the network: the training goes on meanwhile
            unreachable_since = unreachable_since or time.monotonic()
            reason = _reason(e)
            if time.monotonic() - unreachable_since > API_PATIENCE_S:
                raise TrainJobFailed(
                    f"{where}: no status from the Kubernetes API for {API_PATIENCE_S:.0f} s ({reason}); it is "
                    "left running for the task's retry to follow"
                ) from e
            log.warning("%s: cannot read its status (%s); asking again in %.0f s", where, reason, POLL_S)
            time.sleep(POLL_S)
            continue
        unreachable_since = None
        if trainjob is None:
            raise TrainJobFailed(f"{where} is gone before it ended (deleted outside this task)")
        now = [f"node-{node_index(p)} {p.status.phase if p.status else 'Pending'}" for p in pods]
        if now != phases:
            print(f"{where}: {', '.join(now) or 'no node pod yet'}", flush=True)
            phases = now
        for pod in pods:
            started = pod.status and pod.status.phase in ("Running", "Succeeded", "Failed")
            if started and pod.metadata.name not in followed:
                thread = threading.Thread(target=_print_log, args=(jobs, pod, where), daemon=True)
                thread.start()
                followed[pod.metadata.name] = thread
        ended = outcome(trainjob)
        if ended:
            for thread in followed.values():  # the last lines of the logs, for a failure's cause
                thread.join(timeout=10)
            return ended
        time.sleep(POLL_S)


def _print_log(jobs: TrainJobs, pod: Any, where: str) -> None:
    prefix = f"[node-{node_index(pod)}]"
    try:
        for line in jobs.log_lines(pod.metadata.name):
            print(prefix, line, flush=True)
    except Exception as e:  # a lost log stream loses lines of the task's log, never the training
        log.warning("%s: stopped following %s's log: %s", where, pod.metadata.name, e)


def _failure(stage: str, result_uri: str, where: str, why: str) -> Exception:
    """One line naming the TrainJob: what rank 0's process raised where it said, else the TrainJob's
    own condition."""
    error = launch_error(stage, result_uri, f"{where} failed: {why}")
    if where in str(error):
        return TrainJobFailed(str(error))
    return type(error)(f"{error} ({where} failed)")


def _wait_gone(jobs: TrainJobs, name: str) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while jobs.get(name) is not None:
        if time.monotonic() > deadline:
            raise TrainJobFailed(
                f"TrainJob {jobs.namespace}/{name} still exists {GONE_TIMEOUT_S:.0f} s after deletion"
            )
        time.sleep(POLL_S / 5)


@contextlib.contextmanager
def _deleted_when_cancelled(jobs: TrainJobs, name: str, where: str) -> Iterator[None]:
    """A cancelled KFP task (SIGTERM to its pod: a cancel, the task's deadline) or an interrupted one
    deletes its TrainJob, whose nodes would otherwise hold their GPUs until the TrainJob's deadline. A
    task that stops following for an error of its own leaves it training: its retry follows it."""

    def cancel(signum, frame):
        raise Cancelled(f"{where}: the task was cancelled")

    previous = signal.signal(signal.SIGTERM, cancel)
    try:
        yield
    except (Cancelled, KeyboardInterrupt):
        with contextlib.suppress(Exception):
            if jobs.delete(name):
                print(f"{where}: deleted (the task was cancelled)", flush=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _transient(error: Exception) -> bool:
    """An error the API may not give again: a server error, throttling, no connection."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(error, ApiException):
        return error.status is None or error.status >= 500 or error.status == 429
    return isinstance(error, OSError) or type(error).__module__.startswith("urllib3")


def _reason(error: Exception) -> str:
    status = getattr(error, "status", None)  # an ApiException's first line is only "(503)"
    if status:
        return f"{status} {getattr(error, 'reason', '')}".strip()
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@contextlib.contextmanager
def _api_errors(where: str) -> Iterator[None]:
    """A Kubernetes API error as one line that says what to check."""
    from kubernetes.client.exceptions import ApiException

    try:
        yield
    except ApiException as e:
        hint = {
            403: ": the task's service account may not manage TrainJobs or read pods in this namespace "
            "(manifests/base/rbac.yaml)",
            404: ": is Kubeflow Trainer installed (docs/deploy.md)?",
        }.get(e.status, "")
        raise TrainJobFailed(f"{where}: the Kubernetes API answered {e.status} {e.reason}{hint}") from None


def copy_outputs(src: TrainingJob, dst: TrainingJob) -> None:
    """The nodes' outputs (in the work prefix) to the task's own: the checkpoint folder whole (its marker
    last), every per-step file, the metrics file."""
    with tempfile.TemporaryDirectory() as tmp:
        store.upload_dir(store.download_dir(src.out_uri, Path(tmp) / "out"), dst.out_uri)
    for rel in store.list_files(src.steps_uri):
        store.write_bytes(store.join(dst.steps_uri, rel), store.read_bytes(store.join(src.steps_uri, rel)))
    if src.metrics_uri and dst.metrics_uri:
        store.write_bytes(dst.metrics_uri, store.read_bytes(src.metrics_uri))
