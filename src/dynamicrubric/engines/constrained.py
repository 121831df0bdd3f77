"""Rubrics constrained to their JSON schema while they are decoded (xgrammar).

The generator's output is forced into `rubric_schema(M)`: an object {"items": [...]} with 1..M items,
each {"text": a string of 3..MAX_ITEM_CHARS characters, "weight": an integer 1..5}.
`prompts.parse_rubric` reads it as a JSON list (status "json"). Only a sample cut off by the token limit
can fail to parse; the rubric stage counts those and scores them as empty.

- transformers: `hf_logits_processor(tokenizer, M)` returns a fresh `RubricGrammarProcessor` for every
  generation call (it keeps one grammar matcher per batch row and cannot be reused). The grammar itself
  is compiled once per (tokenizer, vocabulary size, stop tokens, M) and cached: compiling took 6.8 s for
  SmolLM2's 49k vocabulary. Its stop tokens must be the ones the caller's `generate` stops on: a row
  that `generate` ends on a token the grammar takes for text (or pads with one it forbids) is off the
  grammar. The processor never raises on such a row, as xgrammar's own HF processor does (an
  AssertionError that ended a training process): it lets the row only end, and the rubric parser counts
  a constrained sample that stopped without a complete rubric as "rejected" (prompts.parse_rubric).
- vLLM: `rubric_grammar(M)`, the same schema as an xgrammar EBNF grammar without free whitespace, is
  passed to its structured outputs (also xgrammar). Not the schema itself: vLLM 0.31/0.32 ignore the
  per-request `disable_any_whitespace` and read only the engine-wide setting, which TRL's colocated
  engine does not expose; with free whitespace a weak model can spend its whole token budget on
  whitespace between JSON tokens (tests_vllm saw 2 of 8 rubrics finish in 400 tokens).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

MAX_ITEM_CHARS = 200  # one criterion is a sentence; the bound also bounds a rubric's token count
MIN_ITEM_CHARS = 3  # parse_rubric drops shorter texts as "too short to be a criterion"
# An item's text is a plain length-bounded JSON string. Not a `pattern`: with xgrammar 0.2.8 a regex
# string made the token mask inexact (at one point inside an item's text, 106 of SmolLM2's tokens,
# e.g. ' "*', were allowed by the mask and then refused by the matcher, and xgrammar's HF processor
# asserts on that, ending the whole batch). The length-bounded string's mask is exact (0 such tokens,
# tests/test_constrained.py); the control characters it lets through are read by parse_rubric
# (json.loads with strict=False), which also drops characters that cannot be stored (surrogates).

_lock = threading.Lock()
# (id(tokenizer), vocab_size, stop ids, max_items) -> (tokenizer, compiled grammar). The tokenizer is
# kept in the value so that its id cannot be reused by another object while the entry exists.
_compiled: dict[tuple, tuple[Any, Any]] = {}


def rubric_schema(max_items: int) -> dict:
    """The JSON schema of a rubric of 1..max_items items with text and an integer weight 1–5."""
    if not isinstance(max_items, int) or max_items < 1:
        raise ValueError(f"rubric_schema: max_items must be an integer >= 1, got {max_items!r}")
    item = {
        "type": "object",
        "properties": {
            "text": {"type": "string", "minLength": MIN_ITEM_CHARS, "maxLength": MAX_ITEM_CHARS},
            "weight": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["text", "weight"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "items": item, "minItems": 1, "maxItems": max_items}},
        "required": ["items"],
        "additionalProperties": False,
    }


@functools.cache
def rubric_grammar(max_items: int) -> str:
    """`rubric_schema(max_items)` as xgrammar EBNF, with fixed separators and no whitespace between
    JSON tokens: the grammar HFEngine compiles, in the form vLLM's structured outputs take per request."""
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(json.dumps(rubric_schema(max_items)), any_whitespace=False))


def compiled_grammar(
    tokenizer: Any,
    max_items: int,
    *,
    vocab_size: int | None = None,
    stop_token_ids: list[int] | None = None,
) -> Any:
    """The rubric grammar compiled for `tokenizer` (cached; compiled at most once per key).

    `vocab_size` is the model's logits width, which may exceed the tokenizer's (padded embeddings);
    `stop_token_ids` are the tokens that end generation (default: the tokenizer's eos). The grammar
    allows a stop token only once the JSON is complete."""
    import xgrammar as xgr

    schema = rubric_schema(max_items)
    size = int(vocab_size) if vocab_size is not None else len(tokenizer)
    stops = tuple(int(i) for i in stop_token_ids) if stop_token_ids else None
    key = (id(tokenizer), size, stops, max_items)
    with _lock:  # one compile per key even when several threads ask at once
        if key not in _compiled:
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=size, stop_token_ids=list(stops) if stops else None
            )
            grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
            _compiled[key] = (tokenizer, grammar)
        return _compiled[key][1]


class RubricGrammarProcessor:
    """The rubric grammar's token mask for ONE generation call, as xgrammar's HF processor applies it,
    except for a row whose last token the grammar rejects (a stop or pad token `generate` chose that the
    grammar did not expect): that row is `rejected`, logged, and from then on may only sample a stop token,
    so it ends at once instead of raising. Called as processor(input_ids, scores) at every step, where
    input_ids' last column is the token each row sampled at the previous step."""

    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        self.compiled, self.stops = compiled, list(stop_token_ids)
        self.matchers: list[Any] = []
        self.rejected: set[int] = set()
        self.bitmask = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch
        import xgrammar as xgr

        if not self.matchers:  # the first step: nothing sampled yet
            self.matchers = [xgr.GrammarMatcher(self.compiled) for _ in range(input_ids.shape[0])]
            self.bitmask = xgr.allocate_token_bitmask(
                len(self.matchers), self.compiled.tokenizer_info.vocab_size
            )
        else:
            for i, matcher in enumerate(self.matchers):
                if i in self.rejected or matcher.is_terminated():
                    continue
                token = int(input_ids[i, -1])
                if not matcher.accept_token(token):
                    self.rejected.add(i)
                    log.warning(
                        "rubric grammar: row %d sampled token %d, which the grammar rejects; it ends here",
                        i,
                        token,
                    )
        live = [i for i, m in enumerate(self.matchers) if i not in self.rejected and not m.is_terminated()]
        for i in live:
            self.matchers[i].fill_next_token_bitmask(self.bitmask, i)
        if live:
            masked = scores.to("cpu") if scores.device.type not in ("cpu", "cuda") else scores
            xgr.apply_token_bitmask_inplace(masked, self.bitmask.to(masked.device), indices=live)
            scores = masked.to(scores.device)
        for i in self.rejected:
            keep = scores[i, self.stops].clone()
            scores[i] = -torch.inf
            scores[i, self.stops] = keep
        return scores


def hf_logits_processor(
    tokenizer: Any, max_items: int, *, stop_token_ids: list[int] | None = None, **grammar_options: Any
) -> RubricGrammarProcessor:
    """A new rubric-grammar logits processor for ONE generation call (transformers' `generate` or
    HFEngine), over `compiled_grammar(tokenizer, max_items, stop_token_ids=..., **grammar_options)`.
    `stop_token_ids`: the tokens the call's `generate` stops on (default: the tokenizer's eos)."""
    stops = list(stop_token_ids) if stop_token_ids else [int(tokenizer.eos_token_id)]
    compiled = compiled_grammar(tokenizer, max_items, stop_token_ids=stops, **grammar_options)
    return RubricGrammarProcessor(compiled, stops)
