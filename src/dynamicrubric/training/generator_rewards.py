"""`GeneratorRewards`: the generator's two rewards, R_disc and R_anchor, for TRL's GRPOTrainer (see
training/policy_reward.py for how the reward functions work)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pandas as pd

from dynamicrubric.infra.config import Config
from dynamicrubric.training.reward_common import (
    StepScorer,
    aggregate_step,
    artifact_table,
    completion_text,
    finish_reason,
    kept_on_failure,
    set_aside_failed,
    step_uris,
    write_step_tables,
)
from dynamicrubric.training.reward_parts import Scored, Share, log_all, score_by_groups, whole_step

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# The generator's rewards


class GeneratorRewards(StepScorer):
    """R_disc and R_anchor of the generator's rubric samples, as two TRL reward functions.

    TRL calls `r_disc` then `r_anchor` on the same batch; both come from one judging pass, so the
    second call reuses the first's result (kept for the last batch only, keyed by its content).
    """

    stage = "train_evaluator"

    def __init__(self, cfg: Config, **where: Any) -> None:
        super().__init__(cfg, **where)
        self.g = cfg.rubrics.train_samples
        self.max_tokens = cfg.rubrics.max_new_tokens
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
        values, metrics = score_by_groups(
            rows, self.g, lambda r, share: self.score(r, step, share), self.served
        )
        log_all(log_metric, metrics)
        result = ([v[0] for v in values], [v[1] for v in values])
        self._last = (key, result)
        return result

    def score(self, rows: list[dict], step: int, share: Share | None = None) -> Scored:
        """(r_disc, r_anchor) for whole groups of G rubric samples (`share` of the step's batch, default
        all of it); writes the step's artifacts (its part's)."""
        if not rows:
            return Scored([], {})
        from dynamicrubric.scoring.rubrics import REJECTED, TRUNCATED, rubric_rows

        started = time.perf_counter()
        cfg, g = self.cfg, self.g
        share = share or whole_step(rows, g)
        uri = step_uris(share.folder(self.steps_uri, step))
        set_ids = list(share.ids)
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
        tables = {
            "rollouts": artifact_table("rollouts", rollouts),
            "rubrics": artifact_table("rubrics", rubrics),
        }
        with kept_on_failure(uri, tables, step):
            judged = self.judge_step(tables)
            call_metrics = {k: v for k, v in judged.items() if "/calls_" in k}
            failed, loss = set_aside_failed(
                cfg, uri, tables, set_ids, "train-evaluator", step, call_metrics, self.servers(), share
            )
            overall: dict = {}
            if len(failed) < len(set_ids):
                kept = anchors[~anchors["list_id"].isin(failed)] if len(anchors) else anchors
                result = aggregate_step(
                    uri,
                    tables,
                    kept if len(kept) else None,
                    soft=cfg.aggregate.soft,
                    round_idx=self.round_idx,
                    variant="dynamic",
                    step=step,
                )
                overall = result["overall"]
                rewards = result["rewards"].set_index(["prompt_id", "rubric_idx"])
            else:
                write_step_tables(uri, tables, step)
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
            # off the grammar (a token it rejected ended the sample): scored as an empty rubric, counted here
            "rubrics/rejected_rate": float((rubrics["parse_status"] == REJECTED).mean()),
            "rubrics/mean_items": float(rubrics["items"].map(len).mean()),
            "judge/yes_rate": judged["judge/yes_rate"],
            "time/judge_s": judged["time/judge_s"],
            "time/reward_s": time.perf_counter() - started,
        }
        return Scored(values, metrics, loss)
