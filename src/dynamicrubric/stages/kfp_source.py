"""The KFP component of each declared stage, written from its declaration.

KFP builds a lightweight component from a function's source text (inspect.getsource) and its
annotations, so each stage's component is a real function: `component_source` writes its text from
the declaration and `component_functions` defines them all, registering the text with linecache
under COMPONENTS_FILE so that inspect.getsource (and a traceback) finds it, as for any module.
`python -m dynamicrubric.stages.kfp_source [STAGE]` prints the source.

The signature rules: every component takes `config` (the run's config, an artifact that the
start-tracking task writes: by reference, so that each task's executor input carries its URI and not
the 3-4 KB of YAML, which on a cluster every driver pod and node status would repeat), `run_name` and
`round_idx`; a param is
`name: int|str`; a model is `<name>_ref: str` (the reference) plus `<name>_ckpt: Input[Model] = None`
(an earlier round's checkpoint, which wins); an input is `Input[Dataset]` (`Input[List[Dataset]]`
for shards, `= None` when optional); an output is `Output[<kfp_type>]` under its own name, and a
model output (`kfp_type="Model"`) also gives its URI as the output parameter `<name>_uri`.

A training stage has a second component, `<stage>_on_nodes`, for a stage trained on several nodes
(`num_nodes` > 1): its task only submits and follows the TrainJob, whose nodes read the models from the
store themselves, so a model is `<name>_ckpt_uri: str = ""` (an earlier round's checkpoint by its
producer's `<name>_uri` output, which wins over the reference) instead of `<name>_ckpt: Input[Model]`.
KFP's launcher downloads every input artifact into the task's pod before the task starts (launcher_v2.go
downloadArtifacts; kfp has no per-input opt-out), which for this task was two 16 GB checkpoints it never
reads. The trade-off: KFP's lineage graph shows those checkpoints as the producing task's parameter, not
as the training task's input artifacts; the task still runs after its producer, and its MLflow run
records every model it trained from by URI (runner.log_lineage), as every stage's does.
"""

from __future__ import annotations

import linecache
import sys
from collections.abc import Callable

from dynamicrubric.stages.declarations import STAGES
from dynamicrubric.stages.spec import Stage

COMPONENTS_FILE = "<dynamicrubric stage components>"
ON_NODES = "_on_nodes"  # the suffix of a training stage's component for several nodes
TRAINED_ON_NODES = ("train_policy", "train_evaluator")  # the stages that have one


def component_source(stage: Stage, on_nodes: bool = False) -> str:
    """The KFP component function of one declared stage (with `on_nodes`, its variant for a TrainJob)."""
    required = ["config: Input[Artifact]", "run_name: str", "round_idx: int"]
    optional: list[str] = []
    values: list[str] = []
    for p in stage.params:
        required.append(f"{p.name}: {p.type.__name__}")
        values.append(f"{p.name}={p.name}")
    for m in stage.models:
        (required if m.default_from else optional).append(
            f"{m.name}_ref: str" + ("" if m.default_from else ' = ""')
        )
        if on_nodes:
            optional.append(f'{m.name}_ckpt_uri: str = ""')
            values.append(f"{m.name}={m.name}_ckpt_uri or {m.name}_ref")
        else:
            optional.append(f"{m.name}_ckpt: Input[Model] = None")
            values.append(f"{m.name}={m.name}_ckpt.path if {m.name}_ckpt is not None else {m.name}_ref")
    for d in stage.inputs:
        kind = f"Input[List[{d.kfp_type}]]" if d.shards else f"Input[{d.kfp_type}]"
        (optional if d.optional else required).append(f"{d.name}: {kind}" + (" = None" if d.optional else ""))
        if d.shards:
            paths = f"[a.path for a in {d.name}]"
            values.append(f"{d.name}={paths} if {d.name} else []" if d.optional else f"{d.name}={paths}")
        else:
            path = f"{d.name}.path"
            values.append(
                f'{d.name}={path} if {d.name} is not None else ""' if d.optional else f"{d.name}={path}"
            )
    models_out = [d.name for d in stage.outputs if d.kfp_type == "Model"]
    for d in stage.outputs:
        required.append(f"{d.name}: Output[{d.kfp_type}]")
        values.append(f"out_{d.name}={d.name}.path")
    required += [f"{name}_uri: OutputPath(str)" for name in models_out]
    if stage.kfp_summary:
        required.append("summary: Output[Metrics]")
    returns = " -> float" if stage.kfp_returns else ""
    name = stage.name + (ON_NODES if on_nodes else "")
    lines = [f"def {name}(", *(f"    {a}," for a in required + optional), f"){returns}:"]
    lines.append(f'    """{stage.help[0].upper()}{stage.help[1:]}."""')
    lines.append("    from dynamicrubric.stages.runner import run_task")
    if stage.kfp_summary:
        lines[-1] += ", write_kfp_metrics"
    lines.append("")
    call = (
        f'run_task(\n        "{stage.name}",\n        config.path,\n        run_name,\n        round_idx,\n'
    )
    call += "".join(f"        {v},\n" for v in values) + "    )"
    lines.append(f"    result = {call}" if stage.kfp_summary or stage.kfp_returns else f"    {call}")
    if stage.kfp_summary:
        lines.append("    write_kfp_metrics(summary, result)")
    if models_out:  # as the store names it (a minio:// root's URI is s3://), for the tasks that take it
        lines.append("    from dynamicrubric.infra.tracking import artifact_uri\n")
    for out in models_out:
        lines.append(f'    with open({out}_uri, "w") as f:\n        f.write(artifact_uri({out}.uri))')
    if stage.kfp_returns:
        lines.append(f'    return float(result.get("{stage.kfp_returns}", 0.0))')
    return "\n".join(lines) + "\n"


def component_functions() -> dict[str, Callable]:
    """Every declared stage's component function, by stage name; a training stage's for several nodes
    by its name and ON_NODES."""

    from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output, OutputPath

    variants = [component_source(STAGES[s], on_nodes=True) for s in TRAINED_ON_NODES if s in STAGES]
    source = "\n\n".join([*(component_source(s) for s in STAGES.values()), *variants])
    lines = source.splitlines(keepends=True)
    linecache.cache[COMPONENTS_FILE] = (len(source), None, lines, COMPONENTS_FILE)  # no mtime: kept
    namespace = {
        "__name__": __name__,  # inspect finds the module (it has a loader) and then the text above
        **{"List": list, "Artifact": Artifact, "Dataset": Dataset, "Input": Input},
        **{"Metrics": Metrics, "Model": Model, "Output": Output, "OutputPath": OutputPath},
    }
    # dont_inherit: this module's `from __future__ import annotations` would make KFP's annotations strings
    exec(compile(source, COMPONENTS_FILE, "exec", dont_inherit=True), namespace)
    names = [*STAGES, *(s + ON_NODES for s in TRAINED_ON_NODES if s in STAGES)]
    return {name: namespace[name] for name in names}


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(STAGES)
    print("\n\n".join(component_source(STAGES[n.replace("-", "_")]) for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
