"""Rollout workers benchmark: learner utilisation and wall-clock per step, in-process against Ray workers
(synchronous, complete-group pipelining, asynchronous at S = 1, 2, 4), with 1 and 2 workers.

Each mode is one `dllm-rl train` run (its own process, its own local Ray) on Sudoku with the embedded models and
the default ERILS settings, for --steps steps; the first --warmup steps (Ray's start, the workers' first load) are
left out. Every mode runs the same work: the same prompts, rollouts and update rule, the Sparse-RL correction on
(`sampler_correction.mode=weight`, which the asynchronous modes need) in all of them. Threads: the in-process
baseline uses --threads torch threads (the machine's cores); with workers the learner runs 1 and each worker 1
(`workers.threads=1`), so that one worker and the learner share two cores without oversubscription (two workers
and the learner cannot).

Per mode: wall-clock seconds per step (the sum of the step's phases), the learner's idle seconds per step (waiting
for rollouts: `perf/rollout_s`, which in process is the learner generating), its utilisation (busy / wall, busy =
external rows + scoring + update), the speedup over the in-process baseline (a ratio in the same run), the lag and
the Sparse-RL effective sample size. Then the projection: with rollout time R and training time T per step
measured in process, W workers that each generate a batch in R (no faster than here) give a synchronous learner
T / (T + R / W) and an asynchronous one (S >= 1) min(1, T / (R / W)), publishing aside. Prints a table and writes
JSON. With --curves, instead: held-out greedy pass@1 against steps for each staleness bound S given (one worker;
S = 0 is the synchronous loop, run in process), every --eval-every steps, as a table and a plot next to the JSON.

    python scripts/bench_workers.py --out docs/bench_workers.json
    python scripts/bench_workers.py --curves 0 1 2 4 --curve-steps 40 --out docs/bench_workers_curves.json
    python scripts/bench_workers.py --modes in-process pipe/w1 async-s2/w1 --steps 4 --warmup 1   # a quick look
    python scripts/bench_workers.py --ranks 2 --out docs/bench_workers_ranks2.json

With --ranks N every run is N learner processes (torchrun, one thread each, ZeRO --zero-stage) and the modes are
in-process, synchronous and asynchronous (S = 1, 2) with one worker (pipelining serves one learner process); the
table is followed by `dllm-rl plan`'s utilisation for the same S from the synchronous run's numbers (the learner's
work per step, the publish, the batch, the worker's rollouts per second while generating), formula and simulation,
beside the measured one.
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

MODES: dict[str, list[str]] = {"in-process": []}
for w in (1, 2):
    MODES[f"sync/w{w}"] = [f"workers.count={w}"]
    MODES[f"pipe/w{w}"] = [f"workers.count={w}", "workers.pipe=true"]
    for s in (1, 2, 4):
        MODES[f"async-s{s}/w{w}"] = [f"workers.count={w}", f"workers.max_staleness={s}"]
RANKED_MODES = ["in-process", "sync/w1", "async-s1/w1", "async-s2/w1"]  # what several learner ranks are measured in
COMMON = ["task=sudoku", "eval_every=0", "checkpoint_every=0", "sample_every=0", "tensorboard=false",
          "sampler_correction.mode=weight", "workers.threads=1", "workers.timeout_s=300"]
TRAINING = ("perf/external_s", "perf/score_s", "perf/update_s")


def run_mode(name: str, args: argparse.Namespace, scratch: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    """The metrics of one mode's run (its own process), after the warmup steps."""
    run_dir = scratch / name.replace("/", "-")
    threads = str(args.threads if name == "in-process" and args.ranks == 1 else 1)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TMPDIR": tempfile.mkdtemp(prefix="b", dir="/tmp")}
    launcher = [sys.executable, "-m", "dllm_rl.cli"]
    if args.ranks > 1:  # N learner processes over gloo, one thread each
        from dllm_rl.engine.dist import free_port

        env["DS_ACCELERATOR"] = "cpu"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
                    "--master_port", str(free_port()), "-m", "dllm_rl.cli"]
        extra = (*extra, f"deepspeed=zero{args.zero_stage}")
    command = [*launcher, "train", f"run_dir={run_dir}", f"steps={args.steps}",
               f"seed={args.seed}", *COMMON, *MODES[name], *extra, *args.overrides]
    start = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name}: the run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"  {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return [m for m in lines if m["step"] > args.warmup]


def summary(steps: list[dict]) -> dict[str, float]:
    mean = lambda key: sum(m.get(key, 0.0) for m in steps) / len(steps)  # noqa: E731
    wall = sum(mean(k) for k in ("perf/rollout_s", *TRAINING))
    busy = sum(mean(k) for k in TRAINING)
    return {"wall_s": wall, "idle_s": mean("perf/rollout_s"), "busy_s": busy, "utilisation": busy / wall,
            "lag_mean": mean("rollout/lag_mean"), "lag_max": max(m.get("rollout/lag_max", 0.0) for m in steps),
            "ess": mean("correction/ess"), "reward": mean("reward/on_policy"), "steps": len(steps),
            "publish_s": mean("rollout/publish_s"), "batch": mean("rollouts/on_policy"),
            "throughput": mean("pool/default/throughput")}


def plan_check(results: dict[str, dict[str, float]], group_size: int) -> list[dict[str, float]]:
    """`dllm-rl plan`'s learner utilisation at S = 0, 1, 2 for the one worker measured, from the synchronous run's
    numbers (dllm_rl/workers/plan.py: the closed form and the event-by-event simulation), beside the measured."""
    from dllm_rl.workers.plan import Pipeline, simulate

    sync = results["sync/w1"]
    out = []
    for S, mode in ((0, "sync/w1"), (1, "async-s1/w1"), (2, "async-s2/w1")):
        if mode not in results:
            continue
        pipeline = Pipeline(sync["busy_s"], sync["publish_s"], int(round(sync["batch"])), S)
        speeds = [sync["throughput"]]
        out.append({"S": S, "measured": results[mode]["utilisation"],
                    "plan": pipeline.utilisation(speeds, group_size), "simulated": simulate(pipeline, speeds, group_size)})
    return out


def projection(base: dict[str, float], workers: tuple[int, ...] = (1, 2, 4, 8)) -> list[dict[str, float]]:
    """The learner's utilisation with W workers from the in-process rollout (R) and training (T) seconds."""
    R, T = base["idle_s"], base["busy_s"]
    return [{"workers": w, "sync": T / (T + R / w), "async": min(1.0, T / (R / w))} for w in workers]


def table(results: dict[str, dict[str, float]]) -> str:
    base = results["in-process"]["wall_s"]
    head = ["mode", "s / step", "idle s / step", "utilisation", "speedup (x in-process)", "lag mean / max", "ESS"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['wall_s']:.2f} | {r['idle_s']:.2f} | {r['utilisation']:.2f} | "
                     f"{base / r['wall_s']:.2f} | {r['lag_mean']:.2f} / {r['lag_max']:.0f} | {r['ess']:.3f} |")
    return "\n".join(lines)


def curves(args: argparse.Namespace) -> None:
    """Held-out greedy pass@1 against steps for each staleness bound in `args.curves` (one worker)."""
    args.steps, args.warmup = args.curve_steps, -1
    evals = {}
    with tempfile.TemporaryDirectory() as scratch:
        for S in args.curves:
            # S = 0: in process, the same run as synchronous workers (tested bit for bit), in half the time here
            name = "in-process" if S == 0 else f"async-s{S}/w1"
            lines = run_mode(name, args, Path(scratch), (f"eval_every={args.eval_every}", "eval_prompts=64"))
            evals[S] = [(int(m["step"]), m["eval/pass@1"]) for m in lines if "eval/pass@1" in m]
    steps = [step for step, _ in evals[args.curves[0]]]
    print("| S | " + " | ".join(f"step {s}" for s in steps) + " |\n" + "|---" * (len(steps) + 1) + "|")
    for S, points in evals.items():
        print(f"| {S} | " + " | ".join(f"{v:.3f}" for _, v in points) + " |")
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "steps": args.steps,
                                        "overrides": args.overrides, "evals": evals}, indent=2) + "\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for S, points in evals.items():
            ax.plot(*zip(*points), marker="o", label=f"S = {S}")
        ax.set(xlabel="step", ylabel="held-out greedy pass@1 (Sudoku)", title="one rollout worker, staleness bound S")
        ax.legend()
        fig.savefig(args.out.with_suffix(".png"), dpi=100, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (Ray's start, first loads)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="the in-process run's threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--curves", type=int, nargs="+", default=None, help="held-out curves for these S instead")
    parser.add_argument("--curve-steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=1, help="learner processes per run (torchrun, gloo)")
    parser.add_argument("--zero-stage", type=int, default=3, help="the ZeRO stage of runs with --ranks > 1")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    args = parser.parse_args()
    if args.ranks > 1:
        if args.modes == list(MODES):
            args.modes = RANKED_MODES
        bad = [m for m in args.modes if m.startswith("pipe")]
        if bad:
            parser.error(f"--ranks {args.ranks} with {bad}: pipelining serves one learner process")
    if args.curves is not None:
        curves(args)
        return
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    modes = ["in-process"] + [m for m in args.modes if m != "in-process"]  # the baseline, always, first
    with tempfile.TemporaryDirectory() as scratch:
        results = {name: summary(run_mode(name, args, Path(scratch))) for name in modes}
        group_size = json.loads((Path(scratch) / modes[0].replace("/", "-") / "config.json").read_text())["group_size"]
    print(table(results))
    checked = []
    if "sync/w1" in results:
        checked = plan_check(results, group_size)
        print("\nlearner utilisation, measured against dllm-rl plan's (from the sync/w1 run's numbers):")
        print("| S | measured | plan (formula) | plan (simulated) |\n|---|---|---|---|")
        for c in checked:
            print(f"| {c['S']} | {c['measured']:.2f} | {c['plan']:.2f} | {c['simulated']:.2f} |")
    project = projection(results["in-process"])
    print("\nprojected learner utilisation with W workers (rollout and training seconds measured in process):")
    for p in project:
        print(f"  W={p['workers']}: synchronous {p['sync']:.2f}, asynchronous (S >= 1) {p['async']:.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                        "steps": args.steps, "warmup": args.warmup, "overrides": args.overrides,
                                        "ranks": args.ranks, "zero_stage": args.zero_stage if args.ranks > 1 else None,
                                        "results": results, "projection": project, "plan_check": checked},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
