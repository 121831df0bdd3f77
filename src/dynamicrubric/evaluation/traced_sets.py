"""The judged candidate sets a round's evaluate stage keeps for people to read: its MLflow traces
(tracking_records.log_traced_sets) and the run report's sample browser (run_page_sections.py) show
the same sets."""

from __future__ import annotations

import re

import pandas as pd

from dynamicrubric import store
from dynamicrubric.evaluation.labelled import OUTCOMES_PREFIX
from dynamicrubric.evaluation.probe import EvalJob
from dynamicrubric.infra.artifacts import read_frame

_STEP = re.compile(r"step-(\d+)")


def _number(value) -> float | None:
    """A JSON-able number: None for NaN (a failed verdict or score, never shown as 0)."""
    value = float(value)
    return None if value != value else value


def traced_sets(
    jobs: list[EvalJob], scored: pd.DataFrame, limit: int, *, generator: str, verifier: str
) -> list[dict]:
    """Up to `limit` judged candidate sets, as the MLflow traces and the run report show them: per set
    (a labelled list, a probe set of both policies' samples, or a probe set with the guard's canaries)
    the prompt, G's rubrics (items, weights, whether its output parsed), and per response V's P(yes) per
    item (None: the verdict failed), its score and its gold: its rank in a labelled list (1 = best) and
    the checker's score of a policy sample. Labelled lists come first, in the jobs' order; the guard's
    order and reference sets repeat the probe's responses and are left out."""
    from dynamicrubric.infra.model_references import model_reference

    checker = {
        (OUTCOMES_PREFIX + str(p), int(i)): float(v)
        for p, i, v in scored[["prompt_id", "sample_idx", "score"]].itertuples(index=False)
    }
    sets: list[dict] = []
    for job in jobs:
        if job.judged is None or job.name in ("order", "reference"):
            continue
        rubrics, judgments, scores = job.judged
        verdicts = judgments.groupby(["prompt_id", "sample_idx"])
        by_set = scores.groupby("prompt_id")
        for prompt_id, rows in job.rollouts.groupby("prompt_id", sort=True):
            if len(sets) >= limit:
                return sets
            set_rubrics = rubrics[rubrics["prompt_id"] == prompt_id]
            set_scores = by_set.get_group(prompt_id) if prompt_id in by_set.groups else scores.iloc[:0]
            responses = []
            for row in rows.itertuples(index=False):
                sample = int(row.sample_idx)
                judged = (
                    verdicts.get_group((prompt_id, sample))
                    if (prompt_id, sample) in verdicts.groups
                    else None
                )
                gold: dict[str, float] = {}
                if job.gold:  # a labelled list: the response's rank in it, and its checker score if any
                    gold["rank"] = job.gold[(prompt_id, sample)]
                    outcome = checker.get((prompt_id, sample))
                else:  # a probe or canary set: the policy samples' checker scores
                    outcome = (job.checker or {}).get((str(prompt_id), sample))
                if outcome is not None:
                    gold["checker_score"] = outcome
                responses.append(
                    {
                        "sample_idx": sample,
                        "response": str(row.response),
                        "verdicts": []
                        if judged is None
                        else [
                            {
                                "rubric_idx": int(j.rubric_idx),
                                "item_idx": int(j.item_idx),
                                "p_yes": _number(j.p_yes),
                            }
                            for j in judged.itertuples(index=False)
                        ],
                        "scores": {
                            int(r.rubric_idx): _number(r.score)
                            for r in set_scores[set_scores["sample_idx"] == sample].itertuples(index=False)
                        },
                        "gold": gold,
                    }
                )
            sets.append(
                {
                    "set_id": f"{job.name}/{prompt_id}",
                    "job": job.name,
                    "variant": job.variant,
                    "prompt": str(rows["prompt"].iloc[0]),
                    "generator": model_reference(generator),
                    "verifier": model_reference(verifier),
                    "rubrics": [
                        {
                            "rubric_idx": int(r.rubric_idx),
                            "parse_status": str(r.parse_status),
                            "items": [{"text": str(i["text"]), "weight": int(i["weight"])} for i in r.items],
                        }
                        for r in set_rubrics.itertuples(index=False)
                    ],
                    "responses": responses,
                }
            )
    return sets


def step_sets(
    steps_uri: str, every: int, limit: int, *, variant: str, generator: str, verifier: str
) -> list[dict]:
    """Up to `limit` judged candidate sets of a trainer's steps 1, 1 + `every`, 1 + 2·`every`, ...: each
    step's sets as its reward judged them (its rollouts, rubrics, judgments and scores artifacts; a
    several-process step's ranks in turn). Steps judged without a rubric (pointwise, verifiable) have none."""
    if every < 1 or limit < 1 or not store.exists(steps_uri):
        return []
    folders: dict[int, list[str]] = {}
    for rel in store.list_files(steps_uri):
        if rel.endswith("/rubrics.parquet") and (found := _STEP.fullmatch(rel.split("/", 1)[0])):
            folders.setdefault(int(found.group(1)), []).append(rel.rsplit("/", 1)[0])
    jobs = []
    for step in sorted(n for n in folders if (n - 1) % every == 0):
        for folder in sorted(folders[step]):
            uri = store.join(steps_uri, folder)

            def table(name: str, kind: str, uri: str = uri) -> pd.DataFrame:
                return read_frame(store.join(uri, f"{name}.parquet"), kind)

            if not all(
                store.exists(store.join(uri, f"{n}.parquet")) for n in ("judgments", "scores", "rollouts")
            ):
                continue  # a step that lost every group wrote no verdicts
            judged = (table("rubrics", "rubrics"), table("judgments", "judgments"), table("scores", "scores"))
            jobs.append(EvalJob(folder, table("rollouts", "rollouts"), variant, judged=judged))
    empty = pd.DataFrame({"prompt_id": [], "sample_idx": [], "score": []})
    return traced_sets(jobs, empty, limit, generator=generator, verifier=verifier)
