"""Why on-policy GRPO does or does not teach the embedded dLLM: three measurements, one table each.

1. **Gradient agreement.** Rollouts of the RL sampler (configs/rollout/rl.yaml, temperature 1) on Sudoku train
   prompts, their rewards and mean-centred advantages (the default `algo.advantage=mean`). The reference is the
   exact log-likelihood of each rollout along the order the sampler unmasked it: the `ordered` estimator at
   group 1 (each step's tokens scored from the very state the sampler committed them from; what the sampler
   records). For every estimator, the cosine between its gradient and the reference's:
   - per row: grad of the row's summed log-prob (what raising that rollout's likelihood does to the weights);
   - per batch: grad of sum_n A_n * logp_n, the policy gradient of the step (what the update follows; the
     token-aggregated GRPO loss at ratio 1 is its negative over a constant);
   each over `--draws` mask draws: the mean of single draws (what one update sees), their spread, and the
   cosine of the draws' mean (what many draws would converge to: the estimator's bias, without its noise).
   JustGRPO's recipe is measured on its own rollouts (decoded left to right, blocks of one), where its estimator
   (`left_to_right`, group 1) is the exact likelihood: the cosine is 1 by construction, printed as a check.
2. **Signal and diversity per sampler setting**: the share of groups with a non-zero reward variance (the groups
   that carry a gradient), distinct completions per group, mean reward, forwards per rollout.
3. **What the negative rows do to the tokens they share with the positive ones**: in the groups with signal,
   the first-order change of the positive rows' exact log-likelihood along each estimator's update direction
   (unit step), on the tokens a negative row of the group shares (same token, same position) and on the others;
   from the whole batch's gradient, and from its positive and negative rows alone.

    python scripts/diagnose_learning.py --json docs/diagnose_learning.json

Table 2 samples as the trainer does (bf16 autocast where the CPU has native bf16, `bf16=auto`); tables 1 and 3
sample and take gradients in float32. One process; the numbers depend on the seed (and the bf16 path) only.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import dllm_rl  # noqa: F401
from dllm_rl.algo.advantages import group_advantages
from dllm_rl.data import build_task
from dllm_rl.data.task import render_prompt
from dllm_rl.device import autocast
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.policy.adapters import load_policy
from dllm_rl.precision import resolve_bf16
from dllm_rl.rollout.generate import TextGenerator
from dllm_rl.rollout.sampler import completion_mask, completion_texts
from dllm_rl.seeds import derive_seed

ROOT = Path(__file__).resolve().parents[1]
RL_SAMPLER = dict(gen_length=64, block_length=32, steps=32, temperature=1.0)  # configs/rollout/rl.yaml
JUSTGRPO_SAMPLER = dict(gen_length=64, block_length=1, steps=64, temperature=1.0)  # configs/experiment/tiny_justgrpo

# (label, estimator config): each estimator at its config group's defaults, plus the settings worth comparing
ESTIMATORS = [
    ("mean_field", {"name": "mean_field", "prompt_mask_prob": 0.15}),
    ("mean_field, prompt unmasked", {"name": "mean_field", "prompt_mask_prob": 0.0}),
    ("elbo per_token M=4", {"name": "elbo", "num_masks": 4, "masking": "per_token"}),
    ("elbo fixed_count M=4", {"name": "elbo", "num_masks": 4, "masking": "fixed_count"}),
    ("coupled M=1", {"name": "coupled", "num_masks": 1}),
    ("espo M=2", {"name": "espo", "num_masks": 2}),
    ("spg M=2", {"name": "spg", "num_masks": 2}),
    ("spg M=2, prompt unmasked", {"name": "spg", "num_masks": 2, "prompt_mask_prob": 0.0}),
    ("left_to_right group 8", {"name": "left_to_right", "group": 8}),
    ("ordered group 8", {"name": "ordered", "group": 8}),
    ("ordered group 4", {"name": "ordered", "group": 4}),
    ("ordered group 2", {"name": "ordered", "group": 2}),
    ("ordered group 1 (reference)", {"name": "ordered", "group": 1}),
]
REFERENCE = {"name": "ordered", "group": 1}

# (label, sampler settings over RL_SAMPLER)
SAMPLERS = [
    ("rl: 2 tokens/step, T=1", {}),
    ("rl, T=1.5", {"temperature": 1.5}),
    ("1 token/step (steps=64), T=1", {"steps": 64}),
    ("threshold 0.9, T=1", {"threshold": 0.9}),
    ("threshold 0.9 + random_first", {"threshold": 0.9, "random_first": True}),
    ("left to right (JustGRPO), T=1", {"block_length": 1, "steps": 64}),
]


class Batch:
    """Rollouts of `prompts` x `group` with everything an estimator and the advantage need."""

    def __init__(self, generator: TextGenerator, task, examples, group: int, seed: int):
        prompts = [render_prompt(task.prompt(ex), generator.tokenizer) for ex in examples]
        keys = [(b, g) for b in range(len(examples)) for g in range(group)]
        start = time.perf_counter()
        samples = generator.sample([prompts[b] for b, _ in keys], [derive_seed(seed, "diag", b, g) for b, g in keys])
        self.seconds = time.perf_counter() - start
        self.forwards = samples.forwards
        eos = generator.eos_id
        self.ids_NL, self.attention_NL, self.P = samples.sequences_BL, samples.attention_mask_BL, samples.prompt_length
        self.order_NC = samples.unmask_step_BC
        self.mask_NC = completion_mask(samples.completion_BC, eos).float()
        texts = completion_texts(generator.tokenizer, samples.completion_BC, eos)
        self.rewards_N = torch.tensor([task.reward(t, examples[b]).score for t, (b, _) in zip(texts, keys)])
        self.group_N = torch.tensor([b for b, _ in keys])
        self.adv_N = group_advantages(self.rewards_N, self.group_N, "mean")
        self.completion_NC = samples.completion_BC
        self.group = group

    def __len__(self) -> int:
        return len(self.ids_NL)

    def signal_groups(self) -> torch.Tensor:
        rewards_BG = self.rewards_N.view(-1, self.group)
        return rewards_BG.std(1) > 0

    def distinct_share(self) -> float:
        per_group = self.completion_NC.view(-1, self.group, self.completion_NC.shape[1])
        return sum(len({tuple(r.tolist()) for r in g}) for g in per_group) / len(self)


def seq_logp(policy, batch: Batch, config: dict, rows: torch.Tensor, draw: int) -> torch.Tensor:
    """Each of `rows`' summed log-prob under the estimator `config`, its masks from draw `draw` (seeds per row)."""
    estimator = build_estimator(dict(config))
    seeds = [derive_seed(draw, "mask", int(r)) for r in rows]
    logp, level_mask = estimator.score(policy, batch.ids_NL[rows], batch.attention_NL[rows], batch.P, seeds,
                                       batch.order_NC[rows], batch.mask_NC[rows], adv_N=batch.adv_N[rows])
    return (logp * level_mask).sum(-1)


def flat_grad(policy, loss: torch.Tensor, retain: bool = False) -> torch.Tensor:
    params = [p for p in policy.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=retain)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def draws_of(config: dict, draws: int) -> int:
    """Mask draws worth making: one for an estimator that draws no mask."""
    fixed = config["name"] in ("ordered", "left_to_right") or (
        config["name"] == "mean_field" and config.get("prompt_mask_prob", 0.15) == 0)
    return 1 if fixed else draws


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def batch_grad(policy, batch: Batch, config: dict, draw: int, weights_N: torch.Tensor, chunk: int = 16):
    """grad of sum_n weights_n * logp_n under `config`, accumulated over chunks of rows."""
    total = None
    for rows in torch.arange(len(batch)).split(chunk):
        if not bool((weights_N[rows] != 0).any()):
            continue
        g = flat_grad(policy, (weights_N[rows] * seq_logp(policy, batch, config, rows, draw)).sum())
        total = g if total is None else total + g
    return total


def gradient_agreement(policy, batch: Batch, rows: torch.Tensor, draws: int) -> list[dict]:
    """Table 1: per-row and per-batch cosines of each estimator's gradient with the exact one's."""
    ref_rows = {int(r): flat_grad(policy, seq_logp(policy, batch, REFERENCE, r[None], 0).sum()) for r in rows}
    ref_batch = batch_grad(policy, batch, REFERENCE, 0, batch.adv_N)
    out = []
    for label, config in ESTIMATORS:
        start, draws_here = time.perf_counter(), draws_of(config, draws)
        row_cos = torch.tensor([[cosine(flat_grad(policy, seq_logp(policy, batch, config, r[None], d).sum()),
                                        ref_rows[int(r)]) for d in range(draws_here)] for r in rows])  # (R, D)
        batch_grads = [batch_grad(policy, batch, config, d, batch.adv_N) for d in range(draws_here)]
        batch_cos = torch.tensor([cosine(g, ref_batch) for g in batch_grads])
        out.append({"estimator": label, "config": config,
                    "row_cos_mean": row_cos.mean().item(), "row_cos_sd_rows": row_cos.mean(1).std().item(),
                    "row_cos_sd_draws": row_cos.std(1).mean().item() if draws_here > 1 else 0.0,
                    "batch_cos_mean": batch_cos.mean().item(),
                    "batch_cos_sd_draws": batch_cos.std().item() if draws_here > 1 else 0.0,
                    "batch_cos_of_mean": cosine(torch.stack(batch_grads).mean(0), ref_batch),
                    "seconds": round(time.perf_counter() - start, 1)})
        print(f"  {label:<30} row {out[-1]['row_cos_mean']:+.3f} (sd rows {out[-1]['row_cos_sd_rows']:.3f}, "
              f"draws {out[-1]['row_cos_sd_draws']:.3f})  batch {out[-1]['batch_cos_mean']:+.3f} "
              f"± {out[-1]['batch_cos_sd_draws']:.3f}  mean of draws {out[-1]['batch_cos_of_mean']:+.3f}", flush=True)
    return out


def shared_tokens(batch: Batch) -> torch.Tensor:
    """shared_NC: tokens of positive-advantage rows that some negative-advantage row of their group has too (same
    token at the same position), counted tokens only."""
    shared = torch.zeros_like(batch.mask_NC, dtype=torch.bool)
    for g in batch.group_N.unique():
        rows = (batch.group_N == g).nonzero().squeeze(-1)
        pos, neg = rows[batch.adv_N[rows] > 0], rows[batch.adv_N[rows] < 0]
        for p in pos:
            same = (batch.completion_NC[neg] == batch.completion_NC[p]).any(0) if len(neg) else False
            shared[p] = same & (batch.mask_NC[p] > 0)
    return shared


def shared_token_effect(policy, batch: Batch, draws: int) -> list[dict]:
    """Table 3: d/d(step) of the positive rows' exact log-likelihood, shared and own tokens, per token."""
    shared_NC = shared_tokens(batch)
    pos_N = batch.adv_N > 0
    own_NC = (batch.mask_NC > 0) & ~shared_NC & pos_N[:, None]
    estimator = build_estimator(dict(REFERENCE))
    rows = pos_N.nonzero().squeeze(-1)
    logp_NC = estimator.logp(policy, batch.ids_NL[rows], batch.attention_NL[rows], batch.P,
                             order_NC=batch.order_NC[rows])
    grad_shared = flat_grad(policy, (logp_NC * shared_NC[rows]).sum() / shared_NC.sum().clamp(min=1), retain=True)
    grad_own = flat_grad(policy, (logp_NC * own_NC[rows]).sum() / own_NC.sum().clamp(min=1))
    out = []
    chosen = ("mean_field", "ordered group 8", "ordered group 1 (reference)")
    for label, config in [(label, config) for label, config in ESTIMATORS if label in chosen]:
        parts = {"all rows": batch.adv_N, "positive rows only": batch.adv_N.clamp(min=0),
                 "negative rows only": batch.adv_N.clamp(max=0)}
        draws_here = draws_of(config, draws)
        full = torch.stack([batch_grad(policy, batch, config, d, batch.adv_N) for d in range(draws_here)]).mean(0)
        scale = full.norm().clamp(min=1e-12)  # one unit step along the whole batch's direction
        for part, weights in parts.items():
            g = full if part == "all rows" else torch.stack(
                [batch_grad(policy, batch, config, d, weights) for d in range(draws_here)]).mean(0)
            out.append({"estimator": label, "gradient of": part,
                        "shared_tokens": float(g.double() @ grad_shared.double() / scale),
                        "own_tokens": float(g.double() @ grad_own.double() / scale)})
            print(f"  {label:<28} {part:<20} shared {out[-1]['shared_tokens']:+.4f}  own {out[-1]['own_tokens']:+.4f}",
                  flush=True)
    return out, int(shared_NC.sum()), int(own_NC.sum())


def sampler_table(policy, tokenizer, task, examples, group: int, seed: int) -> list[dict]:
    """Table 2: signal, diversity and reward per sampler setting."""
    out = []
    for label, settings in SAMPLERS:
        generator = TextGenerator(policy, tokenizer, **{**RL_SAMPLER, **settings})
        # sampled as the trainer samples (bf16=auto); the gradients of tables 1 and 3 are taken in float32
        with torch.no_grad(), autocast(torch.device("cpu"), resolve_bf16("auto")):
            batch = Batch(generator, task, examples, group, seed)
        out.append({"sampler": label, "settings": {**RL_SAMPLER, **settings},
                    "reward": batch.rewards_N.mean().item(),
                    "groups_with_signal": batch.signal_groups().float().mean().item(),
                    "distinct_per_group": batch.distinct_share(), "forwards_per_rollout": batch.forwards,
                    "seconds": round(batch.seconds, 1)})
        print(f"  {label:<34} reward {out[-1]['reward']:.3f}  signal {out[-1]['groups_with_signal']:.3f}  "
              f"distinct {out[-1]['distinct_per_group']:.3f}  forwards {batch.forwards}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/tiny-dllm", help="a model directory (relative: to the repository)")
    parser.add_argument("--prompts", type=int, default=16, help="Sudoku train prompts for tables 1 and 3")
    parser.add_argument("--group", type=int, default=6, help="rollouts per prompt (G)")
    parser.add_argument("--rows", type=int, default=12, help="rows whose per-row gradients are compared")
    parser.add_argument("--draws", type=int, default=4, help="mask draws per estimator")
    parser.add_argument("--sampler-prompts", type=int, default=64, help="train prompts for table 2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tables", default="1,2,3", help="which tables to measure (the others are kept from --json)")
    parser.add_argument("--json", default=None, help="write the results here (each table as it is done)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    policy, tokenizer = load_policy(str(ROOT / args.model) if not Path(args.model).is_absolute() else args.model)
    policy.model.eval()
    task = build_task("sudoku")
    examples = task.examples("train", max(args.prompts, args.sampler_prompts), args.seed)
    tables = {int(t) for t in args.tables.split(",")}
    out = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).is_file() else {}
    out["meta"] = {**out.get("meta", {}), "command": "python scripts/diagnose_learning.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k not in ("json", "tables")),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__}

    def save(**results) -> None:
        out.update(results)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")

    if 2 in tables:
        print("table 2: signal and diversity per sampler setting", flush=True)
        save(samplers=sampler_table(policy, tokenizer, task, examples[:args.sampler_prompts], args.group, args.seed))
    with torch.no_grad():
        batch = Batch(TextGenerator(policy, tokenizer, **RL_SAMPLER), task, examples[:args.prompts], args.group,
                      args.seed)
    signal = batch.signal_groups()
    out["meta"].update(rollouts=len(batch), groups_with_signal=int(signal.sum()), groups=len(signal))
    if 1 in tables:
        # rows for the per-row cosines: spread over the groups
        rows = torch.linspace(0, len(batch) - 1, args.rows).round().long()
        print(f"table 1: gradient agreement with the exact ordered likelihood ({len(batch)} rollouts, "
              f"{int(signal.sum())} of {len(signal)} groups with signal, {args.draws} draws)", flush=True)
        agreement = gradient_agreement(policy, batch, rows, args.draws)
        with torch.no_grad():
            jg = Batch(TextGenerator(policy, tokenizer, **JUSTGRPO_SAMPLER), task, examples[:2], args.group,
                       args.seed)
        jg_cos = [cosine(flat_grad(policy, seq_logp(policy, jg, {"name": "left_to_right", "group": 1}, r[None], 0).sum()),
                         flat_grad(policy, seq_logp(policy, jg, REFERENCE, r[None], 0).sum())) for r in torch.arange(4)]
        agreement.append({"estimator": "JustGRPO (left_to_right group 1 on left-to-right rollouts)",
                          "config": {"name": "left_to_right", "group": 1, "rollout": JUSTGRPO_SAMPLER},
                          "row_cos_mean": sum(jg_cos) / len(jg_cos), "row_cos_sd_rows": 0.0, "row_cos_sd_draws": 0.0,
                          "batch_cos_mean": None, "batch_cos_sd_draws": None, "batch_cos_of_mean": None})
        print(f"  JustGRPO on its own rollouts: row cosine {agreement[-1]['row_cos_mean']:+.4f}", flush=True)
        save(agreement=agreement)
    if 3 in tables:
        print("table 3: the positive rows' exact log-likelihood along each update direction", flush=True)
        effect, n_shared, n_own = shared_token_effect(policy, batch, args.draws)
        out["meta"].update(shared_tokens=n_shared, own_tokens=n_own)
        save(shared_tokens=effect)

if __name__ == "__main__":
    main()
