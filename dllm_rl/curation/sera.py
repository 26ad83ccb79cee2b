"""SERA (arXiv 2609.36552): give each prompt its own group size, so that MaxRL's finite-sample attenuation is the
same for every prompt.

With the MaxRL advantage (r - mean) / (mean + eps) (`algo.advantage=maxrl`), a group of N rollouts of a prompt
whose success rate is p estimates the gradient of log p only up to the factor 1 - (1 - p)^(N - 1): the chance
that another rollout of the group succeeded. With one N for all prompts, hard prompts (small p) are attenuated
most. SERA spends the step's budget of B * N0 rollouts as

    N_q = 1 + tau / (-log(1 - p_q)),   clipped to [n_min, n_max],

with tau found by bisection so that the N_q add up to the budget: before clipping, (1 - p_q)^(N_q - 1) = e^-tau
for every prompt. The integers spend the budget exactly (the largest fractional parts round up). A prompt whose
largest group would almost surely be flat (1 - p^n_max - (1 - p)^n_max < `active_min`: even n_max rollouts would
not tell it apart) is inactive and gets none; an inactive prompt is made active again at its `revisit_every`-th
inactive visit in a row (its success rate may have moved while it was not observed), and when every prompt of a
step is inactive they are all made active, so the step's budget is always spent. Each row's loss weight is
N0 / N_q, so a prompt's total weight is what a uniform group gives it.

p_q is the mean of a discounted Beta posterior per prompt, prior Beta(0.5, 0.5): at each epoch boundary of the
prompt stream the evidence is discounted toward the prior, alpha <- prior + discount * (alpha - prior) +
successes (beta likewise with failures; discount 0.75), so an unobserved prompt's belief drifts back to the
prior, not to zero; within an epoch it is frozen. Defaults are the paper's (prior, discount, active_min 0.05);
n_min = 2 (the smallest group with a comparison), n_max = 4 N0 and revisit_every = 3 are this project's choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dllm_rl.errors import require


@dataclass(frozen=True)
class SeraConfig:
    prior: float = 0.5  # Beta(prior, prior)
    discount: float = 0.75
    active_min: float = 0.05
    n_min: int = 2
    n_max: int | None = None  # None = 4 * group_size
    revisit_every: int = 3  # an inactive prompt is made active at this many inactive visits in a row

    def __post_init__(self) -> None:
        require(self.prior > 0, f"curation.sera.prior={self.prior!r}: expected a number > 0")
        require(0.0 <= self.discount <= 1.0, f"curation.sera.discount={self.discount!r}: expected a number in [0, 1]")
        require(0.0 <= self.active_min < 1.0, f"curation.sera.active_min={self.active_min!r}: expected [0, 1)")
        require(self.n_min >= 1, f"curation.sera.n_min={self.n_min!r}: expected >= 1")
        require(self.revisit_every >= 1, f"curation.sera.revisit_every={self.revisit_every!r}: expected >= 1")
        require(self.n_max is None or self.n_max >= self.n_min,
                f"curation.sera.n_max={self.n_max!r}: expected null or >= n_min ({self.n_min})")


def posterior_update(alpha: float, beta: float, successes: float, failures: float, discount: float,
                     prior: float) -> tuple[float, float]:
    """The Beta parameters after an epoch with these outcomes: older evidence discounted toward the prior."""
    return (prior + discount * (alpha - prior) + successes, prior + discount * (beta - prior) + failures)


def mixed_chance(p: float, n: int) -> float:
    """The probability that n rollouts at success rate p are not all equal."""
    return 1.0 - p ** n - (1.0 - p) ** n


def attenuation(p: float, n: int) -> float:
    """MaxRL's finite-sample factor for a group of n at success rate p: 1 - (1 - p)^(n - 1)."""
    return 1.0 - (1.0 - p) ** (n - 1)


P_MAX = 1.0 - 1e-12  # a success rate of 1 is taken as this: a large enough tau still buys such a prompt more


def group_size_at(tau: float, p: float, n_min: int, n_max: int) -> float:
    """1 + tau / (-log(1 - p)), clipped to [n_min, n_max] (p = 0: n_max)."""
    size = math.inf if p <= 0.0 else 1.0 + tau / -math.log1p(-min(p, P_MAX))
    return min(float(n_max), max(float(n_min), size))


def allocate(p: list[float], budget: int, n_min: int, n_max: int, iterations: int = 100) -> list[int]:
    """Integer group sizes in [n_min, n_max] for prompts of success rates `p`, adding up to `budget` wherever the
    bounds allow it (else every prompt at the nearer bound); tau by bisection, then the largest remainders."""
    require(n_min <= n_max, f"n_min={n_min} > n_max={n_max}")
    if not p:
        return []
    low_total, high_total = n_min * len(p), n_max * len(p)
    if budget <= low_total:
        return [n_min] * len(p)
    if budget >= high_total:
        return [n_max] * len(p)
    total = lambda tau: sum(group_size_at(tau, q, n_min, n_max) for q in p)  # noqa: E731
    lo, hi = 0.0, 1.0
    while total(hi) < budget:
        hi *= 2.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < budget else (lo, mid)
    sizes = [group_size_at(hi, q, n_min, n_max) for q in p]
    whole = [int(math.floor(s)) for s in sizes]
    left = budget - sum(whole)
    by_remainder = sorted(range(len(p)), key=lambda i: (-(sizes[i] - whole[i]), i))
    while left > 0:  # one more rollout each, largest remainder first (a second round only through rounding)
        for i in by_remainder:
            if left > 0 and whole[i] < n_max:
                whole[i] += 1
                left -= 1
    while left < 0:  # rounding overshot (only through floating point): take back from the largest
        i = max(range(len(p)), key=lambda j: (whole[j], -j))
        whole[i] -= 1
        left += 1
    return whole
