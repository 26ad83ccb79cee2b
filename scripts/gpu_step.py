"""Time one GRPO step of an LLaDA-8B-architecture dLLM with the recipe's memory settings, on one GPU.

A randomly initialised native model with LLaDA-8B's shape (hidden 4096, 32 layers, 32 heads, SwiGLU width
12288, vocabulary 126464: 8.0B parameters) is saved in bf16 and trained for one step by `dllm_rl.train.train`,
as `configs/experiment/llada8b_d1.yaml` sets it up: LoRA r=128 on every linear layer, gradient checkpointing,
bf16 autocast, ZeRO-2 in bf16, d1's 256-token rollouts in blocks of 32 with 128 denoising steps, the
mean-field estimator and beta=0.04 with the disabled-adapter reference. Where the full depth does not fit,
the depth is halved until it does; the JSON says which model ran.

Prints one table and writes JSON: rollout tokens/s, rollout / scoring / update seconds, peak GPU memory.
    python scripts/gpu_step.py --out runs/gpu_check/gpu_step.json
    python scripts/gpu_step.py --layers 2 --hidden 64 --heads 4 --intermediate 128 --vocab 512 --gen-length 32 \
        --steps 16 --lora-r 4 --out /tmp/step.json      # a smoke run on any machine (CPU included)
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dllm_rl.data import build_task  # noqa: E402
from dllm_rl.data.task import Reward  # noqa: E402
from dllm_rl.data.tokenizers import load_tokenizer  # noqa: E402
from dllm_rl.device import default_device  # noqa: E402
from dllm_rl.policy.modeling import DiffusionLM, DiffusionLMConfig  # noqa: E402
from dllm_rl.train import train  # noqa: E402


def build_checkpoint(directory: Path, args, layers: int, device: torch.device) -> int:
    """A random LLaDA-shaped native model saved in bf16 with the embedded tokenizer; returns its parameters."""
    tokenizer = load_tokenizer(str(ROOT / "models" / "tiny-dllm"), "model")
    config = DiffusionLMConfig(vocab_size=max(args.vocab, len(tokenizer)), hidden_size=args.hidden,
                               num_hidden_layers=layers, num_attention_heads=args.heads,
                               intermediate_size=args.intermediate, max_position_embeddings=4096,
                               rope_theta=500000.0, mask_token_id=tokenizer.mask_token_id,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                               bos_token_id=tokenizer.bos_token_id)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = DiffusionLM(config)
    finally:
        torch.set_default_dtype(default)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    return count


class DenseCountdown:
    """Countdown prompts with a reward a random model earns (the share of digits in its completion), so the
    step has a learning signal and its update runs (a random model solves no puzzle: every advantage would be
    0 and the update skipped)."""

    name, prompt_style = "countdown_digit_share", "compact"

    def __init__(self):
        self.task = build_task("countdown")

    def examples(self, split, n, seed):
        return self.task.examples(split, n, seed)

    def prompt(self, example) -> str:
        return self.task.prompt(example)

    def reward(self, completion: str, example):
        share = sum(c.isdigit() for c in completion) / max(1, len(completion))
        return Reward(share, share > 0.2, False, "digit share")

    def solve(self, example):
        return self.task.solve(example)


def one_step(model_dir: Path, run_dir: Path, args) -> dict[str, float]:
    return train(
        DenseCountdown(), model=str(model_dir), run_dir=str(run_dir), steps=1, prompts_per_step=args.prompts,
        group_size=args.group, minibatch_size=args.prompts * args.group, inner_iterations=1,
        rollout={"gen_length": args.gen_length, "block_length": args.block_length, "steps": args.steps,
                 "temperature": 0.9},
        likelihood={"name": "mean_field"}, algo={"advantage": "mean", "beta": 0.04, "kl": "k3"},
        lora={"r": args.lora_r, "alpha": 2.0 * args.lora_r, "dropout": 0.0, "target_modules": "all-linear"},
        gradient_checkpointing=True, bf16=True, deepspeed={"stage": 2, "bf16": True}, external={"name": "none"},
        eval_every=0, checkpoint_every=0, sample_every=0, tensorboard=False, lr=1e-5, warmup=0,
        print_fn=lambda *_: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=12288)
    parser.add_argument("--vocab", type=int, default=126464)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="rollouts per prompt")
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=128, help="denoising steps")
    parser.add_argument("--lora-r", type=int, default=128)
    parser.add_argument("--work", default=None, help="where the random checkpoint is written (default: a temp dir)")
    parser.add_argument("--out", default="runs/gpu_step.json")
    args = parser.parse_args()

    device = default_device()
    gpu = device.type == "cuda"
    work = Path(args.work or tempfile.mkdtemp(prefix="dllm_rl_gpu_step_"))
    result: dict = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
                    "attempts": []}
    layers = args.layers
    while layers >= 1:
        shutil.rmtree(work / "model", ignore_errors=True)
        shutil.rmtree(work / "run", ignore_errors=True)
        try:
            start = time.perf_counter()
            params = build_checkpoint(work / "model", args, layers, device)
            built = time.perf_counter() - start
            if gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            metrics = one_step(work / "model", work / "run", args)
            total = time.perf_counter() - start
        except torch.cuda.OutOfMemoryError as error:
            result["attempts"].append({"layers": layers, "error": str(error).splitlines()[0][:200]})
            gc.collect()
            torch.cuda.empty_cache()
            layers //= 2
            continue
        rollout_tokens = args.prompts * args.group * args.gen_length
        result.update({
            "model": {"hidden": args.hidden, "layers": layers, "heads": args.heads, "intermediate": args.intermediate,
                      "vocab": args.vocab, "parameters_B": round(params / 1e9, 3),
                      "full_depth": layers == args.layers},
            "step": {"rollouts": args.prompts * args.group, "gen_length": args.gen_length,
                     "block_length": args.block_length, "denoising_steps": args.steps, "lora_r": args.lora_r,
                     "gradient_checkpointing": True, "bf16": True, "zero_stage": 2},
            "seconds": {"build_and_save": round(built, 1), "train_call": round(total, 1),
                        "rollout": round(metrics.get("perf/rollout_s", float("nan")), 2),
                        "score": round(metrics.get("perf/score_s", float("nan")), 2),
                        "update": round(metrics.get("perf/update_s", float("nan")), 2)},
            "rollout_tokens_per_s": round(rollout_tokens / max(metrics.get("perf/rollout_s", 0.0), 1e-9), 1),
            "peak_gpu_memory_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if gpu else None,
            "finite": all(v == v and abs(v) != float("inf") for v in metrics.values() if isinstance(v, float)),
            "policy_updates": metrics.get("policy/updates"),
        })
        break
    shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if "model" not in result:
        print(f"no depth fitted: {result['attempts']}")
        sys.exit(1)
    m, s = result["model"], result["seconds"]
    print(f"{'model':<34}{m['parameters_B']}B params ({m['layers']} layers x {m['hidden']}), on {result['device']}")
    for key, value in [("rollout s", s["rollout"]), ("rollout tokens/s", result["rollout_tokens_per_s"]),
                       ("score s", s["score"]), ("update s", s["update"]),
                       ("peak GPU memory GiB", result["peak_gpu_memory_GiB"]), ("metrics finite", result["finite"]),
                       ("updates applied", result["policy_updates"])]:
        print(f"{key:<34}{value}")
    print(f"wrote {args.out}")
    sys.exit(0 if result["finite"] and result["policy_updates"] == 1 else 1)


if __name__ == "__main__":
    main()
