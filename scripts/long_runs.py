"""The long runs: on-policy GRPO against ERILS, alone and with each rollout-curation strategy that decides which
rollouts teach, on Sudoku 4x4 and Countdown with the embedded models.

Every (task, arm, seed) is one `dllm-rl train` run from models/tiny-dllm with the fast sampler (confidence-parallel
decoding at 0.9, measured within noise of the exact one in docs/benchmarks.md), evaluated before training and every
--eval-every steps on --eval-prompts held-out prompts: greedy pass@1, best-of-4 at the rollout temperature, and with
an external policy the provenance split (pass@1 on the prompts it solves / fails). Arms: `grpo` (external=none),
`erils` (the default: the task's solver as the external policy), `erils+greso` (part 1's choice: no strategy of
part 1 was a gain, and GRESO was the cheapest at equal outcome on Sudoku, docs/curation.md), and ERILS with each
strategy after the rewards
(`grpo_dropout`, `echo`, `hindsight`, `bandit`).

Resumable: an interrupted run continues from its last checkpoint, and each finished run's numbers are kept as a
small JSON under --keep (committed with the docs, so a sweep longer than one machine's life continues on the
next; a kept run whose settings differ is run again). Prints a markdown table (mean ± standard error over seeds,
and each arm's difference from `erils` with its standard error, flagged where larger than twice it), writes JSON
with every run's numbers, and a plot of held-out greedy pass@1 against steps.

    python scripts/long_runs.py                                    # 2 tasks x 7 arms x 3 seeds x 150 steps
    python scripts/long_runs.py --tasks sudoku --arms grpo erils --seeds 0 --steps 4 --eval-every 2   # a quick look
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts"))

from dllm_rl import analysis  # noqa: E402
from sweep import add_arguments, run_all, write_report  # noqa: E402

ARMS: dict[str, list[str]] = {
    "grpo": ["external=none"],
    "erils": [],
    # under ERILS every group has kept external rows (trigger=always), which GRESO's default exempts from counting
    # as flat: it would skip nothing and repeat the erils run (seed 0 of Sudoku, docs/long_runs.md)
    "erils+greso": ["curation=greso", "curation.greso.exempt_external=false"],
    "erils+grpo_dropout": ["curation=grpo_dropout"],
    "erils+echo": ["curation=echo"],
    "erils+hindsight": ["curation=hindsight"],
    "erils+bandit": ["curation=bandit"],
}
# every run: 8 prompts of 6 rollouts a step from a pool of 200 (an epoch every 25 steps, so GRESO revisits prompts),
# the fast sampler, a checkpoint every 25 steps
COMMON = ["prompts_per_step=8", "group_size=6", "train_pool=200", "rollout.threshold=0.9", "checkpoint_every=25",
          "sample_every=0", "tensorboard=false", "eval_samples=4"]
# per task: Countdown at Sudoku's lr (1e-4) collapsed in every arm by step 15 (the format rate 1 -> 0 after a
# gradient spike); three 50-step GRPO checks held it at 1.0 with lr=2e-5 or algo.beta=0.04 (docs/long_runs.md):
# the smaller step, which adds no reference model and leaves the algorithm as Sudoku's
TASK_OVERRIDES: dict[str, list[str]] = {"sudoku": [], "countdown": ["lr=2.0e-5"]}
# per task, arms with an external policy: the Countdown solver writes its answers in the embedded dLLM's own
# format (`aligned`: 83 -64 -4); its default (`free`: 83-64-4) collapsed ERILS at lr 2e-5 by step 50, aligned held
# the format through 80 steps (docs/long_runs.md). `aligned_first` writes that format for every solvable instance
# (aligned where it can, else any order, spaced alike), as the current embedded dLLM's last SFT phase did; `aligned`
# declined the ~40% without an aligned answer, which the previous model could not write either
EXTERNAL_TASK_OVERRIDES: dict[str, list[str]] = {"sudoku": [], "countdown": ["task.solver_style=aligned_first"]}
PHASES = ("perf/rollout_s", "perf/external_s", "perf/score_s", "perf/update_s")
EVALS = ("eval/pass@1", "eval/best_of_4", "eval/pass1_external_solved", "eval/pass1_external_failed")


def run_dir(out: Path, task: str, arm: str, seed: int) -> Path:
    return out / task / f"{arm}-s{seed}"


def settings(task: str, arm: str, seed: int, args: argparse.Namespace) -> dict:
    """What makes two runs the same run (a kept run with other settings is run again)."""
    return {"task": task, "arm": arm, "seed": seed, "steps": args.steps, "eval_every": args.eval_every,
            "eval_prompts": args.eval_prompts, "overrides": run_overrides(task, arm, args)}


def overrides(task: str, arm: str, seed: int, args: argparse.Namespace) -> list[str]:
    return [f"task={task}", f"seed={seed}", f"steps={args.steps}", f"eval_every={args.eval_every}",
            f"eval_prompts={args.eval_prompts}", *run_overrides(task, arm, args)]


def run_overrides(task: str, arm: str, args: argparse.Namespace) -> list[str]:
    external = [] if "external=none" in ARMS[arm] else EXTERNAL_TASK_OVERRIDES.get(task, [])
    return COMMON + TASK_OVERRIDES.get(task, []) + external + ARMS[arm] + args.overrides


def numbers(path: Path) -> dict:
    """One run's rollouts and seconds per step, and its held-out evaluations."""
    metrics = analysis.load_run(path)["metrics"]
    steps = metrics[metrics["step"] > 0].sort_values("step")
    rollouts = steps.get("curation/rollouts_generated", steps["rollouts/on_policy"]).fillna(steps["rollouts/on_policy"])
    external = steps["external/candidates"].fillna(0.0) if "external/candidates" in steps else rollouts * 0
    evals = metrics[metrics["eval/pass@1"].notna()]
    return {"steps": steps["step"].astype(int).tolist(), "rollouts": rollouts.astype(float).tolist(),
            "external": external.astype(float).tolist(),
            "seconds": sum(steps[k].fillna(0.0) for k in PHASES if k in steps).astype(float).tolist(),
            "evals": [{"step": int(e["step"]), **{k: float(e[k]) for k in EVALS if k in e and e[k] == e[k]}}
                      for e in evals.to_dict("records")]}


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error over seeds (0 with one seed)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def cell(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    mean, se = mean_se(values)
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def summary(results: list[dict], task: str, arm: str) -> dict:
    rows = [r for r in results if r["task"] == task and r["arm"] == arm]
    end = lambda key: [r["end"][key] for r in rows if key in r["end"]]  # noqa: E731
    return {"rows": rows, "pass1": end("eval/pass@1"), "best4": end("eval/best_of_4"),
            "failed": end("eval/pass1_external_failed"), "start": [r["start"]["eval/pass@1"] for r in rows],
            "rollouts": [r["rollouts"] for r in rows], "seconds": [r["seconds"] for r in rows]}


def table(results: list[dict], tasks: list[str], arms: list[str]) -> str:
    head = ["task", "arm", "seeds", "greedy pass@1 start", "greedy pass@1 end", "vs erils", "best-of-4 end",
            "pass@1 where the external fails", "rollouts (x grpo)", "wall-clock s (x grpo)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for task in tasks:
        base, grpo = summary(results, task, "erils"), summary(results, task, "grpo")
        for arm in arms:
            s = summary(results, task, arm)
            if not s["rows"]:
                continue
            versus = "-"
            if arm != "erils" and s["pass1"] and base["pass1"]:
                (a, sa), (b, sb) = mean_se(s["pass1"]), mean_se(base["pass1"])
                noise = math.hypot(sa, sb)
                versus = f"{a - b:+.3f} ± {noise:.3f}" + (" (> 2 s.e.)" if noise and abs(a - b) > 2 * noise else "")
            ratio = lambda key: (f" ({mean_se(s[key])[0] / mean_se(grpo[key])[0]:.2f}x)"  # noqa: E731
                                 if grpo[key] and mean_se(grpo[key])[0] else "")
            lines.append(f"| {task} | {arm} | {len(s['rows'])} | {cell(s['start'])} | {cell(s['pass1'])} | {versus} | "
                         f"{cell(s['best4'])} | {cell(s['failed'])} | {cell(s['rollouts'], 0)}{ratio('rollouts')} | "
                         f"{cell(s['seconds'], 0)}{ratio('seconds')} |")
    return "\n".join(lines)


def plot(results: list[dict], tasks: list[str], arms: list[str], path: Path) -> None:
    """Held-out greedy pass@1 against steps, the mean over seeds, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for arm in arms:
            rows = [r for r in results if r["task"] == task and r["arm"] == arm]
            if rows:
                steps = sorted({e["step"] for e in rows[0]["evals"]})
                means = [mean_se([e["eval/pass@1"] for r in rows for e in r["evals"] if e["step"] == s])[0]
                         for s in steps]
                ax.plot(steps, means, marker="o", label=arm, linestyle="--" if arm == "grpo" else "-")
        ax.set_title(task)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out greedy pass@1 (mean over seeds)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["sudoku", "countdown"])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--plot", default="docs/long_runs.png")
    add_arguments(parser, "runs/long", "docs/long_runs.json", "docs/long_runs")
    args = parser.parse_args()

    out, keep_dir = Path(args.out), Path(args.keep)
    # seed-major: a sweep cut short has whole comparisons at the first seeds
    plan = [(task, arm, seed) for seed in args.seeds for task in args.tasks for arm in args.arms]
    kept_path = {p: keep_dir / p[0] / f"{p[1]}-s{p[2]}.json" for p in plan}
    started = time.perf_counter()
    runs = run_all(plan, kept_path, lambda *p: settings(*p, args), lambda *p: run_dir(out, *p),
                   lambda *p: overrides(*p, args), numbers, args.steps, args.threads, args.jobs, args.only_kept)

    results = [{"task": task, "arm": arm, "seed": seed, "overrides": run_overrides(task, arm, args),
                "rollouts": sum(run["rollouts"]), "external_rollouts": sum(run["external"]),
                "seconds": sum(run["seconds"]), "start": run["evals"][0], "end": run["evals"][-1],
                "evals": run["evals"]}
               for (task, arm, seed), run in runs.items() if run is not None]
    text = table(results, args.tasks, args.arms)
    print(text)
    plot(results, args.tasks, args.arms, Path(args.plot))
    write_report(args.json, started, plan, runs, results, text, args.steps)
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
