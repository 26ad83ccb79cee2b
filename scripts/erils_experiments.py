"""ERILS experiments on the embedded models: which arms help the tiny dLLM on Sudoku 4x4 and Countdown.

Each arm is a list of `dllm-rl train` overrides; every (task, arm, seed) is one run directory under --out,
trained from models/tiny-dllm, evaluated on held-out prompts before training and every 10 steps (greedy
pass@1, and 4 samples at the rollout temperature: sampled pass@1 and best-of-4). Finished runs are
skipped, so an interrupted sweep continues where it stopped. Prints a markdown table (mean and spread over
seeds) and writes JSON with every run's numbers and reward curve.

    python scripts/erils_experiments.py --tasks sudoku countdown --seeds 0 1
    python scripts/erils_experiments.py --arms grpo erils_ar --steps 10     # a quick look

Plot the runs with notebooks/evaluate.ipynb (DLLM_RL_RUNS=runs/erils/sudoku/grpo-s0,...).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dllm_rl import analysis  # noqa: E402
from dllm_rl.analysis import mean_spread as spread  # noqa: E402

AR = ["external=causal_lm"]
SOLVER = ["external=solver"]
# (a) ERILS vs GRPO, (b) separate vs joint, (c) length control, (d) solver vs AR as the external policy
ARMS: dict[str, list[str]] = {
    "grpo": ["external=none"],
    "erils_ar": AR,
    "erils_ar_joint": AR + ["mixing.processing=joint"],
    "erils_solver": SOLVER,
    "erils_solver_joint": SOLVER + ["mixing.processing=joint"],
    "erils_solver_uncontrolled": SOLVER + ["external.trace_steps=-1", "mixing.length_rule=none"],
    "erils_ar_mean_field": AR + ["mixing.likelihood=null"],
    # further options, in the second table of docs/erils.md
    "erils_solver_all_failed": SOLVER + ["mixing.trigger=all_failed"],
    "erils_solver_shaping": SOLVER + ["mixing.correction=shaping", "mixing.likelihood=null"],
    "erils_ar_is": AR + ["mixing.correction=is"],
}
DEFAULT_ARMS = {
    "sudoku": ["grpo", "erils_solver", "erils_solver_joint", "erils_solver_uncontrolled", "erils_ar"],
    "countdown": ["grpo", "erils_ar", "erils_ar_joint", "erils_solver"],
}


def run_dir(out: Path, task: str, arm: str, seed: int) -> Path:
    return out / task / f"{arm}-s{seed}"


def launch(path: Path, task: str, arm: str, seed: int, args: argparse.Namespace) -> float:
    command = [sys.executable, "-m", "dllm_rl.cli", "train", f"task={task}", f"seed={seed}", f"steps={args.steps}",
               f"run_dir={path}", f"eval_every={args.eval_every}", f"eval_prompts={args.eval_prompts}",
               "eval_samples=4", "tensorboard=false", *ARMS[arm], *args.overrides]
    if (path / "checkpoints").is_dir():  # an interrupted run: continue it
        command = [sys.executable, "-m", "dllm_rl.cli", "train", f"resume={path}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1"}
    start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.log", "w") as log:
        subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["sudoku", "countdown"])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="default: DEFAULT_ARMS of each task")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per run")
    parser.add_argument("--eval-every", type=int, default=15)
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--out", default="runs/erils")
    parser.add_argument("--json", default="docs/erils_experiments.json")
    parser.add_argument("--plot", default="docs/erils_rewards.png", help="reward curves per task and arm")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()

    out = Path(args.out)
    plan = [(task, arm, seed) for task in args.tasks for arm in (args.arms or DEFAULT_ARMS[task])
            for seed in args.seeds]
    todo = [p for p in plan if not analysis.finished(run_dir(out, *p), args.steps)]
    seconds: dict[tuple, float] = {}

    def work(item):
        print(f"running {' '.join(map(str, item))} ...", flush=True)
        seconds[item] = launch(run_dir(out, *item), *item, args)

    with ThreadPoolExecutor(args.jobs) as pool:  # each job is a subprocess with its own OMP threads
        list(pool.map(work, todo))

    results = []
    for task, arm, seed in plan:
        run = analysis.load_run(run_dir(out, task, arm, seed), name=f"{task}/{arm}/s{seed}")
        evals = analysis.eval_table(run)
        results.append({
            "task": task, "arm": arm, "seed": seed, "run_dir": str(run["path"]),
            "seconds": seconds.get((task, arm, seed)), "overrides": ARMS[arm] + args.overrides,
            "start": evals.iloc[0].drop("step").to_dict(), "end": evals.iloc[-1].drop("step").to_dict(),
            "reward_curve": analysis.series(run, "reward/on_policy").round(4).tolist(),
            "external_reward_curve": analysis.series(run, "reward/external").round(4).tolist(),
            "external_rows": analysis.series(run, "external/rows").tolist(),
        })

    header = ("| task | arm | seeds | greedy pass@1 start → end | sampled pass@1 end | best-of-4 start → end "
              "| train reward first 10 → last 10 steps |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    for task in args.tasks:
        for arm in args.arms or DEFAULT_ARMS[task]:
            rows = [r for r in results if r["task"] == task and r["arm"] == arm]
            col = lambda when, key: [r[when][key] for r in rows if key in r[when]]  # noqa: E731
            first = [sum(r["reward_curve"][:10]) / max(1, len(r["reward_curve"][:10])) for r in rows]
            last = [sum(r["reward_curve"][-10:]) / max(1, len(r["reward_curve"][-10:])) for r in rows]
            lines.append(f"| {task} | {arm} | {len(rows)} | {spread(col('start', 'eval/pass@1'))} → "
                         f"{spread(col('end', 'eval/pass@1'))} | {spread(col('end', 'eval/sampled_pass@1'))} | "
                         f"{spread(col('start', 'eval/best_of_4'))} → {spread(col('end', 'eval/best_of_4'))} | "
                         f"{spread(first)} → {spread(last)} |")
    table = "\n".join(lines)
    print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "steps": args.steps, "runs": results,
                                           "table": table}, indent=1) + "\n")
    print(f"wrote {args.json}")
    plot(results, args.tasks, args.plot)
    print(f"wrote {args.plot}")


def plot(results: list[dict], tasks: list[str], path: str) -> None:
    """On-policy training reward (rolling mean of 5 steps, averaged over seeds) per arm, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for arm in dict.fromkeys(r["arm"] for r in results if r["task"] == task):
            curves = [pd.Series(r["reward_curve"]) for r in results if r["task"] == task and r["arm"] == arm]
            mean = pd.concat(curves, axis=1).mean(axis=1).rolling(5, min_periods=1).mean()
            ax.plot(range(1, len(mean) + 1), mean, label=arm)
        ax.set_title(f"{task}: on-policy training reward (rolling 5, mean of seeds)")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
