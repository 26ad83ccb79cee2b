"""Turns as training rows (dllm_rl/envs/episodes.py): episodes played by a tiny dLLM, each turn one canvas keyed by
(prompt id, rollout * max_turns + turn), kept as sampled; no estimator masks a context position of a turn row; a
row's score does not depend on the turns around it; advantages per turn from the episodes."""

import contextlib

import pytest
import torch

from dllm_rl.algo.advantages import group_advantages
from dllm_rl.collect import InProcessRollouts
from dllm_rl.envs.episodes import episode_advantages, play_episodes, split_key, turn_prompt
from dllm_rl.likelihood.estimators import ESTIMATORS, build_estimator
from dllm_rl.rollout.generate import TextGenerator
from tests.conftest import Counter

MEAN_FIELD = build_estimator({"name": "mean_field"})


def played(tiny_policy, char_tokenizer, starts=((0, 10, 7), (1, 11, 8)), group_size=3, temperature=1.0):
    generator = TextGenerator(tiny_policy, char_tokenizer, gen_length=8, block_length=8, steps=4,
                              temperature=temperature)
    rollouts = InProcessRollouts(generator, MEAN_FIELD, seed=5, inference=contextlib.nullcontext)
    return play_episodes(rollouts, Counter, list(starts), group_size, step=2, pad_id=char_tokenizer.pad_token_id)


def test_turn_rows_are_keyed_by_episode_and_turn_and_kept_as_sampled(tiny_policy, char_tokenizer):
    rows, episodes = played(tiny_policy, char_tokenizer)
    assert len(episodes) == 6 and len(rows) == sum(len(ep.turns) for ep in episodes)
    assert len(set(rows.keys)) == len(rows) and rows.sampler_logp_NC is not None and rows.order_NC is not None
    by_episode = {(ep.prompt_id, ep.rollout): ep for ep in episodes}
    for n, (q, k) in enumerate(rows.keys):
        g, t = split_key(k, Counter.max_turns)
        ep = by_episode[q, g]
        seen, text = ep.records[t]
        context = rows.ids_NL[n, : rows.prompt_length][rows.attention_mask_NL[n, : rows.prompt_length] != 0]
        assert char_tokenizer.decode(context.tolist()) == turn_prompt("Reach 3.", ep.records[:t], seen)
        assert rows.texts[n] == text  # the action the environment got is the decoded window
        assert rows.rewards[n].correct == ep.success
    for q in (10, 11):  # a group's episodes start from one environment seed
        assert len({by_episode[q, g].records[0][0] for g in range(3)}) == 1
    # each turn draws from its own seed: one group alone samples the same turn rows
    alone, _ = played(tiny_policy, char_tokenizer, starts=((0, 11, 8),))
    whole = {key: rows.ids_NL[n, rows.prompt_length:] for n, key in enumerate(rows.keys)}
    assert all(torch.equal(alone.ids_NL[n, alone.prompt_length:], whole[key]) for n, key in enumerate(alone.keys))
    assert {ep.success or ep.truncated for ep in episodes} == {True}  # every episode ended, by its rules


def test_the_history_keeps_the_last_k_records():
    records = [("n=0", "up"), ("n=1", "up"), ("n=2", "x")]
    assert turn_prompt("Reach 3.", records, "n=2", keep=2) == \
        "Reach 3.\nObservation: n=1\nAction: up\nObservation: n=2\nAction: x\nObservation: n=2\nAction: "
    assert turn_prompt("Reach 3.", records, "n=2", keep=0) == "Reach 3.\nObservation: n=2\nAction: "


ESTIMATOR_CONFIGS = [{"name": name} for name in ESTIMATORS] + [{"name": "elbo", "masking": "fixed_count"}]


@pytest.mark.parametrize("config", ESTIMATOR_CONFIGS, ids=lambda c: "_".join(map(str, c.values())))
def test_no_estimator_masks_a_context_position_of_a_turn_row(tiny_policy, char_tokenizer, monkeypatch, config):
    rows, episodes = played(tiny_policy, char_tokenizer)
    rows.estimator = build_estimator(config)
    rows.adv_N = episode_advantages(rows, episodes, Counter.max_turns, "mean", "crbc")
    rows.mask_seeds = [list(range(100, 100 + len(rows)))]
    seen, logits = [], type(tiny_policy).logits

    def spy(self, ids_BL, attention_mask_BL=None, cache=None):
        seen.append(ids_BL.clone())
        return logits(self, ids_BL, attention_mask_BL, cache)

    monkeypatch.setattr(type(tiny_policy), "logits", spy)
    with torch.no_grad():
        rows.score_all(tiny_policy, 0)
    P, mask_id = rows.prompt_length, tiny_policy.mask_id
    assert seen and all(ids.shape[1] >= P for ids in seen)
    assert not any(bool((ids[:, :P] == mask_id).any()) for ids in seen)
    assert any(bool((ids[:, P:] == mask_id).any()) for ids in seen)  # the windows are what is masked


def test_a_turn_rows_score_does_not_depend_on_the_turns_around_it(tiny_policy, char_tokenizer):
    rows, episodes = played(tiny_policy, char_tokenizer)
    seeds = {key: 1000 + 7 * n for n, key in enumerate(sorted(rows.keys))}
    rows.mask_seeds = [[seeds[key] for key in rows.keys]]
    with torch.no_grad():
        together = rows.score_all(tiny_policy, 0)
    for n in (0, len(rows) // 2, len(rows) - 1):
        rows.mask_seeds = []
        one = rows.select(torch.arange(len(rows)) == n)
        rows.mask_seeds = [[seeds[key] for key in rows.keys]]
        one.mask_seeds = [[seeds[one.keys[0]]]]
        with torch.no_grad():
            alone = one.score_all(tiny_policy, 0)
        assert torch.allclose(alone[0], together[n], atol=1e-5)


def test_turn_advantages_from_the_episodes(tiny_policy, char_tokenizer):
    rows, episodes = played(tiny_policy, char_tokenizer, temperature=2.0)
    grpo = episode_advantages(rows, episodes, Counter.max_turns, "mean", "grpo")
    returns = torch.tensor([ep.total for ep in episodes])
    adv_E = group_advantages(returns, torch.tensor([ep.prompt_id for ep in episodes]), "mean")
    index = {(ep.prompt_id, ep.rollout): e for e, ep in enumerate(episodes)}
    expected = [float(adv_E[index[q, split_key(k, Counter.max_turns)[0]]]) for q, k in rows.keys]
    assert grpo.tolist() == pytest.approx(expected)
    assert torch.equal(episode_advantages(rows, episodes, Counter.max_turns, "mean", "crbc", w_step=0.0), grpo)
    assert episode_advantages(rows, episodes, Counter.max_turns, "mean", "gigpo").shape == grpo.shape
