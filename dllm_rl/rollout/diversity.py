"""How varied a step's rollouts are, per prompt group: what tells a user that fast decoding collapsed a group.

- `distinct_share`: distinct completions in a group over its size (1 = every rollout differs; 1/G = all equal);
- `pairwise_agreement`: the share of window positions at which two rollouts of a group hold the same token,
  averaged over every pair of the group (0 for unrelated rollouts, 1 for identical ones).
Both are averaged over the step's groups. Pure functions of the completion windows.
"""

from __future__ import annotations

import torch


def distinct_share(completion_BC: torch.Tensor, group_size: int) -> float:
    groups = completion_BC.view(-1, group_size, completion_BC.shape[-1])
    return sum(len({tuple(row) for row in group.tolist()}) for group in groups) / completion_BC.shape[0]


def pairwise_agreement(completion_BC: torch.Tensor, group_size: int) -> float:
    if group_size < 2:
        return 1.0
    groups_GKC = completion_BC.view(-1, group_size, completion_BC.shape[-1])
    same_GKKC = groups_GKC[:, :, None, :] == groups_GKC[:, None, :, :]
    pairs = group_size * (group_size - 1)
    off_diagonal = same_GKKC.float().mean(-1).sum((1, 2)) - group_size  # drop each rollout against itself
    return float((off_diagonal / pairs).mean())
