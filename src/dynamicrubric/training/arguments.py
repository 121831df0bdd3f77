"""TRL's `GRPOConfig` for a training stage. The train sections use TRL's own names for what they share
with it (`max_steps`, `per_device_train_batch_size`, `epsilon`, `beta`, `loss_type`, `scale_rewards`, ...),
so a reader of TRL's docs reads this config without translating.

The generator's two rewards, R_disc and R_anchor, are mixed at the advantage level with weights
[1, λ]: TRL's `normalize_then_sum` normalises each reward within its group, (r − mean)/(std + 1e-4),
sums them with the weights (a set without an anchor ranking contributes 0 for R_anchor), and then
divides the sum by its standard deviation over the whole batch. The paper stops after the sum. The
extra division multiplies every advantage of the batch by one positive number: it changes no
advantage's sign or relative size within the batch, only the step's scale (which Adam largely
normalises away), so we accept TRL's mix rather than fork its advantage code.
"""

from __future__ import annotations

from typing import Any

import torch

from dynamicrubric.infra.config import Config
from dynamicrubric.training.data import Trainee


def grpo_arguments(cfg: Config, trainee: Trainee, output_dir: str, accumulation: int, bf16: bool) -> Any:
    """The stage's GRPOConfig: TRL's vLLM colocate mode where the engine is vLLM (it shares the GPU with
    training), the rubric grammar there when the generator's rubrics are constrained."""
    from trl import GRPOConfig

    cuda = torch.cuda.is_available()
    vllm = cfg.engine.engine == "vllm"
    tcfg, weights, thinking = trainee.tcfg, trainee.reward_weights, trainee.enable_thinking
    generation_kwargs = None
    if vllm and trainee.constrain_items:
        from dynamicrubric.engines.constrained import rubric_grammar

        generation_kwargs = {"structured_outputs": {"grammar": rubric_grammar(trainee.constrain_items)}}
    return GRPOConfig(
        output_dir=output_dir,
        max_steps=tcfg.max_steps,
        per_device_train_batch_size=tcfg.per_device_train_batch_size,
        gradient_accumulation_steps=accumulation,
        num_generations=trainee.num_generations,
        max_completion_length=trainee.max_new_tokens,
        temperature=trainee.temperature,
        top_p=trainee.top_p,
        learning_rate=tcfg.learning_rate,
        lr_scheduler_type="constant",  # online RL: every step's samples are new, no schedule to anneal
        beta=tcfg.beta,
        epsilon=tcfg.epsilon,
        loss_type=tcfg.loss_type,
        scale_rewards=trainee.scale_rewards or "group",  # the generator's: unread by normalize_then_sum
        multi_objective_aggregation="normalize_then_sum" if weights else "sum_then_normalize",
        reward_weights=weights,
        max_grad_norm=tcfg.max_grad_norm,
        seed=tcfg.seed,
        ddp_timeout=tcfg.process_group_timeout_s,  # grpo.py sets the group's own; this says the same
        # Read only for TRL's reference model (the policy is passed built): no "auto" device map, which
        # under FSDP spreads each rank's copy over every visible GPU, outside the memory plan. FSDP (or
        # accelerate's prepare on one device) places it.
        model_init_kwargs={"device_map": None},
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
        chat_template_kwargs=None if thinking is None else {"enable_thinking": thinking},
    )
