"""A loopback stand-in of the Kubeflow Pipelines v2beta1 REST API, for testing `dynrubric submit`.

No real KFP API server can run here (it needs Kubernetes, Argo and a database), so this serves the
calls `kfp.Client` 2.17 makes to create a run or upload a pipeline, and checks what it receives the
way the server and its driver would: the PipelineSpec, its deployment config, the PlatformSpec and
every kfp-kubernetes executor config are parsed with the protos with unknown fields rejected, task
and executor references must resolve, and run parameters must be declared pipeline inputs. A bad
request gets HTTP 400 with a message in the grpc-gateway error shape; everything accepted is
recorded for assertions.

A run is created PENDING and keeps its state unless the test plays the cluster: `advance(run)` is
called on every GET of a run that has not ended and returns the state to report from then on (the
state names of the v2beta1 RuntimeState enum: PENDING, RUNNING, SUCCEEDED, FAILED, ...), so a test can
let a run succeed or fail, and record what its tasks would have recorded, when the client asks.

Routes (all under /apis/v2beta1): GET healthz; GET/POST experiments, GET experiments/{id};
POST/GET runs, GET runs/{id}; POST pipelines/upload (multipart, field `uploadfile`). Anything else
is a 404 and is recorded in `unhandled`, so a test notices when the client starts calling more.
"""

from __future__ import annotations

import datetime
import email.parser
import email.policy
import json
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml
from google.protobuf import json_format
from kfp.kubernetes import kubernetes_executor_config_pb2
from kfp.pipeline_spec import pipeline_spec_pb2

API = "/apis/v2beta1"
SCHEMA_VERSIONS = ("2.0.0", "2.1.0")
# The API server's rule for pipeline names (backend/src/apiserver/common: a DNS-1123 label, ≤128 chars).
PIPELINE_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,126}[a-z0-9])?$")
MAX_BODY = 16 * 1024 * 1024  # a 150-task spec is well under 1 MiB; refuse anything absurd
# The v2beta1 RuntimeState values a run can take, and those in which it has ended.
RUN_STATES = ("PENDING", "RUNNING", "SUCCEEDED", "SKIPPED", "FAILED", "CANCELING", "CANCELED", "PAUSED")
ENDED = ("SUCCEEDED", "SKIPPED", "FAILED", "CANCELED")
EQUALS = (1, "EQUALS")  # kfp.Client sends the enum's number; the REST gateway also takes its name


class SpecError(ValueError):
    """A request the stand-in refuses; the message becomes the HTTP 400 body."""


@dataclass
class ParsedPipeline:
    """A strictly parsed pipeline package or run spec."""

    spec: pipeline_spec_pb2.PipelineSpec
    deployment: pipeline_spec_pb2.PipelineDeploymentConfig
    platform: pipeline_spec_pb2.PlatformSpec
    kubernetes: dict[str, kubernetes_executor_config_pb2.KubernetesExecutorConfig]  # executor → config


@dataclass
class ReceivedRun:
    body: dict  # the JSON the client posted
    pipeline: ParsedPipeline
    response: dict


@dataclass
class ReceivedUpload:
    name: str
    filename: str
    pipeline: ParsedPipeline
    response: dict


def _parse_strict(doc: Any, message, what: str):
    if not isinstance(doc, dict):
        raise SpecError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    try:
        return json_format.ParseDict(doc, message, ignore_unknown_fields=False)
    except json_format.ParseError as e:
        raise SpecError(f"{what}: {e}") from None


def parse_pipeline(
    spec_doc: Any, platform_doc: Any, schema_versions: tuple[str, ...] = SCHEMA_VERSIONS
) -> ParsedPipeline:
    """Parse and cross-check a PipelineSpec and PlatformSpec the way the KFP backend reads them."""
    spec = _parse_strict(spec_doc, pipeline_spec_pb2.PipelineSpec(), "pipeline_spec")
    if spec.schema_version not in schema_versions:
        raise SpecError(
            f"pipeline_spec.schemaVersion: {spec.schema_version!r} is not one of {list(schema_versions)}"
        )
    if not PIPELINE_NAME.match(spec.pipeline_info.name):
        raise SpecError(f"pipeline_spec.pipelineInfo.name: {spec.pipeline_info.name!r} is not a valid name")
    # deploymentSpec is a Struct in PipelineSpec; the driver unmarshals it as PipelineDeploymentConfig.
    deployment = _parse_strict(
        json_format.MessageToDict(spec.deployment_spec),
        pipeline_spec_pb2.PipelineDeploymentConfig(),
        "pipeline_spec.deploymentSpec",
    )
    executors = set(deployment.executors)
    for name, component in spec.components.items():
        if component.executor_label and component.executor_label not in executors:
            raise SpecError(
                f"pipeline_spec.components.{name}.executorLabel: no executor {component.executor_label!r}"
            )
    dags = [("root", spec.root.dag)] + [(n, c.dag) for n, c in spec.components.items() if c.HasField("dag")]
    for owner, dag in dags:
        for task_name, task in dag.tasks.items():
            ref = task.component_ref.name
            if ref not in spec.components:
                raise SpecError(
                    f"pipeline_spec: task {owner}/{task_name} refers to unknown component {ref!r}"
                )
            for upstream in task.dependent_tasks:
                if upstream not in dag.tasks:
                    raise SpecError(
                        f"pipeline_spec: task {owner}/{task_name} depends on unknown {upstream!r}"
                    )

    platform = _parse_strict(platform_doc or {}, pipeline_spec_pb2.PlatformSpec(), "platform_spec")
    kubernetes: dict[str, kubernetes_executor_config_pb2.KubernetesExecutorConfig] = {}
    for platform_name, single in platform.platforms.items():
        if platform_name != "kubernetes":
            raise SpecError(f"platform_spec.platforms: unknown platform {platform_name!r}")
        for executor, struct in single.deployment_spec.executors.items():
            if executor not in executors:
                raise SpecError(
                    f"platform_spec: executor {executor!r} is not in the pipeline's deploymentSpec"
                )
            # Each value is a Struct in PlatformSpec; the kfp-kubernetes driver reads it as this proto.
            kubernetes[executor] = _parse_strict(
                json_format.MessageToDict(struct),
                kubernetes_executor_config_pb2.KubernetesExecutorConfig(),
                f"platform_spec.platforms.kubernetes.deploymentSpec.executors.{executor}",
            )
    return ParsedPipeline(spec=spec, deployment=deployment, platform=platform, kubernetes=kubernetes)


def parse_package(text: str, schema_versions: tuple[str, ...] = SCHEMA_VERSIONS) -> ParsedPipeline:
    """A compiled package: the PipelineSpec document, then optionally the PlatformSpec document."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise SpecError(f"pipeline package: not valid YAML: {str(e).splitlines()[0]}") from None
    if not docs or len(docs) > 2:
        raise SpecError(f"pipeline package: expected 1 or 2 YAML documents, found {len(docs)}")
    return parse_pipeline(docs[0], docs[1] if len(docs) == 2 else {}, schema_versions)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class KfpStandIn:
    """The server and what it has received. Use as a context manager, or start() and stop()."""

    # Spec schema versions this server accepts; narrow it to play an older API server.
    schema_versions: tuple[str, ...] = SCHEMA_VERSIONS
    experiments: dict[str, dict] = field(default_factory=dict)  # id → experiment
    runs: list[ReceivedRun] = field(default_factory=list)
    uploads: list[ReceivedUpload] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, message)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path) in arrival order
    unhandled: list[tuple[str, str]] = field(default_factory=list)
    # Plays the cluster: called on each GET of a run that has not ended, returns its state from then on.
    advance: Callable[[ReceivedRun], str] | None = None
    _server: ThreadingHTTPServer | None = None
    _port: int = 0
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def host(self) -> str:
        """The base URL for kfp.Client; still answers after stop(), for messages that name it."""
        assert self._port, "stand-in not started"
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> KfpStandIn:
        standin = self

        class Handler(_Handler):
            owner = standin

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kfp-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> KfpStandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def experiment_named(self, name: str) -> dict | None:
        return next((e for e in self.experiments.values() if e["display_name"] == name), None)

    # ---- route implementations: each returns the JSON response or raises SpecError

    def list_experiments(self, query: dict[str, list[str]]) -> dict:
        found = list(self.experiments.values())
        if "filter" in query:
            try:
                predicates = json.loads(query["filter"][0]).get("predicates", [])
            except (json.JSONDecodeError, AttributeError):
                raise SpecError(f"filter: not a JSON filter object: {query['filter'][0]!r}") from None
            for p in predicates:
                value = p.get("string_value", p.get("stringValue"))
                if (
                    p.get("operation") not in EQUALS
                    or p.get("key") not in ("display_name", "name")
                    or value is None
                ):
                    raise SpecError(
                        f"filter: the stand-in supports only display_name EQUALS <string>, got {p}"
                    )
                found = [e for e in found if e["display_name"] == value]
        return {"experiments": found, "total_size": len(found)} if found else {}

    def create_experiment(self, body: dict) -> dict:
        name = body.get("display_name")
        if not name:
            raise SpecError("experiment.display_name: required")
        if self.experiment_named(name):
            raise SpecError(f"experiment.display_name: an experiment named {name!r} already exists")
        experiment = {
            "experiment_id": str(uuid.uuid4()),
            "display_name": name,
            "description": body.get("description") or "",
            "namespace": body.get("namespace") or "",
            "created_at": _now(),
            "storage_state": "AVAILABLE",
        }
        self.experiments[experiment["experiment_id"]] = experiment
        return experiment

    def create_run(self, body: dict) -> dict:
        if body.get("experiment_id") not in self.experiments:
            raise SpecError(f"run.experiment_id: no experiment {body.get('experiment_id')!r}")
        if not body.get("display_name"):
            raise SpecError("run.display_name: required")
        doc = body.get("pipeline_spec")
        if doc is None:
            raise SpecError("run.pipeline_spec: required (the stand-in holds no pipeline versions)")
        # kfp.Client sends the bare PipelineSpec, or {pipeline_spec, platform_spec} when there is one.
        if isinstance(doc, dict) and "pipeline_spec" in doc:
            pipeline = parse_pipeline(doc["pipeline_spec"], doc.get("platform_spec"), self.schema_versions)
        else:
            pipeline = parse_pipeline(doc, {}, self.schema_versions)
        runtime = body.get("runtime_config") or {}
        declared = set(pipeline.spec.root.input_definitions.parameters)
        for key in runtime.get("parameters") or {}:
            if key not in declared:
                raise SpecError(
                    f"run.runtime_config.parameters: {key!r} is not a pipeline input {sorted(declared)}"
                )
        run = {
            "run_id": str(uuid.uuid4()),
            "experiment_id": body["experiment_id"],
            "display_name": body["display_name"],
            "runtime_config": runtime,
            "service_account": body.get("service_account") or "",
            "storage_state": "AVAILABLE",
            "state": "PENDING",
            "created_at": _now(),
        }
        self.runs.append(ReceivedRun(body=body, pipeline=pipeline, response=run))
        return run

    def get_run(self, run_id: str) -> dict:
        for r in self.runs:
            if r.response["run_id"] == run_id:
                if self.advance is not None and r.response["state"] not in ENDED:
                    state = self.advance(r)
                    if state not in RUN_STATES:
                        raise AssertionError(f"advance returned {state!r}, not a run state {RUN_STATES}")
                    r.response["state"] = state
                    if state in ENDED:
                        r.response["finished_at"] = _now()
                return r.response
        raise KeyError(run_id)

    def upload_pipeline(self, query: dict[str, list[str]], content_type: str, data: bytes) -> dict:
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + data
        )
        if not message.is_multipart():
            raise SpecError(f"upload: expected multipart/form-data, got {content_type!r}")
        part = next(
            (
                p
                for p in message.iter_parts()
                if p.get_param("name", header="content-disposition") == "uploadfile"
            ),
            None,
        )
        if part is None:
            raise SpecError("upload: no `uploadfile` part")
        pipeline = parse_package(part.get_payload(decode=True).decode(), self.schema_versions)
        name = (query.get("name") or query.get("display_name") or [pipeline.spec.pipeline_info.name])[0]
        if any(u.name == name for u in self.uploads):
            raise SpecError(f"upload: a pipeline named {name!r} already exists")
        response = {
            "pipeline_id": str(uuid.uuid4()),
            "display_name": name,
            "name": name,
            "description": (query.get("description") or [""])[0],
            "created_at": _now(),
        }
        self.uploads.append(
            ReceivedUpload(
                name=name, filename=part.get_filename() or "", pipeline=pipeline, response=response
            )
        )
        return response


class _Handler(BaseHTTPRequestHandler):
    owner: KfpStandIn
    protocol_version = "HTTP/1.1"
    timeout = 30  # a stalled client cannot hold a handler thread forever

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass  # keep test output clean; `requests` records every call

    def _reply(self, status: HTTPStatus, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str) -> None:
        # grpc-gateway's error body, as the real API server sends it
        code = {HTTPStatus.BAD_REQUEST: 3, HTTPStatus.NOT_FOUND: 5}.get(status, 2)
        self._reply(status, {"error": message, "code": code, "message": message, "details": []})

    def _json(self, raw: bytes) -> dict:
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            raise SpecError(f"request body: not JSON: {e}") from None
        if not isinstance(body, dict):
            raise SpecError("request body: expected a JSON object")
        return body

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path, query = url.path, parse_qs(url.query)
        owner = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True  # the unread body would otherwise be taken for the next request
            self._error(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body of {length} bytes is over {MAX_BODY}"
            )
            return
        raw = self.rfile.read(length)  # read every body, so a kept-alive connection stays in step
        with owner._lock:
            owner.requests.append((method, path))
            try:
                result = self._route(method, path, query, raw)
            except SpecError as e:
                owner.rejected.append((path, str(e)))
                self._error(HTTPStatus.BAD_REQUEST, str(e))
                return
            except KeyError as e:
                self._error(HTTPStatus.NOT_FOUND, f"not found: {e.args[0]}")
                return
            if result is None:
                owner.unhandled.append((method, path))
                self._error(HTTPStatus.NOT_FOUND, f"the stand-in does not serve {method} {path}")
                return
        self._reply(HTTPStatus.OK, result)

    def _route(self, method: str, path: str, query: dict[str, list[str]], raw: bytes) -> dict | None:
        o = self.owner
        if method == "GET" and path == f"{API}/healthz":
            return {"multi_user": False, "pipeline_store": "database"}
        if path == f"{API}/experiments":
            if method == "GET":
                return o.list_experiments(query)
            if method == "POST":
                return o.create_experiment(self._json(raw))
        if method == "GET" and path.startswith(f"{API}/experiments/"):
            return o.experiments[path.removeprefix(f"{API}/experiments/")]
        if method == "POST" and path == f"{API}/runs":
            return o.create_run(self._json(raw))
        if method == "GET" and path.startswith(f"{API}/runs/"):
            return o.get_run(path.removeprefix(f"{API}/runs/"))
        if method == "POST" and path == f"{API}/pipelines/upload":
            return o.upload_pipeline(query, self.headers.get("Content-Type", ""), raw)
        return None

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")
