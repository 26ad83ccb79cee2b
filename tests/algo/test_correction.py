"""Sparse-RL's sampler-learner correction: ratios, rejection and truncated weights on hand-made numbers, the
loss untouched where sampler and learner agree, and the stage inside a training run."""

import json
import math

import pytest
import torch

from dllm_rl.algo.correction import SamplerCorrection, correction_weights, rollout_log_ratio
from dllm_rl.algo.losses import grpo_loss
from dllm_rl.errors import ConfigError

RATIOS = [0.4, 0.9, 1.0, 1.5, 3.0]


def log_ratios():
    return torch.tensor(RATIOS, dtype=torch.float64).log()


def test_a_rollouts_log_ratio_is_the_mean_over_its_counted_tokens():
    learner = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0], [-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.5, -1.0, -3.0], [-0.5, -1.5, -1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # (0.5 - 1 + 0) / 3; (0 + 1) / 2 (the uncounted -9 vs -1 is ignored); no counted token: 0
    assert rollout_log_ratio(learner, sampler, mask).tolist() == pytest.approx([-0.5 / 3, 0.5, 0.0])


@pytest.mark.parametrize("mode, weights, rejected, capped", [
    ("reject", [0.0, 1.0, 1.0, 1.0, 0.0], 0.4, 0.0),
    ("weight", [0.4, 0.9, 1.0, 1.2, 1.2], 0.0, 0.4),
    ("both", [0.0, 0.9, 1.0, 1.2, 0.0], 0.4, 0.2),  # 3.0 is rejected, so not counted as capped
    ("none", [1.0] * 5, 0.0, 0.0),
])
def test_rejection_and_truncated_weights_on_hand_made_ratios(mode, weights, rejected, capped):
    config = SamplerCorrection(mode=mode, lower=0.5, upper=2.0, cap=1.2)
    weight_N, metrics = correction_weights(log_ratios(), config)
    assert weight_N.tolist() == pytest.approx(weights)
    assert metrics["correction/reject_rate"] == pytest.approx(rejected)
    assert metrics["correction/capped_rate"] == pytest.approx(capped)
    assert metrics["correction/weight_mean"] == pytest.approx(sum(weights) / 5)
    assert metrics["correction/log_ratio"] == pytest.approx(sum(math.log(r) for r in RATIOS) / 5)


def test_where_sampler_and_learner_agree_the_loss_is_bit_identical():
    torch.manual_seed(0)
    logp = torch.randn(6, 5) - 2.0
    old, adv, mask = logp + 0.1 * torch.randn(6, 5), torch.randn(6), (torch.rand(6, 5) > 0.2).float()
    log_ratio = rollout_log_ratio(logp, logp.clone(), mask)
    assert torch.equal(log_ratio, torch.zeros(6, dtype=torch.float64))
    for mode in ("reject", "weight", "both"):
        weight_N, metrics = correction_weights(log_ratio, SamplerCorrection(mode=mode))
        assert torch.equal(weight_N, torch.ones(6)) and metrics["correction/reject_rate"] == 0.0
        plain, _ = grpo_loss(logp.requires_grad_(), old, None, adv, mask)
        corrected, _ = grpo_loss(logp, old, None, adv, mask, weights_N=weight_N)
        assert torch.equal(plain, corrected)


@pytest.mark.parametrize("options, message", [
    ({"mode": "sometimes"}, "sampler_correction.mode must be one of"),
    ({"lower": 1.5}, "must bracket 1"),
    ({"upper": 0.9}, "must bracket 1"),
    ({"cap": 0.5}, "sampler_correction.cap=0.5: expected >= 1"),
    ({"cap": -1.0}, "sampler_correction.cap"),
    ({"lower": "low"}, "sampler_correction.lower"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ConfigError, match=message):
        SamplerCorrection(**options)


@pytest.mark.slow
def test_a_run_with_parallel_decoding_logs_and_applies_the_correction(saved_model, tmp_path):
    from dllm_rl.train import train
    from tests.conftest import DigitShare
    from tests.test_train import SMALL

    runs = {}
    for name, rollout in (("exact", {}), ("parallel", {"threshold": 0.3})):
        run = tmp_path / name
        train(DigitShare(), model=saved_model, run_dir=str(run), steps=2, checkpoint_every=0, bf16=False,
              sampler_correction={"mode": "both", "lower": 0.8, "upper": 1.25, "cap": 1.1},
              **{**SMALL, "rollout": {**SMALL["rollout"], **rollout}})
        runs[name] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for line in runs["exact"] + runs["parallel"]:
        assert {"correction/reject_rate", "correction/weight_mean", "correction/log_ratio"} <= set(line)
        assert all(math.isfinite(v) for v in line.values() if isinstance(v, float))
    # The exact sampler commits what the learner would: its only difference is that it never predicts the mask
    # token, which the learner's softmax keeps (about 1/V of the mass of a random model).
    for line in runs["exact"]:
        assert line["correction/reject_rate"] == 0.0 and abs(line["correction/log_ratio"]) < 0.05
