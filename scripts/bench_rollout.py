"""Rollout benchmark: denoising-sampler throughput of a dLLM, fp32 against bf16, with model FLOPs utilisation.

For each batch size, generation length and precision it times `denoise` (one token unmasked per step, one
block per 32 tokens) and reports milliseconds per denoising step, generated tokens per second, and MFU:
the model's matmul FLOPs per second divided by the peak of a large matmul measured in the same run and
precision. Prints a table and writes JSON.

    python scripts/bench_rollout.py --model models/tiny-dllm --out bench_rollout.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import dllm_rl  # noqa: F401
from dllm_rl.policy.adapters import load_policy
from dllm_rl.rollout.sampler import denoise

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of an n x n matmul (best of `repeats`)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def forward_flops(config, batch: int, length: int) -> float:
    """Matmul FLOPs of one forward pass: linear layers (2 per weight per token) plus attention scores and
    values (2 * 2 * L^2 * d per layer and row)."""
    d, f, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    per_token = layers * (3 * d * d + d * d + 2 * d * f + f * d) + d * vocab
    return 2 * batch * length * per_token + layers * 4 * batch * length**2 * d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/tiny-dllm")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--gen-lengths", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--prompt-length", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench_rollout.json")
    args = parser.parse_args()

    policy, _ = load_policy(args.model)
    config = policy.model.config
    peaks = {name: matmul_peak(dtype) for name, dtype in DTYPES.items()}
    rows = []
    for name, dtype in DTYPES.items():
        for batch in args.batch_sizes:
            for gen_length in args.gen_lengths:
                prompt = torch.randint(5, config.vocab_size, (batch, args.prompt_length))
                settings = dict(gen_length=gen_length, block_length=min(32, gen_length), steps=gen_length)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
                    denoise(policy, prompt, **settings)  # warm-up
                    best = float("inf")
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        denoise(policy, prompt, **settings)
                        best = min(best, time.perf_counter() - start)
                flops = gen_length * forward_flops(config, batch, args.prompt_length + gen_length)
                rows.append({
                    "precision": name, "batch": batch, "gen_length": gen_length, "steps": gen_length,
                    "ms_per_step": 1000 * best / gen_length, "tokens_per_s": batch * gen_length / best,
                    "model_gflops_per_s": flops / best / 1e9, "mfu": flops / best / peaks[name],
                })
                r = rows[-1]
                print(f"{name:5s} B={batch:3d} C={gen_length:4d}  {r['ms_per_step']:8.2f} ms/step  "
                      f"{r['tokens_per_s']:9.1f} tok/s  {r['model_gflops_per_s']:7.1f} GFLOP/s  MFU {r['mfu']:.3f}")
    result = {
        "model": args.model, "parameters": policy.model.num_parameters(), "prompt_length": args.prompt_length,
        "machine": f"{platform.machine()} {platform.processor()}", "threads": torch.get_num_threads(),
        "torch": torch.__version__, "matmul_peak_gflops": {k: v / 1e9 for k, v in peaks.items()}, "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("matmul peak GFLOP/s: " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peaks.items()) + f"; wrote {args.out}")


if __name__ == "__main__":
    main()
