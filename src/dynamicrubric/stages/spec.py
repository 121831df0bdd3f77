"""What a stage declaration is made of: its parameters, the models it loads, the artifacts it reads
and writes, and the function that does the work.

Everything else about a stage is derived from its declaration (stages/declarations.py): the KFP
component's signature (components/stages.py is generated from it), the `dynrubric stage` flags, the
parameters and datasets its MLflow run logs, and how `--from-run` reruns it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

NO_DEFAULT = object()


@dataclass(frozen=True)
class Param:
    """A value that is not an artifact: a seed, a shard index, a label. Logged to MLflow; a rerun
    takes it from there."""

    name: str
    type: type  # int or str
    help: str
    default: Any = NO_DEFAULT  # the CLI's default; none: the flag is required
    # An int's range, checked wherever the value comes from (flag, KFP, rerun): a seed numpy cannot
    # take, or a count of 0 that would be read as "not given", is refused before any model loads.
    bounds: tuple[int, int] | None = None

    @property
    def required(self) -> bool:
        return self.default is NO_DEFAULT


@dataclass(frozen=True)
class ModelParam:
    """A model the stage loads: a reference string (built-in name, hub id, folder, s3://) which the
    pipeline may override with a checkpoint artifact of an earlier round (`<name>_ckpt`). Logged to
    MLflow as the reference a rerun can load (model_references.model_reference)."""

    name: str  # policy | generator | verifier | previous_policy
    help: str
    default_from: str | None = None  # the config's models.<role> when not given; None: optional, ""


@dataclass(frozen=True)
class Data:
    """An artifact the stage reads or writes: a Parquet file of `kind` (artifacts.py), or a folder."""

    name: str
    kind: str  # an artifact kind, or "model" / "reference" / "folder" for folders
    help: str
    shards: bool = False  # one per shard (a list)
    optional: bool = False
    kfp_type: str = "Dataset"  # Dataset | Model | Artifact

    @property
    def folder(self) -> bool:
        return self.kind in ("model", "reference", "folder")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage, declared once.

    `run(cfg, round_idx, **values)` does the work (values: every param, model and artifact by name;
    artifacts as URIs, lists for shards, "" for an absent optional one) and returns the numbers of the
    task's log line. `task_name(values)` names the task's MLflow run ("audit-rollout-1"). `lineage`
    logs what the declaration cannot say (a model registered, plots, per-step metrics).
    """

    name: str  # as KFP and config keys spell it: train_policy
    help: str
    run: Callable[..., dict]
    task_name: Callable[[dict], str]
    params: tuple[Param, ...] = ()
    models: tuple[ModelParam, ...] = ()
    inputs: tuple[Data, ...] = ()
    outputs: tuple[Data, ...] = ()
    lineage: Callable[..., None] | None = None  # (stage_run, run_name, round_idx, values, result)
    kfp_summary: bool = False  # also writes a KFP Metrics output `summary` for the KFP UI
    kfp_returns: str | None = None  # a number of the result the pipeline reads (e.g. tie_rate)
    check: Callable[[dict], None] | None = None  # refuses bad values before anything is read
    notes: tuple[str, ...] = field(default=())  # lines for the component's docstring

    def __post_init__(self) -> None:
        # They share one namespace: the KFP component's arguments (a model is `<name>_ref`, `<name>_ckpt`).
        names = [p.name for p in self.params] + [d.name for d in (*self.inputs, *self.outputs)]
        names += [f"{m.name}_{end}" for m in self.models for end in ("ref", "ckpt")]
        reserved = {"config", "run_name", "round_idx", "summary"}
        clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & reserved))
        if clash:
            raise ValueError(f"stage {self.name}: {clash[0]!r} names two things (or a reserved argument)")

    @property
    def command(self) -> str:
        """The name as the CLI and MLflow spell it: train-policy."""
        return self.name.replace("_", "-")

    def output_flag(self, data: Data) -> str:
        """`--out` for a stage's only output, `--out-<name>` where there are several."""
        return "--out" if len(self.outputs) == 1 else "--out-" + data.name.replace("_", "-")
