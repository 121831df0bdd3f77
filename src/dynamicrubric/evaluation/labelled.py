"""Labelled lists for the evaluator metrics: the policy's samples ranked by their verifiable outcomes, and
the user's files of ranked responses (anchors, Nectar, chosen/rejected pairs)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib import resources

import numpy as np
import pandas as pd

from dynamicrubric import tasks
from dynamicrubric.evaluation.metrics import listwise_accuracy, ndcg, pairwise_accuracy, rankable
from dynamicrubric.infra.artifact_kinds import ArtifactError
from dynamicrubric.infra.artifacts import artifact_kind, read_frame

log = logging.getLogger(__name__)

MAX_LIST_SIZE = 26  # the dynamic generator labels responses A..Z
OUTCOMES_PREFIX = "outcomes:"  # list ids of the policy's outcome lists; a user's file i gives "file<i>:"


# --------------------------------------------------------------------------------------------------
# Labelled lists: verifiable outcomes and user files
# --------------------------------------------------------------------------------------------------


# `data.labelled: ["dynamicrubric:NAME"]` names a labelled set shipped in the package's presets/ folder:
# a preset cannot name a path, since a run may start in any folder.
PACKAGED_PREFIX = "dynamicrubric:"


def packaged_path(uri: str) -> str:
    """The file behind a `dynamicrubric:NAME` labelled set; any other URI as it is."""
    if not uri.startswith(PACKAGED_PREFIX):
        return uri
    path = resources.files("dynamicrubric").joinpath("presets", uri.removeprefix(PACKAGED_PREFIX))
    if not path.is_file():
        raise ValueError(f"{uri}: no such labelled set in the package (looked for {path})")
    return str(path)


def load_labelled(uri: str) -> pd.DataFrame:
    """An anchors frame from a user file: an `anchors` artifact, Nectar answers, or chosen/rejected pairs.

    The format is detected: a dynamicrubric artifact by its footer, otherwise by columns (`chosen` and
    `rejected`: pairs; `answers`: Nectar). `dynamicrubric:NAME` is a set shipped with the package.
    """
    uri = packaged_path(uri)
    try:
        found = artifact_kind(uri)
    except ArtifactError:
        found = "<none>"
    if found == "anchors":
        return read_frame(uri, "anchors")
    if found != "<none>":
        raise ValueError(f"{uri}: a {found!r} artifact is not a labelled set; expected an 'anchors' artifact")
    records = tasks.read_records(uri)
    columns = set(records[0])
    if {"chosen", "rejected"} <= columns:
        return tasks.load_pairs(uri)
    if "answers" in columns:
        return tasks.load_nectar(uri)
    raise ValueError(
        f"{uri}: cannot tell the labelled-set format from columns {sorted(columns)}; expected an anchors "
        "artifact, chosen/rejected pairs (columns prompt, chosen, rejected) or Nectar (prompt, answers)"
    )


def outcome_lists(scored: pd.DataFrame, prompts: pd.DataFrame) -> pd.DataFrame:
    """Anchors from verifiable outcomes: each prompt's samples ranked by checker score (dense, 1 = best).

    The ranking rule of `tasks.anchors_from_outcomes` (score descending → dense rank, list_id =
    prompt_id), applied to scores already computed, so code is not run in the sandbox a second time.
    Unlike there, lists whose samples all score the same are kept (all rank 1): the caller counts
    them as skipped.
    """
    ranked = scored.assign(rank=scored.groupby("prompt_id")["score"].rank(method="dense", ascending=False))
    prompt_text = prompts.set_index("prompt_id")["prompt"]
    return pd.DataFrame(
        {
            "list_id": ranked["prompt_id"].astype(str),
            "sample_idx": ranked["sample_idx"].astype(np.int32),
            "rank": ranked["rank"].astype(np.int32),
            "prompt": ranked["prompt_id"].map(prompt_text),
            "response": ranked["response"],
            "source": "outcomes",
        }
    ).reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# The lists the evaluate stage scores
# --------------------------------------------------------------------------------------------------


def as_rollouts(anchors: pd.DataFrame) -> pd.DataFrame:
    """A rollouts-shaped frame of labelled lists (prompt_id = list_id), for the rubric and judge stages."""
    return pd.DataFrame(
        {
            "prompt_id": anchors["list_id"].astype(str),
            "sample_idx": anchors["sample_idx"].astype(np.int32),
            "prompt": anchors["prompt"],
            "response": anchors["response"],
            "num_tokens": np.zeros(len(anchors), dtype=np.int32),
            "finish_reason": "stop",
            "policy": anchors["source"],
            "seed": 0,
        }
    )


def labelled_lists(
    scored: pd.DataFrame, prompts: pd.DataFrame, labelled_uris: Sequence[str]
) -> tuple[pd.DataFrame, dict[str, float]]:
    """Every labelled list usable for accuracy, and counts of what was kept and skipped.

    List ids are prefixed by where they come from ("outcomes:", "file<i>:") so that a user's list id
    cannot collide with a prompt id. Lists with fewer than two distinct ranks, or more responses than
    the generator can label, are skipped and counted.
    """
    parts = [
        outcome_lists(scored, prompts).pipe(lambda df: df.assign(list_id=OUTCOMES_PREFIX + df["list_id"]))
    ]
    for i, uri in enumerate(labelled_uris):
        user = load_labelled(uri)
        log.info("evaluate: %d labelled list(s) from %s", user["list_id"].nunique(), uri)
        parts.append(user.assign(list_id=f"file{i}:" + user["list_id"].astype(str)))
    lists = pd.concat([p[list(tasks.ANCHOR_COLUMNS)] for p in parts], ignore_index=True)
    total = lists["list_id"].nunique()
    too_big = lists.groupby("list_id")["sample_idx"].transform("size") > MAX_LIST_SIZE
    if too_big.any():
        log.warning(
            "evaluate: skipping %d labelled list(s) of more than %d responses",
            lists.loc[too_big, "list_id"].nunique(),
            MAX_LIST_SIZE,
        )
    kept = rankable(lists[~too_big]).reset_index(drop=True)
    num_kept = kept["list_id"].nunique()
    counts = {
        "labelled_lists": float(num_kept),
        "labelled_lists_skipped": float(total - num_kept),
        "labelled_lists_outcomes": float(
            kept["list_id"].str.startswith(OUTCOMES_PREFIX).groupby(kept["list_id"]).any().sum()
        ),
    }
    return kept, counts


def accuracy_by_origin(lists: pd.DataFrame) -> dict[str, float]:
    """Pairwise accuracy on the user's files alone and on the policy's outcome lists alone, and on the
    user's ranked lists the listwise measures the paper reports for AEOLLM and LMSYS: top-1 accuracy
    (the list's best response scored highest) and nDCG.

    The files are a fixed held-out set, comparable from round to round; the outcome lists are the
    current policy's own samples and change with it. NaN (later dropped) when one side has no pair.
    """
    from_outcomes = lists["list_id"].str.startswith(OUTCOMES_PREFIX)
    return {
        "pairwise_accuracy_labelled": pairwise_accuracy(lists[~from_outcomes]),
        "pairwise_accuracy_outcomes": pairwise_accuracy(lists[from_outcomes]),
        "top1_accuracy_labelled": listwise_accuracy(lists[~from_outcomes]),
        "ndcg_labelled": ndcg(lists[~from_outcomes]),
    }
