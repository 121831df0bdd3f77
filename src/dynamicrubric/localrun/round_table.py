"""The report at the end of a local run: the per-round table (from MLflow) with its legend, and where
the run's folder, plots and MLflow UI are."""

from __future__ import annotations

import logging
from pathlib import Path

from dynamicrubric.evaluation.stats import wilson_interval
from dynamicrubric.infra import tracking
from dynamicrubric.infra.config import Config
from dynamicrubric.localrun.launch import LocalRun

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# The round table
# ------------------------------------------------------------------------------------------------

# Columns of the round table: (header, metric source stage, metric, sample-size metric, meaning).
SMALL_N = 100  # below this many samples an accuracy gets its 95% interval

LEGEND = [
    (
        "mean_gap",
        "mean score gap E(best) - E(other) of the policy's responses, by G_t's rubrics (higher is better)",
    ),
    ("tie_rate", "share of response pairs with equal scores (a tie gives the policy no direction)"),
    ("uniformity", "share of candidate sets whose responses all scored the same"),
    ("evaluator_acc", "pairwise accuracy of the evaluator on labelled lists; n = labelled pairs"),
    ("policy_acc", "accuracy of P_t on held-out prompts; n = scored samples"),
    ("win_rate", "share of held-out prompts where P_t beats P_t-1 (ties count half); n = prompts"),
    ("gold", "the signal guard: P_t's gold on the held-out probe (its checker), and its change from P_t-1"),
    ("agreement", "pairwise agreement of the round's evaluator with the gold on the probe; n = pairs"),
    (
        "canary",
        "share of canaries (padded, master-key, format-only, empty, restated) that beat or tie their original",
    ),
    ("order", "mean |score change| of a probe response when G_t sees the responses in another order"),
    (
        "len_corr",
        "mean within-group correlation of the policy's reward with its completions' length, over steps",
    ),
    ("alarm", "the guard's alarms that fired (hacking, agreement, canary, order); quiet: none"),
    (
        "vs_baseline",
        "benchmarks: P_t's win rate over the benchmark's baseline answers, both orders judged, a split a tie "
        "(WritingBench: P_t's mean P(yes) over each query's checklist, or by its official protocol its critic's "
        "mean 1-10 score / 10); [lo, hi] a 95% bootstrap interval",
    ),
    (
        "lc",
        "AlpacaEval 2's length-controlled win rate (quick protocol: its GLM without the instruction-difficulty "
        "term); Arena-Hard v2.0 by its own protocol: its style-controlled score, where its tokens can be counted",
    ),
    ("vs_p0", "P_t's win rate over P_0's answers (WritingBench: P_t's score minus P_0's)"),
    ("p0", "P_0's number against the baseline, as vs_baseline (win rates: judged in a run's first round)"),
    ("failed", "benchmark prompts with a failed judge call: left out of n, never a loss"),
    (
        "protocol",
        "quick: the project's yes/no questions, not comparable with the benchmark's leaderboard; official: the "
        "benchmark's own annotator and scoring (AlpacaEval 2: alpaca_eval's; WritingBench: its critic's); "
        "x100 these are the leaderboard's numbers",
    ),
]


def round_table(cfg: Config, parent_run_id: str) -> list[dict]:
    """Per-round headline numbers from MLflow: the signal audit of the round's evaluator on P_{t-1}'s
    probe samples (after the generator update, for the dynamic variant) and the eval results, each
    accuracy as (value, n)."""
    if not parent_run_id:
        return []
    variant = _main_variant(cfg)
    table = []
    for t, stages in sorted(tracking.stage_runs_by_round(cfg, parent_run_id).items()):
        if t == 0:
            continue  # data preparation only
        by_run = {s.data.tags.get(tracking.STAGE_TAG): s for s in stages}
        by_stage = {name: s.data.metrics for name, s in by_run.items()}
        agg = by_stage.get("audit-after-aggregate") or by_stage.get("audit-aggregate") or {}
        ev = by_stage.get("evaluate", {})
        table.append(
            {
                "round": t,
                "mean_gap": agg.get("mean_gap"),
                "tie_rate": agg.get("tie_rate"),
                "uniformity": agg.get("uniformity_rate"),
                "evaluator_acc": _with_n(
                    ev,
                    f"{variant}/pairwise_accuracy",
                    f"{variant}/labelled_pairs",
                    f"{variant}/labelled_lists",
                ),
                "policy_acc": _with_n(ev, "policy/accuracy", "policy/samples"),
                "win_rate": _with_n(ev, "policy/win_rate", "policy/win_rate_prompts"),
                **_guard_columns(cfg, ev, by_run.get("train-policy")),
                "benchmarks": {
                    key: cells for b in cfg.evaluate.benchmarks for key, cells in _benchmark_lines(b, ev)
                },
            }
        )
    return table


# Arena-Hard v2.0's categories, each scored apart under its own protocol (evaluation/arena_hard_scores.py).
ARENA_HARD_CATEGORIES = {"hard_prompt": "hard prompts", "creative_writing": "creative writing"}


def _benchmark_lines(benchmark, ev: dict) -> list[tuple[str, dict]]:
    """A configured benchmark's lines of the round table, keyed: one, or under Arena-Hard's own protocol one
    per category (its score against the category's baseline; its style-controlled score in the lc column)."""
    name, protocol = benchmark.name, benchmark.protocol
    if not (name == "arena_hard_v2" and protocol == "official"):
        return [(name, _benchmark_cells(name, protocol, ev))]
    from dynamicrubric.evaluation.benchmarks import BENCHMARKS

    lines = []
    for category, label in ARENA_HARD_CATEGORIES.items():
        count = ev.get(f"{name}/n_{category}")
        failed = ev.get(f"{name}/failed_{category}")
        lines.append(
            (
                f"{name}/{category}",
                {
                    "benchmark": f"{BENCHMARKS[name].title} {label}",
                    "vs_baseline": _interval_text(ev, f"{name}/score_{category}", signed=False),
                    "lc": ev.get(f"{name}/style_controlled_{category}"),
                    "vs_p0": None,
                    "p0": ev.get(f"{name}/score_{category}_p0"),
                    "n": None if count is None else int(count),
                    "failed": None if failed is None else int(failed),
                    "protocol": protocol,
                },
            )
        )
    return lines


def _benchmark_cells(name: str, protocol: str, ev: dict) -> dict:
    """One benchmark's line of the round table from the evaluate metrics (evaluation/benchmark_runs.py):
    P_t against the baseline (a checklist's: P_t's score) and against P_0, each with its 95% interval, and
    the protocol that measured them."""
    from dynamicrubric.evaluation.benchmarks import BENCHMARKS

    pairwise = BENCHMARKS[name].kind == "pairwise"
    main, versus = ("win_rate", "win_rate_vs_p0") if pairwise else ("score", "score_vs_p0")
    return {
        "benchmark": BENCHMARKS[name].title,
        "vs_baseline": _interval_text(ev, f"{name}/{main}", signed=False),
        "lc": ev.get(f"{name}/lc_win_rate"),
        "vs_p0": _interval_text(ev, f"{name}/{versus}", signed=not pairwise),
        "p0": ev.get(f"{name}/{main}_p0"),
        "n": None if f"{name}/n" not in ev else int(ev[f"{name}/n"]),
        "failed": None if f"{name}/failed" not in ev else int(ev[f"{name}/failed"]),
        "protocol": protocol,
    }


def _interval_text(metrics: dict, key: str, signed: bool) -> str | None:
    if key not in metrics:
        return None
    value, lo, hi = metrics[key], metrics.get(f"{key}_lo"), metrics.get(f"{key}_hi")
    if value != value:
        return "-"
    number = f"{value:+.3f}" if signed else f"{value:.3f}"
    return number + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None and lo == lo else "")


def _guard_columns(cfg: Config, ev: dict, train_policy) -> dict:
    """The signal guard's columns (guard.py) from the round's evaluate metrics, and the policy trainer's
    length correlation averaged over its steps."""
    from dynamicrubric.evaluation.guard import ALARMS

    if "guard/healthy" not in ev:  # a run from before the guard, or a round that did not evaluate
        return dict.fromkeys(("gold", "agreement", "canary", "order", "len_corr", "alarm"))
    gold = ev.get("guard/gold_score")
    delta = ev.get("guard/gold_delta")
    fired = [name for name in ALARMS if ev.get(f"guard/alarm_{name}")]
    return {
        "gold": None if gold is None else f"{gold:.3f}" + ("" if delta is None else f" ({delta:+.3f})"),
        "agreement": _with_interval(ev, "guard/agreement", "guard/agreement_pairs"),
        "canary": _with_interval(ev, "guard/canary_win_rate", "guard/canaries"),
        "order": ev.get("guard/order_abs_delta"),
        "len_corr": _mean_over_steps(cfg, train_policy, LENGTH_CORRELATION),
        "alarm": ",".join(fired) or "quiet",
    }


def _with_interval(metrics: dict, key: str, n_key: str) -> str | None:
    """A guard proportion as text with its n and its bootstrap interval (the guard's own, which
    resamples prompts: pairs and canaries of one prompt are not independent, as a Wilson interval
    would take them to be)."""
    if n_key not in metrics:
        return None
    n = int(metrics[n_key])
    if key not in metrics:
        return f"- (n={n})"
    text = f"{metrics[key]:.3f} (n={n})"
    lo, hi = metrics.get(f"{key}_lo"), metrics.get(f"{key}_hi")
    return text + (f" [{lo:.2f}-{hi:.2f}]" if lo is not None and hi is not None else "")


LENGTH_CORRELATION = "rewards/length_corr"  # the policy reward's per-step metric (training/policy_reward.py)


def _mean_over_steps(cfg: Config, run, key: str) -> float | None:
    """The mean of a step metric over a run's steps (MLflow keeps its history; the trainers log it under
    their variant, as "dynamic/<key>"), None when it was not logged."""
    found = [k for k in (run.data.metrics if run is not None else {}) if k == key or k.endswith("/" + key)]
    if not found:
        return None
    history = tracking.mlflow_client(cfg).get_metric_history(run.info.run_id, found[0])
    values = [m.value for m in history if m.value == m.value]
    return sum(values) / len(values) if values else None


def _with_n(metrics: dict, key: str, n_key: str, counted: str = "") -> tuple[float, int] | None:
    """(value, n); NaN with n = 0 when the stage ran (`counted` was logged) but had nothing to measure,
    e.g. no labelled pair; None when the metric was not measured at all."""
    if not any(k in metrics for k in (key, n_key, counted) if k):
        return None
    return metrics.get(key, float("nan")), int(metrics.get(n_key, 0))


def _main_variant(cfg: Config) -> str:
    from dynamicrubric.pipelines.run_plan import pipeline_variant

    return pipeline_variant(cfg)


# The signal guard's columns: printed as a block of their own under the signal's (one table would
# be some 200 characters wide), each line a round.
GUARD_COLUMNS = ("gold", "agreement", "canary", "order", "len_corr", "alarm")


def format_table(rows: list[dict], judge: str = "") -> str:
    """The round table: the signal's block, the signal guard's, and the benchmarks' (a line a round and
    benchmark, under a heading that names `judge`)."""
    if not rows:
        return "(no rounds recorded)"
    signal = [{k: v for k, v in r.items() if k not in (*GUARD_COLUMNS, "benchmarks")} for r in rows]
    guard = [{"round": r["round"], **{k: r[k] for k in GUARD_COLUMNS if k in r}} for r in rows]
    blocks = [_block(signal)]
    if any(r.get("alarm") is not None for r in rows):
        blocks.append(_block(guard))
    benchmarks = [{"round": r["round"], **cells} for r in rows for cells in r.get("benchmarks", {}).values()]
    if benchmarks:
        blocks.append(f"Benchmarks, judged by {judge}:\n" + _block(benchmarks))
    return "\n\n".join(blocks)


def _block(rows: list[dict]) -> str:
    headers = list(rows[0])
    cells = [[format_cell(r[h]) for h in headers] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


# The built-in 135M model: numbers from it need reading at its scale (see scale_notes).
SMALL_MODEL = "smollm2-135m-instruct"


def format_legend(rows: list[dict], cfg: Config | None = None) -> str:
    shown = set(rows[0]) if rows else set()
    shown |= {k for r in rows for cells in r.get("benchmarks", {}).values() for k in cells}
    width = max(len(name) for name, _ in LEGEND)
    lines = [f"  {name.ljust(width)}  {meaning}" for name, meaning in LEGEND if name in shown]
    lines.append(
        f"  (n=…) is the sample size; [lo-hi] a 95% Wilson interval, shown when n < {SMALL_N} (the guard's: "
        "a bootstrap over prompts)."
    )
    lines += scale_notes(cfg) if cfg is not None else []
    return "\n".join(lines)


def scale_notes(cfg: Config) -> list[str]:
    """How to read the table for this config's verdicts and, with the built-in 135M model, its size."""
    notes = []
    if cfg.aggregate.soft:
        notes.append(
            "  Scores weight each item by the verifier's P(yes) (aggregate.soft), so two responses tie only "
            "when V is equally sure of both; hard yes/no verdicts tie far more often."
        )
    if {cfg.models.policy, cfg.models.generator, cfg.models.verifier} == {SMALL_MODEL}:
        notes.append(
            "  SmolLM2-135M plays every role here: its P(yes) moves little with the response, so gaps are "
            "small, an evaluator_acc whose interval holds 0.5 is chance, and a few steps "
            "of training change nothing measurable. The run shows the signal the method trains on, end to "
            "end; docs/results.md measures what it does at this size."
        )
    return notes


def format_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):  # (proportion, n)
        p, n = value
        if p != p:  # NaN: nothing to measure (e.g. no labelled pair)
            return f"- (n={n})"
        text = f"{p:.3f} (n={n})"
        if 0 < n < SMALL_N and 0.0 <= p <= 1.0:
            lo, hi = wilson_interval(p, n)
            text += f" [{lo:.2f}-{hi:.2f}]"
        return text
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def report(cfg: Config, result: LocalRun, page: str = "") -> str:
    """What `dynrubric run` prints at the end: the round table with its legend, where everything is
    (`page`: the run report page), and whether anything ran at all."""
    from dynamicrubric.evaluation.benchmark_judge import judge_label
    from dynamicrubric.evaluation.probe import ACTION_WORDS
    from dynamicrubric.pipelines.run_plan import guard_action

    rows = round_table(cfg, result.parent_run_id)
    out = ["", format_table(rows, judge_label(cfg)), "", "Legend:", format_legend(rows, cfg), ""]
    fired = [str(r["round"]) for r in rows if r.get("alarm") not in (None, "quiet")]
    if fired:
        action = guard_action(cfg)
        out.append(
            f"Signal guard: the alarm fired in round {', '.join(fired)} (guard.action {action}: "
            f"{ACTION_WORDS[action]}); why is in that round's evaluate log and on the run report page."
        )
    if result.tasks and result.ran == 0:
        out.append(
            f"All {len(result.tasks)} tasks were cached: nothing ran, the numbers are the earlier run's. "
            "Pass --fresh to run again (or delete "
            f"{Path(cfg.pipeline.pipeline_root).resolve() / '.kfp_cache'} to drop the cache)."
        )
    elif result.tasks and result.ran < len(result.tasks):
        out.append(
            f"{len(result.tasks) - result.ran} of {len(result.tasks)} tasks were taken from the cache."
        )
    out.append(f"Pipeline root: {Path(cfg.pipeline.pipeline_root).resolve()}")
    for folder, index in zip(result.run_dirs, result.index_files, strict=True):
        out.append(f"Run folder:    {folder}  (which task folder is which: {index})")
    plots = [
        (t.get("round") or 0, uri)
        for t in result.tasks
        if t["stage"] == "evaluate"
        for uri in t["outputs"].get("plots", [])
    ]
    if plots:
        last = max(plots)[1]
        out.append(f"Plots (PNG):   {last}  (open with any image viewer, e.g. xdg-open {last}/accuracy.png)")
    if page:
        out.append(f"Run report:    {page}  (one page, open in a browser; also the parent run's artifact)")
    uri = tracking.tracking_uri(cfg)
    if uri and result.parent_run_id:
        out.append(f"MLflow parent run {result.parent_run_id}. Open the UI with:")
        out.append(f"  mlflow ui --backend-store-uri {uri}")
    return "\n".join(out) + "\n"
