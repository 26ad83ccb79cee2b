"""Advantage estimators against hand values, and each vectorised estimator against a per-group Python loop."""

import math

import pytest
import torch

from dllm_rl.algo.advantages import (ADVANTAGE_FNS, compute_advantages, leave_one_out, maxrl, mean_centred,
                                     std_normalised)
from dllm_rl.errors import ConfigError


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


def test_mean_centred_hand_values():
    # mean of [1, 0, 0, 1] is 0.5 -> r - 0.5
    close(mean_centred(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[0.5, -0.5, -0.5, 0.5]], atol=0)


def test_std_normalised_uses_population_std():
    # centred [0.5, -0.5, -0.5, 0.5]; population std = sqrt(mean of 0.25) = 0.5 -> +-0.5 / 0.5 = +-1
    # (the sample std would be sqrt(1/3) = 0.577 and give +-0.866)
    close(std_normalised(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[1.0, -1.0, -1.0, 1.0]])
    # G = 2 with different rewards: centred +-d/2, population std d/2 -> exactly +-1 up to eps
    close(std_normalised(torch.tensor([[3.0, -1.0]]), eps=0.0), [[1.0, -1.0]], atol=0)


def test_maxrl_hand_values():
    # [1, 0, 0, 1]: mean 0.5 -> +-0.5 / 0.5 = +-1
    close(maxrl(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[1.0, -1.0, -1.0, 1.0]])
    # [1, 0, 0, 0]: mean 0.25 -> success (1 - 0.25) / 0.25 = 3, failure (0 - 0.25) / 0.25 = -1
    close(maxrl(torch.tensor([[1.0, 0.0, 0.0, 0.0]])), [[3.0, -1.0, -1.0, -1.0]], atol=1e-4)


def test_maxrl_rejects_negative_rewards():
    with pytest.raises(ConfigError, match="-0.5"):
        maxrl(torch.tensor([[1.0, -0.5]]))


def test_leave_one_out_hand_values():
    # [1, 0, 0, 0]: the success's baseline is mean(0, 0, 0) = 0 -> 1; a failure's is mean(1, 0, 0) = 1/3 -> -1/3
    close(leave_one_out(torch.tensor([[1.0, 0.0, 0.0, 0.0]])), [[1.0, -1 / 3, -1 / 3, -1 / 3]], atol=1e-6)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_FNS))
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.7])
def test_flat_group_gives_exact_zero(name, value):
    # 0.1 and 0.7 are the traps: in float64 the mean of three of them is not exactly the value (0.1 -> residue
    # 1.4e-17), and /(std + eps) would amplify the residue
    rewards = torch.tensor([[value] * 3, [1.0, 0.0, 1.0]], dtype=torch.float64)
    if value == 0.1:
        assert (rewards[0] - rewards[0].mean()).abs().max() > 0  # the trap is real
    adv = compute_advantages(rewards, name)
    assert not adv.isnan().any()
    assert torch.equal(adv[0], torch.zeros(3, dtype=torch.float64))
    assert adv[1].abs().min() > 0  # the other group is untouched


def reference(rewards, name, eps=1e-6):
    """Slow per-group Python transcription of each formula in the module docstring."""
    out = []
    for group in rewards.tolist():
        g = len(group)
        mean = sum(group) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / g)  # population std
        if name == "mean":
            row = [r - mean for r in group]
        elif name == "std":
            row = [(r - mean) / (std + eps) for r in group]
        elif name == "maxrl":
            row = [(r - mean) / (mean + eps) if mean > 0 else 0.0 for r in group]
        else:
            row = [group[i] - sum(group[j] for j in range(g) if j != i) / (g - 1) for i in range(g)]
        out.append(row)
    return torch.tensor(out, dtype=rewards.dtype)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_FNS))
def test_vectorised_equals_loop(name):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 6, generator=gen, dtype=torch.float64)
    rewards[1] = (rewards[1] > 0.5).double()  # a binary group too
    torch.testing.assert_close(compute_advantages(rewards, name), reference(rewards, name), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_is_kept_and_ints_become_float32(dtype):
    assert compute_advantages(torch.ones(2, 3, dtype=dtype), "std").dtype == dtype
    assert compute_advantages(torch.tensor([[1, 0]]), "mean").dtype == torch.float32


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"'stdd'.*did you mean 'std'.*\['loo', 'maxrl', 'mean', 'std'\]"):
        compute_advantages(torch.zeros(2, 3), "stdd")


def test_rejects_non_2d_rewards_naming_the_shape():
    with pytest.raises(ConfigError, match=r"\(6,\)"):
        compute_advantages(torch.zeros(6), "mean")


def test_rejects_unknown_keyword():
    with pytest.raises(ConfigError, match="'epsilon'"):
        compute_advantages(torch.zeros(2, 3), "std", epsilon=0.1)


def test_leave_one_out_needs_two_rollouts():
    with pytest.raises(ConfigError, match="G=1"):
        compute_advantages(torch.zeros(3, 1), "loo")


@pytest.mark.parametrize("name", sorted(ADVANTAGE_FNS))
def test_groups_of_any_size_match_the_equal_group_estimator(name):
    """Equal groups give bit for bit what compute_advantages gives (to rounding when rows come shuffled); in a ragged
    step each group gets the estimator of its own rows; a lone rollout gets 0; no rows, no advantages."""
    from dllm_rl.algo.advantages import group_advantages

    rewards_BG = torch.tensor([[0.0, 1.0, 1.0], [0.2, 0.2, 0.9], [1.0, 1.0, 1.0], [0.5, 0.0, 0.25]])
    group_N = torch.arange(4).repeat_interleave(3)
    assert torch.equal(group_advantages(rewards_BG.reshape(-1), group_N, name),
                       compute_advantages(rewards_BG, name).reshape(-1))
    shuffle = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(group_advantages(rewards_BG.reshape(-1)[shuffle], group_N[shuffle], name),
                               compute_advantages(rewards_BG, name).reshape(-1)[shuffle])  # sums in another order
    rewards_N = torch.tensor([0.0, 1.0, 0.7, 0.3, 1.0, 0.0, 0.5])
    ragged_N = torch.tensor([7, 7, 2, 9, 9, 9, 9])  # groups of 2, 1 and 4
    got = group_advantages(rewards_N, ragged_N, name)
    assert torch.equal(got[:2], compute_advantages(rewards_N[None, :2], name)[0])
    assert got[2] == 0
    assert torch.equal(got[3:], compute_advantages(rewards_N[None, 3:], name)[0])
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), name).shape == (0,)
