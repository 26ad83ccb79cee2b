"""EchoRL's echo clips: an all-correct group carries no advantage, so its signal is turned into an auxiliary
supervised term on a prefix of one of its rollouts, up to and including the rollout's hardest step.

For a dLLM the steps are denoising steps, and a rollout's prefix up to step k is what the sampler had committed
by then: the tokens unmasked at steps <= k (`Rows.order_NC`), wherever in the window they are. The hardest step is
the one whose committed tokens had the highest mean entropy when they were committed (`Rows.entropy_NC`, recorded
by the sampler: the policy's distribution at temperature 1, the mask token excluded), over the counted tokens (up
to and including the first EOS; a step that committed only EOS fill is not a step of the answer). The clip is
learnt with the masked-diffusion SFT loss (`dllm_rl/algo/auxiliary.py`) in the state the sampler saw it: the
tokens committed later stay masked and are never predicted.

Decisions of this project where the paper (written for autoregressive models) leaves room:
- one clip per all-correct group: its first rollout (the lowest rollout index), all of them being correct and
  drawn alike;
- the mirror case (`external=true`): in a group where every on-policy rollout failed, the first verified-correct
  external row becomes a clip too. An external row has no denoising record and its sources record no per-token
  entropy (a `causal_lm` source records log-probs of the tokens it sampled, in its own tokenizer), and judging its
  steps with the dLLM would take forwards: its clip is the whole completion, i.e. plain SFT on a verified answer;
- the clips join the step's first update as one more backward pass per kind (`echo`, `echo_external`), weighted
  by `weight` against the GRPO loss; a step whose groups are all flat updates on the clips alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dllm_rl.errors import require

WEIGHTINGS = ("elbo", "masked_mean")


@dataclass(frozen=True)
class EchoConfig:
    weight: float = 0.1  # the auxiliary term's weight against the GRPO loss
    external: bool = True  # also clip a correct external row where every on-policy rollout failed
    weighting: str = "elbo"  # the SFT loss's form: elbo (LLaDA's CE / t, `dllm-rl sft`'s default) | masked_mean

    def __post_init__(self) -> None:
        require(math.isfinite(self.weight) and self.weight > 0,
                f"curation.echo.weight must be > 0 and finite, got {self.weight!r}")
        require(self.weighting in WEIGHTINGS, f"curation.echo.weighting must be one of {WEIGHTINGS}, "
                f"got {self.weighting!r}")


def step_entropies(order_C: torch.Tensor, entropy_C: torch.Tensor, mask_C: torch.Tensor) -> dict[int, float]:
    """Denoising step -> the mean entropy of the counted tokens committed at it (steps with none left out)."""
    counted_C = mask_C != 0
    out: dict[int, list[float]] = {}
    for step, h in zip(order_C[counted_C].tolist(), entropy_C[counted_C].tolist()):
        out.setdefault(step, []).append(h)
    return {step: sum(hs) / len(hs) for step, hs in sorted(out.items())}


def clip_mask(order_C: torch.Tensor, entropy_C: torch.Tensor, mask_C: torch.Tensor) -> torch.Tensor:
    """clip_C: the counted tokens committed at or before the highest-entropy step (the earliest of equals)."""
    means = step_entropies(order_C, entropy_C, mask_C)
    if not means:
        return torch.zeros_like(mask_C, dtype=torch.bool)
    hardest = max(means, key=lambda step: (means[step], -step))
    return (mask_C != 0) & (order_C <= hardest)


def all_correct_groups(prompt_N: torch.Tensor, correct_N: list[bool], rollout_N: torch.Tensor) -> dict[int, int]:
    """prompt -> the row of its first rollout, for each prompt whose rows are all correct."""
    first: dict[int, int] = {}
    ok: dict[int, bool] = {}
    for n, (p, c, r) in enumerate(zip(prompt_N.tolist(), correct_N, rollout_N.tolist())):
        ok[p] = ok.get(p, True) and c
        if p not in first or r < int(rollout_N[first[p]]):
            first[p] = n
    return {p: first[p] for p in sorted(first) if ok[p]}
