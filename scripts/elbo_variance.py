"""Per-mask variance of the two ELBO forms, side by side (`likelihood=elbo`, `likelihood.masking=`):

- `per_token`: every window token masked with probability t ~ U[eps, 1], weight 1 / t (the project's default);
- `fixed_count`: exactly l ~ U{1..C} window tokens masked, weight C / l (LLaDA's `get_log_likelihood`).

Both estimate the same ELBO (dllm_rl/likelihood/estimators.py says why). For each model, each row is scored
under `--masks` single masks per form (one forward each); the table gives the mean estimate of the row's
sequence log-likelihood and the variance across masks, averaged over rows, and their ratio. Rows are what
external rows look like: the exact solver's completions of Sudoku 4x4 and Countdown in the rollout window.
Models: the embedded dLLM (models/tiny-dllm) and a randomly initialised LLaDA-shaped model (LLaDA-8B's
vocabulary of 126464 and its width-to-depth proportions, scaled down to run here).

    python scripts/elbo_variance.py --json docs/elbo_variance.json
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
from dllm_rl.data.task import render_completion, render_prompt
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.policy.adapters import load_policy, wrap_model
from dllm_rl.policy.modeling import DiffusionLM, DiffusionLMConfig
from dllm_rl.rollout.sampler import left_pad

ROOT = Path(__file__).resolve().parents[1]
FORMS = ("per_token", "fixed_count")


def solver_rows(tokenizer, per_task: int, gen_length: int, seed: int):
    """(ids_NL, attention_mask_NL, prompt_length): solver completions of Sudoku and Countdown test prompts, each
    in a window of `gen_length` tokens filled with EOS after it (as the trainer lays out external rows)."""
    prompts, windows = [], []
    for name in ("sudoku", "countdown"):
        task = build_task(name)
        for example in task.examples("test", per_task, seed):
            text = render_completion(task.solve(example), task.prompt_style)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:gen_length]
            windows.append(ids + [tokenizer.eos_token_id] * (gen_length - len(ids)))
            prompts.append(tokenizer(render_prompt(task.prompt(example), tokenizer),
                                     add_special_tokens=False)["input_ids"])
    ids_NP, mask_NP = left_pad(prompts, tokenizer.pad_token_id, "cpu")
    window_NC = torch.tensor(windows)
    return torch.cat([ids_NP, window_NC], 1), torch.cat([mask_NP, torch.ones_like(window_NC)], 1), ids_NP.shape[1]


def llada_shaped(tokenizer, hidden: int, layers: int):
    """A random native dLLM with LLaDA-8B's vocabulary and proportions (heads of 128, SwiGLU 3x), scaled down."""
    config = DiffusionLMConfig(vocab_size=126464, hidden_size=hidden, num_hidden_layers=layers,
                               num_attention_heads=max(1, hidden // 128), intermediate_size=3 * hidden,
                               max_position_embeddings=4096, rope_theta=500000.0,
                               mask_token_id=tokenizer.mask_token_id, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    return wrap_model(DiffusionLM(config).eval(), "native", tokenizer)


@torch.no_grad()
def per_mask(policy, ids_NL, mask_NL, P: int, masking: str, masks: int, batch: int) -> torch.Tensor:
    """(rows, masks) single-mask estimates of each row's sequence log-likelihood."""
    estimator = build_estimator({"name": "elbo", "num_masks": 1, "eps": 1e-3, "masking": masking})
    out = torch.empty(len(ids_NL), masks, dtype=torch.float64)
    for row in range(len(ids_NL)):
        for lo in range(0, masks, batch):
            n = min(batch, masks - lo)
            seeds = [1_000_003 * row + s for s in range(lo, lo + n)]
            logp_NC = estimator.logp(policy, ids_NL[row:row + 1].repeat(n, 1), mask_NL[row:row + 1].repeat(n, 1), P,
                                     seeds_N=seeds)
            out[row, lo:lo + n] = logp_NC.sum(1).double()
    return out


def measure(name: str, policy, rows, masks: int, batch: int) -> dict:
    ids_NL, mask_NL, P = rows
    result = {"model": name, "rows": len(ids_NL), "window": ids_NL.shape[1] - P, "masks": masks}
    start = time.perf_counter()
    for form in FORMS:
        estimates = per_mask(policy, ids_NL, mask_NL, P, form, masks, batch)
        result[f"{form}_mean"] = estimates.mean().item()
        result[f"{form}_variance"] = estimates.var(1).mean().item()
        result[f"{form}_stderr_of_mean"] = (estimates.var(1).mean() / (masks * len(ids_NL))).sqrt().item()
    result["variance_ratio"] = result["per_token_variance"] / result["fixed_count_variance"]
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--masks", type=int, default=256, help="single masks per row and form")
    parser.add_argument("--rows", type=int, default=4, help="solver completions per task (Sudoku, Countdown)")
    parser.add_argument("--gen-length", type=int, default=64, help="the rollout window (configs/rollout/rl.yaml)")
    parser.add_argument("--llada-hidden", type=int, default=256)
    parser.add_argument("--llada-layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="masks per forward batch")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    policy, tokenizer = load_policy(str(ROOT / "models" / "tiny-dllm"))
    rows = solver_rows(tokenizer, args.rows, args.gen_length, seed=0)
    results = [measure("embedded tiny-dllm", policy, rows, args.masks, args.batch),
               measure(f"random LLaDA-shaped (vocab 126464, hidden {args.llada_hidden}, {args.llada_layers} layers)",
                       llada_shaped(tokenizer, args.llada_hidden, args.llada_layers), rows, args.masks, args.batch)]
    print(f"{'model':<62} {'form':<12} {'mean logp':>10} {'var/mask':>10}")
    for r in results:
        for form in FORMS:
            print(f"{r['model']:<62} {form:<12} {r[f'{form}_mean']:>10.2f} {r[f'{form}_variance']:>10.2f}")
        print(f"{'':<62} {'ratio':<12} {'':>10} {r['variance_ratio']:>9.2f}x  (per_token / fixed_count)")
    if args.json:
        meta = {"command": "python scripts/elbo_variance.py " + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
