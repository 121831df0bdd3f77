"""A stand-in of KFP's v2 launcher under kfp.local: every task runs as it would in its own pod.

kfp.local runs a pipeline's tasks as processes that share this machine's filesystem, with artifact
URIs that are local paths under the pipeline root, and no memory limit. On a cluster a task's pod sees
none of that: KFP's launcher gives each artifact an `s3://` URI under the pipeline root, downloads the
task's input artifacts into the pod (where the component reads them at `/s3/<bucket>/<key>`: kfp
`dsl/types/artifact_types.py`), runs the task under the memory limit the pipeline requested for it, and
after the task succeeds uploads each output path, file by file with the same relative keys, to its URI
(backend/src/v2/objectstore). A task never sees another task's files, the pipeline root, or anything
else of the machine that ran the pipeline.

`PodLauncher` takes the place of `task_processes.TaskStarter` (the test patches it into task_monitor)
and does what the launcher does around each task, so kfp.local still orchestrates the DAG (loops,
conditions, collected outputs) while every task sees only what its pod would:

- artifact URIs rewritten from `<local pipeline root>/<rel>` to `s3://<bucket>/<rel>` on a real
  SeaweedFS, inputs downloaded into the pod's own `s3/` folder, outputs uploaded flat after success
  (an output path the task left absent is skipped, as the launcher skips it with a warning:
  launcher_v2.go, uploadOutputArtifacts; a task may have written the artifact's URI itself);
- each task forked (from the preloaded server, as in a local run) into a private mount namespace in
  which the pod's `s3/` folder is `/s3` and the pod's own `tmp/` folder is `/tmp`, hiding every other
  pod, the local pipeline root and everything tests keep under /tmp (model caches, the object store's
  data); the task's executor output is written to `/tmp/kfp_outputs/` in the pod, as on a cluster, and
  copied back for kfp.local;
- the model-cache volume of a stage that has one (its `sizeLimit` from `pipeline.model_cache_size`),
  with the caches pointed at it as the compiled pipeline points them, and the pod evicted when it
  writes more (its use polled, as the kubelet does: pod_limits.DiskWatcher);
- files the cluster mounts into every pod (`mounted`: a kubeconfig standing for the service account
  with which a training stage on several nodes submits its TrainJob);
- the memory limit of the task's stage (`pipeline.resources`, what the compiled pipeline requests; for
  a stage on several nodes, what its task that only submits the TrainJob requests) enforced with the
  cgroup v1 memory controller: a task that goes over is killed with exit code 137,
  as a pod is OOM-killed. Pages the task inherits from the preloaded server (its imports) are charged
  to the server, not the task, so the limit is a little looser than a pod's for the same imports.

It needs root (mount namespaces, cgroups); `pod_isolation_problem()` says why it cannot run where it
cannot.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pod_limits import DiskWatcher, remove_group, v1_memory_group

from dynamicrubric.infra.config import STAGE_FACTS, Config, quantity_bytes
from dynamicrubric.localrun.task_monitor import _executor_input
from dynamicrubric.localrun.task_processes import (
    TaskProcess,
    TaskStarter,
    Usage,
    _Fork,
    _run_executor,
    executor_call,
)
from dynamicrubric.pipelines.task_settings import task_resources
from dynamicrubric.stages.kfp_source import ON_NODES

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
S3_MOUNT = Path("/s3")  # where kfp's Artifact.path puts an s3:// URI's file
CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18


def stage_memory(cfg: Config) -> Callable[[str], int]:
    """The memory limit the compiled pipeline requests for a stage's tasks (`pipeline.resources`; a
    training stage on several nodes: what its task that submits the TrainJob requests)."""
    return lambda stage: int(quantity_bytes(task_resources(cfg, stage).memory))


def stage_cache(cfg: Config) -> Callable[[str], int | None]:
    """The sizeLimit of the model-cache volume the compiled pipeline gives a stage's tasks, or None."""
    size = int(quantity_bytes(cfg.pipeline.model_cache_size))
    return lambda stage: size if STAGE_FACTS[stage].model_cache else None


def pod_isolation_problem() -> str | None:
    """Why pods cannot be stood in for here, or None."""
    if os.geteuid() != 0:
        return "needs root (mount namespaces and cgroups)"
    if not (CGROUP_MEMORY / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {CGROUP_MEMORY}"
    return None


def _libc_call(name: str, *args) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _bind(source: Path, target: Path, flags: int = 0) -> None:
    _libc_call("mount", os.fsencode(source), os.fsencode(target), None, MS_BIND | flags, None)


def image_paths() -> list[str]:
    """What the pod's image holds that may lie under /tmp here (a checkout cloned there, its venv): kept
    visible in the pod's own /tmp, as an image's files are in every pod."""
    import dynamicrubric

    tmp = Path("/tmp").resolve()
    found = {Path(dynamicrubric.__file__).resolve().parents[2], Path(sys.prefix).resolve()}
    return sorted(str(p) for p in found if p.is_relative_to(tmp))


def _run_in_pod(pod: dict, component_code: str, executor_args: list[str], env: dict, output, usage) -> None:
    """In the forked child: become the pod (its cgroup, its filesystem), then run the executor."""
    try:
        Path(pod["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
        _libc_call("unshare", CLONE_NEWNS)
        # Nothing mounted in here may reach the machine's namespace, or the other pods'.
        _libc_call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
        _bind(Path(pod["root"], "s3"), S3_MOUNT)
        for path in pod["image"]:  # into the pod's /tmp before it covers the machine's (MS_REC keeps them)
            inside = Path(pod["root"], "tmp", Path(path).relative_to("/tmp"))
            inside.mkdir(parents=True, exist_ok=True)
            _bind(Path(path), inside)
        _bind(Path(pod["root"], "tmp"), Path("/tmp"), MS_REC)
        os.chdir("/tmp")
    except OSError as e:
        os.write(output.fileno(), f"pod stand-in: could not set up the pod: {e}\n".encode())
        os._exit(1)
    _run_executor(component_code, executor_args, env, output, usage)


class PodError(RuntimeError):
    """What the launcher stand-in refuses: a task input a pod could not have."""


class PodLauncher(TaskStarter):
    """Starts kfp.local's tasks as pods (see the module docstring). `root` is kfp.local's pipeline
    root, `bucket` the bucket on the store the AWS_* variables name that stands for it, `pods` a folder
    for the pods' own files, `memory_limit` the bytes a task of a component may use, `cache_limit` the
    sizeLimit of its model-cache volume (None: the component gets none), `mounted` the files the cluster
    mounts into every pod (its path there, under /tmp -> the file here), as a kubeconfig that stands for
    the service account a task that submits a TrainJob uses."""

    def __init__(
        self,
        root: Path,
        bucket: str,
        pods: Path,
        memory_limit: Callable[[str], int],
        cache_limit: Callable[[str], int | None] = lambda component: None,
        preload: bool = True,
        mounted: dict[str, Path] | None = None,
    ):
        super().__init__(preload)
        if self._context is None:
            raise PodError("the pod stand-in forks its tasks: it needs the forkserver start method")
        self.root, self.bucket, self.pods = root.resolve(), bucket, pods
        self.memory_limit, self.cache_limit = memory_limit, cache_limit
        self.mounted = dict(mounted or {})  # a file here -> its path in every pod, under /tmp
        self.ran: list[dict] = []  # per task: its stage, pod folder, limits, peak uses, how it ended

    def _s3_uri(self, local_uri: str) -> str:
        rel = Path(local_uri).resolve().relative_to(self.root)
        return f"s3://{self.bucket}/{rel.as_posix()}"

    def start(self, command, env, own_env) -> TaskProcess:
        parsed = executor_call(command)
        if parsed is None:
            raise PodError(f"not a lightweight component's task command: {command[:3]}")
        component, executor_input = _executor_input(list(command))
        stage = component.replace("-", "_").removesuffix(ON_NODES)  # a stage's TrainJob variant is its task
        code, args = parsed
        pod = self.pods / f"{stage}-{uuid.uuid4().hex[:8]}"
        (pod / "tmp" / "kfp_outputs").mkdir(parents=True)
        (pod / "s3").mkdir()
        for inside, here in self.mounted.items():
            target = pod / "tmp" / Path(inside).relative_to("/tmp")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(here, target)

        # Inputs: what the launcher downloads. Every input artifact must be in the object store.
        for group in executor_input.get("inputs", {}).get("artifacts", {}).values():
            for artifact in group.get("artifacts", []):
                uri = artifact["uri"]
                if not uri.startswith("s3://"):
                    raise PodError(f"{stage}: input artifact {uri} is not in the object store")
                download_artifact(uri, pod / "s3" / uri.removeprefix("s3://"))
        # Outputs: s3:// URIs under the pipeline root; the task writes them under /s3 in its pod.
        outputs = executor_input.get("outputs", {})
        uploads: list[tuple[Path, str]] = []
        for group in outputs.get("artifacts", {}).values():
            for artifact in group.get("artifacts", []):
                artifact["uri"] = self._s3_uri(artifact["uri"])
                local = pod / "s3" / artifact["uri"].removeprefix("s3://")
                local.parent.mkdir(parents=True, exist_ok=True)
                uploads.append((local, artifact["uri"]))
        copy_back = [(pod / "tmp/kfp_outputs/output_metadata.json", Path(outputs["outputFile"]))]
        outputs["outputFile"] = "/tmp/kfp_outputs/output_metadata.json"
        for name, parameter in outputs.get("parameters", {}).items():
            copy_back.append((pod / "tmp/kfp_outputs" / name, Path(parameter["outputFile"])))
            parameter["outputFile"] = f"/tmp/kfp_outputs/{name}"
        args = list(args)
        args[args.index("--executor_input") + 1] = json.dumps(executor_input)

        record = {
            "stage": stage,
            "component": component,
            "pod": str(pod),
            "memory_limit": self.memory_limit(stage),
        }
        self.ran.append(record)
        cgroup = v1_memory_group(f"dynrubric-pod-{pod.name}", record["memory_limit"])
        env = dict(env)
        watcher = None
        if (cache_limit := self.cache_limit(stage)) is not None:
            # The model-cache emptyDir, where the compiled pipeline points the caches (DYNRUBRIC_CACHE,
            # HF_HOME), with the kubelet's eviction of a pod that writes more than its sizeLimit.
            cache = pod / "tmp" / "model-cache"
            cache.mkdir()
            env |= {
                "DYNRUBRIC_CACHE": "/tmp/model-cache/dynamicrubric",
                "HF_HOME": "/tmp/model-cache/huggingface",
            }
            record["cache_limit"] = cache_limit
            watcher = DiskWatcher(cache, cache_limit, record, lambda: _kill_all(cgroup), what="model-cache",
                                  limit_name="sizeLimit", peak="cache_peak")  # fmt: skip
        task = _Fork(
            self._context,
            code,
            args,
            env,
            target=_run_in_pod,
            target_args=({"root": str(pod), "cgroup": str(cgroup), "image": image_paths()},),
        )

        def after(code: int) -> int:
            if watcher is not None:
                watcher.stop()
            _kill_all(cgroup)  # a pod's end leaves no process of it behind
            record["max_usage"] = int((cgroup / "memory.max_usage_in_bytes").read_text())
            oom = dict(line.split() for line in (cgroup / "memory.oom_control").read_text().splitlines())
            record["oom_killed"] = int(oom.get("oom_kill", 0)) > 0
            remove_group(cgroup)
            if record.get("evicted"):
                code = code or 1
            if code != 0:
                return code  # the launcher uploads nothing of a failed task
            for local, uri in uploads:
                if not local.exists():  # the launcher warns and records the artifact at its URI
                    record.setdefault("not_uploaded", []).append(uri)  # (a task may write it there itself)
                    continue
                upload_artifact(local, uri)
            for src, dst in copy_back:
                if src.exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)
            return 0

        return _PodTask(task, after)


def _kill_all(cgroup: Path) -> None:
    """SIGKILL every process left in the pod's cgroup (the task's children included)."""
    for _ in range(50):
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


class _PodTask(TaskProcess):
    def __init__(self, inner: TaskProcess, after: Callable[[int], int]):
        self._inner, self._after = inner, after
        self.output = inner.output

    def wait(self) -> tuple[int, Usage]:
        code, usage = self._inner.wait()
        return self._after(code), usage


def download_artifact(uri: str, local: Path) -> None:
    """An input artifact as the launcher fetches it into a pod: the object itself, or every key under it
    at its path relative to the artifact's, whatever it is (launcher_v2.go downloadArtifacts,
    objectstore DownloadBlob). A folder the store published versioned arrives with its `_COMPLETE`
    marker and its `_versions/<token>/` files as they are."""
    from dynamicrubric import store
    from dynamicrubric.store import s3

    bucket, key = store.split_s3(uri)
    client = s3.s3_client()
    keys = [k for k in s3.list_keys(uri, bucket, key) if k == key or k.startswith(key.rstrip("/") + "/")]
    if not keys:
        raise PodError(f"input artifact {uri} is not in the object store")
    for k in keys:
        target = local if k == key else local / k[len(key.rstrip("/")) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, k, str(target))


def upload_artifact(local: Path, uri: str) -> None:
    """An output as the launcher uploads it: a file to the URI's key, a folder file by file."""
    from dynamicrubric import store
    from dynamicrubric.store import s3

    bucket, key = store.split_s3(uri)
    client = s3.s3_client()
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    for path in files:
        rel = "" if path == local else "/" + path.relative_to(local).as_posix()
        client.upload_file(str(path), bucket, key.rstrip("/") + rel)
