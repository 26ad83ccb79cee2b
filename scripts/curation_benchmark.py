"""Rollout curation on the embedded models: each strategy against plain GRPO on Sudoku 4x4 and Countdown.

Every (task, strategy, seed) is one `dllm-rl train` run from models/tiny-dllm (on-policy GRPO, no external
rollouts, a small train pool so that GRESO's and SERA's epochs pass within the run), evaluated on held-out
prompts before training and every --eval-every steps (greedy pass@1; 4 samples at the rollout temperature:
best-of-4). For each run it reads the rollouts generated, the share of flat (zero-variance) groups trained on,
the wall-clock of a step (rollout, scoring, update), and the held-out numbers at the end, at the plain run's
rollout budget and at its wall-clock (the last evaluation before the strategy has spent as much). Finished runs
are skipped, so an interrupted sweep continues: each finished run's numbers are kept as a small JSON under
--keep (committed with the docs, so a sweep longer than one machine's life continues on the next), and a kept
run whose settings differ from this call's is run again. Prints a markdown table (mean ± spread over seeds) and
writes JSON with every run's numbers.

    python scripts/curation_benchmark.py --tasks sudoku countdown --seeds 0 1 --steps 100
    python scripts/curation_benchmark.py --strategies none greso --steps 4 --eval-every 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts"))

from dllm_rl import analysis  # noqa: E402
from sweep import run_all  # noqa: E402
from dllm_rl.analysis import mean_spread as spread  # noqa: E402

STRATEGIES: dict[str, list[str]] = {
    "none": ["curation=none"],
    "greso": ["curation=greso"],
    "dynamic_sampling": ["curation=dynamic_sampling"],
    "greso+dynamic_sampling": ["curation=[greso,dynamic_sampling]"],
    "sera": ["curation=sera", "algo.advantage=maxrl"],
    "darts": ["curation=darts"],
}
# every run: plain GRPO on the dLLM's own rollouts, 8 prompts of 6 rollouts a step from a pool of 64 prompts
# (an epoch every 8 steps), the fast sampler (confidence-parallel decoding at 0.9)
COMMON = ["external=none", "prompts_per_step=8", "group_size=6", "train_pool=64", "rollout.threshold=0.9",
          "checkpoint_every=50", "sample_every=0", "tensorboard=false"]
PHASES = ("perf/rollout_s", "perf/external_s", "perf/score_s", "perf/update_s")


def run_dir(out: Path, task: str, strategy: str, seed: int) -> Path:
    return out / task / f"{strategy}-s{seed}"


def overrides(task: str, strategy: str, seed: int, args: argparse.Namespace) -> list[str]:
    return [f"task={task}", f"seed={seed}", f"steps={args.steps}", f"eval_every={args.eval_every}",
            f"eval_prompts={args.eval_prompts}", "eval_samples=4", *COMMON, *STRATEGIES[strategy], *args.overrides]


def numbers(path: Path, rollouts_per_step: int) -> dict:
    """One run's per-step spend and its held-out evaluations."""
    metrics = analysis.load_run(path)["metrics"]
    steps = metrics[metrics["step"] > 0].sort_values("step")
    generated = (steps["curation/rollouts_generated"] if "curation/rollouts_generated" in steps
                 else steps["step"] * 0 + rollouts_per_step).fillna(rollouts_per_step)
    seconds = sum(steps[k].fillna(0.0) for k in PHASES if k in steps)
    evals = metrics[metrics["eval/pass@1"].notna()][["step", "eval/pass@1", "eval/best_of_4"]]
    return {"steps": steps["step"].astype(int).tolist(), "generated": generated.astype(float).tolist(),
            "seconds": seconds.astype(float).tolist(),
            "zero_std_groups": float(steps["reward/zero_std_groups"].mean()),
            "evals": evals.to_dict("records")}


def settings(task: str, strategy: str, seed: int, args: argparse.Namespace) -> dict:
    """What makes two runs the same run (a kept run with other settings is run again)."""
    return {"task": task, "strategy": strategy, "seed": seed, "steps": args.steps, "eval_every": args.eval_every,
            "eval_prompts": args.eval_prompts, "overrides": COMMON + STRATEGIES[strategy] + args.overrides}


def at_spend(run: dict, cumulative: list[float], limit: float) -> dict:
    """The last evaluation at a step whose cumulative spend is within `limit`."""
    within = {0} | {s for s, c in zip(run["steps"], cumulative) if c <= limit * (1 + 1e-9)}
    return [e for e in run["evals"] if int(e["step"]) in within][-1]


def cumsum(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["sudoku", "countdown"])
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per run")
    parser.add_argument("--eval-every", type=int, default=20,
                        help="held-out evaluations (each costs about 5 x eval-prompts generations)")
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--out", default="runs/curation")
    parser.add_argument("--json", default="docs/curation_benchmark.json")
    parser.add_argument("--keep", default="docs/curation_benchmark", help="each finished run's numbers")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    if "none" not in args.strategies:
        args.strategies = ["none", *args.strategies]  # the baseline every ratio is taken against

    out, keep_dir = Path(args.out), Path(args.keep)
    plan = [(task, s, seed) for task in args.tasks for s in args.strategies for seed in args.seeds]
    kept_path = {p: keep_dir / p[0] / f"{p[1]}-s{p[2]}.json" for p in plan}
    started = time.perf_counter()
    per_step = 8 * 6
    runs = run_all(plan, kept_path, lambda *p: settings(*p, args), lambda *p: run_dir(out, *p),
                   lambda *p: overrides(*p, args), lambda path: numbers(path, per_step), args.steps, args.threads,
                   args.jobs)

    results = []
    for task, strategy, seed in plan:
        run, base = runs[(task, strategy, seed)], runs[(task, "none", seed)]
        spent, took = cumsum(run["generated"]), cumsum(run["seconds"])
        results.append({
            "task": task, "strategy": strategy, "seed": seed, "run_dir": str(run_dir(out, task, strategy, seed)),
            "overrides": COMMON + STRATEGIES[strategy] + args.overrides,
            "rollouts": spent[-1], "seconds_per_step": took[-1] / len(took), "zero_std_groups": run["zero_std_groups"],
            "start": run["evals"][0], "end": run["evals"][-1],
            "equal_rollouts": at_spend(run, spent, sum(base["generated"])),
            "equal_time": at_spend(run, took, sum(base["seconds"])),
        })

    lines = ["| task | strategy | seeds | rollouts (x plain) | s/step (x plain) | flat groups | greedy pass@1 end "
             "| best-of-4 end | pass@1 at plain's rollouts | pass@1 at plain's time |", "|---" * 10 + "|"]
    for task in args.tasks:
        for strategy in args.strategies:
            rows = [r for r in results if r["task"] == task and r["strategy"] == strategy]
            base = {r["seed"]: r for r in results if r["task"] == task and r["strategy"] == "none"}
            ratio = lambda key: [r[key] / base[r["seed"]][key] for r in rows]  # noqa: E731
            lines.append(
                f"| {task} | {strategy} | {len(rows)} | {spread(ratio('rollouts'), 2)} | "
                f"{spread(ratio('seconds_per_step'), 2)} | {spread([r['zero_std_groups'] for r in rows])} | "
                f"{spread([r['end']['eval/pass@1'] for r in rows])} | "
                f"{spread([r['end']['eval/best_of_4'] for r in rows])} | "
                f"{spread([r['equal_rollouts']['eval/pass@1'] for r in rows])} | "
                f"{spread([r['equal_time']['eval/pass@1'] for r in rows])} |")
    table = "\n".join(lines)
    print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "steps": args.steps,
                                           "sweep_seconds": time.perf_counter() - started, "runs": results,
                                           "table": table}, indent=1, default=float) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
