"""GRPO's policy loss, as pure functions of per-token log-probs: clipped surrogate, KL, aggregation.

    ratio_NC = exp(logp_NC - old_logp_NC)
    loss_NC  = -min(ratio * A_n, clip(ratio, 1 - eps_low, 1 + eps_high) * A_n) + beta * KL_NC(pi || ref)
    loss     = aggregate(loss_NC, mask_NC, "token" | "sequence" | "constant")

- Clipped surrogate: PPO (Schulman et al., arXiv 1707.06347) with one advantage per rollout broadcast over its
  tokens, as in GRPO (DeepSeekMath, arXiv 2402.03300); eps_high > eps_low is DAPO's "clip-higher" (arXiv 2503.14476).
- KL to a reference policy: the per-token estimators k1, k2, k3 of Schulman's note "Approximating KL divergence"
  (2020). GRPO and d1 (arXiv 2504.12216) add k3 to the loss with beta = 0.04; Dr.GRPO and DAPO use beta = 0.
- Aggregation: per token (DAPO), per sequence then over sequences (original GRPO), or a constant divisor
  (Dr.GRPO, arXiv 2503.20783), which removes GRPO's bias towards short correct and long wrong answers.

For a dLLM the log-probs come from a likelihood estimator (`dllm_rl/likelihood/`), not from an autoregressive
factorisation; nothing here depends on that. Sequence-level log-probs work too: pass logp_N1 and mask_N1 and the
ratio, the clipping and the KL become per sequence.

Departures: the log ratio is clamped to [-20, 20] before exp (as verl does), so one corrupt old log-prob cannot
make an inf ratio; this changes the loss only where ratio > e^20 with a negative advantage. Ignored tokens
(mask 0) have their log-probs set to 0 before any arithmetic, see `grpo_loss`.
"""

from __future__ import annotations

from typing import Callable

import torch

from dllm_rl.errors import pick, require

_MAX_LOG_RATIO = 20.0


def _shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)


def _check_per_token(logp_NC: torch.Tensor, **others: torch.Tensor | None) -> None:
    require(logp_NC.dim() == 2, f"logp_NC has shape {_shape(logp_NC)}; expected 2-D (N rollouts, C tokens)")
    for name, t in others.items():
        require(t is None or t.shape == logp_NC.shape,
                f"{name} has shape {_shape(t)}; expected {_shape(logp_NC)}, the shape of logp_NC")


def _check_per_row(logp_NC: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        require(t is None or _shape(t) == (logp_NC.shape[0],),
                f"{name} has shape {_shape(t)}; expected ({logp_NC.shape[0]},), one value per row of "
                f"logp_NC {_shape(logp_NC)}")


def ratio_and_log_ratio(logp_NC: torch.Tensor, old_logp_NC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio_NC, log_ratio_NC) of the current to the old policy; the old log-probs are constants (detached)."""
    log_ratio_NC = logp_NC - old_logp_NC.detach()
    ratio_NC = torch.exp(log_ratio_NC.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return ratio_NC, log_ratio_NC


def clipped_surrogate(
    logp_NC: torch.Tensor, old_logp_NC: torch.Tensor, adv_N: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective per token, as a loss: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A).

    Returns (loss_NC, clipped_NC). `clipped_NC` is True where the clipped term is strictly the smaller one: there
    the ratio has left [1 - eps_low, 1 + eps_high] in the direction the advantage pushes it, and the token's
    gradient is zero. (Outside the range in the other direction the unclipped term wins and the gradient flows.)
    """
    require(0 < eps_low < 1, f"eps_low={eps_low!r}: expected 0 < eps_low < 1")
    require(eps_high > 0, f"eps_high={eps_high!r}: expected eps_high > 0")
    _check_per_token(logp_NC, old_logp_NC=old_logp_NC)
    _check_per_row(logp_NC, adv_N=adv_N)
    ratio_NC, _ = ratio_and_log_ratio(logp_NC, old_logp_NC)
    adv_N1 = adv_N.detach().to(ratio_NC.dtype).unsqueeze(1)
    unclipped_NC = ratio_NC * adv_N1
    clipped_term_NC = ratio_NC.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_N1
    return -torch.minimum(unclipped_NC, clipped_term_NC), clipped_term_NC < unclipped_NC


def shaped_surrogate(logp_NC: torch.Tensor, adv_N: torch.Tensor, gamma: float) -> torch.Tensor:
    """LUFFY's policy shaping for off-policy rows (arXiv 2504.14945), as a loss: -f(p) * A with f(p) = p / (p + gamma),
    p = exp(logp) the policy's probability of the token. Unclipped; d f / d logp = gamma * p / (p + gamma)^2 peaks
    at p = gamma, so low-probability tokens of the external text get a larger gradient than under -p * A."""
    require(gamma > 0, f"shaping_gamma={gamma!r}: expected gamma > 0")
    _check_per_row(logp_NC, adv_N=adv_N)
    p_NC = logp_NC.clamp(max=0.0).exp()
    return -(p_NC / (p_NC + gamma)) * adv_N.detach().to(p_NC.dtype).unsqueeze(1)


# KL(pi || ref) per token from a sample of pi (Schulman 2020). In the loss they are differentiated through
# logp with the samples held fixed, as GRPO does; only k3's value is an unbiased, low-variance, >= 0 estimate.
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log ref: unbiased, high variance, negative on some samples."""
    return logp - ref_logp.detach()


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log ref)^2 / 2: >= 0, low variance, biased (exact to second order)."""
    return 0.5 * (logp - ref_logp.detach()).pow(2)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = ref/pi - log(ref/pi) - 1 = exp(ref_logp - logp) - (ref_logp - logp) - 1: unbiased and >= 0.

    The estimator of GRPO (arXiv 2402.03300, eq. 4) and d1. exp overflows float32 past a log gap of ~88,
    which sequence-level log-probs can reach; use k1 or k2 there.
    """
    log_ref_over_pi = ref_logp.detach() - logp
    return torch.exp(log_ref_over_pi) - log_ref_over_pi - 1.0


KL_FNS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


# Each takes a loss already zeroed where the mask is 0, the 0/1 mask, the constant (used by "constant" only)
# and `units`, what it divides by (see `aggregation_units`).
def _token_mean(loss_NC: torch.Tensor, mask_NC: torch.Tensor, constant: float | None, units) -> torch.Tensor:
    return loss_NC.sum() / units


def _sequence_mean(loss_NC: torch.Tensor, mask_NC: torch.Tensor, constant: float | None, units) -> torch.Tensor:
    per_row_N = loss_NC.sum(dim=1) / mask_NC.sum(dim=1).clamp(min=1.0)
    return per_row_N.sum() / units


def _constant_sum(loss_NC: torch.Tensor, mask_NC: torch.Tensor, constant: float | None, units) -> torch.Tensor:
    require(constant is not None and constant > 0,
            f"constant={constant!r}: the 'constant' aggregation needs a positive number (Dr.GRPO: the max "
            f"completion length)")
    return loss_NC.sum() / (units * constant)


AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token": _token_mean,
    "sequence": _sequence_mean,
    "constant": _constant_sum,
}


def aggregate(loss_NC: torch.Tensor, mask_NC: torch.Tensor, how: str, constant: float | None = None,
              global_units: float | None = None, ranks: int = 1) -> torch.Tensor:
    """A per-token loss as a scalar; `mask_NC` is 1 (or True) where a token counts, 0 elsewhere.

    - "token":    sum(loss * mask) / sum(mask). DAPO: every token weighs the same, long answers weigh more.
    - "sequence": sum over rows of sum_t(loss * mask) / sum_t(mask), divided by the rows with a counted token,
                  the original GRPO. Rows with no counted token are left out (they have no length to divide by).
    - "constant": sum(loss * mask) / (rows * constant), rows with a counted token. Dr.GRPO with constant = the
                  max completion length (the rows without one are data-parallel stand-ins, never rollouts).
    `constant` is read by "constant" only. An all-zero mask gives 0, never NaN.

    Data parallelism (verl's `agg_loss`): a minibatch split over `ranks` ranks, whose gradients the engine
    averages, passes `global_units`, the sum over ranks of `aggregation_units` of their rows. Each rank then
    divides its sum by the global count and multiplies by `ranks`, so the averaged gradient is the gradient of
    the loss over all ranks' rows, whatever the split. None (one process): this call's own units.
    """
    fn = pick(AGGREGATIONS, how, "loss aggregation")
    _check_per_token(loss_NC, mask_NC=mask_NC)
    require(ranks >= 1, f"ranks={ranks!r}: expected the number of data-parallel ranks (>= 1)")
    units = aggregation_units(mask_NC, how) if global_units is None else global_units
    # where, not multiplication: NaN or inf at an ignored token would survive `* 0`.
    masked_NC = torch.where(mask_NC != 0, loss_NC, torch.zeros_like(loss_NC))
    loss = fn(masked_NC, mask_NC.to(loss_NC.dtype), constant, max(units, 1.0))
    return loss * ranks if ranks > 1 else loss


def aggregation_units(mask_NC: torch.Tensor, how: str, weights_N: torch.Tensor | None = None) -> float:
    """What `aggregate` divides by, less the constant: counted tokens ("token"), or rows with a counted token
    ("sequence", "constant"). Rows whose loss weight is 0 (a rollout rejected by the sampler correction, a
    stand-in row) are not counted: the loss is the mean over the rows that remain, so rejecting rows does not
    shrink the others' share. Other weights scale a row's terms, not the count."""
    pick(AGGREGATIONS, how, "loss aggregation")
    counted_NC = mask_NC != 0
    if weights_N is not None:
        counted_NC = counted_NC & (weights_N != 0)[:, None]
    if how == "token":
        return float(counted_NC.sum())
    return float((counted_NC.sum(dim=1) > 0).sum())


OBJECTIVES = ("clipped", "pg")  # PPO's clipped surrogate | the plain policy gradient (SPG)


def grpo_loss(
    logp_NC: torch.Tensor,
    old_logp_NC: torch.Tensor,
    ref_logp_NC: torch.Tensor | None,
    adv_N: torch.Tensor,
    mask_NC: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.0,
    kl: str = "k3",
    aggregation: str = "token",
    constant: float | None = None,
    weights_N: torch.Tensor | None = None,
    shaped_N: torch.Tensor | None = None,
    shaping_gamma: float = 0.1,
    global_units: float | None = None,
    ranks: int = 1,
    objective: str = "clipped", per_row: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's loss (arXiv 2402.03300): clipped surrogate + beta * KL per token, times a per-row weight, aggregated.

    `adv_N` is one advantage per rollout (from `dllm_rl/algo/advantages.py`, flattened). `weights_N` (optional,
    treated as constants) scales each rollout's loss: importance weights for off-policy rollouts or loss weights.
    Rows where the bool `shaped_N` is True (external rollouts under LUFFY's correction) use `shaped_surrogate`
    instead of the clipped one; they are not counted as clipped.
    The KL term needs `ref_logp_NC` when beta > 0 and is skipped when beta == 0. Works as well on sequence-level
    log-probs, logp_N1 with mask_N1. `global_units` and `ranks` make the loss of a data-parallel rank its share
    of the loss over all ranks' rows (see `aggregate`). `objective="pg"` replaces the clipped surrogate with the
    plain policy gradient -A * logp (SPG's update: no ratio, no clipping; the old log-probs are not read). Returns
    (loss, metrics); loss == loss/policy + beta * loss/kl; `per_row` gets each row's (clipped, counted) tokens.
    """
    require(objective in OBJECTIVES, f"objective={objective!r}: expected one of {list(OBJECTIVES)}")
    kl_fn = pick(KL_FNS, kl, "KL estimator")
    pick(AGGREGATIONS, aggregation, "loss aggregation")
    require(beta >= 0, f"beta={beta!r}: expected a KL coefficient >= 0")
    require(beta == 0 or ref_logp_NC is not None,
            f"beta={beta!r} adds a KL penalty, which needs ref_logp_NC (reference log-probs); got None")
    _check_per_token(logp_NC, old_logp_NC=old_logp_NC, ref_logp_NC=ref_logp_NC, mask_NC=mask_NC)
    _check_per_row(logp_NC, adv_N=adv_N, weights_N=weights_N, shaped_N=shaped_N)

    # Padding log-probs may be -inf; (-inf) - (-inf) is NaN, and NaN reaches the gradient even through a
    # where() downstream. Zeroing them first makes ignored tokens inert in the forward and the backward.
    is_counted_NC = mask_NC != 0
    logp_NC, old_logp_NC = (torch.where(is_counted_NC, t, torch.zeros_like(t)) for t in (logp_NC, old_logp_NC))
    use_kl = beta > 0
    if ref_logp_NC is not None:
        ref_logp_NC = torch.where(is_counted_NC, ref_logp_NC, torch.zeros_like(ref_logp_NC))

    if objective == "pg":
        old_logp_NC = logp_NC.detach()
    policy_NC, clipped_NC = clipped_surrogate(logp_NC, old_logp_NC, adv_N, eps_low, eps_high)
    if shaped_N is not None and bool(shaped_N.any()):
        shaped_N1 = shaped_N.bool().unsqueeze(1)
        policy_NC = torch.where(shaped_N1, shaped_surrogate(logp_NC, adv_N, shaping_gamma), policy_NC)
        clipped_NC = clipped_NC & ~shaped_N1
    kl_NC = kl_fn(logp_NC, ref_logp_NC) if use_kl else torch.zeros_like(policy_NC)
    if weights_N is not None:
        weight_N1 = weights_N.detach().to(policy_NC.dtype).unsqueeze(1)
        policy_NC, kl_NC = policy_NC * weight_N1, kl_NC * weight_N1
    units = aggregation_units(mask_NC, aggregation, weights_N) if global_units is None else global_units
    agg = dict(how=aggregation, constant=constant, global_units=units, ranks=ranks)
    loss = aggregate(policy_NC + beta * kl_NC, mask_NC, **agg)

    with torch.no_grad():
        ratio_NC, _ = ratio_and_log_ratio(logp_NC, old_logp_NC)
        mask_f_NC = mask_NC.to(ratio_NC.dtype)
        num_counted = mask_f_NC.sum().clamp(min=1.0)
        values = torch.stack([
            aggregate(policy_NC, mask_NC, **agg),
            aggregate(kl_NC, mask_NC, **agg),
            (clipped_NC & is_counted_NC).sum() / num_counted,
            (ratio_NC * mask_f_NC).sum() / num_counted,
            torch.where(is_counted_NC, ratio_NC, torch.zeros_like(ratio_NC)).max(),
            adv_N.detach().to(ratio_NC.dtype).mean(),
        ]).tolist()  # one device sync for all metrics
        if per_row is not None:
            per_row["clip_counts_N2"] = torch.stack([(clipped_NC & is_counted_NC).sum(-1), is_counted_NC.sum(-1)], -1)
    return loss, dict(zip(["loss/policy", "loss/kl", "policy/clip_frac", "policy/ratio_mean", "policy/ratio_max",
                           "policy/adv_mean"], values))
