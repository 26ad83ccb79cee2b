"""What backward passes in pieces cost and save: JustGRPO's recipe on the embedded model with each minibatch
back-propagated whole, and in pieces of rows and forwards (`micro_batch_rows`, `micro_batch_forwards`).

Each arm runs `configs/experiment/tiny_justgrpo.yaml` (64 forwards with gradients per row, minibatches of 8 rows)
for the same steps and seed in a process of its own, and reports that process's peak resident memory (the update
holds every forward's activations until its backward unless it is cut into pieces), the update phase's seconds per
step (mean over the steps after the first) and the loss. The arms make the same updates up to rounding (bf16
forwards round differently in batches of other shapes), so the first step's losses agree to about 1%, and later
steps, whose rollouts come from weights that rounding moved apart, differ more. Prints a table with the ratios
to the whole-minibatch arm and writes JSON.

    python scripts/bench_pieces.py                       # docs/bench_pieces.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = {"whole minibatch": (0, 0), "8 rows x 8 forwards": (8, 8), "1 row x 1 forward": (1, 1)}


def run_arm(rows: int, forwards: int, steps: int, out: Path) -> dict:
    """One arm in this process: the run, then its numbers (peak RSS of this process)."""
    from dllm_rl import analysis, cli

    code = cli.main(["train", "+experiment=tiny_justgrpo", f"steps={steps}", f"run_dir={out}", "eval_every=0",
                     "sample_every=0", "checkpoint_every=0", "tensorboard=false", f"micro_batch_rows={rows}",
                     f"micro_batch_forwards={forwards}"])
    if code != 0:
        raise SystemExit(f"dllm-rl train failed (exit {code})")
    metrics = analysis.load_run(out)["metrics"]
    later = metrics[metrics["step"] > 1]  # the first step warms up
    return {"micro_batch_rows": rows, "micro_batch_forwards": forwards,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,  # KiB on Linux
            "update_s": float(later["perf/update_s"].mean()), "rollout_s": float(later["perf/rollout_s"].mean()),
            "loss/policy": [float(v) for v in metrics["loss/policy"].dropna()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default="docs/bench_pieces.json")
    parser.add_argument("--arm", nargs=2, type=int, help=argparse.SUPPRESS)  # internal: run one arm, print JSON
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print("ARM " + json.dumps(run_arm(*args.arm, args.steps, Path(args.out))))
        return
    started, results = time.perf_counter(), {}
    with tempfile.TemporaryDirectory() as work:
        for name, (rows, forwards) in ARMS.items():
            done = subprocess.run([sys.executable, __file__, "--arm", str(rows), str(forwards), "--steps",
                                   str(args.steps), "--out", str(Path(work) / f"r{rows}f{forwards}")],
                                  capture_output=True, text=True, cwd=ROOT)
            line = [x for x in done.stdout.splitlines() if x.startswith("ARM ")]
            if done.returncode != 0 or not line:
                raise SystemExit(f"arm {name!r} failed:\n{(done.stdout + done.stderr)[-3000:]}")
            results[name] = json.loads(line[0][4:])
    base = results["whole minibatch"]
    lines = ["| backward passes | peak RSS GB | x whole | update s/step | x whole | loss/policy per step |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        losses = ", ".join(f"{v:.5f}" for v in r["loss/policy"])
        lines.append(f"| {name} | {r['peak_rss_gb']:.2f} | {r['peak_rss_gb'] / base['peak_rss_gb']:.2f} | "
                     f"{r['update_s']:.2f} | {r['update_s'] / base['update_s']:.2f} | {losses} |")
    table = "\n".join(lines)
    print(table)
    Path(args.json).write_text(json.dumps({
        "command": "python scripts/bench_pieces.py " + " ".join(sys.argv[1:]), "steps": args.steps,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "python": platform.python_version(),
        "arms": results, "table": table, "seconds": time.perf_counter() - started}, indent=1) + "\n")


if __name__ == "__main__":
    main()
