"""The stages that make the round's data: prompts and anchor lists, the policy's rollouts, and the
generator's candidate sets."""

from __future__ import annotations

import pandas as pd

from dynamicrubric import store
from dynamicrubric.infra.artifact_kinds import empty_table
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import Config
from dynamicrubric.stages.common import (
    LABEL,
    NUM_SHARDS,
    POLICY,
    SEED,
    SHARD,
    check_shard,
)
from dynamicrubric.stages.spec import Data, Stage

# ---- prepare-data


def prepare_data(cfg: Config, round_idx: int, *, out_train_prompts, out_eval_prompts, out_anchor_lists):
    """Training and held-out prompts, and the user's anchor lists (Nectar format) for R_anchor."""
    from dynamicrubric import tasks

    outputs = (out_train_prompts, out_eval_prompts, out_anchor_lists)
    with store.outputs_as_a_set(*outputs) as (train, held_out, lists_out):
        write_artifact(train, "prompts", tasks.configured_prompts(cfg.data, "train"))
        write_artifact(held_out, "prompts", tasks.configured_prompts(cfg.data, "eval"))
        lists = [tasks.load_nectar(uri) for uri in cfg.data.anchors]
        write_artifact(lists_out, "anchors", pd.concat(lists) if lists else empty_table("anchors"))
    return {"train_prompts": len(read_frame(out_train_prompts, "prompts"))}


PREPARE_DATA = Stage(
    "prepare_data",
    "training and held-out prompts, and anchor lists",
    prepare_data,
    lambda v: "prepare-data",
    outputs=(
        Data("train_prompts", "prompts", "training prompts artifact to write"),
        Data("eval_prompts", "prompts", "held-out prompts artifact to write"),
        Data("anchor_lists", "anchors", "the user's ranked lists (anchors artifact) to write"),
    ),
)


# ---- rollout


def rollout(cfg: Config, round_idx: int, *, label, shard, num_shards, seed, policy, prompts, out_rollouts):
    from dynamicrubric.scoring.rollout import run_rollout

    return run_rollout(
        prompts, out_rollouts, cfg, policy=policy, seed=seed, shard=shard, num_shards=num_shards
    )


ROLLOUT = Stage(
    "rollout",
    "the policy samples K responses per prompt",
    rollout,
    lambda v: f"{v['label']}-rollout-{v['shard']}",
    params=(LABEL, SHARD, NUM_SHARDS, SEED),
    models=(POLICY,),
    inputs=(Data("prompts", "prompts", "prompts artifact"),),
    outputs=(Data("rollouts", "rollouts", "rollouts artifact to write"),),
    check=check_shard,
)


# ---- candidates


def rollouts_from_anchors(anchors: pd.DataFrame) -> pd.DataFrame:
    """Anchor lists as candidate sets (rollouts-shaped), so rubrics and judging treat them alike."""
    return pd.DataFrame(
        {
            "prompt_id": anchors["list_id"],
            "sample_idx": anchors["sample_idx"],
            "prompt": anchors["prompt"],
            "response": anchors["response"],
            "num_tokens": anchors["response"].str.split().str.len().fillna(0).astype(int),
            "finish_reason": "stop",
            "policy": "anchor:" + anchors["source"],
            "seed": 0,
        }
    )


def candidates(
    cfg: Config,
    round_idx: int,
    *,
    shard,
    num_shards,
    rollouts,
    prompts,
    anchor_lists,
    out_candidate_sets,
    out_anchors,
):
    """The generator's candidate sets: the policy's rollouts plus this shard's anchor lists. The
    anchors output ranks the sets that have a reference order: rollouts ranked by verifiable
    correctness (correct ≻ incorrect) and the user's human-ranked lists."""
    from dynamicrubric import tasks

    policy_sets = read_frame(rollouts, "rollouts")
    outcome_lists = tasks.anchors_from_outcomes(
        policy_sets, read_frame(prompts, "prompts"), timeout_s=cfg.evaluate.sandbox_timeout_s
    )
    if not cfg.data.anchors_from_outcomes:
        outcome_lists = outcome_lists.iloc[0:0]
    user_lists = read_frame(anchor_lists, "anchors")
    mine = set(sorted(user_lists["list_id"].unique())[shard::num_shards])
    user_lists = user_lists[user_lists["list_id"].isin(mine)]
    with store.outputs_as_a_set(out_candidate_sets, out_anchors) as (sets_out, ranked_out):
        write_artifact(sets_out, "rollouts", pd.concat([policy_sets, rollouts_from_anchors(user_lists)]))
        write_artifact(ranked_out, "anchors", pd.concat([outcome_lists, user_lists]))
    return {
        "policy_sets": policy_sets["prompt_id"].nunique(),
        "ranked_policy_sets": outcome_lists["list_id"].nunique(),
        "anchor_lists": len(mine),
    }


CANDIDATES = Stage(
    "candidates",
    "candidate sets and their reference rankings",
    candidates,
    lambda v: f"generator-candidates-{v['shard']}",
    params=(SHARD, NUM_SHARDS),
    inputs=(
        Data("rollouts", "rollouts", "the policy's rollouts"),
        Data("prompts", "prompts", "the prompts the rollouts answer (their answers rank the rollouts)"),
        Data("anchor_lists", "anchors", "human-ranked lists (anchors artifact)"),
    ),
    outputs=(
        Data("candidate_sets", "rollouts", "candidate sets (rollouts artifact) to write"),
        Data("anchors", "anchors", "reference rankings (anchors artifact) to write"),
    ),
    check=check_shard,
)
