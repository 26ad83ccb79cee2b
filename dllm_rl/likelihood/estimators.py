"""Estimators of log pi_theta(y | x) for a masked-diffusion policy, per completion token.

A dLLM has no tractable sequence likelihood; RL on it needs a proxy, and its cost in forward passes sets
the speed of training. Each estimator takes the full sequences (left-padded prompt of length P, then the
completion window of C tokens), returns `logp_NC` (float32, one value per completion token, prompt
positions never included) and draws its masks from one seed per row, so the old policy, the reference and
every inner iteration can be scored under exactly the same masks (DESIGN: mask seeds travel with the
rollout). Cost is in forward passes per row:

| name           | paper                                   | forwards  | level    |
|----------------|-----------------------------------------|-----------|----------|
| mean_field     | d1 / diffu-GRPO (arXiv 2504.12216)      | 1         | token    |
| elbo           | LLaDA ELBO, VRPO (arXiv 2505.19223)     | M         | sequence |
| coupled        | DiffuCoder coupled-GRPO (2506.20639)    | 2M        | sequence |
| ordered        | TraceRL (arXiv 2509.06949)              | S / group | token    |
| left_to_right  | ordered, one position per step          | C / group | token    |
| espo           | ESPO (arXiv 2512.03759)                 | 2M        | sequence / C |
| spg            | SPG (arXiv 2510.09541): ELBO / EUBO mix  | M         | sequence |

- mean_field: every completion token masked, each prompt token masked with probability
  `prompt_mask_prob`; one forward; log p of each clean completion token. d1 masks the prompt at 0.15 (a fresh
  mask per inner iteration, as regularisation); the default here is 0, the prompt clean: where the prompt holds
  what the answer is a function of (a Sudoku puzzle's givens), a gradient taken with some of it hidden is one for
  another problem, and it was measured nearly orthogonal to the exact one (cosine 0.04 against 0.41 with the
  prompt clean) and left the training reward flat where the clean prompt raised it (docs/learning.md).
- elbo: M masks with t_m from antithetic (stratified) sampling; token i contributes
  mean_m [masked_im / t_m * log p(y_i | masked sequence)]: its sum over tokens is the unbiased Monte-Carlo
  estimate of LLaDA's ELBO (Eq. 3 of arXiv 2502.09992), a lower bound on log p(y | x).
  `masking=fixed_count` is the form of LLaDA's own `get_log_likelihood`: l_m uniform on 1..C (stratified),
  exactly l_m of the C window tokens masked, weight C / l_m. Both forms give a mask of k tokens the same
  expected weight, integral of t^(k-1) (1-t)^(C-k) dt = (k-1)! (C-k)! / C!, so they estimate the same ELBO;
  the fixed count removes the variance of the number of masked tokens (`scripts/elbo_variance.py`).
- coupled: M pairs of complementary masks (mask_a with rate t, mask_b = not mask_a, rate 1 - t), weights
  1/t and 1/(1 - t); every token is scored exactly once per pair, which lowers the variance.
- ordered: the probability of the tokens in the order they were unmasked: at step s, the tokens unmasked
  before s are revealed and the rest masked, and the tokens of step s are scored. With one token per step
  this is exactly log of the probability of generating y along that order. `group` consecutive steps share
  one forward (their tokens are scored from the state before the group), bounding the cost.

"level" says how the trainer forms the importance ratio: per token (d1) or per sequence from the summed
values (ELBO-based methods), since a per-token ratio of a 1/t-weighted Monte-Carlo term is meaningless.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from dllm_rl.errors import check_kwargs, check_ranges, check_types, pick, require
from dllm_rl.policy.adapters import DiffusionPolicy
from dllm_rl.rollout.sampler import first_eos
from dllm_rl.seeds import row_generators


# Where the estimators draw their masks: the CPU, whatever device scores them, so a GPU run and a CPU run score
# under the same masks (N x C draws per row are cheap; see dllm_rl/device.py).
MASK_DEVICE = torch.device("cpu")


def _token_logp(policy: DiffusionPolicy, input_BL, attention_mask_BL, targets_BC, P: int,
                columns_K: torch.Tensor | None = None) -> torch.Tensor:
    """log p of each window target (B, C); with `columns_K`, of those window columns only (B, K): the float32
    log-softmax, and what the backward keeps of it, is then K columns wide, not C."""
    logits_BCV = policy.logits(input_BL, attention_mask_BL)[:, P:]
    if columns_K is not None:
        logits_BCV, targets_BC = logits_BCV[:, columns_K], targets_BC[:, columns_K]
    return -F.cross_entropy(logits_BCV.float().transpose(1, 2), targets_BC, reduction="none")


def antithetic_t(generator: torch.Generator, num: int, eps: float) -> torch.Tensor:
    """`num` times in [eps, 1] from one uniform offset and evenly spaced strata (low-variance sampling)."""
    u0 = torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device)
    u_M = (u0 + torch.arange(num, dtype=torch.float64, device=generator.device) / num) % 1.0
    return eps + (1.0 - eps) * u_M


def masks_at_times(generator: torch.Generator, num: int, C: int, eps: float,
                   t_max: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_M1, is_masked_MC): `num` antithetic times in [eps, t_max] and, for each, every one of C tokens masked
    independently with probability t. The draws the ELBO and coupled estimators share, in one order."""
    t_M1 = antithetic_t(generator, num, eps)[:, None].clamp(max=t_max)
    return t_M1, torch.rand((num, C), generator=generator, dtype=torch.float64, device=generator.device) < t_M1


# Every estimator takes the same runtime arguments (seeds_N, order_NC) so the trainer can call any of them;
# its own options come from its config and are checked by name.


def mean_field(policy, ids_NL, attention_mask_NL, prompt_length: int, *, seeds_N, order_NC=None,
               prompt_mask_prob: float = 0.0) -> torch.Tensor:
    P = prompt_length
    noisy_NL = ids_NL.clone()
    noisy_NL[:, P:] = policy.mask_id
    prompt_real_NP = attention_mask_NL[:, :P].bool()
    # drawn from the last prompt token backwards, so the mask of a prompt does not depend on how much left
    # padding its batch gave it (data-parallel ranks pad their own rows); on the CPU, so it is the same on
    # every device (dllm_rl/device.py), then moved
    u_NP = torch.stack([torch.rand(P, generator=g, device=g.device).flip(0)
                        for g in row_generators(seeds_N, MASK_DEVICE)]).to(ids_NL.device)
    noisy_NL[:, :P] = ids_NL[:, :P].masked_fill((u_NP < prompt_mask_prob) & prompt_real_NP, policy.mask_id)
    return _token_logp(policy, noisy_NL, attention_mask_NL, ids_NL[:, P:], P)


def _masked_passes(policy, ids_NL, attention_mask_NL, P: int, masks_NMC, weights_NMC) -> torch.Tensor:
    """Average over M passes of weight * log p(token) on masked completion tokens -> (N, C)."""
    N, M, C = masks_NMC.shape
    rep_NL = ids_NL.repeat_interleave(M, 0)
    noisy_NL = rep_NL.clone()
    noisy_NL[:, P:] = rep_NL[:, P:].masked_fill(masks_NMC.reshape(N * M, C), policy.mask_id)
    logp_NC = _token_logp(policy, noisy_NL, attention_mask_NL.repeat_interleave(M, 0), rep_NL[:, P:], P)
    return (logp_NC.view(N, M, C) * masks_NMC * weights_NMC).mean(1)


def masks_of_counts(generator: torch.Generator, num: int, C: int, lowest: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(l_M1, is_masked_MC): `num` mask counts l in lowest..C, stratified (one uniform offset, evenly spaced
    strata, each l uniform on lowest..C), and for each exactly l of the C tokens masked, chosen uniformly (the l
    lowest of C uniform scores). LLaDA's `get_log_likelihood` masking (lowest 1); ESPO's (lowest 0)."""
    u0 = torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device)
    u_M = (u0 + torch.arange(num, dtype=torch.float64, device=generator.device) / num) % 1.0
    span = C + 1 - lowest
    l_M1 = (u_M * span).floor().clamp(max=span - 1)[:, None] + lowest
    scores_MC = torch.rand((num, C), generator=generator, dtype=torch.float64, device=generator.device)
    return l_M1, scores_MC.argsort(1).argsort(1) < l_M1


ELBO_MASKINGS = ("per_token", "fixed_count")


def elbo(policy, ids_NL, attention_mask_NL, prompt_length: int, *, seeds_N, order_NC=None, num_masks: int = 4,
         eps: float = 1e-3, masking: str = "per_token") -> torch.Tensor:
    require(num_masks >= 1, f"num_masks must be >= 1, got {num_masks}")
    require(masking in ELBO_MASKINGS, f"masking={masking!r}: expected one of {list(ELBO_MASKINGS)}")
    C = ids_NL.shape[1] - prompt_length
    masks, weights = [], []
    for g in row_generators(seeds_N, MASK_DEVICE):
        if masking == "fixed_count":  # exactly l of C masked, weight C / l
            l_M1, is_masked_MC = masks_of_counts(g, num_masks, C)
            weight_M1 = C / l_M1
        else:  # each token masked with probability t, weight 1 / t
            t_M1, is_masked_MC = masks_at_times(g, num_masks, C, eps)
            weight_M1 = 1.0 / t_M1
        masks.append(is_masked_MC)
        weights.append(weight_M1.expand(num_masks, C))
    return _masked_passes(policy, ids_NL, attention_mask_NL, prompt_length,
                          torch.stack(masks).to(ids_NL.device), torch.stack(weights).float().to(ids_NL.device))


def coupled(policy, ids_NL, attention_mask_NL, prompt_length: int, *, seeds_N, order_NC=None, num_masks: int = 1,
            eps: float = 1e-3) -> torch.Tensor:
    require(num_masks >= 1, f"num_masks must be >= 1, got {num_masks}")
    C = ids_NL.shape[1] - prompt_length
    masks, weights = [], []
    for g in row_generators(seeds_N, MASK_DEVICE):
        t_M1, mask_a = masks_at_times(g, num_masks, C, eps, t_max=1.0 - eps)
        masks.append(torch.cat([mask_a, ~mask_a]))
        weights.append(torch.cat([(1.0 / t_M1).expand(num_masks, C), (1.0 / (1.0 - t_M1)).expand(num_masks, C)]))
    return _masked_passes(policy, ids_NL, attention_mask_NL, prompt_length,
                          torch.stack(masks).to(ids_NL.device), torch.stack(weights).float().to(ids_NL.device))


def espo(policy, ids_NL, attention_mask_NL, prompt_length: int, *, seeds_N, order_NC=None,
         num_masks: int = 2) -> torch.Tensor:
    """ESPO's sequence ELBO per window token (arXiv 2512.03759; github.com/ML-GSAI/ESPO, `espo_trainer.py`,
    `forward_process` and `_get_elbo`), so that its sum over the counted tokens is the ELBO divided by the window C.

    ESPO forms the importance ratio at the sequence level from the ELBO, normalised per token (its Eq. for the
    ratio): rho = exp((ELBO_theta(y) - ELBO_old(y)) / L), L the generation window, clipped as in PPO, with a k2
    KL on the same normalised ELBO. The ELBO is estimated with `num_masks` pairs of complementary masks: l of the
    C window tokens masked, l stratified on 0..C, weight (C + 1) / l, and the other C - l masked, weight
    (C + 1) / (C - l) (a pass with no masked token adds nothing); each pair's two terms are averaged. Each half
    is an unbiased estimate of LLaDA's ELBO (E[(C+1)/l] over l uniform on 0..C weights a mask of k tokens as the
    fixed-count form does), the complement lowers the variance. One `policy.logits` call on N x 2M rows.

    Departures: ESPO stratifies l over the rows of a micro-batch; here over each row's own `num_masks` pairs
    (from the row's mask seed, so a row's masks do not depend on its batch). ESPO sums its ELBO over the whole
    window, the EOS fill after the answer included; here, as for every estimator of this project, over the
    counted tokens (up to and including the first EOS), still divided by the window C."""
    require(num_masks >= 1, f"num_masks must be >= 1, got {num_masks}")
    C = ids_NL.shape[1] - prompt_length
    masks, weights = [], []
    for g in row_generators(seeds_N, MASK_DEVICE):
        l_M1, mask_a = masks_of_counts(g, num_masks, C, lowest=0)
        weight_a = torch.where(l_M1 > 0, (C + 1) / l_M1.clamp(min=1), torch.zeros_like(l_M1))
        weight_b = torch.where(l_M1 < C, (C + 1) / (C - l_M1).clamp(min=1), torch.zeros_like(l_M1))
        masks.append(torch.cat([mask_a, ~mask_a]))
        weights.append(torch.cat([weight_a.expand(num_masks, C), weight_b.expand(num_masks, C)]) / C)
    return _masked_passes(policy, ids_NL, attention_mask_NL, prompt_length,
                          torch.stack(masks).to(ids_NL.device), torch.stack(weights).float().to(ids_NL.device))


def block_masks(generator: torch.Generator, num: int, C: int, counted: int, block_length: int, prompt_real_P,
                prompt_mask_prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(window_MC, prompt_MP): SPG's block-wise masks (arXiv 2510.09541, Sec. 3.3; its `forward_type=block_random`).
    For each of `num` draws, one block of the window holding counted tokens (the first `counted` positions: up to
    and including the first EOS) is chosen uniformly; n ~ U{1..m} of its m counted positions are masked, chosen
    uniformly; every later position (the following blocks and the EOS fill) is masked; every earlier window
    position and every real prompt token is masked with probability `prompt_mask_prob` (d1's perturbation)."""
    P = prompt_real_P.shape[0]
    real_P = prompt_real_P.to(generator.device)
    blocks = -(-counted // block_length)
    window, prompt = [], []
    for _ in range(num):
        u = torch.rand(3, generator=generator, dtype=torch.float64, device=generator.device)
        b = min(int(u[0] * blocks), blocks - 1)
        lo, hi = b * block_length, min((b + 1) * block_length, counted)
        n = min(int(u[1] * (hi - lo)), hi - lo - 1) + 1
        scores = torch.rand(hi - lo, generator=generator, dtype=torch.float64, device=generator.device)
        noise_C = torch.rand(C, generator=generator, dtype=torch.float64, device=generator.device) < prompt_mask_prob
        # one draw per real prompt token (not per padded position), so a row's masks do not depend on its batch
        noise_P = torch.zeros(P, dtype=torch.bool, device=generator.device)
        noise_P[real_P] = torch.rand(int(real_P.sum()), generator=generator, dtype=torch.float64,
                                     device=generator.device) < prompt_mask_prob
        masked_C = torch.zeros(C, dtype=torch.bool, device=generator.device)
        masked_C[:lo] = noise_C[:lo]
        masked_C[lo:hi] = scores.argsort().argsort() < n
        masked_C[hi:] = True
        window.append(masked_C)
        prompt.append(noise_P)
    return torch.stack(window), torch.stack(prompt)


def spg_bounds(logp_NMC: torch.Tensor, scored_NMC: torch.Tensor, counted_N: torch.Tensor,
               beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(elbo_N, eubo_N): SPG's Monte-Carlo bounds on log pi(y | x), each per counted token (SPG's code
    normalisation; times the counted length they are the bounds themselves).

    ELBO (SPG Eq. 2, LLaDA's): sum_i w(t) 1[i masked] log pi(y_i | z_t); with the empirical masking ratio
    t = n / len of a draw that masks n of the len counted tokens, len x (sum over the masked of log pi) / n.
    EUBO (SPG Corollary 1, Eq. 7, from the Renyi variational bound with beta >= 1): (1/beta) sum_i log
    E[w(t) 1[i masked] pi(y_i | z_t)^beta], the expectation taken over the draws (biased: the log is outside the
    mean). Here elbo = mean over draws of (sum over the masked counted tokens of log pi) / n, and eubo = (1/beta)
    mean over the counted tokens masked in some draw of log mean_draws(pi^beta 1[masked] / t)."""
    n_NM = scored_NMC.sum(-1).clamp(min=1).to(logp_NMC.dtype)
    elbo_N = ((logp_NMC * scored_NMC).sum(-1) / n_NM).mean(1)
    t_NM = n_NM / counted_N[:, None].to(logp_NMC.dtype)
    avg_NC = (torch.exp(beta * logp_NMC) * scored_NMC / t_NM[..., None]).mean(1)
    seen_NC = avg_NC > 0
    log_avg_NC = torch.where(seen_NC, avg_NC.clamp(min=1e-30).log(), torch.zeros_like(avg_NC))
    eubo_N = log_avg_NC.sum(-1) / seen_NC.sum(-1).clamp(min=1) / beta
    return elbo_N, eubo_N


def spg(policy, ids_NL, attention_mask_NL, prompt_length: int, *, seeds_N, order_NC=None, adv_N=None,
        num_masks: int = 2, block_length: int = 32, beta: float = 1.5, omega: float = 0.5,
        prompt_mask_prob: float = 0.0) -> torch.Tensor:
    """SPG, the sandwiched policy gradient (arXiv 2510.09541; github.com/facebookresearch/SPG, `spg_trainer.py`):
    a lower bound of log pi for rows with a positive advantage, whose likelihood the update raises, and for the
    others (whose likelihood it lowers) the mixture (Eq. 8) omega * EUBO + (1 - omega) * ELBO of an upper and a
    lower bound (`spg_bounds`), so the objective stays below the true one on both sides (Eqs. 4-5); omega 0.5
    and beta in {1.0, 1.5, 2.0} as the paper tunes them. Masks are SPG's block-wise ones (`block_masks`),
    `num_masks` draws per row, one `policy.logits` call on N x M rows. The row's value, the chosen bound times
    its counted length (SPG's loss weighs each row's per-token bound by its length), is returned in the row's first
    window column (always counted), zeros elsewhere: a sequence-level estimator. `adv_N` is each row's advantage
    (the trainer scores rows after their advantages). Pair with `algo.objective=pg`: SPG's update is the plain
    policy gradient -A x value, without a ratio or clipping, over `inner_iterations` passes."""
    require(adv_N is not None, "the spg estimator picks each row's bound by the sign of its advantage; it scores "
            "rows after their advantages are assigned")
    require(num_masks >= 1 and block_length >= 1, f"num_masks={num_masks} and block_length={block_length}: "
            f"expected >= 1")
    require(beta >= 1, f"beta={beta}: SPG's upper bound holds for beta >= 1")
    require(0 <= omega <= 1, f"omega={omega}: the mixture weight is in [0, 1]")
    P, (N, L) = prompt_length, ids_NL.shape
    C = L - P
    counted_N = (first_eos(ids_NL[:, P:], policy.eos_id) + 1).clamp(max=C).cpu()
    window, prompt = [], []
    for g, counted, real_P in zip(row_generators(seeds_N, MASK_DEVICE), counted_N.tolist(),
                                  attention_mask_NL[:, :P].bool().cpu()):
        w_MC, p_MP = block_masks(g, num_masks, C, counted, block_length, real_P, prompt_mask_prob)
        window.append(w_MC)
        prompt.append(p_MP)
    window_NMC, prompt_NMP = torch.stack(window).to(ids_NL.device), torch.stack(prompt).to(ids_NL.device)
    rep_NL = ids_NL.repeat_interleave(num_masks, 0)
    masked_NL = torch.cat([prompt_NMP, window_NMC], -1).reshape(N * num_masks, L)
    logp_NMC = _token_logp(policy, rep_NL.masked_fill(masked_NL, policy.mask_id),
                           attention_mask_NL.repeat_interleave(num_masks, 0), rep_NL[:, P:], P).view(N, num_masks, C)
    positions_C = torch.arange(C, device=ids_NL.device)
    scored_NMC = window_NMC & (positions_C < counted_N.to(ids_NL.device)[:, None])[:, None]
    elbo_N, eubo_N = spg_bounds(logp_NMC, scored_NMC, counted_N.to(ids_NL.device), beta)
    value_N = torch.where(adv_N.to(ids_NL.device) > 0, elbo_N, omega * eubo_N + (1 - omega) * elbo_N)
    out_NC = torch.zeros((N, C), dtype=logp_NMC.dtype, device=ids_NL.device)
    out_NC[:, 0] = value_N * counted_N.to(ids_NL.device)
    return out_NC


def ordered(policy, ids_NL, attention_mask_NL, prompt_length: int, *, order_NC: torch.Tensor | None = None,
            seeds_N=None, group: int = 1, span: tuple[int, int] | None = None) -> torch.Tensor:
    """`order_NC[n, i]` is the step at which completion token i was unmasked (ties share a step). `span` = (a, b)
    makes only the forwards a..b-1 of `ordered_groups` (the others' tokens are left 0: `span_mask` says which
    are scored), so a learner can back-propagate the forwards of one span before it makes the next."""
    require(group >= 1, f"group must be >= 1, got {group}")
    require(order_NC is not None, "the ordered estimator needs the unmask step of every completion token")
    P = prompt_length
    N, C = order_NC.shape
    require(ids_NL.shape[1] - P == C, f"order_NC has {C} columns but the completion window has {ids_NL.shape[1] - P}")
    require(bool((order_NC >= 0).all()), "order_NC has negative steps: every completion token needs an unmask step")
    logp_NC = torch.zeros((N, C), dtype=torch.float32, device=ids_NL.device)
    groups = ordered_groups(order_NC, group)
    for lo, hi in groups if span is None else groups[span[0]:span[1]]:
        scored_NC = (order_NC >= lo) & (order_NC < hi)
        noisy_NL = ids_NL.clone()
        noisy_NL[:, P:] = ids_NL[:, P:].masked_fill(order_NC >= lo, policy.mask_id)
        columns_K = scored_NC.any(0).nonzero().squeeze(-1)  # the columns some row scores at this step
        step_logp_NK = _token_logp(policy, noisy_NL, attention_mask_NL, ids_NL[:, P:], P, columns_K)
        logp_NC = logp_NC.index_copy(1, columns_K, torch.where(scored_NC[:, columns_K], step_logp_NK,
                                                                 logp_NC[:, columns_K]))
    return logp_NC


def ordered_groups(order_NC: torch.Tensor, group: int) -> list[tuple[int, int]]:
    """The [lo, hi) step ranges `ordered` scores, one forward each: every `group` consecutive steps that hold a
    token of some row."""
    steps = torch.unique(order_NC).tolist()
    return [(j * group, (j + 1) * group) for j in sorted({s // group for s in steps if s >= 0})]


def positions_order(N: int, C: int, device=None) -> torch.Tensor:
    """order_NC of left-to-right decoding: position i at step i."""
    return torch.arange(C, device=device).expand(N, C)


def left_to_right(policy, ids_NL, attention_mask_NL, prompt_length: int, *, seeds_N=None, order_NC=None,
                  group: int = 1, span: tuple[int, int] | None = None) -> torch.Tensor:
    N, C = ids_NL.shape[0], ids_NL.shape[1] - prompt_length
    return ordered(policy, ids_NL, attention_mask_NL, prompt_length, order_NC=positions_order(N, C, ids_NL.device),
                   group=group, span=span)


# name -> (function, ratio level, needs the rollout's denoising trajectory)
ESTIMATORS: dict[str, tuple[Callable[..., torch.Tensor], str, bool]] = {
    "mean_field": (mean_field, "token", False),
    "elbo": (elbo, "sequence", False),
    "coupled": (coupled, "sequence", False),
    "espo": (espo, "sequence", False),
    "spg": (spg, "sequence", False),
    "ordered": (ordered, "token", True),
    "left_to_right": (left_to_right, "token", False),
}


# name -> how many `policy.logits` calls it makes on N rows of C completion tokens (each call makes
# `policy.forwards(attention_mask)` network forwards): what ZeRO-3 needs to know ahead (dllm_rl/lockstep.py)
LOGITS_CALLS: dict[str, Callable[..., int]] = {
    "mean_field": lambda order_NC, C, options: 1,
    "elbo": lambda order_NC, C, options: 1,
    "coupled": lambda order_NC, C, options: 1,
    "espo": lambda order_NC, C, options: 1,
    "spg": lambda order_NC, C, options: 1,
    "ordered": lambda order_NC, C, options: len(ordered_groups(order_NC, options.get("group", 1))),
    "left_to_right": lambda order_NC, C, options: math.ceil(C / options.get("group", 1)),
}
# the estimators whose forwards score disjoint sets of tokens, one set each, so that any run of them (a `span`)
# can be made and back-propagated alone: the learner's micro-batches of forwards (`learner.forwards`)
SPANNED = ("ordered", "left_to_right")


def replays_rollout(estimator: "Estimator", rollout: dict[str, Any]) -> bool:
    """Whether the log-probs the denoising sampler records as it commits each token (`Samples.logp_BC`) are
    this estimator's values for the rollout, so that the old policy's need no forward while the policy is the one
    that sampled it (JustGRPO's recipe: decode in AR order, score with the exact AR-order likelihood). True for
    `ordered` and `left_to_right` with one step per forward (`group` 1: a larger group scores a step from an
    earlier state than the sampler committed it from) when the sampler's logits are the policy's (no block cache,
    or one refreshed every step; no classifier-free guidance), and for `left_to_right` only when the sampler
    decodes in that order (`block_length` 1: one position per block, so position i is committed at step i).
    `rollout` is the sampler's settings (the `rollout` group)."""
    if estimator.name not in ("ordered", "left_to_right") or estimator.options.get("group", 1) != 1:
        return False
    exact_logits = (rollout.get("cache", "none") == "none" or rollout.get("cache_refresh", 0) == 1) and \
        rollout.get("cfg_scale", 0.0) == 0
    return exact_logits and (estimator.name == "ordered" or rollout.get("block_length") == 1)


def estimate_logp(name: str, policy, ids_NL, attention_mask_NL, prompt_length: int, **kwargs) -> torch.Tensor:
    """logp_NC from the estimator called `name` (see ESTIMATORS); kwargs are its options."""
    fn, _, _ = pick(ESTIMATORS, name, "likelihood estimator")
    return fn(policy, ids_NL, attention_mask_NL, prompt_length, **kwargs)


RUNTIME_ARGS = ("seeds_N", "order_NC", "adv_N", "span")  # what the trainer passes per call;
                                                         # every other keyword is an option
OPTION_RANGES = {"prompt_mask_prob": "probability", "num_masks": "at_least_1", "eps": "open_unit",
                 "group": "at_least_1", "block_length": "at_least_1", "beta": "at_least_1", "omega": "probability"}
OPTION_CHOICES = {"masking": ELBO_MASKINGS}


@dataclass(frozen=True)
class Estimator:
    """One estimator with its options, built once from its config by `build_estimator`; what the trainer and
    the buffer call instead of looking the name up in ESTIMATORS."""

    name: str
    fn: Callable[..., torch.Tensor]
    level: str  # "token" | "sequence": the level of the importance ratio (see the module docstring)
    needs_trajectory: bool  # needs order_NC, each token's unmask step (on-policy rollouts only)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_advantage(self) -> bool:
        """Whether its value depends on each row's advantage (SPG's bound by its sign)."""
        return "adv_N" in inspect.signature(self.fn).parameters

    @property
    def config(self) -> dict[str, Any]:
        return {"name": self.name, **self.options}

    @property
    def spanned(self) -> bool:
        """Whether any run of its forwards can be made alone (`span`; see SPANNED)."""
        return self.name in SPANNED

    def logp(self, policy, ids_NL, attention_mask_NL, prompt_length: int, seeds_N=None, order_NC=None,
             adv_N=None, span: tuple[int, int] | None = None) -> torch.Tensor:
        """logp_NC, one value per completion token (see the module docstring); with `span` (spanned estimators
        only), the tokens of its forwards span[0]..span[1]-1 (the others 0)."""
        extra = {"adv_N": adv_N} if self.needs_advantage else {}
        if span is not None:
            require(self.spanned, f"the {self.name!r} estimator cannot score a span of its forwards (only {SPANNED})")
            extra["span"] = span
        return self.fn(policy, ids_NL, attention_mask_NL, prompt_length, seeds_N=seeds_N, order_NC=order_NC,
                       **extra, **self.options)

    def logits_calls(self, order_NC, C: int) -> int:
        """How many `policy.logits` calls `logp` makes on rows of window C (with this trajectory)."""
        return LOGITS_CALLS[self.name](order_NC, C, self.options)

    def forwards(self, policy, attention_mask_NL, prompt_length: int, order_NC=None,
                 span: tuple[int, int] | None = None) -> int:
        """How many network forwards `logp` makes on these rows (declared ahead, for ZeRO-3's lockstep)."""
        calls = self.logits_calls(order_NC, attention_mask_NL.shape[1] - prompt_length)
        if span is not None:
            calls = max(0, min(span[1], calls) - span[0])
        return calls * policy.forwards(attention_mask_NL)

    def span_mask(self, order_NC, N: int, C: int, span: tuple[int, int], device=None) -> torch.Tensor:
        """in_span_NC: the tokens that the forwards span[0]..span[1]-1 score."""
        if self.name == "left_to_right":
            order_NC = positions_order(N, C, device)
        groups = ordered_groups(order_NC, self.options.get("group", 1))[span[0]:span[1]]
        if not groups:
            return torch.zeros((N, C), dtype=torch.bool, device=device)
        return (order_NC >= groups[0][0]) & (order_NC < groups[-1][1])

    def score(self, policy, ids_NL, attention_mask_NL, prompt_length: int, seeds_N, order_NC,
              mask_NC: torch.Tensor, adv_N=None,
              span: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp, level_mask) at the ratio level: per token (N, C) with `mask_NC` (with `span`, only on the
        span's tokens), or per sequence (N, 1), the sum over the counted tokens, with a mask of ones."""
        logp_NC = self.logp(policy, ids_NL, attention_mask_NL, prompt_length, seeds_N=seeds_N, order_NC=order_NC,
                            adv_N=adv_N, span=span)
        if self.level == "sequence":
            return (logp_NC * mask_NC).sum(-1, keepdim=True), torch.ones_like(mask_NC[:, :1])
        if span is not None:
            in_span_NC = self.span_mask(order_NC, *mask_NC.shape, span, device=mask_NC.device)
            mask_NC = mask_NC * in_span_NC.to(mask_NC.dtype)
        return logp_NC, mask_NC


def build_estimator(config: dict[str, Any], key: str = "likelihood") -> Estimator:
    """The estimator `config["name"]` with the rest of `config` as its options, checked by name and type;
    errors name the config keys under `key`."""
    options = dict(config)
    name = options.pop("name", None)
    require(name in ESTIMATORS, f"{key}.name must be one of {sorted(ESTIMATORS)}, got {name!r}")
    fn, level, needs_trajectory = ESTIMATORS[name]
    positional = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.KEYWORD_ONLY]
    check_kwargs(fn, options, key, exclude=(*positional, *RUNTIME_ARGS))
    check_types(fn, options, key)
    check_ranges(options, OPTION_RANGES, key)
    for option, choices in OPTION_CHOICES.items():
        require(options.get(option, choices[0]) in choices,
                f"{key}.{option}={options.get(option)!r}: expected one of {list(choices)}")
    return Estimator(name, fn, level, needs_trajectory, options)
