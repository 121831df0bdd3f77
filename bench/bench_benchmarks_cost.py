"""What the open-ended benchmarks (#44) cost the default run, and how long the default run takes.

Run from the repository root: `python -m bench.bench_benchmarks_cost`. Like bench_guard_cost, it clones
this repository's HEAD (commit first), runs `make setup` there, builds SmolLM2 once, then runs the
pipeline as `make demo` does twice under GNU time, one after the other on the same machine:

- `with_benchmarks`: the defaults (the `local` preset: 2 prompts of AlpacaEval 2, Arena-Hard v2.0 and
  WritingBench every round, judged by V);
- `without`: the same with `evaluate.benchmarks: []`.

It writes `bench/results/benchmarks_cost.json`: both runs' wall time (the first is the default run's time,
SmolLM2 already built), peak RSS and per-stage task times, and the benchmarks' cost as the ratio of the
walls (goal: at most 1.15) and of the evaluate tasks' times.
"""

from __future__ import annotations

import argparse
import json

from bench import write_result
from bench.bench_guard_cost import ROOT, compare

GOALS = {"wall_ratio_max": 1.15, "default_run_wall_s_max": 12 * 60}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=str(ROOT), help="the repository to clone (its HEAD)")
    args = parser.parse_args(argv)
    result, runs, _, _ = compare(
        args.repo, "bench-benchmarks-", "evaluate: {benchmarks: []}\n", on="with_benchmarks", off="without"
    )
    result["goals"] = GOALS
    walls = {name: r["pipeline"]["wall_s"] for name, r in runs.items()}
    evaluate = {name: result[name]["stages"]["evaluate"]["wall_s"] for name in runs}
    result["benchmarks"] = {
        "default_run_wall_s": walls["with_benchmarks"],
        "wall_ratio": round(walls["with_benchmarks"] / walls["without"], 3),
        "evaluate_s": evaluate,
        "evaluate_ratio": round(evaluate["with_benchmarks"] / evaluate["without"], 3),
        "peak_rss_gb": {name: r["pipeline"]["peak_rss_gb"] for name, r in runs.items()},
    }
    write_result("benchmarks_cost", result)
    print(json.dumps({"walls": walls, "benchmarks": result["benchmarks"]}, indent=1))
    return result


if __name__ == "__main__":
    main()
