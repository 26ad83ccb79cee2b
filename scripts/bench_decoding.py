"""Decoding-mode benchmark: the exact denoising sampler against confidence-parallel decoding, speed and quality.

For each mode and generation length it samples greedy completions of `--prompts` held-out prompts of each task
(Sudoku and Countdown, the embedded dLLM's tasks) in batches of `--batch`, and reports generated tokens per
second, forward passes per generated token, and greedy pass@1. The baseline is the exact sampler with one token
per step (`steps = gen_length`); the speedups are ratios to it, measured in the same run. Modes:

- `exact`: one token per step (the reference);
- `exact/2`: two tokens per step (the `rl` rollout config's ratio);
- `threshold=t`: every token of the block at least t confident, at least one per step (Fast-dLLM);
- `factor=f`: Fast-dLLM's factor rule;
- `prefix`, `dual`: one token per step with the block cache (refreshed at each block's start), which runs the
  block and what follows it (prefix) or the block alone (dual) between refreshes;
- `prefix+threshold=t`, `dual+threshold=t`: both;
- `dual/refresh=n+threshold=t`: both, the cache also refreshed every n steps inside a block.

Prints a table and writes JSON.

    python scripts/bench_decoding.py --out docs/bench_decoding.json
    python scripts/bench_decoding.py --gen-lengths 256 --prompts 32 --max-context 512 --out docs/bench_decoding_256.json

The embedded model's context is 256 tokens, so a 256-token window after a prompt needs `--max-context`: it
lifts the declared limit (rotary positions have no table), for speed only; the model never saw such positions.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import dllm_rl  # noqa: F401
from dllm_rl.data import build_task
from dllm_rl.evaluate import evaluate_task
from dllm_rl.policy.adapters import load_policy
from dllm_rl.rollout.generate import TextGenerator

MODES = {
    "exact": lambda C: {"steps": C},
    "exact/2": lambda C: {"steps": C // 2},
    "threshold=0.9": lambda C: {"steps": C, "threshold": 0.9},
    "threshold=0.7": lambda C: {"steps": C, "threshold": 0.7},
    "factor=1.0": lambda C: {"steps": C, "factor": 1.0},
    "prefix": lambda C: {"steps": C, "cache": "prefix"},
    "dual": lambda C: {"steps": C, "cache": "dual"},
    "prefix+threshold=0.9": lambda C: {"steps": C, "cache": "prefix", "threshold": 0.9},
    "dual+threshold=0.9": lambda C: {"steps": C, "cache": "dual", "threshold": 0.9},
    "dual+threshold=0.95": lambda C: {"steps": C, "cache": "dual", "threshold": 0.95},
    "dual/refresh=4+threshold=0.9": lambda C: {"steps": C, "cache": "dual", "cache_refresh": 4, "threshold": 0.9},
    "dual/refresh=2+threshold=0.9": lambda C: {"steps": C, "cache": "dual", "cache_refresh": 2, "threshold": 0.9},
}


class Counting:
    """A TextGenerator that adds up forward passes and generated tokens."""

    def __init__(self, generator: TextGenerator):
        self.generator, self.row_forwards, self.tokens = generator, 0, 0

    def __call__(self, prompts, seeds):
        samples = self.generator.sample(prompts, seeds)
        self.row_forwards += samples.forwards * len(prompts)  # each row rides along every forward of its batch
        self.tokens += samples.completion_BC.numel()
        return self.generator.completions(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/tiny-dllm")
    parser.add_argument("--tasks", nargs="+", default=["sudoku", "countdown"])
    parser.add_argument("--gen-lengths", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--max-context", type=int, default=None, help="lift the model's declared context (speed only)")
    parser.add_argument("--out", default="bench_decoding.json")
    args = parser.parse_args()
    policy, tokenizer = load_policy(args.model)
    if args.max_context:
        policy.model.config.max_position_embeddings = args.max_context
    rows = []
    for gen_length in args.gen_lengths:
        for task_name in args.tasks:
            task = build_task(task_name)
            for mode in dict.fromkeys(["exact", *args.modes]):  # the baseline first
                settings = MODES[mode]
                generator = TextGenerator(policy, tokenizer, gen_length=gen_length, block_length=args.block_length,
                                          temperature=0.0, **settings(gen_length))
                counting = Counting(generator)
                start = time.perf_counter()
                summary, _ = evaluate_task(counting, task, num_prompts=args.prompts, batch_size=args.batch, seed=0,
                                           print_fn=lambda *_: None)
                seconds = time.perf_counter() - start
                rows.append({"task": task_name, "gen_length": gen_length, "mode": mode, "seconds": seconds,
                             "tokens_per_s": counting.tokens / seconds,
                             "forwards_per_token": counting.row_forwards / counting.tokens,
                             "pass@1": summary["pass@1"]})
    for row in rows:
        base = next(r for r in rows
                    if (r["task"], r["gen_length"], r["mode"]) == (row["task"], row["gen_length"], "exact"))
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["pass@1_change"] = row["pass@1"] - base["pass@1"]
    print("| task | gen length | mode | tokens/s | forwards/token | speedup | pass@1 | change |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['gen_length']} | {r['mode']} | {r['tokens_per_s']:.0f} | "
              f"{r['forwards_per_token']:.3f} | {r['speedup']:.2f}x | {r['pass@1']:.3f} | {r['pass@1_change']:+.3f} |")
    result = {"model": args.model, "batch": args.batch, "prompts": args.prompts, "block_length": args.block_length,
              "machine": f"{platform.machine()} {platform.processor()}", "threads": torch.get_num_threads(),
              "torch": torch.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
