"""The run report page: one self-contained HTML file per pipeline run, read from MLflow.

It is written at the end of `dynrubric run` and by `dynrubric report RUN_ID` (a cluster run), and
logged as the parent run's artifact `report.html`. Nothing in it reaches the network: no script,
font or style from outside, the charts are inline SVG, the sample browser is <details> elements,
and a Content-Security-Policy forbids every request, so a page opened anywhere shows only what it
holds. Reading order, top to bottom: did each round give the policy a signal (the table and the
signal curves), how good are the evaluator and the policy, what did the judge's calls do, and, per
judged candidate set, why one response beat another (the same sets as the evaluate stage's traces).

What the page shows is read from MLflow in run_page_data.py and each section rendered in
run_page_sections.py; this module puts them together and writes the page.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from dynamicrubric.infra import tracking
from dynamicrubric.infra.config import Config
from dynamicrubric.localrun.run_page_benchmarks import section as benchmark_section
from dynamicrubric.localrun.run_page_data import collect
from dynamicrubric.localrun.run_page_sections import (
    escaped,
    guard_section,
    ledger_section,
    samples_section,
    signals_section,
    table_section,
)

log = logging.getLogger(__name__)

PAGE_NAME = "report.html"  # the parent run's artifact


CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; padding: 0 16px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; } td, th { border: 1px solid #ddd; padding: 4px 8px; }
th { background: #f4f4f4; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.legend { color: #555; } .muted { color: #777; } .charts { display: flex; flex-wrap: wrap; gap: 16px; }
details { margin: 4px 0 4px 12px; } summary { cursor: pointer; }
pre { white-space: pre-wrap; background: #f8f8f8; padding: 6px; margin: 4px 0; max-height: 240px; overflow: auto; }
.failed { color: #b00; font-weight: bold; } .best { background: #eef8ee; }
"""


def render(data: dict) -> str:
    """The page's HTML (see the module's docstring)."""
    took = (
        f"{(data['end_ms'] - data['start_ms']) / 60000:.1f} min"
        if data["end_ms"] and data["start_ms"]
        else "still running"
    )
    started = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["start_ms"] / 1000))
        if data["start_ms"]
        else "?"
    )
    models = ", ".join(f"{k} {escaped(v)}" for k, v in data["models"].items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<title>dynrubric run {escaped(data["run_name"])}</title><style>{STYLE}</style></head>
<body>
<h1>Run {escaped(data["run_name"])}</h1>
<p>Preset {escaped(data["preset"])}, variant {escaped(data["variant"])}, {len(data["rounds"])} round(s); started {started},
took {took}. Models: {models}.<br>MLflow: experiment {escaped(data["experiment"])}, parent run
<code>{escaped(data["run_id"])}</code> at <code>{escaped(data["tracking_uri"])}</code>.</p>
<h2>1. Did each round give the policy a signal?</h2>
<p>A round gives the policy something to learn from when the rubric's scores separate its responses: a
positive mean gap, few ties and few uniform sets. Each row is one round's signal audit and evaluation.</p>
{table_section(data)}
<h2>2. Signal curves over rounds</h2>
{signals_section(data)}
<h2>3. Can the round's evaluator still be trusted?</h2>
<p>The signal guard checks every round's evaluator on the held-out probe: does its score of the new policy
rise while the gold (the task's checker) falls, does it still order responses as the gold does, can short
tricks (canaries: filler, a "master key", formatting, an empty or restated answer) score as well as the
answer they decorate, and do its scores move when it sees the responses in another order. Intervals are
95% bootstraps over the probe prompts.</p>
{guard_section(data)}
<h2>4. Open-ended benchmarks</h2>
<p>The policy on the paper's open-ended benchmarks: each round's P_t against the benchmark's baseline
answers, and against P_0, by the benchmark judge (section numbers with their 95% bootstrap interval and
n).</p>
{benchmark_section(data["benchmarks"])}
<h2>5. Judge calls</h2>
{ledger_section(data)}
<h2>6. Judged samples</h2>
<p>Per round, the candidate sets the evaluate stage judged (the same sets as its MLflow traces): the
prompt, G's rubric items with their weights, each response with V's P(yes) per item, its score and its
gold (rank in its labelled list, 1 = best; the checker's score). A failed verdict shows as
<span class="failed">failed</span>, never as 0.</p>
<div id="samples">{samples_section(data)}</div>
</body></html>
"""


def write_page(cfg: Config, parent_run_id: str, out: str | Path, *, log_to_mlflow: bool = True) -> Path:
    """Write the page of pipeline run `parent_run_id` to `out` and log it as the parent run's
    artifact PAGE_NAME; return its path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(collect(cfg, parent_run_id)), encoding="utf-8")
    if log_to_mlflow:
        client = tracking.mlflow_client(cfg)
        if path.name == PAGE_NAME:
            client.log_artifact(parent_run_id, str(path))
        else:
            with tempfile.TemporaryDirectory(prefix="dynrubric-page-") as tmp:
                copy = Path(tmp, PAGE_NAME)
                copy.write_bytes(path.read_bytes())
                client.log_artifact(parent_run_id, str(copy))
    return path
