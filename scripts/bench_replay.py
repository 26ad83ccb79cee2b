"""What the sampler's record saves: JustGRPO's recipe on the embedded model with the old policy's log-probs
replayed from the rollouts (`replay_rollout_logp=true`) against scoring them again (`false`), in one run.

Both arms run `configs/experiment/tiny_justgrpo.yaml` for the same steps and seeds (the rollouts are the same;
the updates agree within float noise) and read the step's phases from metrics.jsonl: rollout, scoring (old and
reference log-probs), update. Prints a table (seconds per step, mean over the steps after the first) and the
ratios, and writes JSON.

    python scripts/bench_replay.py                       # docs/bench_replay.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dllm_rl import analysis, cli  # noqa: E402

PHASES = ("perf/rollout_s", "perf/score_s", "perf/update_s")


def run(replay: bool, steps: int, work: Path) -> dict[str, float]:
    out = work / f"replay_{replay}"
    code = cli.main(["train", "+experiment=tiny_justgrpo", f"steps={steps}", f"run_dir={out}", "eval_every=0",
                     "sample_every=0", "checkpoint_every=0", "tensorboard=false",
                     f"replay_rollout_logp={str(replay).lower()}"])
    if code != 0:
        raise SystemExit(f"dllm-rl train failed (exit {code})")
    metrics = analysis.load_run(out)["metrics"]
    steps_df = metrics[metrics["step"] > 1]  # the first step warms up
    result = {k: float(steps_df[k].mean()) for k in PHASES}
    result["step_s"] = sum(result[k] for k in PHASES)
    result["old_from_rollout"] = float(steps_df["likelihood/old_from_rollout"].mean())
    result["loss/policy"] = [float(v) for v in metrics["loss/policy"].dropna()]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default="docs/bench_replay.json")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        rows = {"replayed": run(True, args.steps, Path(work)), "scored": run(False, args.steps, Path(work))}
    lines = ["| old log-probs | rollout s | scoring s | update s | step s |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['perf/rollout_s']:.2f} | {r['perf/score_s']:.2f} | {r['perf/update_s']:.2f} | "
                     f"{r['step_s']:.2f} |")
    ratio = {k: rows["replayed"][k] / rows["scored"][k] for k in ("perf/score_s", "step_s")}
    lines.append(f"\nreplayed / scored: scoring {ratio['perf/score_s']:.2f}x, step {ratio['step_s']:.2f}x")
    table = "\n".join(lines)
    print(table)
    Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "machine": platform.processor() or "cpu",
                                           "steps": args.steps, "seconds": time.perf_counter() - started,
                                           "rows": rows, "ratios": ratio, "table": table}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
