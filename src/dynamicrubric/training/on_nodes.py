"""The KFP task's side of a training stage on several nodes: submit its TrainJob (training/trainjob.py),
follow it, collect what its nodes wrote.

The task needs no GPU. It writes the config and the job to the stage's work prefix in the store (what
every node reads), submits the TrainJob, and follows it through the Kubernetes API (the `kubernetes`
client, as the Kubeflow SDK does): status changes and the nodes' log lines go to the task's log. The
nodes write the stage's outputs under the work prefix (a pod path such as /s3/b/k is the KFP task's own,
uploaded only when it succeeds); the task copies them to its outputs once the TrainJob is complete, the
checkpoint by server-side copies straight to its output's URI (`in_store`): the task's pod never holds
the models it trains from (they reach the nodes as URIs: stages/kfp_source.py) nor the one it exports. A
failed TrainJob fails the task with one line naming it; a cancelled task (SIGTERM) deletes it, and so
does one whose node pods the scheduler cannot place within `pipeline.schedule_timeout_s`. A retried
task follows the TrainJob of the same name where it still runs (the attempt before died without deleting
it, or lost the API), else deletes the one that ended and submits again, and the trainer resumes from the
newest trainer checkpoint in the work prefix (training/checkpoints.py). A retry after the TrainJob
completed only copies. Once the outputs are the task's, the nodes' copy of the export goes.

The Kubeflow SDK's TrainerClient builds its own TrainJob from its trainer types, which have no command
for a custom image, and its local-process backend runs one node (kubeflow 0.5.0). So the TrainJob is
submitted with the SDK's models and the Kubernetes client directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dynamicrubric import store
from dynamicrubric.infra.config import Config
from dynamicrubric.training.checkpoints import already_done
from dynamicrubric.training.data import TrainingJob, trainee
from dynamicrubric.training.launcher import check_job, error_uri, launch_error
from dynamicrubric.training.trainjob import GROUP, NODE, PLURAL, VERSION, NodeFiles, train_job, trainjob_name

log = logging.getLogger(__name__)

# How the runtime's JobSet labels a TrainJob's node pods (the Kubeflow SDK's constants).
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
NODE_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# In-cluster, the namespace of the task's service account, which its Role covers (manifests/base/rbac.yaml).
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
POLL_S = 5.0  # between two reads of the TrainJob's status
GONE_TIMEOUT_S = 600.0  # how long a leftover TrainJob of a failed attempt may take to go
API_PATIENCE_S = 900.0  # how long the API may stay unreachable while the task follows its TrainJob


class TrainJobFailed(RuntimeError):
    """The TrainJob ended Failed, or could not be submitted or followed; one line, naming it."""


class Cancelled(BaseException):  # noqa: N818 (like KeyboardInterrupt: not an error of the task's own)
    """The KFP task was cancelled (its pod got SIGTERM)."""


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
    exported = in_store(job)
    # A pod path is empty in every attempt's pod, as it was before the export went to the store: a retry
    # copies again from the TrainJob's export (server-side), so the steps and metrics come to its pod too.
    if exported is job and store.is_complete(job.out_uri):
        return already_done(cfg, job)
    files = NodeFiles.of(cfg, job)  # first: a job that no node can read is refused before any download
    check_job(cfg, job)
    # Done by an earlier attempt: the nodes' export is complete (to be collected), or an attempt already
    # copied it to the task's output in the store (`exported` is then the store's URI: the steps and
    # metrics, pod paths, are copied again) and removed the nodes' copy.
    trained = store.is_complete(files.job.out_uri) or store.is_complete(exported.out_uri)
    if not trained:
        _run(cfg, job, files, jobs or TrainJobs.connect())
    result = json.loads(store.read_bytes(files.result_uri))
    copy_outputs(files.job, exported)
    clean_up(files)
    return result


def in_store(job: TrainingJob) -> TrainingJob:
    """`job` with its checkpoint output as the store's URI where the task sees it as its pod's path
    (/s3/b/k is s3://b/k): the task writes the export there itself, by server-side copies, and leaves
    the pod path empty. KFP's launcher uploads an output path only where it exists (a missing one is a
    warning: backend/src/v2/component/launcher_v2.go, uploadOutputArtifacts) and records the artifact
    at its URI either way, so the model reaches KFP's lineage and the next tasks as before, while the
    task's pod never holds a byte of it. The steps and metrics stay pod paths: they are small, and the
    stage's MLflow lineage reads them there."""
    from dynamicrubric.infra.tracking import POD_PREFIXES, artifact_uri

    if job.out_uri.startswith(tuple(POD_PREFIXES)) and store.is_s3(artifact_uri(job.out_uri)):
        return dataclasses.replace(job, out_uri=artifact_uri(job.out_uri))
    return job


def _run(cfg: Config, job: TrainingJob, files: NodeFiles, jobs: TrainJobs) -> None:
    name = trainjob_name(job)
    where = f"TrainJob {jobs.namespace}/{name}"
    # From before the TrainJob exists: a cancel that comes while it is submitted still deletes it.
    with _deleted_when_cancelled(jobs, name, where):
        with _api_errors(where):
            earlier = jobs.get(name)
        if earlier is not None and outcome(earlier) is None:
            # An attempt that died without deleting it (its pod killed outright): its nodes train on.
            print(f"{where}: still running from an earlier attempt of this task; following it", flush=True)
        else:
            _submit(cfg, files, jobs, name, where, leftover=earlier is not None)
        ended, why = _follow(jobs, name, where, cfg.pipeline.schedule_timeout_s)
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


def _follow(jobs: TrainJobs, name: str, where: str, schedule_timeout_s: float = 0) -> tuple[str, str]:
    """Wait for the TrainJob to end, printing its node pods' phases as they change, why the scheduler
    cannot place a node pod (once, and again only if that changes), and every node's log lines (prefixed
    with the node) as they come. A node pod unscheduled for `schedule_timeout_s` (0: no limit) fails it."""
    followed: dict[str, threading.Thread] = {}
    phases: list[str] = []
    unreachable_since: float | None = None
    unscheduled_since: float | None = None
    told = ""
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
        waiting = unscheduled(pods)
        if waiting != told:
            if waiting:
                print(f"{where}: {waiting}", flush=True)
            told = waiting
        # the clock runs from when some node pod is first seen unplaced until every one is placed
        unscheduled_since = (unscheduled_since or time.monotonic()) if waiting else None
        if waiting and schedule_timeout_s and time.monotonic() - unscheduled_since > schedule_timeout_s:
            _unschedulable(jobs, name, where, schedule_timeout_s, waiting)
        time.sleep(POLL_S)


def unscheduled(pods: list[Any]) -> str:
    """Why the scheduler leaves node pods unplaced, as the API says it (the pod's PodScheduled condition
    False: its reason, e.g. Unschedulable, and message, e.g. "0/4 nodes are available: 4 Insufficient
    ephemeral-storage."), on one line, pods with the same reason together; "" when every pod is placed."""
    nodes: dict[str, list[str]] = {}
    for pod in pods:
        for condition in (pod.status and pod.status.conditions) or []:
            if condition.type == "PodScheduled" and condition.status == "False":
                why = ": ".join(filter(None, (condition.reason, condition.message))) or "no reason given"
                nodes.setdefault(" ".join(why.split()), []).append(f"node-{node_index(pod)}")
    return "; ".join(f"{', '.join(names)} not scheduled: {why}" for why, names in nodes.items())


def _unschedulable(jobs: TrainJobs, name: str, where: str, timeout_s: float, why: str) -> None:
    """Delete a TrainJob whose node pods the scheduler cannot place, then fail the task naming why.

    Deleting loses nothing: an unplaced pod has run nothing, and any trainer checkpoint is in the store for
    the retry to resume from. Left in place it would do harm: a placed node would hold its GPUs idle in the
    rendezvous, and once the task's retries are spent nothing follows it, so a TrainJob placed hours later
    would train for no one until its deadline. A retry submits it afresh and waits as long again."""
    with _api_errors(where):
        jobs.delete(name)
        _wait_gone(jobs, name)
    raise TrainJobFailed(
        f"{where}: deleted, its node pods not all placed in {timeout_s:g} s (pipeline.schedule_timeout_s): {why}"
    )


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
    last), every per-step file, the metrics file. The checkpoint (a trained model's one safetensors file
    can be 16 GB; the task has 4Gi and next to no disk) is copied by the store itself, server-side, to
    `dst.out_uri` in the store (`in_store`); the small files stream through the task, none ever whole
    in memory."""
    if not store.is_complete(dst.out_uri):  # else: an earlier attempt's copy (see train_on_nodes)
        store.copy_dir(src.out_uri, dst.out_uri)
    for rel in store.list_files(src.steps_uri):
        store.copy_file(store.join(src.steps_uri, rel), store.join(dst.steps_uri, rel))
    if src.metrics_uri and dst.metrics_uri:
        store.copy_file(src.metrics_uri, dst.metrics_uri)


def clean_up(files: NodeFiles) -> None:
    """Once the task holds the outputs: remove the nodes' export (a second copy of the trained model, 16 GB
    for Qwen3-8B) and abort every multipart upload left under the TrainJob's prefix (a node killed
    mid-upload in an earlier attempt). No node writes there any more: the TrainJob is complete, and its
    name is this task's alone. The small files stay (the result, the steps, the metrics): a retry of the
    task, should its pod fail after this, copies them again."""
    store.delete_dir(files.job.out_uri)
    store.abort_stale_uploads(files.work_uri + "/", older_than_s=0)
