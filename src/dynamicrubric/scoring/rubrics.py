"""Stage 2, rubric generation: the DynamicRubric generator, and the static baseline.

dynamic: the generator reads the prompt and all K responses of a candidate set (labelled A, B, ... in
a seeded shuffled order) and writes at most M weighted yes/no items meant to tell them apart.
static (RaR-style baseline): the same format, written from the prompt alone.

G rubric samples per candidate set (G > 1 feeds the generator's GRPO; G = 1 for scoring). A sample
that does not parse becomes an empty rubric, counted and logged, never a crash. Several samples of a
dynamic rubric for scoring each read the responses in their own seeded order (`rubrics.shuffle`), so
that no position is favoured; each row's `generator_prompt` is the prompt its sample read.

With `rubrics.constrained` (the default) decoding is constrained to `constrained.rubric_schema(M)`, so
every sample parses as JSON unless the token limit cut it off. A cut-off sample gets parse_status
"truncated" and no items (scored as an empty rubric), and is counted in `truncated`.

A dynamic prompt whose responses, each clipped at `rubrics.max_response_chars` characters, still leave
no room in the generator's context for `rubrics.max_new_tokens` (a guard set of 16 long responses) has
its responses clipped further, all at one shorter length, until it fits, and is counted in
`clipped_to_fit`: the engine would otherwise refuse it, or cut its first tokens (the task), and a seeded
retry would fail the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from dynamicrubric.engines import FAILED, Engine, EngineError, load_engine, prompts_named
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import Config
from dynamicrubric.infra.model_references import model_reference
from dynamicrubric.scoring.prompts import (
    ParsedRubric,
    dynamic_rubric_prompt,
    parse_rubric,
    response_order,
    static_rubric_prompt,
)

log = logging.getLogger(__name__)

TRUNCATED = "truncated"  # parse_status of a constrained rubric cut off by the token limit
# parse_status of a constrained rubric that stopped without being whole JSON: the grammar rejected a token
# its row sampled, and the row was ended (constrained.RubricGrammarProcessor). Scored as empty, counted.
REJECTED = "rejected"


def generator_messages(user_text: str) -> list[dict]:
    """The chat the generator sees; the trainer rebuilds it from the stored `generator_prompt`."""
    return [{"role": "user", "content": user_text}]


def orders_per_sample(cfg: Config, variant: str, samples: int) -> bool:
    """Whether each of a set's `samples` rubric samples reads the responses in its own seeded order
    (`rubrics.shuffle`): only a dynamic prompt shows responses, and one sample has no other to differ
    from (it reads the set's one order, as it always did)."""
    return cfg.rubrics.shuffle and variant == "dynamic" and samples > 1


def fitted_dynamic_prompt(
    task: str,
    responses: list[str],
    num_items: int,
    max_response_chars: int,
    prompt_tokens: Callable[[str], int],
    max_prompt_tokens: int,
) -> tuple[str, bool]:
    """The dynamic prompt with every response clipped at one length short enough for the prompt to
    take at most `max_prompt_tokens` (as `prompt_tokens` counts a prompt), and whether it had to be
    clipped below `max_response_chars`. A prompt that cannot fit even with no response text is left as
    it is, for the engine to refuse with its numbers (or cut, as engine.long_prompts says)."""
    text = dynamic_rubric_prompt(task, responses, num_items, max_response_chars)
    length = prompt_tokens(text)
    if length <= max_prompt_tokens:
        return text, False
    fixed = prompt_tokens(dynamic_rubric_prompt(task, responses, num_items, 0))
    if fixed >= max_prompt_tokens:
        return text, False
    limit = max_response_chars
    while length > max_prompt_tokens and limit > 0:
        # The responses' share shrinks by what must go (5% more, so every pass shortens them).
        limit = int(limit * (max_prompt_tokens - fixed) / (length - fixed) * 0.95)
        text = dynamic_rubric_prompt(task, responses, num_items, limit)
        length = prompt_tokens(text)
    return text, True


def rubric_requests(
    rollouts: pd.DataFrame,
    cfg: Config,
    variant: str,
    seed: int,
    samples: int = 1,
    *,
    prompt_tokens: Callable[[str], int] | None = None,
    max_prompt_tokens: int | None = None,
) -> pd.DataFrame:
    """The generator's prompts, in the order the candidate sets (prompt_id) first appear: columns
    prompt_id, rubric_idx (the first rubric sample the prompt is for), generator_prompt and
    clipped_to_fit (its responses clipped below rubrics.max_response_chars to take at most
    `max_prompt_tokens` as `prompt_tokens` counts them; given neither, none is).

    One prompt per set, for all of its samples, unless `orders_per_sample` says each of its `samples`
    samples reads its own order: then one prompt per sample (rubric_idx 0..samples-1). The generator's
    trainer asks for one prompt per set (the default `samples=1`), whatever the config says."""
    rc = cfg.rubrics
    per_sample = orders_per_sample(cfg, variant, samples)
    requests = []
    for prompt_id, group in rollouts.groupby("prompt_id", sort=False):
        group = group.sort_values("sample_idx")
        task = group["prompt"].iloc[0]
        if variant not in ("dynamic", "static"):
            raise ValueError(f"rubrics.variant: unknown variant {variant!r}; expected 'dynamic' or 'static'")
        responses = group["response"].tolist()
        for g in range(samples if per_sample else 1):
            if variant == "dynamic":
                shown = [responses[i] for i in response_order(str(prompt_id), len(responses), seed, g)]
                if prompt_tokens is None or max_prompt_tokens is None:
                    text = dynamic_rubric_prompt(task, shown, rc.num_items, rc.max_response_chars)
                    clipped = False
                else:
                    text, clipped = fitted_dynamic_prompt(
                        task, shown, rc.num_items, rc.max_response_chars, prompt_tokens, max_prompt_tokens
                    )
            else:
                text, clipped = static_rubric_prompt(task, rc.num_items), False
            requests.append(
                {"prompt_id": prompt_id, "rubric_idx": g, "generator_prompt": text, "clipped_to_fit": clipped}
            )
    return pd.DataFrame(requests, columns=["prompt_id", "rubric_idx", "generator_prompt", "clipped_to_fit"])


def rubric_rows(
    prompt_id: str,
    generator_prompt: str,
    completions: list[str],
    finish_reasons: list[str],
    *,
    variant: str,
    generator: str,
    num_items: int,
    constrained: bool,
    first_idx: int = 0,
) -> list[dict]:
    """The rubric samples written for one candidate set from one prompt, parsed, as rows of the
    `rubrics` artifact, numbered from `first_idx`.

    The standalone stage and the generator's online trainer both build their rows here."""
    rows = []
    for g, (completion, reason) in enumerate(zip(completions, finish_reasons, strict=True), first_idx):
        if reason == FAILED:  # the model server never answered: nothing to parse, and no rubric
            parsed = ParsedRubric([], FAILED)
        elif constrained and reason == "length":
            # The schema guarantees a complete rubric only when decoding ends at a stop token:
            # a cut-off one is scored as empty rather than trusted in part.
            parsed = ParsedRubric([], TRUNCATED)
        else:
            parsed = parse_rubric(completion, num_items)
            if constrained and parsed.status != "json":  # stopped, yet not the schema's JSON: off the grammar
                parsed = ParsedRubric([], REJECTED)
        rows.append(
            {
                "prompt_id": prompt_id,
                "rubric_idx": g,
                "variant": variant,
                "generator": generator,
                "generator_prompt": generator_prompt,
                "completion": completion,
                "finish_reason": reason,
                "parse_status": parsed.status,
                "items": parsed.items,
            }
        )
    return rows


def generate_rubrics(
    rollouts: pd.DataFrame,
    cfg: Config,
    *,
    generator: str | None = None,
    samples: int | None = None,
    variant: str | None = None,
    seed: int | None = None,
    engine: Engine | None = None,
    allow_failed: bool = False,
    set_indices: Sequence[int] | None = None,
) -> tuple[pd.DataFrame, dict]:
    """`samples` rubric samples (default cfg.rubrics.samples) for every candidate set of `rollouts`:
    the `rubrics` table and its counts. `set_indices`: where `rollouts` is a part of a larger batch
    scored in parts, each set's place in the whole (in the order the sets appear), which seeds its
    samples as they would be seeded in the whole (a training step split over nodes).

    A sample whose server request failed after its retries raises, unless `allow_failed` (the online
    reward, which leaves that set's group out): it then gets parse_status "failed" and no items, and
    is counted in `failed`."""
    rc = cfg.rubrics
    generator = generator or cfg.models.generator
    samples = rc.samples if samples is None else samples
    variant = variant or rc.variant
    seed = cfg.seed if seed is None else seed
    per_sample = orders_per_sample(cfg, variant, samples)
    thinking = cfg.models.enable_thinking.generator
    if rc.constrained and thinking:
        raise ValueError(
            "rubrics.constrained decodes the rubric's JSON from the first token, which leaves no room "
            "for a thinking block: set models.enable_thinking.generator: false or rubrics.constrained: false"
        )
    engine = engine or load_engine(generator, cfg.engine)

    def prompt_tokens(text: str) -> int:
        chat = engine.chat_prompt(generator_messages(text), enable_thinking=thinking)
        return len(engine.tokenizer.encode(chat, add_special_tokens=False))

    room = engine.context_length and engine.context_length - rc.max_new_tokens
    requests = rubric_requests(
        rollouts, cfg, variant, seed, samples, prompt_tokens=prompt_tokens, max_prompt_tokens=room or None
    )
    clipped = int(requests["clipped_to_fit"].sum())
    if clipped:
        log.warning(
            "rubrics: %d of %d generator prompts had their responses clipped below rubrics.max_response_chars"
            "=%d to leave rubrics.max_new_tokens=%d of the context (%d tokens) free",
            clipped,
            len(requests),
            rc.max_response_chars,
            rc.max_new_tokens,
            engine.context_length,
        )
    indices = None if set_indices is None else list(set_indices)
    if per_sample:  # a prompt per (set, sample): seeded by the set's place and the sample, as in the whole
        place = {pid: i for i, pid in enumerate(dict.fromkeys(requests["prompt_id"]))}
        at = indices or list(range(len(place)))
        indices = [
            at[place[p]] * samples + int(g)
            for p, g in zip(requests["prompt_id"], requests["rubric_idx"], strict=True)
        ]
    # Every prompt goes in one call, the per-sample orders' too: the engines batch them together (vLLM
    # and a server cache the prefix the orders share; HFEngine batches rows of similar length).
    with prompts_named(list(requests["prompt_id"])):
        generations = engine.generate(
            [
                engine.chat_prompt(generator_messages(t), enable_thinking=thinking)
                for t in requests["generator_prompt"]
            ],
            n=1 if per_sample else samples,
            temperature=rc.temperature,
            top_p=rc.top_p,
            max_new_tokens=rc.max_new_tokens,
            seed=seed,
            desc=f"rubrics ({variant})",
            rubric_items=rc.num_items if rc.constrained else None,
            prompt_indices=indices,
        )
    failed = sum(r == FAILED for g in generations for r in g.finish_reasons)
    if failed and not allow_failed:
        raise EngineError(
            f"rubrics: {failed} of {sum(len(g.texts) for g in generations)} rubric samples got no answer from "
            f"the generator's server after its retries (each failure is logged above)"
        )
    reference = model_reference(generator)  # stored normalised: the bytes do not depend on how it was typed
    rows = []
    for request, gen in zip(requests.itertuples(), generations, strict=True):
        rows += rubric_rows(
            request.prompt_id,
            request.generator_prompt,
            gen.texts,
            gen.finish_reasons,
            variant=variant,
            generator=reference,
            num_items=rc.num_items,
            constrained=rc.constrained,
            first_idx=int(request.rubric_idx),
        )
    rubrics = pd.DataFrame(rows)
    empty = int((rubrics["parse_status"] == "empty").sum())
    truncated = int((rubrics["parse_status"] == TRUNCATED).sum())
    rejected = int((rubrics["parse_status"] == REJECTED).sum())
    if empty:
        log.warning("rubrics: %d of %d rubric samples did not parse and are empty", empty, len(rubrics))
    if truncated:
        log.warning(
            "rubrics: %d of %d constrained rubric samples were cut off by rubrics.max_new_tokens=%d and "
            "are scored as empty",
            truncated,
            len(rubrics),
            rc.max_new_tokens,
        )
    if rejected:
        log.warning(
            "rubrics: %d of %d constrained rubric samples stopped off the grammar (a token it rejects) and "
            "are scored as empty",
            rejected,
            len(rubrics),
        )
    complete = len(rubrics) - truncated - failed - rejected
    counts = {
        "failed": failed,
        "candidate_sets": int(requests["prompt_id"].nunique()),
        "rubrics": len(rubrics),
        "empty_rubrics": empty,
        "truncated": truncated,
        "rejected": rejected,
        "clipped_to_fit": clipped,
        # Share of the rubrics not cut off by the token limit that parsed (1.0 when constrained).
        "parse_rate": float((rubrics["parse_status"] != "empty").sum() - truncated - failed - rejected)
        / complete
        if complete
        else 0.0,
        "parsed_json": int((rubrics["parse_status"] == "json").sum()),
        "parsed_lines": int((rubrics["parse_status"] == "lines").sum()),
        "mean_items": float(rubrics["items"].map(len).mean()),
    }
    return rubrics, counts


def run_rubrics(rollouts_uri: str, out_uri: str, cfg: Config, **options: Any) -> dict:
    """The rubrics stage: `generate_rubrics(rollouts, cfg, **options)` over an artifact, written to
    `out_uri` (nothing is written when it raises)."""
    try:
        rubrics, counts = generate_rubrics(read_frame(rollouts_uri, "rollouts"), cfg, **options)
    except EngineError as e:
        raise EngineError(f"{e}; nothing written to {out_uri}") from e
    write_artifact(out_uri, "rubrics", rubrics)
    log.info("rubrics: %s -> %s", counts, out_uri)
    return counts
