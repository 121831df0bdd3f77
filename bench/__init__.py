"""Benchmarks: plain scripts run as `python -m bench.NAME`; each prints a table and writes
bench/results/NAME.json together with the machine it ran on."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """CPU model, cores, threads, accelerator and library versions: numbers mean little without them."""
    import torch
    import transformers

    cpu = cpu_model()
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # Other processes compete for the same cores on shared machines: the load says how much.
        "load_avg_1m_at_start": os.getloadavg()[0],
    }
    return info


def write_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def one_line(e: BaseException) -> str:
    """An exception as a GPU step's problem: its type and the first line of its message."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def write_verdict(name: str, out: Path, result: dict[str, Any], problems: list[str]) -> bool:
    """A GPU step's end: its verdict into `result`, `result` as JSON at `out` (what was measured stays, a
    failure too), and on problems the step's one FAIL line. True when there were none."""
    result["ok"], result["problems"] = not problems, problems
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if problems:
        print(f"{name}: FAIL: {'; '.join(problems)} (see {out})")
    return not problems


def print_table(rows: list[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
