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
