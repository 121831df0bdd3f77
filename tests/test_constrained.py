"""Rubrics decoded under their JSON schema (xgrammar) with HFEngine's own sampler, and the rubric stage."""

from __future__ import annotations

import json

import pytest

from dynamicrubric.engines import HFEngine, constrained
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.scoring.prompts import parse_rubric
from dynamicrubric.scoring.rubrics import TRUNCATED, run_rubrics

QUESTIONS = ["What is 2+3?", "Name a colour.", "Write a rubric for a poem."]


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return HFEngine("tiny-random", device="cpu", batch_size=8)


@pytest.fixture(scope="module")
def prompts(engine: HFEngine) -> list[str]:
    return [engine.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]


def _valid(text: str, max_items: int) -> bool:
    """Valid against rubric_schema(max_items), checked by hand (no jsonschema dependency)."""
    doc = json.loads(text, strict=False)  # the schema's strings may hold raw control characters
    items = doc["items"]
    # The schema bounds a text's characters as the grammar sees them; a random model's byte tokens may
    # decode to replacement characters, so only the lower bound is comparable after decoding.
    return (
        set(doc) == {"items"}
        and 1 <= len(items) <= max_items
        and all(set(it) == {"text", "weight"} for it in items)
        and all(isinstance(it["weight"], int) and 1 <= it["weight"] <= 5 for it in items)
        and all(len(it["text"]) >= constrained.MIN_ITEM_CHARS for it in items)
    )


def _mask_admits_only_what_the_matcher_accepts(tokenizer, vocab_size: int, prefix: str) -> tuple[int, list]:
    """Walk the grammar to `prefix`, then try every token the mask allows on the matcher."""
    import torch
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(constrained.compiled_grammar(tokenizer, 3, vocab_size=vocab_size))
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        assert matcher.accept_token(token), prefix
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab_size)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    allowed = torch.isfinite(logits[0]).nonzero()[:, 0].tolist()
    refused = []
    for token in allowed:
        if matcher.accept_token(token):
            matcher.rollback(1)
        else:
            refused.append(token)
    return len(allowed), refused


PREFIX = '{"items": [{"text": "Is the answer correct'


def test_the_mask_is_exact_inside_an_item_text(engine: HFEngine) -> None:
    """xgrammar's HF processor asserts when a sampled token that the mask allowed is refused by the
    matcher; with a regex `pattern` on the text that happened for 106 SmolLM2 tokens."""
    allowed, refused = _mask_admits_only_what_the_matcher_accepts(
        engine.tokenizer, len(engine.tokenizer), PREFIX
    )
    assert allowed > 100 and refused == []


@pytest.mark.slow
def test_the_mask_is_exact_for_smollm2() -> None:
    from transformers import AutoTokenizer

    from dynamicrubric.infra.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    allowed, refused = _mask_admits_only_what_the_matcher_accepts(tokenizer, 49152, PREFIX)
    assert allowed > 40_000 and [tokenizer.decode([t]) for t in refused] == []


def test_schema_shape_and_bad_input() -> None:
    schema = constrained.rubric_schema(4)
    assert schema["properties"]["items"]["maxItems"] == 4
    assert schema["properties"]["items"]["items"]["properties"]["weight"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 5,
    }
    with pytest.raises(ValueError, match="max_items"):
        constrained.rubric_schema(0)
    doc = '{"items": [{"text": "States 5", "weight": 5}, {"text": "Shows steps", "weight": 2}]}'
    parsed = parse_rubric(doc, 4)
    assert parsed.status == "json" and parsed.items == [
        {"text": "States 5", "weight": 5},
        {"text": "Shows steps", "weight": 2},
    ]


def test_grammar_is_compiled_once_per_key(engine: HFEngine) -> None:
    a = constrained.compiled_grammar(engine.tokenizer, 3, stop_token_ids=engine.stop_ids)
    b = constrained.compiled_grammar(engine.tokenizer, 3, stop_token_ids=engine.stop_ids)
    c = constrained.compiled_grammar(engine.tokenizer, 4, stop_token_ids=engine.stop_ids)
    assert a is b and a is not c
    p, q = (constrained.hf_logits_processor(engine.tokenizer, 3) for _ in range(2))
    assert p is not q  # a processor holds per-row matchers: one per generation call


def test_constrained_rubrics_all_parse_and_are_seeded(engine: HFEngine, prompts: list[str]) -> None:
    gens = engine.generate(prompts, n=4, max_new_tokens=300, seed=1, rubric_items=3)
    complete = [t for g in gens for t, r in zip(g.texts, g.finish_reasons, strict=True) if r == "stop"]
    assert len(complete) >= 8, "most samples of 300 tokens must finish"
    assert all(_valid(t, 3) and parse_rubric(t, 3).status == "json" for t in complete)
    # Same seed, same rubrics, whatever the batch size; another seed differs.
    assert gens == engine.generate(prompts, n=4, max_new_tokens=300, seed=1, rubric_items=3)
    small = HFEngine("x", model=engine.model, tokenizer=engine.tokenizer, batch_size=3)
    assert gens == small.generate(prompts, n=4, max_new_tokens=300, seed=1, rubric_items=3)
    assert gens != engine.generate(prompts, n=4, max_new_tokens=300, seed=2, rubric_items=3)
    # Without the grammar the random model writes no rubric at all: the constraint does the work.
    free = engine.generate(prompts, n=4, max_new_tokens=60, seed=1)
    assert all(parse_rubric(t, 3).status == "empty" for g in free for t in g.texts)


def test_greedy_constrained_decoding_follows_the_grammar(engine: HFEngine, prompts: list[str]) -> None:
    gen = engine.generate(prompts[:1], temperature=0.0, max_new_tokens=300, rubric_items=2)[0]
    assert gen.texts[0].startswith('{"items": [{"text": "')
    if gen.finish_reasons[0] == "stop":
        assert _valid(gen.texts[0], 2)


def _rollouts() -> list[dict]:
    return [
        {
            "prompt_id": f"p{i}",
            "sample_idx": j,
            "prompt": f"What is {i}+{j}?",
            "response": f"It is {i + j}.",
            "num_tokens": 3,
            "finish_reason": "stop",
            "policy": "hand",
            "seed": 0,
        }
        for i in range(2)
        for j in range(2)
    ]


def test_rubric_stage_counts_truncated_and_parses_the_rest(tmp_path, engine: HFEngine) -> None:
    write_artifact(str(tmp_path / "r.parquet"), "rollouts", _rollouts())
    cfg = load_config(
        preset="tiny",
        overrides={"rubrics": {"samples": 3, "num_items": 3, "max_new_tokens": 300, "constrained": True}},
    )
    counts = run_rubrics(str(tmp_path / "r.parquet"), str(tmp_path / "s.parquet"), cfg, engine=engine)
    rubrics = read_frame(str(tmp_path / "s.parquet"), "rubrics")
    cut = rubrics["finish_reason"] == "length"
    assert counts["truncated"] == int(cut.sum()) == int((rubrics["parse_status"] == TRUNCATED).sum())
    assert (rubrics.loc[cut, "items"].map(len) == 0).all()  # cut off: scored as empty
    assert set(rubrics.loc[~cut, "parse_status"]) == {"json"} and counts["parse_rate"] == 1.0

    short = cfg.model_copy(update={"rubrics": cfg.rubrics.model_copy(update={"max_new_tokens": 16})})
    counts = run_rubrics(str(tmp_path / "r.parquet"), str(tmp_path / "t.parquet"), short, engine=engine)
    assert counts["truncated"] == counts["rubrics"] == 6 and counts["mean_items"] == 0.0

    thinking = load_config(preset="tiny", overrides={"models": {"enable_thinking": {"generator": True}}})
    with pytest.raises(ValueError, match="enable_thinking.generator"):
        run_rubrics(str(tmp_path / "r.parquet"), str(tmp_path / "u.parquet"), thinking, engine=engine)


@pytest.mark.slow
def test_smollm2_constrained_rubrics_are_valid_json() -> None:
    """The real generator (vocab 49,152): 8 constrained rubric samples at temperature 0.7, batch 8."""
    smol = HFEngine("smollm2-135m-instruct", device="cpu", batch_size=8)
    prompt = smol.chat_prompt(
        [{"role": "user", "content": "Write a grading rubric for answers to: What is 17 + 25?"}]
    )
    gen = smol.generate([prompt], n=8, temperature=0.7, max_new_tokens=448, seed=0, rubric_items=4)[0]
    complete = [t for t, r in zip(gen.texts, gen.finish_reasons, strict=True) if r == "stop"]
    # Each sample has its own seeded stream, so a sample of n tokens would also finish under any limit
    # >= n: the token counts say how presets' rubrics.max_new_tokens would truncate (shown with -s).
    print("smollm2 constrained rubric tokens:", sorted(gen.num_tokens), gen.finish_reasons)
    assert len(complete) >= 6
    assert all(_valid(t, 4) and parse_rubric(t, 4).status == "json" for t in complete)


def test_vllm_grammar_has_no_free_whitespace() -> None:
    """What vLLM gets (`rubric_grammar`) admits the compact rubric JSON and refuses whitespace between
    tokens, extra items and out-of-range weights."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    grammar = constrained.rubric_grammar(2)
    one = '{"text": "States 5", "weight": 5}'
    assert accepts(grammar, '{"items": [' + one + "]}")
    assert accepts(grammar, '{"items": [' + one + ", " + one + "]}")
    assert not accepts(grammar, '{"items": [' + ", ".join([one] * 3) + "]}")
    assert not accepts(grammar, '{ "items": [' + one + "]}")
    assert not accepts(grammar, '{"items":\n[' + one + "]}")
    assert not accepts(grammar, '{"items": [{"text": "States 5", "weight": 6}]}')


def test_a_row_the_grammar_rejects_ends_and_is_counted_never_raised(engine: HFEngine) -> None:
    """A row that `generate` ends on a token the grammar does not expect at that point (here: a stop token
    mid-rubric, as SmolLM2's old tokenizer made transformers pad with a token the grammar forbade) is
    marked rejected and may then only stop; xgrammar's own processor asserted and ended the process."""
    import torch

    stop = engine.stop_ids[0]
    processor = constrained.hf_logits_processor(engine.tokenizer, 3, stop_token_ids=engine.stop_ids)
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    tokens = engine.tokenizer.encode('{"items": [{"text": "Says', add_special_tokens=False)
    ids = torch.tensor([[0], [0]])
    processor(ids, torch.zeros(2, vocab))  # the first step: the matchers are made
    for k, token in enumerate(tokens):  # row 0 writes the rubric's opening; row 1 stops after one token
        ids = torch.cat([ids, torch.tensor([[token], [tokens[0] if k == 0 else stop]])], dim=1)
        scores = processor(ids, torch.zeros(2, vocab))
        if k >= 1:
            break
    assert processor.rejected == {1}
    allowed = torch.isfinite(scores[1]).nonzero().flatten().tolist()
    assert allowed == sorted(engine.stop_ids)  # it can only end now
    assert 0 < torch.isfinite(scores[0]).sum() < vocab  # the other row is still masked by the grammar


def test_a_constrained_sample_that_stopped_off_the_grammar_is_a_rejected_rubric() -> None:
    from dynamicrubric.scoring.rubrics import REJECTED, rubric_rows

    rows = rubric_rows(
        "p1",
        "prompt",
        ['{"items": [{"text": "States the sum', '{"items": [{"text": "States the sum", "weight": 4}]}'],
        ["stop", "stop"],
        variant="dynamic",
        generator="g",
        num_items=3,
        constrained=True,
    )
    assert [r["parse_status"] for r in rows] == [REJECTED, "json"]
    assert rows[0]["items"] == [] and len(rows[1]["items"]) == 1
