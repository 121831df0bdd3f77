"""The CPU co-evolution study of docs/results.md: the whole pipeline, three evaluator variants.

    python -m bench.study pairs                      # the fixed held-out labelled pairs (committed)
    python -m bench.study run --variant dynamic      # one variant end to end (also static, pointwise)
    python -m bench.study report                     # the markdown tables of docs/results.md

`run` lays bench/study/study.yaml over the `local` preset, sets the variant, and runs:
  1. round 0: the evaluate stage on the untrained models (the starting point of every variant);
  2. the N-round pipeline under kfp.local, exactly as `dynrubric run` does, in a fresh pipeline root
     and a fresh SQLite MLflow store under --root;
and then reads every stage's metrics and wall time back from MLflow into
bench/results/study_<variant>.json (with the machine it ran on). Everything is seeded: a rerun
gives the same metrics; only the wall times change.

The labelled pairs (bench/study/pairs.jsonl) are the untrained policy's own answers to held-out
arithmetic prompts, a correct one as "chosen" and a wrong one as "rejected", judged by the task's
checker. They are fixed, so evaluator accuracy on them is comparable across rounds and variants.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench import RESULTS, machine_info
from dynamicrubric import tasks, tracking
from dynamicrubric.artifacts import write_artifact
from dynamicrubric.config import Config, load_config

HERE = Path(__file__).parent / "study"
PLOTS = Path(__file__).parent.parent / "docs" / "results"  # the last round's evaluate plots, per variant
STUDY_CONFIG = HERE / "study.yaml"
PAIRS = HERE / "pairs.jsonl"
VARIANTS: dict[str, dict] = {
    "dynamic": {},
    "static": {"rubrics": {"variant": "static"}},
    "pointwise": {"judge": {"variant": "pointwise"}},
}
PAIR_SOURCES = ["reasoning_gym:basic_arithmetic", "reasoning_gym:chain_sum"]
PAIR_PROMPTS = 24  # per source; prompts whose 8 samples are all right or all wrong give no pair
PAIR_SEED = 1  # a data seed the study's own prompts (data.seed 0) do not use

log = logging.getLogger("bench.study")


def study_config(variant: str, root: Path, preset: str | None = None) -> Config:
    """The study's config for one variant; its pipeline root and MLflow store live under `root`."""
    overrides = {
        **VARIANTS[variant],
        "evaluate": {"variants": [variant]},
        "data": {"labelled": [str(PAIRS.resolve())]},
        "pipeline": {
            "pipeline_root": str(root / "runs"),
            "mlflow_tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
        },
    }
    return load_config(STUDY_CONFIG, preset=preset, overrides=overrides)


# --------------------------------------------------------------------------------------------------
# pairs
# --------------------------------------------------------------------------------------------------


def make_pairs(out: Path) -> int:
    """Chosen/rejected pairs from the untrained policy's samples on held-out prompts; returns the count."""
    from dynamicrubric.engines import load_engine
    from dynamicrubric.rollout import sample_rollouts

    cfg = load_config(STUDY_CONFIG)
    prompts = tasks.load_prompts(PAIR_SOURCES, PAIR_PROMPTS, "eval", seed=PAIR_SEED)
    # Keep the pairs apart from the prompts the evaluate stage samples the policy on.
    study_eval = tasks.configured_prompts(cfg.data, "eval")
    prompts = prompts[~prompts["prompt"].isin(set(study_eval["prompt"]))]
    engine = load_engine(cfg.models.policy, cfg.engine)
    rollouts = sample_rollouts(engine, prompts, cfg, seed=PAIR_SEED, policy=cfg.models.policy)
    by_id = {row["prompt_id"]: row for row in prompts.to_dict("records")}
    records = []
    for prompt_id, group in rollouts.groupby("prompt_id", sort=False):
        row = by_id[prompt_id]
        scored = [(tasks.score_response(row, r), r) for r in group.sort_values("sample_idx")["response"]]
        right = [r for s, r in scored if s == 1.0]
        wrong = [r for s, r in scored if s == 0.0 and r.strip()]
        if right and wrong:
            records.append(
                {"id": prompt_id, "prompt": row["prompt"], "chosen": right[0], "rejected": wrong[0]}
            )
    out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    return len(records)


# --------------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------------


def run_variant(variant: str, root: Path, plots: Path, preset: str | None = None) -> dict[str, Any]:
    from dynamicrubric.evaluate import run_evaluate
    from dynamicrubric.launch import run_local

    root = root.resolve() / variant
    if root.exists():  # a fresh store: kfp.local's cache and old MLflow runs would skew the numbers
        shutil.rmtree(root)
    root.mkdir(parents=True)
    cfg = study_config(variant, root, preset)
    machine = machine_info()

    log.info("study %s: round 0, the untrained models", variant)
    start = time.perf_counter()
    d = cfg.data
    held_out = tasks.configured_prompts(d, "eval")
    eval_prompts = str(root / "round0" / "eval_prompts.parquet")
    write_artifact(eval_prompts, "prompts", held_out)
    round0 = run_evaluate(
        eval_prompts,
        str(root / "round0" / "metrics.parquet"),
        str(root / "round0" / "plots"),
        cfg,
        labelled_uris=d.labelled,
        round_idx=0,
    )
    round0_s = time.perf_counter() - start

    log.info("study %s: the %d-round pipeline under kfp.local", variant, cfg.pipeline.rounds)
    start = time.perf_counter()
    parent = run_local(cfg).parent_run_id
    pipeline_s = time.perf_counter() - start

    stages = stage_runs(cfg, parent)
    copy_plots(root, cfg.pipeline.rounds, plots)
    return {
        "variant": variant,
        "command": f"python -m bench.study run --variant {variant}"
        + (f" --preset {preset}" if preset else ""),
        "config": cfg.model_dump(mode="json"),
        "machine": machine,
        "prompts": {
            "train": d.num_prompts * len(d.sources),
            "held_out": len(held_out),
            "labelled_pairs": sum(1 for _ in PAIRS.open()),
        },
        "round0": {"metrics": round0, "wall_s": round0_s},
        "pipeline_wall_s": pipeline_s,
        "stages": stages,
    }


def copy_plots(root: Path, rounds: int, dest: Path) -> list[Path]:
    """The last round's evaluate-stage plots, copied to `dest` (docs/results/<variant>/ for the report)."""
    task = "evaluate" if rounds == 1 else f"evaluate-{rounds}"  # KFP suffixes repeated task names
    found = sorted((root / "runs").glob(f"*/{task}/plots/*.png"))
    dest.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(png, dest / png.name)) for png in found]


def stage_runs(cfg: Config, parent_run_id: str) -> list[dict[str, Any]]:
    """Every stage run of the pipeline run: round, stage (shard suffix dropped), seconds, metrics."""
    rows = []
    for run in (r for runs in tracking.stage_runs_by_round(cfg, parent_run_id).values() for r in runs):
        tags = run.data.tags
        rows.append(
            {
                "round": int(tags[tracking.ROUND_TAG]),
                "stage": re.sub(r"-\d+$", "", tags[tracking.STAGE_TAG]),
                "task": tags[tracking.STAGE_TAG],
                "seconds": run.data.metrics.pop("stage_wall_s"),
                "metrics": dict(sorted(run.data.metrics.items())),
            }
        )
    return sorted(rows, key=lambda r: (r["round"], r["task"]))


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------


SHARD_COUNTS = ("rubrics", "empty_rubrics", "judgments", "yes")


def round_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per round: the policy's signal under this round's evaluator, and the evaluate stage."""
    variant = result["variant"]
    by_round: dict[int, dict[str, dict]] = {}
    for s in result["stages"]:
        merged = by_round.setdefault(s["round"], {}).setdefault(s["stage"], {})
        metrics = dict(s["metrics"])
        if "yes_rate" in metrics:  # a judge shard's rate: add up the yes verdicts instead
            metrics["yes"] = metrics.pop("yes_rate") * metrics["judgments"]
        for k, v in metrics.items():  # shard counts add up; the rest are per-stage already
            merged[k] = merged.get(k, 0.0) + v if k in SHARD_COUNTS else v
    rows = [_round_row(0, {"evaluate": result["round0"]["metrics"]}, variant)]
    rows += [_round_row(t, by_round[t], variant) for t in sorted(by_round) if t > 0]
    return rows


def _round_row(t: int, stages: dict[str, dict], variant: str) -> dict[str, Any]:
    agg = stages.get("policy-aggregate", {})
    ev = stages.get("evaluate", {})
    rub = stages.get("policy-rubrics", {})
    judge = stages.get("policy-judge", {})
    return {
        "round": t,
        "Δgap": agg.get("mean_gap"),
        "tie rate": agg.get("tie_rate"),
        "uniform": agg.get("uniformity_rate"),
        "rubrics parsed": (1 - rub["empty_rubrics"] / rub["rubrics"]) if rub.get("rubrics") else None,
        "yes rate": judge["yes"] / judge["judgments"] if judge.get("judgments") else None,
        "eval acc (pairs)": ev.get(f"{variant}/pairwise_accuracy_labelled"),
        "eval acc (outcomes)": ev.get(f"{variant}/pairwise_accuracy_outcomes"),
        "policy acc": ev.get("policy/accuracy"),
        "arith avg@4": _mean(ev.get("policy/basic_arithmetic/avg_at_4"), ev.get("policy/chain_sum/avg_at_4")),
        "HumanEval pass@1": ev.get("policy/humaneval/pass_at_1"),
        "win rate vs prev": ev.get("policy/win_rate"),
    }


def _mean(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


STAGE_ORDER = [
    "prepare-data",
    "generator-rollout",
    "generator-candidates",
    "generator-rubrics",
    "generator-judge",
    "generator-aggregate",
    "train-evaluator",
    "policy-rollout",
    "policy-rubrics",
    "policy-judge",
    "policy-aggregate",
    "train-policy",
    "evaluate",
]


def stage_seconds(result: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Seconds per stage and round, summed over shards (two shards run at once on 2 cores), in
    pipeline order; round 0 holds data preparation and the evaluation of the untrained models."""
    table: dict[str, dict[int, float]] = {}
    for s in result["stages"]:
        row = table.setdefault(s["stage"], {})
        row[s["round"]] = row.get(s["round"], 0.0) + s["seconds"]
    table.setdefault("evaluate", {})[0] = result["round0"]["wall_s"]
    return {stage: table[stage] for stage in sorted(table, key=_stage_position)}


def _stage_position(stage: str) -> int:
    stage = stage.replace("_", "-")  # runs before the CLI's spelling became the run names' (train_policy)
    return STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER)


def summary_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: where it started (round 0), where it ended (last round), and its time."""
    rows = []
    for result in results:
        table = round_rows(result)
        first, last = table[0], table[-1]
        gaps = " → ".join(_cell(r["Δgap"]) for r in table[1:])
        ties = " → ".join(_cell(r["tie rate"]) for r in table[1:])
        rows.append(
            {
                "variant": result["variant"],
                "Δgap by round": gaps,
                "tie rate by round": ties,
                "eval acc (pairs) r0 → last": f"{_cell(first['eval acc (pairs)'])} → {_cell(last['eval acc (pairs)'])}",
                "policy acc r0 → last": f"{_cell(first['policy acc'])} → {_cell(last['policy acc'])}",
                "minutes (pipeline + r0 eval)": f"{result['pipeline_wall_s'] / 60:.1f} + {result['round0']['wall_s'] / 60:.1f}",
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    headers = list(rows[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r[h]) for h in headers) + " |")
    return "\n".join(lines)


def _seconds(v: float | None) -> str | None:
    return None if v is None else f"{v:.1f}"


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def report(results: list[dict[str, Any]]) -> str:
    out = []
    if len(results) > 1:
        out.append("### All variants\n")
        out.append(markdown(summary_rows(results)) + "\n")
    for result in results:
        m = result["machine"]
        p = result["prompts"]
        out.append(f"### {result['variant']}\n")
        out.append(
            f"`{result['command']}` — {p['train']} training prompts and {p['held_out']} held-out prompts "
            f"per round, K={result['config']['rollout']['k']}, {result['config']['pipeline']['rounds']} rounds, "
            f"seed {result['config']['seed']}, {p['labelled_pairs']} labelled pairs. {m['cpu']}, {m['cores']} "
            f"cores, torch {m['torch']}. Pipeline {result['pipeline_wall_s'] / 60:.1f} min + round-0 "
            f"evaluation {result['round0']['wall_s'] / 60:.1f} min.\n"
        )
        out.append(markdown(round_rows(result)) + "\n")
        seconds = stage_seconds(result)
        rounds = sorted({t for row in seconds.values() for t in row})
        rows = [
            {"stage": stage, **{f"round {t} (s)": _seconds(row.get(t)) for t in rounds}}
            for stage, row in seconds.items()
        ]
        total = {t: sum(row.get(t, 0.0) for row in seconds.values()) for t in rounds}
        rows.append(
            {"stage": "sum (tasks overlap)", **{f"round {t} (s)": _seconds(total[t]) for t in rounds}}
        )
        out.append(markdown(rows) + "\n")
    return "\n".join(out)


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Every metric that differs between two results of one variant; speeds (tokens_per_s) are wall
    times too and are left out."""

    def numbers(result: dict[str, Any]) -> dict[str, float]:
        out = {f"round0/{k}": v for k, v in result["round0"]["metrics"].items()}
        for s in result["stages"]:
            out.update({f"round{s['round']}/{s['task']}/{k}": v for k, v in s["metrics"].items()})
        return out

    x, y = numbers(a), numbers(b)
    keys = sorted(k for k in x.keys() | y.keys() if not k.endswith("tokens_per_s"))
    return [f"{k}: {x.get(k)} != {y.get(k)}" for k in keys if x.get(k) != y.get(k)]


def plot_differences(a: Path, b: Path) -> list[str]:
    """Every plot that is not byte for byte the same in folders a and b (a seeded rerun draws the same)."""
    names = sorted({p.name for p in a.glob("*.png")} | {p.name for p in b.glob("*.png")})
    return [
        f"plot {name}: {a / name} != {b / name}"
        for name in names
        if not (
            (a / name).exists() and (b / name).exists() and (a / name).read_bytes() == (b / name).read_bytes()
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.study", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pairs", help="write bench/study/pairs.jsonl")
    run = sub.add_parser("run", help="one variant end to end")
    run.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    run.add_argument("--preset", default=None, help="lay the study over this preset (tiny: a smoke run)")
    run.add_argument("--root", type=Path, default=Path("runs/study"), help="pipeline roots and MLflow stores")
    run.add_argument(
        "--out", type=Path, default=None, help="result JSON (default bench/results/study_<variant>.json)"
    )
    run.add_argument(
        "--check",
        action="store_true",
        help="compare with the committed bench/results/study_<variant>.json instead of replacing it",
    )
    rep = sub.add_parser("report", help="markdown tables from the result JSONs")
    rep.add_argument("results", nargs="*", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    if args.command == "pairs":
        print(f"{make_pairs(PAIRS)} pairs -> {PAIRS}")
    elif args.command == "run":
        committed = RESULTS / f"study_{args.variant}.json"
        if args.check and not committed.exists():
            parser.error(f"--check: {committed} does not exist")
        # A check (or an --out run) leaves the committed result and plots alone: it writes its own
        # beside its runs (or the --out file).
        path = args.out or (args.root if args.check else RESULTS) / committed.name
        committed_plots = PLOTS / args.variant
        plots = (
            committed_plots if path.resolve() == committed.resolve() else path.parent / f"{path.stem}_plots"
        )
        result = run_variant(args.variant, args.root, plots, args.preset)
        _write(path, result)
        print(report([result]))
        print(f"-> {path}, plots in {plots}")
        if args.check:
            diff = differences(json.loads(committed.read_text()), result)
            diff += plot_differences(committed_plots, plots)
            print(f"{len(diff)} difference(s) from {committed}" + "".join(f"\n  {d}" for d in diff[:20]))
            return 1 if diff else 0
    else:
        paths = args.results or [RESULTS / f"study_{v}.json" for v in VARIANTS]
        print(report([json.loads(p.read_text()) for p in paths if p.exists()]))
    return 0


def _write(path: Path, result: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
