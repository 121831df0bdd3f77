"""One GRPO step of a random-initialised Qwen3-8B-shaped model on one GPU, with each phase's peak memory
against the GPU memory plan (config.check_gpu_memory_plan, docs/training.md).

    python -m bench.gpu_step [--out PATH]          # on one GPU (bench/gpu_smoke.sh runs it offline)
    python -m bench.gpu_step --device cpu --tiny   # the same code on a tiny shape, on the CPU, in seconds

No weights and no download: the model is built from a `Qwen3Config` directly on the device, the tokenizer
is a synthetic word-level one that decodes every id of the vocabulary. The settings are the paper preset's
for one training process (micro-batch, gradient checkpointing, beta, learning rate, K), with LoRA, one
prompt and a shorter completion (see `step_settings`). Writes one JSON (default bench/results/gpu_step.json)
and prints one last line, `gpu_step: OK ...` or `gpu_step: FAIL: ...` (exit 1): the step failed, or a phase
peaked above TOLERANCE x the plan's expectation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from bench import RESULTS, machine_info, one_line, write_verdict

GIB = 1024**3
TOLERANCE = 1.25  # a phase may exceed the plan's expectation by 25% (allocator rounding, transients)
LORA_RANK = 16
# What the GPU machine lacks and .gpu-wheels does not bring. torch, transformers, accelerate and TRL import
# some of them only where installed; the project's modules must not import them (gpu_smoke.sh --check).
LACKING = ("vllm", "boto3", "kfp", "mlflow", "xgrammar")
PHASES = ("build", "generation", "reference", "reward", "update", "end_of_step")

# Qwen/Qwen3-8B's config.json (the shape only: rope and norm settings do not change the memory).
QWEN3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def linear_shapes(shape: dict[str, int]) -> list[tuple[int, int]]:
    """(in, out) of the seven linear layers of one decoder layer: q, k, v, o, gate, up, down."""
    h, i, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def param_count(shape: dict[str, int]) -> int:
    """Qwen3's parameters by arithmetic: embedding and LM head, per layer the linears, two RMSNorms and
    the q/k norms (head_dim each), and the final norm."""
    h, v, hd = shape["hidden_size"], shape["vocab_size"], shape["head_dim"]
    per_layer = sum(a * b for a, b in linear_shapes(shape)) + 2 * h + 2 * hd
    heads = 1 if shape["tie_word_embeddings"] else 2
    return heads * v * h + shape["num_hidden_layers"] * per_layer + h


def lora_param_count(shape: dict[str, int], rank: int) -> int:
    """LoRA on every linear of the decoder layers ("all-linear" leaves out the LM head): r x (in + out)."""
    return shape["num_hidden_layers"] * sum(rank * (a + b) for a, b in linear_shapes(shape))


def build_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer with exactly `vocab_size` ids, so that every id a random model samples
    decodes: role words, the yes/no spellings (the project's engines refuse a tokenizer without them,
    bench/gpu_sampler.py wraps one), synthetic words w0, w1, ..., and the ChatML specials last."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["user", "assistant", "system", "yes", "Yes", "YES", "no", "No", "NO"]
    words += [f"w{i}" for i in range(vocab_size - len(words) - len(SPECIALS))]
    vocab = {token: i for i, token in enumerate([*words, *SPECIALS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML,
    )


def build_model(shape: dict[str, int], tokenizer: Any, device: torch.device) -> torch.nn.Module:
    """Random weights, created on `device` in the training dtype (bf16 on GPU): no CPU copy of 16 GB."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        **shape,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")


class Phases:
    """Wall time and peak GPU memory per phase. Each `start` closes the running phase (its peak since the
    last reset, and what is still allocated) and resets the peak counter, so phases cover the run with no
    gap and the largest peak is the step's."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.rows: dict[str, dict[str, float]] = {}
        self.current: str | None = None
        self.started = 0.0

    def start(self, name: str | None) -> None:
        if self.current is not None:
            row = self.rows.setdefault(self.current, {"wall_s": 0.0})
            row["wall_s"] += time.perf_counter() - self.started
            if self.cuda:
                torch.cuda.synchronize()
                row["peak_gib"] = max(row.get("peak_gib", 0.0), torch.cuda.max_memory_allocated() / GIB)
                row["allocated_at_end_gib"] = torch.cuda.memory_allocated() / GIB
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.current, self.started = name, time.perf_counter()


class PhasedGenerate:
    """`model.generate` as TRL's transformers path calls it (as train.py's `_Generate` wraps it): the call is
    the generation phase; what follows until the reward is TRL's no-grad reference forward."""

    def __init__(self, generate: Any, phases: Phases) -> None:
        self.generate, self.phases = generate, phases

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.phases.start("generation")
        try:
            return self.generate(*args, **kwargs)
        finally:
            self.phases.start("reference")


def phased_reward(phases: Phases) -> Any:
    """A deterministic reward: the share of even token ids in the completion. (Not the length: a random
    model almost never samples EOS, so every completion has the maximum length and a group of equal
    rewards would leave no advantage to train on.) Its call is the reward phase; the update follows."""

    def even_token_share(completion_ids: list[list[int]], **_: Any) -> list[float]:
        phases.start("reward")
        rewards = [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
        phases.start("update")
        return rewards

    return even_token_share


def step_settings(tiny: bool) -> dict[str, Any]:
    """The paper preset's train-policy settings for one training process, and what this step changes."""
    from dynamicrubric.infra.config_loading import load_config

    cfg = load_config(preset="paper")
    tcfg = cfg.train_policy
    prompts = 1  # one group of K completions: the smallest step; memory depends on the micro-batch
    completions = prompts * cfg.rollout.k
    return {
        "preset": "paper",
        "per_device_train_batch_size": tcfg.per_device_train_batch_size,
        "gradient_checkpointing": tcfg.gradient_checkpointing,
        "beta": tcfg.beta,
        "learning_rate": tcfg.learning_rate,
        "loss_type": tcfg.loss_type,
        "k": cfg.rollout.k,
        "prompts_per_step": prompts,
        "gradient_accumulation_steps": completions // tcfg.per_device_train_batch_size,
        "activation_memory_gib": tcfg.activation_memory_gib,
        "prompt_tokens": 8 if tiny else 512,  # the plan's longest policy prompt: 512 tokens
        "max_completion_length": 8 if tiny else 1024,
        "max_completion_length_paper": cfg.rollout.max_new_tokens,
        "why_shorter": (
            "the whole smoke run must finish in under 8 minutes and transformers' generate (no vLLM on the "
            "machine) samples one token at a time; the paper's 2,048-token completions fit inside the same "
            "activation allowance, which the plan sizes for 4 x 2,560 tokens"
        ),
        "lora_rank": LORA_RANK,
        "lora_alpha": tcfg.lora_alpha,
        "why_lora": (
            "a full finetune keeps fp32 weights, gradients and Adam's two moments, 16 B/param: 122 GiB for "
            "8.2e9 params, + the 16 GiB activation allowance = 138 GiB of the H200's 140.4 GiB, leaving 2 GiB "
            "for the CUDA context, the allocator and autocast's bf16 weight copies (up to 15 GiB): it does "
            "not fit on one GPU; the plan shards it over 6 GPUs with FSDP"
        ),
        "generation": "transformers generate (TRL's path without vLLM)",
        "_train_config": tcfg,
    }


def expectations(shape: dict[str, int], s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each phase's expected peak by the plan's arithmetic, for this shape and these settings."""
    params, lora = param_count(shape), lora_param_count(shape, s["lora_rank"])
    weights = params * 2 / GIB
    lora_weights = lora * 4 / GIB  # peft keeps the adapter in fp32 beside bf16 weights
    lora_states = lora * 16 / GIB  # fp32 weights, gradients and Adam's two moments
    act = s["activation_memory_gib"]
    kv_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2
    batch = s["prompts_per_step"] * s["k"]
    tokens = s["prompt_tokens"] + s["max_completion_length"]
    kv = batch * tokens * kv_token / GIB
    w = f"bf16 weights {params:,} x 2 B = {weights:.2f}"
    lw = f"LoRA fp32 weights {lora:,} x 4 B = {lora_weights:.3f}"
    ls = f"LoRA weights + grads + Adam {lora:,} x 16 B = {lora_states:.3f}"
    a = f"activation_memory_gib {act:g} (paper preset, train_policy)"
    k = f"KV cache {batch} x {tokens} tokens x {kv_token:,} B = {kv:.3f}"
    plan = {
        "build": (weights + lora_weights, f"{w} + {lw}"),
        "generation": (weights + lora_weights + kv, f"{w} + {lw} + {k}"),
        "reference": (weights + lora_weights + act, f"{w} + {lw} + {a}"),
        "reward": (weights + lora_states, f"{w} + {ls}"),
        "update": (weights + lora_states + act, f"{w} + {ls} + {a}"),
        "end_of_step": (weights + lora_states, f"{w} + {ls}"),
    }
    return {
        name: {"expected_gib": gib, "arithmetic": f"{text} = {gib:.2f} GiB"}
        for name, (gib, text) in plan.items()
    }


def versions() -> dict[str, str]:
    names = ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "tokenizers", "pydantic")
    return {name: metadata.version(name) for name in names}


def run_step(device: torch.device, tiny: bool, result: dict[str, Any]) -> None:
    """Build, train one GRPO step, and fill `result` as it goes (so a failure keeps what was measured)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dynamicrubric.training.checkpoints import lora_config as _lora_config
    from dynamicrubric.training.monitoring import check_device

    cuda = device.type == "cuda"
    phases = Phases(cuda)
    result["phases"] = phases.rows
    phases.start("build")
    shape = TINY if tiny else QWEN3_8B
    settings = step_settings(tiny)
    tcfg = settings.pop("_train_config").model_copy(update={"lora_rank": LORA_RANK})
    result.update(shape="tiny" if tiny else "qwen3-8b", model_config=shape, settings=settings)
    result["expected"] = expectations(shape, settings)

    tokenizer = build_tokenizer(shape["vocab_size"])
    model = build_model(shape, tokenizer, device)
    result["params"] = sum(p.numel() for p in model.parameters())
    result["params_by_arithmetic"] = param_count(shape)
    print(f"params: {result['params']:,} ({result['params'] / 1e9:.2f}B)", flush=True)
    model.generate = PhasedGenerate(model.generate, phases)

    class StepPhases(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            # The project's own check, once the trainer has placed the model (as train.py does).
            check_device("gpu_step", model, device)
            result["params_on"] = sorted({str(p.device) for p in model.parameters() if p.requires_grad})

        def on_step_end(self, args, state, control, **kwargs):
            phases.start("end_of_step")

    prompt = " ".join(f"w{i}" for i in range(settings["prompt_tokens"]))
    with tempfile.TemporaryDirectory() as scratch:
        args = GRPOConfig(
            output_dir=scratch,
            max_steps=1,
            per_device_train_batch_size=settings["per_device_train_batch_size"],
            gradient_accumulation_steps=settings["gradient_accumulation_steps"],
            num_generations=settings["k"],
            max_completion_length=settings["max_completion_length"],
            learning_rate=settings["learning_rate"],
            lr_scheduler_type="constant",
            beta=settings["beta"],
            loss_type=settings["loss_type"],
            gradient_checkpointing=settings["gradient_checkpointing"],
            bf16=cuda,
            use_cpu=not cuda,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            remove_unused_columns=False,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[phased_reward(phases)],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": prompt}]]}),
            processing_class=tokenizer,
            peft_config=_lora_config(tcfg),
            callbacks=[StepPhases()],
        )
        result["lora_params"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        result["lora_params_by_arithmetic"] = lora_param_count(shape, LORA_RANK)
        started = time.perf_counter()
        trainer.train()
        result["step_wall_s"] = time.perf_counter() - started
        phases.start(None)
    logged = next(e for e in trainer.state.log_history if "loss" in e)
    result["step_log"] = {k: v for k, v in logged.items() if isinstance(v, int | float)}


def verdict(result: dict[str, Any]) -> list[str]:
    """What is wrong with a finished run; empty when it passed."""
    problems = []
    if result["params"] != result["params_by_arithmetic"]:
        problems.append(f"{result['params']:,} params, not {result['params_by_arithmetic']:,} by arithmetic")
    if result["lora_params"] != result["lora_params_by_arithmetic"]:
        problems.append(f"{result['lora_params']:,} LoRA params, not {result['lora_params_by_arithmetic']:,}")
    missing = [p for p in PHASES if p not in result["phases"]]
    if missing:
        problems.append(f"phases never reached: {', '.join(missing)}")
    for name, row in result["phases"].items():
        expected = result["expected"][name]["expected_gib"]
        if "peak_gib" in row:
            row["ratio"] = row["peak_gib"] / expected
            if row["ratio"] > TOLERANCE:
                problems.append(
                    f"{name} peaked at {row['peak_gib']:.2f} GiB > {TOLERANCE:g} x expected {expected:.2f} GiB"
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_step.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-64, 512-token shape")
    a = parser.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: FAIL: torch sees no CUDA device (use --device cpu --tiny for a dry run)")
        return 1
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    result: dict[str, Any] = {"device": str(device), "tolerance": TOLERANCE, "machine": machine_info()}
    result["versions"] = versions()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {
            "name": props.name,
            "memory_mib": props.total_memory // 2**20,
            "memory_gib": props.total_memory / GIB,
        }
    try:
        run_step(device, a.tiny, result)
        problems = verdict(result)
    except Exception as e:  # the step's failure, said in one line; the JSON keeps what was measured
        problems = [one_line(e)]
    if not write_verdict("gpu_step", a.out, result, problems):
        return 1
    for name, row in result["phases"].items():
        expected = result["expected"][name]["expected_gib"]
        peak = f"peak {row['peak_gib']:.2f} GiB of " if "peak_gib" in row else ""
        print(f"{name:<12} {peak}expected {expected:.2f} GiB, {row['wall_s']:.1f}s")
    peak_name, peak = max(
        ((n, r.get("peak_gib", 0.0)) for n, r in result["phases"].items()), key=lambda x: x[1]
    )
    memory = (
        f"peak {peak:.1f} GiB ({peak_name}) of {result['gpu']['memory_gib']:.1f} GiB"
        if "gpu" in result
        else "no GPU memory (CPU)"
    )
    print(
        f"gpu_step: OK {result['shape']}: {result['params']:,} params ({result['params'] / 1e9:.2f}B), "
        f"LoRA {result['lora_params']:,}, {memory}, step {result['step_wall_s']:.1f}s, "
        f"params on {','.join(result['params_on'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
