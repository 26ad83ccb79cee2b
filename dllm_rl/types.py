"""Records that flow through the package, and the legend of the shape suffixes used in tensor names.

Shape suffixes: B prompts (or rows of a batch), G rollouts per prompt, N rollouts (= B*G), L whole sequence,
P prompt, C completion (the generation window), V vocabulary, M Monte-Carlo masks, S denoising steps,
D hidden size, H attention heads. `logp_NC` is a log-probability per rollout and completion token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Samples:
    """What a sampler returns for a batch of prompts.

    `sequences_BL` = left-padded prompt (P) + completion window (C); `attention_mask_BL` is 0 on the prompt's
    left padding. For a denoising sampler, `unmask_step_BC` is the (0-based) step of its row at which each
    completion token was unmasked (a row's steps: those at which it still had masks in the block being decoded)
    and `confidence_BC` the model's probability of the token it chose then;
    for an autoregressive sampler the step is the token's position and the confidence its probability.
    """

    sequences_BL: torch.Tensor
    attention_mask_BL: torch.Tensor
    prompt_length: int
    unmask_step_BC: torch.Tensor
    confidence_BC: torch.Tensor
    forwards: int = 0  # model forward passes the batch took (a denoising sampler; 0 where not counted)
    # a denoising sampler's log-probability of each committed token under the policy (temperature 1, the whole
    # vocabulary) at the state it was committed from: the `ordered` estimator's value (rollout/sampler.py)
    logp_BC: torch.Tensor | None = None
    # and the entropy (nats) of the distribution each token was committed from (temperature 1, mask token excluded)
    entropy_BC: torch.Tensor | None = None

    @property
    def completion_BC(self) -> torch.Tensor:
        return self.sequences_BL[:, self.prompt_length :]
