"""Per-stage overhead of a pipeline task (process start, imports, model load) vs its compute.

Every KFP task is a fresh process: it starts Python, imports the project (and torch, transformers,
MLflow), loads its model, then computes. This measures each part for the stages that hold a model,
at a preset's sizes, so the overhead can be read as a ratio to the compute it wraps:

- process start + imports: `python -c "import ..."` in a subprocess, median of `--repeats`;
- model load: `load_engine` in this process;
- compute: the stage function on preloaded engines, in this process.

Run: `python -m bench.bench_pipeline [--preset tiny|local]`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import machine_info, print_table, write_result

IMPORTS = {
    "python": "pass",
    "kfp executor": "import kfp.dsl.executor_main",
    "project (stage runner)": "import dynamicrubric.stages.runner",
    "torch + transformers": "import torch, transformers; from transformers import AutoModelForCausalLM",
    "mlflow": "import mlflow",
}


def _subprocess_seconds(code: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "local"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from dynamicrubric.engines import load_engine
    from dynamicrubric.infra.artifacts import write_artifact
    from dynamicrubric.infra.config_loading import load_config
    from dynamicrubric.scoring.judge import run_judge
    from dynamicrubric.scoring.rollout import run_rollout
    from dynamicrubric.scoring.rubrics import run_rubrics
    from dynamicrubric.tasks import load_prompts

    cfg = load_config(preset=args.preset)
    imports = {name: _subprocess_seconds(code, args.repeats) for name, code in IMPORTS.items()}
    # A model stage pays all of these; the process start is inside every figure.
    task_imports = _subprocess_seconds(
        "import kfp.dsl.executor_main, dynamicrubric.stages.runner, dynamicrubric.engines, mlflow, transformers;"
        "from transformers import AutoModelForCausalLM",
        args.repeats,
    )

    start = time.perf_counter()
    engine = load_engine(cfg.models.policy, cfg.engine)
    model_load = time.perf_counter() - start

    compute = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts, rollouts = f"{tmp}/prompts.parquet", f"{tmp}/rollouts.parquet"
        rubrics, judgments = f"{tmp}/rubrics.parquet", f"{tmp}/judgments.parquet"
        write_artifact(prompts, "prompts", load_prompts(cfg.data.sources, cfg.data.num_prompts, "train", 0))
        stages = [
            ("rollout", lambda: run_rollout(prompts, rollouts, cfg, engine=engine)),
            ("rubrics", lambda: run_rubrics(rollouts, rubrics, cfg, engine=engine)),
            ("judge (pointwise)", lambda: run_judge(rollouts, judgments, cfg, engine=engine)),
        ]
        for name, run in stages:
            start = time.perf_counter()
            run()
            compute[name] = time.perf_counter() - start
        assert Path(judgments).exists()

    overhead = task_imports + model_load
    rows = [(f"import: {k} (s)", v) for k, v in imports.items()]
    rows += [("task imports, all (s)", task_imports), (f"model load {cfg.models.policy} (s)", model_load)]
    rows += [(f"compute: {k} (s)", v) for k, v in compute.items()]
    rows += [(f"overhead / compute: {k}", overhead / v) for k, v in compute.items()]
    print(f"preset {args.preset}: per-task overhead vs compute (one shard of {cfg.data.num_prompts} prompts)")
    print_table(rows)
    result = {
        "preset": args.preset,
        "machine": machine_info(),
        "imports_s": imports,
        "task_imports_s": task_imports,
        "model_load_s": model_load,
        "compute_s": compute,
        "overhead_over_compute": {k: overhead / v for k, v in compute.items()},
    }
    print(f"wrote {write_result(f'pipeline_{args.preset}', result)}")
    return result


if __name__ == "__main__":
    main()
