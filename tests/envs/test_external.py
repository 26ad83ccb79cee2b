"""ERILS in multi-turn runs (dllm_rl/envs/external.py): an external policy plays episodes of the dLLM's groups from
the same seeds; its turns are external rows keyed after the dLLM's episodes, its transitions join the group's
empirical MDP, and its episodes keep their own advantages."""

import contextlib

import pytest
import torch

from dllm_rl.algo.step_credit import Turn, shared_anchor_share, turn_advantages
from dllm_rl.collect import InProcessRollouts, StepBatch
from dllm_rl.data.task import Example
from dllm_rl.envs.episodes import Episode, episode_advantages, play_episodes, split_key, turn_prompt
from dllm_rl.envs.external import ExternalEpisodes, assign_turn_advantages
from dllm_rl.envs.task import EnvConfig, EnvTask
from dllm_rl.errors import ConfigError
from dllm_rl.external.mixer import build_mixer
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.rollout.generate import TextGenerator
from dllm_rl.train import train
from dllm_rl.train_config import TrainConfig
from tests.conftest import Counter, DigitPass, weights_checksum
from tests.envs.test_runs import COUNTER, OPTIONS, metrics_of

MEAN_FIELD = build_estimator({"name": "mean_field"})
G = 3  # the dLLM's episodes per group


def step_batch(tiny_policy, char_tokenizer, seeds=(7, 8), prompt_ids=(10, 11)) -> StepBatch:
    """A multi-turn step's batch as the collect stage leaves it: G episodes per seed played by a tiny dLLM."""
    generator = TextGenerator(tiny_policy, char_tokenizer, gen_length=8, block_length=8, steps=4, temperature=1.0)
    rollouts = InProcessRollouts(generator, MEAN_FIELD, seed=5, inference=contextlib.nullcontext)
    starts = [(b, q, s) for b, (q, s) in enumerate(zip(prompt_ids, seeds))]
    rows, episodes = play_episodes(rollouts, Counter, starts, G, step=2, pad_id=char_tokenizer.pad_token_id)
    examples = [Example("counter", f"seed{s}", "", "", {"seed": s}) for s in seeds]
    batch = StepBatch(2, examples, ["" for _ in seeds], list(prompt_ids), [G] * len(seeds))
    batch.rows["on_policy"], batch.episodes = rows, episodes
    return batch


def external_stage(tiny_policy, char_tokenizer, source=None, **mixing):
    mixer = build_mixer(source or {"name": "solver"}, {"per_prompt": 2, **mixing}, MEAN_FIELD)
    return ExternalEpisodes(mixer, EnvTask(EnvConfig(name=COUNTER)), char_tokenizer, G, window=8,
                            eos_id=tiny_policy.eos_id, max_length=tiny_policy.context_length, seed=3)


def test_the_solver_plays_each_group_from_its_seed_and_its_turns_become_keyed_external_rows(tiny_policy,
                                                                                           char_tokenizer):
    batch = step_batch(tiny_policy, char_tokenizer)
    external_stage(tiny_policy, char_tokenizer)(batch)
    ext, kept = batch.rows["external"], batch.external_episodes
    assert [(ep.prompt_id, ep.rollout) for ep in kept] == [(10, 3), (10, 4), (11, 3), (11, 4)]
    assert all(ep.success and ep.turns[0].anchor == batch.episodes[G * (ep.prompt_id - 10)].turns[0].anchor
               for ep in kept)  # from the group's own start
    assert len(ext) == sum(len(ep.turns) for ep in kept) and len(set(ext.keys)) == len(ext)
    assert not set(ext.keys) & set(batch.rows["on_policy"].keys)
    by_episode = {(ep.prompt_id, ep.rollout): ep for ep in kept}
    eos = tiny_policy.eos_id
    for n, (q, k) in enumerate(ext.keys):
        g, t = split_key(k, Counter.max_turns)
        ep = by_episode[q, g]
        context = ext.ids_NL[n, : ext.prompt_length][ext.attention_mask_NL[n, : ext.prompt_length] != 0]
        assert char_tokenizer.decode(context.tolist()) == turn_prompt("Reach 3.", ep.records[:t], ep.records[t][0])
        window = ext.ids_NL[n, ext.prompt_length:].tolist()
        assert window == char_tokenizer("up", add_special_tokens=False)["input_ids"] + [eos] * 6
        assert ext.texts[n] == "up" and ext.rewards[n].correct and ext.prompt_N[n] == q - 10
        assert ext.behaviour_logp_N[n] == 0.0 and ext.estimator.name == "elbo"
    m = batch.metrics
    assert (m["external/prompts"], m["external/candidates"], m["external/episodes"], m["external/rows"]) == \
        (2, 4, 4, len(ext))
    assert m["external/success"] == 1.0 and 0 < m["external/anchors_shared"] <= 1


def test_keep_candidates_and_the_trigger_act_on_episodes(tiny_policy, char_tokenizer):
    batch = step_batch(tiny_policy, char_tokenizer)
    external_stage(tiny_policy, char_tokenizer, per_prompt=1, candidates=3)(batch)
    assert [(ep.prompt_id, ep.rollout) for ep in batch.external_episodes] == [(10, 3), (11, 3)]
    assert batch.metrics["external/candidates"] == 6
    # all_failed fires only for groups whose own episodes all failed
    batch = step_batch(tiny_policy, char_tokenizer, prompt_ids=(14, 15))
    assert [any(ep.success for ep in batch.episodes if ep.batch_index == b) for b in (0, 1)] == [False, True]
    external_stage(tiny_policy, char_tokenizer, trigger="all_failed")(batch)
    assert {ep.prompt_id for ep in batch.external_episodes} == {14} and batch.metrics["external/prompts"] == 1


def test_a_causal_lm_plays_turn_by_turn_from_the_turn_prompts_with_each_turns_behaviour_logp(tiny_policy,
                                                                                                char_tokenizer):
    source = {"name": "causal_lm", "path": "models/tiny-ar", "max_new_tokens": 6, "device": "cpu"}
    played = []
    for _ in range(2):
        batch = step_batch(tiny_policy, char_tokenizer)
        stage = external_stage(tiny_policy, char_tokenizer, source=source, keep="all")
        asked, rollouts = [], stage.mixer.source.rollouts
        stage.mixer.source.rollouts = lambda task, examples, *a: asked.extend(ex.question for ex in examples) or \
            rollouts(task, examples, *a)
        stage(batch)
        ext = batch.rows["external"]
        played.append((ext.texts, ext.behaviour_logp_N.tolist()))
        for ep in batch.external_episodes:  # every turn asked with the prompt a dLLM turn has, history included
            assert all(turn_prompt("Reach 3.", ep.records[:t], seen) in asked for t, (seen, _) in enumerate(ep.records))
        assert all(-100 < lp < 0 for lp in played[-1][1]) and len(ext) == sum(len(ep.turns)
                                                                            for ep in batch.external_episodes)
    assert played[0] == played[1]  # seeded per (step, prompt, episode, turn)


def test_a_rank_without_groups_plays_no_external_episode_and_still_takes_part(tiny_policy, char_tokenizer):
    batch = StepBatch(2, [], [], [], [])
    stage = external_stage(tiny_policy, char_tokenizer, statistic="running")
    stage(batch)
    gathered = []
    assign_turn_advantages(batch, "mean", EnvTask(EnvConfig(name=COUNTER, credit="crbc")), stage.mixer,
                           gather=lambda t: gathered.append(t) or (t, 0))
    assert batch.rows == {} and batch.external_episodes == [] and batch.metrics["external/prompts"] == 0
    assert len(gathered) == 1 and gathered[0].numel() == 0  # the baseline's collective, with nothing of its own


def test_an_action_the_dllm_cannot_hold_drops_its_episode(tiny_policy, char_tokenizer):
    class Wordy:  # a text source: episode 3 of a group answers with a letter the dLLM cannot spell, episode 4
        name = "wordy"  # first goes down, then answers with more tokens than the window holds

        def rollouts(self, task, examples, count, seeds):
            texts = {"3/0": "\u00e9", "4/0": "down"}
            return [[Reply(texts.get(ex.uid.split("/", 1)[1], "u" * 9), -1.0)] for ex in examples]

    batch = step_batch(tiny_policy, char_tokenizer)
    stage = external_stage(tiny_policy, char_tokenizer, keep="all")
    stage.mixer.source = Wordy()
    stage(batch)
    assert "external" not in batch.rows and batch.external_episodes == []
    m = batch.metrics
    assert (m["external/unrepresentable"], m["external/too_long"], m["external/candidates"]) == (2, 2, 4)
    assert m["external/episodes"] == 0 == m["external/rows"]


class Reply:
    def __init__(self, text, behaviour_logp):
        self.text, self.behaviour_logp = text, behaviour_logp


def test_external_episodes_keep_their_own_advantages_and_join_the_closure(tiny_policy, char_tokenizer):
    mixing = {"statistic": "constant", "constant": 0.5}
    plain = step_batch(tiny_policy, char_tokenizer)
    own = episode_advantages(plain.rows["on_policy"], plain.episodes, Counter.max_turns, "mean", "grpo")
    for credit in ("grpo", "crbc"):
        batch = step_batch(tiny_policy, char_tokenizer)
        stage = external_stage(tiny_policy, char_tokenizer, **mixing)
        stage(batch)
        task = EnvTask(EnvConfig(name=COUNTER, credit=credit))
        assign_turn_advantages(batch, "mean", task, stage.mixer)
        on, ext = batch.rows["on_policy"], batch.rows["external"]
        if credit == "grpo":  # separate processing: the dLLM's advantages are what they are without ERILS
            assert torch.equal(on.adv_N, own)
            assert torch.equal(ext.adv_N, torch.full((len(ext),), 0.5))  # constant * the episode's return 1
        else:  # the credit of every turn over all the group's episodes, the external ones among them
            adv_E = {}
            for ep, a in zip(batch.episodes, own_episode_advantages(batch.episodes)):
                adv_E[ep.prompt_id, ep.rollout] = a
            adv_E |= {(ep.prompt_id, ep.rollout): 0.5 * ep.total for ep in batch.external_episodes}
            expected = {}
            for q in (10, 11):
                group = [ep for ep in batch.episodes + batch.external_episodes if ep.prompt_id == q]
                advs = turn_advantages([ep.turns for ep in group], [adv_E[q, ep.rollout] for ep in group], "crbc")
                expected |= {(q, ep.rollout, t): a for ep, per in zip(group, advs) for t, a in enumerate(per)}
            for rows in (on, ext):
                want = [expected[(q, *split_key(k, Counter.max_turns))] for q, k in rows.keys]
                assert rows.adv_N.tolist() == pytest.approx(want, abs=1e-6)
        assert ext.weight_N is not None and torch.equal(ext.weight_N, torch.ones(len(ext)))


def own_episode_advantages(episodes):
    from dllm_rl.algo.advantages import group_advantages
    returns = torch.tensor([ep.total for ep in episodes])
    groups = torch.tensor([ep.prompt_id for ep in episodes])
    return group_advantages(returns, groups, "mean").tolist()


def test_an_external_episode_opens_the_gate_of_an_anchor_the_dllm_left_with_one_action():
    # the dLLM's two episodes both went down at n=1 (one action there: no credit); the solver went up and won
    down = [Turn(1, "down", 0.0), Turn(0, "up", 0.0), Turn(1, "down", 0.0), Turn(0, "up", 0.0)]
    own = [down, list(down)]
    solver = [Turn(1, "up", 0.0), Turn(2, "up", 1.0)]
    assert shared_anchor_share(own) == 1.0 and shared_anchor_share(own + [solver]) == pytest.approx(2 / 3)
    assert shared_anchor_share([solver]) == 0.0 and shared_anchor_share([]) == 0.0
    alone = turn_advantages(own, [0.0, 0.0], "crbc")
    assert alone == [[0.0] * 4, [0.0] * 4]
    mixed = turn_advantages(own + [solver], [0.0, 0.0, 1.0], "crbc", w_episode=0.0)
    assert mixed[0][0] < 0 < mixed[2][0]  # at n=1 going down is now worse than the external policy's up
    assert mixed[0][1] == 0.0  # n=0 still saw one action


def test_a_multi_turn_erils_run_trains_on_both_sources(saved_model, tmp_path):
    run = tmp_path / "run"
    options = dict(OPTIONS, external={"name": "solver"}, mixing={"per_prompt": 1})
    train(DigitPass(), model=saved_model, run_dir=str(run), steps=2, env={"name": COUNTER, "credit": "crbc"},
          **options)
    lines = metrics_of(run)
    for m in lines[1:]:
        assert m["external/episodes"] == 2 and m["external/rows"] >= 2 and m["external/success"] == 1.0
        assert 0 < m["env/anchors_shared"] <= 1 and 0 < m["external/anchors_shared"] <= 1
    assert weights_checksum(run / "checkpoints" / "step_000002") != weights_checksum(saved_model)


def test_what_multi_turn_erils_refuses_is_named():
    env = {"name": "corridor"}
    with pytest.raises(ConfigError, match="env=corridor with external=.*JSONL file holds single-turn"):
        TrainConfig(env=env, external={"name": "jsonl", "path": "x.jsonl"})
    with pytest.raises(ConfigError, match="env=corridor with mixing=.*set mixing.length_rule=drop"):
        TrainConfig(env=env, mixing={"length_rule": "truncate"})
    assert TrainConfig(env=env).external["name"] == "solver"
    assert Episode(0, 0, 0, 0).dropped is None
