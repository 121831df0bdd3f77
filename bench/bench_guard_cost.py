"""What the signal guard (#37) and the judged-set traces and run page (#38) cost the default run.

Run from the repository root: `python -m bench.bench_guard_cost`. It clones this repository's HEAD
(commit first) into a temporary folder, runs `make setup` there, builds SmolLM2 once into a shared
model cache, then runs the pipeline as `make demo` does (`.venv/bin/dynrubric run`, the embedded
`local` preset) twice under GNU time, one after the other on the same machine:

- `guarded`: the defaults (the guard measures every round; evaluate and the trainers trace sets);
- `baseline`: the same with `guard.enabled: false` (evaluate samples the previous policy once, for the
  win rate, and scores no canary, order or reference sets), traces still on.

It writes `bench/results/guard_cost.json`: both runs' wall time, peak RSS and per-stage task times,
the guard's cost as the ratio of the two walls (and of the evaluate tasks' times), and, from the
guarded run, the traces' cost (the `tracing_s` every stage run logs: reading and logging its sets) and
the run page's (writing report.html again from MLflow, timed here) as shares of its wall.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from bench import cpu_model, write_result
from bench.bench_demo import by_stage, run_pipeline

ROOT = Path(__file__).resolve().parent.parent
GOALS = {"guard_share_max": 0.15, "traces_and_page_share_max": 0.05}


def parent_run(out: Path) -> str:
    """The MLflow parent run a `dynrubric run` printed."""
    found = re.search(r"MLflow parent run (\w+)", (out / "stdout.txt").read_text())
    if not found:
        raise SystemExit(f"{out / 'stdout.txt'} names no MLflow parent run")
    return found.group(1)


def tracing_seconds(db: Path, parent: str) -> dict[str, float]:
    """Each stage run's `tracing_s` under the parent run (round run, stage run), by "r<round> <stage>"."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_run(parent).info.experiment_id

    def children(run_id: str) -> list:
        return client.search_runs(
            [experiment], filter_string=f"tags.mlflow.parentRunId = '{run_id}'", max_results=5000
        )

    runs = [r for top in children(parent) for r in (top, *children(top.info.run_id))]
    return {
        f"r{r.data.tags.get('dynrubric.round')} {r.info.run_name}": round(r.data.metrics["tracing_s"], 2)
        for r in runs
        if "tracing_s" in r.data.metrics
    }


def page_seconds(clone: Path, parent: str, out: Path) -> float:
    """Write the guarded run's page again from MLflow (`dynrubric report`), timed."""
    started = time.perf_counter()
    subprocess.run(
        [
            ".venv/bin/dynrubric",
            "report",
            parent,
            "--tracking-uri",
            f"sqlite:///{clone / 'mlflow.db'}",
            "--out",
            str(out),
        ],
        cwd=clone,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - started


def compare(repo: str, prefix: str, off_config: str, on: str, off: str) -> tuple[dict, dict, Path, Path]:
    """The default run twice in a fresh clone of `repo`'s HEAD, SmolLM2 built first: `on` (the defaults)
    and `off` (with `off_config`, YAML, laid over them). Returns (the result so far, the two runs, the
    work folder, the clone)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    clone = work / "dynamicrubric"
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True)
    subprocess.run(["git", "clone", "--quiet", repo, str(clone)], check=True)
    subprocess.run(["make", "setup"], cwd=clone, check=True, stdout=subprocess.DEVNULL)
    cache = work / "model-cache"
    env = {**os.environ, "DYNRUBRIC_CACHE": str(cache)}
    subprocess.run(
        [".venv/bin/dynrubric", "model", "prepare", "smollm2-135m-instruct"], cwd=clone, env=env, check=True
    )
    off_file = work / "off.yaml"
    off_file.write_text(off_config)
    result: dict = {
        "commit": head.stdout.strip(),
        "machine": {
            "cpu": cpu_model(),
            "cores": len(os.sched_getaffinity(0)),
            "load_avg_1m_before": round(os.getloadavg()[0], 2),
        },
        "off_config": off_config,
    }
    runs = {}
    for name, extra in ((on, ["--fresh"]), (off, ["--fresh", "--config", str(off_file)])):
        runs[name] = run_pipeline(clone, work / name, cache, *extra)
        result[name] = {
            "pipeline": runs[name]["pipeline"],
            "load": runs[name]["load"],
            "table": runs[name]["table"],
            "stages": by_stage(runs[name]["tasks"]),
        }
    return result, runs, work, clone


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=str(ROOT), help="the repository to clone (its HEAD)")
    args = parser.parse_args(argv)
    result, runs, work, clone = compare(
        args.repo, "bench-guard-", "guard: {enabled: false}\n", on="guarded", off="baseline"
    )
    result["goals"] = GOALS
    walls = {name: r["pipeline"]["wall_s"] for name, r in runs.items()}
    evaluate = {name: result[name]["stages"]["evaluate"]["wall_s"] for name in runs}
    parent = parent_run(work / "guarded")
    traces = tracing_seconds(clone / "mlflow.db", parent)
    page = page_seconds(clone, parent, work / "guarded" / "report.html")
    result["guard"] = {
        "wall_ratio": round(walls["guarded"] / walls["baseline"], 3),
        "share_of_guarded_wall": round((walls["guarded"] - walls["baseline"]) / walls["guarded"], 3),
        "evaluate_s": evaluate,
        "evaluate_ratio": round(evaluate["guarded"] / evaluate["baseline"], 3),
        "peak_rss_gb": {name: r["pipeline"]["peak_rss_gb"] for name, r in runs.items()},
    }
    spent = sum(traces.values()) + page
    result["traces_and_page"] = {
        "tracing_s_by_stage_run": traces,
        "page_s": round(page, 2),
        "share_of_guarded_wall": round(spent / walls["guarded"], 4),
    }
    write_result("guard_cost", result)
    print(
        json.dumps(
            {"walls": walls, "guard": result["guard"], "traces_and_page": result["traces_and_page"]}, indent=1
        )
    )
    return result


if __name__ == "__main__":
    main()
