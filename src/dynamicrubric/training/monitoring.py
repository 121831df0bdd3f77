"""What a training process reports and checks as it goes: TRL's per-step log as `metrics` rows, the
step's time split (generation, reward, update), and that the model sits on the device it was given."""

from __future__ import annotations

import os
import time
from typing import Any

import pandas as pd
import torch

from dynamicrubric.infra.artifact_kinds import empty_table, is_timing

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


def split_timings(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """The rows that a rerun reproduces, and the time measurements (time/*), which it cannot."""
    return [r for r in rows if not is_timing(r["name"])], [r for r in rows if is_timing(r["name"])]


def timing_frame(result: dict) -> pd.DataFrame:
    """A training result's time measurements as `metrics` rows (none when the checkpoint was already
    complete and nothing ran)."""
    return pd.DataFrame(result["timings"], columns=empty_table("metrics").schema.names)


def final_values(rows: list[dict]) -> dict:
    if not rows:
        return {}
    last = max(r["step"] for r in rows)
    return {r["name"]: r["value"] for r in rows if r["step"] == last}


class TimedGenerate:
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

            from dynamicrubric.engines.constrained import hf_logits_processor

            # The grammar's stop tokens are the ones this generate stops on (its generation config's eos):
            # a row generate ends on a token the grammar took for text would leave the grammar.
            config = kwargs.get("generation_config") or self.generate.__self__.generation_config
            eos = config.eos_token_id
            stops = [int(i) for i in (eos if isinstance(eos, list | tuple) else [eos]) if i is not None]
            processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            processors.append(
                hf_logits_processor(
                    self.tokenizer, self.max_items, vocab_size=self.vocab_size, stop_token_ids=stops
                )
            )
            kwargs["logits_processor"] = processors
        try:
            return self.generate(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started

    def timed(self, generate: Any) -> Any:
        """`generate` with its time added to this step's generation seconds: TRL's colocated vLLM
        generates through its own `vllm_generation.generate`, never through `model.generate`."""

        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return call


def step_split_callback(timer: TimedGenerate):
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


def device_check_callback(stage: str):
    from transformers import TrainerCallback

    class DeviceCheck(TrainerCallback):
        """Checks the model's device once the trainer has placed it: at train begin, because under FSDP
        the model is only moved and sharded by accelerator.prepare inside train(), not when built."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            check_device(stage, model, process_device())

    return DeviceCheck()
