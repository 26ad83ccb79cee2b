import itertools

import pytest
import torch
import torch.nn.functional as F

from dllm_rl.errors import ConfigError
from dllm_rl.likelihood.estimators import ESTIMATORS, antithetic_t, build_estimator, estimate_logp
from dllm_rl.train_config import GROUP_DEFAULTS


def tiny_sequence(char_tokenizer, completion="12a", prompt="x+"):
    ids = char_tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]
    ids_NL = torch.tensor([[char_tokenizer.pad_token_id] + ids])  # one pad on the left
    mask_NL = torch.ones_like(ids_NL)
    mask_NL[0, 0] = 0
    return ids_NL, mask_NL, 1 + len(prompt)


@torch.no_grad()
def exact_elbo(policy, ids_NL, mask_NL, P, eps):
    """Sum over every non-empty subset S of masked completion positions of
    w(|S|) * sum_{i in S} log p(y_i | y with S masked), w(k) = E_t[t^(k-1) (1-t)^(C-k)], t ~ U[eps, 1]."""
    C = ids_NL.shape[1] - P
    t = torch.linspace(eps, 1.0, 200_001, dtype=torch.float64)
    total = 0.0
    for k in range(1, C + 1):
        w = torch.trapezoid(t ** (k - 1) * (1 - t) ** (C - k), t).item() / (1 - eps)
        for subset in itertools.combinations(range(C), k):
            noisy = ids_NL.clone()
            noisy[0, [P + i for i in subset]] = 1  # mask id of the char tokenizer
            logp = -F.cross_entropy(policy.logits(noisy, mask_NL)[0, P:].float(), ids_NL[0, P:], reduction="none")
            total += w * sum(logp[i].item() for i in subset)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("name, num_masks", [("elbo", 20_000), ("coupled", 10_000)])
def test_monte_carlo_elbo_matches_enumeration(tiny_policy, char_tokenizer, name, num_masks):
    assert tiny_policy.mask_id == 1
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer)
    eps = 0.05
    exact = exact_elbo(tiny_policy, ids_NL, mask_NL, P, eps)
    with torch.no_grad():
        estimate = estimate_logp(name, tiny_policy, ids_NL, mask_NL, P, seeds_N=[0], num_masks=num_masks, eps=eps)
    assert estimate.shape == (1, 3)
    assert estimate.sum().item() == pytest.approx(exact, rel=0.02)


def test_ordered_equals_brute_force_generation_probability(tiny_policy, char_tokenizer):
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer, completion="7+4=11")
    C = ids_NL.shape[1] - P
    order = torch.randperm(C, generator=torch.Generator().manual_seed(0))
    order_NC = torch.empty(1, C, dtype=torch.long)
    order_NC[0, order] = torch.arange(C)  # position order[s] is unmasked at step s
    with torch.no_grad():
        ours = estimate_logp("ordered", tiny_policy, ids_NL, mask_NL, P, order_NC=order_NC)
        # Brute force: walk the order, revealing one token at a time from an all-masked window.
        x = ids_NL.clone()
        x[0, P:] = tiny_policy.mask_id
        total = 0.0
        for s in range(C):
            i = int(order[s])
            probs = tiny_policy.logits(x, mask_NL)[0, P + i].float().softmax(-1)
            total += torch.log(probs[ids_NL[0, P + i]]).item()
            x[0, P + i] = ids_NL[0, P + i]
    assert ours.sum().item() == pytest.approx(total, abs=1e-4)


def test_grouped_steps_share_one_state(tiny_policy, char_tokenizer):
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer, completion="abcd")
    with torch.no_grad():
        grouped = estimate_logp("left_to_right", tiny_policy, ids_NL, mask_NL, P, group=2)
        # Steps {0,1} are scored from the all-masked window, steps {2,3} with positions 0,1 revealed.
        x = ids_NL.clone()
        x[0, P:] = 1
        first = -F.cross_entropy(tiny_policy.logits(x, mask_NL)[0, P:].float(), ids_NL[0, P:], reduction="none")
        x[0, P:P + 2] = ids_NL[0, P:P + 2]
        second = -F.cross_entropy(tiny_policy.logits(x, mask_NL)[0, P:].float(), ids_NL[0, P:], reduction="none")
    torch.testing.assert_close(grouped[0], torch.cat([first[:2], second[2:]]))


class Spy:
    """A policy wrapper that records every input it is called with."""

    def __init__(self, policy):
        self.policy, self.mask_id, self.eos_id, self.inputs = policy, policy.mask_id, policy.eos_id, []

    def logits(self, ids, mask=None):
        self.inputs.append(ids.clone())
        return self.policy.logits(ids, mask)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_seeds_masks_and_prompt_handling(tiny_policy, char_tokenizer, name):
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer, completion="3*5+7")
    ids_NL, mask_NL = ids_NL.repeat(2, 1), mask_NL.repeat(2, 1)
    C = ids_NL.shape[1] - P
    order_NC = torch.arange(C).flip(0).expand(2, C)
    kwargs = dict(seeds_N=[5, 6], order_NC=order_NC) | ({"adv_N": torch.tensor([1.0, -1.0])} if name == "spg" else {})
    spy = Spy(tiny_policy)
    with torch.no_grad():
        a = estimate_logp(name, spy, ids_NL, mask_NL, P, **kwargs)
        b = estimate_logp(name, tiny_policy, ids_NL, mask_NL, P, **kwargs)
    assert a.shape == (2, C) and torch.isfinite(a).all()
    assert torch.equal(a, b)  # same seeds, same estimate, bit for bit
    for x in spy.inputs:
        assert (x[:, 0] == char_tokenizer.pad_token_id).all()  # padding untouched
        # no estimator perturbs the prompt by default (mean_field and spg do at prompt_mask_prob > 0)
        assert (x[:, :P] == ids_NL[0, :P]).all()  # rows of ids_NL are identical here
    if name in ("elbo", "coupled", "espo", "spg"):  # mean_field with a clean prompt draws nothing
        other = estimate_logp(name, tiny_policy, ids_NL, mask_NL, P, **{**kwargs, "seeds_N": [7, 8]})
        assert not torch.equal(a, other)


def test_old_and_current_logp_agree_before_an_update(tiny_policy, char_tokenizer):
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer, completion="3*5+7")
    with torch.no_grad():
        old = estimate_logp("mean_field", tiny_policy, ids_NL, mask_NL, P, seeds_N=[3])
    current = estimate_logp("mean_field", tiny_policy, ids_NL, mask_NL, P, seeds_N=[3])
    assert current.requires_grad
    assert torch.equal(torch.exp(current - old), torch.ones_like(old))  # ratio exactly 1


def test_mean_field_masks_the_prompt_at_the_given_rate(tiny_policy, char_tokenizer):
    ids = torch.randint(5, 100, (400, 30))
    mask = torch.ones_like(ids)
    spy = Spy(tiny_policy)
    with torch.no_grad():
        estimate_logp("mean_field", spy, ids, mask, 25, seeds_N=range(400), prompt_mask_prob=0.15)
    x = spy.inputs[0]
    assert (x[:, 25:] == 1).all()
    assert abs((x[:, :25] == 1).float().mean().item() - 0.15) < 0.01
    # the default keeps the prompt clean (d1's 0.15 hides a Sudoku's givens from the gradient: docs/learning.md)
    with torch.no_grad():
        estimate_logp("mean_field", spy, ids, mask, 25, seeds_N=range(400))
    assert (spy.inputs[-1][:, 25:] == 1).all() and torch.equal(spy.inputs[-1][:, :25], ids[:, :25])
    assert build_estimator({"name": "mean_field"}).options == {} and \
        build_estimator(dict(GROUP_DEFAULTS["likelihood"])).options == {"prompt_mask_prob": 0.0}


def test_antithetic_times_are_stratified():
    t = antithetic_t(torch.Generator().manual_seed(0), 4, eps=0.0)
    u = torch.sort(t).values
    torch.testing.assert_close(u.diff(), torch.full((3,), 0.25, dtype=torch.float64))


def test_bad_names_and_options(tiny_policy, char_tokenizer):
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer)
    with pytest.raises(ConfigError, match="unknown likelihood estimator 'elb'"):
        estimate_logp("elb", tiny_policy, ids_NL, mask_NL, P, seeds_N=[0])
    with pytest.raises(ConfigError, match="num_masks must be >= 1"):
        estimate_logp("elbo", tiny_policy, ids_NL, mask_NL, P, seeds_N=[0], num_masks=0)
    with pytest.raises(ConfigError, match="needs the unmask step"):
        estimate_logp("ordered", tiny_policy, ids_NL, mask_NL, P, seeds_N=[0])


def test_an_estimator_is_built_once_from_its_config_and_checked_by_name_and_type(tiny_policy, char_tokenizer):
    from dllm_rl.likelihood.estimators import build_estimator

    elbo = build_estimator({"name": "elbo", "num_masks": 2})
    assert (elbo.level, elbo.needs_trajectory, elbo.config) == ("sequence", False, {"name": "elbo", "num_masks": 2})
    assert build_estimator({"name": "ordered"}).needs_trajectory
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer)
    counted_NC = torch.tensor([[1.0, 1.0, 0.0]])
    per_token = elbo.logp(tiny_policy, ids_NL, mask_NL, P, seeds_N=[4])
    logp, level_mask = elbo.score(tiny_policy, ids_NL, mask_NL, P, [4], None, counted_NC)
    assert logp.shape == (1, 1) and level_mask.tolist() == [[1.0]]  # one value per sequence: the counted sum
    torch.testing.assert_close(logp, per_token[:, :2].sum(-1, keepdim=True))
    mean_field = build_estimator({"name": "mean_field"})
    logp, level_mask = mean_field.score(tiny_policy, ids_NL, mask_NL, P, [4], None, counted_NC)
    assert logp.shape == (1, 3) and torch.equal(level_mask, counted_NC)
    for config, message in [({"name": "elbow"}, "likelihood.name must be one of"),
                            ({"name": "elbo", "num_maks": 2}, "unknown config key 'likelihood.num_maks' (did you "
                                                              "mean 'num_masks'?)"),
                            ({"name": "elbo", "seeds_N": [1]}, "unknown config key 'likelihood.seeds_N'"),
                            ({"name": "elbo", "num_masks": "two"}, "likelihood.num_masks='two': expected int")]:
        with pytest.raises(ConfigError) as error:
            build_estimator(config)
        assert message in str(error.value)


@pytest.mark.slow
def test_fixed_count_elbo_matches_enumeration(tiny_policy, char_tokenizer):
    """LLaDA's form (exactly l ~ U{1..C} tokens masked, weight C / l) estimates the same ELBO as the per-token
    form: a mask of k tokens has expected weight (k-1)! (C-k)! / C! under both (here with eps = 0)."""
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer)
    exact = exact_elbo(tiny_policy, ids_NL, mask_NL, P, 0.0)
    with torch.no_grad():
        estimate = estimate_logp("elbo", tiny_policy, ids_NL, mask_NL, P, seeds_N=[0], num_masks=20_000,
                                 masking="fixed_count")
    assert estimate.sum().item() == pytest.approx(exact, rel=0.02)


def test_fixed_count_masks_hold_exactly_l_tokens_with_l_stratified():
    from dllm_rl.likelihood.estimators import masks_of_counts

    C, M = 7, 70
    l_M1, masked_MC = masks_of_counts(torch.Generator().manual_seed(3), M, C)
    assert torch.equal(masked_MC.sum(1), l_M1[:, 0].long())  # exactly l masked
    assert sorted(torch.bincount(l_M1[:, 0].long(), minlength=C + 1).tolist()[1:]) == [M // C] * C  # each l alike
    assert masked_MC.float().mean(0).min() > 0.2  # every position gets masked (uniform choice of positions)


def single_mask_estimates(policy, char_tokenizer, masking: str, draws: int = 400) -> torch.Tensor:
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer, completion="r1c3=2 r2c1=4 <answer>1234</answer>")
    with torch.no_grad():
        logp_NC = estimate_logp("elbo", policy, ids_NL.repeat(draws, 1), mask_NL.repeat(draws, 1), P,
                                seeds_N=list(range(draws)), num_masks=1, masking=masking)
    return logp_NC.sum(1).double()


def test_fixed_count_elbo_has_a_lower_per_mask_variance(tiny_policy, char_tokenizer):
    """One mask per draw, 400 draws (fixed seeds), on a 35-token completion: the same mean within noise, and
    LLaDA's fixed count at most half the per-token form's variance (scripts/elbo_variance.py measures it)."""
    per_token = single_mask_estimates(tiny_policy, char_tokenizer, "per_token")
    fixed = single_mask_estimates(tiny_policy, char_tokenizer, "fixed_count")
    standard_error = ((per_token.var() + fixed.var()) / len(fixed)).sqrt()
    assert abs(per_token.mean() - fixed.mean()) < 4 * standard_error
    assert fixed.var() < 0.5 * per_token.var()


def test_elbo_masking_is_checked_by_name(tiny_policy, char_tokenizer):
    from dllm_rl.likelihood.estimators import build_estimator

    with pytest.raises(ConfigError, match=r"mixing.likelihood.masking='fixed': expected one of \['per_token', "
                                          r"'fixed_count'\]"):
        build_estimator({"name": "elbo", "masking": "fixed"}, "mixing.likelihood")


@pytest.mark.slow
def test_espo_estimates_the_elbo_per_window_token(tiny_policy, char_tokenizer):
    """ESPO's pairs of complementary fixed-count masks (l on 0..C, weights (C+1)/l and (C+1)/(C-l)): each half
    is an unbiased ELBO estimate, so C times the sum matches the ELBO by enumeration."""
    ids_NL, mask_NL, P = tiny_sequence(char_tokenizer)
    exact = exact_elbo(tiny_policy, ids_NL, mask_NL, P, 0.0)
    with torch.no_grad():
        estimate = estimate_logp("espo", tiny_policy, ids_NL, mask_NL, P, seeds_N=[0], num_masks=10_000)
    C = ids_NL.shape[1] - P
    assert (C * estimate.sum()).item() == pytest.approx(exact, rel=0.02)


def test_espo_masks_are_complementary_pairs_with_counts_stratified_from_zero():
    from dllm_rl.likelihood.estimators import masks_of_counts

    C, M = 5, 60
    l_M1, masked_MC = masks_of_counts(torch.Generator().manual_seed(4), M, C, lowest=0)
    assert torch.equal(masked_MC.sum(1), l_M1[:, 0].long())
    assert torch.bincount(l_M1[:, 0].long(), minlength=C + 1).tolist() == [M // (C + 1)] * (C + 1)  # 0..C alike
    # LLaDA's masks (lowest 1) are drawn exactly as before the option existed
    l_1, masked_1 = masks_of_counts(torch.Generator().manual_seed(4), M, C)
    u0 = torch.rand(1, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    u_M = (u0 + torch.arange(M, dtype=torch.float64) / M) % 1.0
    assert torch.equal(l_1[:, 0], (u_M * C).floor().clamp(max=C - 1) + 1)
