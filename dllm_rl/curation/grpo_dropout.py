"""GRPODropout (arXiv 2610.11854): drop the positive rollouts that collapse the policy's entropy.

Under a policy-gradient step the entropy moves against Cov(A, log pi): a rollout with a positive advantage and a
low surprisal (one the policy already finds likely) lowers it the most. Per group of G rollouts, with s_g the
rollout's length-normalised surprisal under the old policy and A_g its advantage:

    h_g = (A_g / G) (s_g - mean_g s)          so that  Cov(A, s) = sum_g h_g  over the group
    remove rollouts of any sign, the most negative h_g first, one at a time, until sum over the kept of h_g >= 0
    (Cov(A * keep, s) >= 0 over the original group); then restore the removed rollouts with A_g <= 0: only
    positive rollouts are dropped in the end, but which ones is decided with the negative ones in the count
    recentre the kept advantages: A_g - sum_kept(w A) / sum_kept(w), w_g = exp(-s_g)

The GRPO loss is unchanged; a dropped rollout gets loss weight 0. Decisions of this project where the paper's text
leaves room: s_g is read from the sampler's record (`Rows.sampler_logp_NC`: the old policy's log-probability of
each token as it was committed, over the counted tokens), which every on-policy row has without a forward, whatever
the likelihood estimator; only groups where a rollout was dropped are recentred, so a step that drops nothing is
plain GRPO; external (ERILS) rows are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GrpoDropoutConfig:
    pass  # no options: the rule is the paper's (remove by h of any sign, restore the non-positive)


def surprisal(logp_NC: torch.Tensor, mask_NC: torch.Tensor) -> torch.Tensor:
    """s_N: minus the mean log-probability over each row's counted tokens (0 for a row with none)."""
    counted_NC = mask_NC != 0
    total_N = torch.where(counted_NC, logp_NC.float(), torch.zeros_like(logp_NC, dtype=torch.float32)).sum(-1)
    return -total_N / counted_NC.sum(-1).clamp(min=1)


def contributions(adv_G: torch.Tensor, s_G: torch.Tensor) -> torch.Tensor:
    """h_G = (A / G)(s - mean s): each rollout's term of the group's Cov(A, s)."""
    return adv_G / len(adv_G) * (s_G - s_G.mean())


def keep_mask(adv_G: torch.Tensor, s_G: torch.Tensor) -> torch.Tensor:
    """keep_G: rollouts removed, most negative h first (any sign), until the kept h sum to >= 0; then the removed
    rollouts with A <= 0 restored, so False only for the removed positive ones."""
    h_G = contributions(adv_G.double(), s_G.double())
    removed_G = torch.zeros(len(adv_G), dtype=torch.bool, device=adv_G.device)
    total = float(h_G.sum())
    for g in sorted(range(len(adv_G)), key=lambda g: (float(h_G[g]), g)):
        if total >= 0 or float(h_G[g]) >= 0:
            break
        removed_G[g] = True
        total -= float(h_G[g])
    return ~(removed_G & (adv_G > 0))


def recentred(adv_G: torch.Tensor, s_G: torch.Tensor, keep_G: torch.Tensor) -> torch.Tensor:
    """The kept advantages less their exp(-s)-weighted mean (dropped rollouts: 0)."""
    w_G = torch.exp(-(s_G.double() - s_G.double().min())) * keep_G  # shifted: the same ratios, no underflow
    mean = (w_G * adv_G.double()).sum() / w_G.sum()
    return torch.where(keep_G, adv_G.double() - mean, torch.zeros_like(w_G)).to(adv_G.dtype)
