"""How varied a step's rollouts are, per prompt group: what tells a user that fast decoding collapsed a group.

- `distinct_share`: distinct completions in a group over its size (1 = every rollout differs; 1/G = all equal);
- `pairwise_agreement`: the share of window positions at which two rollouts of a group hold the same token,
  averaged over every pair of the group (0 for unrelated rollouts, 1 for identical ones).
Both are averaged over the step's groups, which may differ in size (`group_N`: each row's prompt). Pure
functions of the completion windows.
"""

from __future__ import annotations

import torch


def groups_of(completion_NC: torch.Tensor, group_N: torch.Tensor) -> list[torch.Tensor]:
    """The completions of each group (rows with the same `group_N`), groups in sorted order."""
    return [completion_NC[group_N == g] for g in torch.unique(group_N).tolist()]


def distinct_share(completion_NC: torch.Tensor, group_N: torch.Tensor) -> float:
    """Distinct completions within their groups, over all rows (groups of any size)."""
    groups = groups_of(completion_NC, group_N)
    return sum(len({tuple(row) for row in group.tolist()}) for group in groups) / completion_NC.shape[0]


def pairwise_agreement(completion_NC: torch.Tensor, group_N: torch.Tensor) -> float:
    """The mean over groups of two or more rows of their mean pairwise agreement (1.0 where no group has a
    pair: nothing differs)."""
    shares = []
    for group_KC in groups_of(completion_NC, group_N):
        size = group_KC.shape[0]
        if size < 2:
            continue
        same_KKC = group_KC[:, None, :] == group_KC[None, :, :]
        off_diagonal = same_KKC.float().mean(-1).sum() - size  # drop each rollout against itself
        shares.append(float(off_diagonal) / (size * (size - 1)))
    return sum(shares) / len(shares) if shares else 1.0
