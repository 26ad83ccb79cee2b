"""Training with exact against fast rollouts: the main job (`dllm-rl train`, the embedded models) for each seed,
once with the exact sampler and once with a fast one, reward curves and held-out greedy pass@1 side by side.

Held-out evaluation always decodes exactly (dllm_rl/run_setup.py), so the two arms are scored the same way; the
rollout seconds per step are the speed. Prints a table and writes JSON.

    python scripts/compare_samplers.py --seeds 0 1 --out docs/sampler_comparison.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import dllm_rl  # noqa: F401
from dllm_rl.analysis import eval_table, load_run, series
from dllm_rl.data import build_task
from dllm_rl.train import train

ARMS = {
    "exact": {},
    "fast": {"threshold": 0.9, "cache": "dual"},  # confidence-parallel decoding with the dual block cache
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--out", default="sampler_comparison.json")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as root:
        for seed in args.seeds:
            for arm in args.arms:
                run_dir = Path(root) / f"{arm}-{seed}"
                start = time.perf_counter()
                train(build_task("sudoku"), run_dir=str(run_dir), seed=seed, steps=args.steps, tensorboard=False,
                      checkpoint_every=0, rollout=ARMS[arm], print_fn=lambda *_: None)
                run = load_run(run_dir)
                evals = eval_table(run)
                runs.append({"arm": arm, "seed": seed, "seconds": time.perf_counter() - start,
                             "rollout_s_per_step": float(series(run, "perf/rollout_s").mean()),
                             "forwards_per_rollout": float(series(run, "rollout/forwards").mean()),
                             "reward": [float(v) for v in series(run, "reward/on_policy")],
                             "eval_steps": [int(s) for s in evals["step"]],
                             "eval_pass@1": [float(v) for v in evals["eval/pass@1"]]})
    print("| arm | seed | rollout s/step | forwards/rollout | reward first 10 -> last 10 | held-out pass@1 |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        first, last = statistics.mean(r["reward"][:10]), statistics.mean(r["reward"][-10:])
        print(f"| {r['arm']} | {r['seed']} | {r['rollout_s_per_step']:.2f} | {r['forwards_per_rollout']:.1f} | "
              f"{first:.3f} -> {last:.3f} | {' -> '.join(f'{v:.3f}' for v in r['eval_pass@1'])} |")
    result = {"arms": {a: ARMS[a] for a in args.arms}, "steps": args.steps, "task": "sudoku",
              "machine": f"{platform.machine()} {platform.processor()}", "threads": torch.get_num_threads(),
              "torch": torch.__version__, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
