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
from dynamicrubric.config import Config, policy_variant, step_seed
from dynamicrubric.models import resolve_model

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
    local_rows: list[dict],
    group_size: int,
    score: Callable[[list[dict], int, int], tuple[list, dict]],
    served: bool = False,
) -> tuple[list, dict]:
    """Split the whole batch into groups, score this process's share, and return its own slice.

    `score(rows, rank, world)` gets the rows of this process's groups (whole groups, in batch order)
    and returns one value per row plus metrics; the metrics are averaged by TRL across processes.
    With `served` models the main process sends the whole step's requests at once (the servers batch
    and prefix-cache them better than world small slices would) and the others wait for the scores.
    """
    rows, start = _gather(local_rows)
    if len(rows) % group_size:
        raise ValueError(f"a batch of {len(rows)} completions is not whole groups of {group_size}")
    rank, world = _process()
    if served:
        mine = list(range(len(rows))) if rank == 0 else []
        values, metrics = score([rows[i] for i in mine], 0, 1)
    else:
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
        self.served = _served(cfg, ("generator", "verifier"))
        self.__name__ = f"{self.variant}_score"  # TRL names the reward's metrics after it

    def release_models(self) -> None:
        """Drop the engines loaded so far (training is over; writing the checkpoint needs the memory)."""
        self._engines = _engine_cache(self.cfg)

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
            rows, self.k, lambda r, rank, world: self.score(r, step, rank, world), self.served
        )
        _log_all(log_metric, metrics)
        return scores

    def score(self, rows: list[dict], step: int, rank: int = 0, world: int = 1) -> tuple[list[float], dict]:
        """Scores for whole groups of K rows; writes the step's artifacts."""
        if not rows:
            return [], {}
        started = time.perf_counter()
        cfg, folder = self.cfg, step_dir(self.steps_uri, step, rank, world)
        uri = _step_uris(folder)
        group_ids = _group_ids(rows, self.k, "prompt_id")
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
            from dynamicrubric.tasks import CODE_TASKS, anchors_from_outcomes

            if self.variant in ("dynamic", "static"):
                from dynamicrubric.rubrics import run_rubrics

                t = time.perf_counter()
                rubrics_uri = uri["rubrics"]
                generator = self._engines("generator", self.generator)
                calls = _Calls(generator, "rubrics")
                counts = run_rubrics(
                    uri["rollouts"],
                    rubrics_uri,
                    cfg,
                    generator=self.generator,
                    samples=cfg.rubrics.samples,
                    variant=self.variant,
                    seed=seed,
                    engine=generator,
                    allow_failed=True,
                )
                metrics.update(calls.done())
                timing["time/rubrics_s"] = time.perf_counter() - t
                metrics["rubrics/parse_rate"] = counts["parse_rate"]
                metrics["rubrics/truncated_rate"] = counts["truncated"] / max(counts["rubrics"], 1)
                metrics["rubrics/mean_items"] = counts["mean_items"]
            t = time.perf_counter()
            verifier = self._engines("verifier", self.verifier)
            calls = _Calls(verifier, "judge")
            counts = run_judge(
                uri["rollouts"],
                uri["judgments"],
                cfg,
                rubrics_uri=rubrics_uri,
                verifier=self.verifier,
                engine=verifier,
            )
            metrics.update(calls.done())
            timing["time/judge_s"] = time.perf_counter() - t
            metrics["judge/yes_rate"] = counts["yes_rate"]
            verifiable = prompts[prompts["meta"].notna() | prompts["reference"].notna()]
            if cfg.pipeline.stage_resources("train_policy").gpus:
                # No policy code runs in a GPU pod: code prompts get no outcome ranking (Δgap) here.
                code = verifiable["task"].isin(CODE_TASKS)
                metrics["rewards/unchecked_code_groups"] = float(code.sum())
                verifiable = verifiable[~code]
            anchors = (
                anchors_from_outcomes(
                    rollouts[rollouts["prompt_id"].isin(verifiable["prompt_id"])],
                    verifiable,
                    timeout_s=cfg.evaluate.sandbox_timeout_s,
                )
                if len(verifiable)
                else None
            )
        calls = {k: v for k, v in metrics.items() if "/calls_" in k}
        failed = _set_aside_failed(cfg, uri, rubrics_uri, group_ids, "train-policy", step, calls)
        metrics["rewards/failed_groups"] = len(failed)
        per_response: dict = {}
        if len(failed) < len(group_ids):
            scores = _aggregate(
                cfg,
                uri,
                rubrics_uri,
                None if anchors is None else anchors[~anchors["list_id"].isin(failed)],
                soft=cfg.aggregate.soft or self.variant == "verifiable",
                round_idx=self.round_idx,
                variant=self.variant,
                step=step,
            )
            metrics.update(scores.overall)
            per_response = scores.frame.groupby(["prompt_id", "sample_idx"])["score"].mean().to_dict()
        # A group that lost a verdict or its rubric gets no reward at all (TRL leaves None out of the
        # advantage), never a score computed from what was left of it.
        values = [
            None if pid in failed else float(per_response[(pid, idx)])
            for pid, idx in zip(rollouts["prompt_id"], rollouts["sample_idx"], strict=True)
        ]
        timing["time/reward_s"] = time.perf_counter() - started
        metrics.update(timing)
        return values, metrics


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
        self.served = _served(cfg, ("verifier",))
        self._last: tuple[Any, tuple[list, list]] | None = None

        def r_disc(prompts, completions, completion_ids, **kwargs):
            return self._rewards(completions, completion_ids, **kwargs)[0]

        def r_anchor(prompts, completions, completion_ids, **kwargs):
            return self._rewards(completions, completion_ids, **kwargs)[1]

        self.functions = [r_disc, r_anchor]

    def release_models(self) -> None:
        """Drop the engines loaded so far (training is over; writing the checkpoint needs the memory)."""
        self._engines = _engine_cache(self.cfg)

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
            rows, self.g, lambda r, rank, world: self.score(r, step, rank, world), self.served
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
        uri = _step_uris(folder)
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
        verifier = self._engines("verifier", self.verifier)
        calls = _Calls(verifier, "judge")
        counts = run_judge(
            uri["rollouts"],
            uri["judgments"],
            cfg,
            rubrics_uri=uri["rubrics"],
            verifier=self.verifier,
            engine=verifier,
        )
        call_metrics = calls.done()
        judge_s = time.perf_counter() - t
        failed = _set_aside_failed(cfg, uri, uri["rubrics"], set_ids, "train-evaluator", step, call_metrics)
        overall: dict = {}
        if len(failed) < len(set_ids):
            kept = anchors[~anchors["list_id"].isin(failed)] if len(anchors) else anchors
            result = _aggregate(
                cfg,
                uri,
                uri["rubrics"],
                kept if len(kept) else None,
                soft=cfg.aggregate.soft,
                round_idx=self.round_idx,
                variant="dynamic",
                step=step,
                stage="train-evaluator",
            )
            overall = result.overall
            rewards = read_frame(uri["rewards"], "rewards").set_index(["prompt_id", "rubric_idx"])
        values = []
        for sid in set_ids:
            for j in range(g):
                if sid in failed:  # a set that lost verdicts: no reward for any of its rubric samples
                    values.append((None, None))
                    continue
                r = rewards.loc[(sid, j)]
                anchor = None if pd.isna(r["r_anchor"]) else float(r["r_anchor"])
                values.append((float(r["r_disc"]), anchor))
        # Parse rate among the samples not cut off by the token limit; the cut-off ones are reported apart.
        truncated = rubrics["parse_status"] == TRUNCATED
        complete = rubrics[~truncated]
        metrics = {
            **overall,
            **call_metrics,
            "rewards/failed_groups": len(failed),
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
    "calls",  # JSON: every server request's outcome, by role (train.py's metrics hold them per step too)
    "rollouts",
    "rubrics",
    "judgments",
    "scores",
    "rewards",
    "diagnostics",
    "metrics",
    "anchors",
)


def _step_uris(folder: str) -> dict[str, str]:
    return {
        name: store.join(folder, f"{name}.json" if name == "calls" else f"{name}.parquet")
        for name in _STEP_ARTIFACTS
    }


def _served(cfg: Config, roles: tuple[str, ...]) -> bool:
    return any(getattr(cfg.models, f"{role}_url") for role in roles)


def _engine_cache(cfg: Config) -> Callable[[str, str], Any]:
    """Each role's engine, made once per process: a client of the role's server when the config names
    one (`models.<role>_url`, set by the training task for the servers it starts), else the model
    loaded in-process, which only the CPU engine may do (vLLM engines inside every training rank would
    all land on GPU 0 and cannot fit beside the trainer)."""
    from dynamicrubric.engines import EngineError, load_engine

    loaded: dict[str, Any] = {}

    def get(role: str, ref: str) -> Any:
        if role not in loaded:
            import torch

            url = getattr(cfg.models, f"{role}_url")
            if not url and cfg.engine.engine != "hf":
                raise EngineError(
                    f"the training reward calls the {role} through a model server on GPUs: set "
                    f"train_*.reward_gpus (the task serves it) or models.{role}_url"
                )
            # Loading initialises weights from torch's global RNG; the trainer's sampling draws from it
            # too, and a resumed run loads the engines at another step than an uninterrupted one.
            with torch.random.fork_rng(devices=[]):
                model = ref if url else str(resolve_model(ref))
                loaded[role] = load_engine(model, cfg.engine, url=url, serving=cfg.serving)
        return loaded[role]

    return get


class _Calls:
    """The server requests one scoring call made, as metrics under `prefix` (empty for in-process)."""

    def __init__(self, engine: Any, prefix: str) -> None:
        self.ledger = getattr(engine, "ledger", None)  # only served engines make requests
        self.before = self.ledger.snapshot() if self.ledger is not None else None
        self.prefix = prefix

    def done(self) -> dict[str, float]:
        if self.ledger is None:
            return {}
        return {f"{self.prefix}/calls_{k}": float(v) for k, v in self.ledger.since(self.before).items()}


class RewardError(RuntimeError):
    """A training step whose scoring failed past the failure budget; the message says what happened."""


def _set_aside_failed(
    cfg: Config,
    uri: dict[str, str],
    rubrics_uri: str | None,
    group_ids: list[str],
    stage: str,
    step: int,
    calls: dict[str, float],
) -> set[str]:
    """The groups that lost a verdict (p_yes NaN: a failed request, or a verifier that gave no label) or
    a rubric sample (its request failed). Their rows move from the step's artifacts to `failed-*.parquet`
    beside them, so aggregation reads only whole groups and nothing asked is lost. Over the step's
    failure budget (`serving.max_failed_fraction`) the step fails with one line."""
    from dynamicrubric.engines import FAILED

    # The requests' outcomes are part of the step's record, also (above all) when the step fails here.
    store.write_bytes(uri["calls"], json.dumps(calls, indent=1, sort_keys=True).encode())
    judgments = read_frame(uri["judgments"], "judgments")
    failed = set(judgments.loc[judgments["p_yes"].isna(), "prompt_id"])
    rubrics = read_frame(rubrics_uri, "rubrics") if rubrics_uri else None
    if rubrics is not None:
        failed |= set(rubrics.loc[rubrics["parse_status"] == FAILED, "prompt_id"])
    if not failed:
        return failed
    share = len(failed) / len(group_ids)
    if share > cfg.serving.max_failed_fraction:
        raise RewardError(
            f"{stage} step {step}: {len(failed)} of {len(group_ids)} groups lost verdicts or rubrics "
            f"({share:.0%} > serving.max_failed_fraction={cfg.serving.max_failed_fraction}); requests: "
            + ", ".join(f"{k.split('/')[-1]} {int(v)}" for k, v in sorted(calls.items()) if v)
            + f"; the step's artifacts and calls.json are in {uri['calls'].rsplit('/', 1)[0]}"
        )
    frames = {"judgments": judgments, "rollouts": read_frame(uri["rollouts"], "rollouts")}
    if rubrics is not None:
        frames["rubrics"] = rubrics
    for name, frame in frames.items():
        lost = frame["prompt_id"].isin(failed)
        write_artifact(_failed_uri(uri[name]), name, frame[lost])
        write_artifact(uri[name], name, frame[~lost])
    log.warning(
        "%s step %d: %d of %d groups get no reward (lost verdicts or rubrics): %s",
        stage,
        step,
        len(failed),
        len(group_ids),
        sorted(failed)[:5],
    )
    return failed


def _failed_uri(artifact_uri: str) -> str:
    folder, name = artifact_uri.rstrip("/").rsplit("/", 1)
    return f"{folder}/failed-{name}"


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
