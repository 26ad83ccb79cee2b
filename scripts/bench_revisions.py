"""The main job's step wall-clock at two (or more) git revisions of this repository, run one after the other in
rounds on the same machine, and each revision's ratio to the first.

Each revision is checked out in a git worktree (under --work, kept between calls) and runs `dllm-rl train` from
there (its own code, its own embedded models) with the same overrides; a step's seconds are the sum of its timed
phases (`perf/rollout_s`, `perf/external_s`, `perf/score_s`, `perf/update_s`), the first step left out (warm-up).
Rounds alternate the revisions (A B A B ...), so a drift of the machine's speed falls on all of them alike. The
ratio's standard error is over the rounds (each round's ratio of means).

    python scripts/bench_revisions.py e0a9743 HEAD --steps 20 --rounds 2 --out docs/bench_revisions.json

Overrides after `--` go to every run (default: `eval_every=0`, the held-out evaluations are not the step's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("perf/rollout_s", "perf/external_s", "perf/score_s", "perf/update_s")


def worktree(rev: str, work: Path) -> tuple[str, Path]:
    """(the full commit of `rev`, a worktree of it under `work`)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    path = work / sha[:12]
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return sha, path


def step_seconds(run_dir: Path) -> list[float]:
    """Each step's timed seconds (its phases added up), in step order."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [sum(m.get(k, 0.0) for k in PHASES) for m in lines]


def run_once(tree: Path, run_dir: Path, steps: int, overrides: list[str]) -> tuple[list[float], float]:
    """One `dllm-rl train` of the revision in `tree`: its steps' seconds and the whole run's wall-clock."""
    code = "import sys; from dllm_rl.cli import main; sys.argv[0] = 'dllm-rl'; sys.exit(main())"
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, "train", f"steps={steps}", f"run_dir={run_dir}", *overrides],
                   cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return step_seconds(run_dir), time.perf_counter() - start


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revs", nargs="+", help="git revisions; the first is the baseline")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dllm_rl_revisions"))
    parser.add_argument("--out", default="bench_revisions.json")
    args, rest = parser.parse_known_args()
    overrides = [a for a in rest if a != "--"] or ["eval_every=0"]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    trees = [worktree(rev, work) for rev in args.revs]
    per_step = {sha: [] for sha, _ in trees}  # [round] -> mean seconds per step (first step left out)
    wall = {sha: [] for sha, _ in trees}
    for r in range(args.rounds):
        for sha, tree in trees:
            run_dir = work / f"run_{sha[:12]}_{r}"
            if run_dir.exists():
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            seconds, total = run_once(tree, run_dir, args.steps, overrides)
            per_step[sha].append(statistics.fmean(seconds[1:]))
            wall[sha].append(total)
            print(f"round {r} {sha[:12]}: {per_step[sha][-1]:.3f} s/step, run {total:.0f} s", flush=True)
    base = trees[0][0]
    rows = []
    for (sha, _), rev in zip(trees, args.revs):
        mean, se = mean_se(per_step[sha])
        ratio, ratio_se = mean_se([a / b for a, b in zip(per_step[sha], per_step[base])])
        rows.append({"rev": rev, "commit": sha, "step_s": mean, "step_s_se": se, "ratio": ratio, "ratio_se": ratio_se,
                     "rounds": per_step[sha], "run_s": wall[sha]})
    print(f"\n{'revision':<14}{'commit':<14}{'s/step':>14}{'ratio to first':>20}")
    for row in rows:
        print(f"{row['rev']:<14}{row['commit'][:12]:<14}{row['step_s']:>8.3f} ± {row['step_s_se']:.3f}"
              f"{row['ratio']:>12.3f} ± {row['ratio_se']:.3f}")
    Path(args.out).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                          "cpu_count": os.cpu_count(), "steps": args.steps, "rounds": args.rounds,
                                          "overrides": overrides, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
