"""ERILS reward processing and off-policy correction for external rollouts, as pure functions.

ERILS ("Beyond On-Policy Exploration", arXiv 2608.01717) finds that the rewards of external rollouts must be
processed separately from the on-policy ones: joint processing, as LUFFY (arXiv 2504.14945) does for AR
models, collapsed its training. The rest of the method is not public, so every choice is an option here:

Reward processing (`processing`):
- "separate": the on-policy advantages come from the on-policy group alone (bit-identical with or without
  external rows); the external rows get an advantage from their own statistic (`statistic`):
    "constant"     A = constant * r           (for verified-correct rows, r = 1: a fixed positive signal)
    "group"        A from the external rows of the same prompt, with the on-policy advantage estimator
    "running"      A = r - b, b an exponential moving average of earlier external rewards
    "on_policy"    A = r - mean(on-policy rewards of the prompt); the on-policy statistics are read, not changed
- "joint": LUFFY's mixed group: each prompt's on-policy and external rewards form one group, and both sets of
  advantages come from it (kept for the ablation).

Triggers (`trigger`), per prompt: "always"; "all_failed" (as IGPO does: only when no on-policy rollout of
the prompt was correct); "schedule" (each prompt with probability max(0, 1 - step / decay_steps),
so the external signal fades out as the policy learns).

Off-policy correction (`correction`) for the external rows' loss:
- "none": the clipped surrogate against the dLLM's own old estimate of the row (ratio 1 at the first update).
- "shaping": LUFFY's policy shaping: the surrogate is -f(p) * A with f(p) = p / (p + gamma), p the dLLM's
  per-token probability, unclipped; it boosts the gradient of low-probability tokens.
- "is": a sequence-level importance weight w = pi_old(y|x) / mu(y|x) against the external policy's behaviour
  log-prob, optionally self-normalised over the step's external rows (mean 1), capped at `is_cap`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dllm_rl.algo.advantages import group_advantages
from dllm_rl.errors import pick, require

PROCESSING = ("separate", "joint")
STATISTICS = ("constant", "group", "running", "on_policy")
TRIGGERS = ("always", "all_failed", "schedule")
CORRECTIONS = ("none", "shaping", "is")


def _choices(names: Sequence[str]) -> dict[str, str]:
    return {n: n for n in names}


def triggered(correct_BG: torch.Tensor, trigger: str, *, step: int = 0, decay_steps: int = 1,
              uniform_B: torch.Tensor | None = None) -> torch.Tensor:
    """Bool per prompt: does this prompt get external rollouts this step? `uniform_B` (one U(0,1) per prompt,
    seeded by the caller) draws the "schedule" trigger."""
    pick(_choices(TRIGGERS), trigger, "external trigger")
    B = correct_BG.shape[0]
    if trigger == "always":
        return torch.ones(B, dtype=torch.bool, device=correct_BG.device)
    if trigger == "all_failed":
        return ~correct_BG.bool().any(-1)
    require(decay_steps > 0, f"decay_steps must be > 0, got {decay_steps}")
    require(uniform_B is not None and uniform_B.shape == (B,), "the schedule trigger needs one uniform draw per prompt")
    return uniform_B < max(0.0, 1.0 - step / decay_steps)


def separate_advantages(
    on_rewards_N: torch.Tensor,
    on_prompt_N: torch.Tensor,
    ext_rewards_E: torch.Tensor,
    ext_prompt_E: torch.Tensor,
    *,
    advantage: str,
    statistic: str,
    constant: float = 1.0,
    baseline: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(adv_on_N, adv_ext_E) for groups of any size (rows keyed by their prompt). The on-policy advantages
    depend on the on-policy rows only. statistic=on_policy with a prompt that has no on-policy rows compares
    its external rows with 0."""
    pick(_choices(STATISTICS), statistic, "external statistic")
    adv_on_N = group_advantages(on_rewards_N, on_prompt_N, advantage)
    if statistic == "constant":
        adv_ext_E = constant * ext_rewards_E
    elif statistic == "group":
        adv_ext_E = group_advantages(ext_rewards_E, ext_prompt_E, advantage)
    elif statistic == "running":
        adv_ext_E = ext_rewards_E - baseline
    else:  # on_policy: the mean on-policy reward of each external row's prompt
        same_EN = ext_prompt_E[:, None] == on_prompt_N[None, :]
        sums_E = (same_EN * on_rewards_N[None, :].to(ext_rewards_E.dtype)).sum(-1)
        adv_ext_E = ext_rewards_E - sums_E / same_EN.sum(-1).clamp(min=1)
    return adv_on_N, adv_ext_E


def joint_advantages(on_rewards_N: torch.Tensor, on_prompt_N: torch.Tensor, ext_rewards_E: torch.Tensor,
                     ext_prompt_E: torch.Tensor, *, advantage: str) -> tuple[torch.Tensor, torch.Tensor]:
    """LUFFY's joint processing: a prompt's group is its on-policy rewards plus its external ones."""
    rewards = torch.cat([on_rewards_N, ext_rewards_E.to(on_rewards_N.dtype)])
    adv = group_advantages(rewards, torch.cat([on_prompt_N, ext_prompt_E]), advantage)
    return adv[: len(on_rewards_N)], adv[len(on_rewards_N):]


def running_baseline(baseline: float, rewards_E: torch.Tensor, decay: float) -> float:
    """The exponential moving average of external rewards after this step's rows (unchanged if there are none)."""
    if rewards_E.numel() == 0:
        return baseline
    return decay * baseline + (1.0 - decay) * float(rewards_E.mean())


def importance_weights(
    logp_N: torch.Tensor, behaviour_logp_N: torch.Tensor, *, cap: float, self_normalize: bool
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence-level weights w = exp(log pi - log mu), self-normalised to mean 1 if asked, capped at `cap`.

    Returns (w_N, metrics): the effective sample size as a fraction, (sum w)^2 / (N * sum w^2) of the
    uncapped weights (1 = all equal), and the share of weights the cap clipped."""
    require(cap > 0, f"is_cap must be > 0, got {cap}")
    N = logp_N.shape[0]
    if N == 0:
        return logp_N.new_zeros(0), {}
    log_w_N = (logp_N - behaviour_logp_N).double()
    if self_normalize:
        w_N = torch.softmax(log_w_N, 0) * N
    else:
        w_N = log_w_N.clamp(max=50.0).exp()
    ess = float(w_N.sum() ** 2 / (N * (w_N**2).sum()).clamp(min=1e-300))
    clipped = float((w_N > cap).double().mean())
    return w_N.clamp(max=cap).to(logp_N.dtype), {"ess": ess, "is_clip_frac": clipped}
