"""Clipped surrogate, KL estimators, aggregation and grpo_loss against hand values and a slow Python loop."""

import ast
import math
from pathlib import Path

import pytest
import torch

from dllm_rl.algo.losses import (AGGREGATIONS, KL_FNS, aggregate, aggregation_units, clipped_surrogate, grpo_loss,
                                 kl_k1, kl_k2, kl_k3, ratio_and_log_ratio)
from dllm_rl.errors import ConfigError

E_HALF, E_MINUS_HALF = math.exp(0.5), math.exp(-0.5)  # 1.6487, 0.6065


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# ---------------------------------------------------------------- clipped surrogate


def test_ratio_is_exp_of_log_ratio():
    ratio, log_ratio = ratio_and_log_ratio(torch.tensor([[0.5, -1.0]]), torch.tensor([[0.0, -0.5]]))
    close(log_ratio, [[0.5, -0.5]])
    close(ratio, [[E_HALF, E_MINUS_HALF]])


def test_clipped_surrogate_hand_values():
    logp = torch.tensor([[0.5, -0.5], [0.5, -0.5]])
    old = torch.zeros(2, 2)  # ratios e^0.5 = 1.6487 and e^-0.5 = 0.6065 in both rows
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([1.0, -1.0]), 0.2, 0.2)
    # A=+1, ratio 1.6487: -min(1.6487, 1.2) = -1.2, clipped.   A=+1, ratio 0.6065: -min(0.6065, 0.8) = -0.6065.
    # A=-1, ratio 1.6487: -min(-1.6487, -1.2) = 1.6487, NOT clipped (the gradient still pulls the ratio down).
    # A=-1, ratio 0.6065: -min(-0.6065, -0.8) = 0.8, clipped.
    close(loss, [[-1.2, -E_MINUS_HALF], [E_HALF, 0.8]])
    assert clipped.tolist() == [[True, False], [False, True]]


def test_clip_higher_is_asymmetric():
    # DAPO eps_low=0.2, eps_high=0.28. ratio 1.25 (log 0.2231) with A=+1: inside [0.8, 1.28] -> -1.25, not
    # clipped (the symmetric 0.2 would clip it to -1.2). ratio 1.6487 -> -1.28. ratio 0.6065 with A=-1 -> 0.8.
    logp = torch.tensor([[math.log(1.25), 0.5, -0.5]])
    loss, clipped = clipped_surrogate(logp, torch.zeros(1, 3), torch.tensor([1.0]), 0.2, 0.28)
    close(loss[:, :2], [[-1.25, -1.28]])
    assert clipped.tolist() == [[False, True, False]]
    loss, clipped = clipped_surrogate(logp, torch.zeros(1, 3), torch.tensor([-1.0]), 0.2, 0.28)
    close(loss[:, 2], [0.8])
    assert clipped[0, 2]
    loss, clipped = clipped_surrogate(logp, torch.zeros(1, 3), torch.tensor([1.0]), 0.2, 0.2)
    close(loss[:, 0], [-1.2])
    assert clipped[0, 0]


# ---------------------------------------------------------------- KL estimators


def test_kl_hand_values():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    close(kl_k1(logp, ref), [1.0, -1.0])  # logp - ref
    close(kl_k2(logp, ref), [0.5, 0.5])  # (+-1)^2 / 2
    # k3 = e^(ref - logp) - (ref - logp) - 1: e^-1 + 1 - 1 = 0.3679; e^1 - 1 - 1 = 0.7183
    close(kl_k3(logp, ref), [math.exp(-1), math.e - 2])
    assert set(KL_FNS) == {"k1", "k2", "k3"}


def test_k3_and_k2_are_never_negative():
    gen = torch.Generator().manual_seed(0)
    logp, ref = 3 * torch.randn(1000, generator=gen), 3 * torch.randn(1000, generator=gen)
    assert (kl_k3(logp, ref) >= 0).all() and (kl_k2(logp, ref) >= 0).all()
    assert (kl_k1(logp, ref) < 0).any()  # k1 is unbiased but not pointwise >= 0
    assert torch.equal(kl_k3(logp, logp), torch.zeros(1000))  # e^0 - 0 - 1


# ---------------------------------------------------------------- aggregation

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # padding in rows 0 and 1, row 2 empty


def test_aggregation_hand_values():
    # counted: 1, 2 (row 0) and 4 (row 1); 3 tokens, sum 7
    close(aggregate(LOSS, MASK, "token"), 7 / 3)
    # row means 1.5 and 4; the empty row is left out: (1.5 + 4) / 2 = 2.75
    close(aggregate(LOSS, MASK, "sequence"), 2.75)
    # Dr.GRPO: 7 / (N rows * constant 4), N = 2 rows with a counted token (a rollout always has one; an empty
    # row is a data-parallel stand-in, which must not count): 7/8
    close(aggregate(LOSS, MASK, "constant", constant=4), 7 / 8)
    close(aggregate(LOSS, MASK.bool(), "token"), 7 / 3)  # a bool mask works the same
    assert set(AGGREGATIONS) == {"token", "sequence", "constant"}


@pytest.mark.parametrize("how", ["token", "sequence", "constant"])
def test_empty_mask_and_nan_padding_give_finite_values(how):
    assert aggregate(LOSS, torch.zeros(3, 3), how, constant=4).item() == 0.0
    with_nan = LOSS.clone()
    with_nan[0, 2], with_nan[2, 0] = float("nan"), float("inf")  # only at ignored tokens
    torch.testing.assert_close(aggregate(with_nan, MASK, how, constant=4), aggregate(LOSS, MASK, how, constant=4))


def test_aggregation_units_are_what_aggregate_divides_by():
    assert aggregation_units(MASK, "token") == 3.0  # counted tokens
    assert aggregation_units(MASK, "sequence") == 2.0 == aggregation_units(MASK, "constant")  # rows with one


def test_rows_of_weight_zero_do_not_dilute_the_loss_of_the_rest():
    """A rejected row (weight 0) leaves the normaliser: the loss of the kept rows is what it is without the
    rejected ones; a weight other than 0 scales a row but still counts it."""
    logp, old = torch.tensor([[-1.0, -2.0], [-0.5, -0.1], [-3.0, -1.0]]), torch.zeros(3, 2)
    adv, mask = torch.tensor([1.0, -1.0, 2.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    assert aggregation_units(mask, "token", torch.tensor([1.0, 0.0, 0.5])) == 4.0
    assert aggregation_units(mask, "sequence", torch.tensor([0.0, 0.0, 0.5])) == 1.0
    for how in ("token", "sequence"):
        kept, _ = grpo_loss(logp[[0, 2]], old[[0, 2]], None, adv[[0, 2]], mask[[0, 2]], aggregation=how)
        rejected, _ = grpo_loss(logp, old, None, adv, mask, aggregation=how, weights_N=torch.tensor([1.0, 0.0, 1.0]))
        close(rejected, kept)
    # token aggregation by hand: ratios e^-1, e^-2 (A = 1) and e^-3, e^-1 (A = 2); with A > 0 and a ratio below
    # 1 - eps the unclipped term ratio * A is the smaller one: -(3 e^-1 + e^-2 + 2 e^-3) / 4 counted tokens
    expected = -(3 * math.exp(-1) + math.exp(-2) + 2 * math.exp(-3)) / 4
    close(grpo_loss(logp, old, None, adv, mask, weights_N=torch.tensor([1.0, 0.0, 1.0]))[0], torch.tensor(expected))


@pytest.mark.parametrize("how", ["token", "sequence", "constant"])
def test_ranks_given_the_global_units_average_to_the_one_process_loss_and_gradient(how):
    """Rows split over two "ranks" (one also holding an empty stand-in row): each rank divides by the units
    of both and multiplies by 2, so the mean over ranks, what DeepSpeed's gradient average computes, is the
    loss (and gradient) of one process holding every row."""
    logp, old, ref, adv, mask = random_inputs(seed=3)
    options = dict(eps_low=0.2, eps_high=0.28, beta=0.04, aggregation=how, constant=5)
    whole_logp = logp.clone().requires_grad_(True)
    whole, _ = grpo_loss(whole_logp, old, ref, adv, mask, **options)
    whole.backward()
    halves = [slice(0, 2), slice(2, 6)]
    inputs = [[t[rows] for t in (logp, old, ref, adv, mask)] for rows in halves]
    inputs[0] = [torch.cat([t, t[:1]]) for t in inputs[0]]  # a stand-in: a copy of row 0 with mask 0 ...
    inputs[0][4][-1] = 0
    units = sum(aggregation_units(m, how) for *_, m in inputs)
    losses, grads = [], []
    for part in inputs:
        part_logp = part[0].clone().requires_grad_(True)
        loss, _ = grpo_loss(part_logp, *part[1:], **options, global_units=units, ranks=2)
        loss.backward()
        losses.append(loss)
        grads.append(part_logp.grad[:len(part_logp) - (part is inputs[0])])  # ... whose gradient is 0
    assert float(sum(losses).detach() / 2) == pytest.approx(float(whole.detach()), rel=1e-12)
    torch.testing.assert_close(torch.cat(grads) / 2, whole_logp.grad, rtol=1e-12, atol=1e-15)


def test_aggregation_errors():
    with pytest.raises(ConfigError, match=r"constant=None"):
        aggregate(LOSS, MASK, "constant")
    with pytest.raises(ConfigError, match=r"constant=0"):
        aggregate(LOSS, MASK, "constant", constant=0)
    with pytest.raises(ConfigError, match=r"'tokens'.*did you mean 'token'"):
        aggregate(LOSS, MASK, "tokens")
    with pytest.raises(ConfigError, match=r"\(3, 2\).*\(3, 3\)"):
        aggregate(LOSS, MASK[:, :2], "token")


# ---------------------------------------------------------------- grpo_loss


def reference_loss(logp, old, ref, adv, mask, weights, eps_low, eps_high, beta, how, constant):
    """Slow token-by-token transcription of the formulas in losses.py's docstrings."""
    sums, counts = [], []
    for n in range(len(mask)):
        row_sum, row_count = 0.0, 0
        for t in range(len(mask[n])):
            if not mask[n][t]:
                continue
            ratio, a = math.exp(logp[n][t] - old[n][t]), adv[n]
            surrogate = -min(ratio * a, min(max(ratio, 1 - eps_low), 1 + eps_high) * a)
            d = ref[n][t] - logp[n][t]
            row_sum += weights[n] * (surrogate + beta * (math.exp(d) - d - 1))
            row_count += 1
        sums.append(row_sum)
        counts.append(row_count)
    if how == "token":
        return sum(sums) / sum(counts)
    if how == "sequence":
        means = [s / c for s, c in zip(sums, counts) if c]
        return sum(means) / len(means)
    return sum(sums) / (sum(1 for c in counts if c) * constant)


def random_inputs(seed=0, n=6, c=5):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, c, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(n, c, generator=gen, dtype=torch.float64)  # some ratios outside [0.8, 1.2]
    ref = logp + 0.5 * torch.randn(n, c, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = (torch.rand(n, c, generator=gen) < 0.7).long()
    mask[0] = 0  # one empty row
    mask[1] = 1  # one full row
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("how", ["token", "sequence", "constant"])
@pytest.mark.parametrize("weighted", [False, True])
def test_grpo_loss_equals_loop(how, weighted):
    logp, old, ref, adv, mask = random_inputs()
    weights = torch.linspace(0.5, 2.0, 6, dtype=torch.float64) if weighted else None
    loss, metrics = grpo_loss(logp, old, ref, adv, mask, eps_low=0.2, eps_high=0.28, beta=0.04, kl="k3",
                              aggregation=how, constant=5, weights_N=weights)
    w = weights.tolist() if weighted else [1.0] * 6
    expected = reference_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), w,
                              0.2, 0.28, 0.04, how, 5)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # the metrics split the loss: loss = loss/policy + beta * loss/kl
    assert loss.item() == pytest.approx(metrics["loss/policy"] + 0.04 * metrics["loss/kl"], rel=1e-12)
    assert metrics["loss/kl"] > 0 and 0 < metrics["policy/clip_frac"] < 1
    assert metrics["policy/adv_mean"] == pytest.approx(adv.mean().item())
    assert all(isinstance(v, float) for v in metrics.values())


def test_padding_log_probs_of_minus_inf_are_inert():
    logp, old, ref, adv, mask = random_inputs()
    expected, _ = grpo_loss(logp, old, ref, adv, mask, beta=0.04)
    pad = mask == 0
    logp, old, ref = (t.masked_fill(pad, float("-inf")) for t in (logp, old, ref))
    logp.requires_grad_(True)
    loss, metrics = grpo_loss(logp, old, ref, adv, mask, beta=0.04)
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.isfinite(logp.grad).all() and (logp.grad[pad] == 0).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_zero_advantage_gives_zero_gradient():
    logp, old, _, _, mask = random_inputs()
    logp.requires_grad_(True)
    loss, _ = grpo_loss(logp, old, None, torch.zeros(6, dtype=torch.float64), mask, beta=0.0)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_on_policy_ratio_is_exactly_one():
    logp, _, ref, adv, mask = random_inputs()
    _, metrics = grpo_loss(logp, logp.clone(), ref, adv, mask, beta=0.04)
    assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/ratio_max"] == 1.0
    assert metrics["policy/clip_frac"] == 0.0


def test_token_gradient_hand_values():
    # ratios e^0.1 = 1.10517 (inside), e^0.5 (clipped: A > 0 and ratio > 1.2), e^-0.1 = 0.90484 (inside);
    # the 4th token is padding. d/dlogp of -A * ratio / 3 tokens is -A * ratio / 3 with A = 2:
    # [-2 * 1.10517 / 3, 0, -2 * 0.90484 / 3, 0] = [-0.73678, 0, -0.60322, 0]
    logp = torch.tensor([[0.1, 0.5, -0.1, 0.0]], requires_grad=True)
    loss, metrics = grpo_loss(logp, torch.zeros(1, 4), None, torch.tensor([2.0]), torch.tensor([[1, 1, 1, 0]]))
    loss.backward()
    close(logp.grad, [[-0.736781, 0.0, -0.603225, 0.0]])
    assert metrics["policy/clip_frac"] == pytest.approx(1 / 3)


def test_token_gradient_formula_on_random_input():
    logp, old, _, adv, mask = random_inputs(seed=1)
    logp.requires_grad_(True)
    loss, _ = grpo_loss(logp, old, None, adv, mask, aggregation="token")
    loss.backward()
    ratio, _ = ratio_and_log_ratio(logp.detach(), old)
    _, clipped = clipped_surrogate(logp.detach(), old, adv, 0.2, 0.2)
    expected = torch.where(clipped | (mask == 0), 0.0, -adv[:, None] * ratio / mask.sum())
    assert clipped[mask == 1].any()  # the case is exercised
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-15)


def test_sequence_level_log_probs():
    # one log-prob per rollout (N, 1): ratios e^0.5 and e^-0.5 with A = +1 -> losses -1.2 and -0.6065
    logp, mask = torch.tensor([[0.5], [-0.5]]), torch.ones(2, 1)
    loss, metrics = grpo_loss(logp, torch.zeros(2, 1), None, torch.ones(2), mask)
    close(loss, (-1.2 - E_MINUS_HALF) / 2)
    assert metrics["policy/clip_frac"] == 0.5 and metrics["loss/kl"] == 0.0


def test_bad_inputs_name_the_value():
    logp, old, ref, adv, mask = random_inputs()
    with pytest.raises(ConfigError, match=r"eps_low=0\b"):
        grpo_loss(logp, old, ref, adv, mask, eps_low=0)
    with pytest.raises(ConfigError, match=r"eps_high=-0.1"):
        grpo_loss(logp, old, ref, adv, mask, eps_high=-0.1)
    with pytest.raises(ConfigError, match=r"'k4'.*\['k1', 'k2', 'k3'\]"):
        grpo_loss(logp, old, ref, adv, mask, kl="k4")
    with pytest.raises(ConfigError, match=r"beta=0.04.*ref_logp_NC"):
        grpo_loss(logp, old, None, adv, mask, beta=0.04)
    with pytest.raises(ConfigError, match=r"beta=-1"):
        grpo_loss(logp, old, ref, adv, mask, beta=-1)
    with pytest.raises(ConfigError, match=r"old_logp_NC has shape \(6, 4\); expected \(6, 5\)"):
        grpo_loss(logp, old[:, :4], ref, adv, mask)
    with pytest.raises(ConfigError, match=r"adv_N has shape \(5,\); expected \(6,\)"):
        grpo_loss(logp, old, ref, adv[:5], mask)
    with pytest.raises(ConfigError, match=r"weights_N has shape \(6, 1\)"):
        grpo_loss(logp, old, ref, adv, mask, weights_N=torch.ones(6, 1))
    with pytest.raises(ConfigError, match=r"logp_NC has shape \(6,\)"):
        grpo_loss(logp[:, 0], old[:, 0], None, adv, mask[:, 0])


def test_algo_imports_only_torch_and_errors():
    """The algo package stays pure tensor math: torch, the standard library, errors, and itself."""
    algo = Path(__file__).resolve().parents[2] / "dllm_rl" / "algo"
    allowed = {"__future__", "math", "dataclasses", "typing", "torch", "dllm_rl.errors"}
    for path in algo.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert (name in allowed or name.split(".")[0] in allowed - {"dllm_rl.errors"}
                        or name.startswith("dllm_rl.algo.")), (path.name, name)
