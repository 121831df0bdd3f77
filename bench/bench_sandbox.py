"""Sandbox overhead per run: what each code check costs before the code itself does any work.

Times (wall clock, median of --reps) of an empty `run_python`, a `check_humaneval` of HumanEval/0's
canonical solution, and `check_humaneval_many` of K copies of it (per completion). The headline is
the batch's speed-up per completion over single checks, measured in the same process.

    python -m bench.bench_sandbox [--reps 10] [--k 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from bench import machine_info, print_table, write_result
from dynamicrubric import sandbox, tasks


def median_ms(fn: Callable[[], list[sandbox.SandboxResult]], reps: int, per: int = 1) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        results = fn()
        times.append((time.perf_counter() - start) / per)
        assert all(r.passed for r in results), [r.stderr[-300:] for r in results]
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--k", type=int, default=8, help="completions per batch (a policy's samples)")
    args = parser.parse_args()
    info = machine_info()
    problem = tasks.humaneval_problems()["HumanEval/0"]
    solution = problem["canonical_solution"]
    isolation = sandbox.run_python("pass", timeout_s=10).isolation  # also warms the page cache
    run_ms = median_ms(lambda: [sandbox.run_python("pass", timeout_s=10)], args.reps)
    check_ms = median_ms(lambda: [sandbox.check_humaneval(problem, solution)], args.reps)
    batch_ms = median_ms(
        lambda: sandbox.check_humaneval_many(problem, [solution] * args.k), max(1, args.reps // 2), args.k
    )
    rows = [
        ("isolation", isolation),
        ("run_python('pass') ms", run_ms),
        ("check_humaneval ms", check_ms),
        (f"check_humaneval_many K={args.k}, ms per completion", batch_ms),
        ("batch speed-up per completion", check_ms / batch_ms),
    ]
    print_table(rows)
    path = write_result("bench_sandbox", {"machine": info, "reps": args.reps, "k": args.k, **dict(rows)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
