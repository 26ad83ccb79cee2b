"""Auxiliary masked-diffusion SFT terms beside the GRPO loss: rows whose `target_NC` tokens the policy learns to
predict from the prompt and the target tokens left visible, the rest of the window masked throughout (EchoRL's
echo clips, dllm_rl/curation/echo.py).

The loss is `dllm-rl sft`'s (dllm_rl/sft.py, LLaDA's Eq. 3) over the targets only: each row draws t ~ U[eps, 1]
and masks each target token with probability t (one seeded generator per row: the noise does not depend on the
batch or the rank; at least one target per row, a departure from LLaDA's estimator so that no clip is wasted), then
    elbo:        sum over masked targets of CE / t, divided by the number of targets
    masked_mean: sum over masked targets of CE, divided by the number of masked targets
the counts taken over every rank's rows (`global_units`) and the rank's sum scaled by the number of ranks, as
`grpo_loss` does, so the engine's average over ranks is the loss over all rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

EPS = 1e-3  # the lowest masking probability (LLaDA's eps)


@dataclass
class AuxRows:
    """One kind of auxiliary rows of a step, on one rank."""

    name: str  # what made them, e.g. "echo": logged as loss/<name>
    ids_NL: torch.Tensor  # left-padded prompt (P) + completion window (C), as the rows were generated
    attention_mask_NL: torch.Tensor
    prompt_length: int
    target_NC: torch.Tensor  # bool: the window tokens the loss predicts; the other window tokens stay masked
    seeds_N: list[int]  # each row's masking seed
    weight: float  # the term's weight against the GRPO loss
    weighting: str = "elbo"

    def __len__(self) -> int:
        return self.ids_NL.shape[0]


def noised(rows: AuxRows, mask_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy_NL, masked_NC, t_N): each target masked with its row's probability t; non-targets always masked."""
    N, C = rows.target_NC.shape
    generators = [torch.Generator().manual_seed(int(s)) for s in rows.seeds_N]  # cpu: one per row, seeded
    # cpu: seeded draws, the same on every device
    draws = [(g, torch.rand(1, generator=g, dtype=torch.float64)) for g in generators]
    t_N = torch.cat([EPS + (1 - EPS) * u for _, u in draws]).to(rows.ids_NL.device)
    u_NC = torch.stack([torch.rand(C, generator=g, dtype=torch.float64)  # cpu: seeded draws, as above
                        for g, _ in draws]).to(rows.ids_NL.device)
    masked_NC = rows.target_NC & (u_NC < t_N[:, None])
    # at least one target masked per row (the one of the lowest draw): a clip whose draw masked none would teach nothing
    lowest_N = u_NC.masked_fill(~rows.target_NC, 2.0).argmin(-1)
    masked_NC[torch.arange(N, device=masked_NC.device), lowest_N] |= rows.target_NC.any(-1)
    window_NC = rows.ids_NL[:, rows.prompt_length:]
    visible_NC = rows.target_NC & ~masked_NC
    noisy_NL = rows.ids_NL.clone()
    noisy_NL[:, rows.prompt_length:] = torch.where(visible_NC, window_NC, torch.full_like(window_NC, mask_id))
    return noisy_NL, masked_NC, t_N


def units(rows: AuxRows, masked_NC: torch.Tensor) -> float:
    """This rank's share of the loss's normaliser: its targets (elbo) or its masked targets (masked_mean)."""
    return float((rows.target_NC if rows.weighting == "elbo" else masked_NC).sum())


def auxiliary_loss(policy, rows: AuxRows, global_units: float, ranks: int = 1) -> torch.Tensor:
    """The rows' SFT loss (unweighted), this rank's share of the loss over every rank's rows."""
    noisy_NL, masked_NC, t_N = noised(rows, policy.mask_id)
    logits_NCV = policy.logits(noisy_NL, rows.attention_mask_NL)[:, rows.prompt_length:]
    ce_NC = F.cross_entropy(logits_NCV.float().transpose(1, 2), rows.ids_NL[:, rows.prompt_length:], reduction="none")
    ce_NC = ce_NC * masked_NC
    if rows.weighting == "elbo":
        ce_NC = ce_NC / t_N[:, None].float()
    return ce_NC.sum() / max(global_units, 1.0) * ranks
