"""The evaluate stage's PNG plots: scores, gap and tie rate, evaluator accuracy, policy quality."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from dynamicrubric import store

log = logging.getLogger(__name__)


PLOT_NAMES = ("scores.png", "gap_tie.png", "accuracy.png", "policy.png")
# Beside the plots: the judged candidate sets the stage traced (evaluate.traced_sets), which its MLflow
# run logs as traces and the run report shows.
TRACED_SETS = "traced_sets.json"
# And the benchmarks' judged pairs it traced (benchmark_judge.BenchmarkResults.traced), logged likewise.
BENCHMARK_PAIRS = "benchmark_pairs.json"
# Everything a plots folder holds: how a rerun tells an earlier plots output from another folder.
PLOTS_FOLDER_FILES = frozenset((*PLOT_NAMES, TRACED_SETS, BENCHMARK_PAIRS))


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------


def write_plots(
    out_dir: str,
    metrics: pd.DataFrame,
    evaluated: dict[str, pd.DataFrame],
    traced: list[dict] | None = None,
    benchmark_pairs: list[dict] | None = None,
) -> list[str]:
    """Write the PNG plots into `out_dir` (a path or s3:// prefix), and the `traced` sets as
    TRACED_SETS and the `benchmark_pairs` as BENCHMARK_PAIRS beside them when given; return the plots'
    file names.

    scores.png: per variant, the score distribution of best vs other responses; gap_tie.png: mean gap,
    gap on correct pairs, tie and uniformity rate per variant; accuracy.png: pairwise / listwise
    accuracy and nDCG per variant; policy.png: avg@k (and pass@k) per task and the win rate.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with tempfile.TemporaryDirectory(prefix="dynrubric-plots-") as tmp:
        variants = list(evaluated)
        fig, axes = plt.subplots(
            1, max(1, len(variants)), figsize=(4 * max(1, len(variants)), 3.2), squeeze=False
        )
        for ax, variant in zip(axes[0], variants, strict=False):
            df = evaluated[variant]
            best = df["rank"] == df.groupby("list_id")["rank"].transform("min")
            bins = np.linspace(0, 1, 21)
            ax.hist([df.loc[best, "score"], df.loc[~best, "score"]], bins=bins, label=["best", "other"])
            ax.set_title(variant)
            ax.set_xlabel("score")
            ax.legend()
        if not variants:
            _no_data(axes[0][0], "no labelled lists")
        axes[0][0].set_ylabel("responses")
        _save(fig, Path(tmp, "scores.png"))

        _bars(
            Path(tmp, "gap_tie.png"),
            metrics,
            variants,
            ["mean_gap", "mean_gap_correct", "tie_rate", "uniformity_rate"],
            "gap and ties",
        )
        _bars(
            Path(tmp, "accuracy.png"),
            metrics,
            variants,
            ["pairwise_accuracy", "listwise_accuracy", "ndcg"],
            "evaluator accuracy",
        )

        per_task = metrics["name"].str.contains("/") | (metrics["name"] == "win_rate")
        pol = metrics[(metrics["variant"] == "policy") & per_task]
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(pol) + 2), 3.2))
        if len(pol):
            ax.bar(pol["name"], pol["value"])
            ax.set_ylim(0, 1)
            ax.tick_params(axis="x", labelrotation=30)
        else:
            _no_data(ax, "no policy scores")
        ax.set_title("policy quality")
        _save(fig, Path(tmp, "policy.png"))
        if traced is not None:
            Path(tmp, TRACED_SETS).write_text(json.dumps(traced))
        if benchmark_pairs is not None:
            Path(tmp, BENCHMARK_PAIRS).write_text(json.dumps(benchmark_pairs))
        store.upload_dir(tmp, out_dir)
    return list(PLOT_NAMES)


def _bars(path: Path, metrics: pd.DataFrame, variants: list[str], names: list[str], title: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    table = metrics[metrics["variant"].isin(variants) & metrics["name"].isin(names)].pivot(
        index="name", columns="variant", values="value"
    )
    if table.empty:
        _no_data(ax, "no labelled lists")
    else:
        table = table.reindex(index=[n for n in names if n in table.index], columns=variants)
        width = 0.8 / len(variants)
        x = np.arange(len(table.index))
        for i, variant in enumerate(variants):
            ax.bar(x + i * width, table[variant].fillna(0).to_numpy(), width, label=variant)
        ax.set_xticks(x + width * (len(variants) - 1) / 2, table.index)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.legend()
    ax.set_title(title)
    _save(fig, path)


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
