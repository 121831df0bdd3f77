"""The cluster-side isolation for pods that run policy-generated code (manifests/cluster/gvisor).

The objects render with kustomize and validate strictly against the Kubernetes 1.32 schemas; the
policies select exactly the pods the pipeline labels; the pipeline labels exactly the CPU stages that
run code in the sandbox (never a GPU task: gVisor would pin it to gVisor nodes, which a normal GPU pool
lacks); and the mutation and the validation agree on the RuntimeClass's name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from test_manifests import MANIFESTS, kustomize, schema_errors

from dynamicrubric.infra.config import STAGE_FACTS
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.pipelines.co_evolution import compile_pipeline
from dynamicrubric.pipelines.task_settings import RUNS_CODE_LABEL, runs_in_gvisor

GVISOR = MANIFESTS / "cluster" / "gvisor"


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    return {obj["kind"]: obj for obj in kustomize(GVISOR)}


CODE_STAGES = {s for s, facts in STAGE_FACTS.items() if facts.runs_code}


def test_the_gvisor_objects_are_valid(objects):
    assert set(objects) == {
        "RuntimeClass",
        "MutatingAdmissionPolicy",
        "MutatingAdmissionPolicyBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    assert schema_errors(list(objects.values())) == []


def test_a_typo_in_a_policy_is_caught(objects):
    broken = yaml.safe_load(yaml.safe_dump(objects["ValidatingAdmissionPolicy"]))
    broken["spec"]["validation"] = broken["spec"].pop("validations")  # unknown field
    assert schema_errors([broken])


def test_the_policies_select_the_pods_the_pipeline_labels(objects):
    key, value = RUNS_CODE_LABEL
    for kind in ("MutatingAdmissionPolicy", "ValidatingAdmissionPolicy"):
        constraints = objects[kind]["spec"]["matchConstraints"]
        assert constraints["objectSelector"] == {"matchLabels": {key: value}}, kind
        assert constraints["resourceRules"][0]["resources"] == ["pods"]
    for kind in ("MutatingAdmissionPolicyBinding", "ValidatingAdmissionPolicyBinding"):
        binding = objects[kind]["spec"]
        assert binding["policyName"] == objects[kind.removesuffix("Binding")]["metadata"]["name"]
    assert objects["ValidatingAdmissionPolicyBinding"]["spec"]["validationActions"] == ["Deny"]


def test_mutation_and_validation_name_the_runtime_class(objects):
    name = objects["RuntimeClass"]["metadata"]["name"]
    assert objects["RuntimeClass"]["handler"] == "runsc"
    mutation = objects["MutatingAdmissionPolicy"]["spec"]["mutations"][0]["applyConfiguration"]["expression"]
    assert re.search(rf'runtimeClassName:\s*"{name}"', mutation)
    validation = objects["ValidatingAdmissionPolicy"]["spec"]["validations"][0]["expression"]
    assert f'object.spec.runtimeClassName == "{name}"' in validation


def test_the_pipeline_labels_exactly_the_stages_that_run_code(tmp_path: Path):
    out = compile_pipeline(load_config(overrides={"pipeline": {"rounds": 1}}), str(tmp_path / "p.yaml"))
    _spec, platform = yaml.safe_load_all(Path(out).read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    key, value = RUNS_CODE_LABEL
    labelled, present = set(), set()
    for name, config in executors.items():
        stage = re.sub(r"-\d+$", "", name.removeprefix("exec-")).replace("-", "_")
        present.add(stage)
        if config.get("podMetadata", {}).get("labels", {}).get(key) == value:
            labelled.add(stage)
        else:
            assert stage not in CODE_STAGES, name
    # on CPU evaluate is one task that checks its samples itself: no check-samples task
    assert labelled == CODE_STAGES - {"check_samples"} and "check_samples" not in present


def _executors(out: str) -> tuple[dict, dict]:
    """The compiled package's executors: container specs and their Kubernetes settings."""
    spec, platform = yaml.safe_load_all(Path(out).read_text())
    return spec["deploymentSpec"]["executors"], platform["platforms"]["kubernetes"]["deploymentSpec"][
        "executors"
    ]


def test_no_gpu_task_is_sent_to_gvisor_nodes(tmp_path: Path):
    """The paper preset's GPU tasks (train-policy and evaluate run code) must schedule on a normal GPU
    pool: no runs-code label (the policies would set the gVisor RuntimeClass, whose scheduling pins the
    pod to gVisor nodes) and no gVisor node selector or toleration; a CPU code stage keeps the label."""
    cfg = load_config(preset="paper")
    out = compile_pipeline(cfg, str(tmp_path / "p.yaml"))
    containers, k8s = _executors(out)
    key, value = RUNS_CODE_LABEL
    runtime = yaml.safe_load((GVISOR / "runtimeclass.yaml").read_text())["scheduling"]
    gvisor_keys = set(runtime["nodeSelector"]) | {t["key"] for t in runtime["tolerations"]}
    gpu_code_tasks = labelled = 0
    for name, container in containers.items():
        stage = re.sub(r"-\d+$", "", name.removeprefix("exec-")).replace("-", "_")
        pod = k8s.get(name, {})
        has_label = pod.get("podMetadata", {}).get("labels", {}).get(key) == value
        if container["container"].get("resources", {}).get("accelerator"):
            gpu_code_tasks += stage in CODE_STAGES
            assert not has_label, name
            assert not gvisor_keys & set(pod.get("nodeSelector", {}).get("labels", {})), name
            assert not gvisor_keys & {t.get("key") for t in pod.get("tolerations", [])}, name
        elif stage in CODE_STAGES:
            labelled += 1
            assert has_label, name
    assert gpu_code_tasks == 2 * cfg.pipeline.rounds  # train-policy and evaluate each round
    assert labelled > 0  # candidates, aggregate and check-samples run under gVisor
    assert {s for s in CODE_STAGES if runs_in_gvisor(cfg, s)} == {"candidates", "aggregate", "check_samples"}


def test_on_gpus_the_policy_code_of_evaluate_runs_in_a_cpu_task(tmp_path: Path):
    """The paper preset's evaluate is evaluate-samples (GPU) → check-samples (CPU image, gVisor label)
    → evaluate (GPU, handed the samples and their outcomes, not the policy's weights)."""
    cfg = load_config(preset="paper", overrides={"pipeline": {"rounds": 1}})
    out = compile_pipeline(cfg, str(tmp_path / "p.yaml"))
    containers, k8s = _executors(out)
    spec = next(yaml.safe_load_all(Path(out).read_text()))
    key, value = RUNS_CODE_LABEL
    tasks = {t["taskInfo"]["name"]: t for t in spec["root"]["dag"]["tasks"].values()}
    sample, check, evaluate = (tasks[f"r1-{n}"] for n in ("evaluate-samples", "check-samples", "evaluate"))

    def gpus(task):
        return containers[task["componentRef"]["name"].replace("comp-", "exec-")]["container"].get(
            "resources", {}
        )

    assert gpus(sample).get("accelerator") and gpus(evaluate).get("accelerator")
    assert not gpus(check).get("accelerator")
    check_exec = check["componentRef"]["name"].replace("comp-", "exec-")
    assert containers[check_exec]["container"]["image"] == cfg.pipeline.cpu_image
    assert k8s[check_exec]["podMetadata"]["labels"][key] == value
    assert set(evaluate["inputs"]["artifacts"]) >= {"samples", "outcomes"}
    assert not {"policy", "previous_policy"} & set(evaluate["inputs"]["artifacts"])
    assert check["inputs"]["artifacts"]["samples"]["taskOutputArtifact"]["producerTask"] == "evaluate-samples"
