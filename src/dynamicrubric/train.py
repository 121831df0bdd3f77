"""The two GRPO training stages: train-policy and train-evaluator, on one shared loop.

- `train_policy` reads the policy's `rollouts` and their `scores`; a response's reward is its score
  averaged over rubric samples, its group is its prompt's K responses. The policy's input is the chat
  template applied to the user prompt (exactly what rollout generation was fed) and the trained
  completion is the response, followed by eos when generation stopped on its own.
- `train_evaluator` reads the generator's `rubrics` and their `rewards`; a group is a candidate set's
  G rubric samples. R_disc and R_anchor are normalised within the group separately and summed,
  A = A_disc + λ·A_anchor (a group without anchors has A_anchor = 0).

The loop (`_train`) is plain GRPO (see `dynamicrubric.grpo`): the sampling policy's log-probs are
computed once, with no grad, before the first update. The stage starts from the very model that
sampled the data, so those log-probs are also the frozen reference's: one no-grad pass serves both
the importance ratio (1 on the first epoch) and the k3 KL, and no second model is kept in memory.

Checkpoints. The result is a Hugging Face folder (model + tokenizer, LoRA merged in, saved in the
dtype of the starting model) uploaded to `out_uri` with `store.upload_dir`, which writes `_COMPLETE`
last: a checkpoint is complete or absent, and a stage whose checkpoint is complete does nothing.
Every `cfg.save_every` optimiser steps a resumable state (trainable weights, optimiser state, step,
RNG states, metrics so far) is written atomically to `<out_uri>.work/state.pt` (a local file, or an
S3 object so that another pod can resume). A stage killed after step k and started again continues
from its last saved step and ends with tensors identical to an uninterrupted run's; the state is
deleted once the checkpoint is complete. The state carries a fingerprint of the inputs and config,
so a state left by a different run is ignored rather than resumed.

Scale. On one GPU node the same code runs data-parallel with FSDP (fully_shard per decoder layer):

    torchrun --nproc-per-node 8 -m dynamicrubric.train policy --rollouts ... --scores ... \
        --model ... --out s3://bucket/run/policy-1 --config run.yaml   # train_policy.world_size: 8

`WORLD_SIZE` (set by torchrun) must equal `cfg.world_size`; rank 0 writes every file. See
docs/training.md for multi-node runs as a Kubeflow Trainer job.

Device: CUDA with bf16 autocast over fp32 master weights when available, else CPU fp32.

Test hook: with `DYNRUBRIC_TEST_STALL_AFTER_STEP=k` the process prints `stalled after step k` and
sleeps forever right after saving the resumable state of step k, so a test can kill it at a point
where it is provably mid-run. It has no other effect.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from dynamicrubric import store
from dynamicrubric.artifacts import read_frame, read_frames, write_artifact
from dynamicrubric.config import EvaluatorTrainConfig, TrainConfig
from dynamicrubric.grpo import group_advantages, grpo_loss, token_logprobs

log = logging.getLogger(__name__)

STALL_ENV = "DYNRUBRIC_TEST_STALL_AFTER_STEP"
SUMMARY_FILE = "dynamicrubric_train.json"
METRIC_NAMES = ("loss", "kl", "clip_frac", "advantage_mean", "reward_mean", "grad_norm", "tokens_per_s")


@dataclass(frozen=True)
class Example:
    """One trained sequence: a user message, the completion sampled for it, its reward and advantage."""

    group: str
    user_message: str
    completion: str
    add_eos: bool
    reward: float
    advantage: float


# --------------------------------------------------------------------------------------------------
# Data: artifacts -> examples with group advantages

Uris = str | list[str]  # one artifact, or the shards of a fan-out (keys must stay unique across them)


def _read(uris: Uris, kind_name: str) -> pd.DataFrame:
    return read_frame(uris, kind_name) if isinstance(uris, str) else read_frames(list(uris), kind_name)


def policy_examples(rollouts_uri: Uris, scores_uri: Uris, cfg: TrainConfig) -> list[Example]:
    """Rollouts with their mean score over rubric samples; advantages within each prompt's group."""
    rollouts = _read(rollouts_uri, "rollouts")
    scores = _read(scores_uri, "scores")
    reward = scores.groupby(["prompt_id", "sample_idx"], as_index=False)["score"].mean()
    df = rollouts.merge(reward, on=["prompt_id", "sample_idx"], how="outer", indicator=True)
    unscored = df[df["_merge"] == "left_only"]
    if len(unscored):
        first = unscored.iloc[0]
        raise ValueError(
            f"{scores_uri}: {len(unscored)} rollout(s) have no score, e.g. prompt_id={first.prompt_id!r} "
            f"sample_idx={first.sample_idx}"
        )
    orphan = df[df["_merge"] == "right_only"]
    if len(orphan):
        first = orphan.iloc[0]
        raise ValueError(
            f"{scores_uri}: {len(orphan)} score(s) name a response absent from {rollouts_uri}, "
            f"e.g. prompt_id={first.prompt_id!r} sample_idx={first.sample_idx}"
        )
    df = df.sort_values(["prompt_id", "sample_idx"]).reset_index(drop=True)
    codes = torch.as_tensor(pd.factorize(df["prompt_id"])[0])
    adv = group_advantages(torch.tensor(df["score"].to_numpy(float)), codes, scale=cfg.scale_rewards)
    return [
        Example(
            group=str(row.prompt_id),
            user_message=row.prompt,
            completion=row.response,
            add_eos=row.finish_reason == "stop",
            reward=float(row.score),
            advantage=float(a),
        )
        for row, a in zip(df.itertuples(index=False), adv.tolist(), strict=True)
    ]


def evaluator_examples(rubrics_uri: Uris, rewards_uri: Uris, cfg: EvaluatorTrainConfig) -> list[Example]:
    """Rubric samples with A = A_disc + λ·A_anchor, each normalised within its candidate set."""
    rubrics = _read(rubrics_uri, "rubrics")
    rewards = _read(rewards_uri, "rewards")
    keys = ["prompt_id", "rubric_idx"]
    df = rubrics.merge(rewards, on=keys, how="outer", indicator=True)
    problems = {
        "left_only": "rubric sample(s) have no reward",
        "right_only": f"reward(s) name a rubric sample absent from {rubrics_uri}",
    }
    for side, what in problems.items():
        bad = df[df["_merge"] == side]
        if len(bad):
            first = bad.iloc[0]
            raise ValueError(
                f"{rewards_uri}: {len(bad)} {what}, e.g. prompt_id={first.prompt_id!r} rubric_idx={first.rubric_idx}"
            )
    df = df.sort_values(keys).reset_index(drop=True)
    codes = torch.as_tensor(pd.factorize(df["prompt_id"])[0])
    a_disc = group_advantages(torch.tensor(df["r_disc"].to_numpy(float)), codes, scale=cfg.scale_rewards)
    has_anchor = df["r_anchor"].notna()
    mixed = has_anchor.groupby(df["prompt_id"]).nunique() > 1
    if mixed.any():
        raise ValueError(
            f"{rewards_uri}: candidate set {mixed[mixed].index[0]!r} has r_anchor for some rubric samples and "
            "null for others; a set's samples must all have it or all lack it"
        )
    a_anchor = torch.zeros(len(df), dtype=torch.float64)
    if has_anchor.any():
        idx = torch.as_tensor(has_anchor.to_numpy().nonzero()[0])
        a_anchor[idx] = group_advantages(
            torch.tensor(df.loc[has_anchor, "r_anchor"].to_numpy(float)),
            codes[idx],
            scale=cfg.scale_rewards,
        )
    adv = a_disc + cfg.anchor_weight * a_anchor
    reward = df["r_disc"].to_numpy(float) + cfg.anchor_weight * df["r_anchor"].fillna(0.0).to_numpy(float)
    return [
        Example(
            group=str(row.prompt_id),
            user_message=row.generator_prompt,
            completion=row.completion,
            add_eos=row.finish_reason == "stop",
            reward=float(r),
            advantage=float(a),
        )
        for row, r, a in zip(df.itertuples(index=False), reward, adv.tolist(), strict=True)
    ]


# --------------------------------------------------------------------------------------------------
# Public stages


def train_policy(
    rollouts_uri: Uris,
    scores_uri: Uris,
    model_ref: str,
    out_uri: str,
    cfg: TrainConfig,
    *,
    metrics_uri: str | None = None,
    round_idx: int = 0,
) -> dict:
    """GRPO on the policy's responses; writes a checkpoint folder to `out_uri`; returns final metrics."""
    if store.is_complete(out_uri):
        return _already_done(out_uri, metrics_uri)
    examples = policy_examples(rollouts_uri, scores_uri, cfg)
    return _train(
        examples, model_ref, out_uri, cfg, stage="train_policy", metrics_uri=metrics_uri, round_idx=round_idx
    )


def train_evaluator(
    rubrics_uri: Uris,
    rewards_uri: Uris,
    model_ref: str,
    out_uri: str,
    cfg: EvaluatorTrainConfig,
    *,
    metrics_uri: str | None = None,
    round_idx: int = 0,
) -> dict:
    """GRPO on the generator's rubric samples; writes a checkpoint folder to `out_uri`; returns final metrics."""
    if store.is_complete(out_uri):
        return _already_done(out_uri, metrics_uri)
    examples = evaluator_examples(rubrics_uri, rewards_uri, cfg)
    return _train(
        examples,
        model_ref,
        out_uri,
        cfg,
        stage="train_evaluator",
        metrics_uri=metrics_uri,
        round_idx=round_idx,
    )


def _already_done(out_uri: str, metrics_uri: str | None) -> dict:
    log.info("%s: checkpoint already complete; nothing to do", out_uri)
    try:  # through the folder's manifest: on S3 its files live under the writer's version
        summary_uri = store.folder_file(out_uri, SUMMARY_FILE)
    except store.StoreError:  # a checkpoint written by something else: nothing recorded
        return {}
    summary = json.loads(store.read_bytes(summary_uri))
    if metrics_uri and not store.exists(metrics_uri):
        write_artifact(metrics_uri, "metrics", summary["metrics_rows"])
    return summary["final"]


# --------------------------------------------------------------------------------------------------
# Model loading, devices, distributed


def resolve_model_ref(ref: str) -> Path:
    """A local HF folder for `ref`: a store URI of a checkpoint (s3:// is fetched once into the cache),
    a local folder, or anything `models.resolve_model` takes."""
    from dynamicrubric.models import cache_dir, resolve_model

    if store.is_s3(ref):
        dest = cache_dir() / "checkpoints" / hashlib.sha256(ref.encode()).hexdigest()[:16]
        if not (dest / store.COMPLETE_MARKER).is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
            try:
                store.download_dir(ref, tmp)  # refuses an incomplete checkpoint
                try:
                    os.rename(tmp, dest)
                except OSError:  # another process finished the same download first
                    if not (dest / store.COMPLETE_MARKER).is_file():
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return dest
    if ref.startswith("file://"):
        ref = str(store.local_path(ref))
    return resolve_model(ref)


def _dist_setup(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """(rank, world size, device); initialises torch.distributed from torchrun's env when WORLD_SIZE > 1."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.world_size:
        raise ValueError(
            f"world_size is {cfg.world_size} in the config but WORLD_SIZE={world} in the environment; "
            f"launch with `torchrun --nproc-per-node {cfg.world_size} -m dynamicrubric.train ...`"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return (dist.get_rank() if world > 1 else 0), world, device


def _lora_config(cfg: TrainConfig):
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def _build_model(path: Path, cfg: TrainConfig):
    """fp32 model (LoRA-wrapped when lora_rank > 0) on CPU; LoRA init draws from torch's seeded RNG."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    if cfg.lora_rank:
        from peft import get_peft_model

        model = get_peft_model(model, _lora_config(cfg))
    return model


def _enable_checkpointing(model) -> None:
    """Recompute each layer's activations in backward (transformers >= 5.24 renamed the method)."""
    kwargs = {"use_reentrant": False}  # non-reentrant works with frozen inputs (LoRA) and FSDP
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _saved_dtype(path: Path) -> torch.dtype:
    """The dtype the starting checkpoint was stored in; the trained one is saved the same way."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _shard(model, world: int):
    """FSDP2: shard each decoder layer, then the root (embeddings, head, norms)."""
    if world == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer_classes = set(getattr(inner, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module)
    fully_shard(model)
    return model


# --------------------------------------------------------------------------------------------------
# Batching and log-probs


@dataclass(frozen=True)
class Tokenized:
    prompt_ids: list[int]
    completion_ids: list[int]


def _tokenize(examples: list[Example], tokenizer) -> list[Tokenized]:
    out = []
    for ex in examples:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": ex.user_message}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        completion_ids = tokenizer(ex.completion, add_special_tokens=False).input_ids
        if ex.add_eos:
            completion_ids = [*completion_ids, tokenizer.eos_token_id]
        if not prompt_ids:
            raise ValueError(f"group {ex.group!r}: the templated prompt is empty")
        out.append(Tokenized(prompt_ids, completion_ids))
    return out


def _sequence_logprobs(
    model, batch: list[Tokenized], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion [b, Lc] and its 0/1 mask, one forward pass.

    Sequences are right-padded; only the positions that predict completion tokens go through the LM
    head (`logits_to_keep`), which matters for long generator prompts and large vocabularies.
    """
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in batch]
    width, comp_width = max(lengths), max(1, max(len(t.completion_ids) for t in batch))
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    targets = torch.full((len(batch), comp_width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), comp_width))
    for i, t in enumerate(batch):
        seq = t.prompt_ids + t.completion_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        targets[i, : len(t.completion_ids)] = torch.tensor(t.completion_ids, dtype=torch.long)
        mask[i, : len(t.completion_ids)] = 1
    start = min(len(t.prompt_ids) for t in batch) - 1  # first position that predicts a completion token
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            logits_to_keep=width - start,
            use_cache=False,
        ).logits
    # row i's completion token j is predicted at position len(prompt_i) - 1 + j, i.e. logits column that - start
    cols = torch.stack([len(t.prompt_ids) - 1 - start + torch.arange(comp_width) for t in batch])
    cols = cols.clamp(max=logits.shape[1] - 1).to(device)
    picked = logits.gather(1, cols.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    return token_logprobs(picked, targets.to(device)), mask.to(device)


def _plan(n: int, cfg: TrainConfig, world: int) -> list[list[int]]:
    """Example indices of every optimiser step: a seeded permutation per epoch, cut into global batches."""
    per_step = cfg.micro_batch_size * cfg.grad_accum * world
    steps: list[list[int]] = []
    for epoch in range(cfg.epochs):
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=gen).tolist()
        steps += [order[i : i + per_step] for i in range(0, n, per_step)]
    return steps


# --------------------------------------------------------------------------------------------------
# Resumable state


def _work_uri(out_uri: str) -> str:
    return str(out_uri).rstrip("/") + ".work"


def _fingerprint(examples: list[Example], model_ref: str, cfg: TrainConfig, stage: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([stage, model_ref, cfg.model_dump(mode="json")], sort_keys=True).encode())
    for ex in examples:
        h.update(json.dumps([ex.group, ex.user_message, ex.completion, ex.add_eos, ex.advantage]).encode())
    return h.hexdigest()


def _state_dicts(model, optimizer) -> tuple[dict, dict]:
    """Full (unsharded, CPU) trainable weights and optimiser state; a collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_state_dict(model, optimizer, options=opts)


def _save_state(
    state_uri: str, model, optimizer, step: int, metrics: list[dict], fingerprint: str, rank: int, world: int
) -> None:
    model_sd, optim_sd = _state_dicts(model, optimizer)
    if rank == 0:
        state = {
            "fingerprint": fingerprint,
            "step": step,
            "model": model_sd,
            "optimizer": optim_sd,
            "metrics": metrics,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        store.write_bytes(state_uri, buf.getvalue())  # atomic locally and on S3
    _barrier(world)


def _load_state(state_uri: str, fingerprint: str) -> dict | None:
    if not store.exists(state_uri):
        return None
    state = torch.load(io.BytesIO(store.read_bytes(state_uri)), map_location="cpu", weights_only=True)
    if state.get("fingerprint") != fingerprint:
        log.warning("%s: resumable state belongs to different inputs or config; starting over", state_uri)
        return None
    return state


def _restore(state: dict, model, optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    opts = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=opts
    )
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _export(path: Path, trained: dict, cfg: TrainConfig, tokenizer, folder: Path) -> None:
    """Write a plain HF checkpoint: the starting model with the trained weights (LoRA merged in)."""
    model = _build_model(path, cfg)
    missing, unexpected = model.load_state_dict(trained, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trainable - set(trained):
        raise RuntimeError(
            f"trained weights do not fit the model: unexpected {unexpected[:3]}, missing {sorted(trainable - set(trained))[:3]}"
        )
    if cfg.lora_rank:
        model = model.merge_and_unload()
    model.to(_saved_dtype(path)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# --------------------------------------------------------------------------------------------------
# The loop


def _train(
    examples: list[Example],
    model_ref: str,
    out_uri: str,
    cfg: TrainConfig,
    *,
    stage: str,
    metrics_uri: str | None,
    round_idx: int,
) -> dict:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    if not examples:
        raise ValueError(f"{stage}: no training examples")
    rank, world, device = _dist_setup(cfg)
    path = resolve_model_ref(model_ref)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{model_ref}: the tokenizer has no eos token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = _tokenize(examples, tokenizer)
    advantages = torch.tensor([ex.advantage for ex in examples], dtype=torch.float32)
    if not advantages.any():
        log.warning(
            "%s: every group has equal rewards, so every advantage is 0: the model will not move", stage
        )

    torch.manual_seed(cfg.seed)
    model = _build_model(path, cfg)
    if cfg.gradient_checkpointing:
        _enable_checkpointing(model)
    model = _shard(model.to(device), world)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)

    # Log-probs of the sampling policy = the frozen reference (the stage starts from the sampler).
    model.eval()
    old_logp: list[torch.Tensor] = []
    with torch.no_grad():
        for i in range(0, len(data), cfg.micro_batch_size):
            chunk = data[i : i + cfg.micro_batch_size]
            logp, _ = _sequence_logprobs(model, chunk, pad_id, device)
            old_logp += [logp[j, : len(t.completion_ids)].float().cpu() for j, t in enumerate(chunk)]
    model.train()

    plan = _plan(len(data), cfg, world)
    fingerprint = _fingerprint(examples, model_ref, cfg, stage)
    state_uri = store.join(_work_uri(out_uri), "state.pt")
    metrics: list[dict] = []
    start = 0
    state = _load_state(state_uri, fingerprint)
    if state is not None:
        _restore(state, model, optimizer)
        start, metrics = state["step"], list(state["metrics"])
        log.info("%s: resuming from step %d of %d (%s)", stage, start, len(plan), state_uri)
    stall_after = os.environ.get(STALL_ENV)

    bar = tqdm(total=len(plan), initial=start, desc=stage, disable=rank != 0)
    for step in range(start, len(plan)):
        t0 = time.perf_counter()
        batch = plan[step]
        comp_tokens = sum(len(data[i].completion_ids) for i in batch)
        denom = float(comp_tokens if cfg.loss_averaging == "token" else len(batch))
        mine = batch[rank::world]
        n_micro = math.ceil(math.ceil(len(batch) / world) / cfg.micro_batch_size)
        sums = torch.zeros(4, dtype=torch.float64)  # loss, kl, clip_frac, tokens seen
        for j in range(n_micro):
            idx = mine[j * cfg.micro_batch_size : (j + 1) * cfg.micro_batch_size]
            weight = 1.0
            if not idx:  # this rank ran out: a zero-weight pass keeps FSDP collectives in lockstep
                idx, weight = batch[:1], 0.0
            chunk = [data[i] for i in idx]
            logp, mask = _sequence_logprobs(model, chunk, pad_id, device)
            old = torch.zeros_like(logp)
            for k, i in enumerate(idx):
                old[k, : len(old_logp[i])] = old_logp[i].to(device)
            loss, stats = grpo_loss(
                logp, old, old, advantages[idx].to(device), mask,
                clip_eps=cfg.clip_eps, beta=cfg.beta, averaging=cfg.loss_averaging, denominator=denom,
            )  # fmt: skip
            # FSDP averages gradients over ranks; scaling by `world` turns that into the batch sum.
            (loss * weight * world).backward()
            sums += torch.tensor([loss.item() * weight, stats["kl"].item() * weight, stats["clip_frac"].item() * weight,
                                  weight * sum(len(t.prompt_ids) + len(t.completion_ids) for t in chunk)], dtype=torch.float64)  # fmt: skip
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if world > 1:
            import torch.distributed as dist

            sums = sums.to(device)
            dist.all_reduce(sums)
            sums = sums.cpu()
        values = {
            "loss": sums[0].item(),
            "kl": sums[1].item(),
            "clip_frac": sums[2].item(),
            "advantage_mean": advantages[batch].mean().item(),
            "reward_mean": sum(examples[i].reward for i in batch) / len(batch),
            "grad_norm": float(grad_norm),
            "tokens_per_s": sums[3].item() / max(time.perf_counter() - t0, 1e-9),
        }
        metrics += [{"name": k, "step": step + 1, "value": v} for k, v in values.items()]
        bar.update(1)
        bar.set_postfix(loss=f"{values['loss']:.4f}", kl=f"{values['kl']:.4f}")
        done = step + 1
        if done % cfg.save_every == 0 and done < len(plan):
            _save_state(state_uri, model, optimizer, done, metrics, fingerprint, rank, world)
            if stall_after is not None and int(stall_after) == done:
                print(f"stalled after step {done}", flush=True)
                while True:  # test hook: wait here to be killed
                    time.sleep(60)
    bar.close()

    trained, _ = _state_dicts(model, optimizer)
    final = _final_values(metrics)
    final["steps"] = float(len(plan))
    if rank == 0:
        rows = [{"round": round_idx, "stage": stage, "variant": "", **m} for m in metrics]
        _write_checkpoint(path, trained, cfg, tokenizer, out_uri, stage, round_idx, model_ref, final, rows)
        if metrics_uri:
            write_artifact(metrics_uri, "metrics", rows)
        if store.exists(state_uri):
            store.delete(state_uri)
    _barrier(world)
    return final


def _final_values(metrics: list[dict]) -> dict:
    last = max(m["step"] for m in metrics)
    return {m["name"]: m["value"] for m in metrics if m["step"] == last}


def _write_checkpoint(
    path, trained, cfg, tokenizer, out_uri, stage, round_idx, model_ref, final, rows
) -> None:
    if store.is_s3(out_uri):
        from dynamicrubric.models import cache_dir

        staging_root = cache_dir() / "train-work" / hashlib.sha256(out_uri.encode()).hexdigest()[:16]
    else:
        staging_root = store.local_path(_work_uri(out_uri))
    folder = staging_root / "export"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    _export(path, trained, cfg, tokenizer, folder)
    summary = {
        "stage": stage,
        "round": round_idx,
        "model_ref": model_ref,
        "config": cfg.model_dump(mode="json"),
        "final": final,
        "metrics_rows": rows,
    }
    (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    store.upload_dir(folder, out_uri)  # _COMPLETE last
    shutil.rmtree(folder, ignore_errors=True)
    if not any(staging_root.iterdir()):
        staging_root.rmdir()
    log.info("%s: wrote checkpoint %s", stage, out_uri)


# --------------------------------------------------------------------------------------------------
# Command line (also what torchrun launches)


def main(argv: list[str] | None = None) -> int:
    from dynamicrubric.config import load_config

    parser = argparse.ArgumentParser(
        prog="python -m dynamicrubric.train", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("stage", choices=["policy", "evaluator"])
    parser.add_argument("--data", required=True, help="rollouts (policy) or rubrics (evaluator) artifact URI")
    parser.add_argument(
        "--rewards", required=True, help="scores (policy) or rewards (evaluator) artifact URI"
    )
    parser.add_argument(
        "--model", required=True, help="starting model: built-in name, folder, or checkpoint URI"
    )
    parser.add_argument("--out", required=True, help="checkpoint folder URI")
    parser.add_argument("--metrics", default=None, help="metrics artifact URI")
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument(
        "--config", default=None, help="dynamicrubric YAML config (its train_* section is used)"
    )
    parser.add_argument("--preset", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_config(args.config, preset=args.preset)
    fn, cfg = (
        (train_policy, config.train_policy)
        if args.stage == "policy"
        else (train_evaluator, config.train_evaluator)
    )
    final = fn(
        args.data, args.rewards, args.model, args.out, cfg, metrics_uri=args.metrics, round_idx=args.round
    )
    print(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
