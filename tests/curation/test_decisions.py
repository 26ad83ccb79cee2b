"""The curation strategies' decisions on hand-made inputs (dllm_rl/curation/): GRESO's skip probability and
its adaptation, SERA's allocation and posterior, DARTS's selection, dynamic sampling's bound."""

import math
import random

import pytest
import torch

from dllm_rl.curation import build_curation, check_curation
from dllm_rl.curation import darts, dynamic_sampling, greso, grpo_dropout, sera
from dllm_rl.curation.strategies import Darts, GroupRecord, Greso, Sera
from dllm_rl.errors import ConfigError
from dllm_rl.collect import Drawn


def drawn(ids, pool=100):
    return [Drawn(q, q % pool, None) for q in ids]


# ------------------------------------------------------------------------------------------ GRESO


def test_greso_skip_probability_follows_the_formula_and_the_floor_holds():
    assert greso.skip_probability(0, 0.5, 0.01) == 0.0  # never flat in a row: never skipped
    assert greso.skip_probability(1, 0.5, 0.01) == 0.5
    assert greso.skip_probability(3, 0.5, 0.01) == pytest.approx(1 - 0.125)
    assert greso.skip_probability(7, 0.5, 0.01) == pytest.approx(1 - 0.01)  # 0.5^7 = 0.0078 < floor
    assert greso.skip_probability(50, 0.9, 0.2) == pytest.approx(0.8)


def test_greso_p_moves_toward_the_target_and_stays_within_bounds():
    assert greso.adapt(0.5, 0.4, 0.25, 0.01, 0.05, 0.95) == pytest.approx(0.49)  # too many flat: skip more
    assert greso.adapt(0.5, 0.1, 0.25, 0.01, 0.05, 0.95) == pytest.approx(0.51)
    assert greso.adapt(0.5, 0.25, 0.25, 0.01, 0.05, 0.95) == pytest.approx(0.49)  # at the target: down (>=)
    p = 0.5
    for _ in range(100):
        p = greso.adapt(p, 1.0, 0.25, 0.01, 0.05, 0.95)
    assert p == pytest.approx(0.05)
    for _ in range(200):
        p = greso.adapt(p, 0.0, 0.25, 0.01, 0.05, 0.95)
    assert p == pytest.approx(0.95)


def test_greso_kinds_are_the_reference_thresholds_on_the_share_correct():
    assert greso.group_kind([True] * 8) == "easy" and greso.group_kind([True] * 7 + [False]) == "mixed"
    assert greso.group_kind([False] * 8) == "hard" and greso.group_kind([True] + [False] * 7) == "mixed"  # 0.125
    assert greso.group_kind([True] + [False] * 9) == "hard"  # 0.1 <= 0.11
    assert greso.group_kind([True] * 49 + [False]) == "easy"  # 0.98
    # wrong answers with and without the format (rewards 0.1 and 0): no variance rule would call it flat
    g = Greso(greso.GresoConfig(), group_size=4, seed=0, pool_size=4)
    g.observe([GroupRecord(0, 1, [0.1, 0.0, 0.1, 0.0], [False] * 4)])
    assert g.streak[1] == 1 and g.kind[1] == "hard"


def test_greso_on_hand_made_histories():
    """Example 1 is all-correct twice, example 2 all-wrong once then mixed, example 3 all-wrong once; one epoch
    of 4 prompts: the epoch's flat shares move p_easy and p_hard at the next epoch's first draw."""
    g = Greso(greso.GresoConfig(), group_size=2, seed=0, pool_size=4, external=False)
    flat_easy = dict(rewards=[1.0, 1.0], correct=[True, True])
    flat_hard = dict(rewards=[0.0, 0.0], correct=[False, False])
    mixed = dict(rewards=[1.0, 0.0], correct=[True, False])
    g.observe([GroupRecord(0, 1, **flat_easy), GroupRecord(1, 2, **flat_hard), GroupRecord(2, 3, **flat_hard),
               GroupRecord(3, 0, **mixed)])
    assert g.streak == {1: 1, 2: 1, 3: 1, 0: 0}
    assert g.skip_probability(1) == 0.5 and g.skip_probability(0) == 0.0
    g.allocate(5, drawn([4]), [2])  # epoch 1 begins: epoch 0 had 1/4 easy flat (> 1/12), 2/4 hard (> 1/6)
    assert g.p == {"easy": pytest.approx(0.49), "hard": pytest.approx(0.49)}
    g.observe([GroupRecord(4, 1, **flat_easy), GroupRecord(5, 2, **mixed)])
    assert g.streak[1] == 2 and g.streak[2] == 0
    assert g.skip_probability(1) == pytest.approx(1 - 0.49 ** 2)
    # the decision is a seeded draw per (step, prompt id): the same on every rank, skip rates as the formula says
    skipped = sum(g.allocate(s, drawn([100 * s + 1], pool=100), [2]) == [0] for s in range(2000))
    assert skipped / 2000 == pytest.approx(1 - 0.49 ** 2, abs=0.03)
    twin = Greso(greso.GresoConfig(), group_size=2, seed=0, pool_size=4)
    twin.load_state_dict(g.state_dict())
    assert [twin.allocate(s, drawn([9, 13]), [2, 2]) for s in range(50)] == \
        [g.allocate(s, drawn([9, 13]), [2, 2]) for s in range(50)]


def test_greso_exempts_prompts_that_got_external_rows():
    for external, streak in ((True, 0), (False, 1)):
        g = Greso(greso.GresoConfig(exempt_external=True), group_size=2, seed=0, pool_size=4, external=external)
        g.observe([GroupRecord(0, 7, [0.0, 0.0], [False, False], external=2)])
        assert g.streak[7] == streak


# ------------------------------------------------------------------------------------------ SERA


def test_sera_spends_the_budget_exactly_within_bounds():
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 12)
        p = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(n)]
        n_min, n_max = rng.randint(1, 3), rng.randint(4, 20)
        budget = rng.randint(n * n_min, n * n_max)
        sizes = sera.allocate(p, budget, n_min, n_max)
        assert sum(sizes) == budget and all(n_min <= s <= n_max for s in sizes), (p, budget, sizes)
    assert sera.allocate([0.5] * 3, 100, 2, 8) == [8] * 3  # more than the bounds allow: all at n_max
    assert sera.allocate([0.5] * 3, 2, 2, 8) == [2] * 3


def test_sera_gives_hard_prompts_more_and_shrinks_the_attenuation_spread():
    p = [0.05, 0.1, 0.3, 0.5, 0.8, 0.95]
    sizes = sera.allocate(p, 6 * 8, 2, 32)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 8 > sizes[-1]
    spread = lambda ns: max(sera.attenuation(q, n) for q, n in zip(p, ns)) - min(  # noqa: E731
        sera.attenuation(q, n) for q, n in zip(p, ns))
    assert spread(sizes) < spread([8] * 6) / 2
    # before clipping and rounding every prompt has the same attenuation 1 - e^-tau
    continuous = [sera.group_size_at(1.3, q, 1, 10 ** 6) for q in (0.1, 0.3, 0.6)]
    assert [(1 - q) ** (n - 1) for q, n in zip((0.1, 0.3, 0.6), continuous)] == pytest.approx([math.exp(-1.3)] * 3)


def test_sera_posterior_moves_only_at_epoch_boundaries_and_weights_are_n0_over_nq(make_rows):
    s = Sera(sera.SeraConfig(), group_size=4, seed=0, pool_size=4)
    assert s.success_rate(2) == 0.5
    s.observe([GroupRecord(1, 2, [1.0, 1.0, 1.0, 0.0], [True, True, True, False])])
    assert s.success_rate(2) == 0.5  # frozen within the epoch
    s.allocate(3, drawn([2, 3]), [4, 4])
    assert s.success_rate(2) == 0.5  # still epoch 0
    s.allocate(4, drawn([4, 5]), [4, 4])  # epoch 1 begins
    alpha, beta = 0.5 + 3, 0.5 + 1  # the evidence is discounted toward the prior: the prior itself stays
    assert s.success_rate(2) == pytest.approx(alpha / (alpha + beta))
    s.observe([GroupRecord(4, 5, [1.0, 0.0, 0.0, 0.0], [True, False, False, False])])  # epoch 1: another prompt
    s.allocate(8, drawn([8, 9]), [4, 4])  # epoch 2: no new evidence of 2, its old is discounted toward the prior
    alpha, beta = 0.5 + 0.75 * 3, 0.5 + 0.75 * 1
    assert s.success_rate(2) == pytest.approx(alpha / (alpha + beta))
    # a prompt whose group of n_max = 16 would almost surely be flat gets none
    s.posterior[9] = (200.0, 0.01)
    sizes = s.allocate(8, drawn([9, 10, 11], pool=100), [4, 4, 4])
    assert sizes[0] == 0 and sum(sizes) == 12
    from dllm_rl.collect import StepBatch

    batch = StepBatch(8, [None] * 2, ["a", "b"], [10, 11], [5, 7])
    batch.rows["on_policy"] = rows = make_rows("on_policy", 12, prompts=2)
    rows.prompt_N = torch.tensor([0] * 5 + [1] * 7)
    s.select(batch)
    assert rows.weight_N.tolist() == pytest.approx([4 / 5] * 5 + [4 / 7] * 7)


def test_sera_judges_activity_at_n_max_and_brings_inactive_prompts_back():
    """p = 0.02: a group of 4 is mixed with chance 0.078, of n_max = 16 with 0.28; at p = 0.001 even 16 give 0.016 <
    0.05: inactive, until its third inactive visit in a row; a step of only inactive prompts activates them all."""
    s = Sera(sera.SeraConfig(active_min=0.1), group_size=4, seed=0, pool_size=100)
    s.posterior[1] = (0.02, 0.98)  # p = 0.02: inactive judged at 4 (0.078 < 0.1), active at 16
    s.posterior[2], s.posterior[3] = (0.001, 0.999), (0.5, 0.5)
    assert sera.mixed_chance(0.02, 4) < 0.1 < sera.mixed_chance(0.02, 16)
    visits = [s.allocate(k, drawn([1, 2, 3]), [4, 4, 4]) for k in range(3)]
    assert [v[0] > 0 for v in visits] == [True] * 3
    assert [v[1] > 0 for v in visits] == [False, False, True]  # its third inactive visit: observed again
    assert all(sum(v) == 12 for v in visits)
    assert s.metrics() == {"curation/sera_inactive": 2.0, "curation/sera_revived": 1.0}
    twin = Sera(sera.SeraConfig(active_min=0.1), group_size=4, seed=0, pool_size=100)
    twin.load_state_dict(s.state_dict())
    assert twin.asleep == s.asleep
    s.posterior[4] = s.posterior[5] = (0.001, 0.999)
    assert s.allocate(3, drawn([4, 5]), [4, 4]) == [4, 4]  # every prompt inactive: the budget is still spent
    assert s.metrics()["curation/sera_revived"] == 2.0


# ------------------------------------------------------------------------------------------ DARTS


def test_darts_keeps_exactly_g_per_prompt_by_its_score(make_rows):
    from dllm_rl.collect import StepBatch

    d = Darts(darts.DartsConfig(delta=2), group_size=2, seed=0, pool_size=10)
    assert d.allocate(0, drawn([0, 1, 2]), [2, 0, 2]) == [4, 0, 4]
    batch = StepBatch(0, [None] * 2, ["a", "b"], [0, 2], [4, 4], [0, 2])
    rows = make_rows("on_policy", 8, C=4)
    rows.prompt_N = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    rows.prompt_id_N, rows.rollout_N = torch.tensor([0] * 4 + [2] * 4), torch.tensor([0, 1, 2, 3] * 2)
    # prompt 0: equal certainty, lengths 4, 1, 2, 3 -> the two shortest (rollouts 1, 2: the extras changed it)
    # prompt 2: equal lengths, certainty -1, -0.1, -2, -3 -> rollouts 0, 1 (the first G: unchanged)
    rows.mask_NC = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]] + [[1, 1, 0, 0]] * 4).float()
    certainty = torch.tensor([-0.5] * 4 + [-1.0, -0.1, -2.0, -3.0])
    rows.sampler_logp_NC = certainty[:, None].expand(8, 4).clone()
    batch.rows["on_policy"] = rows
    d.select(batch)
    kept = batch.rows["on_policy"]
    assert kept.keys == [(0, 1), (0, 2), (2, 0), (2, 1)] and d.changed == {0: True, 2: False}
    assert darts.keep_best([0.5, 0.5, 0.5], 2) == [0, 1]  # ties: the lower index
    records = d.annotate([GroupRecord(0, 0, [], []), GroupRecord(2, 2, [], [])])  # DARTS notes its own decision
    assert [r.changed for r in records] == [True, False] and d.changed == {}
    d.observe(records)
    assert d.delta == {0: 3, 2: 1}
    assert darts.next_delta(4, True, 0, 4) == 4 and darts.next_delta(0, False, 0, 4) == 0


# ------------------------------------------------------------------------------------------ dynamic sampling


def test_dynamic_sampling_never_exceeds_its_bound_and_fills_the_batch_when_it_allows():
    rng = random.Random(1)
    for trial in range(300):
        B, G, extra = rng.randint(1, 8), rng.randint(2, 6), rng.randint(0, 60)
        budget, rate = B * G + extra, rng.random()
        kept = generated = 0
        ask = B
        while ask:
            generated += ask * G
            kept += sum(rng.random() < rate for _ in range(ask))
            ask = dynamic_sampling.next_round(kept, B, generated, budget, G, 1.0)
        assert generated <= budget
        assert kept >= B or budget - generated < G  # stopped only when full or when no group is affordable
    assert dynamic_sampling.groups_to_keep([(5, True), (1, False), (3, True), (9, True)], 2) == {3, 5}


def test_curation_names_and_combinations_are_checked():
    assert check_curation({}) == [] and check_curation({"greso": {}, "dynamic_sampling": {}}) == ["greso",
                                                                                                 "dynamic_sampling"]
    with pytest.raises(ConfigError, match=r"curation=\[darts,sera\] do not compose"):
        check_curation({"sera": {}, "darts": {}})
    with pytest.raises(ConfigError, match=r"curation=\[dynamic_sampling,echo\] do not compose: dynamic sampling drops"):
        check_curation({"echo": {}, "dynamic_sampling": {}})
    with pytest.raises(ConfigError, match=r"curation=\[dynamic_sampling,sera\] do not compose"):
        check_curation({"sera": None, "dynamic_sampling": None})
    with pytest.raises(ConfigError, match="curation='grezo': expected none or any of greso"):
        check_curation({"grezo": {}})
    with pytest.raises(ConfigError, match="curation.sera.n_max=1: expected null or >= n_min"):
        check_curation({"sera": {"n_max": 1}})
    none = build_curation({}, group_size=3, prompts_per_step=2, seed=0, pool_size=5)
    none.begin()
    assert not none.on and none.allocate(0, drawn([0, 1])) == [3, 3] and none.metrics() == {}


def test_dynamic_sampling_stops_after_max_rounds_when_every_prompt_is_skipped():
    """With GRESO skipping every prompt, rounds generate nothing: max_rounds ends the step."""
    cur = build_curation({"greso": {}, "dynamic_sampling": {"max_rounds": 3}}, group_size=2, prompts_per_step=2,
                         seed=0, pool_size=100)
    cur.strategies[0].streak = {q: 60 for q in range(100)}  # skip probability 1 - floor
    cur.strategies[0].p = {"easy": 0.05, "hard": 0.05}
    cur.strategies[0].config = greso.GresoConfig(floor=0.0)
    cur.begin()
    rounds, ids = 0, iter(range(100))
    ask = 2
    while ask:
        rounds += 1
        assert cur.allocate(0, drawn([next(ids) for _ in range(ask)])) == [0] * ask
        ask = cur.more([])
    assert rounds == 3 and cur.metrics()["curation/rounds"] == 3


# ------------------------------------------------------------------------------------------ GRPODropout


def test_grpo_dropout_on_a_hand_computed_group():
    """A = (0.5, 0.5, -0.5, -0.5), s = (0.1, 0.5, 0.5, 0.3): mean s 0.35, h = A/4 (s - 0.35) = (-0.03125, 0.01875,
    -0.01875, 0.00625), sum -0.025 < 0; the most negative h of a positive rollout is rollout 0's, dropping it
    leaves 0.00625 >= 0. Recentred with w = exp(-s) over the kept: mean (0.5 w1 - 0.5 w2 - 0.5 w3) / (w1 + w2 + w3)
    = -0.18958."""
    adv, s = torch.tensor([0.5, 0.5, -0.5, -0.5]), torch.tensor([0.1, 0.5, 0.5, 0.3])
    assert grpo_dropout.contributions(adv, s).tolist() == pytest.approx([-0.03125, 0.01875, -0.01875, 0.00625])
    keep = grpo_dropout.keep_mask(adv, s)
    assert keep.tolist() == [False, True, True, True]
    assert float(grpo_dropout.contributions(adv, s)[keep].sum()) == pytest.approx(0.00625)
    w = torch.exp(-s)
    mean = float((0.5 * w[1] - 0.5 * w[2] - 0.5 * w[3]) / (w[1] + w[2] + w[3]))
    assert float(mean) == pytest.approx(-0.18958, abs=1e-5)
    assert grpo_dropout.recentred(adv, s, keep).tolist() == pytest.approx([0.0, 0.5 - mean, -0.5 - mean, -0.5 - mean])
    assert grpo_dropout.surprisal(torch.tensor([[-1.0, -3.0, -9.0]]), torch.tensor([[1, 1, 0]])).tolist() == [2.0]


def paper_keep(adv, s):
    """GRPODropout's rule written out slowly: h over the whole group; remove rollouts of any sign by ascending h
    while the kept h sum below 0; restore the removed rollouts with A <= 0."""
    G = len(adv)
    h = [float(adv[g]) / G * (float(s[g]) - float(s.mean())) for g in range(G)]
    removed, kept_sum = set(), sum(h)
    for g in sorted(range(G), key=lambda g: (h[g], g)):
        if kept_sum >= 0 or h[g] >= 0:
            break
        removed.add(g)
        kept_sum -= h[g]
    return [not (g in removed and float(adv[g]) > 0) for g in range(G)]


def test_grpo_dropout_removes_by_h_of_any_sign_and_restores_the_non_positive():
    """The issue's case: A = (1, 1, -1, -1), s = (0.3, 0.5, 0.9, 0.3): h = (-0.05, 0, -0.1, 0.05), sum -0.1.
    Removing the most negative h, a negative rollout's, brings the sum to 0: removal stops, the negative rollout is
    restored, and nothing is dropped (a positive-only rule would drop rollout 0)."""
    adv, s = torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.tensor([0.3, 0.5, 0.9, 0.3])
    assert grpo_dropout.contributions(adv, s).tolist() == pytest.approx([-0.05, 0.0, -0.1, 0.05])
    assert grpo_dropout.keep_mask(adv, s).tolist() == [True] * 4
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        G = int(torch.randint(2, 9, (1,), generator=g))
        rewards = torch.randint(0, 2, (G,), generator=g).float()
        adv, s = rewards - rewards.mean(), torch.rand(G, generator=g) * 3
        keep = grpo_dropout.keep_mask(adv, s)
        assert keep.tolist() == paper_keep(adv, s)
        assert bool((adv[~keep] > 0).all())  # only positive rollouts are dropped
        if not bool(keep.all()):
            new, w = grpo_dropout.recentred(adv, s, keep), torch.exp(-s) * keep
            assert float((w * new).sum()) == pytest.approx(0.0, abs=1e-6) and bool((new[~keep] == 0).all())
        if bool((rewards == rewards[0]).all()):
            assert bool(keep.all())  # a flat group: zero advantages, nothing to drop


def test_grpo_dropout_reweights_whole_groups_of_a_batch(make_rows):
    from dllm_rl.collect import StepBatch

    d = build_curation({"grpo_dropout": {}}, group_size=4, prompts_per_step=2, seed=0, pool_size=10)
    d.begin()
    batch = StepBatch(0, [None] * 2, ["a", "b"], [0, 1], [4, 4])
    rows = make_rows("on_policy", 8, prompts=2, C=2)
    rows.adv_N = torch.tensor([0.5, 0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0])  # the second group is flat
    s = torch.tensor([0.1, 0.5, 0.5, 0.3, 0.1, 0.2, 0.3, 0.4])
    rows.sampler_logp_NC = -s[:, None].expand(8, 2).clone()
    rows.weight_N = torch.full((8,), 2.0)
    batch.rows["on_policy"] = rows
    d.reweight(batch)
    assert rows.weight_N.tolist() == [0.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert rows.adv_N[:4].tolist() == pytest.approx(grpo_dropout.recentred(torch.tensor([0.5, 0.5, -0.5, -0.5]), s[:4],
                                                                           torch.tensor([0, 1, 1, 1]).bool()).tolist())
    assert rows.adv_N[4:].tolist() == [0.0] * 4
    assert batch.metrics["curation/dropout_dropped"] == 1.0 and batch.metrics["curation/dropout_positive"] == 2.0
    assert check_curation({"grpo_dropout": {}}) == ["grpo_dropout"]


def test_greso_closes_an_epoch_once_with_every_group_when_a_later_round_draws_the_next():
    """Dynamic sampling's second round draws from the next epoch before the step's groups are observed: the epoch
    closes at the next step's first round, once, from all its groups."""
    c = greso.GresoConfig()
    g = Greso(c, group_size=2, seed=0, pool_size=4)
    hard = dict(rewards=[0.0, 0.0], correct=[False, False])
    mixed = dict(rewards=[1.0, 0.0], correct=[True, False])
    g.allocate(1, drawn([0, 1]), [2, 2])
    g.observe([GroupRecord(0, 0, **hard), GroupRecord(1, 1, **hard)])
    g.allocate(2, drawn([2, 3]), [2, 2])  # step 2, round 1: epoch 0
    g.allocate(2, drawn([4, 5]), [2, 2])  # round 2: epoch 1 already, epoch 0's last groups not yet observed
    assert g.p == {"easy": c.p_start, "hard": c.p_start}
    g.observe([GroupRecord(q, q, **mixed) for q in (2, 3, 4, 5)])
    g.allocate(3, drawn([6, 7]), [2, 2])  # epoch 0 closes with its 4 groups: 2 hard flat, 0 easy flat
    assert g.p["hard"] == pytest.approx(greso.adapt(c.p_start, 2 / 4, c.target * (1 - c.easy_share), c.step,
                                                    c.p_min, c.p_max))
    assert g.p["easy"] == pytest.approx(greso.adapt(c.p_start, 0.0, c.target * c.easy_share, c.step, c.p_min,
                                                    c.p_max))
    assert 0 not in g.epochs
