"""DynamicRubric as reward functions for TRL's GRPOTrainer.

TRL runs the online loop (sample, score, update); these callables do the scoring in memory, with the
very code the standalone stages run (`generate_rubrics`, `judge_rollouts`, `aggregate`: tables in,
tables out), and write every step's batch once, as the same artifacts (rollouts, rubrics, judgments,
scores, rewards, diagnostics, metrics) under `<steps_uri>/step-NNNNN/`. So a step's scoring can be
validated (`dynrubric validate`) and rerun (`dynrubric stage aggregate ...`) like any stage output.

- `PolicyReward` scores the policy's K completions per prompt, for each variant:
  dynamic (G_t reads the prompt and the K completions, writes a rubric, V judges every item and
  completion), static (the rubric is written from the prompt alone), pointwise (V rates each
  completion) and verifiable (the task's checker: reasoning-gym `score_answer`, HumanEval tests in the
  sandbox). The reward is the aggregated score, averaged over rubric samples. With
  `judge.item_dropout` the verifier judges a seeded subset of each rubric's items at each step (the
  rubrics artifact keeps every item and names the judged ones in `judged_items`). Every step also logs
  its length bias, `rewards/length_corr`: the within-group correlation of reward and length.
- `GeneratorRewards` scores the generator's G rubric samples per candidate set (a prompt and P_{t−1}'s
  K responses): `r_disc` (items that split the set) and `r_anchor` (the rubric's agreement with the
  set's reference ranking, None where the set has none). TRL normalises each within its group and
  sums them with weights [1, λ] (`multi_objective_aggregation="normalize_then_sum"`, see training/arguments.py).

The functions are stateless across steps: every random choice is seeded from (config seed, round,
step), so a resumed run and a fresh run score the same batch identically. TRL hands a prompt's
num_generations completions contiguously; with several processes each holds a slice, so the batch is
gathered, scored by whole groups in parts (every world-th group in each process; with served models
rank 0 all of them, or on several nodes each node's share through its own servers), and the scores are
gathered back (reward_parts.score_by_groups). A group is scored as in one part whatever the split.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from dynamicrubric.infra.config import Config, policy_variant, step_seed
from dynamicrubric.scoring.aggregate import TIE_TOLERANCE
from dynamicrubric.training.reward_common import (
    Calls,
    StepScorer,
    aggregate_step,
    artifact_table,
    checker_judgments,
    completion_text,
    finish_reason,
    kept_on_failure,
    outcomes,
    ranked_by,
    set_aside_failed,
    step_uris,
    write_step_tables,
)
from dynamicrubric.training.reward_parts import Scored, Share, log_all, score_by_groups, whole_step

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# The policy's reward


class PolicyReward(StepScorer):
    """TRL reward function: the DynamicRubric score of each of the policy's completions."""

    stage = "train_policy"

    def __init__(self, cfg: Config, **where: Any) -> None:
        super().__init__(cfg, **where)
        self.variant = policy_variant(cfg)
        self.k = cfg.rollout.k
        self.max_tokens = cfg.rollout.max_new_tokens
        self.__name__ = f"{self.variant}_score"  # TRL names the reward's metrics after it

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        *,
        prompt_id: list[str],
        prompt_text: list[str],
        task: list[str],
        reference: list[str | None],
        meta: list[str | None],
        trainer_state: Any = None,
        log_metric: Callable | None = None,
        **_: Any,
    ) -> list[float]:
        step = int(trainer_state.global_step) + 1 if trainer_state is not None else 0
        rows = [
            {
                "prompt_id": pid,
                "prompt": text,
                "task": t,
                "reference": ref,
                "meta": m,
                "response": completion_text(c),
                "num_tokens": len(ids),
                "finish_reason": finish_reason(ids, self.max_tokens),
            }
            for pid, text, t, ref, m, c, ids in zip(
                prompt_id, prompt_text, task, reference, meta, completions, completion_ids, strict=True
            )
        ]
        scores, metrics = score_by_groups(
            rows, self.k, lambda r, share: self.score(r, step, share), self.served
        )
        log_all(log_metric, metrics)
        return scores

    def score(self, rows: list[dict], step: int, share: Share | None = None) -> Scored:
        """Scores for whole groups of K rows (`share` of the step's batch, default all of it); writes
        the step's artifacts (its part's)."""
        if not rows:
            return Scored([], {})
        started = time.perf_counter()
        share = share or whole_step(rows, self.k)
        cfg, uri = self.cfg, step_uris(share.folder(self.steps_uri, step))
        group_ids = list(share.ids)
        seed = step_seed(cfg, self.round_idx, step)
        rollouts = pd.DataFrame(
            {
                "prompt_id": [group_ids[i // self.k] for i in range(len(rows))],
                "sample_idx": [i % self.k for i in range(len(rows))],
                "prompt": [r["prompt"] for r in rows],
                "response": [r["response"] for r in rows],
                "num_tokens": [r["num_tokens"] for r in rows],
                "finish_reason": [r["finish_reason"] for r in rows],
                "policy": self.policy,
                "seed": seed,
            }
        )
        prompts = pd.DataFrame(
            {
                "prompt_id": group_ids,
                "task": [rows[g * self.k]["task"] for g in range(len(group_ids))],
                "prompt": [rows[g * self.k]["prompt"] for g in range(len(group_ids))],
                "reference": [rows[g * self.k]["reference"] for g in range(len(group_ids))],
                "meta": [rows[g * self.k]["meta"] for g in range(len(group_ids))],
            }
        )
        tables = {"rollouts": artifact_table("rollouts", rollouts)}
        with kept_on_failure(uri, tables, step):
            anchors, metrics, timing = self.judged(tables, rollouts, prompts, seed, step, share.indices)
            calls = {k: v for k, v in metrics.items() if "/calls_" in k}
            failed, loss = set_aside_failed(
                cfg, uri, tables, group_ids, "train-policy", step, calls, self.servers(), share
            )
            metrics["rewards/failed_groups"] = len(failed)
            per_response: dict = {}
            if len(failed) < len(group_ids):
                result = aggregate_step(
                    uri,
                    tables,
                    None if anchors is None else anchors[~anchors["list_id"].isin(failed)],
                    soft=cfg.aggregate.soft or self.variant == "verifiable",
                    round_idx=self.round_idx,
                    variant=self.variant,
                    step=step,
                )
                metrics.update(result["overall"])
                per_response = result["scores"].groupby(["prompt_id", "sample_idx"])["score"].mean().to_dict()
            else:
                write_step_tables(uri, tables, step)
        # A group that lost a verdict or its rubric gets no reward at all (TRL leaves None out of the
        # advantage), never a score computed from what was left of it.
        values = [
            None if pid in failed else float(per_response[(pid, idx)])
            for pid, idx in zip(rollouts["prompt_id"], rollouts["sample_idx"], strict=True)
        ]
        corr, groups = length_correlation(values, rollouts["num_tokens"].tolist(), self.k)
        metrics["rewards/length_corr"] = corr  # NaN (not logged) when no group has one
        metrics["rewards/length_corr_groups"] = groups
        timing["time/reward_s"] = time.perf_counter() - started
        metrics.update(timing)
        return Scored(values, metrics, loss)

    def judged(
        self,
        tables: dict,
        rollouts: pd.DataFrame,
        prompts: pd.DataFrame,
        seed: int,
        step: int,
        set_indices: tuple[int, ...] | None = None,
    ) -> tuple[pd.DataFrame | None, dict[str, float], dict[str, float]]:
        """The step's judgments (into `tables`, with its rubrics for the rubric variants) and the
        reference rankings of its verifiable groups (for Δgap); with the step's metrics and timings.
        `set_indices`: the groups' places in the step's batch (their rubric samples' seeds)."""
        cfg = self.cfg
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        if self.variant == "verifiable":
            t = time.perf_counter()
            outcome = outcomes(rollouts, prompts, cfg)
            timing["time/checker_s"] = time.perf_counter() - t
            tables["judgments"] = artifact_table("judgments", checker_judgments(rollouts, outcome))
            return ranked_by(rollouts, outcome), metrics, timing
        from dynamicrubric.tasks import CODE_TASKS, anchors_from_outcomes

        if self.variant in ("dynamic", "static"):
            from dynamicrubric.scoring.rubrics import generate_rubrics

            t = time.perf_counter()
            generator = self._engines("generator", self.generator)
            with Calls(generator, "rubrics") as calls:
                rubrics, counts = generate_rubrics(
                    tables["rollouts"].to_pandas(),
                    cfg,
                    generator=self.generator,
                    samples=cfg.rubrics.samples,
                    variant=self.variant,
                    seed=seed,
                    engine=generator,
                    allow_failed=True,
                    set_indices=set_indices,
                )
            rubrics, kept = drop_items(rubrics, cfg.judge.item_dropout, (cfg.seed, self.round_idx, step))
            metrics.update(kept)
            tables["rubrics"] = artifact_table("rubrics", rubrics)
            metrics.update(calls.done())
            timing["time/rubrics_s"] = time.perf_counter() - t
            metrics["rubrics/parse_rate"] = counts["parse_rate"]
            metrics["rubrics/truncated_rate"] = counts["truncated"] / max(counts["rubrics"], 1)
            metrics["rubrics/mean_items"] = counts["mean_items"]
        judged = self.judge_step(tables)
        timing["time/judge_s"] = judged.pop("time/judge_s")
        metrics.update(judged)
        verifiable = prompts[prompts["meta"].notna() | prompts["reference"].notna()]
        if cfg.pipeline.stage_resources("train_policy").gpus:
            # No policy code runs in a GPU pod: code prompts get no outcome ranking (Δgap) here.
            code = verifiable["task"].isin(CODE_TASKS)
            metrics["rewards/unchecked_code_groups"] = float(code.sum())
            verifiable = verifiable[~code]
        if not len(verifiable):
            return None, metrics, timing
        anchors = anchors_from_outcomes(
            rollouts[rollouts["prompt_id"].isin(verifiable["prompt_id"])],
            verifiable,
            timeout_s=cfg.evaluate.sandbox_timeout_s,
        )
        return anchors, metrics, timing


# --------------------------------------------------------------------------------------------------
# Rubric item dropout and length bias


def kept_items(num_items: int, share: float, rng: random.Random) -> list[int]:
    """The item indices of a rubric of `num_items` items that the verifier judges under item dropout
    `share`, ascending. share·n items are left out, rounded up or down at random in proportion to the
    fraction (so that the share holds on average for any rubric size: a fixed rounding would leave
    nothing out of a 3-item rubric at 0.3, or a third of it at 0.5), never the last item."""
    exact = share * num_items
    drop = min(int(exact) + (rng.random() < exact - int(exact)), max(num_items - 1, 0))
    return sorted(rng.sample(range(num_items), num_items - drop))


def drop_items(
    rubrics: pd.DataFrame, share: float, step_key: tuple[int, int, int]
) -> tuple[pd.DataFrame, dict[str, float]]:
    """The step's rubrics with the items the verifier is to judge (judge.item_dropout), and the count
    of items judged and left out. Each rubric sample keeps its own subset, drawn from (config seed,
    round, step, prompt_id, rubric_idx) alone: the same for every response of the group (the judge asks
    per rubric), another at the next step, and the same again when a resumed run scores the step.
    The items stay as written (weights included); `judged_items` names those kept. Without dropout the
    table is returned as it is, so its artifact is what it always was."""
    total = int(rubrics["items"].map(len).sum())
    if not share:
        return rubrics, {"judge/items_kept": total, "judge/items_dropped": 0}
    seed, round_idx, step = step_key
    kept = [
        kept_items(len(items), share, random.Random(f"item-dropout:{seed}:{round_idx}:{step}:{pid}:{ridx}"))
        for pid, ridx, items in zip(
            rubrics["prompt_id"], rubrics["rubric_idx"], rubrics["items"], strict=True
        )
    ]
    judged = sum(len(k) for k in kept)
    return rubrics.assign(judged_items=kept), {
        "judge/items_kept": judged,
        "judge/items_dropped": total - judged,
    }


def length_correlation(rewards: list[float | None], lengths: list[int], k: int) -> tuple[float, int]:
    """Length bias: the mean over groups (K consecutive completions) of the Pearson correlation between
    the group's rewards and its completions' lengths in tokens, and the number of groups averaged. A
    group without rewards (its scoring failed) or whose rewards or lengths are all equal has no
    correlation and is left out; NaN, not 0, when no group is left (0 would read as "no bias")."""
    correlations = []
    for start in range(0, len(rewards), k):
        group = rewards[start : start + k]
        if any(r is None for r in group):
            continue
        r, n = np.asarray(group, np.float64), np.asarray(lengths[start : start + k], np.float64)
        # Scores this close are ties (aggregate.TIE_TOLERANCE): their "spread" is rounding, not signal.
        if np.ptp(r) <= TIE_TOLERANCE or np.ptp(n) == 0:
            continue
        correlations.append(float(np.corrcoef(r, n)[0, 1]))
    return (float(np.mean(correlations)) if correlations else math.nan), len(correlations)
