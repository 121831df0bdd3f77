"""The whole pipeline under kfp.local on tiny-random: crash in round 2, resume, lineage in MLflow.

One scenario, because each run costs minutes of CPU: a real `dynrubric run` process is killed while
round 2 runs; the rerun reuses round 1 from the cache and finishes; a third run executes nothing.
The MLflow store is then queried for the run tree, every stage's inputs and one model per checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dynamicrubric import store
from dynamicrubric.infra import tracking, tracking_runs
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.localrun.round_table import round_table
from dynamicrubric.pipelines.run_plan import default_run_name


def _stage_runs(client, experiment_id: str) -> list:
    runs = client.search_runs([experiment_id], max_results=5000)
    return [
        r for r in runs if tracking.STAGE_TAG in r.data.tags and r.data.tags[tracking.STAGE_TAG] != "pipeline"
    ]


def _run(workdir: Path, config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dynamicrubric.cli", "run", "--config", str(config)],
        cwd=workdir,
        stdout=open(workdir / f"run-{time.monotonic_ns()}.log", "wb"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """Run the tiny pipeline to completion through a crash and a resume; return what the test needs."""
    import mlflow

    workdir = tmp_path_factory.mktemp("pipeline")
    config = workdir / "config.yaml"
    config.write_text(
        yaml.safe_dump({"preset": "tiny", "pipeline": {"pipeline_root": str(workdir / "runs")}})
    )
    cfg = load_config(config)
    os.chdir(workdir)  # the tiny preset's sqlite:///mlflow.db is relative to the working directory
    # An explicit client: mlflow.set_tracking_uri would export MLFLOW_TRACKING_URI to later tests.
    client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri(cfg))

    # 1. start a run and kill it (SIGKILL, the whole process group) once round 2 has begun
    proc = _run(workdir, config)
    deadline = time.monotonic() + 600
    round2_started = False
    while time.monotonic() < deadline and proc.poll() is None:
        experiment = (workdir / "mlflow.db").exists() and client.get_experiment_by_name(
            cfg.pipeline.experiment
        )
        if experiment:
            stages = _stage_runs(client, experiment.experiment_id)
            if any(r.data.tags.get(tracking.ROUND_TAG) == "2" for r in stages):
                round2_started = True
                break
        time.sleep(1)
    assert round2_started, f"round 2 never started (exit code {proc.poll()})"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    experiment_id = client.get_experiment_by_name(cfg.pipeline.experiment).experiment_id
    before_resume = _stage_runs(client, experiment_id)

    # 2. the rerun reuses round 1 and finishes round 2
    proc = _run(workdir, config)
    assert proc.wait(timeout=900) == 0, "the resumed run failed"
    after_resume = _stage_runs(client, experiment_id)

    # 3. everything is cached now: a third run executes no stage
    proc = _run(workdir, config)
    assert proc.wait(timeout=300) == 0
    after_cached = _stage_runs(client, experiment_id)
    return {
        "cfg": cfg,
        "client": client,
        "experiment_id": experiment_id,
        "before_resume": before_resume,
        "after_resume": after_resume,
        "after_cached": after_cached,
    }


def test_resume_reuses_round_one(pipeline_run):
    def round_runs(runs, t):
        return [r for r in runs if r.data.tags.get(tracking.ROUND_TAG) == str(t)]

    before, after = pipeline_run["before_resume"], pipeline_run["after_resume"]
    done_before = {r.info.run_id for r in round_runs(before, 1)}
    assert done_before, "round 1 had finished stages before the crash"
    assert done_before <= {r.info.run_id for r in round_runs(after, 1)}
    # no round-1 stage ran twice: what finished before the crash came from the cache
    names = [r.data.tags[tracking.STAGE_TAG] for r in round_runs(after, 1)]
    assert len(names) == len(set(names)), f"round-1 stages ran again: {sorted(names)}"
    assert "train-policy" in {r.data.tags[tracking.STAGE_TAG] for r in round_runs(after, 2)}


def test_cached_rerun_executes_nothing(pipeline_run):
    ids = {r.info.run_id for r in pipeline_run["after_cached"]}
    assert ids == {r.info.run_id for r in pipeline_run["after_resume"]}


def test_lineage_run_tree(pipeline_run):
    client, cfg = pipeline_run["client"], pipeline_run["cfg"]
    parent_id = tracking.find_pipeline_run(cfg, default_run_name(cfg))
    parent = client.get_run(parent_id)
    assert parent.data.params["rollout.k"] == "4"  # the whole config is logged as params
    rounds = client.search_runs([pipeline_run["experiment_id"]], f"tags.mlflow.parentRunId = '{parent_id}'")
    # the parent's children: one run per round, and the round-0 stage (prepare_data)
    by_round = {r.data.tags[tracking.ROUND_TAG]: r for r in rounds if tracking.STAGE_TAG not in r.data.tags}
    assert set(by_round) == {"1", "2"}
    for t, round_run in by_round.items():
        stages = client.search_runs(
            [pipeline_run["experiment_id"]], f"tags.mlflow.parentRunId = '{round_run.info.run_id}'"
        )
        names = {s.data.tags[tracking.STAGE_TAG] for s in stages}
        # the online round: P_{t-1}'s candidate sets, G_t trained online, the signal audit of G_{t-1}
        # and G_t on P_{t-1}'s probe samples, P_t trained online, evaluate
        expected = {
            "train-evaluator",
            "audit-before-aggregate",
            "audit-after-aggregate",
            "train-policy",
            "evaluate",
        }
        expected |= {
            f"{stage}-{shard}" for stage in ("generator-rollout", "generator-candidates") for shard in (0, 1)
        }
        expected |= {
            f"audit-{when}-{stage}-{shard}"
            for when in ("before", "after")
            for stage in ("rubrics", "judge")
            for shard in (0, 1)
        }
        expected |= {"audit-rollout-0", "audit-rollout-1"}
        assert expected <= names, f"round {t} lacks {expected - names}"
        # The SIGKILL can land while a task logs to MLflow: that run stays RUNNING, half-logged, and the
        # resumed pipeline ran the task again in a run of its own.
        finished = [s for s in stages if s.info.status == "FINISHED"]
        for s in stages:
            if s.info.status != "FINISHED":
                name = s.data.tags[tracking.STAGE_TAG]
                assert t == "2" and name in {f.data.tags[tracking.STAGE_TAG] for f in finished}, name
        for s in finished:  # every stage logged its artifacts as dataset inputs with their URIs
            # ... and the seconds its work took, which its run's span covers (it starts with the process)
            assert (s.info.end_time - s.info.start_time) / 1000 >= s.data.metrics["stage_wall_s"] > 0
            inputs = client.get_run(s.info.run_id).inputs.dataset_inputs
            assert inputs, f"stage {s.data.tags[tracking.STAGE_TAG]} logged no datasets"
            for d in inputs:  # ... whose source is the artifact itself
                assert store.exists(json.loads(d.dataset.source)["uri"]), d.dataset.source


def test_stage_runs_by_round_and_the_round_table(pipeline_run):
    cfg = pipeline_run["cfg"]
    parent_id = tracking.find_pipeline_run(cfg, default_run_name(cfg))
    by_round = tracking.stage_runs_by_round(cfg, parent_id)
    assert sorted(by_round) == [0, 1, 2]
    assert [r.data.tags[tracking.STAGE_TAG] for r in by_round[0]] == ["prepare-data"]
    for t in (1, 2):
        assert {r.data.tags[tracking.ROUND_TAG] for r in by_round[t]} == {str(t)}
        assert {"train-evaluator", "train-policy", "evaluate"} <= {
            r.data.tags[tracking.STAGE_TAG] for r in by_round[t]
        }
    # the table `dynrubric run` prints reads the same tree
    table = round_table(cfg, parent_id)
    assert [row["round"] for row in table] == [1, 2]
    for row in table:
        metrics = {r.data.tags[tracking.STAGE_TAG]: r.data.metrics for r in by_round[row["round"]]}
        assert row["tie_rate"] == metrics["audit-after-aggregate"]["tie_rate"]
        assert row["policy_acc"] == (
            metrics["evaluate"]["policy/accuracy"],
            int(metrics["evaluate"]["policy/samples"]),
        )


def test_lineage_models(pipeline_run):
    cfg = pipeline_run["cfg"]
    models = pipeline_run["client"].search_logged_models(
        experiment_ids=[pipeline_run["experiment_id"]],
        filter_string=f"tags.`{tracking.PIPELINE_TAG}` = '{default_run_name(cfg)}'",
    )
    names = sorted(m.name for m in models)
    assert names == ["generator-round-1", "generator-round-2", "policy-round-1", "policy-round-2"]
    for m in models:
        assert store.is_complete(m.tags["uri"]), f"{m.name} points at an incomplete checkpoint"
    policy2 = next(m for m in models if m.name == "policy-round-2")
    assert any(metric.key == "policy/accuracy" for metric in policy2.metrics or [])


@pytest.mark.parametrize("rounds_per_run", [None, 1], ids=["one-run", "chained"])
def test_early_stop_skips_later_rounds(tmp_path, monkeypatch, rounds_per_run):
    """A run with early_stop_tie_rate stops after round 1 when the policy's scores tie at that rate:
    round 2's tasks never run. In a chain of 1-round runs the rule is applied between them (the audit's
    tie rate in MLflow): round 2's run is never started."""
    import mlflow

    from dynamicrubric.localrun.launch import run_local

    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        preset="tiny",
        overrides={
            # only round 1 runs: the least of it that still ends in an audit (CI minutes)
            "train_evaluator": {"max_steps": 1},
            "train_policy": {"max_steps": 1},
            "evaluate": {"variants": ["dynamic"]},
            "guard": {"enabled": False},
            "pipeline": {
                "rounds": 2,
                "shards": 1,
                # stop unless round 1's scores have no tie at all: with 4 responses scored by
                # tiny-random's few (often empty) rubrics, some always tie
                "early_stop_tie_rate": 1e-6,
                "rounds_per_run": rounds_per_run,
                "pipeline_root": str(tmp_path / "runs"),
                "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            },
        },
    )
    result = run_local(cfg)
    parent = result.parent_run_id
    assert len(result.run_dirs) == 1  # the chain's second run never started
    client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri(cfg))
    stages = _stage_runs(client, client.get_run(parent).info.experiment_id)
    aggregate = next(
        s
        for s in stages
        if s.data.tags[tracking.STAGE_TAG] == "audit-after-aggregate"
        and s.data.tags[tracking.ROUND_TAG] == "1"
    )
    assert aggregate.data.metrics["tie_rate"] >= 1e-6  # the condition that stops the run
    rounds = {s.data.tags[tracking.ROUND_TAG] for s in stages}
    assert rounds == {"0", "1"}, f"stages ran in rounds {sorted(rounds)}"


@pytest.mark.slow
@pytest.mark.demo  # also alone: `make test-demo`
@pytest.mark.timeout(3000)  # minutes on a busy 2-core VM
def test_default_run_completes(tmp_path):
    """The README's main command on the embedded defaults, SmolLM2-135M in every role, for one of its two
    rounds: every stage runs once on SmolLM2 (round 2 runs the same tasks from round 1's checkpoints, as
    the tiny runs test; both rounds cost CI 14 of its 60 minutes)."""
    result = subprocess.run(
        [sys.executable, "-m", "dynamicrubric.cli", "run", "--rounds", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout[result.stdout.index("round  mean_gap") :].splitlines()
    assert table[1].split()[0] == "1" and not (table[2:] and table[2].split()[:1] == ["2"]), table[:3]
    # The default run shows the signal the method trains on (soft verdicts): the round's evaluator
    # separates the probe responses (a gap, not all ties), and its accuracy rests on 16+ labelled pairs.
    row = table[1].split()
    assert float(row[1]) != 0 and float(row[2]) < 1, table[:2]
    assert int(re.search(r"\(n=(\d+)\)", table[1]).group(1)) >= 16, table[:2]
    assert "mlflow ui --backend-store-uri sqlite:///" in result.stdout
    assert (tmp_path / "mlflow.db").exists() and any((tmp_path / "runs").iterdir())


def test_tracking_leaves_the_environment_alone(tmp_path, monkeypatch):
    """mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI; ours must not pin later configs to it."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    a = load_config(
        preset="tiny", overrides={"pipeline": {"mlflow_tracking_uri": f"sqlite:///{tmp_path}/a.db"}}
    )
    b = load_config(
        preset="tiny", overrides={"pipeline": {"mlflow_tracking_uri": f"sqlite:///{tmp_path}/b.db"}}
    )
    monkeypatch.chdir(tmp_path.parent)
    tracking_runs.start_pipeline_run(a, "run-a", rounds=1)
    assert "MLFLOW_TRACKING_URI" not in os.environ
    # a local store keeps its artifacts beside its database, wherever the run started
    assert (tmp_path / "mlruns").is_dir() and not (tmp_path.parent / "mlruns").exists()
    assert tracking.tracking_uri(b).endswith("b.db")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a tiny chain: ~1.5 min on an idle 2-core VM
def test_chained_run_gives_the_artifacts_of_one_run(tiny_run, tmp_path):
    """`dynrubric run --preset tiny` (2 rounds) as a chain of two 1-round runs (pipeline.rounds_per_run:
    1) against the same config as one run (the session's tiny run): round 2 of the chain starts from
    round 1's checkpoints as MLflow records them, under the same MLflow parent run, and every artifact of
    the two is the same (bench/artifact_digest.py: the chain's outputs lie in two pipeline-run folders)."""
    import mlflow

    from bench.artifact_digest import compare, digest_run

    single = yaml.safe_load(tiny_run["config"].read_text())
    workdir = tmp_path / "chain"
    workdir.mkdir()
    config = workdir / "config.yaml"
    pipeline = {**single["pipeline"], "pipeline_root": str(workdir / "runs"), "rounds_per_run": 1}
    config.write_text(yaml.safe_dump({**single, "pipeline": pipeline}))
    done = subprocess.run(
        [sys.executable, "-m", "dynamicrubric.cli", "run", "--config", str(config)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folders = {
        "single": [tiny_run["run_folder"]],
        "chain": sorted(p.parent for p in (workdir / "runs").glob("*/index.json")),
    }
    digests = {name: {"artifacts": digest_run(found[-1])} for name, found in folders.items()}
    assert len(folders["chain"]) == 2
    result = compare(digests["single"], digests["chain"])
    # the one difference: the config artifact the tasks read says how the rounds were split
    differs = (result["only_in_first"], result["only_in_second"], result["content_differs"])
    assert differs == ([], [], ["r0 - start-tracking config"]), result
    assert result["artifacts"] > 100
    configs = []
    for name in ("single", "chain"):
        index = json.loads((folders[name][-1] / "index.json").read_text())
        task = next(t for t in index["tasks"] if t["stage"] == "start-tracking")
        configs.append(yaml.safe_load(Path(task["outputs"]["config"][0]).read_text())["pipeline"])
    assert (configs[0].pop("rounds_per_run"), configs[1].pop("rounds_per_run")) == (None, 1)
    assert configs[0].pop("pipeline_root") != configs[1].pop("pipeline_root")
    assert configs[0] == configs[1]

    cfg = load_config(tmp_path / "chain" / "config.yaml")
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'chain' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(cfg.pipeline.experiment).experiment_id
    parents = client.search_runs([experiment], f"tags.`{tracking.STAGE_TAG}` = 'pipeline'")
    assert [p.data.tags[tracking.PIPELINE_TAG] for p in parents] == [default_run_name(cfg)]  # one parent
    rounds = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    assert sorted(
        r.data.tags[tracking.ROUND_TAG] for r in rounds if tracking.STAGE_TAG not in r.data.tags
    ) == [
        "1",
        "2",
    ]
