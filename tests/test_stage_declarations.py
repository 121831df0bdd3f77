"""A stage is declared once (src/dynamicrubric/stages/declarations.py); its KFP component, its CLI
flags, its MLflow run and its `--from-run` rerun all follow from the declaration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from kfp import dsl

from dynamicrubric import cli
from dynamicrubric.infra import tracking
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import STAGE_FACTS
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.stages import kfp_source
from dynamicrubric.stages.data_stages import ROLLOUT
from dynamicrubric.stages.declarations import STAGES
from dynamicrubric.stages.rerun import rerun
from dynamicrubric.stages.runner import execute, start_tracking
from dynamicrubric.stages.spec import Data, Param, Stage

REPO = Path(__file__).resolve().parents[1]


def test_a_component_is_its_declaration_written_out():
    """The rollout component: what KFP reads from it (inputs, outputs, the source it runs) follows the
    declaration's rules, and its source is what inspect finds."""
    import inspect

    from dynamicrubric.components import stages as components

    component = dsl.component(
        components.component_functions()["rollout"], base_image="python:3.11", install_kfp_package=False
    )
    spec = component.component_spec
    assert set(spec.inputs) == {
        "config", "run_name", "round_idx", "label", "shard", "num_shards", "seed",
        "policy_ref", "policy_ckpt", "prompts",
    }  # fmt: skip
    assert spec.inputs["policy_ckpt"].optional and not spec.inputs["prompts"].optional
    assert set(spec.outputs) == {"rollouts"}
    command = "".join(spec.implementation.container.command)
    assert "run_task(" in command and "out_rollouts=rollouts.path" in command
    assert inspect.getsource(components.component_functions()["rollout"]) == kfp_source.component_source(
        ROLLOUT
    )


def test_every_declared_stage_has_one_row_of_facts_and_a_component():
    from dynamicrubric.components import stages as components

    assert set(STAGES) <= set(STAGE_FACTS)
    assert set(STAGE_FACTS) == {f.__name__.removesuffix(kfp_source.ON_NODES) for f in components.STAGES}


# ---- a parameter added to a declaration reaches the component, the CLI, MLflow and --from-run


def _tagged(cfg, round_idx: int, *, label: str, tag: int, prompts: str, out_tagged: str) -> dict:
    """The test stage's work: the prompts with `tag` appended, so the output shows the value arrived."""
    frame = read_frame(prompts, "prompts")
    frame["prompt"] = frame["prompt"] + f" #{tag}"
    write_artifact(out_tagged, "prompts", frame)
    return {"tag": tag}


TAGGED = Stage(
    "tagged",
    "a test stage",
    _tagged,
    lambda v: f"{v['label']}-tagged",
    params=(Param("label", str, "which use", "test"),),
    inputs=(Data("prompts", "prompts", "prompts artifact"),),
    outputs=(Data("tagged", "prompts", "prompts artifact to write"),),
)
# The one edit: a parameter added to the declaration.
WITH_TAG = dataclasses.replace(TAGGED, params=(*TAGGED.params, Param("tag", int, "a number to append")))


@pytest.fixture
def declared(monkeypatch):
    monkeypatch.setitem(STAGES, WITH_TAG.name, WITH_TAG)
    return WITH_TAG


def test_an_added_param_reaches_the_component(declared):
    function = kfp_source.component_functions()["tagged"]
    component = dsl.component(function, base_image="python:3.11", install_kfp_package=False)
    assert component.component_spec.inputs["tag"].type == "Integer"
    assert "tag=tag" in "".join(component.component_spec.implementation.container.command)


def test_an_added_param_reaches_the_cli(declared, tmp_path):
    parser = cli.build_parser()
    args = parser.parse_args(["stage", "tagged", "--prompts", "p", "--out", "o", "--tag", "7"])
    assert args.tag == 7 and args.stage_name == "tagged"
    with pytest.raises(SystemExit):
        parser.parse_args(["stage", "tagged", "--prompts", "p", "--out", "o", "--tag", "seven"])


@pytest.fixture
def tagged_run(declared, tmp_path) -> dict:
    """The test stage run once with MLflow (sqlite): its tracking URI, output and MLflow run."""
    import mlflow

    from dynamicrubric import tasks

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, preset="tiny", overrides={"pipeline": {"mlflow_tracking_uri": uri, "rounds": 1}})
    prompts, out = str(tmp_path / "prompts.parquet"), str(tmp_path / "tagged.parquet")
    write_artifact(prompts, "prompts", tasks.configured_prompts(cfg.data, "train"))
    start_tracking(cfg.to_yaml(), "declared")
    execute(declared, cfg, "declared", 1, {"label": "a", "tag": 7, "prompts": prompts, "out_tagged": out})
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(cfg.pipeline.experiment).experiment_id
    (run,) = client.search_runs([experiment], f"tags.`{tracking.STAGE_TAG}` = 'a-tagged'")
    return {"uri": uri, "out": out, "run": run}


def test_an_added_param_reaches_mlflow_and_from_run(tagged_run, tmp_path):
    run = tagged_run["run"]
    assert run.data.params["tag"] == "7"

    again = str(tmp_path / "again.parquet")
    assert rerun("tagged", tagged_run["uri"], run.info.run_id, None, {"out_tagged": again}) == {"tag": 7}
    assert Path(again).read_bytes() == Path(tagged_run["out"]).read_bytes()
    assert read_frame(again, "prompts")["prompt"].str.endswith(" #7").all()


def test_a_declaration_refuses_two_things_of_one_name():
    with pytest.raises(ValueError, match="prompts"):
        dataclasses.replace(TAGGED, outputs=(Data("prompts", "prompts", "the same name as the input"),))


def test_a_rerun_refuses_a_task_of_another_stage(tagged_run, tmp_path):
    from dynamicrubric.stages.rerun import RerunError

    with pytest.raises(RerunError, match="a tagged task, not rollout"):
        rerun(ROLLOUT.name, tagged_run["uri"], tagged_run["run"].info.run_id, None,
              {"out_rollouts": str(tmp_path / "r.parquet")})  # fmt: skip


def test_the_gpu_split_of_evaluate_reruns_byte_for_byte(tmp_path):
    """evaluate-samples and check-samples (the tasks a GPU pipeline splits evaluate into; the tiny run
    has none) rerun from their MLflow runs into the same bytes."""
    import mlflow

    from dynamicrubric.tasks import load_prompts

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, preset="tiny", overrides={"pipeline": {"mlflow_tracking_uri": uri, "rounds": 1}})
    prompts = str(tmp_path / "eval.parquet")
    write_artifact(prompts, "prompts", load_prompts(["reasoning_gym:basic_arithmetic"], 2, "eval", 0))
    start_tracking(cfg.to_yaml(), "split")
    samples, outcomes = str(tmp_path / "samples.parquet"), str(tmp_path / "outcomes.parquet")
    values = {"policy": "tiny-random", "previous_policy": "tiny-random", "eval_prompts": prompts}
    execute(STAGES["evaluate_samples"], cfg, "split", 1, {**values, "out_samples": samples})
    execute(
        STAGES["check_samples"],
        cfg,
        "split",
        1,
        {"eval_prompts": prompts, "samples": samples, "out_outcomes": outcomes},
    )

    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(cfg.pipeline.experiment).experiment_id
    for stage, task, out, written in (
        ("evaluate_samples", "evaluate-samples", "out_samples", samples),
        ("check_samples", "check-samples", "out_outcomes", outcomes),
    ):
        (run,) = client.search_runs([experiment], f"tags.`{tracking.STAGE_TAG}` = '{task}'")
        again = str(tmp_path / f"again-{stage}.parquet")
        rerun(stage, uri, run.info.run_id, None, {out: again})
        assert Path(again).read_bytes() == Path(written).read_bytes(), stage
