"""A training stage's inputs: the job (its artifacts and models), what differs between the two
trainers, and its dataset (one row per prompt, or per candidate set), read from the stage's artifacts
and checked before any model loads (the batch splits, the prompts fit the context)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pandas as pd

from dynamicrubric.infra.artifacts import read_artifact, read_frames
from dynamicrubric.infra.config import (
    Config,
    PolicyTrainConfig,
    SeedPurpose,
    TrainConfig,
    policy_variant,
    round_seed,
)
from dynamicrubric.infra.model_folder_checks import check_model_folder
from dynamicrubric.infra.models import resolve_model_config

TRAINING_STAGES = ("train-policy", "train-evaluator")


@dataclass(frozen=True)
class TrainingJob:
    """One training stage's work: what it reads and writes. The launcher hands it to every training
    process as JSON; the trainer and its reward functions read it from there."""

    stage: str  # one of TRAINING_STAGES
    out_uri: str  # the checkpoint folder to write
    steps_uri: str  # the folder for each step's scoring artifacts
    metrics_uri: str | None = None  # the per-step metrics artifact
    round_idx: int = 0
    policy: str = ""  # train-policy: the starting policy
    generator: str = ""  # train-evaluator: the starting generator; train-policy: G_t for the reward
    verifier: str = ""
    prompts_uri: str = ""  # train-policy: the prompt pool
    candidates: tuple[str, ...] = ()  # train-evaluator: candidate sets (one per shard)
    anchors: tuple[str, ...] = ()  # train-evaluator: their reference rankings

    def __post_init__(self) -> None:
        if self.stage not in TRAINING_STAGES:
            raise ValueError(
                f"unknown training stage {self.stage!r}; expected one of {', '.join(TRAINING_STAGES)}"
            )
        # lists (from a caller or JSON) become tuples, so that a job stays immutable and comparable
        object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "anchors", tuple(self.anchors))

    @property
    def model_ref(self) -> str:
        """The model this stage trains."""
        return self.policy if self.stage == "train-policy" else self.generator

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainingJob:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Trainee:
    """What differs between the two trainers, read from the config: how the trained model samples (the
    policy's K completions, the generator's G rubric samples), how its rewards are mixed, its chat
    template switch and, for the generator, the rubric grammar its samples are decoded under."""

    tcfg: TrainConfig
    num_generations: int
    temperature: float
    top_p: float
    max_new_tokens: int
    enable_thinking: bool | None
    variant: str  # the reward's variant, named in the metrics rows
    reward_weights: list[float] | None = None  # the generator's [1, λ] (R_disc, R_anchor)
    constrain_items: int | None = None  # the generator's rubric grammar, when rubrics are constrained

    @property
    def scale_rewards(self) -> str | None:
        """The policy's advantage scaling; None for the generator, whose rewards TRL's
        normalize_then_sum normalises each within its group whatever scale_rewards says."""
        return self.tcfg.scale_rewards if isinstance(self.tcfg, PolicyTrainConfig) else None


def trainee(cfg: Config, stage: str) -> Trainee:
    """The policy samples as the rollout stage does; the generator as the rubrics stage does."""
    if stage == "train-policy":
        r = cfg.rollout
        sampling = (r.k, r.temperature, r.top_p, r.max_new_tokens)
        return Trainee(cfg.train_policy, *sampling, cfg.models.enable_thinking.policy, policy_variant(cfg))
    r, tcfg = cfg.rubrics, cfg.train_evaluator
    sampling = (r.train_samples, r.temperature, r.top_p, r.max_new_tokens)
    items = r.num_items if r.constrained else None
    thinking = cfg.models.enable_thinking.generator
    return Trainee(tcfg, *sampling, thinking, "dynamic", [1.0, tcfg.anchor_weight], items)


def job_dataset(cfg: Config, job: TrainingJob) -> dict[str, list]:
    """The stage's dataset, its input artifacts read and validated."""
    if job.stage == "train-policy":
        return policy_dataset(job.prompts_uri)
    candidate_sets = read_frames(list(job.candidates), "rollouts")
    return evaluator_dataset(cfg, candidate_sets, read_frames(list(job.anchors), "anchors"), job.round_idx)


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
    from dynamicrubric.scoring.rubrics import generator_messages, rubric_requests

    # One prompt per set, whatever rubrics.shuffle says: TRL's GRPO group is num_generations samples of
    # one dataset row, and its advantage compares samples of the same prompt. Samples that each read
    # their own order would be answers to different prompts, and the trained-on prompt (the row's)
    # would not be the one most of them were written for.
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


def check_context(
    stage: str, cfg: Config, model_ref: str, dataset: dict[str, list], room: int, enable_thinking: bool | None
) -> None:
    """Refuse a prompt whose chat, with `room` completion tokens, does not fit the model's context,
    before any model loads: training would try to allocate many GB for it (a 4 MB prompt: 17 GB). The
    inference stages refuse it the same way (engines). It reads the model's config and tokenizer only:
    a task with a pod's memory and disk must not fetch the weights just for this."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model_config(model_ref)
    check_model_folder(model_ref, path)  # a cut-off copy, a config of {}: here, not in two tracebacks
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
    if rest or per_process % tcfg.per_device_train_batch_size:
        raise ValueError(
            f"{stage}: a step holds prompts_per_step × num_generations = {completions} completions, which "
            f"must split evenly over world_size={tcfg.world_size} processes in micro-batches of "
            f"per_device_train_batch_size={tcfg.per_device_train_batch_size}"
        )
    if pool < tcfg.prompts_per_step:
        raise ValueError(
            f"{stage}: prompts_per_step is {tcfg.prompts_per_step} but the pool holds only {pool} prompt(s)"
        )
    return per_process // tcfg.per_device_train_batch_size
