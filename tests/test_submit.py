"""`dynrubric compile` and `dynrubric submit` against a loopback stand-in of the KFP v2beta1 REST API.

The stand-in (tests/kfp_standin.py) parses what kfp.Client sends with the kfp-pipeline-spec and
kfp-kubernetes protos, rejecting unknown fields and dangling references, so these tests check the
package a cluster would receive: its parameters, its GPU, shared-memory and Secret settings, and
that a bad spec comes back as one line of error rather than a traceback.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import kfp
import kfp_server_api
import pytest
import yaml
from google.protobuf import json_format
from kfp_standin import KfpStandIn, ParsedPipeline, parse_package

from dynamicrubric import cli
from dynamicrubric.infra import tracking, tracking_runs
from dynamicrubric.infra.config import STAGE_FACTS, TENSOR_PARALLEL_ENV
from dynamicrubric.infra.config_loading import config_from_yaml, load_config
from dynamicrubric.pipelines.co_evolution import MAX_PACKAGE_BYTES
from dynamicrubric.pipelines.run_plan import task_count
from dynamicrubric.pipelines.task_settings import CACHE_MOUNT, S3_ENV

REPO = Path(__file__).resolve().parents[1]
# The committed packages and the command that regenerates each from the repository root.
COMMITTED = {
    "pipelines/co_evolution.yaml": [],  # the default config: preset local, no file
    "pipelines/co_evolution_paper.yaml": ["--preset", "paper"],
}
CLUSTER = {"pipeline": {"pipeline_root": "s3://bucket/runs", "mlflow_tracking_uri": "http://mlflow:5000"}}
# A GPU cluster's scheduling settings, which must reach GPU tasks only.
GPU_NODES = {
    "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "image_pull_secrets": ["registry-creds"],
    "service_account": "dynamicrubric-runner",
}
# kfp.Client warns on every construction that it needs a v2.0.0-beta.2+ server; the stand-in is v2beta1.
pytestmark = pytest.mark.filterwarnings("ignore:This client only works:FutureWarning")
GPU_STAGES = (
    "rollout",
    "rubrics",
    "judge",
    "train_evaluator",
    "train_policy",
    "evaluate_samples",
    "evaluate",
)


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch):
    """The tracking URI and kfp.Client both read the environment; the tests' configs must decide."""
    for key in (
        "MLFLOW_TRACKING_URI",
        "KF_PIPELINES_ENDPOINT",
        "KF_PIPELINES_DEFAULT_EXPERIMENT_NAME",
        "KF_PIPELINES_OVERRIDE_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def standin():
    with KfpStandIn() as server:
        yield server


def _config_file(tmp_path: Path, data: dict, name: str = "cluster.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _stage_of(executor: str) -> str:
    """exec-train-policy-3 → train_policy (KFP numbers repeated components)."""
    return re.sub(r"-\d+$", "", executor.removeprefix("exec-")).replace("-", "_")


def _dag_tasks(pipeline: ParsedPipeline) -> dict[tuple[str, str], tuple]:
    """Every task of every DAG: (dag component, task name) -> (task spec, enclosing (dag, task) or None)."""
    spec = pipeline.spec
    found: dict[tuple[str, str], tuple] = {}

    def walk(dag_name: str, dag, parent) -> None:
        for name, task in dag.tasks.items():
            found[(dag_name, name)] = (task, parent)
            component = spec.components[task.component_ref.name]
            if component.HasField("dag"):
                walk(task.component_ref.name, component.dag, (dag_name, name))

    walk("root", spec.root.dag, None)
    return found


def _runs_after(pipeline: ParsedPipeline, first: str) -> set[tuple[str, str]]:
    """The tasks that cannot start before root task `first` ends: through dependencies within a DAG,
    and through the DAG task (ParallelFor, dsl.If) that encloses them."""
    tasks = _dag_tasks(pipeline)

    def ancestors(key: tuple[str, str], seen: set) -> set:
        task, parent = tasks[key]
        direct = [(key[0], d) for d in task.dependent_tasks] + ([parent] if parent else [])
        for d in direct:
            if d not in seen:
                seen.add(d)
                ancestors(d, seen)
        return seen

    return {key for key in tasks if ("root", first) in ancestors(key, set())}


def _executor_of(pipeline: ParsedPipeline, task) -> str:
    return pipeline.spec.components[task.component_ref.name].executor_label


def _runtime_task_count(pipeline: ParsedPipeline) -> int:
    """Tasks a cluster creates: root tasks, plus each ParallelFor body times its item count."""
    spec = pipeline.spec
    total = 0
    for task in spec.root.dag.tasks.values():
        component = spec.components[task.component_ref.name]
        if task.HasField("parameter_iterator"):
            items = yaml.safe_load(task.parameter_iterator.items.raw)
            total += len(items) * len(component.dag.tasks)
        else:
            total += 1
    return total


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    assert stderr.rstrip().endswith(errors[0]), f"the error is not the last thing printed:\n{stderr}"
    return errors[0]


def test_submit_paper_creates_run_with_cluster_settings(standin, tmp_path, capsys):
    config = _config_file(tmp_path, {"pipeline": {**CLUSTER["pipeline"], **GPU_NODES}})
    argv = ["submit", "--host", standin.host, "--preset", "paper", "--config", config]
    assert cli.main([*argv, "--experiment", "dr-paper", "--run-name", "paper-run-1"]) == 0

    # the calls kfp.Client 2.17 makes, and nothing the stand-in does not serve
    assert standin.requests == [
        ("GET", "/apis/v2beta1/healthz"),
        ("GET", "/apis/v2beta1/experiments"),
        ("POST", "/apis/v2beta1/experiments"),
        ("POST", "/apis/v2beta1/runs"),
    ]
    assert standin.unhandled == [] and standin.rejected == []
    (run,) = standin.runs
    assert f"submitted run {run.response['run_id']} to {standin.host}" in capsys.readouterr().out

    experiment = standin.experiment_named("dr-paper")
    assert experiment is not None and run.body["experiment_id"] == experiment["experiment_id"]
    assert run.body["display_name"] == "paper-run-1"
    assert run.body["service_account"] == "dynamicrubric-runner"  # pipeline.service_account, when set

    cfg = load_config(config, preset="paper")
    runtime = run.body["runtime_config"]
    assert runtime["pipeline_root"] == "s3://bucket/runs"
    assert runtime["parameters"]["run_name"] == "paper-run-1"
    assert config_from_yaml(runtime["parameters"]["config_yaml"]) == cfg

    spec = run.pipeline.spec
    assert spec.pipeline_info.name == "dynamicrubric-dynamic"
    assert _runtime_task_count(run.pipeline) == task_count(cfg)

    executors = run.pipeline.deployment.executors
    assert set(run.pipeline.kubernetes) == set(executors)  # every task gets the Secret, at least
    gpu_executors = 0
    for label, executor in executors.items():
        stage = _stage_of(label)
        k8s = run.pipeline.kubernetes[label]
        (secret,) = k8s.secret_as_env
        assert secret.secret_name == cfg.pipeline.s3_secret
        assert [(m.secret_key, m.env_var) for m in secret.key_to_env] == [(k, k) for k in S3_ENV]
        assert [s.secret_name for s in k8s.image_pull_secret] == ["registry-creds"], label
        # no model: CPU image (stage-models only copies weights)
        light = stage in {
            "start_tracking",
            "stage_models",
            "prepare_data",
            "candidates",
            "aggregate",
            "check_samples",
        }
        assert executor.container.image == (cfg.pipeline.cpu_image if light else cfg.pipeline.image)

        res = cfg.pipeline.stage_resources(stage)
        resources = executor.container.resources
        # every task requests what it may use, and has a deadline
        assert (resources.resource_cpu_request, resources.resource_memory_request) == (res.cpu, res.memory)
        assert (resources.resource_cpu_limit, resources.resource_memory_limit) == (res.cpu, res.memory)
        assert k8s.active_deadline_seconds == res.timeout_s > 0, label
        env = {e.name: e.value for e in executor.container.env}
        mounts = {m.mount_path: (m.medium, m.size_limit) for m in k8s.empty_dir_mounts}
        if STAGE_FACTS[stage].model_cache:  # staged weights land on a sized scratch volume
            assert mounts.pop(CACHE_MOUNT) == ("", cfg.pipeline.model_cache_size), label
            assert env.pop("DYNRUBRIC_CACHE").startswith(CACHE_MOUNT + "/"), label
            assert env.pop("HF_HOME").startswith(CACHE_MOUNT + "/"), label
        if res.gpus:
            gpu_executors += 1
            assert stage in GPU_STAGES, label
            accelerator = resources.accelerator
            assert (accelerator.resource_type, accelerator.resource_count) == (
                "nvidia.com/gpu",
                str(res.gpus),
            )
            assert mounts == {"/dev/shm": ("Memory", cfg.pipeline.shm_size)}, label
            assert dict(k8s.node_selector.labels) == GPU_NODES["node_selector"], label
            tolerations = [(t.key, t.operator, t.effect) for t in k8s.tolerations]
            assert tolerations == [("nvidia.com/gpu", "Exists", "NoSchedule")], label
            # vLLM's tensor parallelism follows the GPUs the task requests (config.config_from_yaml)
            expected_env = {TENSOR_PARALLEL_ENV: str(res.gpus)} if STAGE_FACTS[stage].inference else {}
            assert env == expected_env, label
        else:  # CPU tasks are not pinned to GPU nodes
            assert not resources.HasField("accelerator"), label
            assert mounts == {} and env == {}, label
            assert not k8s.HasField("node_selector") and list(k8s.tolerations) == [], label
    # per round: rollout, rubrics and judge for the generator and for the policy, 2 trainers, and
    # evaluate's sampling and scoring (its check-samples task between them is a CPU task)
    assert gpu_executors == cfg.pipeline.rounds * 10

    # every task retries (all are safe to rerun, see config.StageResources)
    for (_, name), (task, _) in _dag_tasks(run.pipeline).items():
        if spec.components[task.component_ref.name].HasField("executor_label"):
            stage = _stage_of(_executor_of(run.pipeline, task))
            assert task.retry_policy.max_retry_count == cfg.pipeline.stage_resources(stage).retries, name
            assert task.retry_policy.backoff_duration.seconds == 60, name

    # models staged once: one plan entry for the one reference all roles share, and every model task
    # reads the staged copy (never the hub id) and starts only after stage-models
    plan = json_format.MessageToDict(spec.root.dag.tasks["stage-models"].inputs.parameters["plan"])
    staged = "s3://bucket/runs/models/Qwen--Qwen3-8B-"
    ((ref, uri),) = plan["runtimeValue"]["constant"].items()
    assert ref == "Qwen/Qwen3-8B" and uri.startswith(staged)
    after_staging = _runs_after(run.pipeline, "stage-models")
    model_tasks = 0
    for key, (task, _) in _dag_tasks(run.pipeline).items():
        refs = {
            k: v.runtime_value.constant.string_value
            for k, v in task.inputs.parameters.items()
            if k.endswith("_ref")
        }
        if refs:
            model_tasks += 1
            assert set(refs.values()) == {uri}, key
            assert key in after_staging, f"{key} may start before stage-models"
    # as compiled (a ParallelFor body counts once), evaluate-samples among them
    assert model_tasks == cfg.pipeline.rounds * 10


def test_submit_tiny_twice_reuses_the_experiment(standin, tmp_path, capsys):
    config = _config_file(tmp_path, CLUSTER)
    for name in ("tiny-a", "tiny-b"):
        argv = ["submit", "--host", standin.host, "--preset", "tiny", "--config", config, "--run-name", name]
        assert cli.main([*argv, "--rounds", "1"]) == 0
    assert [m for m, p in standin.requests if p.endswith("/experiments")] == ["GET", "POST", "GET"]
    (experiment,) = standin.experiments.values()
    assert experiment["display_name"] == "dynamicrubric"  # pipeline.experiment, no --experiment given
    assert [r.body["display_name"] for r in standin.runs] == ["tiny-a", "tiny-b"]

    run = standin.runs[0]
    cfg = config_from_yaml(run.body["runtime_config"]["parameters"]["config_yaml"])
    assert (cfg.preset, cfg.pipeline.rounds) == ("tiny", 1)
    assert run.body.get("service_account") is None  # the default: the server's own identity
    # tiny declares no resources: no GPUs and no /dev/shm, but defaults for CPU and memory requests,
    # and the S3 Secret still reaches every task
    for label, executor in run.pipeline.deployment.executors.items():
        assert not executor.container.resources.HasField("accelerator"), label
        assert executor.container.resources.resource_memory_request, label
        assert [m.mount_path for m in run.pipeline.kubernetes[label].empty_dir_mounts] in ([], [CACHE_MOUNT])
        assert run.pipeline.kubernetes[label].secret_as_env[0].secret_name == "dynamicrubric-s3"


def test_submit_as_a_subprocess(standin, tmp_path):
    config = _config_file(tmp_path, CLUSTER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KF_PIPELINES_"))}
    argv = ["submit", "--host", standin.host, "--preset", "tiny", "--config", config, "--experiment", "sub"]
    done = subprocess.run(
        [sys.executable, "-m", "dynamicrubric.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (run,) = standin.runs
    assert f"submitted run {run.response['run_id']}" in done.stdout
    assert standin.experiment_named("sub")["experiment_id"] == run.body["experiment_id"]
    # no --run-name: the config-derived default, the same one the tasks use to find the MLflow run
    assert re.fullmatch(r"tiny-dynamic-[0-9a-f]{10}", run.body["display_name"])
    assert run.body["runtime_config"]["parameters"]["run_name"] == run.body["display_name"]


def test_server_rejection_is_one_line_cli_error(tmp_path, capsys):
    """An API server that refuses the spec (here: one that only knows schema 2.0.0) → exit 1, one line."""
    config = _config_file(tmp_path, CLUSTER)
    with KfpStandIn(schema_versions=("2.0.0",)) as old_server:
        rc = cli.main(["submit", "--host", old_server.host, "--preset", "tiny", "--config", config])
    assert rc == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {old_server.host}: submitting the pipeline failed: HTTP 400 Bad Request:")
    assert "pipeline_spec.schemaVersion: '2.1.0' is not one of ['2.0.0']" in line
    assert old_server.runs == [] and len(old_server.rejected) == 1


def test_server_rejection_as_a_subprocess(tmp_path):
    config = _config_file(tmp_path, CLUSTER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KF_PIPELINES_"))}
    with KfpStandIn(schema_versions=("2.0.0",)) as old_server:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "dynamicrubric.cli",
                "submit",
                "--host",
                old_server.host,
                "--config",
                config,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert done.returncode == 1
    assert "schemaVersion" in _one_error_line(done.stderr)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"pipeline": {"mlflow_tracking_uri": "http://mlflow:5000"}},
            "error: pipeline.pipeline_root: './runs' is local; a cluster run needs an object-store root",
        ),
        (
            {"pipeline": {"pipeline_root": "s3://bucket/runs"}},
            "error: pipeline.mlflow_tracking_uri: a sqlite file is not reachable from cluster pods",
        ),
    ],
)
def test_submit_refuses_local_settings(standin, tmp_path, capsys, override, message):
    config = _config_file(tmp_path, override)
    assert cli.main(["submit", "--host", standin.host, "--preset", "tiny", "--config", config]) == 1
    assert _one_error_line(capsys.readouterr().err).startswith(message)
    assert standin.requests == []  # refused before contacting the server


# ---- the stand-in's own strictness, with hand-modified packages through kfp.Client


@pytest.fixture(scope="module")
def tiny_package(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pkg") / "pipeline.yaml"
    assert cli.main(["compile", "--preset", "tiny", "--rounds", "1", "--out", str(out)]) == 0
    return out


def _edit_package(src: Path, dst: Path, edit) -> str:
    spec, platform = yaml.safe_load_all(src.read_text())
    edit(spec, platform)
    dst.write_text(yaml.safe_dump_all([spec, platform], sort_keys=False))
    return str(dst)


def _client(standin: KfpStandIn) -> kfp.Client:
    return kfp.Client(host=standin.host)


def _bad_secret_field(spec: dict, platform: dict) -> None:
    executor = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-rollout"]
    executor["secretAsEnvv"] = executor.pop("secretAsEnv")  # a Struct to the client, a typo to the driver


def _dangling_component(spec: dict, platform: dict) -> None:
    spec["root"]["dag"]["tasks"]["prepare-data"]["componentRef"]["name"] = "comp-prepare-dataa"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_bad_secret_field, 'no field named "secretAsEnvv"'),
        (_dangling_component, "task root/prepare-data refers to unknown component 'comp-prepare-dataa'"),
    ],
)
def test_standin_rejects_hand_modified_run(standin, tiny_package, tmp_path, edit, message):
    package = _edit_package(tiny_package, tmp_path / "bad.yaml", edit)
    with pytest.raises(kfp_server_api.ApiException) as err:
        _client(standin).create_run_from_pipeline_package(package, experiment_name="bad", run_name="bad")
    assert err.value.status == 400 and message in json.loads(err.value.body)["message"]
    assert standin.runs == [] and message in standin.rejected[0][1]


def test_standin_upload_parses_strictly(standin, tiny_package, tmp_path):
    client = _client(standin)
    pipeline = client.upload_pipeline(str(tiny_package), pipeline_name="dynamicrubric-tiny")
    (upload,) = standin.uploads
    assert upload.response["pipeline_id"] == pipeline.pipeline_id and upload.filename == "pipeline.yaml"
    assert upload.pipeline.spec.pipeline_info.name == "dynamicrubric-dynamic"
    assert set(upload.pipeline.kubernetes) == set(upload.pipeline.deployment.executors)

    # With a name given, kfp.Client uploads the file unparsed: an unknown field reaches the server.
    def unknown_field(spec: dict, platform: dict) -> None:
        spec["pipelineInfoo"] = spec["pipelineInfo"]

    bad = _edit_package(tiny_package, tmp_path / "bad.yaml", unknown_field)
    with pytest.raises(kfp_server_api.ApiException) as err:
        client.upload_pipeline(bad, pipeline_name="dynamicrubric-bad")
    assert (
        err.value.status == 400 and 'no field named "pipelineInfoo"' in json.loads(err.value.body)["message"]
    )
    assert len(standin.uploads) == 1 and standin.unhandled == []


# ---- compile


@pytest.mark.parametrize("package", sorted(COMMITTED))
def test_committed_package_is_up_to_date(tmp_path, package):
    args = COMMITTED[package]
    regenerate = f"regenerate it from the repository root with `dynrubric compile {' '.join([*args, '--out', package])}`"
    out = tmp_path / "fresh.yaml"
    assert cli.main(["compile", *args, "--out", str(out)]) == 0
    fresh = out.read_text()
    committed_path = REPO / package
    assert committed_path.exists(), f"{package} is missing; {regenerate}"
    committed = committed_path.read_text()
    if fresh != committed:
        diff = "".join(
            list(
                difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True), "committed", "fresh")
            )[:40]
        )
        pytest.fail(f"{package} is out of date; {regenerate}\n{diff}")


def test_local_package_leaves_out_what_kfp_local_would_apply(tmp_path):
    """kfp.local honours container env and retries: a local package must carry neither (a pod-only
    cache path or a retry of a deterministic local failure), nor the CPU and memory settings it warns
    about, and stages nothing."""
    out = tmp_path / "local.yaml"
    assert cli.main(["compile", "--preset", "tiny", "--rounds", "1", "--out", str(out)]) == 0
    pipeline = parse_package(out.read_text())
    for label, executor in pipeline.deployment.executors.items():
        assert list(executor.container.env) == [], label
        assert not executor.container.HasField("resources"), label  # kfp.local warns about each
    for key, (task, _) in _dag_tasks(pipeline).items():
        assert not task.HasField("retry_policy"), key
    plan = json_format.MessageToDict(pipeline.spec.root.dag.tasks["stage-models"].inputs.parameters["plan"])
    assert plan["runtimeValue"]["constant"] == {"tiny-random": "tiny-random"}  # used in place


def test_compiled_package_loads_and_matches_config(tmp_path):
    """The default package parses as the server would, and its default config is the default config."""
    out = tmp_path / "p.yaml"
    assert cli.main(["compile", "--out", str(out), "--rounds", "1"]) == 0
    pipeline = parse_package(out.read_text())
    defaults = pipeline.spec.root.input_definitions.parameters
    cfg = load_config(overrides={"pipeline": {"rounds": 1}})
    assert config_from_yaml(defaults["config_yaml"].default_value.string_value) == cfg
    assert _runtime_task_count(pipeline) == task_count(cfg)


@pytest.mark.parametrize("preset", ["tiny", "local", "paper"])
def test_presets_fit_a_cluster(preset, tmp_path):
    """Each preset compiles to one package under the limit (compile refuses a larger one)."""
    out = tmp_path / "p.yaml"
    assert cli.main(["compile", "--preset", preset, "--out", str(out)]) == 0
    assert out.stat().st_size <= MAX_PACKAGE_BYTES


# ---- long schedules: config by reference, packages under the limit, chained runs


def _config_inputs(pipeline: ParsedPipeline) -> dict[str, tuple[set, set]]:
    """Each executor's component: (its parameter inputs, its artifact inputs)."""
    spec = pipeline.spec
    return {
        c.executor_label: (set(c.input_definitions.parameters), set(c.input_definitions.artifacts))
        for c in spec.components.values()
        if c.executor_label
    }


def test_paper_rounds_compile_to_chained_packages_under_the_limit(tmp_path, capsys):
    """7 paper rounds in segments of 3 (a first, a middle and a short last segment, as any long schedule
    has; 20 rounds made the same checks on seven packages at three times the cost): each package under
    300 KiB, each parsing as the server would; every task but start-tracking takes the config as an
    artifact (a URI in its executor input), never the YAML inline; the segments after the first take the
    previous one's checkpoints."""
    argv = ["compile", "--preset", "paper", "--rounds", "7", "--rounds-per-run", "3"]
    assert cli.main([*argv, "--out", f"{tmp_path}/"]) == 0
    written = capsys.readouterr().out.split()
    expected = [f"{a}-{min(a + 2, 7)}" for a in range(1, 8, 3)]  # numbered with as many digits as 7 has
    assert written == [f"{tmp_path}/co_evolution-rounds-{span}.yaml" for span in expected]
    cfg = load_config(preset="paper", overrides={"pipeline": {"rounds": 7}})
    for i, path in enumerate(written):
        text = Path(path).read_text()
        assert len(text.encode()) < MAX_PACKAGE_BYTES, (path, len(text.encode()))
        pipeline = parse_package(text)
        first = 1 + 3 * i
        roots = set(pipeline.spec.root.input_definitions.parameters)
        starts = {"start_policy", "start_generator"} if first > 1 else set()
        assert roots == {"config_yaml", "run_name"} | starts, path
        for executor, (params, artifacts) in _config_inputs(pipeline).items():
            if executor.startswith("exec-start-tracking"):
                assert "config_yaml" in params, executor
            elif not executor.startswith("exec-stage-models"):
                assert "config_yaml" not in params and "config" in artifacts, executor
        # the YAML is passed on by the root DAG to start-tracking only: every other task's `config`
        # comes from start-tracking's output (directly, or through the loop's DAG inputs)
        passes_yaml = []
        for (dag, name), (task, _) in _dag_tasks(pipeline).items():
            if task.inputs.parameters.get("config_yaml"):
                passes_yaml.append(name)
            art = task.inputs.artifacts.get("config")
            if art is not None and art.HasField("task_output_artifact"):
                assert art.task_output_artifact.producer_task == "start-tracking", (dag, name)
        assert passes_yaml == ["start-tracking"], path
        assert "config_yaml" not in text.split("deploymentSpec:")[1].split("pipelineInfo:")[0].replace(
            "start_tracking(config_yaml", ""
        ).replace("config_yaml: str", "").replace("run(config_yaml", ""), path
        # rounds are numbered as in one long run: this segment's and no other's
        rounds = {
            int(m.group(1))
            for m in re.finditer(
                r"\br(\d+)-", " ".join(t.task_info.name for t, _ in _dag_tasks(pipeline).values())
            )
        }
        assert rounds == set(range(first, min(first + 2, 7) + 1)), path
    assert task_count(cfg) > 100  # what one run of 7 rounds would have been


def test_compile_refuses_a_package_over_the_limit(tmp_path, capsys):
    """4 paper rounds are one over what a package holds (3): refused in one line that names the split."""
    out = tmp_path / "paper.yaml"
    assert cli.main(["compile", "--preset", "paper", "--rounds", "4", "--out", str(out)]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert re.fullmatch(
        r"error: the package of rounds 1-4 would be \d+ KiB, over the 300 KiB limit \(its Argo Workflow, "
        r"several times larger, must stay under Argo's 1 MiB\): split it with pipeline.rounds_per_run: 3 "
        r"\(or --rounds-per-run 3\)",
        line,
    ), line
    assert not out.exists()


@pytest.fixture
def mlflow_uri(mlflow_server, monkeypatch) -> str:
    """A real MLflow server (PostgreSQL store), as a cluster's pods and `submit` reach it."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    return mlflow_server.url


class ClusterStandIn:
    """Plays the KFP cluster that would run each segment's run: a run is RUNNING when first asked
    about, then ends. The training stages cannot run here, so where the run succeeds this records,
    in the real MLflow store and with the project's own tracking functions, what its tasks would
    have: start-tracking's parent run (joined by a later segment), and each round's train-evaluator
    and train-policy runs with their checkpoints as LoggedModels at URIs under the run's root."""

    def __init__(self, cfg, fail: set[str] = frozenset()):
        self.cfg = cfg
        self.fail = set(fail)  # display names of runs that fail (once)
        self.recorded: dict[str, str] = {}  # model name -> URI

    def __call__(self, run) -> str:
        if run.response["state"] == "PENDING":
            return "RUNNING"
        name = run.body["display_name"]
        if name in self.fail:
            self.fail.discard(name)
            return "FAILED"
        params = run.body["runtime_config"]["parameters"]
        first, last = map(int, re.fullmatch(r".*-rounds-(\d+)-(\d+)", name).groups())
        run_name = params["run_name"]
        tracking_runs.start_pipeline_run(self.cfg, run_name, self.cfg.pipeline.rounds, join=first > 1)
        root = f"{run.body['runtime_config']['pipeline_root']}/{run.response['run_id']}"
        for t in range(first, last + 1):
            for stage, role in (("train-evaluator", "generator"), ("train-policy", "policy")):
                with tracking_runs.stage_run(self.cfg, run_name, t, stage) as stage_run:
                    uri = f"{root}/r{t}-{stage}/{role}"
                    stage_run.log_model(run_name, f"{role}-round-{t}", uri)
                    self.recorded[f"{role}-round-{t}"] = uri
        return "SUCCEEDED"


def test_submit_chains_segments_through_mlflow(standin, tmp_path, capsys, mlflow_uri):
    """`submit` of 3 rounds, 1 per run: round 1's run succeeds, round 2's fails (one line, exit 1);
    the same command again skips round 1 (MLflow has its checkpoints), resubmits round 2 from round
    1's checkpoints and then round 3 from round 2's; all under one MLflow parent run."""
    import mlflow

    experiment = f"chain-{uuid.uuid4().hex[:8]}"
    data = {"pipeline": {**CLUSTER["pipeline"], "mlflow_tracking_uri": mlflow_uri, "experiment": experiment}}
    config = _config_file(tmp_path, data)
    argv = ["submit", "--host", standin.host, "--preset", "tiny", "--config", config, "--run-name", "chain"]
    argv += ["--rounds", "3", "--rounds-per-run", "1", "--poll-seconds", "0.05"]
    cfg = load_config(config, preset="tiny", overrides={"pipeline": {"rounds": 3, "rounds_per_run": 1}})
    cluster = ClusterStandIn(cfg, fail={"chain-rounds-2-2"})
    standin.advance = cluster

    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert "run " in _one_error_line(err) and "(rounds 2-2) ended FAILED" in err
    assert [r.body["display_name"] for r in standin.runs] == ["chain-rounds-1-1", "chain-rounds-2-2"]
    assert "rounds 1-1: run" in out and "SUCCEEDED" in out  # the progress lines

    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "rounds 1-1: done already (MLflow has policy-round-1 of chain); skipped" in out
    names = [r.body["display_name"] for r in standin.runs]
    assert names == ["chain-rounds-1-1", "chain-rounds-2-2", "chain-rounds-2-2", "chain-rounds-3-3"]
    params = [r.body["runtime_config"]["parameters"] for r in standin.runs]
    assert {p["run_name"] for p in params} == {"chain"}  # one MLflow parent run name for every segment
    assert "start_policy" not in params[0]
    for segment, previous in ((params[1], 1), (params[2], 1), (params[3], 2)):
        assert segment["start_policy"] == cluster.recorded[f"policy-round-{previous}"]
        assert segment["start_generator"] == cluster.recorded[f"generator-round-{previous}"]
    # each package holds its own rounds and declares the start parameters it is given
    for run, (first, last) in zip(standin.runs, [(1, 1), (2, 2), (2, 2), (3, 3)], strict=True):
        assert run.pipeline.spec.pipeline_info.description.endswith(
            "3 rounds)" if (first, last) == (1, 3) else f"rounds {first}-{last} of 3)"
        )
        declared = set(run.pipeline.spec.root.input_definitions.parameters)
        assert declared == {"config_yaml", "run_name"} | (
            {"start_policy", "start_generator"} if first > 1 else set()
        )
    assert standin.unhandled == [] and standin.rejected == []

    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name(experiment)
    parents = client.search_runs(
        [exp.experiment_id],
        f"tags.`{tracking.PIPELINE_TAG}` = 'chain' and tags.`{tracking.STAGE_TAG}` = 'pipeline'",
    )
    assert len(parents) == 1
    rounds = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    # A round's run is made by its first task, so there is one for each round whose tasks ran (the
    # stand-in cluster ran rounds 1 and 2; `submit` does not wait for the last segment's run), all under
    # the one parent.
    ran = sorted({name.rsplit("-", 1)[-1] for name in cluster.recorded})
    assert ran and sorted(r.data.tags[tracking.ROUND_TAG] for r in rounds) == ran


def test_the_package_limit_leaves_half_of_argos_1_mib_with_node_status_compressed():
    """The paper preset's 3-round segment (the most rounds MAX_PACKAGE_BYTES lets a run have) needs
    Argo's node-status compression to fit 1 MiB, and keeps half of it with (docs/deploy.md's table:
    bench/argo_status_size.py's estimate, no Go toolchain to run KFP's own compiler here)."""
    from bench.argo_status_size import estimate

    three, four = estimate("paper", 3), estimate("paper", 4)
    assert (
        three["tasks"] == 108
        and three["package_kib"] * 1024 <= MAX_PACKAGE_BYTES < four["package_kib"] * 1024
    )
    assert 20_000 < three["status_mib"] * 2**20 / three["tasks"] < 30_000  # ~24 KB of status a task
    assert three["total_uncompressed_mib"] > 2.5 and three["total_compressed_mib"] < 0.6


def test_the_judges_key_reaches_the_evaluate_tasks_only(tmp_path):
    """A judge behind a keyed endpoint (the paper's GPT-4.1 re-judging): its api_key_env comes from
    pipeline.judge_secret's key of that name, on the evaluate tasks, which ask the judges, and no other."""
    judge = {"url": "https://api.openai.com/v1", "served_model": "gpt-4.1", "api_key_env": "OPENAI_API_KEY"}
    config = _config_file(
        tmp_path,
        {
            **CLUSTER,
            "evaluate": {"benchmark_judge": judge},
            "pipeline": {**CLUSTER["pipeline"], "judge_secret": "judges"},
        },
    )
    out = tmp_path / "p.yaml"
    assert cli.main(["compile", "--config", config, "--rounds", "1", "--out", str(out)]) == 0
    pipeline = parse_package(out.read_text())
    keyed = {}
    for label, k8s in pipeline.kubernetes.items():
        for secret in k8s.secret_as_env:
            if secret.secret_name == "judges":
                keyed[_stage_of(label)] = [(m.secret_key, m.env_var) for m in secret.key_to_env]
    assert keyed == {"evaluate": [("OPENAI_API_KEY", "OPENAI_API_KEY")]}
