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
from dynamicrubric.rerun import RerunError
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


def _check_shard(args: argparse.Namespace) -> None:
    from dynamicrubric.steps import check_shard

    check_shard(args.shard, args.num_shards)


def _preflight(*uris: str, inputs: tuple[str, ...] = ()) -> None:
    """Check the outputs can be written, and are not at an input's path, before any input is read or
    model loaded (the same check as the pipeline's steps)."""
    from dynamicrubric.steps import preflight

    preflight(*uris, inputs=inputs)


def cmd_rollout(args: argparse.Namespace) -> int:
    from dynamicrubric.rollout import run_rollout

    if args.from_run:
        return _print_counts("rollout", _rerun("rollout", args))
    _require(args, "prompts")
    _check_shard(args)
    cfg = _config(args)
    _preflight(args.out, inputs=(args.prompts,))
    counts = run_rollout(
        args.prompts,
        args.out,
        cfg,
        policy=args.policy,
        seed=args.seed,
        shard=args.shard,
        num_shards=args.num_shards,
    )
    return _print_counts("rollout", counts)


def cmd_rubrics(args: argparse.Namespace) -> int:
    from dynamicrubric.rubrics import run_rubrics

    if args.from_run:
        return _print_counts("rubrics", _rerun("rubrics", args))
    _require(args, "candidate_sets")
    cfg = _config(args)
    _preflight(args.out, inputs=(args.candidate_sets,))
    counts = run_rubrics(
        args.candidate_sets,
        args.out,
        cfg,
        generator=args.generator,
        samples=args.samples,
        variant=args.variant,
        seed=args.seed,
    )
    return _print_counts("rubrics", counts)


def cmd_judge(args: argparse.Namespace) -> int:
    from dynamicrubric.judge import run_judge

    if args.from_run:
        return _print_counts("judge", _rerun("judge", args))
    _require(args, "candidate_sets")
    cfg = _config(args)
    _preflight(args.out, inputs=(args.candidate_sets, args.rubrics))
    counts = run_judge(args.candidate_sets, args.out, cfg, rubrics_uri=args.rubrics, verifier=args.verifier)
    return _print_counts("judge", counts)


# Options a --from-run rerun takes from the run instead (given with it, they would be ignored).
FROM_RUN_CONFLICTS = (
    "prompts",
    "candidate_sets",
    "rubrics",
    "policy",
    "generator",
    "verifier",
    "seed",
    "samples",
    "variant",
    "config",
    "preset",
)


def _from_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from-run",
        metavar="RUN_ID",
        help="rerun a task of a finished pipeline run: the MLflow run id of the task (or, with --from-task, "
        "of the pipeline run); config, seed, samples, model references and inputs come from MLflow",
    )
    p.add_argument(
        "--from-task", metavar="ROUND/NAME", help="with --from-run PIPELINE_RUN_ID: e.g. 1/generator-judge-0"
    )
    p.add_argument(
        "--tracking-uri",
        metavar="URI",
        help="MLflow to read the run from (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    )


def _require(args: argparse.Namespace, *names: str) -> None:
    missing = ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) is None]
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} required (or rerun a task with --from-run)")


def _rerun(stage: str, args: argparse.Namespace) -> dict:
    import os

    from dynamicrubric.rerun import rerun

    given = [
        "--" + n.replace("_", "-") for n in FROM_RUN_CONFLICTS if getattr(args, n, None) not in (None, False)
    ]
    if given:
        raise SystemExit(f"error: --from-run takes {', '.join(given)} from the run; leave them out")
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + os.path.abspath(uri.removeprefix("sqlite:///"))
    return rerun(stage, uri, args.from_run, args.from_task, args.out)


def cmd_run(args: argparse.Namespace) -> int:
    from dynamicrubric.launch import report, run_local
    from dynamicrubric.pipelines.co_evolution import task_count

    cfg = _config_with_rounds(args)
    print(
        f"dynrubric run: preset {cfg.preset}, {cfg.pipeline.rounds} round(s), {task_count(cfg)} tasks, "
        f"pipeline root {cfg.pipeline.pipeline_root}; a line per task as it ends "
        f"(its full output: task.log in its folder{'' if args.verbose else ', or --verbose'})",
        flush=True,
    )
    result = run_local(cfg, verbose=args.verbose, fresh=args.fresh)
    sys.stdout.write(report(cfg, result))
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from dynamicrubric.launch import compile_to

    print(compile_to(_config_with_rounds(args), args.out))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    import tempfile

    from dynamicrubric.launch import submit

    cfg = _config_with_rounds(args)
    with tempfile.TemporaryDirectory() as tmp:
        run_id = submit(cfg, args.host, args.experiment, args.run_name, f"{tmp}/pipeline.yaml")
    print(f"submitted run {run_id} to {args.host}")
    return 0


def _config_with_rounds(args: argparse.Namespace):
    from dynamicrubric.config import load_config

    rounds = getattr(args, "rounds", None)
    if rounds is not None and rounds < 1:  # checked by value: 0 is falsy and meant the config's rounds
        raise ConfigError(f"--rounds: expected at least 1 round, got {rounds}")
    overrides = {"pipeline": {"rounds": rounds}} if rounds is not None else None
    return load_config(args.config, preset=args.preset, overrides=overrides)


# The remaining stages call the same step functions the KFP components call (without MLflow), so
# rerunning one on a finished run's artifact URIs reproduces that task's output.


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from dynamicrubric import steps

    counts = steps.prepare_data(_config(args).to_yaml(), "", args.out_train, args.out_eval, args.out_anchors)
    return _print_counts("prepare-data", counts)


def cmd_candidates(args: argparse.Namespace) -> int:
    from dynamicrubric import steps

    _check_shard(args)
    counts = steps.candidates(
        _config(args).to_yaml(),
        "",
        0,
        args.rollouts,
        args.prompts,
        args.anchor_lists,
        args.shard,
        args.num_shards,
        args.out,
        args.out_anchors,
    )
    return _print_counts("candidates", counts)


def cmd_aggregate(args: argparse.Namespace) -> int:
    from dynamicrubric import steps

    overall = steps.aggregate(
        _config(args).to_yaml(),
        "",
        args.round,
        args.label,
        args.judgments,
        args.candidate_sets,
        args.rubrics or [],
        args.anchors or [],
        args.out_scores,
        args.out_rewards,
        args.out_diagnostics,
        args.out_metrics,
        args.prompts or "",
    )
    return _print_counts("aggregate", overall)


def cmd_train_evaluator(args: argparse.Namespace) -> int:
    from dynamicrubric import steps

    cfg = _config(args)
    result = steps.train_evaluator(
        cfg.to_yaml(),
        "",
        args.round,
        args.candidate_sets,
        args.anchors or [],
        args.generator or cfg.models.generator,
        args.verifier or cfg.models.verifier,
        args.out,
        args.out_steps,
        args.metrics,
    )
    return _print_counts("train-evaluator", result)


def cmd_train_policy(args: argparse.Namespace) -> int:
    from dynamicrubric import steps

    cfg = _config(args)
    result = steps.train_policy(
        cfg.to_yaml(),
        "",
        args.round,
        args.prompts,
        args.policy or cfg.models.policy,
        args.generator or cfg.models.generator,
        args.verifier or cfg.models.verifier,
        args.out,
        args.out_steps,
        args.metrics,
    )
    return _print_counts("train-policy", result)


def cmd_evaluate_samples(args: argparse.Namespace) -> int:
    from dynamicrubric import steps

    cfg = _config(args)
    result = steps.evaluate_samples(
        cfg.to_yaml(), "", args.round, args.prompts, args.policy, args.previous_policy or "", args.out
    )
    return _print_counts("evaluate-samples", result)


def cmd_check_samples(args: argparse.Namespace) -> int:
    from dynamicrubric import steps

    cfg = _config(args)
    result = steps.check_samples(cfg.to_yaml(), "", args.round, args.prompts, args.samples, args.out)
    return _print_counts("check-samples", result)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from dynamicrubric import steps

    cfg = _config(args)
    if not args.policy and not args.samples:
        raise ValueError("evaluate: give --policy, or --samples and --outcomes")
    result = steps.evaluate(
        cfg.to_yaml(),
        "",
        args.round,
        args.prompts,
        args.policy or "",
        args.generator or cfg.models.generator,
        args.verifier or cfg.models.verifier,
        args.previous_policy or "",
        args.out,
        args.plots,
        args.units or "",
        samples=args.samples or "",
        outcomes=args.outcomes or "",
    )
    return _print_counts("evaluate", result)


def _stage_parser(sub, name: str, help_text: str, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text)
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
    p.add_argument("--rounds", type=int, help="override pipeline.rounds")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="run every task again under a new run name (by default a rerun of the same config is "
        "taken from the cache)",
    )
    p = _stage_parser(sub, "compile", "compile the pipeline to a KFP YAML package", cmd_compile)
    p.add_argument("--out", required=True, metavar="FILE")
    p.add_argument("--rounds", type=int, help="override pipeline.rounds")
    p = _stage_parser(
        sub, "submit", "compile and submit the pipeline to a Kubeflow Pipelines host", cmd_submit
    )
    p.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://localhost:8080")
    p.add_argument("--experiment", help="KFP experiment (default: pipeline.experiment)")
    p.add_argument("--run-name", help="KFP run name (default: derived from the config)")
    p.add_argument("--rounds", type=int, help="override pipeline.rounds")

    stage = sub.add_parser("stage", help="run one pipeline stage on artifact URIs (local paths or s3://)")
    stages = stage.add_subparsers(dest="stage", required=True, metavar="NAME")

    p = _stage_parser(stages, "rollout", "the policy samples K responses per prompt", cmd_rollout)
    p.add_argument("--prompts", metavar="URI", help="prompts artifact (required without --from-run)")
    p.add_argument("--out", required=True, metavar="URI", help="rollouts artifact to write")
    _from_run_options(p)
    p.add_argument("--policy", help="policy model reference (default: models.policy)")
    p.add_argument("--seed", type=int, help="sampling seed (default: the config's seed)")
    p.add_argument("--shard", type=int, default=0, help="this shard's index")
    p.add_argument("--num-shards", type=int, default=1, help="number of prompt shards")

    p = _stage_parser(
        stages, "rubrics", "the generator writes weighted rubric items per candidate set", cmd_rubrics
    )
    p.add_argument(
        "--candidate-sets",
        metavar="URI",
        help="candidate sets (a rollouts artifact); required without --from-run",
    )
    p.add_argument("--out", required=True, metavar="URI", help="rubrics artifact to write")
    _from_run_options(p)
    p.add_argument("--generator", help="generator model reference (default: models.generator)")
    p.add_argument(
        "--samples", type=int, help="rubric samples G per candidate set (default: rubrics.samples)"
    )
    p.add_argument("--variant", choices=["dynamic", "static"], help="default: rubrics.variant")
    p.add_argument("--seed", type=int, help="sampling seed (default: the config's seed)")

    p = _stage_parser(stages, "judge", "the verifier answers yes/no per rubric item and response", cmd_judge)
    p.add_argument(
        "--candidate-sets",
        metavar="URI",
        help="candidate sets (a rollouts artifact); required without --from-run",
    )
    p.add_argument("--rubrics", metavar="URI", help="rubrics artifact; omit for the pointwise judge")
    p.add_argument("--out", required=True, metavar="URI", help="judgments artifact to write")
    _from_run_options(p)
    p.add_argument("--verifier", help="verifier model reference (default: models.verifier)")

    p = _stage_parser(
        stages, "prepare-data", "training and held-out prompts, and anchor lists", cmd_prepare_data
    )
    p.add_argument("--out-train", required=True, metavar="URI", help="training prompts artifact to write")
    p.add_argument("--out-eval", required=True, metavar="URI", help="held-out prompts artifact to write")
    p.add_argument("--out-anchors", required=True, metavar="URI", help="anchor lists artifact to write")

    p = _stage_parser(stages, "candidates", "candidate sets and their reference rankings", cmd_candidates)
    p.add_argument("--rollouts", required=True, metavar="URI")
    p.add_argument("--prompts", required=True, metavar="URI", help="the prompts the rollouts answer")
    p.add_argument(
        "--anchor-lists", required=True, metavar="URI", help="human-ranked lists (anchors artifact)"
    )
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--out", required=True, metavar="URI", help="candidate sets (rollouts artifact) to write")
    p.add_argument("--out-anchors", required=True, metavar="URI", help="rankings (anchors artifact) to write")

    p = _stage_parser(stages, "aggregate", "scores, generator rewards and signal diagnostics", cmd_aggregate)
    p.add_argument("--judgments", required=True, nargs="+", metavar="URI", help="judgments (one per shard)")
    p.add_argument(
        "--candidate-sets", required=True, nargs="+", metavar="URI", help="the judged candidate sets"
    )
    p.add_argument("--rubrics", nargs="+", metavar="URI", help="rubrics (omit for the pointwise judge)")
    p.add_argument(
        "--anchors", nargs="+", metavar="URI", help="reference rankings (for R_anchor and the gap)"
    )
    p.add_argument(
        "--prompts", metavar="URI", help="without --anchors: rank responses by correctness for the gap"
    )
    p.add_argument("--out-scores", required=True, metavar="URI")
    p.add_argument("--out-rewards", required=True, metavar="URI")
    p.add_argument("--out-diagnostics", required=True, metavar="URI")
    p.add_argument("--out-metrics", required=True, metavar="URI")
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--label", default="policy", help="which stage of the round: generator | policy")

    p = _stage_parser(
        stages,
        "train-evaluator",
        "online GRPO on the generator over candidate sets, rewarded with R_disc + λ·R_anchor",
        cmd_train_evaluator,
    )
    p.add_argument(
        "--candidate-sets", required=True, nargs="+", metavar="URI", help="candidate sets (one per shard)"
    )
    p.add_argument("--anchors", nargs="+", metavar="URI", help="their reference rankings (for R_anchor)")
    p.add_argument("--generator", help="the generator to start from (default: models.generator)")
    p.add_argument("--verifier", help="the frozen verifier (default: models.verifier)")
    p.add_argument("--out", required=True, metavar="URI", help="checkpoint folder to write")
    p.add_argument("--out-steps", required=True, metavar="URI", help="folder for the per-step artifacts")
    p.add_argument("--metrics", required=True, metavar="URI", help="per-step metrics artifact to write")
    p.add_argument("--round", type=int, default=0)

    p = _stage_parser(
        stages,
        "train-policy",
        "online GRPO on the policy, rewarded by the configured evaluator",
        cmd_train_policy,
    )
    p.add_argument("--prompts", required=True, metavar="URI", help="the prompt pool (prompts artifact)")
    p.add_argument("--policy", help="the policy to start from (default: models.policy)")
    p.add_argument("--generator", help="G_t, for the dynamic and static rewards (default: models.generator)")
    p.add_argument("--verifier", help="the frozen verifier (default: models.verifier)")
    p.add_argument("--out", required=True, metavar="URI", help="checkpoint folder to write")
    p.add_argument("--out-steps", required=True, metavar="URI", help="folder for the per-step artifacts")
    p.add_argument("--metrics", required=True, metavar="URI", help="per-step metrics artifact to write")
    p.add_argument("--round", type=int, default=0)

    p = _stage_parser(
        stages,
        "evaluate-samples",
        "evaluate's first phase: the policy's held-out samples (and the previous policy's, for the win rate)",
        cmd_evaluate_samples,
    )
    p.add_argument("--prompts", required=True, metavar="URI", help="held-out prompts artifact")
    p.add_argument("--policy", required=True, help="policy reference or checkpoint")
    p.add_argument("--previous-policy", help="for the win rate of --policy over it")
    p.add_argument("--out", required=True, metavar="URI", help="rollouts artifact to write")
    p.add_argument("--round", type=int, default=0)

    p = _stage_parser(
        stages,
        "check-samples",
        "evaluate's second phase: the held-out samples scored by their tasks' checkers (code in the sandbox)",
        cmd_check_samples,
    )
    p.add_argument("--prompts", required=True, metavar="URI", help="held-out prompts artifact")
    p.add_argument("--samples", required=True, metavar="URI", help="rollouts artifact of evaluate-samples")
    p.add_argument("--out", required=True, metavar="URI", help="outcomes artifact to write")
    p.add_argument("--round", type=int, default=0)

    p = _stage_parser(
        stages, "evaluate", "evaluator accuracy and policy quality on held-out data", cmd_evaluate
    )
    p.add_argument("--prompts", required=True, metavar="URI", help="held-out prompts artifact")
    p.add_argument("--policy", help="policy reference or checkpoint (not with --samples)")
    p.add_argument("--samples", metavar="URI", help="the held-out samples, from evaluate-samples")
    p.add_argument("--outcomes", metavar="URI", help="their checker scores, from check-samples")
    p.add_argument("--generator", help="generator reference or checkpoint (default: models.generator)")
    p.add_argument("--verifier", help="default: models.verifier")
    p.add_argument("--previous-policy", help="for the win rate of --policy over it")
    p.add_argument("--out", required=True, metavar="URI", help="metrics artifact to write")
    p.add_argument("--plots", required=True, metavar="DIR", help="folder for the PNG plots")
    p.add_argument(
        "--units", metavar="URI", help="units artifact to write (per prompt and pair, for intervals)"
    )
    p.add_argument("--round", type=int, default=0)
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
