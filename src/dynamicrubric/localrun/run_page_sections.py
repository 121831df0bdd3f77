"""The sections of the run report page, each rendered to HTML from `collect`'s data (run_page_data.py):
the round table, the signal curves (inline SVG line charts), the signal guard, the judge-call ledger
and the judged samples. Apart from run_page.py, which assembles them into the page and writes it:
each section here is a pure function of the data, with no file or MLflow in sight."""

from __future__ import annotations

import html
import math

from dynamicrubric.localrun.round_table import GUARD_COLUMNS, SMALL_N, format_cell

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def escaped(value: object) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], x_label: str) -> str:
    """An inline SVG line chart of `series` (name -> [(x, y)]), with axes, ticks and a legend."""
    width, left, right, top = 420, 48, 12, 28
    bottom = 44 + 13 * len(series)  # the x axis, its label, then one legend line per series
    height = 196 + bottom
    points = [(x, y) for s in series.values() for x, y in s if y is not None and not math.isnan(y)]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">']
    out.append(
        f'<title>{escaped(title)}</title><text x="{left}" y="16" font-weight="bold">{escaped(title)}</text>'
    )
    if not points:
        out.append(f'<text x="{left}" y="{height / 2}" fill="#777">no data</text></svg>')
        return "".join(out)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(0.0, min(ys)), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y1 = y0 + 1
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return top + plot_h - (y - y0) / (y1 - y0) * plot_h

    out.append(
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#444"/>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#444"/>'
    )
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        out.append(
            f'<text x="{left - 4}" y="{py(y) + 4:.1f}" font-size="10" text-anchor="end">{y:.3g}</text>'
            f'<line x1="{left}" y1="{py(y):.1f}" x2="{left + plot_w}" y2="{py(y):.1f}" stroke="#eee"/>'
        )
    ticks = sorted(set(xs)) if len(set(xs)) <= 10 else [x0 + (x1 - x0) * i / 5 for i in range(6)]
    for x in ticks:
        out.append(
            f'<text x="{px(x):.1f}" y="{top + plot_h + 14}" font-size="10" text-anchor="middle">{x:g}</text>'
        )
    out.append(
        f'<text x="{left + plot_w / 2}" y="{top + plot_h + 28}" font-size="11" text-anchor="middle">'
        f"{escaped(x_label)}</text>"
    )
    for i, (name, pts) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        good = [(x, y) for x, y in pts if y is not None and not math.isnan(y)]
        if len(good) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in good)
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>')
        for x, y in good:
            out.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"><title>{escaped(name)}: {y:.4g}</title></circle>'
            )
        lx, ly = left, height - 13 * (len(series) - i) + 6
        out.append(
            f'<rect x="{lx}" y="{ly - 8}" width="10" height="3" fill="{colour}"/>'
            f'<text x="{lx + 14}" y="{ly - 4}" font-size="10">{escaped(name[:60])}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def table_section(data: dict) -> str:
    rounds = data["rounds"]
    if not rounds:
        return "<p>(no rounds recorded)</p>"
    headers = [h for h in rounds[0]["row"] if h not in (*GUARD_COLUMNS, "benchmarks")]
    out = ['<table id="round-table"><tr>' + "".join(f"<th>{escaped(h)}</th>" for h in headers) + "</tr>"]
    for r in rounds:
        cells = []
        for h in headers:
            value = r["row"][h]
            raw = value[0] if isinstance(value, tuple | list) and value else value
            n = f' data-n="{value[1]}"' if isinstance(value, tuple | list) and value else ""
            number = (
                ""
                if raw is None or (isinstance(raw, float) and math.isnan(raw))
                else f' data-value="{raw!r}"'
            )
            cells.append(
                f'<td class="num" data-round="{r["round"]}" data-metric="{escaped(h)}"{number}{n}>{escaped(format_cell(value))}</td>'
            )
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    legend = "".join(
        f"<li><b>{escaped(name)}</b>: {escaped(meaning)}</li>" for name, meaning in data["legend"]
    )
    legend += (
        f"<li>(n=…) is the sample size; [lo-hi] a 95% Wilson interval, shown when n &lt; {SMALL_N}.</li>"
    )
    legend += "".join(f"<li>{escaped(note)}</li>" for note in data["notes"])
    return "".join(out) + f'<ul class="legend">{legend}</ul>'


def signals_section(data: dict) -> str:
    rounds = data["rounds"]

    def series(keys: list[tuple[str, str]]) -> dict:
        return {label: [(r["round"], r["signals"].get(key)) for r in rounds] for key, label in keys}

    charts = [
        line_chart("score gap", series([("mean_gap", "mean gap")]), "round"),
        line_chart("ties", series([("tie_rate", "tie rate"), ("uniformity", "uniformity")]), "round"),
        line_chart("generator reward R_disc", series([("r_disc", "R_disc")]), "round"),
        line_chart(
            "accuracy",
            series(
                [("evaluator_acc", "evaluator_acc"), ("policy_acc", "policy_acc"), ("win_rate", "win_rate")]
            ),
            "round",
        ),
    ]
    steps = "".join(
        line_chart(f"round {r['round']}: rewards per step", r["steps"], "training step")
        for r in rounds
        if r["steps"]
    )
    return (
        '<div class="charts" id="signal-curves">'
        + "".join(charts)
        + "</div>"
        + (
            f'<h3>Rewards per training step</h3><div class="charts" id="step-rewards">{steps}</div>'
            if steps
            else ""
        )
    )


# The guard's numbers per round on the page: (label, metric, what it is); an interval is shown where the
# guard has one (<metric>_lo, <metric>_hi).
GUARD_ROWS = [
    (
        "gold of P_t",
        "gold_score",
        "mean checker score of P_t's probe samples (the reference judge's without a checker)",
    ),
    ("gold change", "gold_delta", "P_t minus P_t-1 on the same prompts"),
    ("training score of P_t", "train_score", "the round's evaluator's mean score of P_t's probe samples"),
    ("training score change", "train_delta", "P_t minus P_t-1, both in the same candidate sets"),
    (
        "agreement",
        "agreement",
        "pairwise agreement of the evaluator with the gold (1 = always ordered as the gold)",
    ),
    ("agreement change", "agreement_delta", "from the previous round's"),
    ("canaries that beat or tie", "canary_win_rate", "share of canaries scored at or above their original"),
    (
        "order |score change|",
        "order_abs_delta",
        "mean move of a score when G_t sees the responses in another order",
    ),
    (
        "order rank correlation",
        "order_rank_corr",
        "mean Spearman correlation of a set's scores in the two orders",
    ),
]


def guard_section(data: dict) -> str:
    rounds = [r for r in data["rounds"] if r["guard"]]
    if not rounds:
        return '<p class="muted" id="signal-guard">The signal guard did not measure this run (the verifiable baseline, or a run from before it).</p>'

    def cell(r: dict, metric: str) -> str:
        g = r["guard"]
        if metric not in g:
            return '<td class="num">-</td>'
        text = f"{g[metric]:.3f}"
        if f"{metric}_lo" in g and f"{metric}_hi" in g:
            text += f" [{g[metric + '_lo']:.2f}, {g[metric + '_hi']:.2f}]"
        return f'<td class="num" data-round="{r["round"]}" data-metric="guard/{metric}" data-value="{g[metric]!r}">{escaped(text)}</td>'

    head = (
        "<tr><th>measure</th>"
        + "".join(f"<th>round {r['round']}</th>" for r in rounds)
        + "<th>what it is</th></tr>"
    )
    body = [
        f"<tr><td>{escaped(label)}</td>"
        + "".join(cell(r, metric) for r in rounds)
        + f"<td class=muted>{escaped(meaning)}</td></tr>"
        for label, metric, meaning in GUARD_ROWS
    ]
    kinds = sorted(
        {
            k
            for r in rounds
            for k in r["guard"]
            if k.startswith("canary_") and not k.startswith("canary_win_rate")
        }
    )
    body += [
        f"<tr><td>canary: {escaped(k.removeprefix('canary_'))}</td>"
        + "".join(cell(r, k) for r in rounds)
        + "<td class=muted>its share that beat or tie</td></tr>"
        for k in kinds
    ]
    length = [r["row"].get("len_corr") for r in rounds]
    body.append(
        "<tr><td>length correlation</td>"
        + "".join(f'<td class="num">{"-" if v is None else f"{v:.3f}"}</td>' for v in length)
        + "<td class=muted>the policy's reward against its completions' length, within groups, mean over steps</td></tr>"
    )
    alarms = "".join(
        f'<li data-round="{r["round"]}" class="{"failed" if r["guard"].get("alarm") else ""}">round {r["round"]}: '
        f"{escaped(r['alarm'] or ('fired' if r['guard'].get('alarm') else 'quiet'))}</li>"
        for r in rounds
    )
    return (
        f'<table id="signal-guard">{head}{"".join(body)}</table>'
        f'<h3>Alarms (guard.action {escaped(data["guard_action"])})</h3><ul id="guard-alarms">{alarms}</ul>'
    )


def ledger_section(data: dict) -> str:
    rounds = [r for r in data["rounds"] if r["ledger"]]
    if not rounds:
        return '<p class="muted" id="ledger">No judge calls went through a server in this run (in-process models).</p>'
    kinds = sorted({k for r in rounds for k in r["ledger"]})
    out = [
        '<table id="ledger"><tr><th>round</th>' + "".join(f"<th>{escaped(k)}</th>" for k in kinds) + "</tr>"
    ]
    for r in rounds:
        out.append(
            f"<tr><td>{r['round']}</td>"
            + "".join(f'<td class="num">{r["ledger"].get(k, 0):g}</td>' for k in kinds)
            + "</tr>"
        )
    return "".join(out) + "</table>"


def _sample_set(s: dict, *, first: bool = False) -> str:
    """One judged set as nested <details> (the first of a round open, to show what a set holds)."""
    items = {(r["rubric_idx"], i): item for r in s["rubrics"] for i, item in enumerate(r["items"])}
    rubrics = "".join(
        f"<li>rubric {r['rubric_idx']} ({escaped(r['parse_status'])}): <ol start=0>"
        + "".join(
            f"<li>{escaped(i['text'])} <span class=muted>(weight {i['weight']})</span></li>"
            for i in r["items"]
        )
        + "</ol></li>"
        for r in s["rubrics"]
    )

    def mean_score(response: dict) -> float | None:
        """The response's score: its scores' mean over the rubric samples (None: none defined)."""
        scores = [v for v in response["scores"].values() if v is not None]
        return sum(scores) / len(scores) if scores else None

    defined = [x for x in map(mean_score, s["responses"]) if x is not None]
    best = max(defined) if len(set(defined)) > 1 else None  # no "best" among equals
    responses = []
    for r in s["responses"]:
        score = mean_score(r)
        failed = any(v["p_yes"] is None for v in r["verdicts"])
        verdicts = "".join(
            f"<tr><td>{escaped(items.get((v['rubric_idx'], v['item_idx']), {}).get('text', '?'))}</td>"
            f"<td class=num>{items.get((v['rubric_idx'], v['item_idx']), {}).get('weight', '?')}</td>"
            + (
                '<td class="num failed">failed</td>'
                if v["p_yes"] is None
                else f'<td class="num">{v["p_yes"]:.3f}</td>'
            )
            + "</tr>"
            for v in r["verdicts"]
        )
        gold = ", ".join(f"{k} {v:g}" for k, v in r["gold"].items()) or "none"
        mark = ' class="best"' if best is not None and score == best else ""
        responses.append(
            f"<details{mark}><summary>response {r['sample_idx']}: score "
            f"{'<span class=failed>failed</span>' if score is None else f'{score:.3f}'}"
            f"{' (a verdict failed)' if failed and score is not None else ''}; gold: {escaped(gold)}</summary>"
            f"<pre>{escaped(r['response'])}</pre>"
            f"<table><tr><th>item</th><th>weight</th><th>P(yes)</th></tr>{verdicts}</table></details>"
        )
    return (
        f"<details class=set{' open' if first else ''}><summary>{escaped(s['set_id'])}: {len(s['responses'])} responses</summary>"
        f"<pre>{escaped(s['prompt'])}</pre><p class=muted>rubrics by {escaped(s['generator'])}, verdicts by "
        f"{escaped(s['verifier'])}</p><ul>{rubrics}</ul>{''.join(responses)}</details>"
    )


def samples_section(data: dict) -> str:
    out = []
    for r in data["rounds"]:
        sets = r["sets"]
        body = "".join(_sample_set(s, first=i == 0) for i, s in enumerate(sets))
        body = body or "<p class=muted>none traced</p>"
        out.append(
            f'<details open id="samples-round-{r["round"]}"><summary>round {r["round"]}: {len(sets)} judged sets</summary>{body}</details>'
        )
    return "".join(out)
