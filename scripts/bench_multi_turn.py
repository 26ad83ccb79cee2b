"""Step credit in multi-turn RL: GRPO, GiGPO and CRBC at group sizes 4 and 8 on two environments, from the
embedded agent (models/tiny-dllm-agent: the embedded dLLM fine-tuned on solver episodes).

Every (env, G, credit, seed) is one `dllm-rl train env=<env>` run (external=none: the dLLM's own episodes only,
so the arms differ in their credit alone), evaluated before training and at the end on --eval-prompts held-out
seeds (one greedy episode each). Resumable and kept as long_runs.py's runs are (each finished run's numbers under
--keep). Prints a markdown table (held-out success at the start and the end, mean ± standard error over seeds; each
arm's end minus GRPO's at the same G, paired by seed, with its standard error; episodes played and wall-clock) and
writes JSON.

    python scripts/bench_multi_turn.py                                         # 2 envs x 2 G x 3 credits x 3 seeds
    python scripts/bench_multi_turn.py --envs corridor --group-sizes 4 --seeds 0 --steps 2   # a quick look
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from dllm_rl import analysis  # noqa: E402
from long_runs import cell, mean_se  # noqa: E402
from sweep import add_arguments, run_all, write_report  # noqa: E402

CREDITS = ("grpo", "gigpo", "crbc")
PROMPTS = 4  # environment seeds a step
# every run: the agent's action window, history 0 (as it was fine-tuned), PROMPTS seeds a step from a pool of 64;
# rollouts decoded exactly, one token a step at T = 1, as the agent's card samples them (0.4% invalid actions in
# FrozenLake). The fast samplers spoil this model's 4-letter actions: in FrozenLake's first two steps the RL
# sampler (threshold 0.9, a random first commit, the prompt cached) wrote 45-48% invalid actions, the exact schedule
# with the prompt cached 67-69%
COMMON = ["model=models/tiny-dllm-agent", "external=none", "env.history=0", "rollout.gen_length=8",
          "rollout.block_length=8", "rollout.steps=8", "rollout.threshold=null", "rollout.random_first=false",
          f"prompts_per_step={PROMPTS}", "train_pool=64",
          "checkpoint_every=10",
          "sample_every=0", "tensorboard=false"]
PHASES = ("perf/rollout_s", "perf/external_s", "perf/score_s", "perf/update_s")


def run_dir(out: Path, env: str, G: int, credit: str, seed: int) -> Path:
    return out / env / f"G{G}-{credit}-s{seed}"


def run_overrides(env: str, G: int, credit: str, args: argparse.Namespace) -> list[str]:
    return COMMON + [f"env={env}", f"env.credit={credit}", f"group_size={G}", f"minibatch_size={args.minibatch}",
                     *args.overrides]


def settings(env: str, G: int, credit: str, seed: int, args: argparse.Namespace) -> dict:
    """What makes two runs the same run (a kept run with other settings is run again)."""
    return {"env": env, "G": G, "credit": credit, "seed": seed, "steps": args.steps, "eval_prompts": args.eval_prompts,
            "overrides": run_overrides(env, G, credit, args)}


def numbers(path: Path) -> dict:
    """One run's episodes, turn rows and seconds per step, and its held-out evaluations."""
    metrics = analysis.load_run(path)["metrics"]
    steps = metrics[metrics["step"] > 0].sort_values("step")
    evals = metrics[metrics["eval/pass@1"].notna()]
    keys = ("eval/pass@1", "eval/turns", "eval/invalid")
    return {"success": steps["env/success"].astype(float).tolist(),
            "rows": steps["rollouts/on_policy"].astype(float).tolist(),
            "seconds": sum(steps[k].fillna(0.0) for k in PHASES if k in steps).astype(float).tolist(),
            "evals": [{"step": int(e["step"]), **{k: float(e[k]) for k in keys if k in e}}
                      for e in evals.to_dict("records")]}


def table(results: list[dict], envs: list[str], sizes: list[int]) -> str:
    head = ["env", "G", "credit", "seeds", "held-out success start", "end", "end - GRPO (paired)",
            "training success, last 5 steps", "episodes", "turn rows", "wall-clock s"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for env in envs:
        for G in sizes:
            by = {c: {r["seed"]: r for r in results if (r["env"], r["G"], r["credit"]) == (env, G, c)}
                  for c in CREDITS}
            for credit in CREDITS:
                rows = list(by[credit].values())
                if not rows:
                    continue
                versus = "-"
                paired = [r["end"] - by["grpo"][s]["end"] for s, r in by[credit].items() if s in by["grpo"]]
                if credit != "grpo" and paired:
                    d, se = mean_se(paired)
                    versus = f"{d:+.3f} ± {se:.3f}" + (" (> 2 s.e.)" if se and abs(d) > 2 * se else "")
                lines.append(f"| {env} | {G} | {credit} | {len(rows)} | {cell([r['start'] for r in rows])} | "
                             f"{cell([r['end'] for r in rows])} | {versus} | {cell([r['train_end'] for r in rows])} | "
                             f"{cell([r['episodes'] for r in rows], 0)} | {cell([r['rows'] for r in rows], 0)} | "
                             f"{cell([r['seconds'] for r in rows], 0)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=["corridor", "frozen_lake"])
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--credits", nargs="+", choices=CREDITS, default=list(CREDITS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--minibatch", type=int, default=64, help="minibatch_size (turn rows per update)")
    parser.add_argument("--eval-prompts", type=int, default=100)
    add_arguments(parser, "runs/multi_turn", "docs/bench_multi_turn.json", "docs/bench_multi_turn")
    args = parser.parse_args()

    out, keep_dir = Path(args.out), Path(args.keep)
    # seed-major: a sweep cut short has whole comparisons at the first seeds
    plan = [(env, G, credit, seed) for seed in args.seeds for env in args.envs for G in args.group_sizes
            for credit in args.credits]
    kept_path = {p: keep_dir / p[0] / f"G{p[1]}-{p[2]}-s{p[3]}.json" for p in plan}
    started = time.perf_counter()
    runs = run_all(plan, kept_path, lambda *p: settings(*p, args), lambda *p: run_dir(out, *p),
                   lambda env, G, credit, seed: [f"seed={seed}", f"steps={args.steps}", f"eval_every={args.steps}",
                                                 f"eval_prompts={args.eval_prompts}",
                                                 *run_overrides(env, G, credit, args)],
                   numbers, args.steps, args.threads, args.jobs, args.only_kept)

    results = [{"env": env, "G": G, "credit": credit, "seed": seed,
                "start": run["evals"][0]["eval/pass@1"], "end": run["evals"][-1]["eval/pass@1"],
                "train_end": sum(run["success"][-5:]) / len(run["success"][-5:]),
                "episodes": PROMPTS * G * len(run["success"]), "rows": sum(run["rows"]), "seconds": sum(run["seconds"]),
                "evals": run["evals"]}
               for (env, G, credit, seed), run in runs.items() if run is not None]
    text = table(results, args.envs, args.group_sizes)
    print(text)
    write_report(args.json, started, plan, runs, results, text, args.steps)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
