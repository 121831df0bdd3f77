"""Sandbox overhead per run: what each code check costs before the code itself does any work, now and
before the cross-run isolation (issue #25: a user namespace, keyring, seccomp filter and memory cgroup
per run).

Times (wall clock, median of --reps) of an empty `run_python`, a `check_humaneval` of HumanEval/0's
canonical solution, and `check_humaneval_many` of K copies of it (per completion), for the current
sandbox and for the sandbox of commit --before (its three files taken from git into a package of their
own), measured alternately in this one process so that both see the same load. The headline is the
ratio current / before of each measure.

    python -m bench.bench_sandbox [--reps 10] [--k 8] [--before 5d66874]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from bench import machine_info, print_table, write_result
from dynamicrubric import tasks
from dynamicrubric.infra import sandbox

SANDBOX_FILES = ("sandbox.py", "_sandbox_launcher.py", "_sandbox_child.py")
# main when issue #25 was filed: the sandbox without the per-run isolation
BEFORE = "5d66874"


def sandbox_at(commit: str, folder: Path) -> ModuleType:
    """The sandbox module of `commit`, imported as `sandbox_before.sandbox` from `folder`."""
    package = folder / "sandbox_before"
    package.mkdir()
    (package / "__init__.py").write_text("")
    root = Path(__file__).resolve().parents[1]
    for name in SANDBOX_FILES:
        source = subprocess.run(
            ["git", "show", f"{commit}:src/dynamicrubric/{name}"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        # its one import of the package: the launcher's constants
        source = source.replace(
            "from dynamicrubric._sandbox_launcher", "from sandbox_before._sandbox_launcher"
        )
        (package / name).write_text(source)
    sys.path.insert(0, str(folder))
    return importlib.import_module("sandbox_before.sandbox")


def timed(fn: Callable[[], list], per: int) -> float:
    start = time.perf_counter()
    results = fn()
    elapsed = (time.perf_counter() - start) / per
    assert all(r.passed for r in results), [r.stderr[-300:] for r in results]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--k", type=int, default=8, help="completions per batch (a policy's samples)")
    parser.add_argument("--before", default=BEFORE, help="the commit whose sandbox is the baseline")
    args = parser.parse_args()
    info = machine_info()
    problem = tasks.humaneval_problems()["HumanEval/0"]
    solution = problem["canonical_solution"]
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"now": sandbox, "before": sandbox_at(args.before, Path(tmp))}
        isolation = {v: m.run_python("pass", timeout_s=10).isolation for v, m in versions.items()}  # warm-up
        measures: dict[str, tuple[Callable[[ModuleType], Callable[[], list]], int]] = {
            "run_python('pass') ms": (lambda m: lambda: [m.run_python("pass", timeout_s=10)], 1),
            "check_humaneval ms": (lambda m: lambda: [m.check_humaneval(problem, solution)], 1),
            f"check_humaneval_many K={args.k}, ms per completion": (
                lambda m: lambda: m.check_humaneval_many(problem, [solution] * args.k),
                args.k,
            ),
        }
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.reps):  # alternate, so that a change of load hits both alike
            for name, (make, per) in measures.items():
                for version, module in versions.items():
                    times.setdefault((name, version), []).append(timed(make(module), per))
    median = {key: 1000 * statistics.median(values) for key, values in times.items()}
    rows: list[tuple[str, object]] = [(f"isolation {v}", isolation[v]) for v in versions]
    for name in measures:
        rows += [(f"{name} {v}", median[(name, v)]) for v in versions]
        rows.append((f"{name} now/before", median[(name, "now")] / median[(name, "before")]))
    print_table(rows)
    result = {"machine": info, "reps": args.reps, "k": args.k, "before": args.before, **dict(rows)}
    print(f"wrote {write_result('bench_sandbox', result)}")


if __name__ == "__main__":
    main()
