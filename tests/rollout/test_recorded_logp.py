"""The log-probabilities the denoising sampler records as it commits each token are the `ordered` estimator's
values for the rollout (JustGRPO's exact AR-order likelihood at blocks of one), so the trainer takes them as the
old policy's without scoring again: checked token for token, and counted at the model."""

import pytest
import torch

from dllm_rl.buffer import Rows
from dllm_rl.collect import StepBatch
from dllm_rl.likelihood.estimators import build_estimator, replays_rollout
from dllm_rl.rollout.sampler import denoise, left_pad
from dllm_rl.seeds import row_generators
from dllm_rl.stages import score_old_and_reference

PROMPTS = ("12+7=", "3*4-5=", "9=")  # three prompt lengths: the rows are left-padded differently


def rollouts(policy, char_tokenizer, **settings):
    ids, mask = left_pad([char_tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS],
                         char_tokenizer.pad_token_id)
    return denoise(policy, ids, mask, generators=row_generators([5, 6, 7]), **settings)


def rescored(policy, samples, name):
    estimator = build_estimator({"name": name, "group": 1})
    with torch.no_grad():
        return estimator.logp(policy, samples.sequences_BL, samples.attention_mask_BL, samples.prompt_length,
                              order_NC=samples.unmask_step_BC)


# (estimator, sampler settings): AR order at blocks of one (JustGRPO), LLaDA's semi-AR blocks, parallel decoding,
# at several temperatures (the record is the policy's temperature-1 probability whatever the sampler's)
CASES = [
    ("left_to_right", dict(gen_length=8, block_length=1, steps=8, temperature=1.0)),
    ("left_to_right", dict(gen_length=8, block_length=1, steps=8, temperature=0.6)),
    ("ordered", dict(gen_length=8, block_length=1, steps=8, temperature=0.0)),
    ("ordered", dict(gen_length=12, block_length=4, steps=6, temperature=1.0)),
    ("ordered", dict(gen_length=12, block_length=4, steps=12, temperature=0.7, remasking="random")),
    ("ordered", dict(gen_length=12, block_length=6, steps=4, temperature=1.0, threshold=0.3)),
    ("ordered", dict(gen_length=12, block_length=6, steps=4, temperature=1.0, random_first=True, factor=2.0)),
]


@pytest.mark.parametrize("name, settings", CASES)
def test_recorded_logp_equals_the_ordered_rescoring_token_for_token(tiny_policy, char_tokenizer, name, settings):
    samples = rollouts(tiny_policy, char_tokenizer, **settings)
    assert replays_rollout(build_estimator({"name": name, "group": 1}), settings)
    expected = rescored(tiny_policy, samples, name)
    assert samples.logp_BC.shape == expected.shape == (3, settings["gen_length"])
    assert (samples.logp_BC < 0).all()  # every token was committed, with a probability below 1
    torch.testing.assert_close(samples.logp_BC, expected, rtol=0, atol=2e-5)


def test_the_record_is_over_the_whole_vocabulary_not_the_commit_candidates(tiny_policy, char_tokenizer):
    """The confidence ranks the tokens the sampler may commit (the mask token excluded); the log-prob is the
    policy's over the whole vocabulary, as the estimators score it: they differ by log(1 - p(mask))."""
    samples = rollouts(tiny_policy, char_tokenizer, gen_length=8, block_length=1, steps=8, temperature=1.0)
    gap = samples.confidence_BC.double().log() - samples.logp_BC.double()
    assert (gap > 1e-4).all()  # a random model gives the mask token real mass


@pytest.mark.parametrize("name, settings, why", [
    ("ordered", dict(block_length=4, cache="dual"), "a stale block cache: not the policy's logits"),
    ("ordered", dict(block_length=4, cfg_scale=1.0), "guided logits are not the policy's"),
    ("left_to_right", dict(block_length=4), "blocks of 4 do not decode in position order"),
    ("mean_field", dict(block_length=1), "another likelihood"),
])
def test_what_the_record_cannot_stand_for(name, settings, why):
    estimator = build_estimator({"name": name, **({} if name == "mean_field" else {"group": 1})})
    assert not replays_rollout(estimator, {"gen_length": 8, "steps": 8, **settings}), why
    assert not replays_rollout(build_estimator({"name": "ordered", "group": 2}), {"block_length": 1})
    assert replays_rollout(build_estimator({"name": "ordered", "group": 1}), {"block_length": 4, "cache": "dual",
                                                                                "cache_refresh": 1})


def step_of(samples, char_tokenizer, estimator, step=3):
    rows = Rows("on_policy", samples.sequences_BL, samples.attention_mask_BL, samples.prompt_length,
                torch.ones_like(samples.unmask_step_BC, dtype=torch.float32), samples.unmask_step_BC,
                torch.arange(3), [], ["", "", ""], version=step, estimator=estimator, sampler_logp_NC=samples.logp_BC)
    return StepBatch(step=step, examples=[{}] * 3, prompt_texts=list(PROMPTS), prompt_ids=[0, 1, 2],
                     group_sizes=[1, 1, 1], rows={"on_policy": rows})


@pytest.mark.parametrize("name, settings", CASES[:1] + CASES[3:4])
def test_a_step_that_replays_the_record_makes_no_old_policy_forward(tiny_policy, char_tokenizer, name, settings,
                                                                    monkeypatch):
    samples = rollouts(tiny_policy, char_tokenizer, **settings)
    estimator = build_estimator({"name": name, "group": 1})
    calls = []
    logits = tiny_policy.logits
    monkeypatch.setattr(tiny_policy, "logits", lambda *a, **k: calls.append(1) or logits(*a, **k))

    def score(replay, version=3):
        calls.clear()
        batch = step_of(samples, char_tokenizer, estimator)
        batch.rows["on_policy"].version = version
        score_old_and_reference(batch, tiny_policy, None, iterations=2, reuse_current=False, seed=0,
                                autocast=torch.autocast("cpu", enabled=False), replay=replay)
        return batch.rows["on_policy"].old_logp, len(calls)

    replayed, replay_calls = score(replay=True)
    rescoring, rescore_calls = score(replay=False)
    assert replay_calls == 0
    assert rescore_calls == 2 * estimator.forwards(tiny_policy, samples.attention_mask_BL, samples.prompt_length,
                                                   samples.unmask_step_BC) > 0
    for old, again in zip(replayed, rescoring):
        torch.testing.assert_close(old, again, rtol=0, atol=2e-5)
    # rows another policy version made (a worker's, a step behind) are scored, not replayed
    _, stale_calls = score(replay=True, version=2)
    assert stale_calls == rescore_calls
