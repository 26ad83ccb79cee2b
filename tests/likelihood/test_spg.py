"""SPG's sandwiched bounds (likelihood=spg): by enumeration on a toy sequence, the ELBO <= the exact log-likelihood
<= the EUBO, and the estimator's Monte-Carlo values converge to those exact bounds; the bound follows the sign of
the advantage; the block-wise masks hold SPG's structure; `algo.objective=pg` is the plain policy gradient."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from dllm_rl.algo.losses import grpo_loss
from dllm_rl.errors import ConfigError
from dllm_rl.likelihood.estimators import block_masks, build_estimator
from tests.likelihood.test_estimators import exact_elbo, tiny_sequence


@torch.no_grad()
def conditionals(policy, ids_NL, mask_NL, P):
    """p_i(S): the probability of completion token i with the positions in S masked (i in S), for every S."""
    C = ids_NL.shape[1] - P
    out = {}
    for k in range(1, C + 1):
        for subset in itertools.combinations(range(C), k):
            noisy = ids_NL.clone()
            noisy[0, [P + i for i in subset]] = policy.mask_id
            logp = -F.cross_entropy(policy.logits(noisy, mask_NL)[0, P:].float(), ids_NL[0, P:], reduction="none")
            out[subset] = {i: math.exp(logp[i].item()) for i in subset}
    return out


def exact_loglik(p, C):
    """log of the probability of generating y in a uniformly random order (the masked-diffusion model's
    likelihood): log mean over orders of prod_t p(y_order[t] | the tokens before it revealed)."""
    total = 0.0
    for order in itertools.permutations(range(C)):
        prob = 1.0
        for t, i in enumerate(order):
            prob *= p[tuple(sorted(order[t:]))][i]
        total += prob
    return math.log(total / math.factorial(C))


def exact_eubo(p, C, beta):
    """SPG's Eq. 7 with its expectation exact: (1/beta) sum_i log sum_k w(k) sum_{|S| = k, S contains i} p_i(S)^beta,
    w(k) = integral of t^(k-1) (1 - t)^(C-k) = (k-1)! (C-k)! / C!."""
    total = 0.0
    for i in range(C):
        avg = sum(math.factorial(len(S) - 1) * math.factorial(C - len(S)) / math.factorial(C) * probs[i] ** beta
                  for S, probs in p.items() if i in S)
        total += math.log(avg) / beta
    return total


@pytest.mark.slow
@pytest.mark.parametrize("beta", [1.0, 1.5, 2.0])
def test_the_bounds_sandwich_the_exact_log_likelihood_and_the_estimator_finds_them(tiny_policy, char_tokenizer, beta):
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer)  # 3 completion tokens, none of them EOS: all counted
    C = ids_NL.shape[1] - P
    p = conditionals(tiny_policy, ids_NL, mask_NL, P)
    elbo, loglik, eubo = exact_elbo(tiny_policy, ids_NL, mask_NL, P, 0.0), exact_loglik(p, C), exact_eubo(p, C, beta)
    assert elbo < loglik < eubo, (elbo, loglik, eubo)
    # one block over the whole window, no perturbation: the estimator's masks are SPG's exact distribution
    common = dict(num_masks=20_000, block_length=C, beta=beta, prompt_mask_prob=0.0)
    with torch.no_grad():
        lower = build_estimator({"name": "spg", **common}).logp(tiny_policy, ids_NL, mask_NL, P, seeds_N=[0],
                                                                  adv_N=torch.tensor([1.0]))
        upper = build_estimator({"name": "spg", **common, "omega": 1.0}).logp(tiny_policy, ids_NL, mask_NL, P,
                                                                                seeds_N=[0], adv_N=torch.tensor([-1.0]))
    assert lower.sum().item() == pytest.approx(elbo, rel=0.02)
    assert upper.sum().item() == pytest.approx(eubo, rel=0.02)
    assert lower[0, 1:].abs().sum() == 0  # the row's value sits in its first column


def test_the_bound_follows_the_sign_of_the_advantage(tiny_policy, char_tokenizer):
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer, completion="7+4=11")
    ids, mask = ids_NL.repeat(3, 1), mask_NL.repeat(3, 1)

    def value(adv, **options):
        estimator = build_estimator({"name": "spg", "num_masks": 4, "block_length": 4, **options})
        with torch.no_grad():
            return estimator.logp(tiny_policy, ids, mask, P, seeds_N=[7, 7, 7], adv_N=torch.tensor(adv))[:, 0]

    mixed = value([1.0, -1.0, 0.0])
    assert mixed[0] != mixed[1] and mixed[1] == mixed[2]  # positive: the ELBO; the others: the mixture
    lower, upper = value([1.0, 1.0, 1.0]), value([-1.0, -1.0, -1.0], omega=1.0)
    assert torch.allclose(value([-1.0] * 3, omega=0.0), lower)  # omega 0: the ELBO on both sides
    assert torch.allclose(mixed[1], 0.5 * upper[1] + 0.5 * lower[1])
    with pytest.raises(ConfigError, match="picks each row's bound by the sign of its advantage"):
        build_estimator({"name": "spg"}).logp(tiny_policy, ids, mask, P, seeds_N=[1, 2, 3])


def test_block_masks_have_spgs_structure():
    real_P = torch.tensor([False, True, True, True, True])
    g = torch.Generator().manual_seed(0)
    window, prompt = block_masks(g, 400, C=12, counted=10, block_length=4, prompt_real_P=real_P, prompt_mask_prob=0.15)
    for w in window:
        masked = w.nonzero().squeeze(-1).tolist()
        assert all(w[10:])  # the EOS fill after the counted tokens is always masked
        # the chosen block: the first block (of those holding counted tokens) whose masks are not all noise
        block = next(b for b in range(3) if w[4 * b:min(4 * b + 4, 10)].any() and all(w[4 * b + 4:]))
        assert all(w[4 * block + 4:]) and 1 <= int(w[4 * block:min(4 * block + 4, 10)].sum()) and masked
    assert not prompt[:, 0].any() and 0.1 < prompt[:, 1:].float().mean() < 0.2  # noise on real prompt tokens only
    chosen = [max(b for b in range(3) if not all(w[4 * b:]) or b == 0) for w in window]
    assert len(set(chosen)) == 3  # every block with counted tokens gets chosen


def test_the_plain_policy_gradient_objective():
    logp = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    old = torch.tensor([[-5.0], [3.0]])  # far from logp: the clipped surrogate would clip, pg ignores them
    adv, mask = torch.tensor([1.0, -0.5]), torch.ones(2, 1)
    loss, metrics = grpo_loss(logp, old, None, adv, mask, objective="pg")
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5], [0.25]]))  # -A / rows
    # its value is -A * ratio with the ratio 1 (exp(logp - logp.detach())): the gradient is -A grad logp
    assert loss.item() == pytest.approx(-(1.0 - 0.5) / 2) and metrics["policy/ratio_max"] == 1.0
    with pytest.raises(ConfigError, match="objective='ppo': expected one of"):
        grpo_loss(logp, old, None, adv, mask, objective="ppo")


def test_a_rows_masks_do_not_depend_on_its_padding():
    """The same prompt left-padded to another width gets the same masks on its real tokens and its window."""
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    narrow = block_masks(g(), 6, C=8, counted=8, block_length=4, prompt_real_P=torch.tensor([True] * 3),
                         prompt_mask_prob=0.5)
    wide = block_masks(g(), 6, C=8, counted=8, block_length=4, prompt_real_P=torch.tensor([False] * 4 + [True] * 3),
                       prompt_mask_prob=0.5)
    assert torch.equal(narrow[0], wide[0]) and torch.equal(narrow[1], wide[1][:, 4:]) and not wide[1][:, :4].any()

