"""The two training stages: online GRPO with TRL's `GRPOTrainer`, DynamicRubric as the reward.

Each stage is ordinary on-policy GRPO: at every step the model samples fresh completions for
`prompts_per_step` prompts, the reward functions (policy_reward.py, generator_rewards.py) score them, and the
model is updated. The rounds only order the two trainers (G_t first, then P_t).

- train-policy: the policy answers prompts drawn from the configured pool, K = rollout.k completions
  each; the reward is the round's evaluator (G_t's rubrics judged by V, the static rubric, the
  pointwise judge, or the task's checker: `judge.variant: verifiable`). Advantages are normalised
  within each prompt's group (`scale_rewards: group`).
- train-evaluator: the generator writes G = rubrics.train_samples rubric samples for a candidate set
  (a prompt and P_{t−1}'s K responses; one dataset row per set), decoded under the rubric's JSON
  schema. Two rewards, R_disc and R_anchor, are mixed at the advantage level with weights [1, λ]
  (TRL's `normalize_then_sum`; arguments.py says how it differs from the paper's mix).

Reference and loss. β (default 0.01) is a k3 KL penalty to the model the stage started from, i.e. the
previous round's checkpoint (P_{t−1} for P_t, G_{t−1} for G_t): each round regularises towards its
own starting point, not the base model. With LoRA the reference is the same model with the adapter
disabled, so no second copy is kept. `loss_type: dapo` (TRL's default) averages the clipped
policy-gradient loss over all completion tokens of the step: no per-sequence length bias (GRPO's
1/|o|), and no dependence on max_completion_length (Dr. GRPO's constant).

The rest of training lives beside this module: its inputs (data.py), its checkpoints and resume
(checkpoints.py), what each step reports (monitoring.py), and how the processes start (launcher.py,
process.py).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch

from dynamicrubric import store
from dynamicrubric.infra.artifacts import write_artifact
from dynamicrubric.infra.config import Config
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.training import cpu_waits
from dynamicrubric.training.arguments import grpo_arguments
from dynamicrubric.training.checkpoints import (
    already_done,
    checkpoint_callback,
    checkpoint_origin,
    fetch_checkpoint,
    finished_work,
    gather_weights,
    lora_config,
    replicated_entries_with_rank0,
    resume_point,
    scratch_folder,
    work_prefix,
    write_checkpoint,
)
from dynamicrubric.training.data import TrainingJob, check_batch, job_dataset, trainee
from dynamicrubric.training.launcher import bound_lm_head_tiles
from dynamicrubric.training.monitoring import (
    TimedGenerate,
    device_check_callback,
    final_values,
    metric_rows,
    split_timings,
    step_split_callback,
)

log = logging.getLogger(__name__)


def train(cfg: Config, job: TrainingJob) -> dict:
    """Online GRPO on the job's model; writes a checkpoint folder to `job.out_uri` and returns the final
    metrics, with the steps' time measurements apart under "timings" (they go to MLflow, not to the
    artifacts, so that a rerun writes the same bytes)."""
    if store.is_complete(job.out_uri):
        return already_done(cfg, job)
    if job.stage == "train-policy":
        from dynamicrubric.training.policy_reward import PolicyReward

        reward = PolicyReward.for_job(cfg, job)
        reward_funcs = [reward]
    else:
        from dynamicrubric.training.generator_rewards import GeneratorRewards

        reward = GeneratorRewards.for_job(cfg, job)
        reward_funcs = reward.functions
    return _grpo(cfg, job, job_dataset(cfg, job), reward_funcs, reward.release_models)


@functools.cache
def _restore_indexed_cpu() -> None:
    """Let torch.load restore tensors to `cpu:0`. accelerate 1.15 names a gloo process's device cpu:0,
    transformers resumes the optimizer state with map_location=args.device when world_size > 1, and torch
    restores only to "cpu": every multi-process CPU resume failed ("don't know how to restore data
    location ... (tagged with cpu:0)"). Only without CUDA; a GPU process's device is cuda:N. Registered
    once a process (cached): torch keeps its registry sorted by priority, and a second entry of the same
    priority made the sort compare two functions (TypeError on the second `train` in a process)."""
    torch.serialization.register_package(30, lambda storage: None, _indexed_cpu)


def _indexed_cpu(obj, location: str):
    return obj if location.startswith("cpu:") else None


def _grpo(
    cfg: Config,
    job: TrainingJob,
    dataset: dict[str, list],
    reward_funcs: list,
    release_models: Callable[[], None],
) -> dict:
    from accelerate import PartialState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    stage, setting = job.stage, trainee(cfg, job.stage)
    tcfg = setting.tcfg
    cuda = torch.cuda.is_available()
    # Without CUDA: gloo processes (TRL's use_cpu joins this state). This creates the process group, so its
    # timeout is set here: TrainingArguments' ddp_timeout comes after the group exists and never applies.
    # It bounds every collective wait on the accelerators (a checkpoint's upload is waited for in cpu_waits).
    timeout = timedelta(seconds=tcfg.process_group_timeout_s)
    state = PartialState(cpu=not cuda, timeout=timeout)
    if state.num_processes > 1:
        log.info("rank %d: process group timeout %s", state.process_index, group_timeout(state.device))
    if not cuda:
        _restore_indexed_cpu()
        bound_lm_head_tiles()
    replicated_entries_with_rank0()  # every node's resume folder holds what its ranks read
    # Where ranks wait for another rank's store transfer or served scores: not in an accelerator collective.
    cpu_waits.init(timedelta(seconds=tcfg.wait_timeout_s))
    if state.num_processes != tcfg.world_size:
        raise ValueError(
            f"{stage}: world_size is {tcfg.world_size} in the config but {state.num_processes} process(es) "
            "are running; start it with `dynrubric`'s launcher (accelerate launch --num_processes N)"
        )
    if tcfg.torch_threads:
        torch.set_num_threads(tcfg.torch_threads)
    accumulation = check_batch(stage, tcfg, setting.num_generations, len(dataset["prompt"]))
    bf16 = cuda if tcfg.bf16 is None else tcfg.bf16
    vllm = cfg.engine.engine == "vllm"
    path = resolve_model(job.model_ref)
    scratch = scratch_folder(job.out_uri)
    scratch.mkdir(parents=True, exist_ok=True)
    work_uri = work_prefix(job.out_uri)
    origin = checkpoint_origin(job.model_ref, tcfg)
    resume = resume_point(stage, work_uri, origin, tcfg.max_steps)  # every rank refuses a wrong one
    if resume:  # one download per node: the others reuse it
        if state.is_local_main_process:
            resume = fetch_checkpoint(resume, scratch)
        cpu_waits.barrier()
        if not state.is_local_main_process:
            resume = fetch_checkpoint(resume, scratch)
    args = grpo_arguments(cfg, setting, str(scratch), accumulation, bf16)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32)
    constrain_items = None if vllm else setting.constrain_items  # vLLM: the grammar is in `args`
    timer = TimedGenerate(model.generate, tokenizer, constrain_items, model.config.vocab_size)
    model.generate = timer
    with reference_sharded_by_layer():
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=Dataset.from_dict(dataset),
            processing_class=tokenizer,
            peft_config=lora_config(tcfg) if tcfg.lora_rank else None,
            callbacks=[
                device_check_callback(stage),
                checkpoint_callback(work_uri, origin),
                step_split_callback(timer),
            ],
        )
    if vllm:  # time/generation_s covers vLLM's generation as it does transformers'
        trainer.vllm_generation.generate = timer.timed(trainer.vllm_generation.generate)
    reference_from_rank0(trainer, model)
    log_reference(trainer)
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    rows, timings = split_timings(
        metric_rows(trainer.state.log_history, stage, job.round_idx, setting.variant)
    )
    recorded = final_values(rows)  # what the checkpoint's summary keeps: no measurement
    # The measurements travel in the result alone, to the stage's MLflow run (training_stages.py).
    final = {**recorded, "train_wall_s": time.perf_counter() - started, "timings": timings}
    weights = gather_weights(trainer)  # on every rank: a collective under FSDP
    # Training is over: the optimizer state, gradients, reference copy and reward models go before
    # write_checkpoint loads a fresh copy beside `weights` (that moment set the default run's peak RSS).
    del trainer, model, timer
    release_models()
    gc.collect()
    if state.is_main_process:
        if job.metrics_uri:
            write_artifact(job.metrics_uri, "metrics", rows)
        write_checkpoint(weights, path, tcfg, tokenizer, job, recorded, rows, finished_work(cfg, job))
        store.delete_dir(work_uri)  # the trainer checkpoints (and, locally, the scratch folder inside)
        shutil.rmtree(scratch, ignore_errors=True)
    cpu_waits.barrier()  # rank 0 exported the model
    return final


@contextlib.contextmanager
def reference_sharded_by_layer() -> Iterator[None]:
    """While GRPOTrainer is built: its reference model is sharded layer by layer under FSDP2, as
    accelerate shards the policy, not as one unit.

    TRL 1.16 prepares the reference with a single `fully_shard` at its root (trl models/utils.py
    `prepare_fsdp`), so its forward all-gathers the whole model on every GPU at once: 15.3 GiB for
    Qwen3-8B in bf16 whatever the world size, on top of the training state and the colocated vLLM. Each
    decoder layer first gets its own `fully_shard` (accelerate's wrap policy and arguments, its
    fsdp2_prepare_model loop), so the forward gathers one layer at a time; TRL's root call then takes the
    rest (embeddings, final norm, LM head). The same shards per rank: fully_shard cuts every parameter on
    dim 0 whatever the unit."""
    from trl.trainer import grpo_trainer

    bare = grpo_trainer.prepare_fsdp

    def by_layer(model, accelerator):
        if accelerator.is_fsdp2:
            _shard_layers(model, accelerator)
        return bare(model, accelerator)

    grpo_trainer.prepare_fsdp = by_layer  # the module's own name: TRL calls it for the reference only
    try:
        yield
    finally:
        grpo_trainer.prepare_fsdp = bare


def _shard_layers(model, accelerator) -> None:
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)  # the decoder layer classes (fsdp.yaml: TRANSFORMER_BASED_WRAP)
    wrap = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if wrap is None:
        return
    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
    }
    for module in get_module_children_bottom_up(model)[:-1]:  # the root is TRL's
        if wrap(module) and not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)


def reference_from_rank0(trainer, model) -> None:
    """Give TRL's reference model rank 0's weights on every rank, under FSDP2 with RAM-efficient loading.

    With `fsdp_cpu_ram_efficient_loading` (accelerate/fsdp.yaml: one copy of the model in CPU memory per
    node, not one per process) transformers loads the weights on local rank 0 only and zeros elsewhere
    (buffers included); accelerate broadcasts rank 0's weights when it prepares the policy, but TRL shards
    the reference with a bare `fully_shard` (trl models/utils.py `prepare_fsdp`), so its shards on the other
    ranks stay zeros and the KL term would pull towards them. The policy is not prepared yet: rank 0's copy
    holds the starting weights, which the reference is. Each parameter is scattered from there into the
    reference's shards in place (tied weights stay tied, FSDP keeps its own storage), and its buffers
    come from rank 0's reference. Every rank must call this (a collective)."""
    accelerator, reference = trainer.accelerator, trainer.ref_model
    if reference is None or not accelerator.is_fsdp2:
        return
    if not accelerator.state.fsdp_plugin.cpu_ram_efficient_loading:
        return  # every rank loaded the real weights
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    start = dict(model.named_parameters()) if accelerator.is_main_process else {}
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if not isinstance(param, DTensor):  # not sharded (an ignored parameter): whole on every rank
                if start:
                    param.copy_(start[name])
                dist.broadcast(param, src=0)
                continue
            local = param.to_local()
            if start:
                full = start[name].detach().to(local.device, local.dtype)
            else:
                full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
            local.copy_(
                distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=0).to_local()
            )
        for buffer in reference.buffers():
            dist.broadcast(buffer, src=0)


def log_reference(trainer) -> None:
    """Lines per rank: the sum of |w| over the reference model's parameters this rank holds (its shards
    under FSDP2), so a log shows a rank whose reference is zeros (tests/test_fsdp_cpu.py reads it), and its
    device map (bench/gpu_launch.py checks there is none on CUDA)."""
    if trainer.ref_model is None:
        return
    from torch.distributed.tensor import DTensor

    total = 0.0
    with torch.no_grad():
        for p in trainer.ref_model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.double().abs().sum().item()
    log.info("rank %d: reference model sum|w| %.17g", trainer.accelerator.process_index, total)
    # A device map means transformers spread the copy over the devices it saw ("auto": every GPU of the
    # node), outside the memory plan; FSDP or accelerate must place it instead.
    device_map = getattr(trainer.ref_model, "hf_device_map", None)
    log.info("rank %d: reference model device map %s", trainer.accelerator.process_index, device_map)
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(m, FSDPModule) for m in trainer.ref_model.modules())
    log.info("rank %d: reference model in %d FSDP units", trainer.accelerator.process_index, units)


def group_timeout(device: torch.device) -> timedelta | None:
    """The default process group's timeout on `device`'s backend, as torch holds it (None if unknown)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    backend = dist.distributed_c10d._get_default_group()._get_backend(device)
    return getattr(getattr(backend, "options", None), "_timeout", None)
