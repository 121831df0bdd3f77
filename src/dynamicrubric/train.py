"""The two training stages: online GRPO with TRL's `GRPOTrainer`, DynamicRubric as the reward.

Each stage is ordinary on-policy GRPO: at every step the model samples fresh completions for
`prompts_per_step` prompts, the reward functions of `dynamicrubric.rewards` score them, and the
model is updated. The rounds only order the two trainers (G_t first, then P_t).

- train-policy: the policy answers prompts drawn from the configured pool, K = rollout.k completions
  each; the reward is the round's evaluator (G_t's rubrics judged by V, the static rubric, the
  pointwise judge, or the task's checker: `judge.variant: verifiable`). Advantages are normalised
  within each prompt's group (`scale_rewards: group`).
- train-evaluator: the generator writes G = rubrics.train_samples rubric samples for a candidate set
  (a prompt and P_{t−1}'s K responses; one dataset row per set), decoded under the rubric's JSON
  schema. Two rewards, R_disc and R_anchor, are mixed at the advantage level with weights [1, λ].
  TRL's `normalize_then_sum` normalises each reward within its group, (r − mean)/(std + 1e-4),
  sums them with the weights (a set without an anchor ranking contributes 0 for R_anchor), and then
  divides the sum by its standard deviation over the whole batch. The paper stops after the sum. The
  extra division multiplies every advantage of the batch by one positive number: it changes no
  advantage's sign or relative size within the batch, only the step's scale (which Adam largely
  normalises away), so we accept TRL's mix rather than fork its advantage code.

Reference and loss. β (default 0.01) is a k3 KL penalty to the model the stage started from, i.e. the
previous round's checkpoint (P_{t−1} for P_t, G_{t−1} for G_t): each round regularises towards its
own starting point, not the base model. With LoRA the reference is the same model with the adapter
disabled, so no second copy is kept. `loss_type: dapo` (TRL's default) averages the clipped
policy-gradient loss over all completion tokens of the step: no per-sequence length bias (GRPO's
1/|o|), and no dependence on max_completion_length (Dr. GRPO's constant).

Checkpoints and resume. TRL saves a trainer checkpoint every `save_steps` steps in a local scratch
folder; a callback uploads it to `<out>.work/checkpoint-NNNNN` in the store (`_COMPLETE` last; for a
pod path /s3/b/k that is s3://b/k.work, since the pod's mount is uploaded only when the task succeeds)
with the starting model and a digest of the train config beside it, so a retried pod on another node
resumes from the newest complete one and ends with the same weights as an uninterrupted run; a
checkpoint of another model or config, or one with no steps left to train, is refused. The result is a
Hugging Face folder (LoRA merged, plus a summary JSON) written to `out_uri` with `store.upload_dir`:
every rank takes part in gathering the weights (a collective under FSDP), rank 0 writes them. A stage
whose output is complete does nothing.

Processes. `launch` (used by the pipeline's training components) runs this module under
`accelerate launch` with one process per GPU the task requests (`train_*.world_size`; FSDP on GPU
with the config shipped in `dynamicrubric/accelerate/`; one GPU is a plain one-process launch); on CPU
the same launcher runs one process (--cpu) or several (gloo). On GPU the trained model generates with
TRL's vLLM colocate mode (sleep mode on), and the reward reaches G and V through vLLM servers that
`launch` starts on the task's `reward_gpus` (serving.py), or through the user's endpoints
(`models.<role>_url`); on CPU the reward loads them in-process (see docs/training.md).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from dynamicrubric import store
from dynamicrubric.artifacts import read_artifact, read_frames, write_artifact
from dynamicrubric.config import (
    Config,
    SeedPurpose,
    TrainConfig,
    policy_variant,
    round_seed,
    served_roles,
)
from dynamicrubric.models import resolve_model

log = logging.getLogger(__name__)

SUMMARY_FILE = "dynamicrubric_train.json"
RESUME_INFO = "dynamicrubric_resume.json"  # beside each stored trainer checkpoint: the run that wrote it
# Test hook: with DYNRUBRIC_TEST_STALL_AFTER_STEP=k the process prints "stalled after step k" and sleeps
# once the step-k trainer checkpoint is in the store, so a test can kill it provably mid-run.
STALL_ENV = "DYNRUBRIC_TEST_STALL_AFTER_STEP"
STAGES = ("train-policy", "train-evaluator")


class TrainingError(ValueError):
    """A training process stopped on bad input; the message is the one the process raised."""


# TRL's per-step log keys kept as metrics (besides every reward-function metric, which is kept whole).
TRL_METRICS = {
    "loss": "loss",
    "kl": "kl",
    "entropy": "entropy",
    "grad_norm": "grad_norm",
    "reward": "reward_mean",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "completions/mean_length": "completion_length",
    "completions/clipped_ratio": "clipped_ratio",
    "clip_ratio/region_mean": "clip_ratio",
    "step_time": "time/step_s",
    "time/generation_s": "time/generation_s",
    "time/update_s": "time/update_s",
}


# --------------------------------------------------------------------------------------------------
# Public stages


def train_policy(
    cfg: Config,
    *,
    prompts_uri: str,
    policy: str,
    out_uri: str,
    steps_uri: str,
    metrics_uri: str | None = None,
    generator: str = "",
    verifier: str = "",
    round_idx: int = 0,
) -> dict:
    """Online GRPO on the policy; writes a checkpoint folder to `out_uri`; returns the final metrics."""
    from dynamicrubric.rewards import PolicyReward

    if store.is_complete(out_uri):
        return _already_done(out_uri, metrics_uri)
    dataset = policy_dataset(prompts_uri)
    reward = PolicyReward(
        cfg,
        steps_uri=steps_uri,
        round_idx=round_idx,
        generator=generator,
        verifier=verifier,
        policy=policy,
    )
    return _grpo(
        "train-policy",
        cfg,
        cfg.train_policy,
        model_ref=policy,
        dataset=dataset,
        reward_funcs=[reward],
        release_models=reward.release_models,
        reward_weights=None,
        num_generations=cfg.rollout.k,
        sampling=(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens),
        out_uri=out_uri,
        metrics_uri=metrics_uri,
        round_idx=round_idx,
        variant=policy_variant(cfg),
        enable_thinking=cfg.models.enable_thinking.policy,
    )


def train_evaluator(
    cfg: Config,
    *,
    candidates: list[str],
    anchors: list[str],
    generator: str,
    out_uri: str,
    steps_uri: str,
    metrics_uri: str | None = None,
    verifier: str = "",
    round_idx: int = 0,
) -> dict:
    """Online GRPO on the generator over P_{t−1}'s candidate sets; writes a checkpoint to `out_uri`."""
    from dynamicrubric.rewards import GeneratorRewards

    if store.is_complete(out_uri):
        return _already_done(out_uri, metrics_uri)
    dataset = evaluator_dataset(
        cfg, read_frames(candidates, "rollouts"), read_frames(anchors, "anchors"), round_idx
    )
    rewards = GeneratorRewards(
        cfg, steps_uri=steps_uri, round_idx=round_idx, generator=generator, verifier=verifier
    )
    tcfg = cfg.train_evaluator
    return _grpo(
        "train-evaluator",
        cfg,
        tcfg,
        model_ref=generator,
        dataset=dataset,
        reward_funcs=rewards.functions,
        release_models=rewards.release_models,
        reward_weights=[1.0, tcfg.anchor_weight],
        num_generations=cfg.rubrics.train_samples,
        sampling=(cfg.rubrics.temperature, cfg.rubrics.top_p, cfg.rubrics.max_new_tokens),
        out_uri=out_uri,
        metrics_uri=metrics_uri,
        round_idx=round_idx,
        variant="dynamic",
        constrain_items=cfg.rubrics.num_items if cfg.rubrics.constrained else None,
        enable_thinking=cfg.models.enable_thinking.generator,
    )


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
# Models


def _lora_config(tcfg: TrainConfig):
    from peft import LoraConfig

    return LoraConfig(
        r=tcfg.lora_rank,
        lora_alpha=tcfg.lora_alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def _saved_dtype(path: Path) -> torch.dtype:
    """The dtype the starting checkpoint was stored in; the trained one is saved the same way."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


class _Generate:
    """`model.generate` as TRL's transformers path calls it, timed for the per-step split, and with a
    fresh rubric-schema logits processor on every call when `max_items` is set (the processor keeps
    per-sequence grammar state, so it cannot be shared between calls)."""

    def __init__(self, generate: Any, tokenizer: Any, max_items: int | None, vocab_size: int) -> None:
        self.generate, self.tokenizer, self.max_items = generate, tokenizer, max_items
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        if self.max_items:
            from transformers import LogitsProcessorList

            from dynamicrubric.constrained import hf_logits_processor

            processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            processors.append(hf_logits_processor(self.tokenizer, self.max_items, vocab_size=self.vocab_size))
            kwargs["logits_processor"] = processors
        try:
            return self.generate(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def _step_split_callback(timer: _Generate):
    from transformers import TrainerCallback

    class StepSplit(TrainerCallback):
        """Adds time/generation_s and time/update_s (step − generation − reward) to each step's log."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            entry = state.log_history[-1] if state.log_history else {}
            if "step_time" in entry:
                entry["time/generation_s"] = timer.seconds
                entry["time/update_s"] = entry["step_time"] - timer.seconds - entry.get("time/reward_s", 0.0)
                timer.seconds = 0.0

    return StepSplit()


def process_device() -> torch.device:
    """The device this process was given: its GPU (cuda:LOCAL_RANK) with CUDA, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_device(stage: str, model: torch.nn.Module, expected: torch.device) -> None:
    """Refuse, in one line, a model whose parameters are not on `expected` (e.g. a GPU run that a
    stray ACCELERATE_USE_CPU put on the CPU: it would train, only a hundred times slower)."""
    found = sorted({str(p.device) for p in model.parameters()} - {str(expected)})
    if found:
        raise RuntimeError(
            f"{stage}: the model's parameters are on {', '.join(found)}, not on {expected}, the device this "
            "process was given: check the launch (accelerate's --cpu / ACCELERATE_USE_CPU on a GPU machine)"
        )


def _device_check_callback(stage: str):
    from transformers import TrainerCallback

    class DeviceCheck(TrainerCallback):
        """Checks the model's device once the trainer has placed it: at train begin, because under FSDP
        the model is only moved and sharded by accelerator.prepare inside train(), not when built."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            check_device(stage, model, process_device())

    return DeviceCheck()


# --------------------------------------------------------------------------------------------------
# Trainer checkpoints in the store


def _work_uri(out_uri: str) -> str:
    """Where the resumable trainer checkpoints go: `<out>.work`, in the object store itself when
    `out_uri` is a pod's path to it (/s3/b/k is s3://b/k). The pod path is pod-local and uploaded only
    when the task succeeds, so a retried pod would never see checkpoints written there."""
    from dynamicrubric.tracking import POD_PREFIXES, artifact_uri

    base = out_uri.rstrip("/")
    if base.startswith(tuple(POD_PREFIXES)) and store.is_s3(artifact_uri(base)):
        base = artifact_uri(base)
    return base + ".work"


def _scratch(out_uri: str) -> Path:
    """Local folder for TRL's output_dir: beside a local output, in the cache when the trainer
    checkpoints go to the object store (the cache is node-local scratch; a retried pod gets a new one)."""
    work_uri = _work_uri(out_uri)
    if store.is_s3(work_uri):
        from dynamicrubric.models import cache_dir

        return cache_dir() / "train-work" / hashlib.sha256(work_uri.encode()).hexdigest()[:16]
    return store.local_path(work_uri) / "scratch"


def checkpoint_origin(model_ref: str, tcfg: TrainConfig) -> dict[str, str]:
    """What a stored trainer checkpoint records about the run that wrote it, compared on resume: the
    starting model, and a digest of the train config without `steps` (raising steps continues a run;
    the zero-steps check covers lowering it)."""
    from dynamicrubric.models import model_reference

    config = tcfg.model_dump(mode="json")
    config.pop("steps")
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    return {"model_ref": model_reference(model_ref), "config_digest": digest}


def _stored_checkpoints(work_uri: str) -> list[str]:
    names = {
        rel.split("/")[0]
        for rel in (
            f.removeprefix(work_uri.rstrip("/") + "/")
            for f in store.list_files(work_uri)
            if not f.endswith("/scratch") and "/scratch/" not in f
        )
        if rel.startswith("checkpoint-")
    }
    return sorted(n for n in names if store.is_complete(store.join(work_uri, n)))


def _resume_point(stage: str, work_uri: str, origin: dict, steps: int) -> str | None:
    """The newest complete stored checkpoint, once checked that it belongs to this run (same model and
    train config) and leaves steps to train; None when there is none."""
    done = _stored_checkpoints(work_uri)
    if not done:
        return None
    name = done[-1]
    uri = store.join(work_uri, name)
    try:
        recorded = json.loads(store.read_bytes(store.folder_file(uri, RESUME_INFO)))
    except store.StoreError:
        raise ValueError(
            f"{stage}: the trainer checkpoint {uri} does not record the model and config it was trained "
            f"with, so it cannot be resumed safely: delete {work_uri} to start over"
        ) from None
    if recorded != origin:
        raise ValueError(
            f"{stage}: the trainer checkpoint {uri} was written for model {recorded.get('model_ref')!r} with "
            f"train config {recorded.get('config_digest')}, not for this run's model {origin['model_ref']!r} "
            f"with train config {origin['config_digest']}: delete {work_uri} to start over"
        )
    step = int(name.removeprefix("checkpoint-"))
    if step >= steps:
        raise ValueError(
            f"{stage}: the trainer checkpoint {uri} is at step {step} and the config asks for steps={steps}: "
            f"resuming would train no more steps; raise steps, or delete {work_uri} to start over"
        )
    return uri


def _fetch_checkpoint(uri: str, scratch: Path) -> str:
    """A stored trainer checkpoint in the scratch folder (a local one is read where it is)."""
    local = scratch / uri.rstrip("/").rsplit("/", 1)[-1]
    marker = local / store.COMPLETE_MARKER
    stored = store.read_manifest(uri)
    # Every process of a node resumes from one copy: the first downloads it, the others find it here.
    if not (marker.is_file() and stored and json.loads(marker.read_text()).get("token") == stored["token"]):
        shutil.rmtree(local, ignore_errors=True)
        log.info("resuming from %s", uri)
        local = store.download_dir(uri, local)
    return str(local)


def _checkpoint_callback(work_uri: str, origin: dict):
    from transformers import TrainerCallback

    class UploadCheckpoints(TrainerCallback):
        """Copy each trainer checkpoint to the store (complete or absent), with the run's origin
        beside it for the resume check, then drop older ones."""

        def on_save(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            local = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            (local / RESUME_INFO).write_text(json.dumps(origin, indent=1))
            name = f"checkpoint-{state.global_step:05d}"
            store.upload_dir(local, store.join(work_uri, name))
            for old in _stored_checkpoints(work_uri):
                if old != name:
                    store.delete_dir(store.join(work_uri, old))
            shutil.rmtree(local, ignore_errors=True)
            if os.environ.get(STALL_ENV) == str(state.global_step):
                print(f"stalled after step {state.global_step}", flush=True)
                while True:
                    time.sleep(3600)

    return UploadCheckpoints()


# --------------------------------------------------------------------------------------------------
# The one GRPO set-up both stages share


def _check_batch(stage: str, tcfg: TrainConfig, num_generations: int, pool: int) -> int:
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


def _grpo(
    stage: str,
    cfg: Config,
    tcfg: TrainConfig,
    *,
    model_ref: str,
    dataset: dict[str, list],
    reward_funcs: list,
    release_models: Callable[[], None],
    reward_weights: list[float] | None,
    num_generations: int,
    sampling: tuple[float, float, int],
    out_uri: str,
    metrics_uri: str | None,
    round_idx: int,
    variant: str,
    constrain_items: int | None = None,
    enable_thinking: bool | None = None,
) -> dict:
    from accelerate import PartialState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    state = PartialState(cpu=not cuda)  # without CUDA: gloo processes (TRL's use_cpu joins this state)
    if not cuda:
        bound_lm_head_tiles()
    if state.num_processes != tcfg.world_size:
        raise ValueError(
            f"{stage}: world_size is {tcfg.world_size} in the config but {state.num_processes} process(es) "
            "are running; start it with `dynrubric`'s launcher (accelerate launch --num_processes N)"
        )
    if tcfg.torch_threads:
        torch.set_num_threads(tcfg.torch_threads)
    accumulation = _check_batch(stage, tcfg, num_generations, len(dataset["prompt"]))
    bf16 = cuda if tcfg.bf16 is None else tcfg.bf16
    vllm = cfg.engine.engine == "vllm"
    temperature, top_p, max_new_tokens = sampling
    path = resolve_model(model_ref)
    scratch = _scratch(out_uri)
    scratch.mkdir(parents=True, exist_ok=True)
    work_uri = _work_uri(out_uri)
    origin = checkpoint_origin(model_ref, tcfg)
    resume = _resume_point(stage, work_uri, origin, tcfg.steps)  # every rank refuses a wrong one
    if resume:
        with state.local_main_process_first():  # one download per node: the others reuse it
            resume = _fetch_checkpoint(resume, scratch)
    generation_kwargs = None
    if vllm and constrain_items:
        from dynamicrubric.constrained import rubric_grammar

        generation_kwargs = {"structured_outputs": {"grammar": rubric_grammar(constrain_items)}}
    args = GRPOConfig(
        output_dir=str(scratch),
        max_steps=tcfg.steps,
        per_device_train_batch_size=tcfg.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        num_generations=num_generations,
        max_completion_length=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        learning_rate=tcfg.learning_rate,
        lr_scheduler_type="constant",  # online RL: every step's samples are new, no schedule to anneal
        beta=tcfg.beta,
        epsilon=tcfg.clip_eps,
        loss_type=tcfg.loss_type,
        scale_rewards=tcfg.scale_rewards,
        multi_objective_aggregation="normalize_then_sum" if reward_weights else "sum_then_normalize",
        reward_weights=reward_weights,
        max_grad_norm=tcfg.max_grad_norm,
        seed=tcfg.seed,
        bf16=bf16,
        gradient_checkpointing=tcfg.gradient_checkpointing,
        use_cpu=not cuda,
        report_to=[],
        logging_steps=1,
        save_strategy="steps",
        save_steps=tcfg.save_steps,
        remove_unused_columns=False,
        log_completions=False,
        use_vllm=vllm,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=vllm,
        vllm_gpu_memory_utilization=tcfg.vllm_gpu_memory_utilization,  # it shares the GPU with training
        vllm_max_model_length=cfg.engine.max_model_len,
        generation_kwargs=generation_kwargs,
        # the same template the standalone stages render (rollout.policy_prompt, the rubrics stage)
        chat_template_kwargs=None if enable_thinking is None else {"enable_thinking": enable_thinking},
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32)
    timer = _Generate(model.generate, tokenizer, None if vllm else constrain_items, model.config.vocab_size)
    model.generate = timer
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_dict(dataset),
        processing_class=tokenizer,
        peft_config=_lora_config(tcfg) if tcfg.lora_rank else None,
        callbacks=[
            _device_check_callback(stage),
            _checkpoint_callback(work_uri, origin),
            _step_split_callback(timer),
        ],
    )
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    rows = metric_rows(trainer.state.log_history, stage, round_idx, variant)
    final = _final_values(rows)
    final["train_wall_s"] = time.perf_counter() - started
    weights = _gather_weights(trainer)  # on every rank: a collective under FSDP
    # Training is over: the optimizer's state, the gradients, the reference copy and the reward models
    # go before _write_checkpoint loads a fresh copy beside the weights (that moment set the default
    # run's peak RSS). The weights themselves stay alive in `weights`.
    del trainer, model, timer
    release_models()
    gc.collect()
    if state.is_main_process:
        if metrics_uri:
            write_artifact(metrics_uri, "metrics", rows)
        _write_checkpoint(weights, path, tcfg, tokenizer, out_uri, stage, round_idx, model_ref, final, rows)
        store.delete_dir(work_uri)  # the trainer checkpoints (and, locally, the scratch folder inside)
        shutil.rmtree(scratch, ignore_errors=True)
    state.wait_for_everyone()
    return final


# Token rows per tile of TRL's fused LM head on a CPU (see bound_lm_head_tiles).
CPU_LM_HEAD_TILE_TOKENS = 256


def bound_lm_head_tiles() -> None:
    """Smaller tiles for TRL's fused LM head (log-probs without the full logits) on a CPU.

    Without Triton it scores every position in tiles of up to 4,096 tokens × 32,768 vocabulary
    columns and folds each tile in torch with several temporaries of the tile's size. Forward and
    backward over 3,500 tokens (the generator's micro-batch of 4 completions) raised peak RSS by
    4.2 GB with TRL's tiles, 0.77 GB with 512-token tiles and 0.51 GB with 256 (SmolLM2's head, measured
    here). Every token's row is computed by the same operations whatever the tile, so losses and
    gradients are unchanged (tests/test_train.py checks it bit for bit). TRL reads the module
    constant at each call.
    """
    from trl.kernels import chunked_logprob

    chunked_logprob.TOKEN_CHUNK_SIZE = min(chunked_logprob.TOKEN_CHUNK_SIZE, CPU_LM_HEAD_TILE_TOKENS)


def metric_rows(history: list[dict], stage: str, round_idx: int, variant: str) -> list[dict]:
    """TRL's per-step log as `metrics` rows: its own numbers under stable names, and every number the
    reward functions logged (signal/*, rubrics/*, judge/*, time/*) under their own names."""
    rows = []
    for entry in history:
        if "step" not in entry or "loss" not in entry:
            continue  # the end-of-training summary
        for key, value in entry.items():
            name = TRL_METRICS.get(key)
            if name is None and key.split("/")[0] in ("signal", "rubrics", "judge", "time", "rewards"):
                name = key
            if name is None or not isinstance(value, int | float) or value != value:
                continue
            rows.append(
                {
                    "round": round_idx,
                    "stage": stage,
                    "variant": variant,
                    "name": name,
                    "step": int(entry["step"]),
                    "value": float(value),
                }
            )
    return rows


def _final_values(rows: list[dict]) -> dict:
    if not rows:
        return {}
    last = max(r["step"] for r in rows)
    return {r["name"]: r["value"] for r in rows if r["step"] == last}


def _gather_weights(trainer) -> dict[str, torch.Tensor]:
    """The trained model's full state dict; every rank must call this. Under FSDP2 it is a collective
    (each rank sends its shards, rank 0 receives the whole model, the others get nothing), so a call on
    rank 0 alone waits forever for ranks that already wait at the end-of-training barrier.

    accelerate runs FSDP only on accelerators (its FSDP type is set for MULTI_GPU/XPU/NPU/..., never
    MULTI_CPU), so the CPU tests cannot shard; they check instead that this runs on every rank, by the
    line it logs."""
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    log.info(
        "rank %d: gathered the trained weights (%d tensors here)",
        trainer.accelerator.process_index,
        len(state_dict),
    )
    return state_dict


def _write_checkpoint(
    weights, path, tcfg, tokenizer, out_uri, stage, round_idx, model_ref, final, rows
) -> None:
    """A plain HF folder: the trained model (LoRA merged in) in the starting dtype, and a summary.

    Rank 0 alone, so nothing here may be a collective: the gathered weights are loaded into a fresh
    copy of the starting model on the CPU (never the sharded module, whose merge or dtype change would
    need the other ranks), and LoRA is merged there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=_saved_dtype(path))
    if tcfg.lora_rank:
        from peft import get_peft_model

        model = get_peft_model(model, _lora_config(tcfg))
    model.load_state_dict(weights)  # strict: a key the trainer's model had and this one lacks is an error
    if tcfg.lora_rank:
        model = model.merge_and_unload()
    with tempfile.TemporaryDirectory(dir=_scratch(out_uri).parent) as tmp:
        folder = Path(tmp) / "export"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        summary = {
            "stage": stage,
            "round": round_idx,
            "model_ref": model_ref,
            "config": tcfg.model_dump(mode="json"),
            "final": final,
            "metrics_rows": rows,
        }
        (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
        store.upload_dir(folder, out_uri)  # _COMPLETE last
    log.info("%s: wrote checkpoint %s", stage, out_uri)


# --------------------------------------------------------------------------------------------------
# Launching: one process per GPU (or one on CPU) under accelerate


def accelerate_config(world_size: int) -> Path | None:
    """The FSDP config shipped in the package, for several GPU processes; None otherwise."""
    if world_size > 1 and torch.cuda.is_available():
        return Path(str(resources.files("dynamicrubric").joinpath("accelerate", "fsdp.yaml")))
    return None


# glibc's malloc serves a request of this many bytes or more with its own mapping, returned to the
# system when freed. By default that threshold rises with every large block freed (up to 32 MiB), so a
# CPU backward pass's many 4-8 MB activations (3,440 tokens x 576 floats is 7.9 MB) end up in the heap,
# which keeps the pages: the local preset's round-1 train-evaluator held 4.36 GB at its peak, of which
# about 2.5 GB was in use. A fixed 4 MiB: peak 2.54 GB, 12% more time for that stage (fresh pages are
# zeroed); 8 MiB: 3.94 GB, +6%; 1 MiB: 2.37 GB, +45% (measured on the 2-core VM, same numbers out).
CPU_MMAP_THRESHOLD = 4 << 20


def training_env(tcfg: TrainConfig, environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """The training processes' environment: `environ` with the config's torch thread count and, on a
    CPU, glibc's mmap threshold (CPU_MMAP_THRESHOLD) unless `environ` sets one."""
    env = dict(environ)
    if tcfg.torch_threads:
        env["OMP_NUM_THREADS"] = str(tcfg.torch_threads)
    if not torch.cuda.is_available():
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(CPU_MMAP_THRESHOLD))
    return env


def launch_command(world_size: int, args: list[str]) -> list[str]:
    """`accelerate launch` of this module with `world_size` processes: one per GPU with CUDA (FSDP for
    several), else CPU processes (--cpu for one, gloo for several)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(world_size)]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    fsdp = accelerate_config(world_size)
    if fsdp is not None:
        cmd += ["--config_file", str(fsdp)]
    elif world_size > 1:
        # torchrun-style processes; without CUDA each one runs on the CPU (TRL's use_cpu) with gloo.
        # (accelerate's --cpu with several processes means an MPI launch, which is not installed.)
        cmd += ["--multi_gpu"]
    elif not torch.cuda.is_available():
        # Only without CUDA: --cpu exports ACCELERATE_USE_CPU, which would put a one-GPU run on the CPU.
        cmd += ["--cpu"]
    return cmd + ["-m", "dynamicrubric.train", *args]


def launch(stage: str, cfg: Config, **kwargs: Any) -> dict:
    """Run a training stage in `world_size` fresh processes and return its final metrics.

    With `reward_gpus` the task first starts a vLLM server for each reward model it serves
    (`serving.reward_servers`) on the GPUs after the trainer's, trains with their URLs in the config,
    and stops them whatever happens. The config travels as a YAML file; list arguments (candidate
    shards) as repeated flags."""
    key = stage.replace("-", "_")
    tcfg = getattr(cfg, key)
    if store.is_complete(kwargs["out_uri"]):
        return _already_done(kwargs["out_uri"], kwargs.get("metrics_uri"))
    # Bad inputs are refused here, in one line, before `accelerate launch` starts processes that would
    # load the models first and fail with two tracebacks (the process's and accelerate's).
    dataset, model_ref, room, enable_thinking = stage_inputs(stage, cfg, kwargs)
    num_generations = cfg.rollout.k if stage == "train-policy" else cfg.rubrics.train_samples
    _check_batch(stage, tcfg, num_generations, len(dataset["prompt"]))
    check_context(stage, cfg, model_ref, dataset, room, enable_thinking)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        env = training_env(tcfg, os.environ)
        roles = served_roles(cfg, key) if tcfg.reward_gpus else ()
        if roles:
            from dynamicrubric.serving import reward_gpu_split, reward_servers

            train_gpus, role_gpus = reward_gpu_split(key, cfg, visible_gpus())
            folders = {r: str(resolve_model(kwargs.get(r) or getattr(cfg.models, r))) for r in roles}
            urls = servers.enter_context(reward_servers(cfg, key, folders, role_gpus, Path(tmp) / "servers"))
            models = cfg.models.model_copy(update={f"{r}_url": url for r, url in urls.items()})
            cfg = cfg.model_copy(update={"models": models})
            env["CUDA_VISIBLE_DEVICES"] = ",".join(train_gpus)
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(cfg.to_yaml())
        result_file = Path(tmp) / "result.json"
        args = [stage, "--config", str(config_file), "--result", str(result_file)]
        for name, value in kwargs.items():
            flag = "--" + name.replace("_", "-")
            for v in value if isinstance(value, list) else [value]:
                if v is not None and v != "":
                    args += [flag, str(v)]
        proc = subprocess.run(launch_command(tcfg.world_size, args), env=env, check=False)
        if proc.returncode != 0:
            error_file = result_file.with_suffix(".error")
            if error_file.exists():  # what the process raised, said again here (its traceback is above)
                error = json.loads(error_file.read_text())
                if error["user"]:
                    raise TrainingError(error["message"])
                raise RuntimeError(f"{stage}: {error['type']}: {error['message']}")
            raise RuntimeError(f"{stage}: the training process exited with code {proc.returncode}")
        return json.loads(result_file.read_text())


def visible_gpus() -> list[str]:
    """The GPUs this task may use, as CUDA_VISIBLE_DEVICES names them (all of the node's if unset)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def main(argv: list[str] | None = None) -> int:
    """What `accelerate launch -m dynamicrubric.train` runs in every process."""
    from dynamicrubric.config import config_from_yaml

    parser = argparse.ArgumentParser(
        prog="python -m dynamicrubric.train", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--config", required=True, help="the run's YAML config")
    parser.add_argument("--result", default=None, help="write the final metrics here as JSON")
    parser.add_argument("--out-uri", required=True, help="checkpoint folder URI")
    parser.add_argument("--steps-uri", required=True, help="folder for the per-step artifacts")
    parser.add_argument("--metrics-uri", default=None)
    parser.add_argument("--round-idx", type=int, default=0)
    parser.add_argument("--prompts-uri", help="train-policy: the prompt pool")
    parser.add_argument("--policy", help="train-policy: the starting policy")
    parser.add_argument("--generator", default="", help="the generator (G_t for the policy's reward)")
    parser.add_argument("--verifier", default="")
    parser.add_argument("--candidates", action="append", default=[], help="train-evaluator: candidate sets")
    parser.add_argument("--anchors", action="append", default=[], help="train-evaluator: anchor lists")
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = config_from_yaml(Path(a.config).read_text())
    common = {
        "out_uri": a.out_uri,
        "steps_uri": a.steps_uri,
        "metrics_uri": a.metrics_uri,
        "verifier": a.verifier,
        "round_idx": a.round_idx,
    }
    try:
        if a.stage == "train-policy":
            final = train_policy(
                cfg, prompts_uri=a.prompts_uri, policy=a.policy, generator=a.generator, **common
            )
        else:
            final = train_evaluator(
                cfg, candidates=a.candidates, anchors=a.anchors, generator=a.generator, **common
            )
    except Exception as e:
        if a.result:  # for the launcher, which reports it as its own error
            from dynamicrubric.artifacts import ArtifactError
            from dynamicrubric.config import ConfigError
            from dynamicrubric.engines import EngineError
            from dynamicrubric.models import ModelError

            user = isinstance(
                e, ArtifactError | ConfigError | store.StoreError | EngineError | ModelError | ValueError
            )
            error = {"user": user, "type": type(e).__name__, "message": str(e)}
            Path(a.result).with_suffix(".error").write_text(json.dumps(error))
        raise
    from accelerate import PartialState

    state = PartialState()
    if a.result and state.is_main_process:
        Path(a.result).write_text(json.dumps(final))
    # Every rank is past its last collective (_grpo ends on a barrier); a rank that exits with the
    # process group still alive can abort in gloo's threads ("terminate called without an active
    # exception", exit code -6) and fail a finished task.
    state.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything this process wrote is closed. Its interpreter's teardown (a full garbage collection over
    # torch, transformers and TRL, then triton's bindings printing leak warnings) would take seconds
    # more of every training task for nothing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
