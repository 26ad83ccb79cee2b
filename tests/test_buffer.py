"""The step buffer's minibatch plan and loss-input assembly across sources."""

import torch

from dllm_rl.buffer import loss_inputs, minibatch_plan, num_minibatches


def test_stratified_plan_spreads_every_source_over_the_minibatches():
    plan = minibatch_plan([48, 16], 2, "stratified", torch.Generator().manual_seed(0))
    assert [[len(p) for p in mb] for mb in plan] == [[24, 8], [24, 8]]
    for part, n in enumerate([48, 16]):  # every row once
        assert sorted(torch.cat([mb[part] for mb in plan]).tolist()) == list(range(n))


def test_mixed_plan_covers_every_row_once():
    plan = minibatch_plan([10, 5], 3, "mixed", torch.Generator().manual_seed(0))
    assert sum(len(p) for mb in plan for p in mb) == 15
    for part, n in enumerate([10, 5]):
        assert sorted(torch.cat([mb[part] for mb in plan]).tolist()) == list(range(n))
    assert num_minibatches(48, 48) == 1 and num_minibatches(48, 20) == 3


class Part:
    """A stand-in for Rows: scores are fixed tensors, so the assembly can be checked by hand."""

    def __init__(self, logp, adv, weight, shaped):
        self.logp, self.adv_N, self.weight_N, self.shaped = logp, adv, weight, shaped
        self.ref_logp = []

    def score(self, policy, rows, iteration, lockstep=None, span=None):
        return self.logp[rows], torch.ones_like(self.logp[rows])


def test_loss_inputs_pad_sources_to_one_width():
    on = Part(torch.full((3, 4), -1.0), torch.tensor([1.0, 0.0, -1.0]), None, False)
    ext = Part(torch.full((2, 1), -5.0), torch.tensor([2.0, 2.0]), torch.tensor([0.5, 0.5]), True)  # per sequence
    inputs = loss_inputs([on, ext], [torch.tensor([0, 2]), torch.tensor([1])], None, 0, reuse_current=True)
    assert inputs["logp_NC"].tolist() == [[-1.0] * 4, [-1.0] * 4, [-5.0, 0.0, 0.0, 0.0]]
    assert inputs["mask_NC"].tolist() == [[1.0] * 4, [1.0] * 4, [1.0, 0.0, 0.0, 0.0]]
    assert inputs["adv_N"].tolist() == [1.0, -1.0, 2.0] and inputs["weights_N"].tolist() == [1.0, 1.0, 0.5]
    assert inputs["shaped_N"].tolist() == [False, False, True] and inputs["ref_logp_NC"] is None
    assert torch.equal(inputs["old_logp_NC"], inputs["logp_NC"])


def test_pad_empty_scores_a_stand_in_row_that_counts_for_nothing():
    on = Part(torch.full((3, 4), -1.0), torch.tensor([1.0, 0.0, -1.0]), None, False)
    ext = Part(torch.full((2, 4), -5.0), torch.tensor([2.0, 2.0]), None, False)
    picks = [torch.tensor([0, 2]), torch.tensor([], dtype=torch.long)]
    inputs = loss_inputs([on, ext], picks, None, 0, reuse_current=True)
    assert inputs["logp_NC"].shape == (2, 4)
    padded = loss_inputs([on, ext], picks, None, 0, reuse_current=True, pad_empty=True)
    assert padded["logp_NC"].shape == (3, 4)
    assert padded["mask_NC"][2].sum() == 0 and padded["weights_N"][2] == 0
    from dllm_rl.algo.losses import grpo_loss

    for how in ("token", "sequence", "constant"):  # the stand-in row changes neither the loss nor its normaliser
        a, _ = grpo_loss(**inputs, aggregation=how, constant=4)
        b, _ = grpo_loss(**padded, aggregation=how, constant=4)
        assert torch.allclose(a, b)


def test_loss_weights_are_named_factors_whose_product_does_not_depend_on_the_writers_order(make_rows):
    """SERA's multiplicity, GRPODropout's keep, the bandit's pick and the sampler correction, written in every
    order: the same weights to the bit. Multiplied in the order written, some orders round differently (the test
    would catch a writer that multiplied in place again)."""
    import itertools

    g = torch.Generator().manual_seed(0)
    factors = {"sera": torch.rand(64, generator=g) * 2, "dropout": (torch.rand(64, generator=g) > 0.2).float(),
               "bandit": torch.rand(64, generator=g), "sampler_correction": torch.rand(64, generator=g) * 3}
    weights, naive = set(), set()
    for order in itertools.permutations(factors):
        rows = make_rows("on_policy", 64)
        product = torch.ones(64)
        for name in order:
            rows.weigh(name, factors[name])
            product = product * factors[name]
        weights.add(tuple(rows.weight_N.tolist()))
        naive.add(tuple(product.tolist()))
        assert set(rows.factors) == set(factors)
    assert len(weights) == 1 and len(naive) > 1


def test_weight_factors_follow_rows_through_select_and_concat(make_rows):
    from dllm_rl.buffer import concat_rows

    a, b = make_rows("on_policy", 4), make_rows("on_policy", 2)
    a.weigh("sera", torch.tensor([0.5, 1.0, 2.0, 4.0]))
    a.weigh("sera", torch.tensor([2.0, 2.0, 2.0, 2.0]))  # a factor written twice multiplies
    b.weight_N = torch.zeros(2)  # set directly (a stand-in row): its factor `base`
    merged = concat_rows([a, b], pad_id=0)
    assert merged.factors["sera"].tolist() == [1.0, 2.0, 4.0, 8.0, 1.0, 1.0]
    assert merged.factors["base"].tolist() == [1.0] * 4 + [0.0] * 2
    assert merged.weight_N.tolist() == [1.0, 2.0, 4.0, 8.0, 0.0, 0.0]
    picked = merged.select(torch.tensor([False, True, False, True, True, False]))
    assert picked.factors["sera"].tolist() == [2.0, 8.0, 1.0] and picked.weight_N.tolist() == [2.0, 8.0, 0.0]
    picked.weigh("bandit", torch.tensor([1.0, 0.0, 1.0]))
    assert picked.weight_N.tolist() == [2.0, 0.0, 0.0]


def test_each_weight_factor_is_logged_with_its_share_of_zeros(make_rows):
    from dllm_rl.data.task import Reward
    from dllm_rl.stages import source_metrics

    rows = make_rows("on_policy", 4)
    rows.rewards, rows.adv_N = [Reward(1.0, True, True, "ok")] * 4, torch.zeros(4)
    rows.weigh("dropout", torch.tensor([1.0, 0.0, 1.0, 1.0]))
    rows.weigh("sera", torch.tensor([0.5, 0.5, 1.5, 1.5]))
    metrics = source_metrics(rows)
    assert metrics["weight/on_policy/dropout"] == 0.75 and metrics["weight/on_policy/dropout_zeros"] == 0.25
    assert metrics["weight/on_policy/sera"] == 1.0 and metrics["weight/on_policy/sera_zeros"] == 0.0
