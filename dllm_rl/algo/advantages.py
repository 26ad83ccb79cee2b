"""Group-relative advantage estimators: rewards_BG (B prompts, G rollouts each) -> advantages_BG.

Each estimator is a pure function of one prompt's group of G rewards, vectorised over the B prompts, and
listed in `ADVANTAGE_FNS`; `compute_advantages` picks one by name at the edge. Row-major flattening gives
the advantage of rollout n = b * G + g, i.e. `adv_N = compute_advantages(...).reshape(-1)`.

Groups of any size (`group_advantages`: rows keyed by their prompt, as a step with a rollout allocator or a
filter has them) go through the same functions, one call per group size, so a step of equal groups gets
bit for bit what `compute_advantages` gives. What the small groups mean:
- a group of 0 rows has no advantages (nothing to train on);
- a group of 1 row has no other rollout to compare with, so its advantage is 0 under every estimator (it is
  "flat"): "mean", "std" and "maxrl" give that by their formulas, and "loo", which has no baseline for one
  rollout, is defined as 0 there too (on equal groups it still needs G >= 2).

- "mean":  A_i = r_i - mean(r)                       d1 / diffu-GRPO (arXiv 2504.12216), Dr.GRPO (2503.20783)
- "std":   A_i = (r_i - mean(r)) / (std(r) + eps)    GRPO (DeepSeekMath, arXiv 2402.03300)
- "maxrl": A_i = (r_i - mean(r)) / (mean(r) + eps)   MaxRL, as paired with SERA (SERA arXiv 2609.36552)
- "loo":   A_i = r_i - mean_{j != i} r_j             RLOO (arXiv 2402.14740)

Departures and choices:
- Dr.GRPO's "constant normalisation" is not an advantage: Dr.GRPO keeps the mean-centred advantage and changes
  how per-token losses are summed (divide by a constant instead of each sequence's length). It lives in
  `dllm_rl/algo/losses.py` as the "constant" aggregation; use it with "mean" here.
- A group whose rewards are all equal gets advantage exactly 0 from every estimator, never NaN and never a
  rounding residue: the mean of [0.1, 0.1, 0.1] is 0.10000000000000002 in float64, and (r - mean) / (std + eps)
  would turn that residue into a spurious ~1e-11 signal.
- Integer rewards are promoted to float32; float32 / float64 rewards keep their dtype.
"""

from __future__ import annotations

from typing import Callable

import torch

from dllm_rl.errors import check_kwargs, pick, require


def _as_float(rewards_BG: torch.Tensor) -> torch.Tensor:
    return rewards_BG if rewards_BG.is_floating_point() else rewards_BG.float()


def _centred(rewards_BG: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r - mean over the group, mean_B1), with flat groups exactly zero (see the module docstring)."""
    rewards_BG = _as_float(rewards_BG)
    mean_B1 = rewards_BG.mean(dim=1, keepdim=True)
    is_flat_B1 = (rewards_BG == rewards_BG[:, :1]).all(dim=1, keepdim=True)
    centred_BG = torch.where(is_flat_B1, torch.zeros_like(rewards_BG), rewards_BG - mean_B1)
    return centred_BG, mean_B1


def mean_centred(rewards_BG: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_j r_j: the group mean as baseline, no scaling.

    d1 / diffu-GRPO (Zhao et al., arXiv 2504.12216) and Dr.GRPO (Liu et al., arXiv 2503.20783), which drops
    GRPO's std division because it up-weights prompts that are almost always (or never) solved.
    """
    return _centred(rewards_BG)[0]


def std_normalised(rewards_BG: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_j r_j) / (std_j r_j + eps): GRPO (DeepSeekMath, Shao et al., arXiv 2402.03300).

    std is the population std (divide by G, `unbiased=False`), so a G=2 group with different rewards gives
    exactly +-1 (up to eps) and G=1 is defined (advantage 0). TRL uses the sample std (divide by G - 1),
    which makes every advantage smaller by sqrt((G - 1) / G).
    """
    require(eps >= 0, f"eps={eps!r}: expected a number >= 0")
    centred_BG, _ = _centred(rewards_BG)
    std_B1 = centred_BG.pow(2).mean(dim=1, keepdim=True).sqrt()
    # Flat groups have centred == 0 exactly, so with eps = 0 only they could give 0/0; guard them.
    return torch.where(std_B1 > 0, centred_BG / (std_B1 + eps), torch.zeros_like(centred_BG))


def maxrl(rewards_BG: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_j r_j) / (mean_j r_j + eps): MaxRL, as paired with SERA (SERA arXiv 2609.36552).

    Rewards are assumed in [0, 1] (pass/fail or a score), so mean(r) is the group's success rate p and the
    advantage of a success is (1 - p) / p: rare successes on hard prompts weigh most, which approximates the
    gradient of log p (maximum likelihood) rather than of p. A group with mean 0 (all failures) gets 0.
    Negative rewards are rejected: the mean is a denominator and could be ~0 or change sign.
    """
    require(eps >= 0, f"eps={eps!r}: expected a number >= 0")
    rewards_BG = _as_float(rewards_BG)
    if rewards_BG.numel():
        low = float(rewards_BG.min())
        require(low >= 0, f"maxrl advantages need rewards in [0, 1]; got a reward of {low!r}")
    centred_BG, mean_B1 = _centred(rewards_BG)
    return torch.where(mean_B1 > 0, centred_BG / (mean_B1 + eps), torch.zeros_like(centred_BG))


def leave_one_out(rewards_BG: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j: REINFORCE leave-one-out (RLOO, Ahmadian et al., arXiv 2402.14740).

    Computed as G / (G - 1) * (r_i - mean_j r_j), which is the same quantity: the baseline excludes the
    rollout's own reward, so it is unbiased. Needs G >= 2.
    """
    group_size = rewards_BG.shape[1]
    require(group_size >= 2, f"leave-one-out advantages need G >= 2 rollouts per prompt; got G={group_size}")
    centred_BG, _ = _centred(rewards_BG)
    return centred_BG * (group_size / (group_size - 1))


ADVANTAGE_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "mean": mean_centred,
    "std": std_normalised,
    "maxrl": maxrl,
    "loo": leave_one_out,
}


def group_advantages(rewards_N: torch.Tensor, group_N: torch.Tensor, name: str, **kwargs) -> torch.Tensor:
    """adv_N for rows in groups of any size: `group_N[n]` is row n's group (its prompt); rows of a group need
    not be adjacent. Each group size is one `compute_advantages` call over the groups of that size (rows in
    their order within the group); groups of one row get 0 (see the module docstring)."""
    require(rewards_N.dim() == 1 and group_N.shape == rewards_N.shape,
            f"rewards_N and group_N: expected two 1-D tensors of one length; got {tuple(rewards_N.shape)} and "
            f"{tuple(group_N.shape)}")
    adv_N = torch.zeros_like(_as_float(rewards_N))
    if rewards_N.numel() == 0:
        return adv_N
    groups, inverse_N, sizes = torch.unique(group_N, return_inverse=True, return_counts=True)
    rows_by_group = [(inverse_N == k).nonzero().squeeze(-1) for k in range(len(groups))]
    for size in sorted(set(sizes.tolist())):
        if size < 2:
            continue  # a lone rollout: advantage 0
        members = [rows for rows in rows_by_group if len(rows) == size]
        index_BG = torch.stack(members)
        adv_N[index_BG.reshape(-1)] = compute_advantages(rewards_N[index_BG], name,
                                                         **kwargs).reshape(-1).to(adv_N.dtype)
    return adv_N


def compute_advantages(rewards_BG: torch.Tensor, name: str, **kwargs) -> torch.Tensor:
    """Advantages_BG from the estimator `ADVANTAGE_FNS[name]`; kwargs (e.g. eps) go to it."""
    fn = pick(ADVANTAGE_FNS, name, "advantage estimator")
    got = tuple(rewards_BG.shape) if isinstance(rewards_BG, torch.Tensor) else type(rewards_BG).__name__
    require(
        isinstance(rewards_BG, torch.Tensor) and rewards_BG.dim() == 2,
        f"rewards_BG: expected a 2-D tensor (B prompts, G rollouts); got {got}",
    )
    check_kwargs(fn, kwargs, "")
    return fn(rewards_BG, **kwargs)
