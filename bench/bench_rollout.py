"""Rollout throughput: batched sampling vs one sequence at a time (goal >= 4x tokens/s), and the
project's sampler against transformers' `model.generate` (goal >= 1x tokens/s).

The policy samples K responses per prompt. Batched: `generate(prompts, n=K)` with `--batch-size`
rows per batch (each prompt's context computed once and shared by its K rows). Sequential: the same
engine with batch size 1, on the first `--sequential-prompts` prompts (it is slow). Each sample has its
own seeded random stream, so both produce identical samples for the rows they share; the benchmark
checks that too. `model.generate` samples the same rows (the same prompts, K each, the same rows per
batch, temperature 1, no top-k or top-p, the same stop tokens) with the same model object in the same
process; its samples differ (its own random stream), so the ratio is of tokens per second.

    python -m bench.bench_rollout [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench import machine_info, print_table, write_result
from dynamicrubric.engines import Generation, HFEngine

QUESTIONS = [
    "What is 17 + 25?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is 9 times 7?",
    "Give a synonym for 'happy'.",
    "What is the capital of France?",
    "Explain in one sentence what a prime number is.",
    "What is 100 minus 37?",
]


def run(engine: HFEngine, prompts: list[str], k: int, max_new_tokens: int) -> tuple[list[Generation], float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = engine.generate(prompts, n=k, temperature=1.0, max_new_tokens=max_new_tokens, seed=0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def run_model_generate(
    engine: HFEngine, prompts: list[str], k: int, max_new_tokens: int
) -> tuple[int, float]:
    """Tokens sampled (to the first stop token, as the engine counts them) and seconds, by
    `model.generate` over the same rows in batches of the engine's batch size."""
    tok = engine.tokenizer
    per_batch = max(1, engine.batch_size // k)  # whole prompts per batch: K rows each
    settings = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
        eos_token_id=list(engine.stop_ids), pad_token_id=engine.pad_id, num_return_sequences=k,
    )  # fmt: skip
    torch.manual_seed(0)
    tokens = 0
    t = time.perf_counter()
    for start in range(0, len(prompts), per_batch):
        ids = [tok.encode(p, add_special_tokens=False) for p in prompts[start : start + per_batch]]
        width = max(len(i) for i in ids)
        # On the model's device: generate does not move its inputs (a CUDA model fails on CPU tensors).
        input_ids = torch.tensor([[engine.pad_id] * (width - len(i)) + i for i in ids], device=engine.device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=engine.device)
        with torch.inference_mode():
            out = engine.model.generate(input_ids=input_ids, attention_mask=mask, **settings)
        for row in out[:, width:].tolist():
            cut = next((n for n, x in enumerate(row) if x in engine.stop_ids), None)
            tokens += len(row) if cut is None else cut + 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--prompts", type=int, default=8, help="prompts (at most 8)")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--sequential-prompts", type=int, default=1, help="prompts run one sequence at a time")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    batched = HFEngine(args.model, batch_size=args.batch_size)
    sequential = HFEngine(args.model, model=batched.model, tokenizer=batched.tokenizer, batch_size=1)
    prompts = [batched.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS[: args.prompts]]
    batched.generate(prompts[:1], n=2, max_new_tokens=4)  # warm-up

    out_b, t_b = run(batched, prompts, args.k, args.max_new_tokens)
    out_s, t_s = run(sequential, prompts[: args.sequential_prompts], args.k, args.max_new_tokens)
    tok_g, t_g = run_model_generate(batched, prompts, args.k, args.max_new_tokens)
    tok_b = sum(sum(g.num_tokens) for g in out_b)
    tok_s = sum(sum(g.num_tokens) for g in out_s)
    same = out_s == out_b[: args.sequential_prompts]
    stops = sum(r == "stop" for g in out_b for r in g.finish_reasons)
    result = {
        "benchmark": "rollout",
        "model": args.model,
        "machine": machine_info(),
        "device": str(batched.device),
        "dtype": str(batched.model.dtype),
        "prompts": len(prompts),
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "batched_s": t_b,
        "batched_tokens": tok_b,
        "batched_tokens_per_s": tok_b / t_b,
        "sequential_prompts": args.sequential_prompts,
        "sequential_s": t_s,
        "sequential_tokens": tok_s,
        "sequential_tokens_per_s": tok_s / t_s,
        "speedup": (tok_b / t_b) / (tok_s / t_s),
        "model_generate_s": t_g,
        "model_generate_tokens": tok_g,
        "model_generate_tokens_per_s": tok_g / t_g,
        "vs_model_generate": (tok_b / t_b) / (tok_g / t_g),
        "identical_samples_on_shared_rows": same,
        "stopped_at_eos": stops,
        "sample_texts": out_b[0].texts[:2],
    }
    print_table(
        [
            ("model", args.model),
            ("rows (prompts x K)", f"{len(prompts)} x {args.k}, max {args.max_new_tokens} new tokens"),
            (f"batched tokens/s (batch {args.batch_size})", result["batched_tokens_per_s"]),
            ("one-at-a-time tokens/s", result["sequential_tokens_per_s"]),
            ("speedup (goal >= 4)", result["speedup"]),
            ("model.generate tokens/s (same rows)", result["model_generate_tokens_per_s"]),
            ("vs model.generate (goal >= 1)", result["vs_model_generate"]),
            ("identical samples", same),
            ("rows stopped at eos", f"{stops}/{len(prompts) * args.k}"),
        ]
    )
    print("wrote", write_result(f"rollout_{args.model}", result))


if __name__ == "__main__":
    main()
