"""What both trainers' reward functions share: whole groups across processes, the engines they
load (or reach through a server), the ledger of their calls, the step's artifacts, the checker's
outcomes, and the aggregation of a step (see training/policy_reward.py, training/generator_rewards.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dynamicrubric import store
from dynamicrubric.engines.server_engine import ServedError, counts_text
from dynamicrubric.infra.artifacts import to_table, write_artifact
from dynamicrubric.infra.config import Config, reward_roles
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.training import cpu_waits
from dynamicrubric.training.checkpoints import this_node

log = logging.getLogger(__name__)


def step_dir(steps_uri: str, step: int, part: int = 0, parts: int = 1, kind: str = "rank") -> str:
    """Where one step's artifacts go: a part's own folder (`rank-K`, `node-K`) when several score it."""
    folder = store.join(steps_uri, f"step-{step:05d}")
    return store.join(folder, f"{kind}-{part}") if parts > 1 else folder


def completion_text(completion: Any) -> str:
    """TRL passes conversational completions as [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def finish_reason(ids: list[int], max_tokens: int) -> str:
    """'length' when the completion used its whole budget (TRL cuts at eos, so a stop is shorter)."""
    return "length" if len(ids) >= max_tokens else "stop"


# --------------------------------------------------------------------------------------------------
# Whole groups across processes


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


# --------------------------------------------------------------------------------------------------
# Shared pieces

STEP_ARTIFACTS = (
    "calls",  # JSON: every server request's outcome, by role (the trainers' metrics hold them per step too)
    "rollouts",
    "rubrics",
    "judgments",
    "scores",
    "rewards",
    "diagnostics",
    "metrics",
    "anchors",
)


def step_uris(folder: str) -> dict[str, str]:
    return {
        name: store.join(folder, f"{name}.json" if name == "calls" else f"{name}.parquet")
        for name in STEP_ARTIFACTS
    }


def served(cfg: Config, roles: tuple[str, ...]) -> bool:
    return any(getattr(cfg.models, f"{role}_url") for role in roles)


def engine_cache(cfg: Config) -> Callable[[str, str], Any]:
    """Each role's engine, made once per process: a client of the role's server when the config names
    one (`models.<role>_url`, set by the training task for the servers it starts), else the model
    loaded in-process, which only the CPU engine may do (vLLM engines inside every training rank would
    all land on GPU 0 and cannot fit beside the trainer)."""
    from dynamicrubric.engines import EngineError, load_engine

    loaded: dict[str, Any] = {}

    def get(role: str, ref: str) -> Any:
        if role not in loaded:
            import torch

            url = getattr(cfg.models, f"{role}_url")
            if not url and cfg.engine.engine != "hf":
                raise EngineError(
                    f"the training reward calls the {role} through a model server on GPUs: set "
                    f"train_*.reward_gpus (the task serves it) or models.{role}_url"
                )
            # Loading initialises weights from torch's global RNG; the trainer's sampling draws from it
            # too, and a resumed run loads the engines at another step than an uninterrupted one.
            with torch.random.fork_rng(devices=[]):
                model = ref if url else str(resolve_model(ref))
                loaded[role] = load_engine(model, cfg.engine, url=url, serving=cfg.serving, role=role)
        return loaded[role]

    return get


class StepScorer:
    """What both trainers' reward functions hold: the config, where each step's artifacts go, the models
    they call (the stage's own references, else the config's) and how they reach them."""

    stage: str  # the training stage whose reward this is (config.reward_roles says which models it calls)

    def __init__(
        self,
        cfg: Config,
        *,
        steps_uri: str,
        round_idx: int,
        generator: str = "",
        verifier: str = "",
        policy: str = "",
        engines: Callable[[str, str], Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.steps_uri = steps_uri
        self.round_idx = round_idx
        self.generator = generator or cfg.models.generator
        self.verifier = verifier or cfg.models.verifier
        self.policy = policy or cfg.models.policy
        self._engines = engines or engine_cache(cfg)
        self.served = served(cfg, reward_roles(self.stage))

    @classmethod
    def for_job(cls, cfg: Config, job: Any) -> Any:
        """The reward functions of a training job (training.data.TrainingJob)."""
        models = {"generator": job.generator, "verifier": job.verifier, "policy": job.policy}
        return cls(cfg, steps_uri=job.steps_uri, round_idx=job.round_idx, **models)

    def release_models(self) -> None:
        """Drop the engines loaded so far (training is over; writing the checkpoint needs the memory)."""
        self._engines = engine_cache(self.cfg)

    def judge_step(self, tables: dict[str, pa.Table]) -> dict[str, float]:
        """V judges the step's rollouts under its rubrics (pointwise without): adds the `judgments`
        table to `tables`; returns its yes rate, the server requests it made, and its seconds."""
        from dynamicrubric.scoring.judge import judge_rollouts

        started = time.perf_counter()
        verifier = self._engines("verifier", self.verifier)
        rubrics = tables["rubrics"].to_pandas() if "rubrics" in tables else None
        with Calls(verifier, "judge") as calls:
            judgments, counts = judge_rollouts(
                tables["rollouts"].to_pandas(), rubrics, self.cfg, verifier=self.verifier, engine=verifier
            )
        tables["judgments"] = judgments
        return {
            **calls.done(),
            "judge/yes_rate": counts["yes_rate"],
            "time/judge_s": time.perf_counter() - started,
        }

    def servers(self) -> dict[str, str]:
        """Each served role's `Calls` prefix -> how errors name it ("verifier at http://...")."""
        prefixes = {"generator": "rubrics", "verifier": "judge"}
        return {
            prefixes[role]: f"{role} at {getattr(self.cfg.models, f'{role}_url')}"
            for role in reward_roles(self.stage)
            if role in prefixes and getattr(self.cfg.models, f"{role}_url")
        }


class Calls:
    """The server requests one scoring step made of one role, as metrics under `prefix` (none for an
    in-process engine). As a context: the calls inside share one `serving.deadline_s` (the step's
    budget for that role), whatever the server does."""

    def __init__(self, engine: Any, prefix: str) -> None:
        self.ledger = getattr(engine, "ledger", None)  # only served engines make requests
        self.before = self.ledger.snapshot() if self.ledger is not None else None
        self.prefix = prefix
        self._budget = engine.budget() if hasattr(engine, "budget") else contextlib.nullcontext()

    def __enter__(self) -> Calls:
        self._budget.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._budget.__exit__(*exc)

    def done(self) -> dict[str, float]:
        if self.ledger is None:
            return {}
        return {f"{self.prefix}/calls_{k}": float(v) for k, v in self.ledger.since(self.before).items()}


class RewardError(ServedError):
    """A training step whose scoring failed past the failure budget; the message says what happened
    (one line: the roles' servers, their requests' counts by outcome, where calls.json is)."""


def set_aside_failed(
    cfg: Config,
    uri: dict[str, str],
    tables: dict[str, pa.Table],
    group_ids: list[str],
    stage: str,
    step: int,
    calls: dict[str, float],
    servers: dict[str, str] | None = None,
    share: Share | None = None,
) -> tuple[set[str], Loss | None]:
    """The groups that lost a verdict (p_yes NaN: a failed request, or a verifier that gave no label) or
    a rubric sample (its request failed). Their rows move from the step's tables to `failed-*.parquet`
    beside the step's artifacts (as they are: a lost verdict stays NaN, which the judgments contract
    allows), so aggregation reads only whole groups and nothing asked is lost. Over the step's failure
    budget (`serving.max_failed_fraction`) the step fails with one line naming each role's server
    (`servers`: a `calls` prefix -> "verifier at URL") and its requests' counts by outcome.

    A `share` that is one part of a step scored in parts (several nodes) is not the step: its loss is
    returned for the budget of the whole step (over_budget, once every part is in), and its failed
    groups are set aside whatever their share of its own groups."""
    from dynamicrubric.engines import FAILED

    # The requests' outcomes are part of the step's record, also (above all) when the step fails here.
    store.write_bytes(uri["calls"], json.dumps(calls, indent=1, sort_keys=True).encode())
    judgments = tables["judgments"]
    unscored = pc.fill_null(pc.is_nan(judgments["p_yes"]), True)  # NaN or null: no verdict
    failed = set(judgments.filter(unscored)["prompt_id"].to_pylist())
    if "rubrics" in tables:
        rubrics = tables["rubrics"]
        failed |= set(rubrics.filter(pc.equal(rubrics["parse_status"], FAILED))["prompt_id"].to_pylist())
    by_role = []
    for prefix in sorted({k.split("/")[0] for k in calls} | set(servers or {})):
        name = (servers or {}).get(prefix, f"{prefix} (in-process)")
        mine = {k: v for k, v in sorted(calls.items()) if k.startswith(f"{prefix}/")}
        by_role.append(f"{name}: {counts_text(mine)}")
    record = f"requests in {uri['calls']}; " + "; ".join(by_role)
    budget = cfg.serving.max_failed_fraction
    loss = None
    if share is not None and share.parts > 1:
        loss = Loss(stage, step, len(failed), len(group_ids), budget, f"{share.name}: {record}")
    elif (error := over_budget([Loss(stage, step, len(failed), len(group_ids), budget, record)])) is not None:
        raise error
    if not failed:
        return failed, loss
    # In Arrow, not pandas: a frame's NaN would come back as a null, which the contract refuses.
    for name, table in tables.items():
        lost = pc.is_in(table["prompt_id"], value_set=pa.array(sorted(failed), table["prompt_id"].type))
        write_artifact(failed_uri(uri[name]), name, table.filter(lost))
        tables[name] = table.filter(pc.invert(lost))
    log.warning(
        "%s step %d%s: %d of %d groups get no reward (lost verdicts or rubrics): %s",
        stage,
        step,
        f" ({share.name})" if loss is not None else "",
        len(failed),
        len(group_ids),
        sorted(failed)[:5],
    )
    return failed, loss


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


def failed_uri(artifact_uri: str) -> str:
    folder, name = artifact_uri.rstrip("/").rsplit("/", 1)
    return f"{folder}/failed-{name}"


def outcomes(rollouts: pd.DataFrame, prompts: pd.DataFrame, cfg: Config) -> list[float]:
    """The task checker's score of every rollout; a group's code runs in one sandbox batch."""
    from dynamicrubric.tasks import score_group

    by_id = {row["prompt_id"]: row for row in prompts.to_dict("records")}
    scores = pd.Series(0.0, index=rollouts.index)
    for pid, group in rollouts.groupby("prompt_id", sort=False):
        scores[group.index] = score_group(
            by_id[pid], group["response"].tolist(), timeout_s=cfg.evaluate.sandbox_timeout_s
        )
    return scores.tolist()


def checker_judgments(rollouts: pd.DataFrame, outcome: list[float]) -> pd.DataFrame:
    """The checker as a one-item judge: p_yes is its score, so soft aggregation reproduces it exactly."""
    return pd.DataFrame(
        {
            "prompt_id": rollouts["prompt_id"],
            "rubric_idx": 0,
            "item_idx": 0,
            "sample_idx": rollouts["sample_idx"],
            "weight": 1,
            "verdict": [o >= 0.5 for o in outcome],
            "p_yes": outcome,
        }
    )


def ranked_by(rollouts: pd.DataFrame, outcome: list[float]) -> pd.DataFrame | None:
    """Reference rankings from outcomes (for Δgap), for groups whose outcomes differ."""
    from dynamicrubric.tasks import ranked_by_score

    ranked, _ = ranked_by_score(rollouts.assign(score=outcome))
    return ranked if len(ranked) else None


def artifact_table(kind_name: str, data: pd.DataFrame | pa.Table) -> pa.Table:
    """`data` as the stages' code reads it back from an artifact (the kind's schema, no pandas
    metadata): the step's tables stay in memory and are written once, when the step is scored."""
    return to_table(kind_name, data).replace_schema_metadata(None)


def write_step_tables(uri: dict[str, str], tables: dict[str, pa.Table], step: int) -> None:
    """The step's rollouts, rubrics and judgments, each row stamped with its step (a table that lost
    every group to failures has nothing left to write: its rows are in `failed-*`)."""
    for name, table in tables.items():
        if len(table):
            stamped = table.append_column("step", pa.array([step] * len(table), pa.int32()))
            write_artifact(uri[name], name, stamped)


@contextlib.contextmanager
def kept_on_failure(uri: dict[str, str], tables: dict[str, pa.Table], step: int) -> Iterator[None]:
    """A step whose scoring raises still leaves the tables it had made in its folder, for the record;
    the step's own error is the one raised, whatever becomes of that record."""
    try:
        yield
    except BaseException:
        try:
            write_step_tables(uri, tables, step)
        except Exception:
            log.exception("step %d: could not keep the step's tables in %s", step, uri["rollouts"])
        raise


def aggregate_step(
    uri: dict[str, str],
    tables: dict[str, pa.Table],
    anchors: pd.DataFrame | None,
    *,
    soft: bool,
    round_idx: int,
    variant: str,
    step: int,
) -> dict[str, Any]:
    """Write the step's tables (validated on the way), aggregate them (aggregate.py) and write its
    outputs: every artifact of the step once. Returns the outputs by kind, and the run-level numbers
    as `signal/*` under "overall"."""
    from dynamicrubric.scoring.aggregate import write_aggregation

    write_step_tables(uri, tables, step)
    anchors_table = None
    if anchors is not None and len(anchors):
        anchors_table = artifact_table("anchors", write_artifact(uri["anchors"], "anchors", anchors))
    inputs = {"rubrics": None, **tables, "anchors": anchors_table}
    frames, overall = write_aggregation(
        inputs, uri, uri["judgments"], soft=soft, round_idx=round_idx, variant=variant, step=step
    )
    return {**frames, "overall": {f"signal/{k}": v for k, v in overall.items()}}
