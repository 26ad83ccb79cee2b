"""Speculative external rollouts (SRT) against plain sampling, on the embedded external policy (tiny-ar).

ERILS asks its frozen external policy for rollouts of the same training prompts step after step. This script
replays that: `--rounds` rounds, each sampling `--group` rollouts of each of `--prompts` train prompts with fresh
seeds (as the trainer derives them per step), through the `causal_lm` source with `draft_tokens=0` (plain,
the baseline) and with each `--draft-tokens` k (speculative; its trees learn from every round). For each round it
reports tokens per second, forward passes, draft acceptance and tokens per forward, and the speedup over plain
sampling measured in the same round. Plain and speculative sampling are one sampling rule (rollout/causal.py):
the script checks that every speculative row is the plain one, text for text.

Prints a table and writes JSON.

    python scripts/bench_speculative.py --out docs/bench_speculative.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import dllm_rl  # noqa: F401
from dllm_rl.data import build_task
from dllm_rl.external.sources import CausalLMSource
from dllm_rl.seeds import derive_seed

ROOT = Path(__file__).resolve().parents[1]


def timed(source, task, examples, group, seeds):
    start = time.perf_counter()
    rows = source.rollouts(task, examples, group, seeds)
    seconds = time.perf_counter() - start
    tokenizer = source.generator.tokenizer
    tokens = sum(len(tokenizer(r.text, add_special_tokens=False)["input_ids"]) + 1 for rs in rows for r in rs)
    return rows, seconds, tokens


def run_task(name: str, args) -> list[dict]:
    task = build_task(name)
    examples = task.examples("train", args.prompts, 0)
    options = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens, batch_size=args.batch,
                   device=args.device)
    plain = CausalLMSource(args.model, **options)
    speculative = {k: CausalLMSource(args.model, draft_tokens=k, **options) for k in args.draft_tokens}
    out = []
    for r in range(args.rounds):
        seeds = [[derive_seed(args.seed, "external", r, i, j) for j in range(args.group)] for i in range(len(examples))]
        base, base_s, tokens = timed(plain, task, examples, args.group, seeds)
        rows = [dict(task=name, round=r, mode="plain", seconds=base_s, tokens=tokens, tokens_per_s=tokens / base_s,
                     speedup=1.0)]
        for k, source in speculative.items():
            got, seconds, n = timed(source, task, examples, args.group, seeds)
            same = [[x.text for x in rs] for rs in got] == [[x.text for x in rs] for rs in base]
            assert same, f"{name} round {r}: speculative rows (k={k}) differ from plain sampling's"
            rows.append(dict(task=name, round=r, mode=f"draft={k}", seconds=seconds, tokens=n, tokens_per_s=n / seconds,
                             speedup=base_s / seconds, **source.step_metrics()))
        for row in rows:
            print(f"{row['task']:<10} {row['round']:>5} {row['mode']:<10} {row['tokens_per_s']:>9.0f} "
                  f"{row.get('spec_forwards', float('nan')):>8.0f} {row.get('spec_acceptance', float('nan')):>7.2f} "
                  f"{row.get('spec_tokens_per_forward', float('nan')):>7.2f} {row['speedup']:>7.2f}x", flush=True)
        out += rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny-ar"))
    parser.add_argument("--tasks", nargs="+", default=["countdown", "sudoku"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=4, help="rollouts per prompt per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="where the external model runs: cpu, cuda, cuda:N")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{args.device}: {torch.cuda.get_device_name(0) if args.device.startswith('cuda') else platform.processor()}")
    print(f"{'task':<10} {'round':>5} {'mode':<10} {'tokens/s':>9} {'forwards':>8} {'accept':>7} {'tok/fwd':>7} "
          f"{'speedup':>8}")
    rows = [row for name in args.tasks for row in run_task(name, args)]
    meta = {"command": "python scripts/bench_speculative.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items() if v is not None and k not in ("model", "out")),
            "machine": f"{platform.machine()} {platform.processor()}", "threads": torch.get_num_threads(),
            "torch": torch.__version__}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
