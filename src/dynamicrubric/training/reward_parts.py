"""A training step's reward scored in parts: the step's whole groups split across processes (or, with
served models, across nodes), each part's share scored, and the scores gathered back; the parts'
metrics combined, and what they lost held to one failure budget for the whole step. Apart from
reward_common.py (what a part does with its share) because this is only about who scores which groups
and how their answers meet, whatever the scoring."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from dynamicrubric import store
from dynamicrubric.engines.served_calls import ServedError
from dynamicrubric.training import cpu_waits
from dynamicrubric.training.checkpoints import this_node


def step_dir(steps_uri: str, step: int, part: int = 0, parts: int = 1, kind: str = "rank") -> str:
    """Where one step's artifacts go: a part's own folder (`rank-K`, `node-K`) when several score it."""
    folder = store.join(steps_uri, f"step-{step:05d}")
    return store.join(folder, f"{kind}-{part}") if parts > 1 else folder


def prompt_group_ids(rows: list[dict], group_size: int, key: str) -> list[str]:
    """A distinct id per group: the row's id, suffixed if the same prompt appears twice in one batch."""
    ids, seen = [], {}
    for g in range(0, len(rows), group_size):
        base = str(rows[g][key])
        seen[base] = seen.get(base, -1) + 1
        ids.append(base if seen[base] == 0 else f"{base}#{seen[base]}")
    return ids


@dataclass(frozen=True)
class Share:
    """The groups of a step's batch that one process scores, and where their artifacts go.

    Each group keeps its id and its place in the whole batch (the seeds of its rubric samples), so it
    is scored exactly as it would be with the whole batch in one part."""

    ids: tuple[str, ...]  # its groups' ids, as prompt_group_ids names them over the whole batch
    indices: tuple[int, ...]  # their places in the batch
    part: int = 0
    parts: int = 1  # above 1: the step is scored in parts, and its failure budget is the whole step's
    kind: str = "rank"  # what a part is, in its folder's name and in errors: rank-K, node-K

    @property
    def name(self) -> str:
        return f"{self.kind} {self.part}"

    def folder(self, steps_uri: str, step: int) -> str:
        return step_dir(steps_uri, step, self.part, self.parts, self.kind)


def whole_step(rows: list[dict], group_size: int, key: str = "prompt_id") -> Share:
    """The share of a process that scores the whole batch alone."""
    ids = prompt_group_ids(rows, group_size, key)
    return Share(tuple(ids), tuple(range(len(ids))))


@dataclass(frozen=True)
class Loss:
    """What one part of a step lost to failed requests or missing verdicts, for the step's budget."""

    stage: str
    step: int
    failed: int  # groups that lost a verdict or a rubric
    groups: int
    max_failed_fraction: float
    record: str  # where it is recorded and its requests by server: how the step's failure names it


class Scored(NamedTuple):
    """A scorer's answer for its share: one value per row, the metrics of its share and, for a part of
    a step scored in parts, what it lost (the step's budget is decided once every part is in)."""

    values: list
    metrics: dict[str, float]
    loss: Loss | None = None


def process_rank() -> tuple[int, int]:
    from accelerate import PartialState

    state = PartialState()
    return state.process_index, state.num_processes


def score_by_groups(
    local_rows: list[dict],
    group_size: int,
    score: Callable[[list[dict], Share], Scored],
    served: bool = False,
    key: str = "prompt_id",
) -> tuple[list, dict]:
    """Split the whole batch into groups (of `group_size` rows, named by their rows' `key`), score this
    process's share, and return its own slice of the values and the metrics it logs.

    `score(rows, share)` gets the rows of this process's groups (whole groups, in batch order); who
    scores which is `_split`'s. The others wait for the scores on the CPU group: a part's requests may
    take serving.deadline_s a role. Every process ends the same way: with the step's scores, or with
    the same one-line error (a part's own, said as its part's, or the step's failure budget over all its
    parts), never in a collective's timeout behind a part that failed. The metrics of a step in parts
    are combined on the main process (combined_metrics), which alone logs them."""
    rank, world = process_rank()
    slices = cpu_waits.gather_object((this_node(), local_rows)) if world > 1 else [(0, local_rows)]
    rows = [x for _, part in slices for x in part]
    start = sum(len(part) for _, part in slices[:rank])
    if len(rows) % group_size:
        raise ValueError(f"a batch of {len(rows)} completions is not whole groups of {group_size}")
    ids = prompt_group_ids(rows, group_size, key)
    part_of, sender, kind = _split(served, [node for node, _ in slices], len(ids))
    mine = next((p for p, r in sender.items() if r == rank), None)
    groups = [g for g in range(len(ids)) if part_of[g] == mine] if mine is not None else []
    indices = [i for g in groups for i in range(g * group_size, (g + 1) * group_size)]
    scored, raised, failure = Scored([], {}), None, None
    if mine is not None:
        share = Share(tuple(ids[g] for g in groups), tuple(groups), mine, len(sender), kind)
        try:
            scored = score([rows[i] for i in indices], share)
        except Exception as e:
            if world == 1:
                raise
            raised, failure = e, _carried(e, share)
    if world == 1:
        return scored.values, scored.metrics
    own = dict(zip(indices, scored.values, strict=True)) if raised is None else {}
    answers: list[_Answer] = cpu_waits.gather_object(
        _Answer(own, len(groups), scored.metrics, scored.loss, failure)
    )
    carried = next((a.failure for a in answers if a.failure is not None), None)
    if carried is not None:  # the first part that failed, in rank order, is every process's error
        raise _rebuilt(*carried) from raised
    budget = over_budget([a.loss for a in answers if a.loss is not None])
    if budget is not None:
        raise budget
    results = {i: v for a in answers for i, v in a.values.items()}
    values = [results[i] for i in range(start, start + len(local_rows))]
    if len(sender) == 1:
        return values, scored.metrics
    return values, combined_metrics([(a.groups, a.metrics) for a in answers]) if rank == 0 else {}


def _split(served: bool, nodes: list[int], groups: int) -> tuple[list[int], dict[int, int], str]:
    """Who scores which of a step's groups: each group's part, each part's process (its rank) and what
    a part is. With in-process models every process scores every world-th group. With served models
    the servers batch and prefix-cache a whole step's requests better than world small slices: on one
    node the main process sends them all; on several (`nodes`: each rank's torchrun GROUP_RANK) group g
    is node g % num_nodes's, sent by its first process to the node's own servers, so none of them idle."""
    world = len(nodes)
    if not served:
        return [g % world for g in range(groups)], {r: r for r in range(world)}, "rank"
    order = sorted(set(nodes))
    if len(order) == 1:
        return [0] * groups, {0: 0}, "rank"
    first = {n: nodes.index(n) for n in order}
    return [order[g % len(order)] for g in range(groups)], first, "node"


class _Answer(NamedTuple):
    """What each process hands the others once its share is scored."""

    values: dict[int, Any]  # its rows' values, by their place in the batch
    groups: int
    metrics: dict[str, float]
    loss: Loss | None
    failure: tuple[type[Exception], str] | None  # its error, as every process raises it


def _carried(error: Exception, share: Share) -> tuple[type[Exception], str]:
    """A part's error as the other processes raise it too: its type (where it pickles) and its one
    line, which names the part when the step has several (two nodes' servers can share a URL)."""
    kind: type[Exception] = type(error)
    try:
        pickle.dumps(kind)
    except Exception:
        kind = RuntimeError
    message = str(error) if share.parts == 1 else f"{share.name}: {error}"
    return kind, message


def _rebuilt(kind: type[Exception], message: str) -> Exception:
    try:
        return kind(message)
    except Exception:  # an error type that takes other arguments than one message
        return RuntimeError(f"{kind.__name__}: {message}")


COUNTED = ("/calls_", "_groups")  # metrics that count things (requests by outcome, groups)


def combined_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The metrics of a step scored in parts, from each part's (groups, metrics): counts add up, times
    are the slowest part's (the parts run at once), any other value is the parts' mean weighted by
    their groups (a rate over a part's rows is close to, not always exactly, the rate over the step's)."""
    out: dict[str, float] = {}
    for name in sorted({k for _, metrics in parts for k in metrics}):
        values = [(n, m[name]) for n, m in parts if m.get(name) is not None and math.isfinite(m[name])]
        if not values:
            continue
        if any(c in name for c in COUNTED):
            out[name] = float(sum(v for _, v in values))
        elif name.startswith("time/"):
            out[name] = float(max(v for _, v in values))
        elif sum(n for n, _ in values):
            out[name] = float(sum(n * v for n, v in values) / sum(n for n, _ in values))
    return out


def log_all(log_metric: Callable | None, metrics: dict) -> None:
    for name, value in metrics.items():
        if log_metric is not None and value is not None and math.isfinite(value):
            log_metric(name, float(value))


class RewardError(ServedError):
    """A training step whose scoring failed past the failure budget; the message says what happened
    (one line: the roles' servers, their requests' counts by outcome, where calls.json is)."""


def over_budget(losses: list[Loss]) -> RewardError | None:
    """The step's failure when the groups its parts lost are over `serving.max_failed_fraction` of all
    its groups: one line naming where each part that lost groups recorded its requests, and its
    servers' counts by outcome; None within the budget."""
    failed, groups = sum(x.failed for x in losses), sum(x.groups for x in losses)
    if not losses or not failed or failed / max(groups, 1) <= losses[0].max_failed_fraction:
        return None
    first, share = losses[0], failed / max(groups, 1)
    records = [x.record for x in losses if x.failed or len(losses) == 1]
    return RewardError(
        f"{first.stage} step {first.step}: {failed} of {groups} groups lost verdicts or rubrics "
        f"({share:.0%} > serving.max_failed_fraction={first.max_failed_fraction}); " + "; ".join(records)
    )
