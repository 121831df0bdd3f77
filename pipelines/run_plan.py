"""What a run of a config is, before any task exists: its variant, what the signal guard's alarm does,
its default name, whether a round's evaluate is split in three, how many tasks it has, the segments a
long schedule is compiled as and the start parameters of a later segment. Apart from co_evolution.py
because the command line, the local launcher and the report read these without building a pipeline."""

import hashlib
import sys

import yaml

from dynamicrubric.infra.config import Config, policy_variant


def split_evaluate(cfg: Config) -> bool:
    """Whether a round's evaluate is three tasks: evaluate-samples (the policies sample, on the
    evaluate's GPUs) → check-samples (their code checked, CPU) → evaluate (G and V score, metrics).
    Where evaluate has no GPU it is one task that does all three, as the split costs two task starts."""
    return bool(cfg.pipeline.stage_resources("evaluate").gpus)


def pipeline_variant(cfg: Config) -> str:
    """dynamic | static (rubrics.variant), pointwise or verifiable (judge.variant)."""
    return policy_variant(cfg)


def guard_action(cfg: Config) -> str:
    """What the signal guard's alarm does in this run (guard.action); the verifiable baseline has no
    evaluator to guard, and a disabled guard no alarm."""
    return cfg.guard.action if cfg.guard.enabled and pipeline_variant(cfg) != "verifiable" else "warn"


def default_run_name(cfg: Config) -> str:
    """Stable for a given config, so a rerun hits the cache and reuses its MLflow parent run."""
    digest = hashlib.sha256(cfg.to_yaml().encode()).hexdigest()[:10]
    return f"{cfg.preset}-{pipeline_variant(cfg)}-{digest}"


def one_line_yaml(cfg: Config) -> str:
    """`cfg` as single-line flow YAML; `config_from_yaml` reads it back to an equal Config."""
    return yaml.safe_dump(
        cfg.model_dump(mode="json"), default_flow_style=True, width=sys.maxsize, sort_keys=False
    ).strip()


def task_count(cfg: Config, rounds: int | None = None) -> int:
    """Tasks of a run of `rounds` rounds (default: all of the config's, in one run)."""
    shards, variant = cfg.pipeline.shards, pipeline_variant(cfg)
    audit = {"dynamic": 5 * shards + 2, "static": 3 * shards + 1, "pointwise": 2 * shards + 1}.get(variant, 0)
    generator = 2 * shards + 1 if variant == "dynamic" else 0
    evaluate = 3 if split_evaluate(cfg) else 1
    rounds = cfg.pipeline.rounds if rounds is None else rounds
    rollbacks = min(rounds, cfg.pipeline.rounds - 1) if guard_action(cfg) == "rollback" else 0
    return 3 + rounds * (generator + audit + 1 + evaluate) + rollbacks


def segments(cfg: Config) -> list[tuple[int, int]]:
    """The (first, last) rounds of each run of a chained schedule (`pipeline.rounds_per_run`); one
    segment of all rounds when it is not set."""
    rounds, per_run = cfg.pipeline.rounds, cfg.pipeline.rounds_per_run or cfg.pipeline.rounds
    return [(first, min(first + per_run - 1, rounds)) for first in range(1, rounds + 1, per_run)]


def start_parameters(cfg: Config) -> tuple[str, ...]:
    """The pipeline parameters of a segment after the first: where P_{first-1} and (for the dynamic
    variant, the one that trains a generator) G_{first-1} are, as paths or URIs of the previous
    segment's final checkpoints (what the training stages' MLflow LoggedModels record). Parameters
    rather than constants, so that a segment's package is compiled before its start exists."""
    return ("start_policy", "start_generator") if pipeline_variant(cfg) == "dynamic" else ("start_policy",)
