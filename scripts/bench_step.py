"""Step benchmark: where the time of one GRPO step goes, for each likelihood estimator.

For one batch of rollouts (B prompts x G samples from the embedded dLLM) it times the rollout once, then for
each estimator: scoring the old policy (no grad), the forward with grad, the backward and the optimizer
step, and counts forward passes per rollout (rows the model saw / rollouts). Prints a table, writes JSON.

    python scripts/bench_step.py --model models/tiny-dllm --out bench_step.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import dllm_rl  # noqa: F401
from dllm_rl.algo.losses import grpo_loss
from dllm_rl.data import build_task
from dllm_rl.data.task import render_prompt
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.policy.adapters import load_policy
from dllm_rl.rollout.generate import TextGenerator
from dllm_rl.rollout.sampler import completion_mask

OPTIONS = {"mean_field": {}, "elbo": {"num_masks": 4}, "coupled": {"num_masks": 1}, "ordered": {"group": 8},
           "left_to_right": {"group": 8}}


class CountingPolicy:
    """Counts the rows passed through the model."""

    def __init__(self, policy):
        self.policy, self.mask_id, self.rows = policy, policy.mask_id, 0

    def logits(self, ids, mask=None):
        self.rows += ids.shape[0]
        return self.policy.logits(ids, mask)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/tiny-dllm")
    parser.add_argument("--task", default="sudoku")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--out", default="bench_step.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    policy, tokenizer = load_policy(args.model)
    task = build_task(args.task)
    examples = task.examples("train", args.prompts, 0)
    texts = [render_prompt(task.prompt(ex), tokenizer) for ex in examples for _ in range(args.group_size)]
    N = len(texts)
    generator = TextGenerator(policy, tokenizer, gen_length=64, block_length=32, steps=32, temperature=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        samples, rollout_s = timed(lambda: generator.sample(texts, list(range(N))))
    ids, attn, P = samples.sequences_BL, samples.attention_mask_BL, samples.prompt_length
    mask = completion_mask(samples.completion_BC, policy.eos_id)
    adv = torch.randn(N)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-6)
    rows = []
    for name, options in OPTIONS.items():
        estimator = build_estimator({"name": name, **options})
        counter = CountingPolicy(policy)
        args_ = (ids, attn, P, list(range(N)), samples.unmask_step_BC, mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                (old, _), old_s = timed(lambda: estimator.score(counter, *args_))
            forwards = counter.rows / N
            (logp, level_mask), forward_s = timed(lambda: estimator.score(policy, *args_))
        loss, _ = grpo_loss(logp.float(), old.float(), None, adv, level_mask)
        _, backward_s = timed(loss.backward)
        _, optim_s = timed(optimizer.step)
        optimizer.zero_grad(set_to_none=True)
        rows.append({"estimator": name, "options": options, "ratio_level": estimator.level,
                     "forwards_per_sample": forwards, "score_old_s": old_s, "forward_grad_s": forward_s,
                     "backward_s": backward_s, "optimizer_s": optim_s, "rollout_s": rollout_s})
        print(f"{name:14s} fwd/sample {forwards:5.1f}  old {old_s:6.2f}s  fwd+grad {forward_s:6.2f}s  "
              f"backward {backward_s:6.2f}s  optim {optim_s:5.2f}s  (rollout {rollout_s:.2f}s)")
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "task": args.task, "rollouts": N, "gen_length": 64, "rollout_steps": 32,
                   "machine": f"{platform.machine()} {platform.processor()}", "threads": torch.get_num_threads(),
                   "torch": torch.__version__, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
