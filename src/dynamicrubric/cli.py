"""`dynrubric`: the command line. Each command is a thin wrapper over a library function."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from dynamicrubric import logs
from dynamicrubric.artifacts import KIND_KEY, ArtifactError
from dynamicrubric.config import ConfigError
from dynamicrubric.launch import LaunchError
from dynamicrubric.stages.rerun import RerunError
from dynamicrubric.store import StoreError

MAX_ERROR_CHARS = 300  # an error echoes user data (an id, a path): a 4 MB id must not flood the terminal

# Errors that describe bad input or an unusable store/config: their message is the whole story.
USER_ERRORS = (ArtifactError, ConfigError, StoreError, LaunchError, RerunError, ValueError, OSError)


def one_line(message: object, limit: int = MAX_ERROR_CHARS) -> str:
    """`message` on one line (whitespace collapsed), cut to `limit` characters with a note of how many
    more there were."""
    text = " ".join(str(message).split())
    if len(text) <= limit:
        return text
    keep = limit - len(f"... ({len(text)} more chars)")  # the count's width is at most this
    return f"{text[:keep]}... ({len(text) - keep} more chars)"


def describe_error(err: BaseException) -> str:
    """One line for the user. Bad-input errors say what is wrong themselves; anything else is named by
    its type, since it is a bug to report rather than an input to fix."""
    from dynamicrubric.engines import EngineError
    from dynamicrubric.models import ModelError

    if isinstance(err, USER_ERRORS + (EngineError, ModelError)) and str(err):
        return one_line(err)
    return one_line(f"{type(err).__name__}: {err} (an internal error: rerun with -v for the traceback)")


def cmd_validate(args: argparse.Namespace) -> int:
    from dynamicrubric.artifacts import read_artifact

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
    from dynamicrubric.config import load_config

    return load_config(args.config, preset=args.preset)


def _print_counts(stage: str, counts: dict) -> int:
    print(
        f"{stage}: "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in counts.items())
    )
    return 0


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from dynamicrubric.models import prepare_model

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
    from dynamicrubric.launch import run_local
    from dynamicrubric.pipelines.co_evolution import segments, task_count
    from dynamicrubric.round_table import report

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
    sys.stdout.write(report(cfg, result))
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from dynamicrubric.launch import compile_to

    for path in compile_to(_config_with_rounds(args), args.out):
        print(path)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    import functools
    import tempfile

    from dynamicrubric.launch import submit

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
    from dynamicrubric.config import load_config

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

    stage = sub.add_parser("stage", help="run one pipeline stage on artifact URIs (local paths or s3://)")
    _add_stage_parsers(stage.add_subparsers(dest="stage", required=True, metavar="NAME"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.setup(args.verbose)
    logs.skip_the_exit_collection()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.verbose:
            logging.exception("%s failed", args.command)
        print(f"error: {describe_error(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
