"""The contextual rollout bandit with replay: the scorer by hand, the selection and its entropy guard, the buffer's
age cap and capacity, deterministic choices, per-row clip counts, and a run that replays rows."""

import json

import pytest
import torch

from dllm_rl.curation import build_curation
from dllm_rl.curation.bandit import BanditConfig, Candidate, LinearScorer, kept, select
from dllm_rl.curation.replay import ReplaySource
from dllm_rl.data.task import Reward
from dllm_rl.errors import ConfigError
from dllm_rl.train import train
from tests.conftest import DigitPass
from tests.test_micro_batches import learner_of, step_of
from tests.test_stages import ARITHMETIC, MEAN_FIELD, batch_of


def test_the_scorer_is_ridge_regression_with_linucbs_width_by_hand():
    scorer = LinearScorer(2, ridge=1.0, alpha=0.0)
    scorer.update([[1.0, 0.0], [1.0, 1.0]], reward=2.0)
    # A = I + [[2, 1], [1, 1]] = [[3, 1], [1, 2]], b = 2 * [2, 1] = [4, 2]; theta = A^-1 b = [6/5, 2/5]
    assert scorer.scores([[1.0, 0.0], [0.0, 1.0]]) == pytest.approx([6 / 5, 2 / 5])
    scorer.alpha = 2.0  # + 2 sqrt(x' A^-1 x): A^-1 = [[2, -1], [-1, 3]] / 5
    assert scorer.scores([[1.0, 0.0], [0.0, 1.0]]) == pytest.approx([6 / 5 + 2 * (2 / 5) ** 0.5,
                                                                     2 / 5 + 2 * (3 / 5) ** 0.5])
    again = LinearScorer(2, 1.0, 2.0)
    again.load_state_dict(scorer.state_dict())
    assert again.scores([[0.3, 0.7]]) == scorer.scores([[0.3, 0.7]])


def cand(source, key, entropy):
    return Candidate(source, key, [1.0], entropy)


def test_selection_takes_the_best_scores_then_keeps_the_entropy_up():
    c = [cand("on_policy", (0, 0), 1.0), cand("on_policy", (0, 1), 0.2), cand("replay", (0, 0), 0.1),
         cand("on_policy", (1, 0), 2.0)]
    assert select(c, [0.5, 0.9, 0.9, 0.1], 2, guard=0.0) == [1, 2]  # equal scores: on_policy before replay
    # the candidates' mean entropy is 0.825; picks 1 and 2 average 0.15 < 0.9 * 0.825: the lowest-entropy dLLM
    # pick (the replayed 2) goes for the highest-entropy left out (3), then the mean 1.1 holds
    assert select(c, [0.5, 0.9, 0.9, 0.1], 2, guard=0.9) == [1, 3]
    external = [cand("external", (0, 0), 0.0), cand("on_policy", (0, 0), 1.0)]
    assert select(external, [1.0, 0.0], 1, guard=0.9) == [0]  # an external row (no entropy record) is never swapped
    assert select(c, [0.0] * 4, 4, guard=0.9) == [0, 1, 2, 3]


def test_the_buffer_keeps_young_rows_up_to_its_capacity():
    entries = [{"key": [q, 0], "version": v} for q, v in ((5, 3), (1, 0), (2, 1), (3, 2), (4, 3))]
    assert [e["key"][0] for e in kept(entries, step=3, capacity=10, max_age=2)] == [3, 4, 5]  # ages 0 and 1
    assert [e["key"][0] for e in kept(entries, step=3, capacity=2, max_age=4)] == [4, 5]  # the newest two
    assert kept(entries, step=3, capacity=0, max_age=4) == []
    with pytest.raises(ConfigError, match="curation.bandit.max_age must be >= 1"):
        BanditConfig(max_age=0)
    with pytest.raises(ConfigError, match="curation.bandit.scorer must be one of"):
        BanditConfig(scorer="mlp")


def bandit_batch(make_rows, step):
    batch = batch_of(ARITHMETIC.examples("train", 2, 0), first_id=2 * step, step=step, sizes=[2, 2])
    on = make_rows("on_policy", 4, prompts=2, C=4)
    on.prompt_id_N = on.prompt_N + 2 * step
    on.version, on.order_NC = step, torch.tensor([[0, 1, 2, 3]] * 4)
    on.sampler_logp_NC = -torch.rand(4, 4, generator=torch.Generator().manual_seed(step))
    on.entropy_NC = torch.tensor([[0.5, 1.0, 0.2, 0.1], [0.1] * 4, [2.0] * 4, [0.3] * 4]) + step
    on.rewards = [Reward(float(r), r == 1, True, "ok") for r in (1, 0, 1, 1)]
    on.adv_N = torch.tensor([1.0, -1.0, 0.0, 0.0])
    on.mask_seeds = [[7, 8, 9, 10]]
    batch.rows["on_policy"] = on
    return batch


def test_the_bandit_decides_alike_from_the_same_state_and_replays_within_its_caps(make_rows):
    def run(steps):
        probes = iter([0.0, 0.1, 0.05, 0.3, 0.2, 0.4])
        curation = build_curation({"bandit": {"capacity": 3, "max_age": 2, "rows": 3}}, group_size=2,
                                  prompts_per_step=2, seed=0, pool_size=8, probe=lambda: next(probes))
        source = ReplaySource(curation, MEAN_FIELD, pad_id=0, rank=0, world=1)
        out = []
        for step in range(steps):
            batch = bandit_batch(make_rows, step)
            curation.reweight(batch)  # the bandit decides (its state) ...
            assert "replay" not in batch.rows
            source(batch)  # ... and the replay stage makes the rows
            replay = batch.rows.get("replay")
            if replay is not None:  # each row's provenance: the rollout it was, the version that made it
                assert replay.source == "replay" and replay.estimator is MEAN_FIELD
                assert replay.version_N.tolist() == [q // 2 for q, _ in replay.keys]
                assert replay.version == min(replay.version_N.tolist())
            out.append((batch.rows["on_policy"].weight_N.tolist(), None if replay is None else replay.keys,
                        dict(batch.metrics)))
            curation.after_update(batch)
            buffer = curation.strategies[0].buffer
            assert len(buffer) <= 3 and all(step - e["version"] < 2 for e in buffer)
        return out, curation.state_dict()
    first, state = run(4)
    again, same = run(4)
    assert first == again and state == same  # deterministic
    assert all(sum(w) + (len(keys) if keys else 0) == 3 for w, keys, _ in first)  # 3 rows reach the loss
    assert any(keys for _, keys, _ in first[1:])  # some replayed rows
    for step, (_, keys, metrics) in enumerate(first):
        if keys:  # replayed rows are from earlier steps, at most max_age old
            assert all(0 < step - q // 2 <= 2 for q, _ in keys) and metrics["curation/bandit_age_mean"] > 0


def test_the_learner_counts_each_rows_clipped_and_counted_tokens(make_dllm, make_rows):
    learner = learner_of(make_dllm(), 0, 0, {"eps_low": 0.2, "eps_high": 0.2})
    batch = step_of(learner, make_rows)
    batch.rows["on_policy"].old_logp[1] = batch.rows["on_policy"].old_logp[1] - 1.0  # ratios far from 1: clipping
    learner.update(batch)
    on = batch.rows["on_policy"]
    assert on.clip_counts_N2[:, 1].tolist() == (2 * on.mask_NC.sum(-1)).tolist()  # two inner iterations
    assert (on.clip_counts_N2[:, 0] <= on.clip_counts_N2[:, 1]).all() and on.clip_counts_N2[:, 0].sum() > 0


def test_a_bandit_run_replays_rows_and_resumes_exactly(saved_model, tmp_path):
    options = dict(model=saved_model, curation={"bandit": {"capacity": 8, "max_age": 2}},
                   rollout={"gen_length": 32, "block_length": 16, "steps": 16, "temperature": 1.0},
                   external={"name": "none"}, prompts_per_step=4, group_size=2, minibatch_size=8, train_pool=4,
                   eval_every=0, sample_every=0, tensorboard=False, bf16=False, lr=1e-3, checkpoint_every=2,
                   print_fn=lambda *_: None)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(DigitPass(), run_dir=str(straight), steps=4, **options)
    train(DigitPass(), run_dir=str(resumed), steps=2, **options)
    train(DigitPass(), resume=str(resumed), steps=4, **options)
    lines = [[{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
              for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (straight, resumed)]
    assert lines[0] == lines[1]
    assert sum(m["curation/bandit_replayed"] for m in lines[0]) > 0
    assert all(m["curation/bandit_buffer"] <= 8 for m in lines[0])
    state = torch.load(resumed / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=True)["state"]
    assert len(state["curation"]["bandit"]["buffer"]) == 8 and state["curation"]["bandit"]["last_probe"] is not None


def test_rows_an_earlier_strategy_dropped_are_neither_picked_nor_replayed(make_rows):
    """GRPODropout acts first however the strategies are listed; a row it dropped (weight 0) is no candidate of the
    bandit and never enters its replay buffer."""
    curation = build_curation({"bandit": {"capacity": 8, "max_age": 4}, "grpo_dropout": {}}, group_size=2,
                              prompts_per_step=2, seed=0, pool_size=8, probe=lambda: 0.0)
    assert curation.names == ["grpo_dropout", "bandit"]
    bandit = curation.strategies[1]
    batch = bandit_batch(make_rows, 0)
    on = batch.rows["on_policy"]
    on.weight_N = torch.tensor([0.0, 1.0, 1.0, 1.0])  # as GRPODropout leaves a dropped rollout
    dropped = on.keys[0]
    bandit.reweight(batch)
    assert batch.metrics["curation/bandit_picked"] == 3.0  # the three rows left, all picked (no buffer yet)
    assert on.weight_N.tolist() == [0.0, 1.0, 1.0, 1.0]
    bandit.after_update(batch)
    assert [tuple(e["key"]) for e in bandit.buffer] == [tuple(k) for k in on.keys[1:]]
    assert tuple(dropped) not in {tuple(e["key"]) for e in bandit.buffer}
