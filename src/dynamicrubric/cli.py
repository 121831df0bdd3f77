"""`dynrubric`: the command line. Each command is a thin wrapper over a library function."""

from __future__ import annotations

import argparse
import logging
import sys

from dynamicrubric.artifacts import KIND_KEY, ArtifactError
from dynamicrubric.config import ConfigError
from dynamicrubric.store import StoreError


def cmd_validate(args: argparse.Namespace) -> int:
    from dynamicrubric.artifacts import read_artifact

    failed = 0
    for uri in args.uris:
        try:
            table = read_artifact(uri)
        except (ArtifactError, StoreError) as e:
            print(f"FAIL {e}")
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


def cmd_rollout(args: argparse.Namespace) -> int:
    from dynamicrubric.rollout import run_rollout

    counts = run_rollout(
        args.prompts, args.out, _config(args), policy=args.policy, seed=args.seed,
        shard=args.shard, num_shards=args.num_shards,
    )  # fmt: skip
    return _print_counts("rollout", counts)


def cmd_rubrics(args: argparse.Namespace) -> int:
    from dynamicrubric.rubrics import run_rubrics

    counts = run_rubrics(
        args.rollouts, args.out, _config(args), generator=args.generator, samples=args.samples,
        variant=args.variant, seed=args.seed,
    )  # fmt: skip
    return _print_counts("rubrics", counts)


def cmd_judge(args: argparse.Namespace) -> int:
    from dynamicrubric.judge import run_judge

    counts = run_judge(
        args.rollouts, args.out, _config(args), rubrics_uri=args.rubrics, verifier=args.verifier
    )
    return _print_counts("judge", counts)


def _stage_parser(sub, name: str, help_text: str, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("--config", metavar="FILE", help="YAML config laid over the preset")
    p.add_argument("--preset", help="named preset (tiny, local, paper); default: the config's, else local")
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynrubric",
        description="DynamicRubric: evaluator-policy co-evolution for LLM post-training, on Kubeflow Pipelines.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
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

    stage = sub.add_parser("stage", help="run one pipeline stage on artifact URIs (local paths or s3://)")
    stages = stage.add_subparsers(dest="stage", required=True, metavar="NAME")

    p = _stage_parser(stages, "rollout", "the policy samples K responses per prompt", cmd_rollout)
    p.add_argument("--prompts", required=True, metavar="URI", help="prompts artifact")
    p.add_argument("--out", required=True, metavar="URI", help="rollouts artifact to write")
    p.add_argument("--policy", help="policy model reference (default: models.policy)")
    p.add_argument("--seed", type=int, help="sampling seed (default: the config's seed)")
    p.add_argument("--shard", type=int, default=0, help="this shard's index")
    p.add_argument("--num-shards", type=int, default=1, help="number of prompt shards")

    p = _stage_parser(
        stages, "rubrics", "the generator writes weighted rubric items per candidate set", cmd_rubrics
    )
    p.add_argument("--rollouts", required=True, metavar="URI", help="rollouts artifact (the candidate sets)")
    p.add_argument("--out", required=True, metavar="URI", help="rubrics artifact to write")
    p.add_argument("--generator", help="generator model reference (default: models.generator)")
    p.add_argument(
        "--samples", type=int, help="rubric samples G per candidate set (default: rubrics.samples)"
    )
    p.add_argument("--variant", choices=["dynamic", "static"], help="default: rubrics.variant")
    p.add_argument("--seed", type=int, help="sampling seed (default: the config's seed)")

    p = _stage_parser(stages, "judge", "the verifier answers yes/no per rubric item and response", cmd_judge)
    p.add_argument("--rollouts", required=True, metavar="URI", help="rollouts artifact")
    p.add_argument("--rubrics", metavar="URI", help="rubrics artifact; omit for the pointwise judge")
    p.add_argument("--out", required=True, metavar="URI", help="judgments artifact to write")
    p.add_argument("--verifier", help="verifier model reference (default: models.verifier)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (ArtifactError, ConfigError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
