"""Evaluate stage: is the evaluator ranking responses correctly, and is the policy getting better?

Three measurements per round, written as one `metrics` artifact (stage="evaluate") plus PNG plots,
and the units each metric averages over as a `units` artifact (one row per held-out prompt, labelled
pair or win-rate prompt), from which a study computes confidence intervals and paired differences:

1. Policy quality on held-out verifiable prompts (variant "policy"): the policy samples k responses
   per prompt, each is scored by its task's own checker (`tasks.score_response`: reasoning-gym's
   `score_answer`, HumanEval's tests in the sandbox). avg@k is the mean score over the k samples;
   for code, pass@1 and pass@k use the unbiased estimator over the k samples.
2. Evaluator quality on labelled lists (variants "dynamic", "static", "pointwise"): ranked lists
   whose order is known (the policy's own samples ranked by verifiable correctness, plus the user's
   anchors / Nectar / chosen-rejected files). Each evaluator scores every response of a list, and
   the scores are compared with the known ranks by the metric functions below.
3. Win rate of the policy over the previous round's policy (variant "policy"), judged by the current
   evaluator: per held-out prompt one response from each, a dynamic rubric written over the two as
   the candidate set, scores compared; ties count half.
4. The open-ended benchmarks (`evaluate.benchmarks`; variants named by benchmark): P_t against each
   benchmark's baseline answers and against P_0, judged by `evaluate.benchmark_judge` (by default the
   frozen verifier, never the generator being trained); benchmark_runs.py.

The measurements themselves are in metrics.py, the plots in plots.py.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd

from dynamicrubric import tasks
from dynamicrubric.engines import Engine, load_engine, load_judge
from dynamicrubric.evaluation.benchmark_judge import benchmark_judge
from dynamicrubric.evaluation.benchmark_runs import benchmark_answers, benchmark_prompts, judge_benchmarks
from dynamicrubric.evaluation.guard import GUARD, guarded
from dynamicrubric.evaluation.item_usefulness import summarise as summarise_items
from dynamicrubric.evaluation.labelled import accuracy_by_origin, as_rollouts, labelled_lists
from dynamicrubric.evaluation.metrics import (
    evaluator_metrics,
    pair_credits,
    policy_metrics,
    win_credits,
    win_rate,
)
from dynamicrubric.evaluation.plots import write_plots
from dynamicrubric.evaluation.probe import (
    ACTION_WORDS,
    EvalJob,
    guard_jobs,
    guard_record,
    guard_report,
    probe_items,
)
from dynamicrubric.evaluation.traced_sets import traced_sets
from dynamicrubric.infra.artifacts import read_artifact, read_frame, write_artifact
from dynamicrubric.infra.config import Config
from dynamicrubric.scoring.aggregate import score_responses
from dynamicrubric.scoring.judge import run_judge
from dynamicrubric.scoring.rollout import sample_rollouts
from dynamicrubric.scoring.rubrics import run_rubrics

log = logging.getLogger(__name__)


EVALUATOR_VARIANTS = ("dynamic", "static", "pointwise")


# --------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------


class Engines:
    """Holds at most one engine that it loaded itself: asking for another model frees the current one.

    One at a time rather than sized together: at paper scale every role is an 8B model and a vLLM
    engine claims `gpu_memory_utilization` (0.85) of its GPU, so two engines cannot share one GPU, and
    splitting the memory between them would halve each one's KV cache (batch size) for the whole
    stage. The stage is ordered so that each model is needed in one phase only (policy, previous
    policy, generator, verifier), so at most four loads happen per evaluate call; a model given by
    the caller (`preloaded`) is used as is and never freed here."""

    def __init__(self, cfg: Config, preloaded: dict[str, Engine] | None) -> None:
        self.cfg = cfg
        self.preloaded: dict[str, Engine] = dict(preloaded or {})
        self.ref: str | None = None
        self.engine: Engine | None = None
        self.loads = 0

    def get(self, ref: str) -> Engine:
        if ref in self.preloaded:
            return self.preloaded[ref]
        if self.ref != ref:
            self.release()
            self.engine = load_engine(ref, self.cfg.engine)
            self.ref = ref
            self.loads += 1
        assert self.engine is not None
        return self.engine

    def release(self) -> None:
        """Free the engine this pool loaded (engine.close(): del, gc, CUDA cache / vLLM shutdown)."""
        if self.engine is not None:
            self.engine.close()
        self.engine, self.ref = None, None


def sample_held_out(
    cfg: Config,
    prompts: pd.DataFrame,
    pool: Engines,
    *,
    policy: str,
    previous_policy: str | None,
    seed: int,
) -> pd.DataFrame:
    """The policy's `evaluate.samples` k responses per held-out prompt (sample_idx 0..k-1) and the
    previous policy's k of the same seed (k..2k-1; with identical weights both policies give identical
    responses), for the win rate and the signal guard's probe: one rollouts frame, so one artifact
    carries the stage's samples from the GPU task that makes them to the tasks that check and score."""
    ev = cfg.evaluate
    sample_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"k": ev.samples})})
    samples = sample_rollouts(pool.get(policy), prompts, sample_cfg, seed=seed, policy=policy)
    if previous_policy is None or not (ev.win_rate or guarded(cfg)):
        return samples
    # k samples for the guard's probe; the win rate alone compares sample 0 of each
    k = ev.samples if guarded(cfg) else 1
    previous_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"k": k})})
    previous = sample_rollouts(
        pool.get(previous_policy), prompts, previous_cfg, seed=seed, policy=previous_policy
    )
    return pd.concat(
        [samples, previous.assign(sample_idx=previous["sample_idx"] + np.int32(ev.samples))],
        ignore_index=True,
    )


def split_samples(samples: pd.DataFrame, cfg: Config, source: str = "") -> tuple[pd.DataFrame, pd.DataFrame]:
    """`sample_held_out`'s frame as (the policy's samples, the previous policy's renumbered 0..k-1).
    Samples read from `source` must be of this config's evaluate.samples k: the policy's are 0..k-1,
    the previous policy's k..2k-1. More (drawn with a larger k) would be taken for the wrong policy's."""
    k = cfg.evaluate.samples
    top = int(samples["sample_idx"].max()) if len(samples) else 0
    if top > 2 * k - 1:
        raise ValueError(
            f"{source or 'samples'}: sample_idx goes up to {top}, but evaluate.samples is {k} (the "
            f"policy's samples are 0..{k - 1}, the previous policy's {k}..{2 * k - 1}): evaluate them with "
            "the config that drew them"
        )
    current = samples["sample_idx"] < k
    previous = samples[~current]
    return samples[current], previous.assign(sample_idx=previous["sample_idx"] - np.int32(k))


def check_samples(samples: pd.DataFrame, prompts: pd.DataFrame, timeout_s: float) -> pd.DataFrame:
    """The outcomes frame (prompt_id, sample_idx, task, score): each sample scored by its task's
    checker; code runs in the sandbox, a few runs at a time. Score NaN: unscored (the sandbox failed;
    logged and counted). Prompts without a verifiable outcome (no task checker, no reference) are left
    out and counted."""
    by_id = tasks.prompt_rows(samples, prompts, "samples")
    verifiable = samples["prompt_id"].map(lambda pid: tasks.is_verifiable(by_id[pid]))
    if not verifiable.all():
        log.warning(
            "evaluate: %d of %d held-out prompts have no verifiable outcome and are not scored",
            samples.loc[~verifiable, "prompt_id"].nunique(),
            samples["prompt_id"].nunique(),
        )
    todo = samples[verifiable]
    jobs = [(by_id[pid], response) for pid, response in zip(todo["prompt_id"], todo["response"], strict=True)]
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        scores = list(pool.map(lambda job: tasks.score_response(job[0], job[1], timeout_s=timeout_s), jobs))
    outcomes = pd.DataFrame(
        {
            "prompt_id": todo["prompt_id"].to_numpy(),
            "sample_idx": todo["sample_idx"].to_numpy(dtype=np.int32),
            "task": [job[0]["task"] for job in jobs],
            "score": np.asarray(scores, dtype=np.float64),
        }
    )
    unscored = outcomes["score"].isna()
    if unscored.any():  # the sandbox failed on them (logged by tasks): unknown, not wrong
        log.warning(
            "evaluate: %d of %d samples left unscored (sandbox errors)", int(unscored.sum()), len(outcomes)
        )
    return outcomes


def _evaluator_scores(
    jobs: list[EvalJob],
    cfg: Config,
    workdir: Path,
    engines: Engines,
    *,
    generator: str,
    verifier: str,
    seed: int,
) -> dict[str, pd.DataFrame]:
    """Score every response of every job: job name -> (prompt_id, sample_idx, score, score_soft,
    score_hard); `score` is the configured verdicts' (aggregate.soft), the other two both kinds.

    Runs the rubric and judge stages in process on temporary artifacts (so the evaluate stage measures
    exactly what the training rounds use): first every job's rubrics, grouped by generator, then every
    job's judgments with the verifier, so each model is loaded once. Scores of several rubric samples
    are averaged. (One engine call for all jobs' rubrics was tried: on the 2-core CPU it took 167 s
    against 101 s, padding short static prompts to the dynamic ones' length; decoding there is
    compute-bound, so batching saved nothing.)"""
    for job in jobs:
        job.rollouts_uri = str(workdir / f"{job.name}.rollouts.parquet")
        write_artifact(job.rollouts_uri, "rollouts", job.rollouts)
    # The stage's generator first, then any other (sorted is stable: jobs keep their order within one).
    for job in sorted(jobs, key=lambda j: (j.generator is not None, j.generator or "")):
        if job.variant != "pointwise":
            job.rubrics_uri = str(workdir / f"{job.name}.rubrics.parquet")
            writer = job.generator or generator
            run_rubrics(
                job.rollouts_uri,
                job.rubrics_uri,
                cfg,
                generator=writer,
                variant=job.variant,
                seed=seed,
                engine=engines.get(writer),
            )
    out = {}
    for job in sorted(jobs, key=lambda j: j.judge is not None):  # the verifier's jobs, then another judge's
        judgments_uri = str(workdir / f"{job.name}.judgments.parquet")
        variant = "pointwise" if job.rubrics_uri is None else "rubric"
        judge_cfg = cfg.model_copy(update={"judge": cfg.judge.model_copy(update={"variant": variant})})
        if job.judge is not None and job.judge.url:  # a judge endpoint: a client, not a model to hold
            engines.release()
            engine = load_judge(job.judge, cfg, role="gold judge")
        else:
            engine = engines.get(job.judge.model if job.judge is not None else verifier)
        run_judge(
            job.rollouts_uri,
            judgments_uri,
            judge_cfg,
            rubrics_uri=job.rubrics_uri,
            verifier=verifier,
            engine=engine,
        )
        if job.judge is not None and job.judge.url:
            engine.close()
        inputs = (
            read_artifact(judgments_uri, "judgments"),
            read_artifact(job.rollouts_uri, "rollouts"),
            read_artifact(job.rubrics_uri, "rubrics") if job.rubrics_uri else None,
        )
        if job.rubrics_uri:
            job.judged = (
                read_frame(job.rubrics_uri, "rubrics"),
                read_frame(judgments_uri, "judgments"),
                score_responses(*inputs, soft=cfg.aggregate.soft),
            )
        by_kind = {
            f"score_{name}": score_responses(*inputs, soft=soft)
            .groupby(["prompt_id", "sample_idx"], as_index=False)["score"]
            .mean()
            .rename(columns={"score": f"score_{name}"})
            for name, soft in (("soft", True), ("hard", False))
        }
        scores = by_kind["score_soft"].merge(by_kind["score_hard"], on=["prompt_id", "sample_idx"])
        out[job.name] = scores.assign(score=scores["score_soft" if cfg.aggregate.soft else "score_hard"])
    return out


def run_evaluate(
    eval_prompts_uri: str,
    out_metrics_uri: str,
    out_plots_dir: str,
    cfg: Config,
    *,
    policy: str | None = None,
    generator: str | None = None,
    verifier: str | None = None,
    previous_policy: str | None = None,
    labelled_uris: Sequence[str] = (),
    round_idx: int = 0,
    seed: int | None = None,
    engines: dict[str, Engine] | None = None,
    out_units_uri: str | None = None,
    samples_uri: str | None = None,
    outcomes_uri: str | None = None,
    out_guard_uri: str | None = None,
    out_items_uri: str | None = None,
    previous_units_uri: str | None = None,
    reference_generator: str | None = None,
) -> dict[str, float]:
    """The evaluate stage; returns every metric as a flat dict "<variant>/<name>" -> value.

    `out_units_uri` (optional) gets the units artifact: ("policy", "avg_at_k") per held-out prompt,
    ("policy", "win") per win-rate prompt, and per evaluator variant ("pair_soft" and "pair_hard") the
    credit of every reference pair under soft and hard verdicts (the metrics use `aggregate.soft`'s).

    Model references (local folders, hub ids or built-in names) default to cfg.models; `engines`
    (model ref -> Engine) lets a caller reuse engines it already holds. The stage holds one model at a
    time (see `Engines`): the policy samples, then the previous policy, then the generator writes
    every rubric (all variants and the win rate), then the verifier judges them all. `labelled_uris`
    are user files of anchors artifacts, Nectar answers or chosen/rejected pairs (JSONL or Parquet).
    `samples_uri` (a rollouts artifact of `sample_held_out`) and `outcomes_uri` (of `check_samples`)
    are the first two phases done by earlier tasks; without them they run here.

    The signal guard (guard.py, probe.py) adds its numbers as the "guard" variant's metrics and units
    (`guard/healthy` is always there: 1 where the guard found nothing or did not measure);
    `out_guard_uri` gets its verdict as a `guard` artifact, `out_items_uri` the probe rubric's items'
    `item_usefulness` (their summary is the "items" variant's metrics), `previous_units_uri` (the previous round's
    units) gives it the previous round's agreement, and `reference_generator` (default: the config's
    generator) writes the gold's rubrics for prompts without a checker.
    """
    ev = cfg.evaluate
    variants = list(dict.fromkeys(ev.variants))  # each once, in the configured order
    if isinstance(labelled_uris, str):  # one file given where a list is expected
        labelled_uris = [labelled_uris]
    policy = policy or cfg.models.policy
    generator = generator or cfg.models.generator
    verifier = verifier or cfg.models.verifier
    seed = cfg.seed if seed is None else seed
    prompts = read_frame(eval_prompts_uri, "prompts")
    pool = Engines(cfg, engines)
    roles = {"generator": generator, "verifier": verifier, "seed": seed}
    rows: list[tuple[str, str, float]] = []  # (variant, name, value)
    units: list[pd.DataFrame] = []  # (variant, measure, unit_id, value)

    # (1) The policy samples k responses per held-out prompt; each is scored by its task's checker, and
    # so are the previous policy's (the guard's gold). On GPUs these are tasks of their own
    # (evaluate-samples, check-samples: code runs in a CPU pod).
    if samples_uri:
        samples = read_frame(samples_uri, "rollouts")
    else:
        samples = sample_held_out(
            cfg, prompts, pool, policy=policy, previous_policy=previous_policy, seed=seed
        )
    rollouts, _ = split_samples(samples, cfg, samples_uri or "")
    # (4) The benchmarks' answers, P_0's and P_t's, while the policies are the models at hand; they are
    # judged after the evaluator's phase, when the judge (by default V) is.
    bench_prompts = benchmark_prompts(cfg) if ev.benchmarks else {}
    answers = (
        benchmark_answers(cfg, bench_prompts, pool.get, policy=policy, base=cfg.models.policy, seed=seed)
        if bench_prompts
        else None
    )
    if outcomes_uri:
        outcomes = read_frame(outcomes_uri, "outcomes")
    else:
        outcomes = check_samples(samples, prompts, ev.sandbox_timeout_s)
    current_outcomes = outcomes[outcomes["sample_idx"] < ev.samples]
    scored = current_outcomes[current_outcomes["score"].notna()].merge(
        rollouts[["prompt_id", "sample_idx", "response"]], on=["prompt_id", "sample_idx"], how="left"
    )
    rows.append(("policy", "unscored", float(len(current_outcomes) - len(scored))))
    rows += [("policy", name, value) for name, value in policy_metrics(scored, ev.samples).items()]
    per_prompt = scored.groupby("prompt_id", sort=True)["score"].mean()
    units.append(_units("policy", "avg_at_k", per_prompt.index, per_prompt.to_numpy()))
    rows.append(("policy", "samples", float(len(scored))))

    # (2) Labelled lists scored by each evaluator variant, and (3) the probe: every held-out prompt's
    # samples of both policies as one candidate set, scored by the round's evaluator (the win rate and
    # the signal guard's gold probe), with the guard's canary and order sets: one generator phase, one
    # verifier phase.
    lists, counts = labelled_lists(scored, prompts, labelled_uris)
    jobs: list[EvalJob] = []
    if lists.empty:
        log.warning(
            "evaluate: no labelled list with two distinct outcomes (%d skipped); evaluator metrics "
            "of %s are skipped",
            int(counts["labelled_lists_skipped"]),
            variants,
        )
    else:
        listed = as_rollouts(lists)
        ranks = {
            (str(a), int(b)): int(c)
            for a, b, c in lists[["list_id", "sample_idx", "rank"]].itertuples(index=False)
        }
        jobs += [EvalJob(f"labelled-{v}", listed, v, gold=ranks) for v in variants]
    has_previous = bool((samples["sample_idx"] >= ev.samples).any())
    probe_jobs = guard_jobs(cfg, samples, prompts, outcomes, reference_generator or generator, round_idx)
    if not guarded(cfg) and not (has_previous and ev.win_rate):
        probe_jobs = []
    jobs += probe_jobs
    with tempfile.TemporaryDirectory(prefix="dynrubric-evaluate-") as tmp:
        scores = _evaluator_scores(jobs, cfg, Path(tmp), pool, **roles) if jobs else {}
    bench = None
    if answers is not None:
        judge = benchmark_judge(cfg, pool.get, verifier)
        try:
            bench = judge_benchmarks(cfg, bench_prompts, answers, judge, seed, first_round=round_idx == 1)
        finally:
            judge.close()
        rows += bench.rows
        units += bench.units
    pool.release()

    evaluated: dict[str, pd.DataFrame] = {}
    for variant in variants:
        if f"labelled-{variant}" in scores:
            evaluated[variant] = lists.merge(
                scores[f"labelled-{variant}"].rename(columns={"prompt_id": "list_id"}),
                on=["list_id", "sample_idx"],
                how="left",
            )
        values = evaluator_metrics(evaluated[variant]) if variant in evaluated else {}
        for kind in ("soft", "hard") if variant in evaluated else ():
            credits = pair_credits(evaluated[variant].assign(score=evaluated[variant][f"score_{kind}"]))
            pair_ids = (
                credits["list_id"]
                + "|"
                + credits["sample_idx_a"].astype(str)
                + ">"
                + credits["sample_idx_b"].astype(str)
            )
            units.append(_units(variant, f"pair_{kind}", pair_ids, credits["credit"].to_numpy()))
        values.update(counts)
        if variant in evaluated and labelled_uris:
            values.update(accuracy_by_origin(evaluated[variant]))
        rows += [(variant, name, value) for name, value in values.items()]
    if "probe" in scores and has_previous and ev.win_rate:
        # sample 0 of each policy (the same seed): ties count half
        by_side = scores["probe"].pivot(index="prompt_id", columns="sample_idx", values="score")
        rows.append(("policy", "win_rate", win_rate(by_side[0], by_side[ev.samples])))
        wins = win_credits(by_side[0], by_side[ev.samples])
        units.append(_units("policy", "win", wins.index, wins.to_numpy()))
        rows.append(("policy", "win_rate_prompts", float(len(by_side))))
    report = None
    if guarded(cfg) and "probe" in scores:
        report = guard_report(cfg, samples, prompts, scores, outcomes, previous_units_uri, round_idx)
        rows += [(GUARD, name, value) for name, value in report.metrics.items()]
        units.append(report.units.assign(variant=GUARD))
    rows.append((GUARD, "healthy", 1.0 if report is None else float(report.healthy)))
    items = probe_items(cfg, probe_jobs, scores, outcomes, round_idx)
    rows += [("items", name, value) for name, value in summarise_items(items).items()]

    metrics = pd.DataFrame(rows, columns=["variant", "name", "value"])
    metrics = metrics.drop_duplicates(["variant", "name"], keep="last")
    metrics = metrics.assign(round=round_idx, stage="evaluate", step=0)
    defined = metrics["value"].notna()
    if not defined.all():  # e.g. the gap on correct pairs when no pair is ordered correctly
        undefined = metrics.loc[~defined, "variant"] + "/" + metrics.loc[~defined, "name"]
        log.info("evaluate: undefined metric(s) not written: %s", ", ".join(undefined))
    metrics = metrics[defined]
    write_artifact(out_metrics_uri, "metrics", metrics)
    if out_units_uri:
        write_artifact(out_units_uri, "units", pd.concat(units, ignore_index=True).assign(round=round_idx))
    if out_items_uri:
        write_artifact(out_items_uri, "item_usefulness", items)
    if out_guard_uri:
        write_artifact(
            out_guard_uri,
            "guard",
            [guard_record(cfg, report, round_idx, policy=policy, generator=generator)],
        )
    sets = traced_sets(jobs, scored, cfg.pipeline.traced_sets, generator=generator, verifier=verifier)
    pairs = bench.traced(cfg.pipeline.traced_sets) if bench is not None else None
    write_plots(out_plots_dir, metrics, evaluated, traced=sets, benchmark_pairs=pairs)
    result = {
        f"{v}/{n}": float(x) for v, n, x in metrics[["variant", "name", "value"]].itertuples(index=False)
    }
    log.info("evaluate: %s", ", ".join(f"{k}={v:.4g}" for k, v in result.items()))
    if report is not None and report.fired:
        log.warning(
            "round %d: the signal guard's alarm fired: %s; guard.action %s: %s",
            round_idx,
            "; ".join(report.reasons),
            cfg.guard.action,
            ACTION_WORDS[cfg.guard.action],
        )
    return result


def _units(variant: str, measure: str, unit_ids: Sequence[str], values: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame(
        {"variant": variant, "measure": measure, "unit_id": pd.Index(unit_ids).astype(str), "value": values}
    )
