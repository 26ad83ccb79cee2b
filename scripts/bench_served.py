"""The served external policy: ERILS with the tiny AR model in the trainer's process (`external=causal_lm`) against
the same model behind `transformers serve` (`external=openai`), its requests started at the external stage or
prefetched before the dLLM's rollouts; and whether a few long completions hold a step up (RollVerify's problem).

Each arm is one `dllm-rl train` run (its own process) on Sudoku or Countdown with the embedded models and the default
ERILS settings, for --steps steps after --warmup left out. The server is started once, on a free loopback port,
with one torch thread (the trainer gets the rest). Per arm: seconds per step (the sum of the step's phases), the
external stage's seconds, the seconds it waited for requests, the mean and the slowest request's seconds, and the
ratio of the step to the in-process baseline (same run). Long tail: the share of the wait for requests that the
slowest request alone explains, (slowest - mean request) / waited seconds, where a wait is left (without
prefetch); with prefetch, whether any wait is left at all. Prints a table and writes JSON.

    python scripts/bench_served.py --out docs/bench_served.json
    python scripts/bench_served.py --task countdown --out docs/bench_served_countdown.json
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
from dllm_rl.external.local_server import TransformersServe  # noqa: E402

PHASES = ("perf/rollout_s", "perf/external_s", "perf/score_s", "perf/update_s")
KEYS = {"rollout_s": "perf/rollout_s", "external_s": "perf/external_s", "wait_s": "external/wait_s",
        "request_s": "external/request_s", "request_max_s": "external/request_max_s",
        "candidate_len": "external/candidate_len", "rows": "external/rows", "failed": "external/failed_requests"}


def arms(server: TransformersServe) -> dict[str, list[str]]:
    served = ["external=openai", f"external.base_url={server.base_url}", f"external.model={server.model}"]
    return {"causal_lm (in process)": ["external=causal_lm"],
            "openai, requests at the external stage": [*served, "external.prefetch=false"],
            "openai, prefetched": [*served, "external.prefetch=true"]}


def run_arm(name: str, overrides: list[str], args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    run_dir = scratch / str(abs(hash(name)))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1"}
    command = [sys.executable, "-m", "dllm_rl.cli", "train", f"run_dir={run_dir}", f"task={args.task}",
               f"steps={args.steps + args.warmup}", f"seed={args.seed}", "eval_every=0", "checkpoint_every=0",
               "sample_every=0", "tensorboard=false", *overrides, *args.overrides]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    metrics = analysis.load_run(run_dir)["metrics"]
    steps = metrics[metrics["step"] > args.warmup]
    result = {"step_s": float(sum(steps[k].fillna(0.0) for k in PHASES if k in steps).mean())}
    for key, column in KEYS.items():
        result[key] = float(steps[column].mean()) if column in steps else 0.0
    return result


def table(results: dict[str, dict[str, float]]) -> str:
    base = next(iter(results.values()))["step_s"]
    lines = ["| arm | s / step | x in-process | dLLM rollouts s | external stage s | waited s | mean request s "
             "| slowest request s | tail share |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        # the tail's share of the wait, where there is one to explain (no prefetch, or a prefetch that did not hide it)
        tail = (f"{(r['request_max_s'] - r['request_s']) / r['wait_s']:.2f}" if r["wait_s"] > 0.05 else "-")
        lines.append(f"| {name} | {r['step_s']:.2f} | {base / r['step_s']:.2f} | {r['rollout_s']:.2f} | "
                     f"{r['external_s']:.2f} | {r['wait_s']:.2f} | {r['request_s']:.3f} | "
                     f"{r['request_max_s']:.3f} | {tail} |"
                     if r["request_s"] else
                     f"| {name} | {r['step_s']:.2f} | {base / r['step_s']:.2f} | {r['rollout_s']:.2f} | "
                     f"{r['external_s']:.2f} | - | - | - | - |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="sudoku")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="the trainer's torch threads")
    parser.add_argument("--out", default="docs/bench_served.json")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every arm")
    args = parser.parse_args()

    server = TransformersServe(ROOT / "models" / "tiny-ar")
    try:
        results = {}
        with tempfile.TemporaryDirectory() as scratch:
            for name, overrides in arms(server).items():
                started = time.perf_counter()
                results[name] = run_arm(name, overrides, args, Path(scratch))
                print(f"{name}: {results[name]['step_s']:.2f} s/step ({time.perf_counter() - started:.0f} s)",
                      flush=True)
    finally:
        server.stop()
    text = table(results)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(["python", "scripts/bench_served.py", *sys.argv[1:]]),
                               "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                               "steps": args.steps, "warmup": args.warmup, "task": args.task, "results": results,
                               "table": text}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
