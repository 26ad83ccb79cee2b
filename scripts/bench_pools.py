"""Heterogeneous worker pools: one worker decoding with the fast sampler (confidence-parallel, threshold 0.9) beside
one decoding exactly, each pool's logged throughput, utilisation and lag; and what sharing a synchronous step by the
measured throughputs (the plan's figures) buys over an even split.

Three `dllm-rl train` runs (each its own process and local Ray) on Sudoku with the embedded models, for --steps
steps after --warmup left out, every process on one torch thread: (1) asynchronous (S = 1): each group goes to
whichever worker is free, so the pools' throughputs are measured without a split imposed; (2) synchronous, the
groups split evenly between the two workers; (3) synchronous, split by the throughputs run (1) measured
(`workers.pools.<name>.throughput`). Per run: seconds per step and in the rollout phase, and the ratio of (3)'s
rollout phase to (2)'s (same script, same machine); per pool: rollouts per step, rollouts/s of one worker while
generating, utilisation, mean lag. Prints a table and writes JSON.

    python scripts/bench_pools.py --out docs/bench_pools.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dllm_rl import analysis  # noqa: E402
from dllm_rl.workers.plan import flow  # noqa: E402

PHASES = ("perf/rollout_s", "perf/external_s", "perf/score_s", "perf/update_s")
COMMON = ["task=sudoku", "eval_every=0", "checkpoint_every=0", "sample_every=0", "tensorboard=false",
          "sampler_correction.mode=weight", "workers.timeout_s=300"]
POOLS = {"fast": {"count": 1, "threads": 1, "sampler": {"threshold": 0.9}}, "exact": {"count": 1, "threads": 1}}


def run(name: str, pools: dict, extra: list[str], args: argparse.Namespace, scratch: Path) -> dict:
    """One run's means after the warmup: seconds per step and rollout phase, and each pool's metrics."""
    run_dir = scratch / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "TMPDIR": tempfile.mkdtemp(prefix="b", dir="/tmp")}
    command = [sys.executable, "-m", "dllm_rl.cli", "train", f"run_dir={run_dir}", f"steps={args.steps + args.warmup}",
               f"seed={args.seed}", *COMMON, f"workers.pools={flow(pools)}", *extra]
    started = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    metrics = analysis.load_run(run_dir)["metrics"]
    steps = metrics[metrics["step"] > args.warmup]
    mean = lambda key: float(steps[key].mean()) if key in steps else 0.0  # noqa: E731
    result = {"step_s": float(sum(steps[k].fillna(0.0) for k in PHASES if k in steps).mean()),
              "rollout_s": mean("perf/rollout_s"), "pools": {}}
    for pool in pools:
        result["pools"][pool] = {k: mean(f"pool/{pool}/{k}") for k in ("rollouts", "throughput", "utilisation",
                                                                         "lag_mean")}
    print(f"{name}: {result['step_s']:.2f} s/step ({time.perf_counter() - started:.0f} s)", flush=True)
    return result


def table(results: dict[str, dict]) -> str:
    even = results["synchronous, even split"]["rollout_s"]
    lines = ["| run | s / step | rollout phase s | x even split | pool | rollouts / step | rollouts/s per worker "
             "| utilisation | mean lag |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for i, (pool, p) in enumerate(r["pools"].items()):
            head = (f"| {name} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['rollout_s'] / even:.2f} "
                    if i == 0 else "| | | | ")
            lines.append(f"{head}| {pool} | {p['rollouts']:.1f} | {p['throughput']:.2f} | {p['utilisation']:.2f} | "
                         f"{p['lag_mean']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/bench_pools.json")
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        results["asynchronous (S = 1)"] = run("async", POOLS, ["workers.max_staleness=1"], args, Path(scratch))
        results["synchronous, even split"] = run("even", POOLS, [], args, Path(scratch))
        measured = {name: {**spec, "throughput": round(results["asynchronous (S = 1)"]["pools"][name]["throughput"], 3)}
                    for name, spec in POOLS.items()}
        results["synchronous, split by measured throughput"] = run("weighted", measured, [], args, Path(scratch))
    text = table(results)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(["python", "scripts/bench_pools.py", *sys.argv[1:]]),
                               "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                               "steps": args.steps, "warmup": args.warmup, "pools": POOLS,
                               "measured_throughput": {k: v["throughput"] for k, v in measured.items()},
                               "results": results, "table": text}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
