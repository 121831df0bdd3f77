"""The N-round co-evolution pipeline, built from a config at compile time.

Round t (KFP v2 has no loops: rounds are unrolled when the pipeline is compiled):
  generator stage: P_{t-1} samples K responses → candidate sets (+ anchor lists, ranked by verifiable
                   correctness or by humans) → G rubric samples each → verifier judgments →
                   aggregate (scores, R_disc, R_anchor) → train-evaluator → G_t
  policy stage:    P_{t-1} samples again → G_t writes one rubric per set → judgments → aggregate →
                   train-policy → P_t
  evaluate:        G_t and P_t on held-out prompts and labelled lists, P_t vs P_{t-1}
Rollout, rubrics and judging fan out over prompt shards (ParallelFor) and are collected for
aggregation, so a run grows with the cluster rather than with one node.

Baselines run through the same pipeline: `rubrics.variant: static` scores the policy with rubrics
written from the prompt alone by the untrained generator, and `judge.variant: pointwise` with the
verifier's direct rating; neither has a generator stage.

Each round adds 7·shards + 5 tasks to a dynamic run (4·shards + 3 to a baseline); keep a run under
about 150 tasks, the size a cluster's Argo workflow object allows (etcd's 1.5 MiB cap).
"""

import contextlib
import hashlib
import sys
from collections.abc import Callable

import yaml
from kfp import dsl, kubernetes

from dynamicrubric.components import stages
from dynamicrubric.config import Config
from dynamicrubric.steps import round_seed

S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")
# Stages that run policy-generated code in the sandbox (outcome ranking, HumanEval, the verifiable
# reward). Their pods carry this label, which the cluster's policies in manifests/cluster/gvisor use
# to run them under gVisor.
CODE_STAGES = frozenset({"candidates", "aggregate", "evaluate", "train_policy"})
RUNS_CODE_LABEL = ("dynamicrubric.io/runs-code", "true")


def pipeline_variant(cfg: Config) -> str:
    if cfg.judge.variant == "pointwise":
        return "pointwise"
    return cfg.rubrics.variant  # "dynamic" | "static"


def default_run_name(cfg: Config) -> str:
    """Stable for a given config, so a rerun hits the cache and reuses its MLflow parent run."""
    digest = hashlib.sha256(cfg.to_yaml().encode()).hexdigest()[:10]
    return f"{cfg.preset}-{pipeline_variant(cfg)}-{digest}"


def one_line_yaml(cfg: Config) -> str:
    """`cfg` as single-line flow YAML; `config_from_yaml` reads it back to an equal Config."""
    return yaml.safe_dump(
        cfg.model_dump(mode="json"), default_flow_style=True, width=sys.maxsize, sort_keys=False
    ).strip()


def task_count(cfg: Config) -> int:
    per_round = (
        (7 * cfg.pipeline.shards + 5) if pipeline_variant(cfg) == "dynamic" else (4 * cfg.pipeline.shards + 3)
    )
    if pipeline_variant(cfg) == "pointwise":
        per_round -= cfg.pipeline.shards  # no rubric tasks
    return 2 + cfg.pipeline.rounds * per_round


def _configure(cfg: Config, stage: str) -> Callable[[dsl.PipelineTask, str], dsl.PipelineTask]:
    """Cluster settings for one stage's tasks (the local runner ignores them)."""
    p = cfg.pipeline
    res = p.resources.get(stage)

    def apply(task: dsl.PipelineTask, name: str) -> dsl.PipelineTask:
        task.set_display_name(name)
        task.set_caching_options(p.caching)
        if res is not None:
            task.set_cpu_limit(res.cpu).set_memory_limit(res.memory)
            if res.gpus:
                task.set_accelerator_type(p.accelerator_type).set_accelerator_limit(res.gpus)
                # vLLM and NCCL need a large shared-memory segment
                kubernetes.empty_dir_mount(
                    task, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit=p.shm_size
                )
        if p.s3_secret:
            kubernetes.use_secret_as_env(task, p.s3_secret, {k: k for k in S3_ENV}, optional=True)
        if stage in CODE_STAGES:
            kubernetes.add_pod_label(task, *RUNS_CODE_LABEL)
        for key, value in p.node_selector.items():
            kubernetes.add_node_selector(task, key, value)
        for tol in p.tolerations:
            kubernetes.add_toleration(task, **tol.model_dump(exclude_none=True))
        return task

    return apply


def build_pipeline(cfg: Config):
    """The pipeline function for `cfg` (its rounds, shards, variant and image are fixed here)."""
    c = stages.build(cfg.pipeline.image, cfg.pipeline.cpu_image)
    rounds, shards = cfg.pipeline.rounds, cfg.pipeline.shards
    variant = pipeline_variant(cfg)
    m = cfg.models

    @dsl.pipeline(
        name=f"dynamicrubric-{variant}",
        description=f"DynamicRubric evaluator-policy co-evolution ({variant} evaluator, {rounds} rounds)",
    )
    # The default is one-line flow YAML: KFP copies string defaults verbatim into the package's `#` header,
    # and a multi-line default leaves uncommented lines there that make the package unparseable YAML.
    def co_evolution(config_yaml: str = one_line_yaml(cfg), run_name: str = default_run_name(cfg)):
        # Tasks find the MLflow parent run by `run_name`, a pipeline parameter: kfp.local 2.17 hands the
        # loop item instead of an upstream task's parameter output to tasks inside a ParallelFor.
        common = {"config_yaml": config_yaml, "run_name": run_name}
        tracking = _configure(cfg, "tracking")(c.start_tracking(**common), "start-tracking")
        data = _configure(cfg, "prepare_data")(c.prepare_data(**common), "prepare-data").after(tracking)
        policy_ckpt: dict = {}  # {} = the base policy; else {"policy_ckpt": the last round's checkpoint}
        generator_ckpt: dict = {}
        conditions = contextlib.ExitStack()  # each round after an early-stop check runs inside its dsl.If
        for t in range(1, rounds + 1):
            if variant == "dynamic":
                # ---- generator stage: G_t learns from P_{t-1}'s samples
                with dsl.ParallelFor(items=list(range(shards)), parallelism=shards) as shard:
                    ro = _configure(cfg, "rollout")(
                        c.rollout(
                            **common,
                            round_idx=t,
                            label="generator",
                            shard=shard,
                            num_shards=shards,
                            seed=round_seed(cfg, t, 0),
                            policy_ref=m.policy,
                            prompts=data.outputs["train_prompts"],
                            **policy_ckpt,
                        ),
                        f"r{t}-generator-rollout",
                    )
                    cand = _configure(cfg, "candidates")(
                        c.candidates(
                            **common,
                            round_idx=t,
                            shard=shard,
                            num_shards=shards,
                            rollouts=ro.outputs["rollouts"],
                            prompts=data.outputs["train_prompts"],
                            anchor_lists=data.outputs["anchor_lists"],
                        ),
                        f"r{t}-candidates",
                    )
                    rub = _configure(cfg, "rubrics")(
                        c.rubrics(
                            **common,
                            round_idx=t,
                            label="generator",
                            shard=shard,
                            samples=cfg.rubrics.train_samples,
                            seed=round_seed(cfg, t, 2),
                            generator_ref=m.generator,
                            candidate_sets=cand.outputs["candidate_sets"],
                            **generator_ckpt,
                        ),
                        f"r{t}-generator-rubrics",
                    )
                    jd = _configure(cfg, "judge")(
                        c.judge(
                            **common,
                            round_idx=t,
                            label="generator",
                            shard=shard,
                            verifier_ref=m.verifier,
                            candidate_sets=cand.outputs["candidate_sets"],
                            rubrics=rub.outputs["rubrics"],
                        ),
                        f"r{t}-generator-judge",
                    )
                agg = _configure(cfg, "aggregate")(
                    c.aggregate(
                        **common,
                        round_idx=t,
                        label="generator",
                        judgments=dsl.Collected(jd.outputs["judgments"]),
                        candidate_sets=dsl.Collected(cand.outputs["candidate_sets"]),
                        rubrics=dsl.Collected(rub.outputs["rubrics"]),
                        anchors=dsl.Collected(cand.outputs["anchors"]),
                    ),
                    f"r{t}-generator-aggregate",
                )
                te = _configure(cfg, "train_evaluator")(
                    c.train_evaluator(
                        **common,
                        round_idx=t,
                        generator_ref=m.generator,
                        rubrics=dsl.Collected(rub.outputs["rubrics"]),
                        rewards=agg.outputs["rewards"],
                        **generator_ckpt,
                    ),
                    f"r{t}-train-evaluator",
                )
                generator_ckpt = {"generator_ckpt": te.outputs["generator"]}

            # ---- policy stage: P_t learns from G_t's scores of P_{t-1}'s samples
            with dsl.ParallelFor(items=list(range(shards)), parallelism=shards) as shard:
                ro = _configure(cfg, "rollout")(
                    c.rollout(
                        **common,
                        round_idx=t,
                        label="policy",
                        shard=shard,
                        num_shards=shards,
                        seed=round_seed(cfg, t, 1),
                        policy_ref=m.policy,
                        prompts=data.outputs["train_prompts"],
                        **policy_ckpt,
                    ),
                    f"r{t}-policy-rollout",
                )
                rubric_input = {}
                if variant != "pointwise":
                    rub = _configure(cfg, "rubrics")(
                        c.rubrics(
                            **common,
                            round_idx=t,
                            label="policy",
                            shard=shard,
                            samples=cfg.rubrics.samples,
                            seed=round_seed(cfg, t, 3),
                            generator_ref=m.generator,
                            candidate_sets=ro.outputs["rollouts"],
                            **generator_ckpt,
                        ),
                        f"r{t}-policy-rubrics",
                    )
                    rubric_input = {"rubrics": rub.outputs["rubrics"]}
                jd = _configure(cfg, "judge")(
                    c.judge(
                        **common,
                        round_idx=t,
                        label="policy",
                        shard=shard,
                        verifier_ref=m.verifier,
                        candidate_sets=ro.outputs["rollouts"],
                        **rubric_input,
                    ),
                    f"r{t}-policy-judge",
                )
            collected_rubrics = {"rubrics": dsl.Collected(rub.outputs["rubrics"])} if rubric_input else {}
            agg = _configure(cfg, "aggregate")(
                c.aggregate(
                    **common,
                    round_idx=t,
                    label="policy",
                    judgments=dsl.Collected(jd.outputs["judgments"]),
                    candidate_sets=dsl.Collected(ro.outputs["rollouts"]),
                    prompts=data.outputs["train_prompts"],
                    **collected_rubrics,
                ),
                f"r{t}-policy-aggregate",
            )
            tp = _configure(cfg, "train_policy")(
                c.train_policy(
                    **common,
                    round_idx=t,
                    policy_ref=m.policy,
                    rollouts=dsl.Collected(ro.outputs["rollouts"]),
                    scores=agg.outputs["scores"],
                    **policy_ckpt,
                ),
                f"r{t}-train-policy",
            )
            previous = {"previous_policy": policy_ckpt["policy_ckpt"]} if policy_ckpt else {}
            _configure(cfg, "evaluate")(
                c.evaluate(
                    **common,
                    round_idx=t,
                    base_policy_ref=m.policy,
                    generator_ref=m.generator,
                    verifier_ref=m.verifier,
                    eval_prompts=data.outputs["eval_prompts"],
                    policy=tp.outputs["policy"],
                    **generator_ckpt,
                    **previous,
                ),
                f"r{t}-evaluate",
            )
            policy_ckpt = {"policy_ckpt": tp.outputs["policy"]}
            if cfg.pipeline.early_stop_tie_rate is not None and t < rounds:
                # the aggregate task returns the policy-stage tie rate
                conditions.enter_context(
                    dsl.If(
                        agg.outputs["Output"] < cfg.pipeline.early_stop_tie_rate,
                        name=f"continue-after-round-{t}",
                    )
                )
        conditions.close()

    return co_evolution


def compile_pipeline(cfg: Config, out: str) -> str:
    from kfp import compiler

    compiler.Compiler().compile(build_pipeline(cfg), out)
    return out
