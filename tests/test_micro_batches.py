"""A minibatch back-propagated in pieces (`micro_batch_rows`, `micro_batch_forwards`): the spans of an ordered
estimator's forwards add up to its whole value, and a learner that accumulates its gradient over pieces makes the
update that one backward over the whole minibatch makes, with the same metrics; a non-finite piece discards what
had accumulated."""

import contextlib
import dataclasses

import pytest
import torch

from dllm_rl.buffer import piece_spans
from dllm_rl.data.task import Reward
from dllm_rl.data_parallel import DataParallel
from dllm_rl.engine import Engine, deepspeed_config, init_distributed
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.lockstep import counting_forwards
from dllm_rl.learner import Learner
from dllm_rl.stages import assign_advantages, score_old_and_reference
from tests.test_stages import ARITHMETIC, batch_of


def test_piece_spans_cover_every_forward_once():
    assert piece_spans(5, 2) == [(0, 2), (2, 4), (4, 6)]
    assert piece_spans(4, 4) == [(0, 4)] and piece_spans(0, 3) == [(0, 3)]  # a row without forwards: one span


@pytest.mark.parametrize("config", [{"name": "left_to_right", "group": 1}, {"name": "left_to_right", "group": 3},
                                    {"name": "ordered", "group": 1}, {"name": "ordered", "group": 2}])
def test_spans_add_up_to_the_whole_estimate_in_their_declared_forwards(tiny_policy, config):
    estimator = build_estimator(config)
    g = torch.Generator().manual_seed(0)
    N, P, C = 3, 4, 7
    ids_NL = torch.randint(5, 20, (N, P + C), generator=g)
    attention_NL = torch.ones_like(ids_NL)
    mask_NC = torch.ones(N, C)
    mask_NC[1, 5:] = 0
    order_NC = torch.stack([torch.randperm(C, generator=g) // 2 for _ in range(N)])  # two tokens a step, ragged
    order_NC[2] = order_NC[2] + 3  # one row starts later: steps no row uses are skipped
    whole_NC, _ = estimator.score(tiny_policy, ids_NL, attention_NL, P, None, order_NC, mask_NC)
    calls = estimator.logits_calls(order_NC, C)
    total_NC, covered_NC, made = torch.zeros(N, C), torch.zeros(N, C), 0
    for span in piece_spans(calls, 2):
        with counting_forwards(tiny_policy.model) as count:
            logp_NC, in_span_NC = estimator.score(tiny_policy, ids_NL, attention_NL, P, None, order_NC, mask_NC,
                                                  span=span)
        assert count[0] == estimator.forwards(tiny_policy, attention_NL, P, order_NC, span)
        made += count[0]
        total_NC += logp_NC * in_span_NC
        covered_NC += in_span_NC
    assert made == calls and torch.equal(covered_NC, mask_NC)  # every counted token in exactly one span
    torch.testing.assert_close(total_NC, whole_NC * mask_NC, atol=1e-6, rtol=0)


def test_an_estimator_without_spans_refuses_one(tiny_policy):
    ids_NL = torch.randint(5, 20, (2, 6))
    with pytest.raises(ValueError, match="'elbo' estimator cannot score a span"):
        build_estimator({"name": "elbo"}).logp(tiny_policy, ids_NL, torch.ones_like(ids_NL), 3, seeds_N=[1, 2],
                                               span=(0, 1))


def learner_of(policy, rows: int, forwards: int, loss_options: dict) -> Learner:
    """A one-process learner with plain SGD (its update is the gradient, so updates compare exactly)."""
    net = policy.model.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = Engine(net, optimizer, init_distributed(), deepspeed_config(stage=0, micro_batch_size=6))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return Learner(engine, dataclasses.replace(policy, model=engine.ds), None, scheduler, loss_options, iterations=2,
                   reuse_current=False, minibatch_mix="stratified", seed=0,
                   dp=DataParallel(init_distributed(), 2, 3, 6),
                   autocast=contextlib.nullcontext(), micro_rows=rows, micro_forwards=forwards)


def step_of(learner: Learner, make_rows) -> object:
    """Two prompts of three left-to-right rollouts (ragged lengths) and two ELBO-scored external rows, their
    advantages and old log-probs under `learner`'s policy."""
    batch = batch_of(ARITHMETIC.examples("train", 2, 0), sizes=[3, 3])
    on = make_rows("on_policy", 6, prompts=2, C=5, estimator=build_estimator({"name": "left_to_right", "group": 1}))
    on.mask_NC[0, 3:], on.mask_NC[4, 1:] = 0, 0
    ext = make_rows("external", 2, prompts=2, C=5, estimator=build_estimator({"name": "elbo", "num_masks": 2}))
    for rows, rewards in ((on, [1, 0, 0, 1, 1, 0]), (ext, [1, 1])):
        rows.rewards = [Reward(float(r), r == 1, True, "ok") for r in rewards]
    batch.rows.update(on_policy=on, external=ext)
    assign_advantages(batch, "mean", None, learner.dp)
    ext.adv_N, ext.weight_N = torch.tensor([1.0, 0.5]), torch.tensor([0.5, 1.0])
    learner.dp.shard_sources(batch.rows, {"on_policy": on.estimator, "external": ext.estimator})
    score_old_and_reference(batch, learner.policy, None, 2, False, 0, contextlib.nullcontext())
    return batch


@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
@pytest.mark.parametrize("rows, forwards", [(1, 0), (2, 2), (0, 1), (4, 3)])
def test_pieces_make_the_whole_minibatch_update(make_dllm, make_rows, aggregation, rows, forwards):
    options = {"eps_low": 0.2, "eps_high": 0.2, "aggregation": aggregation, "constant": 5.0}
    whole, pieces = learner_of(make_dllm(), 0, 0, options), learner_of(make_dllm(), rows, forwards, options)
    metrics = []
    for learner in (whole, pieces):
        batch = step_of(learner, make_rows)
        batch.rows["on_policy"].old_logp[1] = batch.rows["on_policy"].old_logp[1] - 0.1  # ratios away from 1
        metrics.append(learner.update(batch))
    assert metrics[0]["policy/updates"] == metrics[1]["policy/updates"] == 2.0
    for key in metrics[0]:
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-6), key
    moved = 0.0
    for a, b, start in zip(whole.engine.module.parameters(), pieces.engine.module.parameters(),
                           make_dllm().model.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
        moved += float((a - start).abs().sum())
    assert moved > 1e-3  # the update moved the weights


def test_a_non_finite_piece_discards_the_gradient_accumulated_before_it(make_dllm, make_rows):
    options = {"eps_low": 0.2, "eps_high": 0.2}
    learner, fresh = learner_of(make_dllm(), 1, 0, options), learner_of(make_dllm(), 1, 0, options)
    batch = step_of(learner, make_rows)
    learner.iterations = fresh.iterations = 1
    ext = batch.rows["external"]
    kept = ext.old_logp[0].clone()
    ext.old_logp[0][1, 0] = float("nan")  # an external row's piece: after the six on-policy rows' pieces
    start = [p.detach().clone() for p in learner.engine.module.parameters()]
    with pytest.warns(UserWarning, match="non-finite loss"):
        assert learner.update(batch)["policy/updates"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(start, learner.engine.module.parameters()))
    ext.old_logp[0] = kept
    assert learner.update(batch)["policy/updates"] == 1.0  # nothing left over from the discarded pieces
    assert fresh.update(step_of(fresh, make_rows))["policy/updates"] == 1.0
    for a, b in zip(learner.engine.module.parameters(), fresh.engine.module.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_part_without_rows_in_a_minibatch_gets_no_pass(make_rows):
    """With more minibatches than external rows, some minibatch holds none: no pass for that part (one process),
    and the on-policy rows are cut by rows and by spans of forwards."""
    on = make_rows("on_policy", 3, C=5, estimator=build_estimator({"name": "left_to_right", "group": 1}))
    ext = make_rows("external", 2, C=5, estimator=build_estimator({"name": "elbo"}))
    dp = DataParallel(init_distributed(), 1, 3, 3)
    pieces = dp.pieces([on, ext], [torch.tensor([2, 0]), torch.tensor([], dtype=torch.long)], rows=1, forwards=2)
    assert [(p.parts, p.rows[0].tolist(), p.spans) for p in pieces] == \
        [((0,), [2], ((a, a + 2),)) for a in (0, 2, 4)] + [((0,), [0], ((a, a + 2),)) for a in (0, 2, 4)]
    assert all(p.share == pytest.approx(1 / 3) for p in pieces)
    whole = dp.pieces([on, ext], [torch.tensor([2, 0]), torch.tensor([1])])
    assert len(whole) == 1 and whole[0].parts == (0, 1) and whole[0].spans == (None, None)
    ext_only = dp.pieces([on, ext], [torch.tensor([], dtype=torch.long), torch.tensor([0, 1])], rows=0, forwards=2)
    assert [(p.parts, p.rows[0].tolist(), p.spans) for p in ext_only] == [((1,), [0, 1], (None,))]  # no spans: ELBO
