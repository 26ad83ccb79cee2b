"""GPU memory per rank of the 8B recipes, computed with the ZeRO accounting (no GPU needed).

For a model given by its dimensions (LLaDA-8B-Instruct and Dream-v0-Instruct-7B are built in, read off their
published config.json) it counts the parameters and the LoRA parameters of `lora.target_modules=all-linear`
(every linear layer of the blocks; the output head excluded, as peft's all-linear does) and prints, for N
ranks, the model state each rank holds (GB = 1e9 bytes):

- bf16 mixed precision as `deepspeed.bf16=true` runs it (Rajbhandari et al., arXiv 1910.02054): 2 B of
  weights and 2 B of gradients per trained parameter, 12 B of fp32 master weights and AdamW moments;
  stage 1 divides the 12 B over the ranks, stage 2 the gradients too, stage 3 the weights too;
- with LoRA, the frozen base holds its 2 B weights only (divided at stage 3) and the 16 B apply to the
  adapter; without LoRA and with `algo.beta > 0` the reference is a second bf16 copy (divided at stage 3);
- the block inputs that gradient checkpointing keeps for a micro-batch: layers x tokens x hidden x 2 B.
  Other activations (one block's, recomputed in the backward pass; the logits of the micro-batch) come on top.

    python scripts/memory_plan.py --ranks 8 --out docs/memory_plan.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class Dims:
    """A transformer's shapes: `linear` lists each block's linear layers as (inputs, outputs)."""

    name: str
    vocab: int
    hidden: int
    layers: int
    linear: tuple[tuple[int, int], ...]
    biases: int = 0  # bias parameters per block (Qwen2's q, k, v)
    tied: bool = False  # output head shares the input embedding

    @property
    def parameters(self) -> int:
        block = sum(i * o for i, o in self.linear) + self.biases + 2 * self.hidden  # two norms
        heads = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * block + heads + self.hidden

    def lora_parameters(self, r: int) -> int:
        return self.layers * sum(r * (i + o) for i, o in self.linear)


def llada_8b() -> Dims:  # GSAI-ML/LLaDA-8B-Instruct config.json: d_model 4096, 32 layers, mlp 12288, vocab 126464
    d, f = 4096, 12288
    return Dims("LLaDA-8B-Instruct", 126464, d, 32, ((d, d),) * 4 + ((d, f), (d, f), (f, d)))


def dream_7b() -> Dims:  # Dream-org/Dream-v0-Instruct-7B (Qwen2.5-7B): hidden 3584, 28 layers, 4 KV heads
    d, f, kv = 3584, 18944, 512
    return Dims("Dream-v0-Instruct-7B", 152064, d, 28, ((d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)),
                biases=d + 2 * kv)


def model_state(dims: Dims, ranks: int, stage: int, lora_r: int = 0, reference: bool = False) -> dict[str, float]:
    """GB per rank of weights, gradients, optimizer state and the reference copy (bf16 mixed precision)."""
    psi = dims.parameters
    trained = dims.lora_parameters(lora_r) if lora_r else psi
    frozen = psi if lora_r else 0
    split = lambda n, from_stage: n / ranks if stage >= from_stage else n  # noqa: E731
    out = {
        "weights": (split(2 * frozen, 3) + split(2 * trained, 3)) / GB,
        "gradients": split(2 * trained, 2) / GB,
        "optimizer": split(12 * trained, 1) / GB,
        "reference": (split(2 * psi, 3) if reference and not lora_r else 0.0) / GB,
    }
    out["total"] = sum(out.values())
    return out


def checkpointed_activations(dims: Dims, rows: int, tokens: int) -> float:
    """GB of the block inputs gradient checkpointing keeps for `rows` sequences of `tokens` (bf16)."""
    return dims.layers * rows * tokens * dims.hidden * 2 / GB


PLANS = (  # (label, stage, LoRA rank, reference copy)
    ("LoRA r=128, ZeRO-2 (the recipes)", 2, 128, False),
    ("LoRA r=128, ZeRO-3", 3, 128, False),
    ("full weights, ZeRO-2, reference", 2, 0, True),
    ("full weights, ZeRO-3, reference", 3, 0, True),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=12, help="rollouts per rank per micro-batch (96 / 8 ranks)")
    parser.add_argument("--tokens", type=int, default=456, help="prompt (about 200) + 256 completion tokens")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for dims in (llada_8b(), dream_7b()):
        activations = checkpointed_activations(dims, args.rows, args.tokens)
        for label, stage, r, reference in PLANS:
            state = model_state(dims, args.ranks, stage, r, reference)
            rows.append({"model": dims.name, "plan": label, "ranks": args.ranks, "parameters": dims.parameters,
                         "lora_parameters": dims.lora_parameters(r) if r else 0, **state,
                         "checkpointed_activations": activations})
    print(f"| model | plan | params | LoRA params | weights | grads | optimizer | reference | model state | "
          f"+ checkpointed activations ({args.rows} x {args.tokens} tokens) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['plan']} | {row['parameters'] / 1e9:.2f}B | "
              f"{row['lora_parameters'] / 1e6:.0f}M | "
              f"{row['weights']:.1f} | {row['gradients']:.2f} | {row['optimizer']:.2f} | {row['reference']:.1f} | "
              f"{row['total']:.1f} GB | {row['total'] + row['checkpointed_activations']:.1f} GB |")
    if args.out:
        args.out.write_text(json.dumps({"ranks": args.ranks, "rows": rows,
                                        "dims": [asdict(d) for d in (llada_8b(), dream_7b())]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
