"""Judge memory: peak RSS of the judge stage's request path against the number of judgments.

At the paper's sizes one judge shard holds about 532k (item, response) questions. The stage builds
and scores them in bounded chunks (`judge.JUDGE_CHUNK_PAIRS`), renders the chat template once per
response, and keeps only keys and P(yes) per judgment, so its memory should stay flat as the number of
judgments grows. Each size runs in a fresh subprocess that reads its input artifacts (K=8 responses
of ~1,000 characters per prompt, G=4 rubrics of M=6 items: 192 judgments per prompt) and runs
`judge.run_judge` on them with the tiny-random verifier's real chat template and tokenizer, writing
the judgments artifact; its peak RSS is `ru_maxrss`.

The scorer tokenizes every (prefix, suffix) pair as an engine does (each prefix once) but runs no
model (`TokenizeOnlyEngine`): at 1M judgments a forward pass per judgment would take hours on 2 CPU
cores, and the model's memory does not depend on the number of judgments (a batch at a time). The baseline is the former
path: every question rendered as its own full prompt string, all held at once (10k and 100k only).

    python -m bench.bench_judge_memory [--sizes 10000 100000 1000000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import machine_info, print_table, write_result
from dynamicrubric.engines import Engine

K, G, M = 8, 4, 6
PER_PROMPT = K * G * M
RESPONSE = (
    "First, 4 pencils cost 4 x 3 = 12 dollars. Then the change from a 20 dollar bill is 20 - 12 = 8 dollars. "
    * 10
)


def write_inputs(n: int, folder: Path) -> tuple[str, str]:
    """Rollouts and rubrics artifacts that give n judgments (rounded up to whole prompts)."""
    import pandas as pd

    from dynamicrubric.infra.artifacts import write_artifact

    prompts = -(-n // PER_PROMPT)
    rollouts = pd.DataFrame(
        {
            "prompt_id": [f"p{i:07d}" for i in range(prompts) for _ in range(K)],
            "sample_idx": [j for _ in range(prompts) for j in range(K)],
            "prompt": [
                f"Question {i}: how much change does Tom get?" for i in range(prompts) for _ in range(K)
            ],
            "response": [f"Response {j}. {RESPONSE}" for _ in range(prompts) for j in range(K)],
            "num_tokens": 200,
            "finish_reason": "stop",
            "policy": "bench",
            "seed": 0,
        }
    )
    items = [
        {"text": f"The response satisfies criterion number {m} of this rubric.", "weight": 1 + m % 5}
        for m in range(M)
    ]
    rubrics = pd.DataFrame(
        {
            "prompt_id": [f"p{i:07d}" for i in range(prompts) for _ in range(G)],
            "rubric_idx": [g for _ in range(prompts) for g in range(G)],
            "variant": "dynamic",
            "generator": "bench",
            "generator_prompt": "",
            "completion": "",
            "finish_reason": "stop",
            "parse_status": "json",
            "items": [items for _ in range(prompts) for _ in range(G)],
        }
    )
    r_uri, s_uri = str(folder / f"rollouts-{n}.parquet"), str(folder / f"rubrics-{n}.parquet")
    write_artifact(r_uri, "rollouts", rollouts)
    write_artifact(s_uri, "rubrics", rubrics)
    return r_uri, s_uri


class TokenizeOnlyEngine(Engine):
    """The request path of an engine without its model: the real tiny-random tokenizer and chat
    template, each (prefix, suffix) pair tokenized as HFEngine does (each prefix once), and a P(yes)
    derived from the suffix length. For this benchmark only: judging 1M questions with a forward
    pass each would take hours on 2 CPU cores, and a model's memory is a batch at a time."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        from dynamicrubric.infra.models import resolve_model

        self.model_ref = "tiny-random (tokenizer only)"
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny-random"))
        self.tokens = 0

    def yes_probability(self, pairs, desc="judge", *, bar=None):
        prefixes = {
            p: self.tokenizer.encode(p, add_special_tokens=False) for p in dict.fromkeys(p for p, _ in pairs)
        }
        suffixes = self.tokenizer([s for _, s in pairs], add_special_tokens=False)["input_ids"]
        self.tokens += sum(map(len, prefixes.values())) + sum(map(len, suffixes))
        if bar is not None:
            bar.update(len(pairs))
        return [(len(s) % 10) / 10 for s in suffixes]

    def _generate(self, *args, **kwargs):
        raise NotImplementedError("the judge benchmark only judges")

    def logprobs(self, *args, **kwargs):
        raise NotImplementedError("the judge benchmark only judges")


def child(n: int, folder: str, mode: str) -> dict:
    """One measurement, in its own process: judge `n` questions the stage's way (or the former way)."""
    from dynamicrubric.infra.artifacts import read_frame
    from dynamicrubric.infra.config_loading import load_config
    from dynamicrubric.scoring.judge import run_judge
    from dynamicrubric.scoring.prompts import JUDGE_ITEM_QUESTION, judge_context, split_chat_prompt

    engine = TokenizeOnlyEngine()
    cfg = load_config(preset="tiny")
    rollouts_uri, rubrics_uri = f"{folder}/rollouts-{n}.parquet", f"{folder}/rubrics-{n}.parquet"
    start = time.perf_counter()
    if mode == "stream":  # the judge stage itself, inputs read and judgments written
        counts = run_judge(
            rollouts_uri, f"{folder}/judgments-{n}.parquet", cfg, rubrics_uri=rubrics_uri, engine=engine
        )
        judged = counts["judgments"]
    else:  # the former path: one full prompt string pair per question, all built before judging
        rollouts, rubrics = read_frame(rollouts_uri, "rollouts"), read_frame(rubrics_uri, "rubrics")
        by_prompt = {pid: g for pid, g in rollouts.groupby("prompt_id", sort=False)}
        pairs = []
        for rubric in rubrics.itertuples():
            for r in by_prompt[rubric.prompt_id].itertuples():
                context = judge_context(r.prompt, r.response, cfg.judge.max_response_chars)
                for item in rubric.items:
                    question = JUDGE_ITEM_QUESTION.format(item=item["text"])
                    pairs.append(split_chat_prompt(engine.chat_prompt, context, question))
        judged = len(pairs)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"judgments": judged, "peak_rss_mb": peak_mb, "seconds": seconds, "tokens": engine.tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--baseline-sizes", type=int, nargs="*", default=[10_000, 100_000])
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="stream", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.mode)))
        return

    info = machine_info()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-judge-memory-") as tmp:
        for n in sorted(set(args.sizes) | set(args.baseline_sizes)):
            write_inputs(n, Path(tmp))
            modes = (["stream"] if n in args.sizes else []) + (
                ["all-at-once"] if n in args.baseline_sizes else []
            )
            for mode in modes:
                cmd = [sys.executable, "-m", "bench.bench_judge_memory", "--child", str(n), "--mode", mode]
                out = subprocess.run(cmd + ["--folder", tmp], check=True, capture_output=True, text=True)
                run = {"size": n, "mode": mode, **json.loads(out.stdout.strip().splitlines()[-1])}
                runs.append(run)
                print(
                    f"{mode:>12} {n:>9,} judgments: peak RSS {run['peak_rss_mb']:.0f} MB, {run['seconds']:.1f} s"
                )
    stream = {r["size"]: r for r in runs if r["mode"] == "stream"}
    ratio = stream[max(stream)]["peak_rss_mb"] / stream[min(stream)]["peak_rss_mb"]
    result = {"machine": info, "K": K, "G": G, "M": M, "runs": runs, "ratio_largest_smallest": ratio}
    path = write_result("judge_memory", result)
    print_table(
        [(f"{r['mode']} {r['size']:,} peak RSS MB", r["peak_rss_mb"]) for r in runs]
        + [(f"ratio {max(stream):,} / {min(stream):,} (goal < 1.5)", ratio), ("written", str(path))]
    )


if __name__ == "__main__":
    main()
