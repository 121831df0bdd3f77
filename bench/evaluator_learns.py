"""Does the online generator trainer learn? R_disc of G_0 and G_1 on held-out candidate sets.

P_0 (SmolLM2-135M-Instruct) samples K responses for the training prompts and for held-out prompts,
which become candidate sets (the standalone rollout and candidates stages, with reference rankings
from verifiable outcomes). G_0 is trained online on the training sets (`dynamicrubric.training`:
TRL's GRPOTrainer, R_disc + λ·R_anchor, soft verdicts, rubrics decoded under their JSON schema) into
G_1. Then G_0 and G_1 each write rubrics for the held-out sets with the same seed, the frozen
verifier judges them, and aggregation gives per set: R_disc, tie rate, uniformity and Δgap (the
signal audit of the pipeline, run by the same stage code). Paired differences over sets get 95%
bootstrap intervals (bench/stats.py). The config is bench/study/evaluator_learns.yaml.

    python -m bench.evaluator_learns [--config ...] [--out bench/results/evaluator_learns.json]
    python -m bench.evaluator_learns --work DIR --reuse   # recompute the JSON from DIR's finished steps
    python -m bench.evaluator_learns --seeing-verifier    # V a planted rule that sees the response

With `--seeing-verifier` (JSON: bench/results/evaluator_learns_seeing.json) the verifier is the stand-in
of bench/seeing_verifier.py, loaded through the engines' test hook for the verifier's reference only:
P(yes) answers whether the response contains the number an item names. With it R_disc can move, so the
run shows whether the generator trainer follows its reward; the policy and the generator stay SmolLM2.

R_disc is Σ w·Var_k(v)/Σ w (dynamicrubric.scoring.aggregate): with soft verdicts, how differently the verifier
judges the K responses. The paper's v̄(1 − v̄) with soft verdicts adds the verifier's doubt about each
response (law of total variance: v̄(1 − v̄) = Var_k(p_yes) + mean_k p_yes(1 − p_yes)); the JSON reports
that form (`soft_item_disc`) and the doubt (`uncertainty`) beside R_disc, per item averaged per set.
The first run of this check trained on the v̄(1 − v̄) form and learned nothing; its JSON is
bench/results/evaluator_learns_vbar.json (made at commit 69639e9).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import pandas as pd

from bench.stats import bootstrap_mean, paired_difference
from dynamicrubric import tasks
from dynamicrubric.infra.artifact_kinds import empty_table
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config import Config
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.stages.runner import run_stage
from dynamicrubric.training import launcher
from dynamicrubric.training.data import TrainingJob
from dynamicrubric.training.monitoring import timing_frame

HERE = Path(__file__).parent
AUDIT_SEED = 4242  # the same rubric-sampling seed for G_0 and G_1: only the generator differs


def candidate_sets(cfg: Config, work: Path, split: str, seed: int, reuse: bool) -> tuple[str, str, str]:
    """P_0's K responses per prompt of `split`, as candidate sets with their outcome rankings."""
    sets, ranked = str(work / f"{split}-sets.parquet"), str(work / f"{split}-anchors.parquet")
    if reuse and Path(sets).exists() and Path(ranked).exists():
        return str(work / f"{split}-prompts.parquet"), sets, ranked
    y = cfg.to_yaml()
    prompts = str(work / f"{split}-prompts.parquet")
    write_artifact(prompts, "prompts", tasks.configured_prompts(cfg.data, split))
    lists = str(work / "no-lists.parquet")
    write_artifact(lists, "anchors", empty_table("anchors"))
    rollouts = str(work / f"{split}-rollouts.parquet")
    run_stage("rollout", y, "", 1, label=split, prompts=prompts, out_rollouts=rollouts, policy=cfg.models.policy,
              shard=0, num_shards=1, seed=seed)  # fmt: skip
    run_stage("candidates", y, "", 1, rollouts=rollouts, prompts=prompts, anchor_lists=lists, shard=0, num_shards=1,
              out_candidate_sets=sets, out_anchors=ranked)  # fmt: skip
    return prompts, sets, ranked


def audit(
    cfg: Config, work: Path, name: str, generator: str, sets: str, ranked: str, reuse: bool
) -> pd.DataFrame:
    """One row per held-out set: R_disc and the signal diagnostics of `generator`'s rubric for it."""
    y = cfg.to_yaml()
    folder = work / f"audit-{name}"
    rubrics, judgments = str(folder / "rubrics.parquet"), str(folder / "judgments.parquet")
    out = {k: str(folder / f"{k}.parquet") for k in ("scores", "rewards", "diagnostics", "metrics")}
    if not (reuse and Path(out["diagnostics"]).exists()):
        label = f"audit-{name}"
        run_stage("rubrics", y, "", 1, label=label, candidate_sets=sets, out_rubrics=rubrics, generator=generator,
                  samples=cfg.rubrics.samples, shard=0, seed=AUDIT_SEED)  # fmt: skip
        run_stage("judge", y, "", 1, label=label, candidate_sets=sets, rubrics=rubrics, out_judgments=judgments,
                  verifier=cfg.models.verifier, shard=0)  # fmt: skip
        run_stage("aggregate", y, "", 1, label=label, judgments=[judgments], candidate_sets=[sets], rubrics=[rubrics],
                  anchors=[ranked], **{f"out_{k}": v for k, v in out.items()})  # fmt: skip
    rubric_rows = read_frame(rubrics, "rubrics")
    rewards = read_frame(out["rewards"], "rewards")
    diag = read_frame(out["diagnostics"], "diagnostics")
    per_set = (
        rewards.merge(diag, on=["prompt_id", "rubric_idx"])
        .groupby("prompt_id")
        .agg(
            r_disc=("r_disc", "mean"),
            tie_rate=("tie_rate", "mean"),
            uniform=("uniform", "mean"),
            mean_gap=("mean_gap", "mean"),
            num_items=("num_items_x", "mean"),
        )
    )
    per_set = per_set.join(r_disc_parts(read_frame(judgments, "judgments")))
    per_set.attrs["counts"] = {
        "rubrics": len(rubric_rows),
        "truncated": int((rubric_rows["parse_status"] == "truncated").sum()),
        "empty": int((rubric_rows["parse_status"] == "empty").sum()),
        "parsed_json": int((rubric_rows["parse_status"] == "json").sum()),
    }
    return per_set


def r_disc_parts(judgments: pd.DataFrame) -> pd.DataFrame:
    """Per set: the item mean of v̄(1 − v̄) (soft), of Var_k(p_yes) (R_disc's term; unweighted here)
    and of mean_k p_yes(1 − p_yes)."""
    j = judgments[judgments["p_yes"].notna()].assign(p=lambda d: d["p_yes"].astype(float))
    j = j.assign(unsure=j["p"] * (1 - j["p"]))
    items = j.groupby(["prompt_id", "rubric_idx", "item_idx"]).agg(
        vbar=("p", "mean"), var=("p", lambda p: p.var(ddof=0)), uncertainty=("unsure", "mean")
    )
    items["soft_item_disc"] = items["vbar"] * (1 - items["vbar"])
    return (
        items.groupby("prompt_id")[["soft_item_disc", "var", "uncertainty"]]
        .mean()
        .rename(columns={"var": "discrimination"})
    )


def seeing_verifier(cfg: Config, work: Path) -> Config:
    """`cfg` with V the stand-in of bench/seeing_verifier.py: the verifier's reference becomes a folder of
    its own (the same model's files, hard-linked), which the hook tells from the generator's by its name,
    and the hook is set for this process and the training process it starts."""
    from bench import seeing_verifier as hook
    from dynamicrubric.engines import TEST_ENGINES_ENV
    from dynamicrubric.infra.models import resolve_model

    folder = work / hook.FOLDER_NAME
    if not folder.exists():
        shutil.copytree(resolve_model(cfg.models.verifier), folder, copy_function=os.link)
    os.environ[TEST_ENGINES_ENV] = hook.__file__
    return cfg.model_copy(
        update={"models": cfg.models.model_copy(update={"verifier": str(folder.resolve())})}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "study" / "evaluator_learns.yaml"))
    parser.add_argument("--out", default=str(HERE / "results" / "evaluator_learns.json"))
    parser.add_argument("--work", default=None)
    parser.add_argument("--reuse", action="store_true", help="keep what a run in --work already finished")
    parser.add_argument(
        "--seeing-verifier", action="store_true", help="V: the stand-in of bench/seeing_verifier.py"
    )
    args = parser.parse_args(argv)
    if args.seeing_verifier and args.out == parser.get_default("out"):
        args.out = str(HERE / "results" / "evaluator_learns_seeing.json")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    work = Path(args.work or tempfile.mkdtemp(prefix="evaluator-learns-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.seeing_verifier:
        cfg = seeing_verifier(cfg, work)
    timings_file = work / "timings.json"  # kept with the work, so a --reuse run reports the first run's
    timings: dict[str, float] = (
        json.loads(timings_file.read_text()) if args.reuse and timings_file.exists() else {}
    )

    def timed(name: str, started: float) -> None:
        timings.setdefault(name, time.perf_counter() - started)
        timings_file.write_text(json.dumps(timings))

    started = time.perf_counter()
    _, train_sets, train_ranked = candidate_sets(cfg, work, "train", seed=1, reuse=args.reuse)
    _, held_sets, held_ranked = candidate_sets(cfg, work, "eval", seed=2, reuse=args.reuse)
    timed("candidate_sets_s", started)

    started = time.perf_counter()
    before = audit(cfg, work, "g0", cfg.models.generator, held_sets, held_ranked, args.reuse)
    timed("audit_g0_s", started)

    started = time.perf_counter()
    result = launcher.launch(
        cfg,
        TrainingJob(
            "train-evaluator",
            candidates=[train_sets],
            anchors=[train_ranked],
            generator=cfg.models.generator,
            out_uri=str(work / "generator"),
            steps_uri=str(work / "steps"),
            metrics_uri=str(work / "metrics.parquet"),
            round_idx=1,
        ),
    )
    timed("train_s", started)

    started = time.perf_counter()
    after = audit(cfg, work, "g1", str(work / "generator"), held_sets, held_ranked, args.reuse)
    timed("audit_g1_s", started)

    after = after.reindex(before.index)
    # time/step_s comes with the result: the metrics artifact holds what a rerun reproduces
    metrics = pd.concat([read_frame(str(work / "metrics.parquet"), "metrics"), timing_frame(result)])
    curve = {
        name: group.sort_values("step")["value"].round(6).tolist()
        for name, group in metrics.groupby("name")
        if name in ("rewards/r_disc/mean", "rewards/r_anchor/mean", "reward_std", "kl", "rubrics/parse_rate",
                    "rubrics/truncated_rate", "rubrics/rejected_rate", "judge/yes_rate", "time/step_s")
    }  # fmt: skip
    t = cfg.train_evaluator
    result = {
        "what": "R_disc (soft verdicts: Var_k of p_yes) and the signal audit of G_0 vs G_1 on held-out candidate sets of P_0"
        + (
            " (V: bench/seeing_verifier.py's stand-in, which sees the response)"
            if args.seeing_verifier
            else ""
        ),
        "command": "python -m bench.evaluator_learns"
        + (" --seeing-verifier" if args.seeing_verifier else ""),
        "machine": f"{platform.machine()}, 2 cores (shared with other work)",
        "config": cfg.model_dump(mode="json"),
        "steps": t.max_steps,
        "sets_per_step": t.prompts_per_step,
        "rubric_samples_per_set": cfg.rubrics.train_samples,
        "training_sets": int(read_frame(train_sets, "rollouts")["prompt_id"].nunique()),
        "held_out_sets": len(before),
        "audit_rubric_samples_per_set": cfg.rubrics.samples,
        "parse": {name: frame.attrs["counts"] for name, frame in (("g0", before), ("g1", after))},
        "before": {c: bootstrap_mean(before[c].to_numpy()) for c in before.columns},
        "after": {c: bootstrap_mean(after[c].to_numpy()) for c in after.columns},
        "difference": {
            c: paired_difference(after[c].to_numpy(), before[c].to_numpy())
            for c in ("r_disc", "tie_rate", "uniform", "mean_gap", "discrimination", "uncertainty")
        },
        "curve": curve,
        # A --reuse run over a work folder made before timings.json existed has only its own (short) times.
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "reused_work": args.reuse,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=float) + "\n")
    d = result["difference"]["r_disc"]
    print(
        f"R_disc {result['before']['r_disc']['mean']:.4f} -> {result['after']['r_disc']['mean']:.4f}; "
        f"difference {d['mean']:+.4f} [95% CI {d['low']:+.4f}, {d['high']:+.4f}] over {d['n']} held-out sets"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
