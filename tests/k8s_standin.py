"""A loopback stand-in of the Kubernetes API and of Kubeflow Trainer's controller, for testing the
training stage's TrainJob path (training/on_nodes.py).

No Kubernetes API server, Trainer controller or JobSet can run here. This serves the calls the
`kubernetes` client makes for a TrainJob, and acts as the controller would: a TrainJob it accepts
(parsed with kubeflow-trainer-api's own models, which reject a malformed one) starts `numNodes` node
"pods", each the trainer's command as a local process in a fresh scratch folder (its own HOME, TMPDIR
and model cache: nothing shared but the store), with the environment the torch runtime gives a node
(PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR/PORT on loopback) and the container's
env, secret references resolved from `secrets`. Like JobSet's default failure policy, a node that
exits non-zero fails the TrainJob and the other nodes are killed; all nodes exiting 0 complete it; the
active deadline is enforced. Deleting a TrainJob kills its nodes. While `unschedulable` holds a message,
the node pods of a TrainJob created then stay Pending and run nothing, with the condition the scheduler
gives a pod it cannot place (type PodScheduled, status "False", reason Unschedulable, that message).

A node sees only what its pod would. Every path it is handed (its command line, and the fields of the
job and the config its command names in the store) must be an s3:// URI, lie in its own pod folder or in
the image (the interpreter, the installed package): a node handed another is failed as a pod is whose
file is not there. Where the machine allows (root, `unshare`, the cgroup v1 memory controller), each
node also runs in a private mount namespace in which the folder `hide` (the test session's, holding the
task's own files) is an empty tmpfs but for the node's pod folder, and in a memory cgroup limited to the
TrainJob's `resourcesPerNode` memory (capped at `memory_cap`, what this machine can give two nodes): a
node that goes over is killed (exit -9), as a pod is OOM-killed.

Routes: POST .../namespaces/{ns}/trainjobs; GET and DELETE .../trainjobs/{name} (under
/apis/trainer.kubeflow.org/v1alpha1); GET /api/v1/namespaces/{ns}/pods?labelSelector=k=v,... (node
pods as a PodList the client deserialises into V1PodList); GET .../pods/{name}/log (follow streams
until the node ends). Anything else is a 404 recorded in `unhandled`, so a test notices new calls.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml
from kubeflow_trainer_api import models as trainer_models
from kubernetes.utils import parse_quantity
from pod_limits import remove_group, v1_memory_group

import dynamicrubric
from dynamicrubric import store

TRAINJOBS = re.compile(r"^/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs(?:/([^/]+))?$")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+)/log)?$")
RUNTIMES = ("torch-distributed",)
GO_TRUE = (
    "1",
    "t",
    "T",
    "TRUE",
    "true",
    "True",
)  # what the API server's boolean query parameters accept  # the ClusterTrainingRuntimes "installed"


@dataclass
class Node:
    pod: str
    index: int
    proc: subprocess.Popen | None  # None: held Pending by the scheduler, nothing runs
    log: Path
    created: str
    phase: str = "Running"
    conditions: list[dict] = field(default_factory=list)  # the pod's status.conditions
    cgroup: Path | None = None  # its memory cgroup, removed once it has ended
    memory_limit: int | None = None  # bytes, where a cgroup enforces it


@dataclass
class Job:
    body: dict
    nodes: list[Node] = field(default_factory=list)
    deadline: float | None = None
    conditions: list[dict] = field(default_factory=list)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")
# A mount namespace in which `hide` is an empty tmpfs but for the node's own folder, which is moved back
# in place from a bind mount made before (/mnt is the staging point, private to the namespace).
HIDE_SCRIPT = (
    "home=$1; hide=$2; shift 2; mount --make-rprivate /; mount -t tmpfs pod-staging /mnt; mkdir /mnt/home; "
    'mount --bind "$home" /mnt/home; mount -t tmpfs -o mode=755 pod-hidden "$hide"; mkdir -p "$home"; '
    'mount --move /mnt/home "$home"; umount /mnt; cd "$home"; exec "$@"'
)
# Join the memory cgroup before anything forks (a child forked before would stay outside), then hide.
POD_SCRIPT = 'echo $$ > "$1/cgroup.procs"; ns=$2; home=$3; hide=$4; shift 4; exec unshare --mount -- sh -ec "$ns" pod "$home" "$hide" "$@"'


def pod_limits_available() -> bool:
    """Whether nodes can run in their own mount namespace and memory cgroup here (root, cgroup v1)."""
    return (
        os.geteuid() == 0
        and shutil.which("unshare") is not None
        and (MEMORY_CGROUPS / "cgroup.procs").exists()
    )


def _image_paths() -> list[Path]:
    """What the image gives every pod: the interpreter and its environment, the installed package."""
    return [Path(p).resolve() for p in {sys.prefix, sys.base_prefix, Path(dynamicrubric.__file__).parent}]


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def foreign_paths(command: list[str], home: Path) -> list[str]:
    """The paths a node is handed that its pod would not have: every absolute or file:// path in its
    command line and in the job and config it reads from the store, outside its pod folder and the image."""
    handed = list(command)
    for flag, load in (("--job", json.loads), ("--config", yaml.safe_load)):
        if flag in command[:-1] and store.is_s3(uri := command[command.index(flag) + 1]):
            with contextlib.suppress(Exception):  # not there: the node fails reading it, as a pod would
                handed += _strings(load(store.read_bytes(uri).decode()))
    allowed = [home.resolve(), *_image_paths()]
    foreign = []
    for word in handed:
        path = word.removeprefix("file://")
        if path.startswith("/") and not any(Path(path).resolve().is_relative_to(a) for a in allowed):
            foreign.append(word)
    return foreign


def _kill_tree(pid: int) -> None:
    """SIGKILL a node's process and every process under it, as deleting a pod stops all of its
    container's processes: torchrun's workers leave the node's process group, so killpg alone would
    leave them running (a stalled one forever)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # a process that ended while we read
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:  # every descendant first, while their parents still link them
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def _remove_cgroup(node: Node) -> None:
    if node.cgroup is not None:
        remove_group(node.cgroup)


def _node_mounts(trainjob: dict) -> list[dict]:
    """The volume mounts the TrainJob's runtime patches give the node container."""
    mounts = []
    for patch in trainjob["spec"].get("runtimePatches") or []:
        jobset = patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {})
        for replicated in jobset.get("replicatedJobs") or []:
            pod = replicated.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            if replicated.get("name") == "node":
                for container in pod.get("containers") or []:
                    if container.get("name") == "node":
                        mounts += container.get("volumeMounts") or []
    return mounts


def _status(code: int, reason: str, message: str) -> dict:
    """The body Kubernetes answers an error with (a meta/v1 Status)."""
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason,
            "code": code}  # fmt: skip


class KubernetesStandIn:
    def __init__(self, scratch: Path, secrets: dict[str, dict[str, str]], base_env: dict[str, str],
                 node_env: dict[str, str] | None = None, *, hide: Path | None = None,
                 memory_cap: str = "6Gi"):  # fmt: skip
        self.scratch = scratch
        self.hide = hide or scratch.parent  # what no node may see but its own pod folder (under it)
        self.memory_cap = int(parse_quantity(memory_cap))
        self.pod_limits = pod_limits_available()
        self.secrets = secrets
        self.base_env = base_env  # what the image gives every process (PATH and the like)
        self.node_env = dict(node_env or {})  # what a pod template patch would add to the nodes
        # The scheduler's message for node pods it cannot place, e.g. "0/4 nodes are available: 4 Insufficient
        # ephemeral-storage."; None: every node pod is placed and runs.
        self.unschedulable: str | None = None
        self.jobs: dict[tuple[str, str], Job] = {}
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.created: list[dict] = []  # every TrainJob body accepted, in order
        self.deleted: list[str] = []
        self.authorizations: set[str] = set()
        # (method, resource) -> HTTP status the API answers instead, as a cluster whose RBAC denies it
        self.refuse: dict[tuple[str, str], int] = {}
        self.lock = threading.RLock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._threads = [threading.Thread(target=self._server.serve_forever, daemon=True),
                         threading.Thread(target=self._controller, daemon=True)]  # fmt: skip
        self._stopping = threading.Event()

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path, namespace: str) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.host}}],
            "users": [{"name": "runner", "user": {"token": "standin-token"}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "runner", "namespace": namespace}}],
        }))  # fmt: skip
        return path

    def start(self) -> KubernetesStandIn:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self.lock:
            for job in self.jobs.values():
                self._kill(job)
        self._server.shutdown()
        self._server.server_close()

    # ---- what a test does to the "cluster"

    def job(self, name: str, namespace: str = "team-a") -> Job | None:
        with self.lock:
            return self.jobs.get((namespace, name))

    def kill_node(self, name: str, index: int, namespace: str = "team-a") -> None:
        """A node lost (its process killed), as when a GPU node goes away."""
        job = self.job(name, namespace)
        assert job is not None and job.nodes[index].proc is not None, name
        _kill_tree(job.nodes[index].proc.pid)

    def wait_for_log(self, name: str, text: str, timeout: float = 600, namespace: str = "team-a") -> None:
        """Until some node of the TrainJob has printed `text`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(name, namespace)
            if job and any(text in n.log.read_text(errors="replace") for n in job.nodes if n.log.exists()):
                return
            time.sleep(0.5)
        raise TimeoutError(f"no node of {name} printed {text!r} in {timeout} s")

    # ---- the controller

    def _start_nodes(self, namespace: str, name: str, job: Job) -> None:
        trainer = job.body["spec"]["trainer"]
        nodes = trainer.get("numNodes", 1)
        port = _free_port()
        for index in range(nodes):
            pod = f"{name}-node-0-{index}-{uuid.uuid4().hex[:5]}"
            home = self.scratch / pod
            if self.unschedulable is not None:  # as the scheduler reports a pod it cannot place
                held = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": self.unschedulable, "lastProbeTime": None, "lastTransitionTime": _now()}  # fmt: skip
                job.nodes.append(Node(pod, index, None, home / "node.log", _now(), "Pending", [held]))
                continue
            (home / "tmp").mkdir(parents=True)
            env = {**self.base_env, "HOME": str(home), "TMPDIR": str(home / "tmp"),
                   "DYNRUBRIC_CACHE": str(home / "cache")}  # fmt: skip
            for var in trainer.get("env") or []:
                if "value" in var:
                    env[var["name"]] = var["value"]
                    continue
                ref = var["valueFrom"]["secretKeyRef"]
                value = self.secrets.get(ref["name"], {}).get(ref["key"])
                if value is None and not ref.get("optional"):
                    raise ValueError(f"secret {ref['name']} has no key {ref['key']}")
                if value is not None:
                    env[var["name"]] = value
            # A volume is a folder of the pod: each mount path maps to one in the node's scratch, and a
            # variable that points under a mount path points there.
            for mount in _node_mounts(job.body):
                folder = home / "volumes" / mount["name"]
                folder.mkdir(parents=True, exist_ok=True)
                for key, value in env.items():
                    if value == mount["mountPath"] or value.startswith(mount["mountPath"].rstrip("/") + "/"):
                        env[key] = str(folder) + value[len(mount["mountPath"]) :]
            env.update(self.node_env)
            env.update({"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
                        "PET_NODE_RANK": str(index), "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)})  # fmt: skip
            command = [*trainer["command"], *(trainer.get("args") or [])]
            if foreign := foreign_paths(command, home):  # the container fails opening it
                message = f"stand-in: this pod has no {foreign[0]} (a path of another pod's filesystem)"
                command = [sys.executable, "-c", f"import sys; sys.exit({message!r})"]
            cgroup, limit = None, None
            if self.pod_limits:
                limit = self._memory_limit(trainer)
                cgroup = v1_memory_group(f"k8s-standin-{pod}", limit)
                command = ["sh", "-ec", POD_SCRIPT, "pod", str(cgroup), HIDE_SCRIPT, str(home), str(self.hide),
                           *command]  # fmt: skip
            log = home / "node.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(command, env=env, cwd=home, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
            job.nodes.append(Node(pod, index, proc, log, _now(), cgroup=cgroup, memory_limit=limit))

    def _memory_limit(self, trainer: dict) -> int:
        """The node's memory limit in bytes: the TrainJob's, capped at what this machine can give."""
        limits = (trainer.get("resourcesPerNode") or {}).get("limits") or {}
        requested = int(parse_quantity(limits["memory"])) if "memory" in limits else self.memory_cap
        return min(requested, self.memory_cap)

    def _controller(self) -> None:
        while not self._stopping.wait(0.2):
            with self.lock:
                for job in self.jobs.values():
                    if job.conditions and job.conditions[-1]["type"] in ("Complete", "Failed"):
                        continue
                    for node in job.nodes:
                        code = node.proc.poll() if node.proc else None
                        if code is not None and node.phase == "Running":
                            node.phase = "Succeeded" if code == 0 else "Failed"
                            _remove_cgroup(node)
                    failed = [n for n in job.nodes if n.phase == "Failed"]
                    if failed:
                        self._kill(job)
                        node = failed[0]
                        self._end(
                            job,
                            "Failed",
                            "NodeFailed",
                            f"node {node.index} exited with code {node.proc.returncode}",
                        )
                    elif job.nodes and all(n.phase == "Succeeded" for n in job.nodes):
                        self._end(job, "Complete", "JobSetCompleted", "all nodes completed")
                    elif job.deadline and time.monotonic() > job.deadline:
                        self._kill(job)
                        self._end(job, "Failed", "DeadlineExceeded", "activeDeadlineSeconds exceeded")

    @staticmethod
    def _end(job: Job, kind: str, reason: str, message: str) -> None:
        job.conditions.append({"type": kind, "status": "True", "reason": reason, "message": message,
                               "lastTransitionTime": _now()})  # fmt: skip

    @staticmethod
    def _kill(job: Job) -> None:
        for node in job.nodes:
            if node.proc and node.proc.poll() is None:
                _kill_tree(node.proc.pid)
                node.proc.wait()
                node.phase = "Failed"
            _remove_cgroup(node)

    # ---- the API

    def _create(self, namespace: str, body: dict) -> tuple[int, dict]:
        trainjob = trainer_models.TrainerV1alpha1TrainJob.from_dict(body)  # rejects a malformed TrainJob
        if trainjob.kind != "TrainJob" or trainjob.api_version != "trainer.kubeflow.org/v1alpha1":
            return 400, _status(400, "BadRequest", f"not a TrainJob: {trainjob.api_version} {trainjob.kind}")
        name = trainjob.metadata.name
        if trainjob.metadata.namespace not in (None, namespace):
            return 400, _status(400, "BadRequest", "the namespace of the body does not match the request")
        if trainjob.spec.runtime_ref.name not in RUNTIMES:
            return 422, _status(422, "Invalid", f"no ClusterTrainingRuntime {trainjob.spec.runtime_ref.name}")
        with self.lock:
            if (namespace, name) in self.jobs:
                return 409, _status(
                    409, "AlreadyExists", f'trainjobs.trainer.kubeflow.org "{name}" already exists'
                )
            stored = json.loads(json.dumps(body))
            stored["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=_now())
            job = Job(stored)
            deadline = stored["spec"].get("activeDeadlineSeconds")
            job.deadline = time.monotonic() + deadline if deadline else None
            self.jobs[(namespace, name)] = job
            self.created.append(stored)
            self._start_nodes(namespace, name, job)
            return 201, self._object(job)

    @staticmethod
    def _object(job: Job) -> dict:
        return {**job.body, "status": {"conditions": list(job.conditions)}}

    def _pods(self, namespace: str, selector: str) -> dict:
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        items = []
        with self.lock:
            for (ns, name), job in self.jobs.items():
                for node in job.nodes:
                    labels = {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": "node",
                              "batch.kubernetes.io/job-completion-index": str(node.index)}  # fmt: skip
                    if ns == namespace and all(labels.get(k) == v for k, v in wanted.items()):
                        items.append({
                            "metadata": {"name": node.pod, "namespace": ns, "labels": labels,
                                         "creationTimestamp": node.created},
                            "spec": {"containers": [{"name": "node", "image": job.body["spec"]["trainer"].get("image")}]},
                            "status": {"phase": node.phase, **({"conditions": node.conditions} if node.conditions else {})},
                        })  # fmt: skip
        return {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}

    def _node(self, namespace: str, pod: str) -> Node | None:
        with self.lock:
            for (ns, _), job in self.jobs.items():
                for node in job.nodes:
                    if ns == namespace and node.pod == pod:
                        return node
        return None

    def _handler(self):
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                url = urlsplit(self.path)
                standin.requests.append((method, url.path))
                standin.authorizations.add(self.headers.get("Authorization", ""))
                jobs, pods = TRAINJOBS.match(url.path), PODS.match(url.path)
                refused = standin.refuse.get((method, "trainjobs" if jobs else "pods" if pods else ""))
                if refused:
                    return self._reply(
                        refused, _status(refused, HTTPStatus(refused).phrase, "refused by the test")
                    )
                if jobs and method == "POST" and not jobs[2]:
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    try:
                        self._reply(*standin._create(jobs[1], body))
                    except ValueError as e:  # pydantic's ValidationError is a ValueError
                        self._reply(422, _status(422, "Invalid", str(e).splitlines()[0]))
                elif jobs and jobs[2] and method in ("GET", "DELETE"):
                    key = (jobs[1], jobs[2])
                    with standin.lock:
                        job = standin.jobs.get(key)
                        if job is None:
                            return self._reply(
                                404, _status(404, "NotFound", f'trainjobs "{jobs[2]}" not found')
                            )
                        if method == "DELETE":
                            standin._kill(job)
                            del standin.jobs[key]
                            standin.deleted.append(jobs[2])
                    self._reply(200, standin._object(job))
                elif pods and method == "GET" and not pods[2]:
                    selector = parse_qs(url.query).get("labelSelector", [""])[0]
                    if any(op in selector for op in ("!=", " in ", "notin", "(")):
                        return self._reply(
                            400, _status(400, "BadRequest", "the stand-in knows only k=v selectors")
                        )
                    self._reply(200, standin._pods(pods[1], selector))
                elif pods and method == "GET" and pods[2]:
                    node = standin._node(pods[1], pods[2])
                    if node is None:
                        return self._reply(404, _status(404, "NotFound", f'pods "{pods[2]}" not found'))
                    if node.proc is None:  # the API's answer for a container that has not started
                        message = (
                            f'container "node" in pod "{pods[2]}" is waiting to start: ContainerCreating'
                        )
                        return self._reply(400, _status(400, "BadRequest", message))
                    self._stream_log(node, parse_qs(url.query).get("follow", ["false"])[0] in GO_TRUE)
                else:
                    standin.unhandled.append((method, url.path))
                    self._reply(404, _status(404, "NotFound", "the stand-in does not serve this"))

            def _stream_log(self, node: Node, follow: bool) -> None:
                # HTTP/1.0 without a length: the body ends when the connection closes, as a followed log does.
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                with node.log.open("rb") as f:
                    while True:
                        chunk = f.read(65536)
                        if chunk:
                            self.wfile.write(chunk)
                            self.wfile.flush()
                        elif not follow or node.proc.poll() is not None:
                            rest = f.read()
                            if not rest:
                                break
                            self.wfile.write(rest)
                        else:
                            time.sleep(0.2)

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def do_DELETE(self) -> None:
                self._route("DELETE")

        return Handler
