"""`dynrubric`: the command line. Each command is a thin wrapper over a library function."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import NoReturn

from dynamicrubric.cli_errors import LineEnds, describe_error, error_line, one_line
from dynamicrubric.infra import logs
from dynamicrubric.infra.artifact_kinds import KIND_KEY, ArtifactError
from dynamicrubric.infra.config import ConfigError
from dynamicrubric.store import StoreError


def cmd_validate(args: argparse.Namespace) -> int:
    from dynamicrubric.infra.artifacts import read_artifact

    failed = 0
    for uri in args.uris:
        try:
            table = read_artifact(uri)
        except Exception as e:  # one file's problem must not stop the others being checked
            if args.verbose and not isinstance(e, ArtifactError | StoreError):
                logging.exception("%s", uri)
            print(f"FAIL {describe_error(e)}")
            failed += 1
            continue
        kind = table.schema.metadata[KIND_KEY].decode()
        print(f"OK   {uri}: kind={kind} rows={table.num_rows}")
    return 1 if failed else 0


def _config(args: argparse.Namespace):
    from dynamicrubric.infra.config_loading import load_config

    return load_config(args.config, preset=args.preset)


def _print_counts(stage: str, counts: dict) -> int:
    # the numbers and names; what a stage hands its lineage (timings, traced sets) is MLflow's to show
    shown = {k: v for k, v in counts.items() if not isinstance(v, list | dict)}
    print(
        f"{stage}: "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
    )
    return 0


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from dynamicrubric.infra.models import prepare_model

    print(prepare_model(args.name))
    return 0


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_stage_parsers(stages_sub) -> None:
    """`dynrubric stage NAME` for every declared stage: its flags come from its declaration."""
    from dynamicrubric.stages.declarations import STAGES

    for stage in STAGES.values():
        p = _stage_parser(stages_sub, stage.command, stage.help, cmd_stage)
        p.set_defaults(stage_name=stage.name)
        for d in stage.inputs:
            needed = "" if d.optional else " (required without --from-run)"
            p.add_argument(
                _flag(d.name), metavar="URI", nargs="+" if d.shards else None, help=d.help + needed
            )
        for d in stage.outputs:
            p.add_argument(
                stage.output_flag(d),
                dest=f"out_{d.name}",
                required=not d.optional,
                metavar="DIR" if d.folder else "URI",
                help=d.help,
            )
        for m in stage.models:
            default = f" (default: models.{m.default_from})" if m.default_from else ""
            p.add_argument(_flag(m.name), metavar="MODEL", help=m.help + default)
        for param in stage.params:
            default = "" if param.required or param.default is None else f" (default: {param.default})"
            p.add_argument(_flag(param.name), type=param.type, help=param.help + default)
        p.add_argument("--round", type=int, help="the round the task belongs to (default: 0)")
        p.add_argument(
            "--from-run",
            metavar="RUN_ID",
            help="rerun a task of a finished pipeline run: the MLflow run id of the task (or, with "
            "--from-task, of the pipeline run); config, round, params, model references and inputs come "
            "from MLflow, the outputs go where the output flags say",
        )
        p.add_argument(
            "--from-task",
            metavar="ROUND/NAME",
            help="with --from-run PIPELINE_RUN_ID: e.g. 1/generator-judge-0",
        )
        p.add_argument(
            "--tracking-uri",
            metavar="URI",
            help="MLflow to read the run from (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
        )


def cmd_stage(args: argparse.Namespace) -> int:
    """One stage on artifact URIs, or (--from-run) a pipeline task rerun from what MLflow recorded."""
    from dynamicrubric.stages.declarations import STAGES

    stage = STAGES[args.stage_name]
    taken = [p.name for p in stage.params] + [m.name for m in stage.models] + [d.name for d in stage.inputs]
    outputs = {f"out_{d.name}": getattr(args, f"out_{d.name}") or "" for d in stage.outputs}
    if args.from_run:
        given = [
            _flag(n) for n in (*taken, "round", "config", "preset") if getattr(args, n, None) is not None
        ]
        if given:
            raise SystemExit(f"error: --from-run takes {', '.join(given)} from the run; leave them out")
        from dynamicrubric.stages.rerun import rerun

        counts = rerun(stage.name, _tracking_uri(args), args.from_run, args.from_task, outputs)
        return _print_counts(stage.command, counts)
    missing = [_flag(d.name) for d in stage.inputs if not d.optional and getattr(args, d.name) is None]
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} required (or rerun a task with --from-run)")
    from dynamicrubric.stages.runner import execute

    values = {n: getattr(args, n) for n in taken if getattr(args, n) is not None}
    counts = execute(stage, _config(args), "", args.round or 0, {**values, **outputs})
    return _print_counts(stage.command, counts)


def _tracking_uri(args: argparse.Namespace) -> str:
    import os

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + os.path.abspath(uri.removeprefix("sqlite:///"))
    return uri


def cmd_run(args: argparse.Namespace) -> int:
    from dynamicrubric.localrun.launch import run_local
    from dynamicrubric.localrun.round_table import report
    from dynamicrubric.pipelines.run_plan import segments, task_count

    cfg = _config_with_rounds(args)
    chain = segments(cfg)
    runs = f" in {len(chain)} chained runs" if len(chain) > 1 else ""
    tasks = sum(task_count(cfg, last - first + 1) for first, last in chain)
    print(
        f"dynrubric run: preset {cfg.preset}, {cfg.pipeline.rounds} round(s){runs}, {tasks} tasks, "
        f"pipeline root {cfg.pipeline.pipeline_root}; a line per task as it ends "
        f"(its full output: task.log in its folder{'' if args.verbose else ', or --verbose'})",
        flush=True,
    )
    result = run_local(cfg, verbose=args.verbose, fresh=args.fresh)
    page = ""
    if result.parent_run_id and result.run_dirs:
        from dynamicrubric.localrun.run_page import PAGE_NAME, write_page

        started = time.perf_counter()
        page = str(write_page(cfg, result.parent_run_id, Path(result.run_dirs[0]) / PAGE_NAME))
        logging.getLogger(__name__).debug("run report page written in %.1f s", time.perf_counter() - started)
    sys.stdout.write(report(cfg, result, page=page))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """The run report page of a finished pipeline run (local or on a cluster), from MLflow."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from dynamicrubric.infra import tracking, tracking_runs
    from dynamicrubric.infra.config_loading import config_from_yaml
    from dynamicrubric.localrun.run_page import write_page
    from dynamicrubric.stages.rerun import pipeline_config

    uri = _tracking_uri(args)
    try:
        parent = mlflow.MlflowClient(tracking_uri=uri).get_run(args.run_id)
    except MlflowException:
        raise SystemExit(f"error: {args.run_id}: no such MLflow run in {uri}") from None
    if parent.data.tags.get(tracking.STAGE_TAG) != "pipeline":
        raise SystemExit(f"error: {args.run_id} is not a pipeline's parent run (MLflow shows it under one)")
    cfg = config_from_yaml(pipeline_config(uri, parent))
    cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"mlflow_tracking_uri": uri})})
    with _mlflow_env(uri):
        tracking_runs.settle_spans(cfg, args.run_id)  # a cluster run has no `dynrubric run` to end its spans
        path = write_page(cfg, args.run_id, args.out or f"report-{args.run_id}.html")
    print(f"Run report: {path.resolve()}")
    return 0


def cmd_items_export(args: argparse.Namespace) -> int:
    """The useful items (all with --all) of one round of a pipeline run, from its evaluate's `items`."""
    from dynamicrubric.evaluation.item_usefulness import export_format, export_items, find_items_artifact
    from dynamicrubric.stages.rerun import check_existing_store
    from dynamicrubric.stages.runner import preflight

    if args.round_idx < 0:
        raise ValueError(f"--round: expected 0 or more, got {args.round_idx}")
    export_format(args.out)  # a wrong extension is refused before MLflow is opened
    uri = _tracking_uri(args)
    check_existing_store(uri)
    found = find_items_artifact(uri, args.run, args.round_idx)
    preflight(args.out, inputs=[found.uri])  # never over the artifact itself, nor a folder
    written, total = export_items(found.uri, args.out, everything=args.all)
    where = f"round {args.round_idx} of run {found.pipeline_run_id}"
    if written == 0 and total:
        print(
            f"items export: none of round {args.round_idx}'s {total} items is useful; wrote an empty {args.out}"
        )
    elif written == 0:
        print(f"items export: {where} has no rubric items; wrote an empty {args.out}")
    else:
        what = "items" if args.all else "useful items"
        print(f"items export: wrote {written} of {total} items of {where} to {args.out} ({what})")
    return 0


@contextlib.contextmanager
def _mlflow_env(uri: str):
    """MLFLOW_TRACKING_URI set to `uri` (tracking_uri() reads it before the config) for a while."""
    import os

    before = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before


def cmd_compile(args: argparse.Namespace) -> int:
    from dynamicrubric.localrun.launch import compile_to

    for path in compile_to(_config_with_rounds(args), args.out):
        print(path)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    import functools
    import tempfile

    from dynamicrubric.localrun.launch import submit

    cfg = _config_with_rounds(args)
    with tempfile.TemporaryDirectory() as tmp:
        say = functools.partial(print, flush=True)  # a chain's progress shows as it happens
        submit(
            cfg,
            args.host,
            args.experiment,
            args.run_name,
            f"{tmp}/pipeline.yaml",
            poll_s=args.poll_seconds,
            say=say,
        )
    return 0


def _config_with_rounds(args: argparse.Namespace):
    from dynamicrubric.infra.config_loading import load_config

    rounds = getattr(args, "rounds", None)
    if rounds is not None and rounds < 1:  # checked by value: 0 is falsy and meant the config's rounds
        raise ConfigError(f"--rounds: expected at least 1 round, got {rounds}")
    per_run = getattr(args, "rounds_per_run", None)
    if per_run is not None and per_run < 1:
        raise ConfigError(f"--rounds-per-run: expected at least 1 round, got {per_run}")
    pipeline = {k: v for k, v in (("rounds", rounds), ("rounds_per_run", per_run)) if v is not None}
    overrides = {"pipeline": pipeline} if pipeline else None
    return load_config(args.config, preset=args.preset, overrides=overrides)


def _add_round_flags(p: argparse.ArgumentParser) -> None:
    """run, compile and submit: how many rounds, and how many a run of a chain holds."""
    p.add_argument("--rounds", type=int, help="override pipeline.rounds")
    p.add_argument(
        "--rounds-per-run",
        type=int,
        help="override pipeline.rounds_per_run (a chain of runs of this many rounds)",
    )


def _stage_parser(sub, name: str, help_text: str, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
    p.add_argument("--config", metavar="FILE", help="YAML config laid over the preset")
    p.add_argument("--preset", help="named preset (tiny, local, paper); default: the config's, else local")
    p.set_defaults(func=func)
    return p


class _Parser(argparse.ArgumentParser):
    """Usage mistakes as one line, like every other error (`--help` still shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {one_line(message)} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dynrubric",
        description="DynamicRubric: evaluator-policy co-evolution for LLM post-training, on Kubeflow Pipelines.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging; `run` also shows every task's own output"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "validate", help="check artifacts against the contract (prints kind and rows, or the error)"
    )
    p.add_argument("uris", nargs="+", metavar="URI", help="artifact path, file:// or s3:// URI")
    p.set_defaults(func=cmd_validate)

    model = sub.add_parser("model", help="built-in models").add_subparsers(
        dest="model_command", required=True
    )
    p = model.add_parser(
        "prepare", help="build or fetch a built-in model into the cache and print its folder"
    )
    p.add_argument("name", help="smollm2-135m-instruct | tiny-random")
    p.set_defaults(func=cmd_model_prepare)

    p = _stage_parser(
        sub, "run", "run the whole co-evolution pipeline locally (kfp.local, MLflow in sqlite)", cmd_run
    )
    _add_round_flags(p)
    p.add_argument(
        "--fresh",
        action="store_true",
        help="run every task again under a new run name (by default a rerun of the same config is "
        "taken from the cache)",
    )
    p = _stage_parser(sub, "compile", "compile the pipeline to a KFP YAML package", cmd_compile)
    p.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="the package; with rounds_per_run one per segment beside it (FILE-rounds-01-03.yaml, ...) "
        "or, for a folder, in it",
    )
    _add_round_flags(p)
    p = _stage_parser(
        sub, "submit", "compile and submit the pipeline to a Kubeflow Pipelines host", cmd_submit
    )
    p.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://localhost:8080")
    p.add_argument("--experiment", help="KFP experiment (default: pipeline.experiment)")
    p.add_argument("--run-name", help="KFP run name (default: derived from the config)")
    _add_round_flags(p)
    p.add_argument(
        "--poll-seconds",
        type=float,
        default=30.0,
        help="a chained run: how often to ask whether a segment's run has ended (default: 30)",
    )

    p = sub.add_parser(
        "report", help="write the run report page (HTML) of a pipeline run from MLflow and log it to the run"
    )
    p.add_argument("run_id", metavar="RUN_ID", help="the pipeline's parent MLflow run id")
    p.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    )
    p.add_argument("--out", metavar="FILE", help="where to write the page (default: report-RUN_ID.html)")
    p.set_defaults(func=cmd_report)

    items = sub.add_parser("items", help="rubric items of a pipeline run").add_subparsers(
        dest="items_command", required=True, metavar="COMMAND"
    )
    p = items.add_parser(
        "export",
        help="write the items of a round that split its responses and agree with gold (JSONL or Parquet)",
    )
    p.add_argument("run", metavar="RUN", help="the pipeline's parent MLflow run id, or its run name")
    p.add_argument("--round", type=int, required=True, dest="round_idx", metavar="N", help="the round")
    p.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="FILE.jsonl (one item a line) or FILE.parquet (an artifact)",
    )
    p.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    )
    p.add_argument("--all", action="store_true", help="every item of the round, useful or not")
    p.set_defaults(func=cmd_items_export)

    stage = sub.add_parser("stage", help="run one pipeline stage on artifact URIs (local paths or s3://)")
    _add_stage_parsers(stage.add_subparsers(dest="stage", required=True, metavar="NAME"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    stderr, sys.stderr = sys.stderr, LineEnds(sys.stderr)
    try:
        return _run(args, sys.stderr)
    finally:
        sys.stderr = stderr


def _run(args: argparse.Namespace, stderr: LineEnds) -> int:
    logs.setup(args.verbose)
    logs.skip_the_exit_collection()
    from dynamicrubric.infra.stopping import Stopped, raise_on_stop_signals

    raise_on_stop_signals()
    try:
        return args.func(args)
    except Stopped as e:  # Ctrl-C or a pod's stop: everything above has been cleaned up on the way
        error_line(f"error: stopped by {e.name}", stderr)
        return e.exit_code
    except KeyboardInterrupt:
        error_line("error: interrupted", stderr)
        return 130
    except Exception as e:
        if args.verbose:
            logging.exception("%s failed", args.command)
        error_line(f"error: {describe_error(e)}", stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
