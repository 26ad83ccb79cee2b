"""DARTS (arXiv 2605.30859): over-sample each prompt and keep the rollouts worth learning from.

Each prompt gets G + delta_q rollouts; the G with the highest score are kept, where

    score = certainty_weight * certainty + length_weight * conciseness
    certainty   = the mean log-probability the sampler gave the completion's tokens as it committed them
                  (`Rows.sampler_logp_NC`, over the counted tokens)
    conciseness = -(counted completion tokens) / window

(ties: the lower rollout index). The discarded rollouts cost their generation but no verification, scoring or
update. delta_q adapts per prompt (kept by its index in the train pool): when the extra rollouts changed the kept
set (some rollout beyond the first G was kept) it grows by one, up to `delta_max`, else it shrinks by one, down to
`delta_min`, so redundancy goes where it pays. Defaults (delta 2 in [0, 4], weights 1 and 1) are this project's
choice: the paper's exact score is not public; its two criteria are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_rl.errors import require


@dataclass(frozen=True)
class DartsConfig:
    delta: int = 2  # extra rollouts a prompt starts with
    delta_min: int = 0
    delta_max: int = 4
    certainty_weight: float = 1.0
    length_weight: float = 1.0

    def __post_init__(self) -> None:
        require(0 <= self.delta_min <= self.delta <= self.delta_max, f"curation.darts: expected 0 <= delta_min <= "
                f"delta <= delta_max; got {self.delta_min}, {self.delta}, {self.delta_max}")
        for key in ("certainty_weight", "length_weight"):
            require(getattr(self, key) >= 0, f"curation.darts.{key}={getattr(self, key)!r}: expected >= 0")


def scores(sampler_logp_NC: torch.Tensor, mask_NC: torch.Tensor, certainty_weight: float,
           length_weight: float) -> torch.Tensor:
    """score_N of each rollout (see the module docstring); higher is kept first."""
    counted_N = mask_NC.sum(-1)
    certainty_N = (sampler_logp_NC * mask_NC).sum(-1) / counted_N.clamp(min=1)
    return certainty_weight * certainty_N - length_weight * counted_N / mask_NC.shape[1]


def keep_best(score_K: list[float], keep: int) -> list[int]:
    """The indices (positions in the group, in rollout order) of the `keep` highest scores; ties to the lower."""
    ranked = sorted(range(len(score_K)), key=lambda k: (-score_K[k], k))
    return sorted(ranked[:keep])


def next_delta(delta: int, changed: bool, low: int, high: int) -> int:
    """delta after a visit: one more where the extra rollouts changed the kept set, one fewer where not."""
    return min(high, delta + 1) if changed else max(low, delta - 1)
