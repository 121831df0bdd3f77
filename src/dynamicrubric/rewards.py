"""DynamicRubric as reward functions for TRL's GRPOTrainer.

TRL runs the online loop (sample, score, update); these callables do the scoring, with the very code
the standalone stages run: every step's batch is written as the same artifacts (rollouts, rubrics,
judgments, scores, rewards, diagnostics, metrics) under `<steps_uri>/step-NNNNN/`, and
`run_rubrics`, `run_judge` and `run_aggregate` read and write them. So a step's scoring can be
validated (`dynrubric validate`) and rerun (`dynrubric stage aggregate ...`) like any stage output.

- `PolicyReward` scores the policy's K completions per prompt, for each variant:
  dynamic (G_t reads the prompt and the K completions, writes a rubric, V judges every item and
  completion), static (the rubric is written from the prompt alone), pointwise (V rates each
  completion) and verifiable (the task's checker: reasoning-gym `score_answer`, HumanEval tests in the
  sandbox). The reward is the aggregated score, averaged over rubric samples.
- `GeneratorRewards` scores the generator's G rubric samples per candidate set (a prompt and P_{t−1}'s
  K responses): `r_disc` (items that split the set) and `r_anchor` (the rubric's agreement with the
  set's reference ranking, None where the set has none). TRL normalises each within its group and
  sums them with weights [1, λ] (`multi_objective_aggregation="normalize_then_sum"`, see train.py).

The functions are stateless across steps: every random choice is seeded from (config seed, round,
step), so a resumed run and a fresh run score the same batch identically. TRL hands a prompt's
num_generations completions contiguously; with several processes each holds a slice, so the batch is
gathered, each process scores every world-th group, and the scores are gathered back.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import pandas as pd
import pyarrow as pa

from dynamicrubric import store
from dynamicrubric.artifacts import read_artifact, read_frame, write_artifact
from dynamicrubric.config import Config

log = logging.getLogger(__name__)


def step_dir(steps_uri: str, step: int, rank: int = 0, world: int = 1) -> str:
    """Where one step's artifacts go (a rank's own folder when several processes score)."""
    folder = store.join(steps_uri, f"step-{step:05d}")
    return store.join(folder, f"rank-{rank}") if world > 1 else folder


def completion_text(completion: Any) -> str:
    """TRL passes conversational completions as [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def finish_reason(ids: list[int], max_tokens: int) -> str:
    """'length' when the completion used its whole budget (TRL cuts at eos, so a stop is shorter)."""
    return "length" if len(ids) >= max_tokens else "stop"


# --------------------------------------------------------------------------------------------------
# Whole groups across processes


def _process() -> tuple[int, int]:
    from accelerate import PartialState

    state = PartialState()
    return state.process_index, state.num_processes


def _gather(local: list) -> tuple[list, int]:
    """Every process's items in process order, and where this process's own slice starts."""
    rank, world = _process()
    if world == 1:
        return local, 0
    from accelerate.utils import gather_object

    parts = gather_object([local])
    return [x for part in parts for x in part], sum(len(p) for p in parts[:rank])


def _score_by_groups(
    local_rows: list[dict], group_size: int, score: Callable[[list[dict], int, int], tuple[list, dict]]
) -> tuple[list, dict]:
    """Split the whole batch into groups, score this process's share, and return its own slice.

    `score(rows, rank, world)` gets the rows of this process's groups (whole groups, in batch order)
    and returns one value per row plus metrics; the metrics are averaged by TRL across processes.
    """
    rows, start = _gather(local_rows)
    if len(rows) % group_size:
        raise ValueError(f"a batch of {len(rows)} completions is not whole groups of {group_size}")
    rank, world = _process()
    mine = [i for i in range(len(rows)) if (i // group_size) % world == rank]
    values, metrics = score([rows[i] for i in mine], rank, world)
    results = dict(zip(mine, values, strict=True))
    if world > 1:
        from accelerate.utils import gather_object

        results = {k: v for part in gather_object([results]) for k, v in part.items()}
    return [results[i] for i in range(start, start + len(local_rows))], metrics


def _group_ids(rows: list[dict], group_size: int, key: str) -> list[str]:
    """A distinct id per group: the row's id, suffixed if the same prompt appears twice in one batch."""
    ids, seen = [], {}
    for g in range(0, len(rows), group_size):
        base = str(rows[g][key])
        seen[base] = seen.get(base, -1) + 1
        ids.append(base if seen[base] == 0 else f"{base}#{seen[base]}")
    return ids


def _log_all(log_metric: Callable | None, metrics: dict) -> None:
    for name, value in metrics.items():
        if log_metric is not None and value is not None and math.isfinite(value):
            log_metric(name, float(value))


# --------------------------------------------------------------------------------------------------
# The policy's reward


class PolicyReward:
    """TRL reward function: the DynamicRubric score of each of the policy's completions."""

    def __init__(
        self,
        cfg: Config,
        *,
        steps_uri: str,
        round_idx: int,
        generator: str = "",
        verifier: str = "",
        policy: str = "",
        engines: Callable[[str], Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.variant = policy_variant(cfg)
        self.steps_uri = steps_uri
        self.round_idx = round_idx
        self.generator = generator or cfg.models.generator
        self.verifier = verifier or cfg.models.verifier
        self.policy = policy or cfg.models.policy
        self.k = cfg.rollout.k
        self.max_tokens = cfg.rollout.max_new_tokens
        self._engines = engines or _engine_cache(cfg)
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
        scores, metrics = _score_by_groups(
            rows, self.k, lambda r, rank, world: self.score(r, step, rank, world)
        )
        _log_all(log_metric, metrics)
        return scores

    def score(self, rows: list[dict], step: int, rank: int = 0, world: int = 1) -> tuple[list[float], dict]:
        """Scores for whole groups of K rows; writes the step's artifacts."""
        if not rows:
            return [], {}
        started = time.perf_counter()
        cfg, folder = self.cfg, step_dir(self.steps_uri, step, rank, world)
        uri = {name: store.join(folder, f"{name}.parquet") for name in _STEP_ARTIFACTS}
        group_ids = _group_ids(rows, self.k, "prompt_id")
        seed = _step_seed(cfg, self.round_idx, step)
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
        write_artifact(uri["rollouts"], "rollouts", rollouts)
        prompts = pd.DataFrame(
            {
                "prompt_id": group_ids,
                "task": [rows[g * self.k]["task"] for g in range(len(group_ids))],
                "prompt": [rows[g * self.k]["prompt"] for g in range(len(group_ids))],
                "reference": [rows[g * self.k]["reference"] for g in range(len(group_ids))],
                "meta": [rows[g * self.k]["meta"] for g in range(len(group_ids))],
            }
        )
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        rubrics_uri = None
        if self.variant == "verifiable":
            t = time.perf_counter()
            outcome = _outcomes(rollouts, prompts, cfg)
            timing["time/checker_s"] = time.perf_counter() - t
            write_artifact(uri["judgments"], "judgments", _checker_judgments(rollouts, outcome))
            anchors = _ranked_by(rollouts, outcome)
        else:
            from dynamicrubric.judge import run_judge
            from dynamicrubric.tasks import anchors_from_outcomes

            if self.variant in ("dynamic", "static"):
                from dynamicrubric.rubrics import run_rubrics

                t = time.perf_counter()
                rubrics_uri = uri["rubrics"]
                counts = run_rubrics(
                    uri["rollouts"],
                    rubrics_uri,
                    cfg,
                    generator=self.generator,
                    samples=cfg.rubrics.samples,
                    variant=self.variant,
                    seed=seed,
                    engine=self._engines(self.generator),
                )
                timing["time/rubrics_s"] = time.perf_counter() - t
                metrics["rubrics/parse_rate"] = counts["parse_rate"]
                metrics["rubrics/truncated_rate"] = counts["truncated"] / max(counts["rubrics"], 1)
                metrics["rubrics/mean_items"] = counts["mean_items"]
            t = time.perf_counter()
            counts = run_judge(
                uri["rollouts"],
                uri["judgments"],
                cfg,
                rubrics_uri=rubrics_uri,
                verifier=self.verifier,
                engine=self._engines(self.verifier),
            )
            timing["time/judge_s"] = time.perf_counter() - t
            metrics["judge/yes_rate"] = counts["yes_rate"]
            verifiable = prompts[prompts["meta"].notna() | prompts["reference"].notna()]
            anchors = (
                anchors_from_outcomes(
                    rollouts[rollouts["prompt_id"].isin(verifiable["prompt_id"])],
                    verifiable,
                    timeout_s=cfg.evaluate.sandbox_timeout_s,
                )
                if len(verifiable)
                else None
            )
        scores = _aggregate(
            cfg,
            uri,
            rubrics_uri,
            anchors,
            soft=cfg.aggregate.soft or self.variant == "verifiable",
            round_idx=self.round_idx,
            variant=self.variant,
            step=step,
        )
        metrics.update(scores.overall)
        per_response = scores.frame.groupby(["prompt_id", "sample_idx"])["score"].mean()
        values = [
            float(per_response[(pid, idx)])
            for pid, idx in zip(rollouts["prompt_id"], rollouts["sample_idx"], strict=True)
        ]
        timing["time/reward_s"] = time.perf_counter() - started
        metrics.update(timing)
        return values, metrics


def policy_variant(cfg: Config) -> str:
    """How the policy is rewarded: dynamic | static (rubrics), pointwise, or verifiable."""
    if cfg.judge.variant in ("pointwise", "verifiable"):
        return cfg.judge.variant
    return cfg.rubrics.variant


# --------------------------------------------------------------------------------------------------
# The generator's rewards


class GeneratorRewards:
    """R_disc and R_anchor of the generator's rubric samples, as two TRL reward functions.

    TRL calls `r_disc` then `r_anchor` on the same batch; both come from one judging pass, so the
    second call reuses the first's result (kept for the last batch only, keyed by its content).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        steps_uri: str,
        round_idx: int,
        generator: str = "",
        verifier: str = "",
        engines: Callable[[str], Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.steps_uri = steps_uri
        self.round_idx = round_idx
        self.generator = generator or cfg.models.generator
        self.verifier = verifier or cfg.models.verifier
        self.g = cfg.rubrics.train_samples
        self.max_tokens = cfg.rubrics.max_new_tokens
        self._engines = engines or _engine_cache(cfg)
        self._last: tuple[Any, tuple[list, list]] | None = None

        def r_disc(prompts, completions, completion_ids, **kwargs):
            return self._rewards(completions, completion_ids, **kwargs)[0]

        def r_anchor(prompts, completions, completion_ids, **kwargs):
            return self._rewards(completions, completion_ids, **kwargs)[1]

        self.functions = [r_disc, r_anchor]

    def _rewards(
        self,
        completions: list,
        completion_ids: list[list[int]],
        *,
        prompt_id: list[str],
        generator_prompt: list[str],
        set_prompt: list[str],
        responses: list[list[str]],
        sample_idx: list[list[int]],
        anchor_ranks: list[list[int]],
        trainer_state: Any = None,
        log_metric: Callable | None = None,
        **_: Any,
    ) -> tuple[list[float], list[float | None]]:
        step = int(trainer_state.global_step) + 1 if trainer_state is not None else 0
        texts = [completion_text(c) for c in completions]
        key = (step, tuple(prompt_id), tuple(texts))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        rows = [
            {
                "prompt_id": pid,
                "generator_prompt": gp,
                "set_prompt": sp,
                "responses": list(resp),
                "sample_idx": list(idx),
                "anchor_ranks": list(ranks),
                "completion": text,
                "finish_reason": finish_reason(ids, self.max_tokens),
            }
            for pid, gp, sp, resp, idx, ranks, text, ids in zip(
                prompt_id,
                generator_prompt,
                set_prompt,
                responses,
                sample_idx,
                anchor_ranks,
                texts,
                completion_ids,
                strict=True,
            )
        ]
        values, metrics = _score_by_groups(
            rows, self.g, lambda r, rank, world: self.score(r, step, rank, world)
        )
        _log_all(log_metric, metrics)
        result = ([v[0] for v in values], [v[1] for v in values])
        self._last = (key, result)
        return result

    def score(self, rows: list[dict], step: int, rank: int = 0, world: int = 1) -> tuple[list, dict]:
        """(r_disc, r_anchor) for whole groups of G rubric samples; writes the step's artifacts."""
        if not rows:
            return [], {}
        from dynamicrubric.judge import run_judge
        from dynamicrubric.rubrics import TRUNCATED, rubric_rows

        started = time.perf_counter()
        cfg, g = self.cfg, self.g
        folder = step_dir(self.steps_uri, step, rank, world)
        uri = {name: store.join(folder, f"{name}.parquet") for name in _STEP_ARTIFACTS}
        set_ids = _group_ids(rows, g, "prompt_id")
        sets = [rows[i * g] for i in range(len(set_ids))]
        rollouts = pd.DataFrame(
            [
                {
                    "prompt_id": sid,
                    "sample_idx": int(idx),
                    "prompt": s["set_prompt"],
                    "response": response,
                    "num_tokens": len(response.split()),
                    "finish_reason": "stop",
                    "policy": "candidate-set",
                    "seed": 0,
                }
                for sid, s in zip(set_ids, sets, strict=True)
                for idx, response in zip(s["sample_idx"], s["responses"], strict=True)
            ]
        )
        write_artifact(uri["rollouts"], "rollouts", rollouts)
        rubric_records = []
        for i, sid in enumerate(set_ids):
            group = rows[i * g : (i + 1) * g]
            rubric_records += rubric_rows(
                sid,
                group[0]["generator_prompt"],
                [r["completion"] for r in group],
                [r["finish_reason"] for r in group],
                variant="dynamic",
                generator=self.generator,
                num_items=cfg.rubrics.num_items,
                constrained=cfg.rubrics.constrained,
            )
        rubrics = pd.DataFrame(rubric_records)
        write_artifact(uri["rubrics"], "rubrics", rubrics)
        anchors = pd.DataFrame(
            [
                {
                    "list_id": sid,
                    "sample_idx": int(idx),
                    "rank": int(rank_),
                    "prompt": s["set_prompt"],
                    "response": response,
                    "source": "candidates",
                }
                for sid, s in zip(set_ids, sets, strict=True)
                if s["anchor_ranks"]
                for idx, response, rank_ in zip(
                    s["sample_idx"], s["responses"], s["anchor_ranks"], strict=True
                )
            ]
        )
        t = time.perf_counter()
        counts = run_judge(
            uri["rollouts"],
            uri["judgments"],
            cfg,
            rubrics_uri=uri["rubrics"],
            verifier=self.verifier,
            engine=self._engines(self.verifier),
        )
        judge_s = time.perf_counter() - t
        result = _aggregate(
            cfg,
            uri,
            uri["rubrics"],
            anchors if len(anchors) else None,
            soft=cfg.aggregate.soft,
            round_idx=self.round_idx,
            variant="dynamic",
            step=step,
            stage="train-evaluator",
        )
        rewards = read_frame(uri["rewards"], "rewards").set_index(["prompt_id", "rubric_idx"])
        values = []
        for sid in set_ids:
            for j in range(g):
                r = rewards.loc[(sid, j)]
                anchor = None if pd.isna(r["r_anchor"]) else float(r["r_anchor"])
                values.append((float(r["r_disc"]), anchor))
        # Parse rate among the samples not cut off by the token limit; the cut-off ones are reported apart.
        truncated = rubrics["parse_status"] == TRUNCATED
        complete = rubrics[~truncated]
        metrics = {
            **result.overall,
            "rubrics/parse_rate": float((complete["parse_status"] != "empty").mean())
            if len(complete)
            else 0.0,
            "rubrics/truncated_rate": float(truncated.mean()),
            "rubrics/mean_items": float(rubrics["items"].map(len).mean()),
            "judge/yes_rate": counts["yes_rate"],
            "time/judge_s": judge_s,
            "time/reward_s": time.perf_counter() - started,
        }
        return values, metrics


# --------------------------------------------------------------------------------------------------
# Shared pieces

_STEP_ARTIFACTS = (
    "rollouts",
    "rubrics",
    "judgments",
    "scores",
    "rewards",
    "diagnostics",
    "metrics",
    "anchors",
)


def _step_seed(cfg: Config, round_idx: int, step: int) -> int:
    """A seed of its own for every (round, step), so scoring never depends on what ran before."""
    return cfg.seed * 1_000_003 + round_idx * 101 + 7 + step * 7_919


def _engine_cache(cfg: Config) -> Callable[[str], Any]:
    """Load each model reference once per process (generator and verifier stay resident)."""
    from dynamicrubric.engines import load_engine

    loaded: dict[str, Any] = {}

    def get(ref: str) -> Any:
        if ref not in loaded:
            import torch

            from dynamicrubric.train import resolve_model_ref

            # Loading initialises weights from torch's global RNG; the trainer's sampling draws from it
            # too, and a resumed run loads the engines at another step than an uninterrupted one.
            with torch.random.fork_rng(devices=[]):
                loaded[ref] = load_engine(str(resolve_model_ref(ref)), cfg.engine)
        return loaded[ref]

    return get


def _outcomes(rollouts: pd.DataFrame, prompts: pd.DataFrame, cfg: Config) -> list[float]:
    """The task checker's score of every rollout; a group's code runs in one sandbox batch."""
    from dynamicrubric.tasks import score_group

    by_id = {row["prompt_id"]: row for row in prompts.to_dict("records")}
    scores = pd.Series(0.0, index=rollouts.index)
    for pid, group in rollouts.groupby("prompt_id", sort=False):
        scores[group.index] = score_group(
            by_id[pid], group["response"].tolist(), timeout_s=cfg.evaluate.sandbox_timeout_s
        )
    return scores.tolist()


def _checker_judgments(rollouts: pd.DataFrame, outcome: list[float]) -> pd.DataFrame:
    """The checker as a one-item judge: p_yes is its score, so soft aggregation reproduces it exactly."""
    return pd.DataFrame(
        {
            "prompt_id": rollouts["prompt_id"],
            "rubric_idx": 0,
            "item_idx": 0,
            "sample_idx": rollouts["sample_idx"],
            "weight": 1,
            "verdict": [o >= 0.5 for o in outcome],
            "p_yes": outcome,
        }
    )


def _ranked_by(rollouts: pd.DataFrame, outcome: list[float]) -> pd.DataFrame | None:
    """Reference rankings from outcomes (for Δgap), for groups whose outcomes differ."""
    from dynamicrubric.tasks import ranked_by_score

    ranked, _ = ranked_by_score(rollouts.assign(score=outcome))
    return ranked if len(ranked) else None


class _Scores:
    def __init__(self, frame: pd.DataFrame, overall: dict) -> None:
        self.frame, self.overall = frame, overall


def _aggregate(
    cfg: Config,
    uri: dict[str, str],
    rubrics_uri: str | None,
    anchors: pd.DataFrame | None,
    *,
    soft: bool,
    round_idx: int,
    variant: str,
    step: int,
    stage: str = "train-policy",
) -> _Scores:
    from dynamicrubric.aggregate import run_aggregate

    anchors_uri = None
    if anchors is not None and len(anchors):
        anchors_uri = uri["anchors"]
        write_artifact(anchors_uri, "anchors", anchors)
    overall = run_aggregate(
        uri["judgments"],
        uri["rollouts"],
        uri["scores"],
        uri["rewards"],
        uri["diagnostics"],
        uri["metrics"],
        rubrics_uri=rubrics_uri,
        anchors_uri=anchors_uri,
        soft=soft,
        round_idx=round_idx,
        variant=variant,
        step=step,
    )
    # The stages' own code wrote the step's inputs; stamp the step on them too, now that aggregation
    # has read them, so every file of a step folder says which step it belongs to.
    for name in ("rollouts", "rubrics", "judgments"):
        if name != "rubrics" or rubrics_uri:
            table = read_artifact(uri[name], name)
            write_artifact(
                uri[name], name, table.append_column("step", pa.array([step] * len(table), pa.int32()))
            )
    named = {f"signal/{k}": v for k, v in overall.items()}
    log.debug("%s step %d: %s", stage, step, json.dumps(named))
    return _Scores(read_frame(uri["scores"], "scores"), named)
