"""`VLLMEngine`: a thin wrapper over `vllm.LLM` for the one-GPU inference stages (see engines/__init__.py)."""

from __future__ import annotations

import logging
import math
import sys
from typing import TYPE_CHECKING, Any

from dynamicrubric.engines.base import (
    PROGRESS_INTERVAL_S,
    Engine,
    EngineError,
    Generation,
    answer_token_ids,
    free_memory,
    logsumexp,
    pair_token_ids,
)
from dynamicrubric.infra.model_folder_checks import check_model_folder
from dynamicrubric.infra.models import resolve_model

if TYPE_CHECKING:
    from dynamicrubric.engines.base import Sampling

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# vLLM


class VLLMEngine(Engine):
    """vLLM backend (vllm is imported only here: the CPU image does not ship it).

    Prompts go in as token ids encoded with add_special_tokens=False, exactly as HFEngine encodes
    them: a text prompt would make vLLM add the tokenizer's BOS a second time on Llama-family models.
    Extra keyword arguments go to `vllm.LLM` (e.g. max_model_len, enforce_eager on CPU).
    """

    def __init__(
        self,
        model_ref: str,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.85,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        long_prompts: str = "error",
        **llm_kwargs: Any,
    ) -> None:
        try:
            import vllm
        except ImportError as e:
            raise EngineError(
                "engine 'vllm' needs the vllm package (GPU image, `pip install dynamicrubric[gpu]`); "
                "use engine: hf on machines without a GPU"
            ) from e
        self._vllm = vllm
        self.model_ref = model_ref
        path = resolve_model(model_ref)
        check_model_folder(model_ref, path)  # a cut-off copy: one line, not transformers' errors
        self.llm = vllm.LLM(
            model=str(path),
            dtype="bfloat16" if dtype == "auto" else dtype,
            enable_prefix_caching=True,  # shares the KV cache of a judged response across its items
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            **llm_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.yes_ids, self.no_ids = answer_token_ids(self.tokenizer)
        if long_prompts not in ("error", "truncate"):
            raise EngineError(f"long_prompts must be 'error' or 'truncate', got {long_prompts!r}")
        self.long_prompts, self.truncated_prompts = long_prompts, 0
        self.context_length = int(self.llm.llm_engine.model_config.max_model_len)

    def _token_prompts(self, prompts: list[str], room: int, what: str) -> list[dict]:
        """Each prompt's token ids, fitted to the context with `room` tokens left (engine.long_prompts)."""
        out = []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p, add_special_tokens=False)
            if not ids:
                raise EngineError(f"{what}: prompt {i} is empty")
            out.append({"prompt_token_ids": self.fit_prompt(ids, room, f"{what}: prompt {i}")})
        return out

    def _generate(self, prompts: list[str], sampling: Sampling, desc: str) -> list[Generation]:
        """Seeded per prompt from (seed, prompt index); with `rubric_items` through vLLM's structured
        outputs (xgrammar) with the same grammar HFEngine uses."""
        structured = None
        if sampling.rubric_items:
            from dynamicrubric.engines.constrained import rubric_grammar

            structured = self._vllm.sampling_params.StructuredOutputsParams(
                grammar=rubric_grammar(sampling.rubric_items)
            )
        params = [
            self._vllm.SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=sampling.seed_of(i, 0),
                structured_outputs=structured,
            )
            for i in range(len(prompts))
        ]
        encoded = self._token_prompts(prompts, sampling.max_new_tokens, "generate")
        outputs = self.llm.generate(encoded, params, use_tqdm=_vllm_progress(desc))
        return [
            Generation(
                texts=[c.text for c in o.outputs],
                num_tokens=[len(c.token_ids) for c in o.outputs],
                finish_reasons=["stop" if c.finish_reason == "stop" else "length" for c in o.outputs],
            )
            for o in outputs
        ]

    def yes_probability(
        self, pairs: list[tuple[str, str]], desc: str = "judge", *, bar: Any = None
    ) -> list[float]:
        """P(yes) / (P(yes) + P(no)) from the raw log-probs of exactly the label tokens of the next token.

        `logprob_token_ids` asks vLLM for those tokens' log-probs whatever their rank, so the value is
        exact. A vLLM without that parameter falls back to the top-20 log-probs; a verdict with
        neither label among them is NaN (counted by the judge stage), never 0.5."""
        token_ids = pair_token_ids(self.tokenizer, pairs)
        if not token_ids:
            return []
        labels = self.yes_ids + self.no_ids
        try:
            params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=labels)
        except TypeError:  # vLLM without logprob_token_ids
            params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
        prompts = [
            {"prompt_token_ids": self.fit_prompt(ids, 1, f"judge: pair {k}")}
            for k, ids in enumerate(token_ids)
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False if bar else _vllm_progress(desc))
        if bar is not None:
            bar.update(len(prompts))
        result = []
        for o in outputs:
            top = o.outputs[0].logprobs[0]  # {token_id: Logprob}
            yes = [top[t].logprob for t in self.yes_ids if t in top]
            no = [top[t].logprob for t in self.no_ids if t in top]
            if not yes and not no:
                result.append(math.nan)
                continue
            ly, ln = logsumexp(yes), logsumexp(no)
            result.append(1.0 / (1.0 + math.exp(ln - ly)) if ly > -math.inf else 0.0)
        return result

    def logprobs(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        """From vLLM's prompt log-probs of prompt+completion (prompt_logprobs=0: the actual token only)."""
        if len(prompts) != len(completions):
            raise EngineError(f"logprobs: {len(prompts)} prompts but {len(completions)} completions")
        if not prompts:
            return []
        enc = self.tokenizer
        token_prompts = []
        counts = []
        for p, c in zip(prompts, completions, strict=True):
            p_ids, c_ids = enc.encode(p, add_special_tokens=False), enc.encode(c, add_special_tokens=False)
            token_prompts.append({"prompt_token_ids": p_ids + c_ids})
            counts.append(len(c_ids))
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0)
        outputs = self.llm.generate(token_prompts, params, use_tqdm=False)
        result = []
        for o, c in zip(outputs, counts, strict=True):
            ids = o.prompt_token_ids
            lps = o.prompt_logprobs  # one dict per prompt position (None for the first)
            result.append([lps[k][ids[k]].logprob for k in range(len(ids) - c, len(ids))])
        return result

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()  # stops the engine-core process and frees its KV cache and weights
        del llm
        free_memory()


def _vllm_progress(desc: str) -> Any:
    """vLLM's `use_tqdm` callable: its bar, named like ours, on stderr, refreshed at most every 5 s."""
    from tqdm.auto import tqdm

    def bar(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(desc=desc, file=sys.stderr, mininterval=PROGRESS_INTERVAL_S)
        return tqdm(*args, **kwargs)

    return bar
