"""The N-round co-evolution pipeline, built from a config at compile time.

Round t (KFP v2 has no loops: rounds are unrolled when the pipeline is compiled):
  generator stage: P_{t-1} samples K responses per training prompt → candidate sets (+ anchor lists,
                   ranked by verifiable correctness or by humans) → train-evaluator: online GRPO on
                   the generator (every step samples fresh rubrics for the sets, V judges them,
                   R_disc + λ·R_anchor) → G_t
  signal audit:    P_{t-1} samples the held-out probe prompts; G_{t-1} and G_t each write rubrics for
                   those sets, V judges, and aggregate reports Δgap, tie rate and uniform rate before
                   and after the generator update (the early-stop rule reads the "after" tie rate)
  policy stage:    train-policy: online GRPO on P_{t-1} (every step samples fresh, G_t writes rubrics,
                   V judges, the scores are the reward) → P_t
  evaluate:        G_t and P_t on held-out prompts and labelled lists, P_t vs P_{t-1}; where evaluate
                   has GPUs, as evaluate-samples → check-samples (the code runs on CPU) → evaluate
Rollout, candidates and the audit fan out over prompt shards (ParallelFor) and are collected for
aggregation and training.

Baselines run through the same pipeline with no generator stage: `rubrics.variant: static` rewards
the policy with rubrics written from the prompt alone by the untrained generator, `judge.variant:
pointwise` with the verifier's direct rating, and `judge.variant: verifiable` with the task's checker.

Before the rounds, `stage-models` puts each distinct base model into the object store once
(models.staging_plan): every task then reads the staged copy rather than the hub. It runs before
`prepare-data`, which every model task depends on.

The config travels by reference: only start-tracking takes the YAML (a pipeline parameter) and
writes it as its `config` artifact, which every other task reads. On a cluster each task's driver
pod and node status carry its executor input, so ~3.5 KB of inline YAML per task would make the Argo
Workflow object several times the package's size.

A package is kept under MAX_PACKAGE_BYTES (300 KiB): a run's Workflow object is its spec (about the
package's size) and three status nodes a task (driver, executor, impl pod: ~24 KB a task), and Argo
refuses one over 1 MiB (its maxWorkflowSize; etcd's 1.5 MiB cap comes later); it fits only with its
node status compressed (~2.4 KB a task), about 1.9 x the package in all (estimates:
bench/argo_status_size.py, docs/deploy.md). A longer schedule is compiled as segments
(`pipeline.rounds_per_run`, `segments`): `build_pipeline(cfg, first, last)` builds rounds
first..last (absolute round numbers, so seeds and task names are those of one long run); a segment
after the first starts from the previous one's final policy and generator, given as the pipeline
parameters `start_policy` and `start_generator` (checkpoint paths or URIs). launch.py runs the
segments one after another.

What a run of a config is (its variant, task count, segments, start parameters) is in run_plan.py, and
what each task gets on a cluster (resources, mounts, secrets, staged models) in task_settings.py.
"""

import contextlib

from kfp import dsl

from dynamicrubric.components import stages
from dynamicrubric.infra.config import (
    Config,
    ConfigError,
    SeedPurpose,
    gpu_count_mismatch,
    round_seed,
)
from dynamicrubric.pipelines.run_plan import (
    default_run_name,
    guard_action,
    one_line_yaml,
    pipeline_variant,
    split_evaluate,
    start_parameters,
)
from dynamicrubric.pipelines.task_settings import _configure, model_plan, staged_models
from dynamicrubric.stages.kfp_source import ON_NODES

# The largest package `dynrubric compile` writes (bytes of YAML): a run's Argo Workflow object is its
# spec and ~24 KB of node status a task, which Argo fits under its 1 MiB only compressed (~2.4 KB a
# task); 300 KiB keeps the compressed estimate near 0.55 MiB, half the limit left for retries' nodes
# and what the estimate leaves out (docs/deploy.md, "How many rounds a run holds").
MAX_PACKAGE_BYTES = 300 * 1024


def build_pipeline(cfg: Config, first: int = 1, last: int | None = None):
    """The pipeline function for rounds `first`..`last` of `cfg` (default: all of them; its shards,
    variant and image are fixed here). A segment that starts after round 1 takes the previous
    segment's final checkpoints, P_{first-1} and G_{first-1}, as the parameters `start_parameters`
    names."""
    last = cfg.pipeline.rounds if last is None else last
    if not 1 <= first <= last <= cfg.pipeline.rounds:
        raise ConfigError(f"rounds {first}..{last}: not a range of pipeline.rounds 1..{cfg.pipeline.rounds}")
    for stage, tcfg in (("train_policy", cfg.train_policy), ("train_evaluator", cfg.train_evaluator)):
        gpus = cfg.pipeline.resources[stage].gpus if stage in cfg.pipeline.resources else 0
        # Config checks this too where engine is vllm (config.check_gpu_memory_plan); here for any engine.
        mismatch = gpu_count_mismatch(stage, tcfg, gpus) if gpus else None
        if mismatch:
            raise ConfigError(mismatch)
    c = stages.build(cfg.pipeline.image, cfg.pipeline.cpu_image)
    rounds, shards = cfg.pipeline.rounds, cfg.pipeline.shards
    variant = pipeline_variant(cfg)
    m = staged_models(cfg)  # what tasks load: the staged copies on a cluster

    span = f"{rounds} rounds" if (first, last) == (1, rounds) else f"rounds {first}-{last} of {rounds}"

    def co_evolution(config_yaml, run_name, start_policy: str = "", start_generator: str = ""):
        tracking = _configure(cfg, "start_tracking")(
            c.start_tracking(config_yaml=config_yaml, run_name=run_name, first_round=first), "start-tracking"
        )
        # Tasks read the config from start-tracking's artifact (an upstream artifact reaches tasks inside
        # a ParallelFor under kfp.local too) and find the MLflow parent run by `run_name`, a pipeline
        # parameter: kfp.local 2.17 hands the loop item instead of an upstream task's parameter output
        # to tasks inside a ParallelFor.
        common = {"config": tracking.outputs["config"], "run_name": run_name}
        staging = _configure(cfg, "stage_models")(c.stage_models(plan=model_plan(cfg)), "stage-models")
        # Every model task depends on prepare-data, so none starts before the weights are staged.
        data = _configure(cfg, "prepare_data")(c.prepare_data(**common, round_idx=0), "prepare-data").after(
            tracking, staging
        )

        def policy_rollout(t: int, shard, label: str, purpose: SeedPurpose, prompts, ckpt: dict):
            """One shard of P_{t-1}'s samples: the generator's candidate sets or the signal audit's probe."""
            return _configure(cfg, "rollout")(
                c.rollout(**common, round_idx=t, label=label, shard=shard, num_shards=shards,
                          seed=round_seed(cfg, t, purpose), prompts=prompts, **ckpt),
                f"r{t}-{label}-rollout",
            )  # fmt: skip

        def trainer(stage: str, ckpts: dict):
            """A training stage's component and its model inputs. On several nodes, its variant that takes
            each checkpoint by its URI (the producer's `<name>_uri` output), which KFP does not download
            into the task's pod (stages/kfp_source.py says why, and what lineage gives up)."""
            if getattr(cfg, stage).num_nodes == 1:
                return getattr(c, stage), ckpts
            by_uri = {}
            for key, value in ckpts.items():
                if key.endswith("_ckpt"):  # an output channel of the task that wrote the checkpoint
                    key, value = key + "_uri", value.task.outputs[f"{value.name}_uri"]
                by_uri[key] = value
            return getattr(c, stage + ON_NODES), by_uri

        # P_{t-1} and G_{t-1} as a model input: the model's reference, plus from round 2 on the last
        # round's checkpoint artifact (which wins over the reference). A later segment starts from the
        # previous one's final checkpoints, by reference.
        policy_ckpt: dict = {"policy_ref": start_policy if first > 1 else m.policy}
        generator_ckpt: dict = {
            "generator_ref": start_generator if first > 1 and start_generator else m.generator
        }
        conditions = contextlib.ExitStack()  # each round after an early-stop check runs inside its dsl.If
        previous_units = {}  # the last round's evaluate units, for the guard's agreement change
        for t in range(first, last + 1):
            previous_generator = dict(generator_ckpt)  # G_{t-1}, for the audit's "before"
            round_start = {"start_" + k: v for k, v in (*policy_ckpt.items(), *generator_ckpt.items())}
            if variant == "dynamic":
                # ---- generator stage: G_t learns online on P_{t-1}'s candidate sets
                with dsl.ParallelFor(items=list(range(shards)), parallelism=shards) as shard:
                    prompts = data.outputs["train_prompts"]
                    ro = policy_rollout(
                        t, shard, "generator", SeedPurpose.GENERATOR_ROLLOUT, prompts, policy_ckpt
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
                train_evaluator, models = trainer("train_evaluator", generator_ckpt)
                te = _configure(cfg, "train_evaluator")(
                    train_evaluator(
                        **common,
                        round_idx=t,
                        verifier_ref=m.verifier,
                        candidate_sets=dsl.Collected(cand.outputs["candidate_sets"]),
                        anchors=dsl.Collected(cand.outputs["anchors"]),
                        **models,
                    ),
                    f"r{t}-train-evaluator",
                )
                generator_ckpt = {"generator_ref": m.generator, "generator_ckpt": te.outputs["generator"]}

            # ---- signal audit: the round's evaluator (before and after its update) on P_{t-1}'s probe samples
            audit_tie_rate = None
            if variant != "verifiable":
                scorers = (
                    {"before": previous_generator, "after": generator_ckpt}
                    if variant == "dynamic"
                    else {"": {"generator_ref": m.generator}}
                )
                judged: dict = {name: ([], []) for name in scorers}
                with dsl.ParallelFor(items=list(range(shards)), parallelism=shards) as shard:
                    prompts = data.outputs["eval_prompts"]
                    probe = policy_rollout(t, shard, "audit", SeedPurpose.AUDIT_ROLLOUT, prompts, policy_ckpt)
                    for name, generator in scorers.items():
                        label = f"audit-{name}" if name else "audit"
                        rubric_input = {}
                        if variant != "pointwise":
                            rub = _configure(cfg, "rubrics")(
                                c.rubrics(
                                    **common,
                                    round_idx=t,
                                    label=label,
                                    shard=shard,
                                    samples=cfg.rubrics.samples,
                                    # the same for both: only the generator differs
                                    seed=round_seed(cfg, t, SeedPurpose.AUDIT_RUBRICS),
                                    candidate_sets=probe.outputs["rollouts"],
                                    **generator,
                                ),
                                f"r{t}-{label}-rubrics",
                            )
                            rubric_input = {"rubrics": rub.outputs["rubrics"]}
                        jd = _configure(cfg, "judge")(
                            c.judge(
                                **common,
                                round_idx=t,
                                label=label,
                                shard=shard,
                                verifier_ref=m.verifier,
                                candidate_sets=probe.outputs["rollouts"],
                                **rubric_input,
                            ),
                            f"r{t}-{label}-judge",
                        )
                        judged[name] = (jd, rubric_input)
                for name, (jd, rubric_input) in judged.items():
                    label = f"audit-{name}" if name else "audit"
                    collected = {"rubrics": dsl.Collected(rubric_input["rubrics"])} if rubric_input else {}
                    agg = _configure(cfg, "aggregate")(
                        c.aggregate(
                            **common,
                            round_idx=t,
                            label=label,
                            judgments=dsl.Collected(jd.outputs["judgments"]),
                            candidate_sets=dsl.Collected(probe.outputs["rollouts"]),
                            prompts=data.outputs["eval_prompts"],
                            **collected,
                        ),
                        f"r{t}-{label}-aggregate",
                    )
                    audit_tie_rate = agg.outputs["Output"]  # the last one: "after" for dynamic

            # ---- policy stage: P_t learns online, rewarded by the round's evaluator
            train_policy, models = trainer("train_policy", {**policy_ckpt, **generator_ckpt})
            tp = _configure(cfg, "train_policy")(
                train_policy(
                    **common,
                    round_idx=t,
                    verifier_ref=m.verifier,
                    prompts=data.outputs["train_prompts"],
                    **models,
                ),
                f"r{t}-train-policy",
            )
            # P_{t-1}, for the win rate: its reference (the base policy, or a segment's start) and checkpoint
            previous = {f"previous_{k}": v for k, v in policy_ckpt.items()}
            held_out = {"eval_prompts": data.outputs["eval_prompts"]}
            if split_evaluate(cfg):
                sampled = _configure(cfg, "evaluate_samples")(
                    c.evaluate_samples(
                        **common,
                        round_idx=t,
                        policy_ref=m.policy,
                        policy_ckpt=tp.outputs["policy"],
                        **held_out,
                        **previous,
                    ),
                    f"r{t}-evaluate-samples",
                )
                checked = _configure(cfg, "check_samples")(
                    c.check_samples(**common, round_idx=t, samples=sampled.outputs["samples"], **held_out),
                    f"r{t}-check-samples",
                )
                phases = {"samples": sampled.outputs["samples"], "outcomes": checked.outputs["outcomes"]}
                phases["previous_policy_ref"] = previous["previous_policy_ref"]
            else:
                phases = {"policy_ckpt": tp.outputs["policy"], **previous}
            ev = _configure(cfg, "evaluate")(
                c.evaluate(
                    **common,
                    round_idx=t,
                    verifier_ref=m.verifier,
                    reference_generator_ref=m.generator,
                    **held_out,
                    **generator_ckpt,
                    **phases,
                    **previous_units,
                ),
                f"r{t}-evaluate",
            )
            previous_units = {"previous_units": ev.outputs["units"]}
            policy_ckpt = {"policy_ref": m.policy, "policy_ckpt": tp.outputs["policy"]}
            action = guard_action(cfg)
            if action == "rollback" and t < rounds:
                # The next round starts from the last healthy round's checkpoints (the rollback task's
                # reference folders name them); also after a segment's last round, for the next segment.
                rb = _configure(cfg, "rollback")(
                    c.rollback(**common, round_idx=t, guard=ev.outputs["guard"], **round_start),
                    f"r{t}-rollback",
                )
                policy_ckpt = {"policy_ref": m.policy, "policy_ckpt": rb.outputs["policy"]}
                if variant == "dynamic":
                    generator_ckpt = {"generator_ref": m.generator, "generator_ckpt": rb.outputs["generator"]}
            if action == "stop" and t < last:
                # no later round runs once the round's guard has fired
                conditions.enter_context(
                    dsl.If(ev.outputs["Output"] > 0.5, name=f"guard-healthy-after-round-{t}")
                )
            if cfg.pipeline.early_stop_tie_rate is not None and t < last and audit_tie_rate is not None:
                # stop once the round's evaluator ties P_{t-1}'s probe samples this often
                conditions.enter_context(
                    dsl.If(
                        audit_tie_rate < cfg.pipeline.early_stop_tie_rate, name=f"continue-after-round-{t}"
                    )
                )
        conditions.close()

    # The defaults are one-line flow YAML: KFP copies string defaults verbatim into the package's `#`
    # header, and a multi-line default leaves uncommented lines there that make the package unparseable.
    # The run name is the same for every segment of a chain: their tasks share one MLflow parent run.
    defaults = {"config_yaml": one_line_yaml(cfg), "run_name": default_run_name(cfg)}
    if first == 1:

        def pipeline_function(
            config_yaml: str = defaults["config_yaml"], run_name: str = defaults["run_name"]
        ):
            co_evolution(config_yaml, run_name)

    elif len(start_parameters(cfg)) == 2:  # required: a segment must not silently start from the base

        def pipeline_function(
            start_policy: str,
            start_generator: str,
            config_yaml: str = defaults["config_yaml"],
            run_name: str = defaults["run_name"],
        ):
            co_evolution(config_yaml, run_name, start_policy, start_generator)

    else:

        def pipeline_function(
            start_policy: str,
            config_yaml: str = defaults["config_yaml"],
            run_name: str = defaults["run_name"],
        ):
            co_evolution(config_yaml, run_name, start_policy)

    pipeline_function.__name__ = "co_evolution"
    return dsl.pipeline(
        name=f"dynamicrubric-{variant}",
        description=f"DynamicRubric evaluator-policy co-evolution ({variant} evaluator, {span})",
    )(pipeline_function)


def compile_pipeline(cfg: Config, out: str, first: int = 1, last: int | None = None) -> str:
    """Compile rounds `first`..`last` (default: all) to the package `out`."""
    from kfp import compiler

    compiler.Compiler().compile(build_pipeline(cfg, first, last), out)
    return out
