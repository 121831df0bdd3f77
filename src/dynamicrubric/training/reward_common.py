"""What both trainers' reward functions share for the groups they score: the engines they load (or
reach through a server), the ledger of their calls, the step's artifacts, the groups set aside for
lost verdicts, the checker's outcomes, and the aggregation of a step (see training/policy_reward.py,
training/generator_rewards.py). How a step's groups are split into parts and gathered back is
training/reward_parts.py."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dynamicrubric import store
from dynamicrubric.engines.served_calls import counts_text
from dynamicrubric.infra.artifacts import to_table, write_artifact
from dynamicrubric.infra.config import Config, reward_roles
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.training.reward_parts import Loss, Share, over_budget

log = logging.getLogger(__name__)


def completion_text(completion: Any) -> str:
    """TRL passes conversational completions as [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def finish_reason(ids: list[int], max_tokens: int) -> str:
    """'length' when the completion used its whole budget (TRL cuts at eos, so a stop is shorter)."""
    return "length" if len(ids) >= max_tokens else "stop"


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
