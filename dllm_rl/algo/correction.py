"""The sampler-learner correction (Sparse-RL, arXiv 2601.10079): rollouts from an approximate sampler, corrected.

A fast sampler (confidence-parallel decoding, a stale KV cache, bf16 logits) commits each token from logits
that differ a little from the ones the learner computes for the same state, so the rollouts come from a
policy mu near, not equal to, the policy pi the learner scores. Sparse-RL corrects this with two tools, used
here for every on-policy dLLM rollout when `sampler_correction.mode` is not none:

- both sides give each completion token the probability of the token that was committed, at the state it was
  committed from: the sampler records it as it decodes (`Samples.logp_BC`), the learner recomputes it
  with the `ordered` estimator (the tokens revealed before the token's step, the rest masked; one group per
  step), both at temperature 1, so the comparison measures the sampler's approximation and nothing else;
- a rollout's ratio is the geometric mean of its token ratios, r = exp(mean_t (log pi_t - log mu_t)) over its
  counted tokens (length-normalised, as in GSPO, so one bound means the same at 64 and 256 tokens);
- `reject`: a rollout with r outside [lower, upper] gets loss weight 0 (its advantage still counts in its
  group's baseline: the group was sampled whole);
- `weight`: the truncated importance weight min(r, cap) multiplies the rollout's loss weight;
- `both`: rejection, then the weight on the rollouts kept.

Where sampler and learner agree (r = 1 exactly) every weight is exactly 1, and the loss is bit-identical to
the uncorrected one. The rates are logged: `correction/reject_rate`, `correction/capped_rate`,
`correction/weight_mean`, `correction/log_ratio` (mean over rollouts) and `correction/log_ratio_abs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_rl.errors import check_ranges, check_types, require

MODES = ("auto", "none", "reject", "weight", "both")


@dataclass(frozen=True)
class SamplerCorrection:
    """The `sampler_correction` options of `dllm-rl train` (configs/train.yaml)."""

    mode: str = "auto"  # resolved by `resolved_mode` before a run: weight with asynchronous rollouts, else none
    lower: float = 0.5  # reject a rollout whose ratio is below this
    upper: float = 2.0  # or above this
    cap: float = 2.0  # the truncated importance weight min(r, cap)

    def __post_init__(self) -> None:
        check_types(SamplerCorrection, self.__dict__, "sampler_correction")
        require(self.mode in MODES, f"sampler_correction.mode must be one of {MODES}, got {self.mode!r}")
        check_ranges(self.__dict__, {"lower": "positive", "upper": "positive", "cap": "positive"},
                     "sampler_correction")
        require(self.lower <= 1.0 <= self.upper, f"sampler_correction.lower={self.lower} and upper={self.upper} "
                f"must bracket 1 (a rollout the learner agrees with is always kept)")
        require(self.cap >= 1.0, f"sampler_correction.cap={self.cap}: expected >= 1 (a weight below 1 for every "
                f"rollout would only shrink the step)")

    @property
    def on(self) -> bool:
        require(self.mode != "auto", "sampler_correction.mode=auto must be resolved first (resolved_mode)")
        return self.mode != "none"


def resolved_mode(mode: str, max_staleness: object) -> tuple[str, str | None]:
    """(the mode `auto` stands for, why) where `mode` is auto: weight where rollouts come from older policies
    (asynchronous workers, workers.max_staleness > 0: they need the truncated importance weight), none where the
    sampler is the learner's policy; any other mode is itself (why None)."""
    if mode != "auto":
        return mode, None
    if isinstance(max_staleness, int) and max_staleness > 0:
        return "weight", (f"sampler_correction.mode=weight (auto: workers.max_staleness={max_staleness} trains on "
                          f"rollouts of older policies, which need the truncated importance weight)")
    return "none", None


def rollout_log_ratio(learner_logp_NC: torch.Tensor, sampler_logp_NC: torch.Tensor,
                      mask_NC: torch.Tensor) -> torch.Tensor:
    """log r_N: the mean over each rollout's counted tokens of log pi - log mu (0 for a rollout with none)."""
    diff_NC = (learner_logp_NC.double() - sampler_logp_NC.double()) * mask_NC
    return diff_NC.sum(-1) / mask_NC.sum(-1).clamp(min=1).double()


def correction_weights(log_ratio_N: torch.Tensor, config: SamplerCorrection) -> tuple[torch.Tensor, dict[str, float]]:
    """(weight_N, metrics): each rollout's loss weight from its log-ratio, per `config.mode`."""
    ratio_N = log_ratio_N.exp()
    weight_N = torch.ones_like(ratio_N)
    kept_N = torch.ones_like(ratio_N, dtype=torch.bool)
    if config.mode in ("reject", "both"):
        kept_N = (ratio_N >= config.lower) & (ratio_N <= config.upper)
        weight_N = weight_N * kept_N
    capped_N = torch.zeros_like(kept_N)
    if config.mode in ("weight", "both"):
        capped_N = kept_N & (ratio_N > config.cap)
        weight_N = weight_N * ratio_N.clamp(max=config.cap)
    n = max(len(ratio_N), 1)
    metrics = {"correction/reject_rate": float((~kept_N).sum()) / n,
               "correction/capped_rate": float(capped_N.sum()) / n,
               "correction/weight_mean": float(weight_N.sum()) / n,
               "correction/log_ratio": float(log_ratio_N.sum()) / n,
               "correction/log_ratio_abs": float(log_ratio_N.abs().sum()) / n,
               # Kish's effective sample size of the weights, as a fraction of the rollouts (1 = all weights equal)
               "correction/ess": float(weight_N.sum() ** 2 / (n * (weight_N ** 2).sum()).clamp(min=1e-30))}
    return weight_N.float(), metrics
