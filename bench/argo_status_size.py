"""Estimate the size of a run's Argo Workflow object for r rounds per run, from a compiled package.

No Go toolchain here to run KFP's own argocompiler, so this models what it and Argo's packer write
(KFP 2.17's argocompiler, Argo v4.0.5's workflow/packer; docs/deploy.md, "How many rounds a run
holds"): the Workflow spec is about the package's size (components stored once), and every task at
run time adds three status nodes (driver, executor, impl pod), each carrying its resolved inputs:

- driver: the task's component JSON, task JSON, container JSON (its command holds the Python
  source) and kubernetes platform config as input parameters; its output `pod-spec-patch`;
- executor and impl pod: `pod-spec-patch` as input: the container (command, source, args with the
  executor input filled in: every input and output artifact with its s3:// URI) as escaped JSON.

Each node also gets ~600 B of bookkeeping (id, names, phase, times, children). A loop's tasks run
once per item (pipeline.shards); each loop and iteration adds a DAG driver and a DAG node carrying the
loop's component JSON. Compressed: what Argo stores in `status.compressedNodes`, base64 of gzip of
the nodes' JSON (Go's default level 6; zlib's level 6 here), keyed by random node ids as Argo's are.

    .venv/bin/python -m bench.argo_status_size [--preset paper] [--rounds 1 2 3 4 5 6]
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import random
import tempfile
import uuid
from pathlib import Path

import yaml

from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.pipelines.co_evolution import compile_pipeline

NODE_BOOKKEEPING = 600  # bytes: id, name, displayName, type, templateName, phase, times, children, ...
MIB = 2**20


def _uri(run: str, task: str, name: str) -> str:
    return f"s3://pipelines/dynamicrubric/co-evolution/{run}/{task}/{uuid.uuid4()}/{name}"


def _executor_input(run: str, task_name: str, task: dict, comp: dict, fan_in: int) -> dict:
    """What the driver resolves into the container's --executor_input: inputs with URIs, outputs."""
    artifacts = {}
    for name, art in (comp.get("inputDefinitions", {}).get("artifacts") or {}).items():
        count = fan_in if art.get("isArtifactList") else 1
        artifacts[name] = {
            "artifacts": [
                {
                    "name": f"{uuid.uuid4()}",
                    "type": art.get("artifactType", {}),
                    "uri": _uri(run, "producer-task", name),
                    "metadata": {"display_name": name},
                }
                for _ in range(count)
            ]
        }
    params = {n: "x" * 40 for n in (comp.get("inputDefinitions", {}).get("parameters") or {})}
    outputs = {
        name: {"artifacts": [{"type": art.get("artifactType", {}), "uri": _uri(run, task_name, name)}]}
        for name, art in (comp.get("outputDefinitions", {}).get("artifacts") or {}).items()
    }
    return {
        "inputs": {"artifacts": artifacts, "parameterValues": params},
        "outputs": {"artifacts": outputs, "outputFile": "/tmp/kfp_outputs/output_metadata.json"},
    }


def _node(inputs: dict, outputs: dict | None = None) -> dict:
    node = {"inputs": {"parameters": [{"name": k, "value": v} for k, v in inputs.items()]}}
    if outputs:
        node["outputs"] = {"parameters": [{"name": k, "value": v} for k, v in outputs.items()]}
    node["_bookkeeping"] = "b" * NODE_BOOKKEEPING
    return node


def status_nodes(package: str, fan_in: int) -> dict[str, dict]:
    """The modelled `status.nodes` of one run of `package` (every task run once)."""
    docs = list(yaml.safe_load_all(Path(package).read_text()))
    spec, platform = docs[0], (docs[1] if len(docs) > 1 else {})
    comps, execs = spec["components"], spec["deploymentSpec"]["executors"]
    k8s = platform.get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {})
    run = str(uuid.uuid4())
    nodes: dict[str, dict] = {}
    rng = random.Random(0)

    def add(node: dict) -> None:
        nodes[f"co-evolution-{rng.getrandbits(40):x}-{rng.getrandbits(32)}"] = node

    def walk(dag: dict, times: int) -> None:
        for name, task in dag["tasks"].items():
            comp = comps[task["componentRef"]["name"]]
            items = 1
            if "parameterIterator" in task:
                items = len(json.loads(task["parameterIterator"]["items"]["raw"]))
            if "dag" in comp:
                for _ in range(times):
                    driver = {"component": json.dumps(comp), "task": json.dumps(task)}
                    add(_node(driver))  # the loop's DAG driver
                    add(_node({}))  # the loop's DAG node
                    for _ in range(items if items > 1 else 0):  # each iteration: driver + DAG node
                        add(_node(driver))
                        add(_node({}))
                walk(comp["dag"], times * items)
                continue
            label = comp["executorLabel"]
            container = json.dumps(execs[label]["container"])
            for _ in range(times):
                executor_input = json.dumps(_executor_input(run, name, task, comp, fan_in))
                patch = json.dumps(
                    {"containers": [{"name": "main", **execs[label]["container"], "args": [executor_input]}]}
                )
                driver_in = {
                    "component": json.dumps(comp),
                    "task": json.dumps(task),
                    "container": container,
                    "kubernetes-config": json.dumps(k8s.get(label, {})),
                    "parent-dag-id": "1234567890",
                    "iteration-index": "0",
                }
                add(_node(driver_in, {"pod-spec-patch": patch, "cached-decision": "false", "condition": ""}))
                add(_node({"pod-spec-patch": patch, "cached-decision": "false"}))  # executor
                add(_node({"pod-spec-patch": patch}))  # impl pod

    walk(spec["root"]["dag"], 1)
    return nodes


def estimate(preset: str, rounds: int) -> dict:
    cfg = load_config(preset=preset, overrides={"pipeline": {"rounds": rounds + 1}})
    with tempfile.TemporaryDirectory() as tmp:
        first = 2  # a later segment of a chain: it has the start parameters
        package = compile_pipeline(cfg, f"{tmp}/p.yaml", first, first + rounds - 1)
        package_bytes = Path(package).stat().st_size
        spec_json = sum(len(json.dumps(doc)) for doc in yaml.safe_load_all(Path(package).read_text()))
        nodes = status_nodes(package, cfg.pipeline.shards)
    raw = json.dumps(dict(sorted(nodes.items()))).encode()  # Go marshals a map in key order
    compressed = base64.b64encode(gzip.compress(raw, compresslevel=6))
    tasks = sum(1 for n in nodes.values() if n.get("outputs"))  # one driver with outputs a task
    return {
        "rounds": rounds,
        "package_kib": round(package_bytes / 1024, 1),
        "spec_json_kib": round(spec_json / 1024, 1),
        "status_nodes": len(nodes),
        "status_mib": round(len(raw) / MIB, 3),
        "compressed_status_kib": round(len(compressed) / 1024, 1),
        "tasks": tasks,
        "total_uncompressed_mib": round((package_bytes + len(raw)) / MIB, 3),
        "total_compressed_mib": round((package_bytes + len(compressed)) / MIB, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--rounds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    args = parser.parse_args()
    for r in args.rounds:
        print(json.dumps(estimate(args.preset, r)), flush=True)


if __name__ == "__main__":
    main()
