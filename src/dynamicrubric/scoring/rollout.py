"""Stage 1, rollout: the policy samples K responses per prompt.

prompts artifact → rollouts artifact (prompt id, sample index, response, token count, finish reason,
policy reference, seed). Same seed and inputs → identical rollouts.
"""

from __future__ import annotations

import logging

import pandas as pd

from dynamicrubric.engines import Engine, load_engine, prompts_named
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import Config
from dynamicrubric.infra.model_references import model_reference

log = logging.getLogger(__name__)


def policy_prompt(engine: Engine, prompt: str, enable_thinking: bool | None = None) -> str:
    """The exact text the policy continues; the trainer rebuilds it the same way to score responses
    (with the same `models.enable_thinking.policy`)."""
    return engine.chat_prompt([{"role": "user", "content": prompt}], enable_thinking=enable_thinking)


def sample_rollouts(
    engine: Engine, prompts: pd.DataFrame, cfg: Config, *, seed: int, policy: str
) -> pd.DataFrame:
    r = cfg.rollout
    thinking = cfg.models.enable_thinking.policy
    with prompts_named(list(prompts["prompt_id"])):
        generations = engine.generate(
            [policy_prompt(engine, p, thinking) for p in prompts["prompt"]],
            n=r.k,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            seed=seed,
            desc="rollout",
        )
    rows = [
        {
            "prompt_id": row.prompt_id,
            "sample_idx": j,
            "prompt": row.prompt,
            "response": text,
            "num_tokens": num_tokens,
            "finish_reason": reason,
            "policy": policy,
            "seed": seed,
        }
        for row, gen in zip(prompts.itertuples(), generations, strict=True)
        for j, (text, num_tokens, reason) in enumerate(
            zip(gen.texts, gen.num_tokens, gen.finish_reasons, strict=True)
        )
    ]
    return pd.DataFrame(rows)


def run_rollout(
    prompts_uri: str,
    out_uri: str,
    cfg: Config,
    *,
    policy: str | None = None,
    seed: int | None = None,
    shard: int = 0,
    num_shards: int = 1,
    engine: Engine | None = None,
) -> dict:
    """Sample cfg.rollout.k responses for this shard's prompts (every num_shards-th, from `shard`)."""
    policy = policy or cfg.models.policy
    seed = cfg.seed if seed is None else seed
    prompts = read_frame(prompts_uri, "prompts")
    prompts = prompts.iloc[shard::num_shards].reset_index(drop=True)
    if prompts.empty:
        raise ValueError(f"{prompts_uri}: shard {shard} of {num_shards} holds no prompts")
    engine = engine or load_engine(policy, cfg.engine)
    # the stored reference is normalised: a relative path and its absolute form give the same bytes
    rollouts = sample_rollouts(engine, prompts, cfg, seed=seed, policy=model_reference(policy))
    write_artifact(out_uri, "rollouts", rollouts)
    counts = {
        "prompts": len(prompts),
        "responses": len(rollouts),
        "truncated": int((rollouts["finish_reason"] == "length").sum()),
        "mean_tokens": float(rollouts["num_tokens"].mean()),
    }
    log.info("rollout: %s -> %s", counts, out_uri)
    return counts
