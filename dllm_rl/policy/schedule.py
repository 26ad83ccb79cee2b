"""The masking schedule of a masked-diffusion language model, as a diffusers scheduler.

Time t runs from 1 (every token masked) to 0 (clean text). `alpha(t)` is the probability that a token
is still clean at time t, so a token is masked with probability `1 - alpha(t)`.

- "linear": alpha(t) = 1 - t, LLaDA's schedule (Nie et al., arXiv 2502.09992). `num_transfer_tokens`
  reproduces LLaDA's `get_num_transfer_tokens` exactly for it.
- "cosine": alpha(t) = cos(pi/2 * t), MDLM's cosine schedule (Sahoo et al., arXiv 2406.07524). The
  antithetic time sampling in `sample_t` is MDLM's low-discrepancy sampler.
- "polynomial": alpha(t) = 1 - t**exponent.

Departure from diffusers: there is no `step`. The reverse (denoising) step needs the remasking policy
and the model's logits, so it lives in the sampler, `dllm_rl/rollout/sampler.py`; this class only
says how much is masked when. Randomness comes only from a passed `torch.Generator`.
"""

from __future__ import annotations

import math

import torch
from diffusers import ConfigMixin, SchedulerMixin
from diffusers.configuration_utils import register_to_config

from dllm_rl.errors import pick, require

_ALPHAS = {
    "linear": lambda t, exponent: 1.0 - t,
    "cosine": lambda t, exponent: torch.cos(0.5 * math.pi * t),
    "polynomial": lambda t, exponent: 1.0 - t**exponent,
}


class MaskingSchedule(SchedulerMixin, ConfigMixin):
    """alpha(t), training-time sampling of t and masking, and the unmasking budget for inference."""

    config_name = "scheduler_config.json"

    @register_to_config
    def __init__(self, schedule: str = "linear", eps: float = 1e-3, exponent: float = 1.0):
        self._alpha_fn = pick(_ALPHAS, schedule, "masking schedule")
        require(0.0 <= eps < 1.0, f"eps={eps!r}: expected 0 <= eps < 1")
        require(exponent > 0, f"exponent={exponent!r}: expected a positive number")
        self.timesteps: torch.Tensor | None = None
        self.num_inference_steps: int | None = None

    def alpha(self, t: float | torch.Tensor) -> float | torch.Tensor:
        """Probability that a token is clean at time t; a float for a float, a tensor for a tensor."""
        if not isinstance(t, torch.Tensor):
            return float(self.alpha(torch.tensor(float(t), dtype=torch.float64)))  # cpu: read back as a float
        if not t.is_floating_point():
            t = t.float()
        # cos(pi/2) is -4e-8 in float32; clamping keeps mask_prob a valid probability at t=1.
        return self._alpha_fn(t, self.config.exponent).clamp(0.0, 1.0)

    def mask_prob(self, t: float | torch.Tensor) -> float | torch.Tensor:
        return 1.0 - self.alpha(t)

    def sample_t(
        self, batch_size: int, generator: torch.Generator | None = None, antithetic: bool = False
    ) -> torch.Tensor:
        """Training times t_B in [eps, 1]; eps > 0 keeps the 1/t loss weight finite."""
        device = generator.device if generator is not None else None
        if antithetic:
            # One shared offset and evenly spaced strata cover [0, 1) evenly: lower-variance loss.
            u0 = torch.rand(1, generator=generator, device=device)
            u_B = (u0 + torch.arange(batch_size, device=device) / batch_size) % 1.0
        else:
            u_B = torch.rand(batch_size, generator=generator, device=device)
        eps = self.config.eps
        return eps + (1.0 - eps) * u_B

    def add_noise(
        self,
        input_ids_BL: torch.Tensor,
        t_B: torch.Tensor | float,
        mask_id: int,
        generator: torch.Generator | None = None,
        maskable_BL: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mask each maskable token independently with its row's mask_prob(t).

        Returns (noisy_ids_BL, is_masked_BL).
        """
        t_B = torch.as_tensor(t_B, dtype=torch.float32, device=input_ids_BL.device)
        p_B1 = self.mask_prob(t_B).reshape(-1, 1)
        u_BL = torch.rand(input_ids_BL.shape, generator=generator, device=input_ids_BL.device)
        is_masked_BL = u_BL < p_B1  # rand is in [0, 1): p=1 masks all, p=0 masks none
        if maskable_BL is not None:
            is_masked_BL &= maskable_BL.bool()
        noisy_ids_BL = torch.where(is_masked_BL, torch.full_like(input_ids_BL, mask_id), input_ids_BL)
        return noisy_ids_BL, is_masked_BL

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        """Inference times 1.0 -> 0.0, uniform in t, num_inference_steps + 1 of them."""
        require(
            isinstance(num_inference_steps, int) and num_inference_steps >= 1,
            f"num_inference_steps={num_inference_steps!r}: expected an integer >= 1",
        )
        self.num_inference_steps = num_inference_steps
        self.timesteps = torch.linspace(1.0, 0.0, num_inference_steps + 1, device=device)

    def num_transfer_tokens(self, num_masked_B: torch.Tensor, steps: int) -> torch.Tensor:
        """How many of each row's masked tokens to unmask at each of `steps` steps: LongTensor (B, steps).

        Each row sums to its count of masked tokens.
        """
        require(isinstance(steps, int) and steps >= 1, f"steps={steps!r}: expected an integer >= 1")
        n_B = torch.as_tensor(num_masked_B, device=getattr(num_masked_B, "device", None)).long()
        if self.config.schedule == "linear":
            # LLaDA's get_num_transfer_tokens: n // steps each, the remainder one each to the first steps.
            # Cumulative rounding (below) would put the extras elsewhere (n=7, steps=4 -> 2,2,1,2 instead of
            # 2,2,2,1); keeping LLaDA's rule makes rollouts match its reference sampler token for token.
            base_B1 = (n_B // steps).unsqueeze(1)
            extra_BS = torch.arange(steps, device=n_B.device) < (n_B % steps).unsqueeze(1)
            return base_B1 + extra_BS.long()
        # Round the expected cumulative number of clean tokens at each timestep, then difference it:
        # rounding the cumulative (not each step) keeps the row sum exact and every step >= 0.
        s_S1 = 1.0 - torch.arange(steps + 1, dtype=torch.float64, device=n_B.device) / steps
        alpha_S1 = self.alpha(s_S1)
        frac_S1 = (alpha_S1 - alpha_S1[0]) / (alpha_S1[-1] - alpha_S1[0])
        cum_BS1 = torch.round(n_B.unsqueeze(1).double() * frac_S1).long()
        cum_BS1[:, 0] = 0
        cum_BS1[:, -1] = n_B
        return cum_BS1.diff(dim=1)
