"""One KFP component per pipeline stage. Each body only calls `dynamicrubric.steps`.

Lightweight components (`install_kfp_package=False`, nothing to pip-install): the one authoring
style that runs both under `kfp.local.SubprocessRunner` and on a cluster, where the image already
holds the project. `build(image)` binds every stage function to the image a config names.

A model input is a reference string (a built-in name, hub id or folder) plus an optional checkpoint
artifact from an earlier round; when the checkpoint is given it wins.
"""

from types import SimpleNamespace
from typing import Dict, List  # KFP parses typing.List, not list[...]

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output


def start_tracking(config_yaml: str, run_name: str):
    from dynamicrubric import steps

    steps.start_tracking(config_yaml, run_name)


def stage_models(plan: Dict[str, str]) -> Dict[str, str]:
    """Copy each base model to where the plan says tasks read it (models.staging_plan)."""
    import logging

    from dynamicrubric.models import stage_models as run

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(plan)


def prepare_data(
    config_yaml: str,
    run_name: str,
    train_prompts: Output[Dataset],
    eval_prompts: Output[Dataset],
    anchor_lists: Output[Dataset],
):
    from dynamicrubric import steps

    steps.prepare_data(config_yaml, run_name, train_prompts.path, eval_prompts.path, anchor_lists.path)


def rollout(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    label: str,
    shard: int,
    num_shards: int,
    seed: int,
    policy_ref: str,
    prompts: Input[Dataset],
    rollouts: Output[Dataset],
    policy_ckpt: Input[Model] = None,
):
    from dynamicrubric import steps

    policy = policy_ckpt.path if policy_ckpt is not None else policy_ref
    steps.rollout(
        config_yaml,
        run_name,
        round_idx,
        label,
        prompts.path,
        rollouts.path,
        policy,
        shard,
        num_shards,
        seed,
    )


def candidates(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    shard: int,
    num_shards: int,
    rollouts: Input[Dataset],
    prompts: Input[Dataset],
    anchor_lists: Input[Dataset],
    candidate_sets: Output[Dataset],
    anchors: Output[Dataset],
):
    from dynamicrubric import steps

    steps.candidates(
        config_yaml,
        run_name,
        round_idx,
        rollouts.path,
        prompts.path,
        anchor_lists.path,
        shard,
        num_shards,
        candidate_sets.path,
        anchors.path,
    )


def rubrics(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    label: str,
    shard: int,
    samples: int,
    seed: int,
    generator_ref: str,
    candidate_sets: Input[Dataset],
    rubrics: Output[Dataset],
    generator_ckpt: Input[Model] = None,
):
    from dynamicrubric import steps

    generator = generator_ckpt.path if generator_ckpt is not None else generator_ref
    steps.rubrics(
        config_yaml,
        run_name,
        round_idx,
        label,
        candidate_sets.path,
        rubrics.path,
        generator,
        samples,
        shard,
        seed,
    )


def judge(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    label: str,
    shard: int,
    verifier_ref: str,
    candidate_sets: Input[Dataset],
    judgments: Output[Dataset],
    rubrics: Input[Dataset] = None,
):
    from dynamicrubric import steps

    steps.judge(
        config_yaml,
        run_name,
        round_idx,
        label,
        candidate_sets.path,
        rubrics.path if rubrics is not None else "",
        judgments.path,
        verifier_ref,
        shard,
    )


def aggregate(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    label: str,
    judgments: Input[List[Dataset]],
    candidate_sets: Input[List[Dataset]],
    scores: Output[Dataset],
    rewards: Output[Dataset],
    diagnostics: Output[Dataset],
    metrics: Output[Dataset],
    summary: Output[Metrics],
    rubrics: Input[List[Dataset]] = None,
    anchors: Input[List[Dataset]] = None,
    prompts: Input[Dataset] = None,
) -> float:
    from dynamicrubric import steps

    overall = steps.aggregate(
        config_yaml,
        run_name,
        round_idx,
        label,
        [a.path for a in judgments],
        [a.path for a in candidate_sets],
        [a.path for a in rubrics] if rubrics else [],
        [a.path for a in anchors] if anchors else [],
        scores.path,
        rewards.path,
        diagnostics.path,
        metrics.path,
        prompts.path if prompts is not None else "",
    )
    steps.write_kfp_metrics(summary, overall)
    return float(overall.get("tie_rate", 0.0))


def train_evaluator(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    generator_ref: str,
    verifier_ref: str,
    candidate_sets: Input[List[Dataset]],
    anchors: Input[List[Dataset]],
    generator: Output[Model],
    steps: Output[Artifact],
    metrics: Output[Dataset],
    generator_ckpt: Input[Model] = None,
):
    from dynamicrubric import steps as run

    base = generator_ckpt.path if generator_ckpt is not None else generator_ref
    run.train_evaluator(
        config_yaml,
        run_name,
        round_idx,
        [a.path for a in candidate_sets],
        [a.path for a in anchors],
        base,
        verifier_ref,
        generator.path,
        steps.path,
        metrics.path,
    )


def train_policy(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    policy_ref: str,
    generator_ref: str,
    verifier_ref: str,
    prompts: Input[Dataset],
    policy: Output[Model],
    steps: Output[Artifact],
    metrics: Output[Dataset],
    policy_ckpt: Input[Model] = None,
    generator_ckpt: Input[Model] = None,
):
    from dynamicrubric import steps as run

    base = policy_ckpt.path if policy_ckpt is not None else policy_ref
    generator = generator_ckpt.path if generator_ckpt is not None else generator_ref
    run.train_policy(
        config_yaml,
        run_name,
        round_idx,
        prompts.path,
        base,
        generator,
        verifier_ref,
        policy.path,
        steps.path,
        metrics.path,
    )


def evaluate_samples(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    base_policy_ref: str,
    eval_prompts: Input[Dataset],
    policy: Input[Model],
    samples: Output[Dataset],
    previous_policy: Input[Model] = None,
):
    from dynamicrubric import steps

    previous = previous_policy.path if previous_policy is not None else base_policy_ref
    steps.evaluate_samples(
        config_yaml, run_name, round_idx, eval_prompts.path, policy.path, previous, samples.path
    )


def check_samples(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    eval_prompts: Input[Dataset],
    samples: Input[Dataset],
    outcomes: Output[Dataset],
):
    from dynamicrubric import steps

    steps.check_samples(config_yaml, run_name, round_idx, eval_prompts.path, samples.path, outcomes.path)


def evaluate(
    config_yaml: str,
    run_name: str,
    round_idx: int,
    base_policy_ref: str,
    generator_ref: str,
    verifier_ref: str,
    eval_prompts: Input[Dataset],
    metrics: Output[Dataset],
    plots: Output[Artifact],
    units: Output[Dataset],
    summary: Output[Metrics],
    policy: Input[Model] = None,
    generator_ckpt: Input[Model] = None,
    previous_policy: Input[Model] = None,
    samples: Input[Dataset] = None,
    outcomes: Input[Dataset] = None,
):
    """With `samples` and `outcomes` (the split pipeline) it gets no policy model: they say whose."""
    from dynamicrubric import steps

    generator = generator_ckpt.path if generator_ckpt is not None else generator_ref
    previous = previous_policy.path if previous_policy is not None else base_policy_ref
    result = steps.evaluate(
        config_yaml,
        run_name,
        round_idx,
        eval_prompts.path,
        policy.path if policy is not None else "",
        generator,
        verifier_ref,
        previous,
        metrics.path,
        plots.path,
        units.path,
        samples=samples.path if samples is not None else "",
        outcomes=outcomes.path if outcomes is not None else "",
    )
    steps.write_kfp_metrics(summary, result)


STAGES = [
    start_tracking,
    stage_models,
    prepare_data,
    rollout,
    candidates,
    rubrics,
    judge,
    aggregate,
    train_evaluator,
    train_policy,
    evaluate_samples,
    check_samples,
    evaluate,
]


# Stages that run no model run in the smaller CPU image (stage_models only copies weights).
CPU_STAGES = {start_tracking, stage_models, prepare_data, candidates, aggregate, check_samples}


def build(image: str, cpu_image: str) -> SimpleNamespace:
    """Every stage as a KFP component: model stages in `image`, the others in `cpu_image`."""
    return SimpleNamespace(
        **{
            f.__name__: dsl.component(
                f, base_image=cpu_image if f in CPU_STAGES else image, install_kfp_package=False
            )
            for f in STAGES
        }
    )
