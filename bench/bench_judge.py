"""Judge throughput: yes/no from one forward pass (shared context) vs generating a verdict text.

K responses to one prompt are each judged on M rubric items (K·M judgments):
- `yes_probability`: P(yes) from the next-token distribution, each response's context run once;
- the same without prefix sharing (every pair a full sequence);
- the baseline API-judge systems use: generate a short verdict text per (response, item), greedy,
  and parse its first yes/no.
Reports judgments/s of each, the ratio (goal >= 10x), verdict agreement between P(yes) >= 0.5 and the
parsed text (goal >= 95%), and the judge's FLOP use: model FLOPs / time against a matmul roofline
measured in the same run (goal >= 30%).

    python -m bench.bench_judge [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

import torch

from bench import machine_info, print_table, write_result
from dynamicrubric.engines import HFEngine

QUESTION = "A shop sells pencils at 3 dollars each. Tom buys 4 pencils and pays with a 20 dollar bill. How much change does he get?"
RESPONSES = [
    "4 pencils cost 4 x 3 = 12 dollars. Change: 20 - 12 = 8 dollars. The answer is 8.",
    "The answer is 8 dollars.",
    "4 * 3 = 12, and 20 - 12 = 8. Tom gets 8 dollars back.",
    "Tom pays 12 dollars, so he gets 7 dollars of change.",
    "The pencils cost 3 + 4 = 7 dollars, so the change is 13 dollars.",
    "I am not sure, maybe 10 dollars?",
    "Pencils are useful for writing and drawing. Many shops sell them.",
    "Each pencil is 3 dollars. 4 pencils: 12 dollars. 20 dollars minus 12 dollars leaves 8 dollars of change.",
]
ITEMS = [
    "The response states that the final answer is 8 dollars.",
    "The response computes the cost of the pencils as 12 dollars.",
    "The response shows the subtraction 20 - 12.",
    "The response is shorter than three sentences.",
    "The response stays on the topic of the question.",
    "The response contains an arithmetic mistake.",
    "The response expresses uncertainty about its answer.",
    "The response mentions the 20 dollar bill.",
]
_SPLIT = "\u0000SPLIT\u0000"
_VERDICT = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def judge_pairs(engine: HFEngine, k: int, m: int) -> list[tuple[str, str]]:
    """(prefix, suffix) per (response, item): the prefix holds the response, the suffix the item."""
    pairs = []
    for response in RESPONSES[:k]:
        body = (
            f"Here is a question and a response to it.\n\nQuestion: {QUESTION}\n\nResponse: {response}\n\n{_SPLIT}"
            "Criterion: {item}\nDoes the response satisfy the criterion? Answer with yes or no."
        )
        for item in ITEMS[:m]:
            text = engine.chat_prompt([{"role": "user", "content": body.replace("{item}", item)}])
            prefix, suffix = text.split(_SPLIT)
            pairs.append((prefix, suffix))
    return pairs


def parse_verdict(text: str) -> bool | None:
    match = _VERDICT.search(text)
    return None if match is None else match.group(1).lower() == "yes"


def matmul_roofline(device: torch.device, dtype: torch.dtype) -> float:
    """Best FLOP/s of a large square matmul on this device: the ceiling the judge is measured against."""
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def judge_flops(engine: HFEngine, pairs: list[tuple[str, str]]) -> tuple[float, int]:
    """Model FLOPs of the shared-prefix judge: 2·(non-embedding params)·tokens plus the vocabulary
    projection for the rows whose logits are computed (attention score FLOPs are left out)."""
    model = engine.model
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    skip = {id(emb), id(out)}
    body = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    prefixes = list(dict.fromkeys(p for p, _ in pairs))
    tokens = sum(len(engine._encode([p])[0]) for p in prefixes) + sum(
        len(engine._encode([s])[0]) for _, s in pairs
    )
    logit_rows = len(prefixes) + len(pairs)
    return 2.0 * body * tokens + 2.0 * out.numel() * logit_rows, tokens


def timed_interleaved(fns: dict[str, Any], repeats: int) -> dict[str, tuple[Any, float]]:
    """Result and best wall time of each function over `repeats` rounds. The rounds interleave the
    functions, so load from other processes on a shared machine hits all of them alike."""
    best: dict[str, tuple[Any, float]] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if name not in best or dt < best[name][1]:
                best[name] = (out, dt)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--k", type=int, default=8, help="responses (at most 8)")
    ap.add_argument("--m", type=int, default=8, help="rubric items per response (at most 8)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--verdict-tokens", type=int, default=16, help="max new tokens of a generated verdict")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per method; the best is kept")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = HFEngine(args.model, batch_size=args.batch_size)
    pairs = judge_pairs(engine, args.k, args.m)
    full = [p + s for p, s in pairs]
    engine.yes_probability(pairs)  # warm-up (allocator, kernels)
    engine.generate(full[: args.batch_size], temperature=0.0, max_new_tokens=2)

    runs = timed_interleaved(
        {
            "shared": lambda: engine.yes_probability(pairs),
            "plain": lambda: engine.yes_probability(pairs, share_prefix=False),
            "generate": lambda: engine.generate(full, temperature=0.0, max_new_tokens=args.verdict_tokens),
        },
        args.repeats,
    )
    (p_yes, t_shared), (p_plain, t_plain), (gens, t_gen) = runs["shared"], runs["plain"], runs["generate"]
    texts = [g.texts[0] for g in gens]
    parsed = [parse_verdict(t) for t in texts]
    agree = [v == (p >= 0.5) for v, p in zip(parsed, p_yes, strict=True) if v is not None]

    flops, tokens = judge_flops(engine, pairs)
    roof = matmul_roofline(engine.device, engine.model.dtype)
    n = len(pairs)
    result = {
        "benchmark": "judge",
        "model": args.model,
        "machine": machine_info(),
        "device": str(engine.device),
        "dtype": str(engine.model.dtype),
        "k": args.k,
        "m": args.m,
        "batch_size": args.batch_size,
        "verdict_tokens": args.verdict_tokens,
        "repeats": args.repeats,
        "judgments": n,
        "yes_probability_s": t_shared,
        "yes_probability_no_sharing_s": t_plain,
        "generate_verdict_s": t_gen,
        "judgments_per_s": n / t_shared,
        "judgments_per_s_no_sharing": n / t_plain,
        "judgments_per_s_generate": n / t_gen,
        "speedup_vs_generate": t_gen / t_shared,
        "speedup_sharing": t_plain / t_shared,
        "max_abs_diff_sharing_vs_plain": max(abs(a - b) for a, b in zip(p_yes, p_plain, strict=True)),
        "verdicts_parsed": sum(v is not None for v in parsed),
        "verdict_agreement": (sum(agree) / len(agree)) if agree else None,
        "yes_rate": sum(p >= 0.5 for p in p_yes) / n,
        "judge_tokens": tokens,
        "judge_flops_per_s": flops / t_shared,
        "matmul_roofline_flops_per_s": roof,
        "flop_utilisation": flops / t_shared / roof,
        "sample_verdict_texts": texts[:4],
    }
    print_table(
        [
            ("model", args.model),
            ("judgments (K x M)", f"{n} ({args.k} x {args.m})"),
            ("yes_probability judgments/s", result["judgments_per_s"]),
            ("  without prefix sharing", result["judgments_per_s_no_sharing"]),
            (f"generated verdict ({args.verdict_tokens} tok) /s", result["judgments_per_s_generate"]),
            ("speedup vs generate (goal >= 10)", result["speedup_vs_generate"]),
            ("speedup from prefix sharing", result["speedup_sharing"]),
            ("verdicts parsed from text", f"{result['verdicts_parsed']}/{n}"),
            ("verdict agreement (goal >= 0.95)", result["verdict_agreement"]),
            ("judge GFLOP/s", result["judge_flops_per_s"] / 1e9),
            ("matmul roofline GFLOP/s", roof / 1e9),
            ("FLOP utilisation (goal >= 0.30)", result["flop_utilisation"]),
        ]
    )
    print("wrote", write_result(f"judge_{args.model}", result))


if __name__ == "__main__":
    main()
