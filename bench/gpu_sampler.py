"""The project's in-process sampler against transformers' `model.generate` on one GPU (issue #43 item 5's
ratio): bench/bench_rollout.py's comparison, at a Qwen3-8B shape with random weights.

    python -m bench.gpu_sampler [--out PATH]   # on one GPU (bench/gpu_smoke.sh runs it offline)
    python -m bench.gpu_sampler --tiny         # the same code at gpu_step's tiny shape, on the CPU

The model is bench/gpu_step.py's (built on the GPU in bf16 from a `Qwen3Config`, its synthetic word-level
tokenizer), wrapped in `HFEngine` as the training stages wrap a loaded model. One prompt of 512 tokens, n = 8
samples, 256 new tokens, temperature 1, in one batch of 8 rows: `bench_rollout.run` times the engine's
`generate`, `bench_rollout.run_model_generate` times `model.generate` on the same rows with the same model
object in the same process; both once with 4 tokens first (CUDA's first-call costs). A random model almost
rarely samples its stop token, so both sample (almost) every row to full length; the ratio is
of tokens per second either way. Writes one JSON and prints one last
line, `gpu_sampler: OK ...` (tokens/s of both and their ratio; no bound: the ratio is a measurement) or
`gpu_sampler: FAIL: ...` (exit 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import RESULTS, machine_info, one_line, write_verdict
from bench.bench_rollout import run, run_model_generate
from bench.gpu_step import QWEN3_8B, TINY, build_model, build_tokenizer


def settings(tiny: bool) -> dict[str, int]:
    """The issue's shape (one 512-token prompt, n = 8, 256 new tokens); tiny: seconds on a CPU."""
    if tiny:
        return {"prompt_tokens": 16, "n": 4, "max_new_tokens": 8}
    return {"prompt_tokens": 512, "n": 8, "max_new_tokens": 256}


def measure(device: torch.device, tiny: bool, result: dict[str, Any]) -> None:
    """Build the model, run both samplers on the same rows, fill `result`."""
    from dynamicrubric.engines import HFEngine

    shape = TINY if tiny else QWEN3_8B
    s = settings(tiny)
    result.update(shape="tiny" if tiny else "qwen3-8b", model_config=shape, settings=s)
    started = time.perf_counter()
    tokenizer = build_tokenizer(shape["vocab_size"])
    model = build_model(shape, tokenizer, device)
    result["build_s"] = time.perf_counter() - started
    # All n rows in one batch: one prompt's prefill shared by its n rows (the engine), one generate call
    # with num_return_sequences = n (transformers).
    engine = HFEngine("random-" + result["shape"], model=model, tokenizer=tokenizer, batch_size=s["n"])
    prompts = [" ".join(f"w{i}" for i in range(s["prompt_tokens"]))]
    result["prompt_token_count"] = len(tokenizer.encode(prompts[0], add_special_tokens=False))
    result["dtype"] = str(model.dtype)
    run(engine, prompts, 2, 4)  # warm-up of both paths: kernels, cuBLAS handles, the allocator
    run_model_generate(engine, prompts, 2, 4)
    out, engine_s = run(engine, prompts, s["n"], s["max_new_tokens"])
    engine_tokens = sum(sum(g.num_tokens) for g in out)
    result["engine_rows_stopped_early"] = sum(r == "stop" for g in out for r in g.finish_reasons)
    generate_tokens, generate_s = run_model_generate(engine, prompts, s["n"], s["max_new_tokens"])
    result.update(
        engine_s=engine_s,
        engine_tokens=engine_tokens,
        engine_tokens_per_s=engine_tokens / engine_s,
        model_generate_s=generate_s,
        model_generate_tokens=generate_tokens,
        model_generate_tokens_per_s=generate_tokens / generate_s,
        vs_model_generate=(engine_tokens / engine_s) / (generate_tokens / generate_s),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_sampler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_sampler.json")
    parser.add_argument("--tiny", action="store_true", help="gpu_step's 2-layer, hidden-64 shape on the CPU")
    a = parser.parse_args(argv)
    if not a.tiny and not torch.cuda.is_available():
        print("gpu_sampler: FAIL: torch sees no CUDA device (use --tiny for a CPU dry run)")
        return 1
    device = torch.device("cpu") if a.tiny else torch.device("cuda", 0)
    result: dict[str, Any] = {"benchmark": "sampler", "device": str(device), "machine": machine_info()}
    try:
        measure(device, a.tiny, result)
        problems = [f"{k} is 0" for k in ("engine_tokens", "model_generate_tokens") if not result[k]]
    except Exception as e:  # said in one line; the JSON keeps what was measured
        problems = [one_line(e)]
    if not write_verdict("gpu_sampler", a.out, result, problems):
        return 1
    s = result["settings"]
    print(
        f"gpu_sampler: OK {result['shape']} on {result['device']}, 1 x {result['prompt_token_count']}-token prompt, "
        f"n {s['n']}, {s['max_new_tokens']} new: engine {result['engine_tokens_per_s']:.1f} tokens/s, "
        f"model.generate {result['model_generate_tokens_per_s']:.1f} tokens/s, "
        f"ratio {result['vs_model_generate']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
