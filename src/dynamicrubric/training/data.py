"""A training stage's inputs: its dataset (one row per prompt, or per candidate set), read from the
stage's artifacts and checked before any model loads (the batch splits, the prompts fit the context)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from dynamicrubric.artifacts import read_artifact, read_frames
from dynamicrubric.config import Config, SeedPurpose, TrainConfig, round_seed
from dynamicrubric.models import resolve_model


def policy_dataset(prompts_uri: str) -> dict[str, list]:
    """One row per prompt of the pool, its columns as Python lists.

    Read through Arrow, not pandas: pandas 3 turns a missing reference or meta into NaN, a float that
    `Dataset.from_dict` refuses in a string column; Arrow gives None."""
    table = read_artifact(prompts_uri, "prompts")
    column = {name: table.column(name).to_pylist() for name in table.schema.names}
    return {
        "prompt": [[{"role": "user", "content": p}] for p in column["prompt"]],
        "prompt_id": column["prompt_id"],
        "prompt_text": column["prompt"],
        "task": column["task"],
        "reference": column["reference"],
        "meta": column["meta"],
    }


def evaluator_dataset(
    cfg: Config, candidate_sets: pd.DataFrame, anchors: pd.DataFrame, round_idx: int
) -> dict[str, list]:
    """One row per candidate set: the generator's prompt (the same text the rubrics stage builds),
    the set's responses, and their reference ranks where the set has an anchor list."""
    from dynamicrubric.rubrics import generator_messages, rubric_requests

    requests = rubric_requests(
        candidate_sets, cfg, "dynamic", round_seed(cfg, round_idx, SeedPurpose.EVALUATOR_RUBRICS)
    )
    ranks = {
        (lid, int(idx)): int(rank)
        for lid, idx, rank in zip(anchors["list_id"], anchors["sample_idx"], anchors["rank"], strict=True)
    }
    by_set = {pid: g.sort_values("sample_idx") for pid, g in candidate_sets.groupby("prompt_id", sort=False)}
    columns: dict[str, list] = {
        k: [] for k in ("prompt", "prompt_id", "generator_prompt", "set_prompt", "responses", "sample_idx")
    }
    columns["anchor_ranks"] = []
    for pid, text in zip(requests["prompt_id"], requests["generator_prompt"], strict=True):
        group = by_set[pid]
        idx = [int(i) for i in group["sample_idx"]]
        set_ranks = [ranks.get((pid, i)) for i in idx]
        columns["prompt"].append(generator_messages(text))
        columns["prompt_id"].append(str(pid))
        columns["generator_prompt"].append(text)
        columns["set_prompt"].append(str(group["prompt"].iloc[0]))
        columns["responses"].append(group["response"].tolist())
        columns["sample_idx"].append(idx)
        columns["anchor_ranks"].append(set_ranks if all(r is not None for r in set_ranks) else [])
    return columns


def stage_inputs(
    stage: str, cfg: Config, inputs: dict[str, Any]
) -> tuple[dict[str, list], str, int, bool | None]:
    """A stage's dataset (its input artifacts read and validated), starting model, completion length
    and thinking switch, from the keyword arguments `launch` takes."""
    if stage == "train-policy":
        dataset = policy_dataset(inputs["prompts_uri"])
        return dataset, inputs["policy"], cfg.rollout.max_new_tokens, cfg.models.enable_thinking.policy
    candidate_sets = read_frames(inputs["candidates"], "rollouts")
    anchors = read_frames(inputs["anchors"], "anchors")
    dataset = evaluator_dataset(cfg, candidate_sets, anchors, inputs.get("round_idx", 0))
    return dataset, inputs["generator"], cfg.rubrics.max_new_tokens, cfg.models.enable_thinking.generator


def check_context(
    stage: str, cfg: Config, model_ref: str, dataset: dict[str, list], room: int, enable_thinking: bool | None
) -> None:
    """Refuse a prompt whose chat, with `room` completion tokens, does not fit the model's context,
    before any model loads: training would try to allocate many GB for it (a 4 MB prompt: 17 GB). The
    inference stages refuse it the same way (engines)."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model(model_ref)
    limits = [int(getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 0) or 0)]
    if cfg.engine.engine == "vllm" and cfg.engine.max_model_len:  # the trainer's vLLM gets this length
        limits.append(cfg.engine.max_model_len)
    context = min((n for n in limits if n), default=0)
    if not context:
        return  # the model states no context length: nothing to check against
    tokenizer = AutoTokenizer.from_pretrained(path)
    switch = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    for prompt_id, messages in zip(dataset["prompt_id"], dataset["prompt"], strict=True):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **switch)
        length = len(tokenizer.encode(text, add_special_tokens=False))
        if length + room > context:
            raise ValueError(
                f"{stage}: prompt {prompt_id!r} has {length} tokens; with {room} more for its completion it "
                f"exceeds the context length {context} of {model_ref!r}"
            )


def check_batch(stage: str, tcfg: TrainConfig, num_generations: int, pool: int) -> int:
    """Gradient-accumulation steps for one step's batch; a clear error for a batch that cannot be split."""
    completions = tcfg.prompts_per_step * num_generations
    per_process, rest = divmod(completions, tcfg.world_size)
    if rest or per_process % tcfg.micro_batch_size:
        raise ValueError(
            f"{stage}: a step holds prompts_per_step × num_generations = {completions} completions, which "
            f"must split evenly over world_size={tcfg.world_size} processes in micro-batches of "
            f"micro_batch_size={tcfg.micro_batch_size}"
        )
    if pool < tcfg.prompts_per_step:
        raise ValueError(
            f"{stage}: prompts_per_step is {tcfg.prompts_per_step} but the pool holds only {pool} prompt(s)"
        )
    return per_process // tcfg.micro_batch_size
