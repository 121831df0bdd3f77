"""Run the pipeline locally with kfp.local, compile it, or submit it to a Kubeflow Pipelines host."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from dynamicrubric import tracking
from dynamicrubric.config import Config

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A pipeline that cannot be compiled, run or submitted as configured; one line, names the key."""


def run_local(cfg: Config) -> str:
    """Run every stage in subprocesses on this machine; returns the MLflow parent run id."""
    from kfp import local

    from dynamicrubric.pipelines.co_evolution import build_pipeline, default_run_name

    root = Path(cfg.pipeline.pipeline_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    # use_venv=False: the tasks run with this interpreter, which already has the project installed.
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(root),
        enable_caching=cfg.pipeline.caching,
        raise_on_error=True,
    )
    pipeline = build_pipeline(cfg)
    run_name = default_run_name(cfg)
    pipeline(config_yaml=cfg.to_yaml(), run_name=run_name)
    return tracking.find_pipeline_run(cfg, run_name) or ""


def compile_to(cfg: Config, out: str) -> str:
    from dynamicrubric.pipelines.co_evolution import compile_pipeline, task_count

    tasks = task_count(cfg)
    if tasks > 150:
        log.warning(
            "%d tasks per run: above the ~150 a cluster's workflow object holds; lower rounds or shards",
            tasks,
        )
    return compile_pipeline(cfg, out)


def submit(cfg: Config, host: str, experiment: str | None, run_name: str | None, package: str) -> str:
    """Compile and create a run on a KFP v2 API server; returns the KFP run id."""
    import kfp

    from dynamicrubric.pipelines.co_evolution import default_run_name

    if not cfg.pipeline.pipeline_root.startswith(("s3://", "minio://", "gs://")):
        raise LaunchError(
            f"pipeline.pipeline_root: {cfg.pipeline.pipeline_root!r} is local; a cluster run needs an object-store "
            "root such as s3://bucket/runs"
        )
    if tracking.tracking_uri(cfg).startswith("sqlite"):
        raise LaunchError(
            "pipeline.mlflow_tracking_uri: a sqlite file is not reachable from cluster pods; "
            "use the MLflow server's http:// URI (see docs/deploy.md)"
        )
    compile_to(cfg, package)
    name = run_name or default_run_name(cfg)
    try:
        with warnings.catch_warnings():  # kfp.Client warns about its own future defaults on every call
            warnings.simplefilter("ignore", FutureWarning)
            client = kfp.Client(host=host)
        run = client.create_run_from_pipeline_package(
            package,
            arguments={"config_yaml": cfg.to_yaml(), "run_name": name},
            run_name=name,
            experiment_name=experiment or cfg.pipeline.experiment,
            pipeline_root=cfg.pipeline.pipeline_root,
            enable_caching=cfg.pipeline.caching,
            # None: the server's default identity (`default-editor` in a multi-user Kubeflow profile)
            service_account=cfg.pipeline.service_account or None,
        )
    except Exception as e:  # kfp_server_api and urllib3 errors carry multi-line bodies
        raise LaunchError(f"{host}: submitting the pipeline failed: {_one_line(e)}") from e
    return run.run_id


def _one_line(e: Exception) -> str:
    """The server's own message for an HTTP error (str() of an ApiException is just "(400)" first),
    else the exception's first line."""
    import json

    import kfp_server_api

    if isinstance(e, kfp_server_api.ApiException):
        body = e.body.decode(errors="replace") if isinstance(e.body, bytes) else (e.body or "")
        try:
            message = json.loads(body).get("message") or body
        except (ValueError, AttributeError):
            message = body
        lines = str(message).strip().splitlines()
        return f"HTTP {e.status} {e.reason}: {lines[0] if lines else '(no message)'}"
    lines = str(e).strip().splitlines()
    return lines[0] if lines else repr(e)


def round_table(cfg: Config, parent_run_id: str) -> list[dict]:
    """Per-round headline numbers from MLflow: the signal audit of the round's evaluator on P_{t-1}'s
    probe samples (after the generator update, for the dynamic variant), the policy trainer's final
    reward, and the eval results."""
    if not parent_run_id:
        return []
    table = []
    for t, stages in sorted(tracking.stage_runs_by_round(cfg, parent_run_id).items()):
        if t == 0:
            continue  # data preparation only
        by_stage = {s.data.tags.get(tracking.STAGE_TAG): s.data.metrics for s in stages}
        agg = by_stage.get("audit-after-aggregate") or by_stage.get("audit-aggregate") or {}
        ev = by_stage.get("evaluate", {})
        table.append(
            {
                "round": t,
                "mean_gap": agg.get("mean_gap"),
                "tie_rate": agg.get("tie_rate"),
                "uniformity": agg.get("uniformity_rate"),
                "evaluator_acc": ev.get(f"{_main_variant(cfg)}/pairwise_accuracy"),
                "policy_acc": ev.get("policy/accuracy"),
            }
        )
    return table


def _main_variant(cfg: Config) -> str:
    from dynamicrubric.pipelines.co_evolution import pipeline_variant

    return pipeline_variant(cfg)


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rounds recorded)"
    headers = list(rows[0])
    cells = [[_fmt(r[h]) for h in headers] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
