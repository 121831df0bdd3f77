"""Stage 2, rubric generation: the DynamicRubric generator, and the static baseline.

dynamic: the generator reads the prompt and all K responses of a candidate set (labelled A, B, ... in
a seeded shuffled order) and writes at most M weighted yes/no items meant to tell them apart.
static (RaR-style baseline): the same format, written from the prompt alone.

G rubric samples per candidate set (G > 1 feeds the generator's GRPO; G = 1 for scoring). A sample
that does not parse becomes an empty rubric, counted and logged, never a crash.
"""

from __future__ import annotations

import logging

import pandas as pd

from dynamicrubric.artifacts import read_frame, write_artifact
from dynamicrubric.config import Config
from dynamicrubric.engines import Engine, load_engine
from dynamicrubric.models import model_reference
from dynamicrubric.prompts import dynamic_rubric_prompt, parse_rubric, response_order, static_rubric_prompt

log = logging.getLogger(__name__)


def generator_messages(user_text: str) -> list[dict]:
    """The chat the generator sees; the trainer rebuilds it from the stored `generator_prompt`."""
    return [{"role": "user", "content": user_text}]


def rubric_requests(rollouts: pd.DataFrame, cfg: Config, variant: str, seed: int) -> pd.DataFrame:
    """One generator prompt per candidate set (prompt_id), in the order the prompts first appear."""
    rc = cfg.rubrics
    requests = []
    for prompt_id, group in rollouts.groupby("prompt_id", sort=False):
        group = group.sort_values("sample_idx")
        task = group["prompt"].iloc[0]
        if variant == "dynamic":
            responses = group["response"].tolist()
            shown = [responses[i] for i in response_order(str(prompt_id), len(responses), seed)]
            text = dynamic_rubric_prompt(task, shown, rc.num_items, rc.max_response_chars)
        elif variant == "static":
            text = static_rubric_prompt(task, rc.num_items)
        else:
            raise ValueError(f"rubrics.variant: unknown variant {variant!r}; expected 'dynamic' or 'static'")
        requests.append({"prompt_id": prompt_id, "generator_prompt": text})
    return pd.DataFrame(requests)


def run_rubrics(
    rollouts_uri: str,
    out_uri: str,
    cfg: Config,
    *,
    generator: str | None = None,
    samples: int | None = None,
    variant: str | None = None,
    seed: int | None = None,
    engine: Engine | None = None,
) -> dict:
    """Write `samples` rubric samples (default cfg.rubrics.samples) for every candidate set."""
    rc = cfg.rubrics
    generator = generator or cfg.models.generator
    samples = samples or rc.samples
    variant = variant or rc.variant
    seed = cfg.seed if seed is None else seed
    rollouts = read_frame(rollouts_uri, "rollouts")
    requests = rubric_requests(rollouts, cfg, variant, seed)
    engine = engine or load_engine(generator, cfg.engine)
    generations = engine.generate(
        [engine.chat_prompt(generator_messages(t)) for t in requests["generator_prompt"]],
        n=samples,
        temperature=rc.temperature,
        top_p=rc.top_p,
        max_new_tokens=rc.max_new_tokens,
        seed=seed,
        desc=f"rubrics ({variant})",
    )
    reference = model_reference(generator)  # stored normalised: the bytes do not depend on how it was typed
    rows = []
    for request, gen in zip(requests.itertuples(), generations, strict=True):
        for g, (completion, finish_reason) in enumerate(zip(gen.texts, gen.finish_reasons, strict=True)):
            parsed = parse_rubric(completion, rc.num_items)
            rows.append(
                {
                    "prompt_id": request.prompt_id,
                    "rubric_idx": g,
                    "variant": variant,
                    "generator": reference,
                    "generator_prompt": request.generator_prompt,
                    "completion": completion,
                    "finish_reason": finish_reason,
                    "parse_status": parsed.status,
                    "items": parsed.items,
                }
            )
    rubrics = pd.DataFrame(rows)
    write_artifact(out_uri, "rubrics", rubrics)
    empty = int((rubrics["parse_status"] == "empty").sum())
    if empty:
        log.warning("rubrics: %d of %d rubric samples did not parse and are empty", empty, len(rubrics))
    counts = {
        "candidate_sets": len(requests),
        "rubrics": len(rubrics),
        "empty_rubrics": empty,
        "parsed_json": int((rubrics["parse_status"] == "json").sum()),
        "parsed_lines": int((rubrics["parse_status"] == "lines").sum()),
        "mean_items": float(rubrics["items"].map(len).mean()),
    }
    log.info("rubrics: %s -> %s", counts, out_uri)
    return counts
