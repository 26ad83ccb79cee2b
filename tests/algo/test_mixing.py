"""ERILS reward processing, triggers, importance weights and LUFFY shaping against hand-computed values."""

import math

import pytest
import torch

from dllm_rl.algo.losses import grpo_loss, shaped_surrogate
from dllm_rl.algo.mixing import (importance_weights, joint_advantages, running_baseline, separate_advantages,
                                 triggered)
from dllm_rl.errors import ConfigError

ON_BG = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])  # prompt 0: mean 0.5; prompt 1: all failed
ON = (ON_BG.reshape(-1), torch.arange(2).repeat_interleave(4))  # as rows: rewards_N, prompt_N


def test_separate_processing_leaves_on_policy_advantages_bit_identical():
    alone, _ = separate_advantages(*ON, torch.zeros(0), torch.zeros(0, dtype=torch.long), advantage="std",
                                   statistic="group")
    for statistic in ("constant", "group", "running", "on_policy"):
        with_ext, _ = separate_advantages(*ON, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 1, 1]),
                                          advantage="std", statistic=statistic, baseline=0.3)
        assert torch.equal(alone, with_ext)


def test_external_statistics_hand_values():
    ext, prompt = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 1, 1])
    args = dict(advantage="mean")
    # constant: 2 * r
    assert separate_advantages(*ON, ext, prompt, statistic="constant", constant=2.0, **args)[1].tolist() == [2, 2, 0]
    # group: prompt 0 has one external row -> its own group -> 0; prompt 1: [1, 0] - 0.5 = [0.5, -0.5]
    assert separate_advantages(*ON, ext, prompt, statistic="group", **args)[1].tolist() == [0.0, 0.5, -0.5]
    # running: r - 0.25
    assert separate_advantages(*ON, ext, prompt, statistic="running", baseline=0.25, **args)[1].tolist() == [
        0.75, 0.75, -0.25]
    # on_policy: r - mean of the prompt's on-policy rewards (0.5 and 0.0)
    assert separate_advantages(*ON, ext, prompt, statistic="on_policy", **args)[1].tolist() == [0.5, 1.0, 0.0]


def test_joint_processing_pools_the_groups():
    ext, prompt = torch.tensor([1.0]), torch.tensor([1])
    on, adv_ext = joint_advantages(*ON, ext, prompt, advantage="mean")
    # prompt 0 has no external row: unchanged, r - 0.5. Prompt 1: [0, 0, 0, 0, 1] has mean 0.2.
    assert on[:4].tolist() == [-0.5, -0.5, 0.5, 0.5]
    torch.testing.assert_close(on[4:], torch.full((4,), -0.2))
    torch.testing.assert_close(adv_ext, torch.tensor([0.8]))
    separate, _ = separate_advantages(*ON, ext, prompt, advantage="mean", statistic="constant")
    assert not torch.equal(on, separate)  # joint processing changes the on-policy advantages


def test_ragged_groups_hand_values():
    """Prompt 0 has three on-policy rows, prompt 1 one, prompt 2 none (only an external row), in mixed order."""
    on_rewards, on_prompt = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 1, 0, 0])
    ext, ext_prompt = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1, 2, 2])
    adv_on, adv_ext = separate_advantages(on_rewards, on_prompt, ext, ext_prompt, advantage="mean",
                                          statistic="on_policy")
    assert adv_on.tolist() == pytest.approx([1 / 3, 0.0, -2 / 3, 1 / 3])  # a lone rollout: 0
    assert adv_ext.tolist() == [1.0, 1.0, 0.0]  # prompt 1's mean is 0; prompt 2 has none: compared with 0
    adv_on, adv_ext = joint_advantages(on_rewards, on_prompt, ext, ext_prompt, advantage="mean")
    assert adv_on.tolist() == pytest.approx([1 / 3, -0.5, -2 / 3, 1 / 3])  # prompt 1 pools [0, 1]: mean 0.5
    assert adv_ext.tolist() == pytest.approx([0.5, 0.5, -0.5])


def test_triggers():
    correct_BG = torch.tensor([[True, False], [False, False], [False, True]])
    assert triggered(correct_BG, "always").tolist() == [True, True, True]
    assert triggered(correct_BG, "all_failed").tolist() == [False, True, False]
    u = torch.tensor([0.1, 0.5, 0.9])
    # step 4 of decay 10: probability 0.6 -> prompts with u < 0.6 fire
    assert triggered(correct_BG, "schedule", step=4, decay_steps=10, uniform_B=u).tolist() == [True, True, False]
    assert not triggered(correct_BG, "schedule", step=10, decay_steps=10, uniform_B=u).any()
    with pytest.raises(ConfigError, match="unknown external trigger 'sometimes'"):
        triggered(correct_BG, "sometimes")


def test_running_baseline_is_an_ema():
    assert running_baseline(0.5, torch.tensor([1.0, 0.0, 1.0, 1.0]), 0.9) == pytest.approx(0.9 * 0.5 + 0.1 * 0.75)
    assert running_baseline(0.5, torch.zeros(0), 0.9) == 0.5


def test_importance_weights_hand_values():
    logp = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64)
    mu = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    w, m = importance_weights(logp, mu, cap=10.0, self_normalize=False)
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-1), math.exp(-2)], dtype=torch.float64))
    s, s2 = 1 + math.exp(-1) + math.exp(-2), 1 + math.exp(-2) + math.exp(-4)
    assert m["ess"] == pytest.approx(s * s / (3 * s2)) and m["is_clip_frac"] == 0.0
    # self-normalised to mean 1, then capped at 1.5: weights 3 * softmax = [2.119, 0.780, 0.287] -> first capped
    w, m = importance_weights(logp, mu, cap=1.5, self_normalize=True)
    expected = [3 / s, 3 * math.exp(-1) / s, 3 * math.exp(-2) / s]
    torch.testing.assert_close(w, torch.tensor([1.5, expected[1], expected[2]], dtype=torch.float64))
    assert m["is_clip_frac"] == pytest.approx(1 / 3)


def test_shaped_surrogate_hand_values_and_gradient():
    logp = torch.tensor([[math.log(0.1), math.log(0.9)]], requires_grad=True)
    loss = shaped_surrogate(logp, torch.tensor([2.0]), gamma=0.1)
    # f(0.1) = 0.1 / 0.2 = 0.5, f(0.9) = 0.9 / 1.0 = 0.9; loss = -2 f
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.0, -1.8]]))
    loss.sum().backward()
    # d(-2 f)/d logp = -2 * gamma * p / (p + gamma)^2: p=0.1 -> -0.5, p=0.9 -> -0.18
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.18]]))


def test_grpo_loss_uses_shaping_only_on_shaped_rows():
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.1, 0.9]]))
    adv, mask = torch.tensor([1.0, 1.0]), torch.ones(2, 2)
    plain, _ = grpo_loss(logp, logp, None, adv, mask)
    mixed, m = grpo_loss(logp, logp, None, adv, mask, shaped_N=torch.tensor([False, True]), shaping_gamma=0.1)
    # row 0 keeps the clipped surrogate at ratio 1: -1 per token; row 1 shaped: -0.5 and -0.9
    assert plain.item() == pytest.approx(-1.0)
    assert mixed.item() == pytest.approx((-1 - 1 - 0.5 - 0.9) / 4)
    assert m["policy/clip_frac"] == 0.0
